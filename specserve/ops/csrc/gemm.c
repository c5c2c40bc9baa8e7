/* y = x @ W^T (+ bias) for fp32, with W pre-packed into column blocks: the linear layers of every step.
 *
 * Packed layout: W [N, K] becomes [ceil(N / 32)][K][32] (block b holds output columns 32b..32b+31, k-major,
 * zero rows past N), so one k step of a block is NV vectors (gemm_common.h) that every input row multiplies
 * by its broadcast x[m, k]. Up to MAX_ROWS input rows share each weight load: a decode step (1 row) and a
 * verification step (2-12 rows) stream the weights once, at about the same memory-bound cost, and large
 * batches reuse each block from cache across row chunks.
 *
 * Each output element is one FMA chain over k = 0..K-1 in order, whatever the number of rows or the chunk a
 * row falls in, so a row's result is bitwise independent of the batch it is computed in.
 */
#include "gemm_common.h"

static inline __attribute__((always_inline)) void block_rows(const float *restrict w, const float *restrict x,
                                                             int64_t K, float *restrict y, int64_t N,
                                                             int64_t ncols, const float *bias, const int rows) {
    vf acc[MAX_ROWS][NV];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf wv[NV];
        __builtin_prefetch(w + k * BLOCK + PREFETCH); /* past the end: a hint, never a fault */
        __builtin_prefetch(w + k * BLOCK + PREFETCH + 16);
        load_block(wv, w + k * BLOCK);
        accumulate(acc, x + k, K, wv, rows);
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
static inline __attribute__((always_inline)) void block_rows_i8(const int8_t *restrict w, const float *restrict x,
                                                                int64_t K, float *restrict y, int64_t N,
                                                                int64_t ncols, const float *restrict scale,
                                                                const float *bias, const int rows) {
    vf acc[MAX_ROWS][NV];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        __builtin_prefetch(w + k * BLOCK + 4 * PREFETCH);
        vf wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = widen(w + k * BLOCK + j * VLEN);
        accumulate(acc, x + k, K, wv, rows);
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
