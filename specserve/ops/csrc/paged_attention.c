/* Paged attention straight from the block pool, for queries of any length (decode, 1 + k
 * verification, prefill chunks).
 *
 * The PyTorch path gathers every request's blocks into a padded [B, L, Hkv, D] copy per layer and
 * then runs SDPA over it: the KV bytes cross memory three times, and at 32 requests of ~300 tokens
 * that copy alone took as long as SDPA. Here each (request, kv head) pair reads its blocks once, in
 * place, with an online softmax, for all the query heads that share that kv head and all of the
 * request's query tokens at once.
 *
 * Each output row depends only on its own request's query, keys and values: the same numbers
 * whatever else is in the batch, however long its query and however many threads run (the vector path
 * takes every row's keys in the same fixed chunks, see below; the scalar path has one thread per row).
 *
 * Layouts (contiguous; q and out fp32, the caches stored as kv_dtype: fp32, bf16 or int8, kv_format.h):
 *   q            [num_tokens, num_heads, head_dim]
 *   out          [num_tokens, num_heads * head_dim]   (rows of the listed requests are written)
 *   k cache      [num_blocks, num_kv_heads, row, block_size]: each block's keys transposed, so the
 *                16 keys of a block are one vector per dimension (see partial_tile_vec, pass 1)
 *   v cache      [num_blocks, block_size, num_kv_heads, row]
 *                (row = head_dim, or for int8 head_dim + 4 per 16 numbers: the numbers, then their
 *                scales' bytes)
 *   block_table  [num_seqs, table_width] int64
 *   query_start, query_len, context_len  [num_seqs] int64
 * Query j of request s sits at absolute position p = context_len - query_len + j and attends to keys
 * 0 ..= p, or with a sliding window w > 0 to keys p - w + 1 ..= p (the last w, itself included). Blocks
 * wholly before a request's first query's window are never read: the cache manager may have freed them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_format.h"
#include "specserve_math.h"

/* Without AVX-512 each 64-byte vector below is a pair of 32-byte halves, and GCC 12's RTL global CSE passes
 * take minutes on the unrolled kernels (load CSE after reload ~110 s, PRE ~50 s of a ~190 s compile on an
 * AVX2 EPYC); without them the file compiles in ~20 s and attention's times stay within 3% (either way). */
#ifndef __AVX512F__
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#endif

#define MAX_STACK_ROWS 48
#define MAX_HEAD_DIM 128

/* The first key a query at absolute position `pos` sees: 0, or pos - window + 1 with a window. */
static inline int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* Block `block`'s keys ([head_dim][block_size]) and values (block_size rows of head_dim, vstride floats apart)
 * of kv head kvh as floats: in the cache itself for fp32, else decoded into kbuf and vbuf. */
static void block_floats(const void *k_cache, const void *v_cache, int64_t kv, int64_t block, int64_t kvh,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float *kbuf, float *vbuf,
                         const float **kb, const float **vb, int64_t *vstride) {
    const int64_t row = kv_row_elems(head_dim, kv), esz = kv_elem_bytes(kv);
    const int64_t token_stride = num_kv_heads * row, block_stride = block_size * token_stride;
    const char *kp = (const char *)k_cache + (block * block_stride + kvh * row * block_size) * esz;
    const char *vp = (const char *)v_cache + (block * block_stride + kvh * row) * esz;
    if (kv == KV_F32) {
        *kb = (const float *)kp, *vb = (const float *)vp, *vstride = token_stride;
        return;
    }
    for (int64_t t = 0; t < block_size; t++) {
        kv_decode_row(vbuf, kp + t * esz, head_dim, block_size, kv); /* slot t's key, then transposed */
        for (int64_t d = 0; d < head_dim; d++) kbuf[d * block_size + t] = vbuf[d];
    }
    for (int64_t t = 0; t < block_size; t++)
        kv_decode_row(vbuf + t * head_dim, vp + t * token_stride * esz, head_dim, 1, kv);
    *kb = kbuf, *vb = vbuf, *vstride = head_dim;
}

/* work: rows * (head_dim + 2) floats, then for a cache not in fp32 2 * head_dim * block_size more. */
static void attend_one(const float *q, float *out, const void *k_cache, const void *v_cache, int64_t kv,
                       const int64_t *table, int64_t q_start, int64_t q_len, int64_t c_len,
                       int64_t kvh, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, int64_t window, float *work) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t rows = group * q_len;
    const int64_t first_pos = c_len - q_len;
    /* work: acc[rows][head_dim], m[rows], l[rows], then the decoded block */
    float *acc = work, *m = work + rows * head_dim, *l = m + rows;
    float *kbuf = l + rows, *vbuf = kbuf + head_dim * block_size;
    float scores[block_size];
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    const int64_t num_blocks = (c_len + block_size - 1) / block_size;
    for (int64_t b = window_start(first_pos, window) / block_size; b < num_blocks; b++) {
        const float *kb, *vb; /* [head_dim][block_size], [block_size][token_stride] */
        int64_t token_stride;
        block_floats(k_cache, v_cache, kv, table[b], kvh, num_kv_heads, head_dim, block_size, kbuf, vbuf, &kb, &vb,
                     &token_stride);
        const int64_t base = b * block_size;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t g = r / q_len, j = r % q_len;
            int64_t n = first_pos + j + 1 - base; /* keys of this block row r may see */
            if (n <= 0) continue;
            if (n > block_size) n = block_size;
            int64_t t0 = window_start(first_pos + j, window) - base; /* and the first it sees */
            if (t0 < 0) t0 = 0;
            if (t0 >= n) continue;
            const float *qr = q + ((q_start + j) * num_heads + kvh * group + g) * head_dim;
            float mb = -INFINITY;
            for (int64_t t = t0; t < n; t++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; d++) s += qr[d] * kb[d * block_size + t];
                s *= scale;
                scores[t] = s;
                mb = s > mb ? s : mb;
            }
            const float m_new = mb > m[r] ? mb : m[r];
            float *ar = acc + r * head_dim;
            if (m[r] != m_new && l[r] != 0.0f) {
                const float alpha = exp_nonpositive(m[r] - m_new);
                l[r] *= alpha;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ar[d] *= alpha;
            }
            m[r] = m_new;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = t0; t < n; t++) {
                scores[t] = exp_nonpositive(scores[t] - m_new);
                sum += scores[t];
            }
            l[r] += sum;
            for (int64_t t = t0; t < n; t++) {
                const float p = scores[t];
                const float *vt = vb + t * token_stride;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ar[d] += p * vt[d];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r / q_len, j = r % q_len;
        float *o = out + ((q_start + j) * num_heads + kvh * group + g) * head_dim;
        const float inv = 1.0f / l[r];
        const float *ar = acc + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] = ar[d] * inv;
    }
}

/* ---- Vector path: block_size 16, head_dim = 16 * NC (NC <= 8, or 16); one (request, head) pair per work item --
 * GCC vector extensions (zmm on AVX-512; without it the hot kernels run on ymm halves, attention_lanes8.h). A
 * block's 16 keys are stored dimension by dimension, so a row's 16 scores accumulate as one vector (a broadcast
 * query element times one key vector per dimension) and max, exp and sum run on whole vectors. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef uint16_t vbf16 __attribute__((vector_size(32)));
typedef int8_t vi8 __attribute__((vector_size(16)));
typedef unsigned char vbytes __attribute__((vector_size(64)));

/* 16 consecutive stored elements (kv_format.h) as floats (int8: without the row's scale). */
static inline vf load_kv(const char *p, const int KV) {
    if (KV == KV_BF16) {
        vbf16 h;
        memcpy(&h, p, sizeof h);
        return (vf)(__builtin_convertvector(h, vi) << 16);
    }
    if (KV == KV_I8) {
        vi8 c;
        memcpy(&c, p, sizeof c);
        return __builtin_convertvector(c, vf);
    }
    return load_vf((const float *)p);
}

/* An int8 key block's 16 scales of one group, from the 64 bytes at p: byte j of slot t's scale is p[16 * j + t]. */
static inline vf key_scales(const char *p) {
    vbytes b;
    memcpy(&b, p, sizeof b);
    const vbytes order = {0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    return (vf)__builtin_shuffle(b, order);
}

/* exp_nonpositive on x, a vector of float lanes V with int lanes VI (VMAX their lane max), for both vector
 * widths (attention_lanes8.h's too); lanes below -87 (and -inf) give exactly 0. */
#define EXP_LANES(x, V, VI, VMAX)                                                                       \
    ({                                                                                                   \
        const VI keep_ = (x) >= -87.0f;                                                                  \
        const V x_ = VMAX((x), (V){0} - 87.0f);                                                          \
        const VI ni_ = __builtin_convertvector(x_ * 1.44269504088896341f - 0.5f, VI); /* x <= 0: rounds */ \
        const V n_ = __builtin_convertvector(ni_, V);                                                    \
        const V r_ = x_ - n_ * 0.693359375f + n_ * 2.12194440e-4f;                                       \
        V p_ = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                                 \
        p_ = p_ * r_ + 8.3334519073e-3f;                                                                 \
        p_ = p_ * r_ + 4.1665795894e-2f;                                                                 \
        p_ = p_ * r_ + 1.6666665459e-1f;                                                                 \
        p_ = p_ * r_ + 5.0000001201e-1f;                                                                 \
        p_ = p_ * r_ * r_ + r_ + 1.0f;                                                                   \
        (V)((VI)(p_ * (V)((ni_ + 127) << 23)) & keep_);                                                  \
    })

/* ---- Keys in chunks ----
 * A row's keys are taken in fixed chunks of CHUNK_BLOCKS blocks (128 keys): each chunk gives a partial
 * (running max m, sum l, unnormalized accumulator) from a fresh start, and the partials are folded in
 * chunk order. The chunk edges are absolute key positions, so a row gets the same numbers whether its
 * chunks run one after another in one thread (many requests, long queries) or side by side on all
 * threads (one or two requests decoding or verifying: the context is then split over the threads, so
 * every core streams keys and values, instead of each core walking one kv head's blocks alone). */
#define CHUNK_BLOCKS 8

/* Start loading a cache line into L1 (to_l1) or L2 (__builtin_prefetch's locality must be a constant). */
static inline void prefetch_line(const void *p, int to_l1) {
    if (to_l1)
        __builtin_prefetch(p, 0, 3);
    else
        __builtin_prefetch(p, 0, 2);
}

/* Start loading bytes [h0, h1) of each of a value block's 16 tokens (its kv heads in use). */
static inline void prefetch_values(const char *block, int64_t token_bytes, int64_t h0, int64_t h1, int to_l1) {
    for (int t = 0; t < 16; t++)
        for (int64_t c = h0; c < h1; c += 64) prefetch_line(block + t * token_bytes + c, to_l1);
}

/* The same for a key block, whose kv heads' rows are contiguous ([kv head][row][16 keys]: 16 times the bytes). */
static inline void prefetch_keys(const char *block, int64_t h0, int64_t h1, int to_l1) {
    for (int64_t c = 16 * h0; c < 16 * h1; c += 64) prefetch_line(block + c, to_l1);
}

#define CHUNK_KEYS (16 * CHUNK_BLOCKS)
#define TILE_ROWS 32 /* rows whose scores for one chunk are held at once (TILE_ROWS * CHUNK_KEYS floats) */
/* Rows sharing each load of a key or value vector: their accumulators (4 vectors a row) stay in registers,
 * and each vector loaded feeds up to GROUP_ROWS rows' FMAs, so the rows of a kv head (its query heads, each
 * token of a verification step) read each key and value once per group rather than once per row. */
#define GROUP_ROWS 6

/* Rows sharing each value vector in pass 3: their accumulators, NC vectors a row, fit the registers. */
#define PV_GROUP_ROWS(NC) ((NC) <= 4 ? GROUP_ROWS : (NC) <= 8 ? GROUP_ROWS / 2 : 1)

/* CALL(rows) with rows = n (1..GROUP_ROWS) as a compile-time constant, so the accumulators stay in registers. */
#define FOR_GROUP_SIZE(n, CALL)      \
    switch (n) {                     \
        case 6: CALL(6); break;      \
        case 5: CALL(5); break;      \
        case 4: CALL(4); break;      \
        case 3: CALL(3); break;      \
        case 2: CALL(2); break;      \
        default: CALL(1); break;     \
    }

/* The kernels on 16 lanes, one zmm each with AVX-512; other builds take attention_lanes8.h's on 8 lanes. */
#ifdef __AVX512F__
/* Scores of `rows` rows for one block's 16 keys (stored [dim][16]): out[r * CHUNK_KEYS + t] =
 * sum_d qs[r * dim + d] * kb[d * 16 + t], summed in four chains (d mod 4) then (c0 + c1) + (c2 + c3); int8
 * keys times their group's scales ks[d / KV_GROUP] as they are loaded. */
static inline __attribute__((always_inline)) void qk_rows(const char *kb, const float *qs, float *out,
                                                          const int rows, const vf *ks, const int NC, const int KV) {
    const int dim = 16 * NC, esz = KV == KV_F32 ? 4 : KV == KV_BF16 ? 2 : 1;
    vf a[GROUP_ROWS][4];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) a[r][j] = (vf){0};
#pragma GCC unroll 4
    for (int d = 0; d < dim; d += 4) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            vf kv = load_kv(kb + (d + j) * 16 * esz, KV);
            if (KV == KV_I8) kv *= ks[(d + j) / KV_GROUP];
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) a[r][j] += qs[r * dim + d + j] * kv;
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        const vf s = (a[r][0] + a[r][1]) + (a[r][2] + a[r][3]);
        memcpy(out + r * CHUNK_KEYS, &s, sizeof s);
    }
}

/* acc[row] += sum over keys t in [t0, t1) of p[row][t] * v[t], t in order, one FMA per 16 floats per key:
 * rows at acc + row * acc_stride with their probabilities at p + row * CHUNK_KEYS; value t at
 * vb + t * token_bytes (int8: times its groups' scales as it is loaded). */
static inline __attribute__((always_inline)) void pv_rows(const char *vb, int64_t token_bytes, const float *p,
                                                          float *acc, int64_t acc_stride, const int rows, int64_t t0,
                                                          int64_t t1, const int NC, const int KV) {
    const int esz = KV == KV_F32 ? 4 : KV == KV_BF16 ? 2 : 1;
    vf a[GROUP_ROWS * 16];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) a[r * NC + c] = load_vf(acc + r * acc_stride + 16 * c);
    for (int64_t t = t0; t < t1; t++) {
        const char *vt = vb + t * token_bytes;
        vf v[16];
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) {
            v[c] = load_kv(vt + 16 * c * esz, KV);
            if (KV == KV_I8) {
                float sg;
                memcpy(&sg, vt + 16 * NC + KV_SCALE_BYTES * (16 * c / KV_GROUP), sizeof sg);
                v[c] *= sg;
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const float pr = p[r * CHUNK_KEYS + t];
#pragma GCC unroll 16
            for (int c = 0; c < NC; c++) a[r * NC + c] += pr * v[c];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 16
        for (int c = 0; c < NC; c++) memcpy(acc + r * acc_stride + 16 * c, &a[r * NC + c], sizeof(vf));
}

static inline vf vmax(vf a, vf b) {
    const vi gt = a > b;
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

static inline float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

static inline float hmax(vf v) {
    v = vmax(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    v = vmax(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    v = vmax(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return v[0];
}

static inline vf exp_vf(vf x) { return EXP_LANES(x, vf, vi, vmax); }

/* One row's scores over nb blocks (sr[16 * nb]) -> exp(score - m), with ml[0] = m, their max, and ml[1] = l,
 * the sum of the exps (0 when the row sees none of these keys: every score -inf). */
static inline void softmax_chunk(float *sr, int64_t nb, float *ml) {
    vf mx = load_vf(sr);
    for (int64_t b = 1; b < nb; b++) mx = vmax(mx, load_vf(sr + 16 * b));
    const float m = hmax(mx);
    ml[0] = m;
    if (m == -INFINITY) { /* sees none of these keys */
        ml[1] = 0.0f;
        return;
    }
    vf lsum = (vf){0};
    for (int64_t b = 0; b < nb; b++) {
        const vf p = exp_vf(load_vf(sr + 16 * b) - m); /* exactly 0 where the score is -inf */
        lsum += p;
        memcpy(sr + 16 * b, &p, sizeof p);
    }
    ml[1] = hsum(lsum);
}
#else
#include "attention_lanes8.h"
#endif

/* Partial attention of rows r0..r1-1 (r1 - r0 <= TILE_ROWS) of one request over the keys of blocks
 * [b0, b1) (one chunk), each row from a fresh start, into st (row r at st + (r - r0) * (dim + 2)). Row r is
 * query head r / q_len at query token r % q_len; callers pass rows of one kv head. Three passes over the
 * chunk, each with the rows as the inner loop, so a block's keys or values come from memory once and from
 * L1 for the other rows, and the rows' dependency chains (dot products, max, exp, sums) are independent
 * of each other and overlap in the core: 1. every row's scores for every key, 2. per row the max over
 * the chunk, exp and the sum, 3. the probability-weighted values. A row that sees none of these keys is
 * left with l = 0. Caches stored as KV (kv_format.h): bf16 and int8 numbers become floats in registers, int8
 * ones times their group's scale as they are loaded. */
static inline __attribute__((always_inline)) void partial_tile_vec(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t q_start,
        int64_t q_len, int64_t c_len, int64_t r0, int64_t r1, int64_t b0, int64_t b1,
        int64_t num_heads, int64_t num_kv_heads, float scale, int64_t window, float *st, float *sc, const int NC,
        const int KV) {
    const int64_t dim = 16 * NC, stride = dim + 2, group = num_heads / num_kv_heads;
    const int64_t row_bytes = kv_row_elems(dim, KV) * kv_elem_bytes(KV);
    const int64_t token_bytes = num_kv_heads * row_bytes, block_bytes = 16 * token_bytes;
    const char *k_bytes = k_cache, *v_bytes = v_cache;
    const vf lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vf neg_inf = (vf){0} - INFINITY;
    if (b1 > (c_len + 15) / 16) b1 = (c_len + 15) / 16;
    /* Blocks before every row's window hold only masked keys (exact zeros in every sum below): skipped. */
    int64_t first_block = b1;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t fb = window_start(c_len - q_len + r % q_len, window) / 16;
        first_block = fb < first_block ? fb : first_block;
    }
    if (b0 < first_block) b0 = first_block;
    if (b0 >= b1) { /* no row sees any of these keys */
        for (int64_t r = r0; r < r1; r++) {
            memset(st + (r - r0) * stride, 0, sizeof(float) * dim);
            st[(r - r0) * stride + dim] = -INFINITY;
            st[(r - r0) * stride + dim + 1] = 0.0f;
        }
        return;
    }
    /* the kv heads' bytes within a token */
    const int64_t h0 = r0 / q_len / group * row_bytes, h1 = ((r1 - 1) / q_len / group + 1) * row_bytes;
    /* The whole chunk's keys and values of these kv heads into L2 first, rather than only one block ahead:
     * once requests have come and gone a request's blocks lie scattered over the pool, and reading scattered
     * blocks one at a time is 30-50% slower than reading consecutive ones. Prefetching the chunk takes
     * 15-20% off the kernel's time at 1-9 query rows with scattered blocks, ~5% with consecutive ones
     * (2 threads, 1000-token context, 30 layers of caches). */
    for (int64_t b = b0; b < b1; b++) {
        prefetch_keys(k_bytes + table[b] * block_bytes, h0, h1, 0);
        prefetch_values(v_bytes + table[b] * block_bytes, token_bytes, h0, h1, 0);
    }
    /* Per row, once: the keys it sees, its query, its kv head's byte offset within a token (no integer
     * divisions in the block loops: 3-4% of the kernel's time) */
    int64_t lim[TILE_ROWS], low[TILE_ROWS], qoff[TILE_ROWS], hoff[TILE_ROWS];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t h = r / q_len, j = r % q_len;
        lim[r - r0] = c_len - q_len + j + 1;
        low[r - r0] = window_start(c_len - q_len + j, window);
        qoff[r - r0] = ((q_start + j) * num_heads + h) * dim;
        hoff[r - r0] = h / group * row_bytes;
    }
    /* 1. scores: sc[(r - r0) * CHUNK_KEYS + (b - b0) * 16 + t], -inf past the row's position: a row's 16
     * scores are sum_d q[d] * (the block's keys' dimension d), for groups of rows sharing each key vector's
     * load (the rows are of one kv head; rows that see none of the block's keys are masked like the rest). */
    float qs[TILE_ROWS * 16 * 16]; /* the rows' queries times the scale */
    for (int64_t r = r0; r < r1; r++)
        for (int64_t d = 0; d < dim; d++) qs[(r - r0) * dim + d] = q[qoff[r - r0] + d] * scale;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = b * 16;
        if (b + 1 < b1) prefetch_keys(k_bytes + table[b + 1] * block_bytes, h0, h1, 1);
        const char *kb = k_bytes + table[b] * block_bytes + 16 * hoff[0];
        vf ks[MAX_HEAD_DIM / KV_GROUP]; /* int8: each group's 16 key scales */
        if (KV == KV_I8)
            for (int64_t g = 0; g < kv_groups(dim); g++)
                ks[g] = key_scales(kb + 16 * (dim + KV_SCALE_BYTES * g));
        for (int64_t g0 = r0; g0 < r1; g0 += GROUP_ROWS) {
            const int64_t g1 = g0 + GROUP_ROWS < r1 ? g0 + GROUP_ROWS : r1;
            float *sg = sc + (g0 - r0) * CHUNK_KEYS + (b - b0) * 16;
            const float *qg = qs + (g0 - r0) * dim;
#define QK_ROWS(rows) qk_rows(kb, qg, sg, rows, ks, NC, KV)
            FOR_GROUP_SIZE(g1 - g0, QK_ROWS);
#undef QK_ROWS
            for (int64_t r = g0; r < g1; r++) {
                const int64_t n = lim[r - r0] - base, before = low[r - r0] - base;
                if (n >= 16 && before <= 0) continue;
                float *sr = sc + (r - r0) * CHUNK_KEYS + (b - b0) * 16;
                vf s = load_vf(sr);
                const vi beyond = (lane >= (float)n) | (lane < (float)before);
                s = (vf)(((vi)s & ~beyond) | ((vi)neg_inf & beyond));
                memcpy(sr, &s, sizeof s);
            }
        }
    }
    /* 2. per row: m = the max over the chunk, scores -> exp(score - m), l = their sum */
    const int64_t nb = b1 - b0;
    for (int64_t r = r0; r < r1; r++) {
        float *sr = sc + (r - r0) * CHUNK_KEYS, *ar = st + (r - r0) * stride;
        memset(ar, 0, sizeof(float) * dim);
        softmax_chunk(sr, nb, ar + dim);
    }
    /* 3. acc += p * v, key by key in order, one FMA chain per 16 floats of a row: rows in groups that
     * share each value vector's load, over the keys every row of the group sees; then each row alone over
     * the rest of its keys (same order, so the same numbers as a row alone). */
    /* accumulators: at most 24 vectors (a 256-wide row alone takes 16) */
    const int group_rows = PV_GROUP_ROWS(NC);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = b * 16;
        if (b + 1 < b1) prefetch_values(v_bytes + table[b + 1] * block_bytes, token_bytes, h0, h1, 1);
        const float *ps = sc + (b - b0) * 16;
        for (int64_t g0 = r0; g0 < r1; g0 += group_rows) {
            const int64_t g1 = g0 + group_rows < r1 ? g0 + group_rows : r1;
            const char *vb = v_bytes + table[b] * block_bytes + hoff[g0 - r0];
            int64_t common = 16;
            for (int64_t r = g0; r < g1; r++) {
                const int64_t n = lim[r - r0] - base;
                common = n < common ? n : common;
            }
            if (common < 0) common = 0;
            float *ag = st + (g0 - r0) * stride;
            const float *pg = ps + (g0 - r0) * CHUNK_KEYS;
#define PV_ROWS(rows) \
    if ((rows) <= PV_GROUP_ROWS(NC)) pv_rows(vb, token_bytes, pg, ag, stride, rows, 0, common, NC, KV)
            FOR_GROUP_SIZE(g1 - g0, PV_ROWS);
#undef PV_ROWS
            for (int64_t r = g0; r < g1; r++) {
                int64_t n = lim[r - r0] - base;
                n = n < 16 ? n : 16;
                if (n > common)
                    pv_rows(vb, token_bytes, ps + (r - r0) * CHUNK_KEYS, st + (r - r0) * stride, stride, 1, common,
                            n, NC, KV);
            }
        }
    }
}

#define PARTIAL_VEC(NC_, KV_)                                                                                \
    partial_tile_vec(q, k_cache, v_cache, table, q_start, q_len, c_len, t0, t1, b0, b1, num_heads,        \
                     num_kv_heads, scale, window, st + (t0 - r0) * (head_dim + 2), scores, NC_, KV_)

/* partial_tile_vec over rows r0..r1-1 in tiles. One compiled copy (noinline) serves both ways of running
 * the chunks, so they agree to the bit. */
/* Each head_dim of the vector path for fp32 caches; bf16 and int8 ones (each copy adds ~10 s to the build on
 * an AVX2 host) take it at the usual head_dims only (vector_path_dim), the others the scalar path. */
#define PARTIAL_DIMS_F32                         \
    switch (head_dim / 16) {                     \
        case 1: PARTIAL_VEC(1, KV_F32); break;   \
        case 2: PARTIAL_VEC(2, KV_F32); break;   \
        case 3: PARTIAL_VEC(3, KV_F32); break;   \
        case 4: PARTIAL_VEC(4, KV_F32); break;   \
        case 5: PARTIAL_VEC(5, KV_F32); break;   \
        case 6: PARTIAL_VEC(6, KV_F32); break;   \
        case 7: PARTIAL_VEC(7, KV_F32); break;   \
        case 8: PARTIAL_VEC(8, KV_F32); break;   \
        default: PARTIAL_VEC(16, KV_F32); break; \
    }
#define PARTIAL_DIMS(KV_)                    \
    switch (head_dim / 16) {                 \
        case 1: PARTIAL_VEC(1, KV_); break;  \
        case 2: PARTIAL_VEC(2, KV_); break;  \
        case 4: PARTIAL_VEC(4, KV_); break;  \
        default: PARTIAL_VEC(8, KV_); break; \
    }

/* Whether the vector path takes this head_dim (block_size 16) for caches stored as kv. */
static int vector_path_dim(int64_t head_dim, int64_t kv) {
    if (head_dim % 16) return 0;
    if (kv == KV_F32) return head_dim <= 128 || head_dim == 256;
    return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
}

static __attribute__((noinline)) void partial_rows(const float *q, const void *k_cache, const void *v_cache,
                                                   int64_t kv, const int64_t *table, int64_t q_start, int64_t q_len,
                                                   int64_t c_len, int64_t r0, int64_t r1, int64_t b0,
                                                   int64_t b1, int64_t num_heads, int64_t num_kv_heads,
                                                   int64_t head_dim, float scale, int64_t window, float *st) {
    float scores[TILE_ROWS * CHUNK_KEYS];
    for (int64_t t0 = r0; t0 < r1; t0 += TILE_ROWS) {
        const int64_t t1 = t0 + TILE_ROWS < r1 ? t0 + TILE_ROWS : r1;
        if (kv == KV_BF16)
            PARTIAL_DIMS(KV_BF16)
        else if (kv == KV_I8)
            PARTIAL_DIMS(KV_I8)
        else
            PARTIAL_DIMS_F32
    }
}

/* Per-row state, `dim + 2` floats: the accumulator, then m and l; init: no keys seen. */
static void init_state(float *st, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        st[r * (dim + 2) + dim] = -INFINITY;
        st[r * (dim + 2) + dim + 1] = 0.0f;
    }
}

/* run = the fold of run and part (a partial over later keys); rows of `dim + 2` floats. */
static __attribute__((noinline)) void fold_rows(float *run, const float *part, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++, run += dim + 2, part += dim + 2) {
        const float mp = part[dim], lp = part[dim + 1];
        if (lp == 0.0f) continue; /* saw no keys */
        if (run[dim + 1] == 0.0f) {
            memcpy(run, part, sizeof(float) * (dim + 2));
            continue;
        }
        const float m = run[dim] > mp ? run[dim] : mp;
        const float a = exp_nonpositive(run[dim] - m), b = exp_nonpositive(mp - m);
        for (int64_t d = 0; d < dim; d++) run[d] = run[d] * a + part[d] * b;
        run[dim] = m;
        run[dim + 1] = run[dim + 1] * a + lp * b;
    }
}

/* Rows r0..r1-1 of the state back into `out` as acc / l. */
static __attribute__((noinline)) void write_rows(float *out, const float *st, int64_t q_start, int64_t q_len,
                                                 int64_t r0, int64_t r1, int64_t num_heads, int64_t dim) {
    for (int64_t r = r0; r < r1; r++) {
        float *o = out + ((q_start + r % q_len) * num_heads + r / q_len) * dim;
        const float *sr = st + (r - r0) * (dim + 2);
        const float inv = 1.0f / sr[dim + 1];
        for (int64_t d = 0; d < dim; d++) o[d] = sr[d] * inv;
    }
}

static int64_t num_chunks(int64_t c_len) { return (c_len + 16 * CHUNK_BLOCKS - 1) / (16 * CHUNK_BLOCKS); }

/* The first chunk any of a request's query rows reads (0 without a window). */
static int64_t first_chunk(int64_t c_len, int64_t q_len, int64_t window) {
    return window_start(c_len - q_len, window) / (16 * CHUNK_BLOCKS);
}

/* Chunks one after another: rows r0..r1-1 of one request (see partial_tile_vec). work: 2 * rows * (dim + 2). */
static void attend_rows_chunked(const float *q, float *out, const void *k_cache, const void *v_cache,
                                int64_t kv, const int64_t *table, int64_t q_start, int64_t q_len, int64_t c_len, int64_t r0,
                                int64_t r1, int64_t num_heads, int64_t num_kv_heads, int64_t dim, float scale,
                                int64_t window, float *work) {
    const int64_t rows = r1 - r0, nblocks = (c_len + 15) / 16;
    float *run = work, *part = work + rows * (dim + 2);
    init_state(run, rows, dim);
    for (int64_t b0 = first_chunk(c_len, q_len, window) * CHUNK_BLOCKS; b0 < nblocks; b0 += CHUNK_BLOCKS) {
        partial_rows(q, k_cache, v_cache, kv, table, q_start, q_len, c_len, r0, r1, b0, b0 + CHUNK_BLOCKS, num_heads,
                     num_kv_heads, dim, scale, window, part);
        fold_rows(run, part, rows, dim);
    }
    write_rows(out, run, q_start, q_len, r0, r1, num_heads, dim);
}

/* Chunks side by side, for a few short queries: each (request, chunk, kv head) is a work item over that kv
 * head's rows, writing its partials to a scratch buffer; then each request folds them in chunk order. */
static int attend_split(const float *q, float *out, const void *k_cache, const void *v_cache, int64_t kv,
                        const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *context_len, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t dim, float scale, int64_t window) {
    const int64_t stride = dim + 2, group = num_heads / num_kv_heads;
    /* item i: (seq item_seq[i], chunk item_chunk[i]); its partials start at scratch + item_off[i], kv head by
     * kv head */
    int64_t items = 0, floats = 0;
#define SEQ_CHUNKS(s) (num_chunks(context_len[s]) - first_chunk(context_len[s], query_len[s], window))
    for (int64_t s = 0; s < num_seqs; s++) items += SEQ_CHUNKS(s);
    int64_t *meta = malloc(sizeof(int64_t) * (3 * items + num_seqs + 1));
    if (!meta) return 1;
    int64_t *item_seq = meta, *item_chunk = meta + items, *item_off = meta + 2 * items, *first = meta + 3 * items;
    for (int64_t s = 0, i = 0; s < num_seqs; s++) {
        first[s] = i;
        for (int64_t c = 0; c < SEQ_CHUNKS(s); c++, i++) {
            item_seq[i] = s;
            item_chunk[i] = first_chunk(context_len[s], query_len[s], window) + c;
            item_off[i] = floats;
            floats += num_heads * query_len[s] * stride;
        }
    }
    float *scratch = malloc(sizeof(float) * (floats ? floats : 1));
    if (!scratch) {
        free(meta);
        return 1;
    }
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items * num_kv_heads; it++) {
            const int64_t i = it / num_kv_heads, kvh = it % num_kv_heads;
            const int64_t s = item_seq[i], b0 = item_chunk[i] * CHUNK_BLOCKS, rows = group * query_len[s];
            partial_rows(q, k_cache, v_cache, kv, block_table + s * table_width, query_start[s], query_len[s],
                         context_len[s], kvh * rows, (kvh + 1) * rows, b0, b0 + CHUNK_BLOCKS, num_heads,
                         num_kv_heads, dim, scale, window, scratch + item_off[i] + kvh * rows * stride);
        }
#pragma omp for schedule(static)
        for (int64_t s = 0; s < num_seqs; s++) {
            const int64_t rows = num_heads * query_len[s];
            float *run = scratch + item_off[first[s]]; /* folds into chunk 0's partials */
            for (int64_t c = 1; c < SEQ_CHUNKS(s); c++)
                fold_rows(run, scratch + item_off[first[s] + c], rows, dim);
            write_rows(out, run, query_start[s], query_len[s], 0, rows, num_heads, dim);
        }
    }
    free(scratch);
    free(meta);
    return 0;
#undef SEQ_CHUNKS
}

/* Whether to split the context over the threads: short queries (decode, verification) from too few
 * requests to give every thread two (request, kv head) pairs. With fewer pairs some thread idles for part
 * of the step (SmolLM2's 3 kv heads on 2 threads: one request gives one thread two pairs, the other one),
 * and splitting each pair's context evens the threads out; with more, the pairs keep the threads about
 * equally busy and folding the split's partial results is only overhead. */
static int use_split(const int64_t *query_len, int64_t num_seqs, int64_t num_kv_heads) {
    if (num_seqs * num_kv_heads >= 2 * omp_get_max_threads()) return 0;
    for (int64_t s = 0; s < num_seqs; s++)
        if (query_len[s] > 16) return 0;
    return 1;
}

/* Returns 0 on success, 1 when a work buffer could not be allocated. */
int paged_attention_f32(const float *q, float *out, const void *k_cache, const void *v_cache,
                        const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *context_len, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale, int64_t window, int64_t kv_dtype) {
    const int vector_path = block_size == 16 && vector_path_dim(head_dim, kv_dtype);
    if (vector_path && use_split(query_len, num_seqs, num_kv_heads))
        return attend_split(q, out, k_cache, v_cache, kv_dtype, block_table, table_width, query_start, query_len,
                            context_len, num_seqs, num_heads, num_kv_heads, head_dim, scale, window);
    const int64_t group = num_heads / num_kv_heads;
    /* Few (request, kv head) pairs, as with a long prefill: split each pair's rows so every thread works
     * (the split pairs read their keys and values once per part). */
    int64_t parts = 1;
    if (vector_path) {
        const int64_t threads = omp_get_max_threads();
        while (num_seqs * num_kv_heads * parts < 2 * threads && parts < group) parts++;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t it = 0; it < num_seqs * num_kv_heads * parts; it++) {
        const int64_t part = it % parts, pair = it / parts;
        const int64_t s = pair / num_kv_heads, kvh = pair % num_kv_heads;
        const int64_t rows = group * query_len[s];
        const int64_t r0 = rows * part / parts, r1 = rows * (part + 1) / parts;
        const int64_t need = (vector_path ? 2 : 1) * (r1 - r0) * (head_dim + 2) +
                             (vector_path || kv_dtype == KV_F32 ? 0 : 2 * head_dim * block_size);
        float stack_work[MAX_STACK_ROWS * (MAX_HEAD_DIM + 2)];
        float *work = stack_work;
        if (need > MAX_STACK_ROWS * (MAX_HEAD_DIM + 2)) {
            work = malloc(sizeof(float) * need);
            if (!work) {
                failed = 1;
                continue;
            }
        }
        if (vector_path)
            attend_rows_chunked(q, out, k_cache, v_cache, kv_dtype, block_table + s * table_width, query_start[s],
                                query_len[s], context_len[s], kvh * rows + r0, kvh * rows + r1, num_heads,
                                num_kv_heads, head_dim, scale, window, work);
        else
            attend_one(q, out, k_cache, v_cache, kv_dtype, block_table + s * table_width, query_start[s], query_len[s],
                       context_len[s], kvh, num_heads, num_kv_heads, head_dim, block_size, scale, window, work);
        if (work != stack_work) free(work);
    }
    return failed;
}
