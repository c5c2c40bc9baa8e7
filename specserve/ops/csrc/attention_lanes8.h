/* Paged attention's inner kernels on 8-lane (32-byte) vectors, for builds without AVX-512; included by
 * paged_attention.c in place of its 16-lane qk_rows, pv_rows and softmax_chunk, with the same contracts. */

/* With AVX2 only, GCC lowers arithmetic on the 64-byte vf of a 16-key block to ymm pairs, but it spills a row
 * group's accumulators and builds each broadcast through the stack: on an AVX2 EPYC these kernels on 8 lanes
 * take attention from 3.3 to 1.5 ms a layer at 32 requests of 250 tokens, and from 0.69 to 0.11 ms at one
 * request verifying 9 tokens. Each lane's numbers are the same operations in the same order as with 16 lanes,
 * so both builds give the same bits. */
typedef float vh __attribute__((vector_size(32)));
typedef int32_t vhi __attribute__((vector_size(32)));
typedef uint16_t vhbf16 __attribute__((vector_size(16)));
typedef int8_t vhi8 __attribute__((vector_size(8)));

/* 8 consecutive stored elements (kv_format.h) as floats (int8: without the row's scale). */
static inline vh load_kv_half(const char *p, const int KV) {
    vh v;
    if (KV == KV_BF16) {
        vhbf16 h;
        memcpy(&h, p, sizeof h);
        return (vh)(__builtin_convertvector(h, vhi) << 16);
    }
    if (KV == KV_I8) {
        vhi8 c;
        memcpy(&c, p, sizeof c);
        return __builtin_convertvector(c, vh);
    }
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vh load_vh(const float *p) {
    vh v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Rows whose accumulators one pass holds: 3 rows of 4 chains (qk), 3 rows of 16 floats (pv). */
#define HALF_ROWS 3

/* Scores of `rows` rows for one block's 16 keys (stored [dim][16]): out[r * CHUNK_KEYS + t] =
 * sum_d qs[r * dim + d] * kb[d * 16 + t], summed in four chains (d mod 4) then (c0 + c1) + (c2 + c3); int8
 * keys times their group's scales ks[d / KV_GROUP] as they are loaded. Keys 0-7, then 8-15, three rows at a
 * time. */
static inline __attribute__((always_inline)) void qk_rows(const char *kb, const float *qs, float *out,
                                                          const int rows, const vf *ks, const int NC, const int KV) {
    const int dim = 16 * NC, esz = KV == KV_F32 ? 4 : KV == KV_BF16 ? 2 : 1;
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++)
#pragma GCC unroll 2
        for (int r0 = 0; r0 < rows; r0 += HALF_ROWS) {
            const int n = rows - r0 < HALF_ROWS ? rows - r0 : HALF_ROWS;
            vh a[HALF_ROWS][4];
#pragma GCC unroll 3
            for (int r = 0; r < n; r++)
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) a[r][j] = (vh){0};
#pragma GCC unroll 4
            for (int d = 0; d < dim; d += 4) {
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    vh kv = load_kv_half(kb + ((d + j) * 16 + 8 * half) * esz, KV);
                    if (KV == KV_I8) kv *= load_vh((const float *)&ks[(d + j) / KV_GROUP] + 8 * half);
#pragma GCC unroll 3
                    for (int r = 0; r < n; r++) a[r][j] += qs[(r0 + r) * dim + d + j] * kv;
                }
            }
#pragma GCC unroll 3
            for (int r = 0; r < n; r++) {
                const vh s = (a[r][0] + a[r][1]) + (a[r][2] + a[r][3]);
                memcpy(out + (r0 + r) * CHUNK_KEYS + 8 * half, &s, sizeof s);
            }
        }
}

/* acc[row] += sum over keys t in [t0, t1) of p[row][t] * v[t], t in order, one FMA per 8 floats per key:
 * rows at acc + row * acc_stride with their probabilities at p + row * CHUNK_KEYS; value t at
 * vb + t * token_bytes (int8: times its groups' scales as it is loaded). 16 floats of three rows at a time. */
static inline __attribute__((always_inline)) void pv_rows(const char *vb, int64_t token_bytes, const float *p,
                                                          float *acc, int64_t acc_stride, const int rows, int64_t t0,
                                                          int64_t t1, const int NC, const int KV) {
    const int esz = KV == KV_F32 ? 4 : KV == KV_BF16 ? 2 : 1;
    for (int c = 0; c < NC; c++)
#pragma GCC unroll 2
        for (int r0 = 0; r0 < rows; r0 += HALF_ROWS) {
            const int n = rows - r0 < HALF_ROWS ? rows - r0 : HALF_ROWS;
            vh a[HALF_ROWS][2];
#pragma GCC unroll 3
            for (int r = 0; r < n; r++) {
                a[r][0] = load_vh(acc + (r0 + r) * acc_stride + 16 * c);
                a[r][1] = load_vh(acc + (r0 + r) * acc_stride + 16 * c + 8);
            }
            for (int64_t t = t0; t < t1; t++) {
                const char *vt = vb + t * token_bytes + 16 * c * esz;
                vh v0 = load_kv_half(vt, KV), v1 = load_kv_half(vt + 8 * esz, KV);
                if (KV == KV_I8) {
                    float sg;
                    memcpy(&sg, vb + t * token_bytes + 16 * NC + KV_SCALE_BYTES * (16 * c / KV_GROUP), sizeof sg);
                    v0 *= sg;
                    v1 *= sg;
                }
#pragma GCC unroll 3
                for (int r = 0; r < n; r++) {
                    const float pr = p[(r0 + r) * CHUNK_KEYS + t];
                    a[r][0] += pr * v0;
                    a[r][1] += pr * v1;
                }
            }
#pragma GCC unroll 3
            for (int r = 0; r < n; r++) {
                memcpy(acc + (r0 + r) * acc_stride + 16 * c, &a[r][0], sizeof(vh));
                memcpy(acc + (r0 + r) * acc_stride + 16 * c + 8, &a[r][1], sizeof(vh));
            }
        }
}
static inline vh vmax_h(vh a, vh b) {
    const vhi gt = a > b;
    return (vh)((gt & (vhi)a) | (~gt & (vhi)b));
}

static inline vh exp_vh(vh x) { return EXP_LANES(x, vh, vhi, vmax_h); }

/* softmax_chunk of the AVX-512 build on 8-lane halves: each block's keys 0-7 and 8-15 as two vectors, max and
 * sum folded across them first (hmax's and hsum's first step), then within 8 lanes as there. */
static inline void softmax_chunk(float *sr, int64_t nb, float *ml) {
    vh lo = load_vh(sr), hi = load_vh(sr + 8);
    for (int64_t b = 1; b < nb; b++) {
        lo = vmax_h(lo, load_vh(sr + 16 * b));
        hi = vmax_h(hi, load_vh(sr + 16 * b + 8));
    }
    vh v = vmax_h(lo, hi);
    v = vmax_h(v, __builtin_shuffle(v, (vhi){4, 5, 6, 7, 0, 1, 2, 3}));
    v = vmax_h(v, __builtin_shuffle(v, (vhi){2, 3, 0, 1, 6, 7, 4, 5}));
    v = vmax_h(v, __builtin_shuffle(v, (vhi){1, 0, 3, 2, 5, 4, 7, 6}));
    const float m = v[0];
    ml[0] = m;
    if (m == -INFINITY) { /* sees none of these keys */
        ml[1] = 0.0f;
        return;
    }
    vh slo = (vh){0}, shi = (vh){0};
    for (int64_t b = 0; b < nb; b++) {
        const vh plo = exp_vh(load_vh(sr + 16 * b) - m), phi = exp_vh(load_vh(sr + 16 * b + 8) - m);
        slo += plo;
        shi += phi;
        memcpy(sr + 16 * b, &plo, sizeof plo);
        memcpy(sr + 16 * b + 8, &phi, sizeof phi);
    }
    v = slo + shi;
    v += __builtin_shuffle(v, (vhi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vhi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vhi){1, 0, 3, 2, 5, 4, 7, 6});
    ml[1] = v[0];
}
