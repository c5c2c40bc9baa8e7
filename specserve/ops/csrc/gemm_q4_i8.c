/* y = x @ W^T (+ bias) for 4-bit GGUF blocks with integer dot products on 15-bit activations.
 *
 * Each row of x is quantized per group of 32 k's (the weights' groups) to two int8 digits, x ~ d * (hi + lo /
 * 256) with d = max|x| / 127 (an error below max|x| / 65000, where one int8 digit, llama.cpp's Q8 activations,
 * errs up to max|x| / 254 and flips near-tied greedy tokens). Every output is the sum over groups of
 * (a * d / 256) * sum_k q_w * (256 hi + lo) + b * (d / 256) * sum_k (256 hi + lo), with the weights'
 * w = a * q_w + b (q_w in 0..15; a, b per column and group, gemm_gguf.c). The integer sums are exact; the fp32
 * epilogue takes the same operations in the same order for every row, so a row's result does not depend on
 * the other rows of the call (a verification step gives each position what a one-token step gives) nor on
 * the thread count. Per 32 weights a row costs one 512-bit dot-product instruction (AVX512-VNNI vpdpbusd:
 * 64 u8 x s8 products into 16 int32 lanes, twice for the two digits) where the fp32 GEMM spends two FMAs and
 * the dequantization, so a one-token step is bound by the blocks' bytes and extra verified rows are cheap.
 *
 * Packed layout (WEIGHT_Q4_I8): gemm_gguf.c's Q4 records (a[32], b[32], then the group's q) with the q bytes
 * of each group reordered from [k][16] to [k / 4][16][4]: byte 4j + i of quad t holds column j (low nibble)
 * and column j + 16 (high nibble) at k = 4t + i, so one 64-byte load gives 16 columns x 4 k's for each half.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_common.h"
#include "specserve_kernels.h"

#define QGROUP 32
#define Q4_RECORD (2 * BLOCK * (int64_t)sizeof(float) + QGROUP * 16)
/* Rows sharing each block's loads: 4 rows keep 16 int32 and 8 fp32 accumulators with the scales and the
 * unpacked nibbles in the 32 vector registers. */
#define I8_ROWS 4
/* Records ahead that each group prefetches, all 12 of a record's cache lines: a shorter stream (3 lines 2
 * records ahead) leaves the loads waiting on memory, ~3.4 ms for a 2-row call on a 75 MB weight against
 * 2.0-3.0 ms with these. */
#define I8_PREFETCH 8

typedef int32_t i32v __attribute__((vector_size(64)));
typedef uint8_t u8v __attribute__((vector_size(64)));

/* For each of 16 int32 lanes j: acc[j] + sum_i u[4j + i] * s[i], with s the four int8 of s4. */
static inline __attribute__((always_inline)) i32v dot4(i32v acc, u8v u, int32_t s4) {
#if defined(__AVX512VNNI__)
    __m512i a, uu;
    memcpy(&a, &acc, sizeof a);
    memcpy(&uu, &u, sizeof uu);
    a = _mm512_dpbusd_epi32(a, uu, _mm512_set1_epi32(s4));
    memcpy(&acc, &a, sizeof acc);
    return acc;
#elif defined(__AVX2__)
    /* u <= 15, |s| <= 127: each pair sum of maddubs fits int16 (no saturation), so this equals vpdpbusd */
    __m256i u0, u1;
    memcpy(&u0, &u, sizeof u0);
    memcpy(&u1, (const char *)&u + 32, sizeof u1);
    const __m256i s = _mm256_set1_epi32(s4), one = _mm256_set1_epi16(1);
    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, s), one);
    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, s), one);
    i32v p;
    memcpy(&p, &p0, sizeof p0);
    memcpy((char *)&p + 32, &p1, sizeof p1);
    return acc + p;
#else
    int8_t s[4];
    memcpy(s, &s4, sizeof s);
    for (int j = 0; j < 16; j++)
        acc[j] += u[4 * j] * s[0] + u[4 * j + 1] * s[1] + u[4 * j + 2] * s[2] + u[4 * j + 3] * s[3];
    return acc;
#endif
}

/* x [M, K] -> two int8 digits per value, per group of 32 k's with d = max|x| / 127: x ~ d * (hi + lo / 256),
 * hi = round(x / d), lo = round(256 * (x / d - hi)) (clamped to +-127). Row m's digits are q[2mK .. 2mK + K)
 * (hi) and q[2mK + K .. 2mK + 2K) (lo); per group the unit u = d / 256 [M, K / 32] and u * sum(256 hi + lo). */
void quantize_rows_i8(const float *x, int64_t M, int64_t K, int8_t *q, float *unit, float *usum) {
    const int64_t ng = K / QGROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            const float *v = x + m * K + g * QGROUP;
            int8_t *hi = q + 2 * m * K + g * QGROUP, *lo = hi + K;
            float amax = 0.0f;
            for (int i = 0; i < QGROUP; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < QGROUP; i++) {
                const float r = v[i] * inv;
                const int h = (int)nearbyintf(r);
                int l = (int)nearbyintf((r - (float)h) * 256.0f);
                l = l > 127 ? 127 : l < -127 ? -127 : l;
                hi[i] = (int8_t)h;
                lo[i] = (int8_t)l;
                sum += 256 * h + l;
            }
            unit[m * ng + g] = d / 256.0f;
            usum[m * ng + g] = d / 256.0f * (float)sum;
        }
}

static inline __attribute__((always_inline)) void block_rows_i8(const uint8_t *restrict w, const int8_t *restrict xq,
                                                                const float *restrict xu, const float *restrict xs,
                                                                int64_t K, float *restrict y, int64_t N,
                                                                int64_t ncols, const float *bias, const int rows) {
    v16 acc[I8_ROWS][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = (v16){0};
    const int64_t ng = K / QGROUP;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *rec = w + g * Q4_RECORD, *q = rec + 2 * BLOCK * sizeof(float);
        for (int line = 0; line < Q4_RECORD; line += 64) __builtin_prefetch(rec + I8_PREFETCH * Q4_RECORD + line);
        v16 a0, a1, b0, b1;
        memcpy(&a0, rec, sizeof a0);
        memcpy(&a1, rec + 64, sizeof a1);
        memcpy(&b0, rec + 128, sizeof b0);
        memcpy(&b1, rec + 192, sizeof b1);
        i32v hi[I8_ROWS][2], lo[I8_ROWS][2];  /* per row and half: sums of q_w * hi and q_w * lo */
        for (int m = 0; m < rows; m++) hi[m][0] = hi[m][1] = lo[m][0] = lo[m][1] = (i32v){0};
        for (int t = 0; t < QGROUP / 4; t++) {
            u8v v;
            memcpy(&v, q + t * 64, sizeof v);
            const u8v w0 = v & 15, w1 = v >> 4;
            for (int m = 0; m < rows; m++) {
                const int8_t *xm = xq + 2 * m * K + g * QGROUP + 4 * t;
                int32_t h4, l4;
                memcpy(&h4, xm, sizeof h4);
                memcpy(&l4, xm + K, sizeof l4);
                hi[m][0] = dot4(hi[m][0], w0, h4);
                hi[m][1] = dot4(hi[m][1], w1, h4);
                lo[m][0] = dot4(lo[m][0], w0, l4);
                lo[m][1] = dot4(lo[m][1], w1, l4);
            }
        }
        for (int m = 0; m < rows; m++) {
            /* 256 * hi + lo is exact in int32 (|.| < 2^24) and in fp32 */
            const float u = xu[m * ng + g], s = xs[m * ng + g];
            acc[m][0] = __builtin_convertvector((hi[m][0] << 8) + lo[m][0], v16) * (a0 * u) + acc[m][0];
            acc[m][0] = b0 * s + acc[m][0];
            acc[m][1] = __builtin_convertvector((hi[m][1] << 8) + lo[m][1], v16) * (a1 * u) + acc[m][1];
            acc[m][1] = b1 * s + acc[m][1];
        }
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

/* x: [M, K] fp32 (K a multiple of 32); packed: WEIGHT_Q4_I8 records; bias: [N] or NULL; y: [M, N].
 * Returns 0, or 1 when the activations' buffer cannot be allocated. */
int gemm_q4_i8(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, int64_t N) {
    const int64_t ng = K / QGROUP, nblocks = (N + BLOCK - 1) / BLOCK, block_bytes = ng * Q4_RECORD;
    int8_t *xq = malloc(2 * M * K + 2 * M * ng * sizeof(float) + 64);
    if (!xq) return 1;
    float *xu = (float *)(xq + ((2 * M * K + 63) & ~(int64_t)63)), *xs = xu + M * ng;
    quantize_rows_i8(x, M, K, xq, xu, xs);
#pragma omp parallel for schedule(static) if (M * K * N >= (1 << 18))
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *w = packed + b * block_bytes;
        const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
        const float *bb = bias ? bias + col : NULL;
        int64_t m = 0;
#define CALL_I8(rows) \
    block_rows_i8(w, xq + 2 * m * K, xu + m * ng, xs + m * ng, K, y + m * N + col, N, ncols, bb, rows)
        for (; m + I8_ROWS <= M; m += I8_ROWS) CALL_I8(I8_ROWS);
        switch (M - m) {
            case 1: CALL_I8(1); break;
            case 2: CALL_I8(2); break;
            case 3: CALL_I8(3); break;
            default: break;
        }
#undef CALL_I8
    }
    free(xq);
    return 0;
}
