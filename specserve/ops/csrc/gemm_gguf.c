/* y = x @ W^T (+ bias) with W kept in GGUF's quantized form: the same outputs, bit for bit, as gemm_packed_f32
 * on the dequantized fp32 weight, reading a fifth to a third of its bytes.
 *
 * Every supported GGUF block type dequantizes to w = a * q + b, with q a small integer and a, b fp32 per
 * output column and group of G consecutive k's: Q4_0 (a = d, b = -8d, q in 0..15), Q4_1 (a = d, b = m),
 * Q8_0 (a = d, b = -0, q int8), Q4_K / Q5_K (a = d * scale, b = -dmin * min, q in 0..15 / 0..31), Q6_K (a =
 * d * scale, b = -0, q - 32 in -32..31, G = 16). In each, a * q is exact in fp32 (at most 24 significant bits),
 * so a * q + b rounds once whether or not the compiler fuses it: w is exactly the load-time dequantizer's
 * value (and b = -0 keeps the sign of a zero product). The GEMM then takes the same k steps as
 * gemm_packed_f32 (gemm_common.h), so each output is the same FMA chain over the same fp32 values.
 *
 * Packed layout (WEIGHT_Q4, WEIGHT_Q8): for each block of 32 output columns, K / G group records, each
 * a[32] and b[32] (fp32) then G rows of the 32 columns' q: 16 bytes (Q4: byte j holds column j in its low
 * nibble and column j + 16 in its high one) or 32 bytes (Q8: int8). Columns past N are zero. WEIGHT_F16:
 * gemm_packed_f32's layout, [ceil(N / 32)][K][32], in IEEE half precision.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gemm_common.h"
#include "specserve_kernels.h"

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

#define RECORD_HEADER (2 * BLOCK * (int64_t)sizeof(float)) /* a[32], b[32] */

static inline int64_t record_bytes(int64_t format, int64_t group) {
    return RECORD_HEADER + group * (format == WEIGHT_Q8 ? 32 : 16);
}

/* The 32 weights of one k row of a Q4 record: the low nibbles are columns 0-15, the high ones 16-31. */
static inline __attribute__((always_inline)) void dequant_q4(const uint8_t *p, v16 a0, v16 a1, v16 b0, v16 b1,
                                                             v16 *w0, v16 *w1) {
#if defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    v16 l, h;
    memcpy(&l, &lo, sizeof l);
    memcpy(&h, &hi, sizeof h);
#else
    u8x16 q;
    memcpy(&q, p, sizeof q);
    const i32x16 v = __builtin_convertvector(q, i32x16);
    const v16 l = __builtin_convertvector(v & 15, v16), h = __builtin_convertvector(v >> 4, v16);
#endif
    *w0 = l * a0 + b0;
    *w1 = h * a1 + b1;
}

static inline __attribute__((always_inline)) void dequant_q8(const uint8_t *p, v16 a0, v16 a1, v16 b0, v16 b1,
                                                             v16 *w0, v16 *w1) {
    *w0 = widen((const int8_t *)p) * a0 + b0;
    *w1 = widen((const int8_t *)p + 16) * a1 + b1;
}

/* 16 halves -> 16 floats (exact). */
static inline __attribute__((always_inline)) v16 widen_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    v16 r;
    memcpy(&r, &f, sizeof r);
    return r;
#else
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = half_to_float(p[i]);
    return r;
#endif
}

float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float magnitude;
    if (exponent == 31)
        magnitude = mantissa ? NAN : INFINITY;
    else if (exponent == 0)
        magnitude = ldexpf((float)mantissa, -24); /* subnormal */
    else
        magnitude = ldexpf((float)(mantissa | 1024), (int)exponent - 25);
    uint32_t bits;
    memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

static inline __attribute__((always_inline)) void load_record_scales(const uint8_t *rec, v16 *a0, v16 *a1, v16 *b0,
                                                                     v16 *b1) {
    memcpy(a0, rec, sizeof *a0);
    memcpy(a1, rec + 64, sizeof *a1);
    memcpy(b0, rec + 128, sizeof *b0);
    memcpy(b1, rec + 192, sizeof *b1);
}

/* One block of 32 columns for `rows` rows: group records of G k steps, `qbytes` bytes of q per k step. */
static inline __attribute__((always_inline)) void block_rows_q(const uint8_t *restrict w, const float *restrict x,
                                                               int64_t K, float *restrict y, int64_t N,
                                                               int64_t ncols, const float *bias, const int rows,
                                                               const int qbytes, const int G) {
    v16 acc[MAX_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v16){0};
    const int64_t R = RECORD_HEADER + (int64_t)G * qbytes;
    for (int64_t g = 0; g < K / G; g++) {
        const uint8_t *rec = w + g * R, *q = rec + RECORD_HEADER;
        __builtin_prefetch(rec + R + PREFETCH);
        v16 a0, a1, b0, b1;
        load_record_scales(rec, &a0, &a1, &b0, &b1);
        for (int kk = 0; kk < G; kk++) {
            v16 w0, w1;
            if (qbytes == 16) {
                if ((kk & 3) == 0) __builtin_prefetch(q + kk * 16 + PREFETCH);
                dequant_q4(q + kk * 16, a0, a1, b0, b1, &w0, &w1);
            } else {
                if ((kk & 1) == 0) __builtin_prefetch(q + kk * 32 + PREFETCH);
                dequant_q8(q + kk * 32, a0, a1, b0, b1, &w0, &w1);
            }
            accumulate(acc, x + g * G + kk, K, w0, w1, rows);
        }
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

static inline __attribute__((always_inline)) void block_rows_f16(const uint16_t *restrict w,
                                                                 const float *restrict x, int64_t K,
                                                                 float *restrict y, int64_t N, int64_t ncols,
                                                                 const float *bias, const int rows) {
    v16 acc[MAX_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v16){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(w + k * BLOCK + PREFETCH);
        accumulate(acc, x + k, K, widen_f16(w + k * BLOCK), widen_f16(w + k * BLOCK + 16), rows);
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

/* One format and group size with compile-time constants, so each keeps its accumulators in registers. */
#define DEFINE_GEMM_Q(NAME, QBYTES, G)                                                                       \
    static void NAME(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, \
                     int64_t N) {                                                                           \
        const int64_t nblocks = (N + BLOCK - 1) / BLOCK, block_bytes = K / (G) * (RECORD_HEADER + (G) * (QBYTES)); \
        _Pragma("omp parallel for schedule(static) if (M * K * N >= (1 << 18))")                           \
        for (int64_t b = 0; b < nblocks; b++) {                                                             \
            const uint8_t *w = packed + b * block_bytes;                                                    \
            const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;                       \
            const float *bb = bias ? bias + col : NULL;                                                     \
            int64_t m;                                                                                      \
            FOR_ROW_CHUNKS(M, m, CALL_Q)                                                                    \
        }                                                                                                   \
    }
#define CALL_Q(rows) block_rows_q(w, x + m * K, K, y + m * N + col, N, ncols, bb, rows, CUR_QBYTES, CUR_G)

#define CUR_QBYTES 16
#define CUR_G 32
DEFINE_GEMM_Q(gemm_q4_g32, 16, 32)
#undef CUR_G
#define CUR_G 16
DEFINE_GEMM_Q(gemm_q4_g16, 16, 16)
#undef CUR_G
#undef CUR_QBYTES
#define CUR_QBYTES 32
#define CUR_G 32
DEFINE_GEMM_Q(gemm_q8_g32, 32, 32)
#undef CUR_G
#define CUR_G 16
DEFINE_GEMM_Q(gemm_q8_g16, 32, 16)
#undef CUR_G
#undef CUR_QBYTES
#undef CALL_Q

static void gemm_f16(const float *x, const uint16_t *packed, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N) {
    const int64_t nblocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (M * K * N >= (1 << 18))
    for (int64_t b = 0; b < nblocks; b++) {
        const uint16_t *w = packed + b * K * BLOCK;
        const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
        const float *bb = bias ? bias + col : NULL;
        int64_t m;
#define CALL_F16(rows) block_rows_f16(w, x + m * K, K, y + m * N + col, N, ncols, bb, rows)
        FOR_ROW_CHUNKS(M, m, CALL_F16)
#undef CALL_F16
    }
}

/* x: [M, K]; w: a packed weight of any format (K a multiple of its group); bias: [N] or NULL; y: [M, N].
 * Returns 0, or 1 for an unknown format or group. */
int gemm_weight(const float *x, const weight_t *w, const float *bias, float *y, int64_t M, int64_t K, int64_t N) {
    switch (w->format) {
        case WEIGHT_F32: gemm_packed_f32(x, (const float *)w->data, bias, y, M, K, N); return 0;
        case WEIGHT_F16: gemm_f16(x, (const uint16_t *)w->data, bias, y, M, K, N); return 0;
        case WEIGHT_Q4:
            if (w->group == 32) return gemm_q4_g32(x, w->data, bias, y, M, K, N), 0;
            if (w->group == 16) return gemm_q4_g16(x, w->data, bias, y, M, K, N), 0;
            return 1;
        case WEIGHT_Q8:
            if (w->group == 32) return gemm_q8_g32(x, w->data, bias, y, M, K, N), 0;
            if (w->group == 16) return gemm_q8_g16(x, w->data, bias, y, M, K, N), 0;
            return 1;
        case WEIGHT_Q4_I8: return w->group == 32 ? gemm_q4_i8(x, w->data, bias, y, M, K, N, 2) : 1;
        case WEIGHT_Q4_Q8: return w->group == 32 ? gemm_q4_i8(x, w->data, bias, y, M, K, N, 1) : 1;
        default: return 1;
    }
}

/* Python's entry (ctypes): the weight's fields as arguments. */
int gemm_weight_f32(const float *x, const void *data, int64_t format, int64_t group, const float *bias, float *y,
                    int64_t M, int64_t K, int64_t N) {
    const weight_t w = {data, format, group};
    return gemm_weight(x, &w, bias, y, M, K, N);
}

/* Output column n of gemm_weight (no bias) for one row, computed exactly as the GEMM computes it: the same
 * 16-lane vector expression over the half-block holding n (so the compiler contracts it into the same fused
 * multiply-adds), lane n % 16 kept. */
float weight_column(const float *x, const weight_t *w, int64_t K, int64_t n) {
    if (w->format == WEIGHT_Q4_I8 || w->format == WEIGHT_Q4_Q8)
        return NAN; /* its GEMM quantizes x: no fp32 column to reproduce */
    const int64_t b = n / BLOCK, half = (n % BLOCK) / 16;
    v16 acc = {0};
    if (w->format == WEIGHT_F32 || w->format == WEIGHT_F16) {
        for (int64_t k = 0; k < K; k++) {
            const int64_t at = (b * K + k) * BLOCK + half * 16;
            v16 wv;
            if (w->format == WEIGHT_F32)
                memcpy(&wv, (const float *)w->data + at, sizeof wv);
            else
                wv = widen_f16((const uint16_t *)w->data + at);
            acc += x[k] * wv;
        }
        return acc[n % 16];
    }
    const int64_t G = w->group, R = record_bytes(w->format, G);
    const uint8_t *block = (const uint8_t *)w->data + b * (K / G) * R;
    for (int64_t g = 0; g < K / G; g++) {
        const uint8_t *rec = block + g * R;
        v16 a[2], s[2];
        load_record_scales(rec, &a[0], &a[1], &s[0], &s[1]);
        for (int64_t kk = 0; kk < G; kk++) {
            v16 w0, w1;
            if (w->format == WEIGHT_Q4)
                dequant_q4(rec + RECORD_HEADER + kk * 16, a[0], a[1], s[0], s[1], &w0, &w1);
            else
                dequant_q8(rec + RECORD_HEADER + kk * 32, a[0], a[1], s[0], s[1], &w0, &w1);
            acc += x[g * G + kk] * (half ? w1 : w0);
        }
    }
    return acc[n % 16];
}

/* out [count, K]: rows ids[i] of the dequantized weight W [N, K] (an embedding lookup, or the whole weight
 * with ids = 0..N-1), exactly the values the GEMM multiplies by. */
void weight_rows(const weight_t *w, int64_t K, const int64_t *ids, int64_t count, float *out) {
#pragma omp parallel for schedule(static) if (count * K >= (1 << 16))
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids[i], b = n / BLOCK, j = n % BLOCK;
        float *row = out + i * K;
        if (w->format == WEIGHT_F32 || w->format == WEIGHT_F16) {
            for (int64_t k = 0; k < K; k++) {
                const int64_t at = (b * K + k) * BLOCK + j;
                row[k] = w->format == WEIGHT_F32 ? ((const float *)w->data)[at]
                                                 : half_to_float(((const uint16_t *)w->data)[at]);
            }
            continue;
        }
        const int64_t G = w->group, R = record_bytes(w->format, G);
        const uint8_t *block = (const uint8_t *)w->data + b * (K / G) * R;
        for (int64_t g = 0; g < K / G; g++) {
            const uint8_t *rec = block + g * R, *q = rec + RECORD_HEADER;
            float a, s;
            memcpy(&a, rec + 4 * j, sizeof a);
            memcpy(&s, rec + 128 + 4 * j, sizeof s);
            for (int64_t kk = 0; kk < G; kk++) {
                /* Q4_I8 and Q4_Q8 keep the same nibbles, the bytes of each 4 k's grouped per column (gemm_q4_i8.c) */
                const int quads = w->format == WEIGHT_Q4_I8 || w->format == WEIGHT_Q4_Q8;
                const int64_t at = quads ? (kk >> 2) * 64 + 4 * (j & 15) + (kk & 3) : kk * 16 + (j & 15);
                const float v = w->format == WEIGHT_Q8 ? (float)(int8_t)q[kk * 32 + j]
                                                       : (float)(j < 16 ? q[at] & 15 : q[at] >> 4);
                row[g * G + kk] = v * a + s; /* a * v is exact: one rounding, fused or not */
            }
        }
    }
}

void weight_rows_f32(const void *data, int64_t format, int64_t group, int64_t K, const int64_t *ids, int64_t count,
                     float *out) {
    const weight_t w = {data, format, group};
    weight_rows(&w, K, ids, count, out);
}
