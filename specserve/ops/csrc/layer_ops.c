/* Fused element-wise steps of a decoder layer, fp32, contiguous rows.
 *
 * PyTorch runs each of these as 3-8 separate ops (rms_norm alone decomposes into pow, mean, add, rsqrt,
 * mul, mul on CPU); at one token per step that is ~25 us of dispatch per norm, ~7% of a SmolLM2 decode
 * step. Large inputs (prefill) are split over rows with OpenMP; small ones stay on the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* out[r] = the index of the first maximum of row r (the first NaN if the row has one), as torch.argmax:
 * greedy sampling and verification. torch's CPU argmax takes ~30 us per 49152-wide row; this takes a
 * few, which matters once per decode step and once per verified token. */
typedef float am_vf __attribute__((vector_size(64)));
typedef int32_t am_vi __attribute__((vector_size(64)));

static inline am_vf am_vmax(am_vf a, am_vf b) { /* a where a > b, else b */
    const am_vi gt = a > b;
    return (am_vf)((gt & (am_vi)a) | (~gt & (am_vi)b));
}

static inline void load64(const float *p, am_vf *v0, am_vf *v1, am_vf *v2, am_vf *v3) {
    memcpy(v0, p, 64);
    memcpy(v1, p + 16, 64);
    memcpy(v2, p + 32, 64);
    memcpy(v3, p + 48, 64);
}

/* The first index holding `value` (NaN: the first NaN). Whole 64-float stretches are tested with vector
 * compares; the stretch that holds it is then scanned. */
static int64_t first_match(const float *xr, int64_t cols, float value) {
    int64_t c = 0;
    if (value == value) {
        const am_vf splat = (am_vf){0} + value;
        for (; c + 64 <= cols; c += 64) {
            am_vf v0, v1, v2, v3;
            load64(xr + c, &v0, &v1, &v2, &v3);
            const am_vi hit = (v0 == splat) | (v1 == splat) | (v2 == splat) | (v3 == splat);
            int any = 0;
            for (int i = 0; i < 16; i++) any |= hit[i];
            if (any) break;
        }
        for (; c < cols; c++)
            if (xr[c] == value) return c;
    } else {
        for (; c < cols; c++)
            if (xr[c] != xr[c]) return c;
    }
    return cols - 1;
}

void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        /* max over the row; a NaN lane compares false both ways and is flagged separately */
        am_vf m0 = (am_vf){0} - INFINITY, m1 = m0, m2 = m0, m3 = m0;
        am_vi bad = (am_vi){0};
        int64_t c = 0;
        for (; c + 64 <= cols; c += 64) {
            am_vf v0, v1, v2, v3;
            load64(xr + c, &v0, &v1, &v2, &v3);
            m0 = am_vmax(v0, m0);
            m1 = am_vmax(v1, m1);
            m2 = am_vmax(v2, m2);
            m3 = am_vmax(v3, m3);
            bad |= (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3);
        }
        m0 = am_vmax(m1, m0);
        m2 = am_vmax(m3, m2);
        m0 = am_vmax(m2, m0);
        float best = -INFINITY;
        int nan = 0;
        for (int i = 0; i < 16; i++) {
            best = m0[i] > best ? m0[i] : best;
            nan |= bad[i] != 0;
        }
        for (; c < cols; c++) {
            best = xr[c] > best ? xr[c] : best;
            nan |= xr[c] != xr[c];
        }
        out[r] = first_match(xr, cols, nan ? NAN : best);
    }
}
