/* The exact argmax of an LM head's logits, y = x @ W^T, without streaming all of W (fp32 or GGUF blocks).
 *
 * Greedy decoding and greedy verification need only each row's argmax, but the LM head is the largest
 * layer (SmolLM2: 49152 x 576, 113 MB fp32, ~2 ms of a ~11 ms step). An int8 copy of W (a quarter of
 * the bytes) screens the vocabulary with exact integer dot products; a column whose screened logit plus
 * its error bound falls below another's minus that one's bound cannot be the maximum, and the few that
 * survive are recomputed exactly as gemm_weight computes them (the same chain of multiply-adds over k, so
 * the same bits); the first maximum wins, as in torch.argmax. Rows with non-finite inputs or too many
 * survivors get the full row instead.
 *
 * The screen. W[n] ~ s_n q[n] with q = round(W[n] / s_n) in int8, s_n = max |W[n]| / 127, so
 * |W[n, k] - s_n q[n, k]| <= s_n / 2. Each row x is written as two int8 terms, x ~ t p + t2 p2 (p =
 * round(x / t), t = max |x| / 127; p2 the same for the remainder), because hidden states have outlier
 * dimensions (max |x| ~16x the mean |x| on SmolLM2): with p alone the bound below let hundreds to
 * thousands of columns survive, with both terms as few as with fp32 activations (median 3). Then
 * D1 = sum_k p q and D2 = sum_k p2 q are exact int32 sums (AVX-512 VNNI: 64 products per instruction, 4x
 * the fp32 multiply-adds of widening the weights), the screened logit is s_n (t D1 + t2 D2), and with
 * e = the largest |x_k - t p_k - t2 p2_k|, the exact logit differs from it by at most
 *   s_n / 2 * (||x||_1 + K e)          (the weights' rounding)
 *   + e * ||W[n]||_1                   (the activations' remainder)
 *   + 127 s_n ||x||_1 * gamma_K        (the fp32 GEMM's own rounding, gamma_K = K u / (1 - K u), u = 2^-24).
 *
 * Without VNNI (AVX2) the bytes are widened to int16 and multiplied in pairs (vpmaddwd), so the screen costs
 * per activation row what it costs per int8 term. That path writes each row as one int16 term instead, x ~ t p
 * with |p| <= P, P the largest value whose sums cannot leave int32 (K * 127 * P < 2^31: P = 18,872 at K = 896):
 * one pass where two int8 terms took two, with e and the bound as above (e ~ max |x| / 2P against ~max |x| /
 * 65,000 for the two terms, so about as few columns survive). Either screen only chooses which columns are
 * recomputed exactly: the argmax is the same on every path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define GREEDY_X86 1
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define TARGET_AVX2 __attribute__((target("avx2")))
#include "amx_tiles.h"
#endif

#include "specserve_kernels.h"

#define BLOCK 32
#define MAX_CANDIDATES 256
#define SCREEN_COLS 16 /* columns of a screen block: one 16-lane int32 accumulator per activation row */
#define SCREEN_ROWS 16 /* activation rows (8 x rows, two terms each) sharing every weight load; at 18
                        * and more GCC spilled the accumulators (dot products at 350 instead of ~770 GMAC/s) */
/* The AVX2 path's rows of x a pass (one int16 term each): 4 accumulators a row in 16 registers, so 2 rows keep
 * them with the 4 weight vectors; the block's 16 columns (K4 * 64 bytes) stay in L1 for the next pass. */
#ifndef SCREEN_ROWS_AVX2
#define SCREEN_ROWS_AVX2 2
#endif
#define SCREEN_PREFETCH 4096 /* bytes ahead in the weight stream */
#define SCAN 64 /* columns tested at once for candidates */

typedef float v16 __attribute__((vector_size(64)));

/* The full row through the GEMM, then torch.argmax's answer over the allowed columns (all when allowed
 * is NULL; a row allowing none gets 0, as torch.argmax of all -inf). Rare: its buffer is allocated here.
 * Returns 0, or 1 when the buffer could not be allocated. */
static int full_row(const float *x, const weight_t *packed, int64_t K, int64_t N, const uint8_t *allowed,
                    int64_t *out) {
    float *y = malloc(sizeof(float) * N);
    if (!y) return 1;
    gemm_weight(x, packed, NULL, y, 1, K, N);
    if (allowed)
        for (int64_t n = 0; n < N; n++)
            if (!allowed[n]) y[n] = -INFINITY;
    argmax_rows_f32(y, 1, N, out);
    free(y);
    return 0;
}

/* Activations: x [K] -> t, t2 and the two int8 terms as unsigned bytes (p + 128) in xu [2][K4 * 4] (zero
 * terms past K); returns e, the largest |x_k - t p_k - t2 p2_k| (doubles: exact enough to bound). */
static double quantize_row(const float *x, int64_t K, int64_t K4, uint8_t *xu, double *t_out, double *t2_out) {
    double amax = 0.0;
    for (int64_t k = 0; k < K; k++) amax = fmax(amax, fabs((double)x[k]));
    const double t = amax / 127.0;
    double rmax = 0.0;
    memset(xu, 128, 2 * K4 * 4);
    for (int64_t k = 0; k < K && t > 0.0; k++) {
        const double p = nearbyint(x[k] / t);
        xu[k] = (uint8_t)(p + 128.0);
        rmax = fmax(rmax, fabs(x[k] - t * p));
    }
    const double t2 = rmax / 127.0;
    double e = 0.0;
    for (int64_t k = 0; k < K && t2 > 0.0; k++) {
        const double r = x[k] - t * ((double)xu[k] - 128.0);
        const double p2 = fmin(fmax(nearbyint(r / t2), -127.0), 127.0);
        xu[K4 * 4 + k] = (uint8_t)(p2 + 128.0);
        e = fmax(e, fabs(r - t2 * p2));
    }
    if (t2 == 0.0) e = rmax;
    *t_out = t;
    *t2_out = t2;
    return e * (1.0 + 1e-9) + amax * 1e-15; /* covers the doubles' own rounding */
}

/* The AVX2 screen's activations: x [K] -> t and p [K4 * 4] int16 (zeros past K) with x ~ t p, |p| <= pmax;
 * returns e, the largest |x_k - t p_k|. */
static double quantize_row16(const float *x, int64_t K, int64_t K4, double pmax, int16_t *p, double *t_out) {
    double amax = 0.0;
    for (int64_t k = 0; k < K; k++) amax = fmax(amax, fabs((double)x[k]));
    const double t = amax / pmax;
    double e = 0.0;
    memset(p, 0, sizeof(int16_t) * K4 * 4);
    for (int64_t k = 0; k < K && t > 0.0; k++) {
        const double v = fmin(fmax(nearbyint(x[k] / t), -pmax), pmax);
        p[k] = (int16_t)v;
        e = fmax(e, fabs(x[k] - t * v));
    }
    *t_out = t;
    return e * (1.0 + 1e-9) + amax * 1e-15; /* covers the doubles' own rounding */
}

/* dots[r][n] = sum_k xu[r][k] * q[n][k] for the `rows` activation rows of one block of 16 columns
 * (w: the block, [K4][16][4]). Integer sums: exact, whichever path computes them. One function per
 * instruction-set path (the screen's route for the call's rows, int8_path_for), each built with its target
 * attribute. */
static inline __attribute__((always_inline)) void screen_block_portable(const uint8_t *xu, int64_t K4, const int8_t *w,
                                                                        int32_t *dots, int64_t ldd, const int rows) {
    for (int r = 0; r < rows; r++) {
        int32_t acc[SCREEN_COLS] = {0};
        for (int64_t k4 = 0; k4 < K4; k4++)
            for (int c = 0; c < SCREEN_COLS; c++)
                for (int j = 0; j < 4; j++)
                    acc[c] += (int32_t)xu[r * K4 * 4 + k4 * 4 + j] * (int32_t)w[k4 * 64 + c * 4 + j];
        memcpy(dots + r * ldd, acc, sizeof acc);
    }
}

#if defined(GREEDY_X86)
TARGET_VNNI static inline __attribute__((always_inline)) void screen_block_vnni(const uint8_t *xu, int64_t K4,
                                                                                const int8_t *w, int32_t *dots,
                                                                                int64_t ldd, const int rows) {
    __m512i acc[SCREEN_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < K4; k4++) {
        __builtin_prefetch(w + k4 * 64 + SCREEN_PREFETCH);
        const __m512i wv = _mm512_loadu_si512((const void *)(w + k4 * 64));
        for (int r = 0; r < rows; r++) {
            int32_t xb;
            memcpy(&xb, xu + r * K4 * 4 + k4 * 4, 4);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(xb), wv);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_si512((void *)(dots + r * ldd), acc[r]);
}

/* No VNNI: the weights widened to int16 and multiplied in pairs with int16 activations (vpmaddwd, exact; x16:
 * `rows` rows of K4 * 4 int16); lane 2c + i of acc[r][h] holds half i of column 4h + c's sum. */
TARGET_AVX2 static inline __attribute__((always_inline)) void screen_block_avx2(const int16_t *x16, int64_t K4,
                                                                                const int8_t *w, int32_t *dots,
                                                                                int64_t ldd, const int rows) {
    __m256i acc[SCREEN_ROWS_AVX2][4];
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 4; h++) acc[r][h] = _mm256_setzero_si256();
    for (int64_t k4 = 0; k4 < K4; k4++) {
        __builtin_prefetch(w + k4 * 64 + SCREEN_PREFETCH);
        __m256i wv[4];
        for (int h = 0; h < 4; h++) wv[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k4 * 64 + 16 * h)));
        for (int r = 0; r < rows; r++) {
            int64_t four;
            memcpy(&four, x16 + r * K4 * 4 + k4 * 4, sizeof four);
            const __m256i xv = _mm256_set1_epi64x(four);
            for (int h = 0; h < 4; h++) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(xv, wv[h]));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 4; h++) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, acc[r][h]);
            for (int c = 0; c < 4; c++) dots[r * ldd + 4 * h + c] = lanes[2 * c] + lanes[2 * c + 1];
        }
}
#endif

/* One pass of 2 * pairs activation rows over one block, with the row count a compile-time constant. */
#define SCREEN_PASS(PATH, TARGET)                                                                           \
    TARGET static void screen_pass_##PATH(const uint8_t *x, int64_t K4, const int8_t *w, int32_t *d,        \
                                          int64_t ldd, int64_t pairs) {                                     \
        switch (pairs) {                                                                                    \
            case 1: screen_block_##PATH(x, K4, w, d, ldd, 2); break;                                        \
            case 2: screen_block_##PATH(x, K4, w, d, ldd, 4); break;                                        \
            case 3: screen_block_##PATH(x, K4, w, d, ldd, 6); break;                                        \
            case 4: screen_block_##PATH(x, K4, w, d, ldd, 8); break;                                        \
            case 5: screen_block_##PATH(x, K4, w, d, ldd, 10); break;                                       \
            case 6: screen_block_##PATH(x, K4, w, d, ldd, 12); break;                                       \
            case 7: screen_block_##PATH(x, K4, w, d, ldd, 14); break;                                       \
            default: screen_block_##PATH(x, K4, w, d, ldd, 16); break;                                      \
        }                                                                                                   \
    }
SCREEN_PASS(portable, )
#if defined(GREEDY_X86)
SCREEN_PASS(vnni, TARGET_VNNI)

/* One AVX2 pass of `rows` int16 activation rows (one per row of x) over one block. */
TARGET_AVX2 static void screen_pass_avx2(const int16_t *x16, int64_t K4, const int8_t *w, int32_t *d, int64_t ldd,
                                         int64_t rows) {
    if (rows >= 2) screen_block_avx2(x16, K4, w, d, ldd, 2);
    else screen_block_avx2(x16, K4, w, d, ldd, 1);
}

/* The screen on AMX tiles (greedy_amx.h), and the same code on emulated tiles (tests) */
#if INT8_AMX_BUILT
#define SA_PATH amx
#define SA_TARGET __attribute__((target("amx-tile,amx-int8,avx512f")))
#define AMX_EMULATED 0
#include "greedy_amx.h"
#undef SA_PATH
#undef SA_TARGET
#undef AMX_EMULATED
#endif
#define SA_PATH amx_emulated
#define SA_TARGET
#define AMX_EMULATED 1
#include "greedy_amx.h"
#endif

/* dots [R][Np] (Np = the columns rounded up to 16) for activation rows xu [R][K4 * 4] (R even: two terms a
 * row; rows up to R rounded up to 16 readable, zeros past R) on `path` (not AVX2). Rows go through the
 * weights in as few passes as SCREEN_ROWS allows, the passes equal in size; on AMX, in tiles of 16 rows. */
static void screen_dots(int path, const uint8_t *xu, int64_t R, int64_t K4, const int8_t *packed, int64_t Np,
                        int32_t *dots) {
#if defined(GREEDY_X86)
#if INT8_AMX_BUILT
    if (path == INT8_AMX) return screen_dots_amx(xu, R, K4, packed, Np, dots);
#endif
    if (path == INT8_AMX_EMULATED) return screen_dots_amx_emulated(xu, R, K4, packed, Np, dots);
#endif
    const int64_t passes = (R + SCREEN_ROWS - 1) / SCREEN_ROWS;
    const int64_t per_pass = 2 * ((R / 2 + passes - 1) / passes); /* activation rows, even, <= SCREEN_ROWS */
#pragma omp parallel for schedule(static) if (R * K4 * Np >= (1 << 16))
    for (int64_t b = 0; b < Np / SCREEN_COLS; b++) {
        const int8_t *w = packed + b * K4 * 64;
        for (int64_t r0 = 0; r0 < R; r0 += per_pass) {
            const int64_t pairs = (R - r0 < per_pass ? R - r0 : per_pass) / 2;
            const uint8_t *x = xu + r0 * K4 * 4;
            int32_t *d = dots + r0 * Np + b * SCREEN_COLS;
#if defined(GREEDY_X86)
            if (path == INT8_VNNI) {
                screen_pass_vnni(x, K4, w, d, Np, pairs);
                continue;
            }
#endif
            screen_pass_portable(x, K4, w, d, Np, pairs);
        }
    }
}

#if defined(GREEDY_X86)
/* The AVX2 screen: dots [M][Np] for int16 activation rows x16 [M][K4 * 4], SCREEN_ROWS_AVX2 rows a pass. */
static void screen_dots_avx2(const int16_t *x16, int64_t M, int64_t K4, const int8_t *packed, int64_t Np,
                             int32_t *dots) {
#pragma omp parallel for schedule(static) if (M * K4 * Np >= (1 << 15))
    for (int64_t b = 0; b < Np / SCREEN_COLS; b++)
        for (int64_t r0 = 0; r0 < M; r0 += SCREEN_ROWS_AVX2)
            screen_pass_avx2(x16 + r0 * K4 * 4, K4, packed + b * K4 * 64, dots + r0 * Np + b * SCREEN_COLS, Np,
                             M - r0);
}
#endif

#if defined(GREEDY_X86)
/* screen_dots on (emulated) AMX tiles against the VNNI path on a fixed problem: 34 rows (three tiles, the
 * last padded), K4 = 20 (a 16-row chunk and a tail of 4), 32 columns. Allocates nothing (gemm_q4_i8.c runs it
 * in a forked child); 1 when the sums are equal. */
int screen_amx_self_check(int emulated) {
    enum { R = 34, PADDED = 48, K4 = 20, NP = 32 };
    static uint8_t xu[PADDED * K4 * 4];
    static int8_t q[NP * K4 * 4];
    static int32_t want[R * NP], got[R * NP];
    uint32_t state = 99;
    for (int i = 0; i < R * K4 * 4; i++) xu[i] = (uint8_t)((state = state * 1664525u + 1013904223u) >> 24);
    for (int i = 0; i < NP * K4 * 4; i++) q[i] = (int8_t)((state = state * 1664525u + 1013904223u) >> 24);
    for (int64_t b = 0; b < NP / SCREEN_COLS; b++)
        for (int64_t r0 = 0; r0 < R; r0 += 16)
            screen_pass_vnni(xu + r0 * K4 * 4, K4, q + b * K4 * 64, want + r0 * NP + b * SCREEN_COLS, NP,
                             (R - r0 < 16 ? R - r0 : 16) / 2);
    if (emulated) screen_dots_amx_emulated(xu, R, K4, q, NP, got);
#if INT8_AMX_BUILT
    else screen_dots_amx(xu, R, K4, q, NP, got);
#endif
    return memcmp(want, got, sizeof want) == 0;
}
#else
int screen_amx_self_check(int emulated) { return (void)emulated, 0; }
#endif

/* Column n's screened logit of one row (d1, d2: its two terms' dot products) plus or minus its bound. */
#define SCREENED(n) (scale[n] * (t * (d1[n] - offset * col_sum[n]) + t2 * (d2[n] - offset * col_sum[n])))
#define BOUND(n) (a * scale[n] + ew * w_l1[n])

/* One row: its two terms' dot products d1, d2 [Np] in (with `offset` the terms' stored offset: 128 for the
 * unsigned bytes, 0 for the AVX2 screen's one int16 term, whose t2 is 0), the exact argmax out; 1 when a
 * fallback to the full row could not allocate its buffer. */
static int row_argmax(const float *x, const weight_t *packed, const float *scale, const int32_t *col_sum,
                      const double *w_l1, const int32_t *d1, const int32_t *d2, double offset, const double row[4],
                      int64_t K, int64_t N, const uint8_t *allowed, int64_t *out) {
    const double t = row[0], t2 = row[1], e = row[2], l1 = row[3]; /* see lm_head_argmax_f32 */
    const double u = 0x1p-24, gamma = K * u / (1.0 - K * u);
    /* 1e-3 on top covers the scales' own rounding and this arithmetic */
    const double a = ((l1 + K * e) * 0.5 + 127.0 * l1 * (gamma + u)) * (1.0 + 1e-3), ew = e * (1.0 + 1e-3);
    /* One pass: threshold = the max over n of a lower bound on the exact logit n, and per SCAN columns the
     * max of their upper bounds; only groups whose max reaches the threshold are looked at again. */
    const int64_t groups = (N + SCAN - 1) / SCAN;
    double threshold = -INFINITY, group_high[groups];
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n1 = (g + 1) * SCAN < N ? (g + 1) * SCAN : N;
        double low_max = -INFINITY, high_max = -INFINITY;
#pragma omp simd reduction(max : low_max, high_max)
        for (int64_t n = g * SCAN; n < n1; n++) {
            const double v = SCREENED(n), b = BOUND(n), on = allowed && !allowed[n] ? -INFINITY : 0.0;
            low_max = v - b + on > low_max ? v - b + on : low_max;
            high_max = v + b + on > high_max ? v + b + on : high_max;
        }
        threshold = low_max > threshold ? low_max : threshold;
        group_high[g] = high_max;
    }
    if (!isfinite(threshold)) return full_row(x, packed, K, N, allowed, out);
    int64_t best = -1, count = 0;
    float best_value = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        if (!(group_high[g] >= threshold)) continue; /* NaN-safe: such a group is looked at */
        const int64_t n1 = (g + 1) * SCAN < N ? (g + 1) * SCAN : N;
        for (int64_t n = g * SCAN; n < n1; n++) {
            if ((allowed && !allowed[n]) || SCREENED(n) + BOUND(n) < threshold) continue;
            if (++count > MAX_CANDIDATES) return full_row(x, packed, K, N, allowed, out);
            const float v = weight_column(x, packed, K, n);
            if (v != v) return full_row(x, packed, K, N, allowed, out); /* NaN: torch.argmax reports the first */
            if (best < 0 || v > best_value) {
                best = n;
                best_value = v;
            }
        }
    }
    *out = best;
    return 0;
}
#undef SCREENED
#undef BOUND

/* x: [M, K]; packed: W [N, K] in gemm_weight's blocks of `format` with `group` k's per scale record (fp32:
 * WEIGHT_F32, any group); the screen (see the top of this file): q packed as
 * [ceil(N / 16)][ceil(K / 4)][16][4] int8, scale [N] (max |W[n]| / 127), col_sum [N] (sum_k q[n, k]), w_l1 [N]
 * (sum_k |W[n, k]|); allowed: NULL, or [M, N] bytes, nonzero where a column may win (structured output's
 * masks: the argmax of the logits with the others at -inf); out: [M] int64. Returns 0, or 1 when a work buffer
 * could not be allocated. */
int lm_head_argmax_f32(const float *x, const void *data, int64_t format, int64_t group, const int8_t *q, const float *scale,
                       const int32_t *col_sum, const double *w_l1, const uint8_t *allowed, int64_t M, int64_t K,
                       int64_t N, int64_t *out) {
    const int64_t K4 = (K + 3) / 4, Np = (N + SCREEN_COLS - 1) / SCREEN_COLS * SCREEN_COLS;
    const weight_t weight = {data, format, group}, *packed = &weight;
    const int path = int8_path_for(INT8_SCREEN, M);
#if defined(GREEDY_X86)
    const int wide = path == INT8_AVX2; /* one int16 term a row (see the top of this file) */
#else
    const int wide = 0;
#endif
    const int64_t terms = wide ? 1 : 2;
    const int64_t tile_rows = (2 * M + 15) / 16 * 16; /* AMX reads whole tiles of 16 activation rows */
    /* the activation terms: int8 ones as unsigned bytes, or the AVX2 screen's int16 ones */
    uint8_t *xu = calloc((wide ? M * K4 * 4 * (int64_t)sizeof(int16_t) : tile_rows * K4 * 4) + 1, 1);
    int32_t *dots = malloc(sizeof(int32_t) * (terms * M * Np + 1));
    double *rows = malloc(sizeof(double) * (4 * M + 1)); /* per row: t, t2, e (quantize_row), ||x||_1 */
    if (!xu || !dots || !rows) {
        free(xu), free(dots), free(rows);
        return 1;
    }
    int16_t *x16 = (int16_t *)xu;
    const double pmax = fmin(32767.0, floor(2147483647.0 / (127.0 * (double)(K4 * 4))));
    for (int64_t m = 0; m < M; m++) {
        double *r = rows + 4 * m;
        r[3] = 0.0;
        for (int64_t k = 0; k < K; k++) r[3] += fabs((double)x[m * K + k]);
        if (!isfinite(r[3])) { /* the full row: its screen terms are zeros */
            if (!wide) memset(xu + 2 * m * K4 * 4, 128, 2 * K4 * 4);
            continue;
        }
        if (wide) {
            r[2] = quantize_row16(x + m * K, K, K4, pmax, x16 + m * K4 * 4, r);
            r[1] = 0.0;
        } else {
            r[2] = quantize_row(x + m * K, K, K4, xu + 2 * m * K4 * 4, r, r + 1);
        }
    }
#if defined(GREEDY_X86)
    if (wide)
        screen_dots_avx2(x16, M, K4, q, Np, dots);
    else
#endif
        screen_dots(path, xu, 2 * M, K4, q, Np, dots);
    int failed = 0;
#pragma omp parallel for if (M > 1) reduction(| : failed)
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *row_allowed = allowed ? allowed + m * N : NULL;
        const int32_t *d1 = dots + terms * m * Np, *d2 = dots + (terms * m + terms - 1) * Np;
        if (!isfinite(rows[4 * m + 3]))
            failed |= full_row(x + m * K, packed, K, N, row_allowed, out + m);
        else
            failed |= row_argmax(x + m * K, packed, scale, col_sum, w_l1, d1, d2, wide ? 0.0 : 128.0, rows + 4 * m,
                                 K, N, row_allowed, out + m);
    }
    free(xu), free(dots), free(rows);
    return failed;
}
