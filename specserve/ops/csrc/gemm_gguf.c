/* y = x @ W^T (+ bias) with W kept in GGUF's quantized form: the same outputs, bit for bit, as gemm_packed_f32
 * on the dequantized fp32 weight, reading a fifth to a third of its bytes.
 *
 * Every supported GGUF block type dequantizes to w = a * q + b, with q a small integer and a, b fp32 per
 * output column and group of G consecutive k's: Q4_0 (a = d, b = -8d, q in 0..15), Q4_1 (a = d, b = m),
 * Q8_0 (a = d, b = -0, q int8), Q4_K / Q5_K (a = d * scale, b = -dmin * min, q in 0..15 / 0..31), Q6_K (a =
 * d * scale, b = -0, q - 32 in -32..31, G = 16). In each, a * q is exact in fp32 (at most 24 significant bits),
 * so a * q + b rounds once whether or not the compiler fuses it: w is exactly the load-time dequantizer's
 * value (and b = -0 keeps the sign of a zero product). The GEMM then takes the same k steps as
 * gemm_packed_f32 (gemm_common.h), so each output is the same FMA chain over the same fp32 values. The
 * int8-activation formats (WEIGHT_Q4_I8, WEIGHT_Q4_Q8: gemm_q4_i8.c; WEIGHT_Q8_I8, WEIGHT_Q8_Q8: gemm_q8_i8.c)
 * hold the same values reordered, for GEMMs that quantize x.
 *
 * Packed layout (WEIGHT_Q4, WEIGHT_Q8): for each block of 32 output columns, K / G group records, each
 * a[32] and b[32] (fp32) then G rows of the 32 columns' q: 16 bytes (Q4: byte j holds column j in its low
 * nibble and column j + 16 in its high one) or 32 bytes (Q8: int8); a k-quant's records may come in
 * super-blocks with int8 scales instead (gemm_common.h's group_record: the same a and b). Columns past N are
 * zero. WEIGHT_F16:
 * gemm_packed_f32's layout, [ceil(N / 32)][K][32], in IEEE half precision.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gemm_common.h"
#include "specserve_kernels.h"


/* Whether `format` multiplies int8-quantized activations (gemm_q4_i8.c, gemm_q8_i8.c). */
static inline int int8_activations(int64_t format) {
    return format == WEIGHT_Q4_I8 || format == WEIGHT_Q4_Q8 || format == WEIGHT_Q8_I8 || format == WEIGHT_Q8_Q8;
}

/* Bytes of q in a record of `group` k's. */
static inline int64_t q_bytes(int64_t format, int64_t group) {
    const int eight = format == WEIGHT_Q8 || format == WEIGHT_Q8_I8 || format == WEIGHT_Q8_Q8;
    return group * (eight ? 32 : 16);
}


/* The 32 weights of one k row of a Q4 record, w = q * a + b: the low nibbles are columns 0-15, the high ones
 * 16-31. */
static inline __attribute__((always_inline)) void dequant_q4(const uint8_t *p, const vf a[NV], const vf b[NV],
                                                             vf w[NV]) {
#if defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    memcpy(&w[0], &lo, sizeof w[0]);
    memcpy(&w[1], &hi, sizeof w[1]);
#elif defined(__AVX2__)
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        memcpy(&w[h], &lo, sizeof w[h]);
        memcpy(&w[2 + h], &hi, sizeof w[2 + h]);
    }
#else
    for (int j = 0; j < NV; j++)
        for (int i = 0; i < VLEN; i++) {
            const int c = j * VLEN + i;
            w[j][i] = (float)(c < 16 ? p[c] & 15 : p[c - 16] >> 4);
        }
#endif
    for (int j = 0; j < NV; j++) w[j] = w[j] * a[j] + b[j];
}

static inline __attribute__((always_inline)) void dequant_q8(const uint8_t *p, const vf a[NV], const vf b[NV],
                                                             vf w[NV]) {
    for (int j = 0; j < NV; j++) w[j] = widen((const int8_t *)p + j * VLEN) * a[j] + b[j];
}

/* VLEN halves -> VLEN floats (exact). */
static inline __attribute__((always_inline)) vf widen_f16(const uint16_t *p) {
    vf r;
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&r, &f, sizeof r);
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&r, &f, sizeof r);
#else
    for (int i = 0; i < VLEN; i++) r[i] = half_to_float(p[i]);
#endif
    return r;
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

static inline __attribute__((always_inline)) void load_record_scales(const float *ab, vf a[NV], vf b[NV]) {
    load_block(a, ab);
    load_block(b, ab + BLOCK);
}

/* One block of 32 columns for `rows` rows: group records of G k steps, `qbytes` bytes of q per k step, plain or
 * in super-blocks of `supers` groups (gemm_common.h's group_record). */
static inline __attribute__((always_inline)) void block_rows_q(const uint8_t *restrict w, const float *restrict x,
                                                               int64_t K, float *restrict y, int64_t N,
                                                               int64_t ncols, const float *bias, const int rows,
                                                               const int qbytes, const int G, const int supers) {
    vf acc[MAX_ROWS][NV];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
    const int64_t ng = K / G, stride = records_bytes(ng, (int64_t)G * qbytes, supers) / ng; /* bytes a group */
    float made[2 * BLOCK];
    for (int64_t g = 0; g < ng; g++) {
        const float *ab;
        const uint8_t *q = group_record(w, g, (int64_t)G * qbytes, supers, made, &ab);
        __builtin_prefetch(w + (g + 1) * stride + PREFETCH);
        vf a[NV], b[NV];
        load_record_scales(ab, a, b);
        for (int kk = 0; kk < G; kk++) {
            vf wv[NV];
            if (qbytes == 16) {
                if ((kk & 3) == 0) __builtin_prefetch(q + kk * 16 + PREFETCH);
                dequant_q4(q + kk * 16, a, b, wv);
            } else {
                if ((kk & 1) == 0) __builtin_prefetch(q + kk * 32 + PREFETCH);
                dequant_q8(q + kk * 32, a, b, wv);
            }
            accumulate(acc, x + g * G + kk, K, wv, rows);
        }
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

static inline __attribute__((always_inline)) void block_rows_f16(const uint16_t *restrict w,
                                                                 const float *restrict x, int64_t K,
                                                                 float *restrict y, int64_t N, int64_t ncols,
                                                                 const float *bias, const int rows) {
    vf acc[MAX_ROWS][NV];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(w + k * BLOCK + PREFETCH);
        vf wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = widen_f16(w + k * BLOCK + j * VLEN);
        accumulate(acc, x + k, K, wv, rows);
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

/* One format and group size with compile-time constants, so each keeps its accumulators in registers. */
#define DEFINE_GEMM_Q(NAME, QBYTES, G)                                                                       \
    static void NAME(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, \
                     int64_t N, int supers) {                                                               \
        const int64_t nblocks = (N + BLOCK - 1) / BLOCK, block_bytes = records_bytes(K / (G), (G) * (QBYTES), supers); \
        _Pragma("omp parallel for schedule(static) if (M * K * N >= (1 << 18))")                           \
        for (int64_t b = 0; b < nblocks; b++) {                                                             \
            const uint8_t *w = packed + b * block_bytes;                                                    \
            const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;                       \
            const float *bb = bias ? bias + col : NULL;                                                     \
            int64_t m;                                                                                      \
            FOR_ROW_CHUNKS(M, m, CALL_Q)                                                                    \
        }                                                                                                   \
    }
#define CALL_Q(rows) block_rows_q(w, x + m * K, K, y + m * N + col, N, ncols, bb, rows, CUR_QBYTES, CUR_G, supers)

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
        case WEIGHT_Q8: {
            const int64_t G = RECORD_GROUP(w->group);
            const int supers = RECORD_SUPERS(w->group);
            if ((G != 16 && G != 32) || (supers & (supers - 1)) || (supers && (K / G) % supers)) return 1;
            const int q4 = w->format == WEIGHT_Q4;
            if (G == 32) (q4 ? gemm_q4_g32 : gemm_q8_g32)(x, w->data, bias, y, M, K, N, supers);
            else (q4 ? gemm_q4_g16 : gemm_q8_g16)(x, w->data, bias, y, M, K, N, supers);
            return 0;
        }
        case WEIGHT_Q4_I8:
        case WEIGHT_Q4_Q8:
            if (RECORD_GROUP(w->group) != 32) return 1;
            return gemm_q4_i8(x, w->data, bias, y, M, K, N, w->format == WEIGHT_Q4_I8 ? 2 : 1, RECORD_SUPERS(w->group));
        case WEIGHT_Q8_I8: return gemm_q8_i8(x, w->data, bias, y, M, K, N, w->group, 2);
        case WEIGHT_Q8_Q8: return gemm_q8_i8(x, w->data, bias, y, M, K, N, w->group, 1);
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
 * dequantization and fused multiply-adds over the vector of the block holding n, lane n % VLEN kept. */
float weight_column(const float *x, const weight_t *w, int64_t K, int64_t n) {
    if (int8_activations(w->format)) return NAN; /* its GEMM quantizes x: no fp32 column to reproduce */
    const int64_t b = n / BLOCK, j = (n % BLOCK) / VLEN;
    vf acc = {0};
    if (w->format == WEIGHT_F32 || w->format == WEIGHT_F16) {
        for (int64_t k = 0; k < K; k++) {
            const int64_t at = (b * K + k) * BLOCK + j * VLEN;
            vf wv;
            if (w->format == WEIGHT_F32)
                memcpy(&wv, (const float *)w->data + at, sizeof wv);
            else
                wv = widen_f16((const uint16_t *)w->data + at);
            acc = fma_vf((vf){0} + x[k], wv, acc);
        }
        return acc[n % VLEN];
    }
    const int64_t G = RECORD_GROUP(w->group), QB = q_bytes(w->format, G);
    const int supers = RECORD_SUPERS(w->group);
    const uint8_t *block = (const uint8_t *)w->data + b * records_bytes(K / G, QB, supers);
    for (int64_t g = 0; g < K / G; g++) {
        float made[2 * BLOCK];
        const float *ab;
        const uint8_t *q = group_record(block, g, QB, supers, made, &ab);
        vf a[NV], s[NV];
        load_record_scales(ab, a, s);
        for (int64_t kk = 0; kk < G; kk++) {
            vf wv[NV];
            if (w->format == WEIGHT_Q4)
                dequant_q4(q + kk * 16, a, s, wv);
            else
                dequant_q8(q + kk * 32, a, s, wv);
            acc = fma_vf((vf){0} + x[g * G + kk], wv[j], acc);
        }
    }
    return acc[n % VLEN];
}

/* The q of column j at k = kk of a group's q bytes in `format`. The int8-activation formats keep the bytes of
 * each 4 k's grouped per column (gemm_q4_i8.c, gemm_q8_i8.c): Q4_I8 and Q4_Q8 the same nibbles, Q8_I8 and Q8_Q8
 * each q as q + 128. */
static inline float stored_q(int64_t format, const uint8_t *q, int64_t kk, int64_t j) {
    switch (format) {
        case WEIGHT_Q8: return (float)(int8_t)q[kk * 32 + j];
        case WEIGHT_Q8_I8:
        case WEIGHT_Q8_Q8: return (float)((int)q[(kk >> 2) * 128 + 4 * j + (kk & 3)] - 128);
        case WEIGHT_Q4: return (float)(j < 16 ? q[kk * 16 + j] & 15 : q[kk * 16 + j - 16] >> 4);
        default: {
            const uint8_t byte = q[(kk >> 2) * 64 + 4 * (j & 15) + (kk & 3)];
            return (float)(j < 16 ? byte & 15 : byte >> 4);
        }
    }
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
        const int64_t G = RECORD_GROUP(w->group), QB = q_bytes(w->format, G);
        const int supers = RECORD_SUPERS(w->group);
        const uint8_t *block = (const uint8_t *)w->data + b * records_bytes(K / G, QB, supers);
        for (int64_t g = 0; g < K / G; g++) {
            float made[2 * BLOCK];
            const float *ab;
            const uint8_t *q = group_record(block, g, QB, supers, made, &ab);
            const float a = ab[j], s = ab[BLOCK + j];
            /* a * q is exact: one rounding, fused or not */
            for (int64_t kk = 0; kk < G; kk++) row[g * G + kk] = stored_q(w->format, q, kk, j) * a + s;
        }
    }
}

void weight_rows_f32(const void *data, int64_t format, int64_t group, int64_t K, const int64_t *ids, int64_t count,
                     float *out) {
    const weight_t w = {data, format, group};
    weight_rows(&w, K, ids, count, out);
}
