/* y = x @ W^T (+ bias) for fp32, with W pre-packed into column blocks: the linear layers of every step.
 *
 * Packed layout: W [N, K] becomes [ceil(N / 32)][K][32] (block b holds output columns 32b..32b+31, k-major,
 * zero rows past N), so one k step of a block is two 16-float vectors that every input row multiplies by
 * its broadcast x[m, k]. Up to MAX_ROWS input rows share each weight load: a decode step (1 row) and a
 * verification step (2-12 rows) stream the weights once, at about the same memory-bound cost, and large
 * batches reuse each block from cache across row chunks.
 *
 * Each output element is one FMA chain over k = 0..K-1 in order, whatever the number of rows or the chunk a
 * row falls in, so a row's result is bitwise independent of the batch it is computed in.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
/* Rows sharing each weight load: 12 rows keep 24 accumulators + 2 weight vectors in the 32 AVX-512
 * registers, so a verification step of 1 + 8 tokens is one pass over the weights (at 8 rows it was two,
 * the second a latency-bound single row: a 9-token step cost 1.28x a 1-token step instead of 1.15x). */
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

static inline __attribute__((always_inline)) void block_rows(const float *restrict w, const float *restrict x,
                                                             int64_t K, float *restrict y, int64_t N,
                                                             int64_t ncols, const float *bias, const int rows) {
    v16 acc[MAX_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v16){0};
    for (int64_t k = 0; k < K; k++) {
        v16 w0, w1;
        __builtin_prefetch(w + k * BLOCK + PREFETCH); /* past the end: a hint, never a fault */
        __builtin_prefetch(w + k * BLOCK + PREFETCH + 16);
        memcpy(&w0, w + k * BLOCK, sizeof w0);
        memcpy(&w1, w + k * BLOCK + 16, sizeof w1);
        accumulate(acc, x + k, K, w0, w1, rows);
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

/* x: [M, K]; packed: as above; bias: [N] or NULL; y: [M, N]. All contiguous. */
void gemm_packed_f32(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N) {
    const int64_t nblocks = (N + BLOCK - 1) / BLOCK;
    /* one thread for small layers, where waking the pool costs more than the work */
#pragma omp parallel for schedule(static) if (M * K * N >= (1 << 18))
    for (int64_t b = 0; b < nblocks; b++) {
        const float *w = packed + b * K * BLOCK;
        const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
        const float *bb = bias ? bias + col : NULL;
        int64_t m;
#define CALL_F32(rows) block_rows(w, x + m * K, K, y + m * N + col, N, ncols, bb, rows)
        FOR_ROW_CHUNKS(M, m, CALL_F32)
#undef CALL_F32
    }
}

/* ---- int8 weights, fp32 activations (weight-only quantization: the draft model's linears) ----------------
 *
 * Same block layout with int8 weights, [ceil(N / 32)][K][32], and one fp32 scale per output column:
 * y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] (+ bias[n]). Each k step widens 32 weights to fp32 once and
 * every row multiplies them, so a decode step streams a quarter of the fp32 bytes; activations stay fp32,
 * so the only error is the weights' rounding. One FMA chain per output in k order, as above. */
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

static inline __attribute__((always_inline)) void block_rows_i8(const int8_t *restrict w, const float *restrict x,
                                                                int64_t K, float *restrict y, int64_t N,
                                                                int64_t ncols, const float *restrict scale,
                                                                const float *bias, const int rows) {
    v16 acc[MAX_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v16){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(w + k * BLOCK + 4 * PREFETCH);
        accumulate(acc, x + k, K, widen(w + k * BLOCK), widen(w + k * BLOCK + 16), rows);
    }
    store_rows(acc, y, N, ncols, scale, bias, rows);
}

/* x: [M, K] fp32; packed: [ceil(N / 32)][K][32] int8; scale: [N]; bias: [N] or NULL; y: [M, N]. */
void gemm_packed_i8(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                    int64_t M, int64_t K, int64_t N) {
    const int64_t nblocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (M * K * N >= (1 << 18))
    for (int64_t b = 0; b < nblocks; b++) {
        const int8_t *w = packed + b * K * BLOCK;
        const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
        const float *bb = bias ? bias + col : NULL, *sc = scale + col;
        int64_t m;
#define CALL_I8(rows) block_rows_i8(w, x + m * K, K, y + m * N + col, N, ncols, sc, bb, rows)
        FOR_ROW_CHUNKS(M, m, CALL_I8)
#undef CALL_I8
    }
}
