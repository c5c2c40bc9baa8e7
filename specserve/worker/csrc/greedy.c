/* The exact argmax of an fp32 LM head's logits, y = x @ W^T, without streaming all of W.
 *
 * Greedy decoding and greedy verification need only each row's argmax, but the LM head is the largest
 * layer (SmolLM2: 49152 x 576, 113 MB fp32, ~2 ms of a ~11 ms step). An int8 copy of W (a quarter of
 * the bytes) screens the vocabulary: with per-column scale s_n, rounding W to int8 moves logit n by at
 * most ||x||_1 * s_n / 2, and the two fp32 summations add at most ~K * 2^-24 * ||x||_1 * 127 s_n each.
 * With b_n that bound, a column whose screened logit plus b_n falls below another's minus b_m cannot be
 * the maximum; the few that survive are recomputed exactly as gemm_packed_f32 computes them (the same
 * chain of multiply-adds over k, so the same bits), and the first maximum wins, as in torch.argmax. Rows
 * with non-finite inputs or too many survivors get the full fp32 row instead.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specserve_kernels.h"

#define BLOCK 32
#define MAX_CANDIDATES 256

typedef float v16 __attribute__((vector_size(64)));

/* Output column n of gemm_packed_f32 (no bias) for one row, computed exactly as that kernel computes it:
 * the same 16-lane vector expression over the half-block holding n (so the compiler contracts it into the
 * same fused multiply-adds; a scalar loop was left as separate multiplies and adds), lane n % 16 kept. */
static float packed_column(const float *x, const float *packed, int64_t K, int64_t n) {
    const float *w = packed + (n / BLOCK) * K * BLOCK + (n % BLOCK) / 16 * 16;
    v16 acc = {0};
    for (int64_t k = 0; k < K; k++) {
        v16 wv;
        memcpy(&wv, w + k * BLOCK, sizeof wv);
        acc += x[k] * wv;
    }
    return acc[n % 16];
}

/* The full row through the fp32 GEMM, then torch.argmax's answer. */
static void full_row(const float *x, const float *packed, int64_t K, int64_t N, float *y, int64_t *out) {
    gemm_packed_f32(x, packed, NULL, y, 1, K, N);
    argmax_rows_f32(y, 1, N, out);
}

/* One row: screened logits y [N] in, the exact argmax out. */
static void row_argmax(const float *x, const float *packed, const float *scale, float *y, int64_t K, int64_t N,
                       double slack, int64_t *out) {
    double l1 = 0.0;
    for (int64_t k = 0; k < K; k++) l1 += fabs((double)x[k]);
    if (!isfinite(l1)) {
        full_row(x, packed, K, N, y, out);
        return;
    }
    const double c = l1 * slack;
    double threshold = -INFINITY; /* max over n of a lower bound on the exact logit n */
#pragma omp simd reduction(max : threshold)
    for (int64_t n = 0; n < N; n++) {
        const double low = (double)y[n] - c * scale[n];
        threshold = low > threshold ? low : threshold;
    }
    if (!isfinite(threshold)) {
        full_row(x, packed, K, N, y, out);
        return;
    }
    int64_t best = -1, count = 0;
    float best_value = 0.0f;
    for (int64_t n = 0; n < N; n++) {
        if ((double)y[n] + c * scale[n] < threshold) continue;
        if (++count > MAX_CANDIDATES) {
            full_row(x, packed, K, N, y, out);
            return;
        }
        const float v = packed_column(x, packed, K, n);
        if (v != v) { /* NaN: torch.argmax reports the first one; let the full row find it */
            full_row(x, packed, K, N, y, out);
            return;
        }
        if (best < 0 || v > best_value) {
            best = n;
            best_value = v;
        }
    }
    *out = best;
}

/* x: [M, K]; packed: W [N, K] in gemm_packed_f32's blocks; packed_i8, scale: gemm_packed_int8's copy of W
 * (scale = max |W[n]| / 127); out: [M] int64. Returns 0, or 1 when the work buffer could not be allocated. */
int lm_head_argmax_f32(const float *x, const float *packed, const int8_t *packed_i8, const float *scale,
                       int64_t M, int64_t K, int64_t N, int64_t *out) {
    float *y = malloc(sizeof(float) * (M * N ? M * N : 1));
    if (!y) return 1;
    gemm_packed_i8(x, packed_i8, scale, NULL, y, M, K, N);
    /* |exact fp32 logit - screened logit| <= ||x||_1 s_n (1/2 + 127 (2 gamma_K + 2^-23)) with
     * gamma_K = K u / (1 - K u), u = 2^-24: weight rounding (a half step, plus the quotient's rounding),
     * both fp32 summations and the scale's product; 1e-3 on top covers this bound's own arithmetic and
     * a scale rounded when it was computed. */
    const double u = 0x1p-24, gamma = K * u / (1.0 - K * u);
    const double slack = 0.5 + 127.0 * (2.0 * gamma + 2.0 * u) + 1e-3;
#pragma omp parallel for if (M > 1)
    for (int64_t m = 0; m < M; m++)
        row_argmax(x + m * K, packed, scale, y + m * N, K, N, slack, out + m);
    free(y);
    return 0;
}
