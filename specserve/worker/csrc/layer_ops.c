/* Fused element-wise steps of a decoder layer, fp32, contiguous rows.
 *
 * PyTorch runs each of these as 3-8 separate ops (rms_norm alone decomposes into pow, mean, add, rsqrt,
 * mul, mul on CPU); at one token per step that is ~25 us of dispatch per norm, ~7% of a SmolLM2 decode
 * step. Large inputs (prefill) are split over rows with OpenMP; small ones stay on the calling thread.
 */
#include <math.h>
#include <stdint.h>

#include "specserve_math.h"

#define PARALLEL_MIN_ROWS 16

/* residual += x (when x is given), then out = rms_norm(residual) * weight. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t dim, float eps) {
#pragma omp parallel for if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim;
        float *o = out + r * dim;
        if (x) {
            const float *xr = x + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) res[d] += xr[d];
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) ss += res[d] * res[d];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = res[d] * inv * weight[d];
    }
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        /* silu(x) = x / (1 + exp(-x)); written with exp(-|x|) <= 1 so nothing overflows */
        const float x = g[i];
        const float e = exp_nonpositive(-fabsf(x));
        o[i] = (x >= 0.0f ? x : x * e) / (1.0f + e) * u[i];
    }
}

/* gate_up: [rows, 2 * inter] (gate then up); out: [rows, inter] = silu(gate) * up. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
}

/* In place on the q and k heads of a fused qkv row: x * cos + rotate_half(x) * sin (rotate-half
 * convention: the first half pairs with the second). qkv: [rows, row_stride], the q heads first, then the
 * k heads; cos, sin: [rows, head_dim]. */
void rope_qk_f32(float *qkv, const float *cos, const float *sin, int64_t rows, int64_t row_stride,
                 int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x = qkv + r * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = x[d], b = x[d + half];
                x[d] = a * c[d] - b * s[d];
                x[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}
