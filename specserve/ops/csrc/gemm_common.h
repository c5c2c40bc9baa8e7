/* What the packed GEMMs share (gemm.c, gemm_gguf.c): the block width, the row chunks and the one k step
 * every kernel takes, so that fp32, int8 and GGUF-block weights accumulate each output in the same FMA chain. */
#ifndef SPECSERVE_GEMM_COMMON_H
#define SPECSERVE_GEMM_COMMON_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
/* Rows sharing each weight load: 12 rows keep 24 accumulators + 2 weight vectors in the 32 AVX-512
 * registers, so a verification step of 1 + 8 tokens is one pass over the weights. With 8 rows it would be
 * two, the second a latency-bound single row (a 9-token step then costs ~1.28x a 1-token step, not ~1.15x). */
#define MAX_ROWS 12

/* Run CALL(rows) for each chunk of at most MAX_ROWS rows, m being the chunk's first row, with `rows` a
 * compile-time constant in each case so the accumulators stay in registers. */
#define FOR_ROW_CHUNKS(M, m, CALL)                                       \
    for (m = 0; m + MAX_ROWS <= (M); m += MAX_ROWS) CALL(MAX_ROWS);      \
    switch ((M) - m) {                                                   \
        case 1: CALL(1); break;                                          \
        case 2: CALL(2); break;                                          \
        case 3: CALL(3); break;                                          \
        case 4: CALL(4); break;                                          \
        case 5: CALL(5); break;                                          \
        case 6: CALL(6); break;                                          \
        case 7: CALL(7); break;                                          \
        case 8: CALL(8); break;                                          \
        case 9: CALL(9); break;                                          \
        case 10: CALL(10); break;                                        \
        case 11: CALL(11); break;                                        \
        default: break;                                                  \
    }
/* Software prefetch distance, in floats (4 KB): the stream runs ahead of the FMAs, so with 2-8 rows the
 * arithmetic hides under the memory traffic (measured: 6 rows cost what 1 row does; 1 row 8% faster). */
#define PREFETCH 1024

typedef float v16 __attribute__((vector_size(64)));

/* One k step: every row's broadcast x[m, k] (x points at column k of row 0) times the block's 32 weights. */
static inline __attribute__((always_inline)) void accumulate(v16 acc[][2], const float *x, int64_t K, v16 w0,
                                                             v16 w1, const int rows) {
    for (int m = 0; m < rows; m++) {
        const float xv = x[m * K];
        acc[m][0] += xv * w0;
        acc[m][1] += xv * w1;
    }
}

/* Each row's 32 sums, times the column scales and plus the bias where given, into its ncols outputs. */
static inline __attribute__((always_inline)) void store_rows(v16 acc[][2], float *y, int64_t N, int64_t ncols,
                                                             const float *scale, const float *bias,
                                                             const int rows) {
    for (int m = 0; m < rows; m++) {
        float tmp[BLOCK];
        memcpy(tmp, &acc[m][0], sizeof acc[m][0]);
        memcpy(tmp + 16, &acc[m][1], sizeof acc[m][1]);
        if (scale)
            for (int64_t j = 0; j < ncols; j++) tmp[j] *= scale[j];
        if (bias)
            for (int64_t j = 0; j < ncols; j++) tmp[j] += bias[j];
        memcpy(y + m * N, tmp, ncols * sizeof(float));
    }
}

typedef int8_t c16 __attribute__((vector_size(16)));
typedef int32_t i16x32 __attribute__((vector_size(64)));

/* 16 int8 -> 16 fp32. GCC turns __builtin_convertvector on int8 into lane-by-lane scalar code, so
 * AVX-512 / AVX2 builds use the sign-extend and convert instructions directly. */
static inline __attribute__((always_inline)) v16 widen(const int8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    v16 r;
    memcpy(&r, &f, sizeof r);
    return r;
#elif defined(__AVX2__)
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    v16 r;
    memcpy(&r, &lo, sizeof lo);
    memcpy((float *)&r + 8, &hi, sizeof hi);
    return r;
#else
    c16 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, i16x32), v16);
#endif
}

#endif
