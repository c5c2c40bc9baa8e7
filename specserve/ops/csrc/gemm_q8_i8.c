/* y = x @ W^T (+ bias) for GGUF blocks in the Q8 layout (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K: w = a * q + b with q an
 * integer in -128..127 and a, b per column and group of G = 32 or 16 k's, gemm_gguf.c) with integer dot
 * products on int8-quantized activations: gemm_q4_i8.c's method for 8-bit weights.
 *
 * Each row of x is quantized per group of 32 k's exactly as gemm_q4_i8.c does it (its quantize_rows: two int8
 * digits hi, lo with x ~ d * (hi + lo / 256), or one with lo = 0), so a weight group of 16 lies inside one
 * activation group. Per weight group and column the exact integer T = sum_k q * (256 hi + lo), and every output
 * is the sum over weight groups of fma(T, a * unit, .) then fma(b, unit * S, .), unit = d / 256 of the
 * activation group and S = sum_k (256 hi + lo) over the weight group's k's: the same fp32 operations in the same
 * order for every row, on every path, so a row's result depends neither on the other rows of the call nor on
 * the thread count, and every path gives the same bits.
 *
 * The weights are stored as u = q + 128 (0..255), the unsigned operand of vpdpbusd; each path's integer sum
 * U = sum_k u * (256 hi + lo) then gives T = U - 128 * S exactly (|256 hi + lo| <= 32512, so |U| < 2^29).
 * Instruction-set paths, each computing U exactly: AVX512-VNNI (vpdpbusd on the digits, as gemm_q4_i8.c), AVX2
 * (vpmovzxbw + vpmaddwd on 256 hi + lo as int16: pair sums below 2^24, where vpmaddubsw's int16 pair sums of
 * 255 x 127 would saturate) and portable C; no AMX path, so this kernel's routes (INT8_GEMM_Q8) never name it.
 * Each path keeps its rows' fp32 accumulators in memory, loaded and stored once per group: 4 rows x 32 columns
 * would fill AVX2's 16 registers, which the dot products need.
 *
 * Packed layout (WEIGHT_Q8_I8, two digits; WEIGHT_Q8_Q8, one): gemm_gguf.c's Q8 records (a[32], b[32], then the
 * group's q) with the q bytes of each group as u and reordered from [k][32] to [k / 4][32][4]: byte 4j + i of
 * quad t holds column j at k = 4t + i, so one 64-byte load gives 16 columns x 4 k's. The same bytes as the Q8
 * layout. A k-quant's records may instead come in super-blocks with int8 scales (gemm_common.h's group_record).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "gemm_common.h"
#include "int8_simd.h"
#include "specserve_kernels.h"

#define QGROUP 32                                        /* k's per activation group */
#define Q8_QUAD (4 * BLOCK) /* bytes of 4 k's of 32 columns */
/* Rows sharing each block's loads: 4 rows keep the AVX2 path's 8 int32 accumulators of an 8-column slice, its
 * 2 widened weight vectors and a broadcast in the 16 ymm registers (the VNNI path's 16 in its 32 zmm). */
#define Q8_ROWS 4
/* Bytes ahead that each group prefetches, all of its record's lines: gemm_q4_i8.c's distance (8 records of 768
 * bytes). */
#define Q8_PREFETCH 6144

/* One call's quantized rows, as every path reads them (row m of each array at m times its row length). */
typedef struct {
    const int8_t *digits;  /* [M][2][K]: hi then lo, quantize_rows' layout */
    const int16_t *wide;   /* [M][K]: 256 hi + lo (the AVX2 and portable paths) */
    const float *unit;     /* [M][K / 32]: d / 256 of each activation group */
    const float *sums;     /* [M][K / G]: unit * S of each weight group */
    const int32_t *offset; /* [M][K / G]: 128 * S, what u = q + 128 adds to the group's integer sums */
    int64_t K;
} q8_rows_t;

/* Each row's 32 sums plus the bias where given, into its ncols outputs (gemm_common.h's store_rows). */
static inline ALWAYS_INLINE void store_acc(float acc[][BLOCK], float *y, int64_t N, int64_t ncols, const float *bias,
                                           const int rows) {
    for (int m = 0; m < rows; m++) {
        if (bias)
            for (int64_t j = 0; j < ncols; j++) acc[m][j] += bias[j];
        memcpy(y + m * N, acc[m], ncols * sizeof(float));
    }
}

/* The unit and unit * S of row m's activations at weight group g. */
#define ROW_UNIT(x, m, g, G) ((x)->unit[(m) * ((x)->K / QGROUP) + (g) * (G) / QGROUP])
#define ROW_SUM(x, m, g, G) ((x)->sums[(m) * ((x)->K / (G)) + (g)])
#define ROW_OFFSET(x, m, g, G) ((x)->offset[(m) * ((x)->K / (G)) + (g)])

/* ---- the portable path: plain C (vectorized as the build's flags allow) ---- */

static inline ALWAYS_INLINE void group_portable(const float *ab, const uint8_t *q, const q8_rows_t *x, int64_t m0,
                                                int64_t g, float acc[][BLOCK], const int rows, const int G,
                                                const int digits) {
    (void)digits;
    for (int m = 0; m < rows; m++) {
        const int16_t *xs = x->wide + (m0 + m) * x->K + g * G;
        i32v s[2] = {{0}, {0}};
        for (int tq = 0; tq < G / 4; tq++) {
            const int32_t x0 = xs[4 * tq], x1 = xs[4 * tq + 1], x2 = xs[4 * tq + 2], x3 = xs[4 * tq + 3];
            for (int h = 0; h < 2; h++) {
                u8v w;
                memcpy(&w, q + tq * Q8_QUAD + 64 * h, sizeof w);
                for (int j = 0; j < 16; j++)
                    s[h][j] += w[4 * j] * x0 + w[4 * j + 1] * x1 + w[4 * j + 2] * x2 + w[4 * j + 3] * x3;
            }
        }
        const float unit = ROW_UNIT(x, m0 + m, g, G), sum = ROW_SUM(x, m0 + m, g, G);
        for (int h = 0; h < 2; h++) {
            v16 a, b, c;
            memcpy(&a, ab + 16 * h, sizeof a);
            memcpy(&b, ab + BLOCK + 16 * h, sizeof b);
            memcpy(&c, acc[m] + 16 * h, sizeof c);
            const v16 t = __builtin_convertvector(s[h] - ROW_OFFSET(x, m0 + m, g, G), v16);
            c = fmadd_portable(t, a * unit, c);
            c = fmadd_portable(b, (v16){0} + sum, c);
            memcpy(acc[m] + 16 * h, &c, sizeof c);
        }
    }
}

#define Q8_PATH portable
#define Q8_TARGET
#define Q8_GROUP group_portable
#include "gemm_q8_i8_path.h"

#if defined(__x86_64__)
/* ---- AVX2: vpmaddwd of the zero-extended weights and 256 hi + lo, per slice of 8 columns ---- */

TARGET_AVX2 static inline ALWAYS_INLINE void group_avx2(const float *ab, const uint8_t *q, const q8_rows_t *x,
                                                        int64_t m0, int64_t g, float acc[][BLOCK], const int rows,
                                                        const int G, const int digits) {
    (void)digits;
    for (int slice = 0; slice < BLOCK / 8; slice++) {
        /* per row: columns 0-3 and 4-7 of the slice, each column's two int32 lanes its k's 4t, 4t + 1 and
         * 4t + 2, 4t + 3 */
        __m256i c0[Q8_ROWS], c1[Q8_ROWS];
        for (int m = 0; m < rows; m++) c0[m] = c1[m] = _mm256_setzero_si256();
        for (int tq = 0; tq < G / 4; tq++) {
            const uint8_t *p = q + tq * Q8_QUAD + 32 * slice;
            const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
            const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
            for (int m = 0; m < rows; m++) {
                const int16_t *xs = x->wide + (m0 + m) * x->K + g * G + 4 * tq;
                const __m256i s = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)xs));
                c0[m] = _mm256_add_epi32(c0[m], _mm256_madd_epi16(w0, s));
                c1[m] = _mm256_add_epi32(c1[m], _mm256_madd_epi16(w1, s));
            }
        }
        const __m256 a = _mm256_loadu_ps(ab + 8 * slice);
        const __m256 b = _mm256_loadu_ps(ab + BLOCK + 8 * slice);
        for (int m = 0; m < rows; m++) {
            /* hadd: columns 0, 1, 4, 5 | 2, 3, 6, 7; the permutation puts them in order */
            const __m256i u = _mm256_permute4x64_epi64(_mm256_hadd_epi32(c0[m], c1[m]), _MM_SHUFFLE(3, 1, 2, 0));
            const __m256i t = _mm256_sub_epi32(u, _mm256_set1_epi32(ROW_OFFSET(x, m0 + m, g, G)));
            const __m256 unit = _mm256_set1_ps(ROW_UNIT(x, m0 + m, g, G));
            __m256 c = _mm256_load_ps(acc[m] + 8 * slice);
            c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(a, unit), c);
            c = _mm256_fmadd_ps(b, _mm256_set1_ps(ROW_SUM(x, m0 + m, g, G)), c);
            _mm256_store_ps(acc[m] + 8 * slice, c);
        }
    }
}

#define Q8_PATH avx2
#define Q8_TARGET TARGET_AVX2
#define Q8_GROUP group_avx2
#include "gemm_q8_i8_path.h"

/* ---- AVX512-VNNI: vpdpbusd of the weights and each digit ---- */

TARGET_VNNI static inline ALWAYS_INLINE void group_vnni(const float *ab, const uint8_t *q, const q8_rows_t *x,
                                                        int64_t m0, int64_t g, float acc[][BLOCK], const int rows,
                                                        const int G, const int digits) {
    const int64_t K = x->K;
    __m512i hi[Q8_ROWS][2], lo[Q8_ROWS][2];
    for (int m = 0; m < rows; m++) hi[m][0] = hi[m][1] = lo[m][0] = lo[m][1] = _mm512_setzero_si512();
    for (int tq = 0; tq < G / 4; tq++) {
        const __m512i w0 = _mm512_loadu_si512(q + tq * Q8_QUAD), w1 = _mm512_loadu_si512(q + tq * Q8_QUAD + 64);
        for (int m = 0; m < rows; m++) {
            const int8_t *xm = x->digits + 2 * (m0 + m) * K + g * G + 4 * tq;
            int32_t h4, l4;
            memcpy(&h4, xm, sizeof h4);
            hi[m][0] = _mm512_dpbusd_epi32(hi[m][0], w0, _mm512_set1_epi32(h4));
            hi[m][1] = _mm512_dpbusd_epi32(hi[m][1], w1, _mm512_set1_epi32(h4));
            if (digits == 2) {
                memcpy(&l4, xm + K, sizeof l4);
                lo[m][0] = _mm512_dpbusd_epi32(lo[m][0], w0, _mm512_set1_epi32(l4));
                lo[m][1] = _mm512_dpbusd_epi32(lo[m][1], w1, _mm512_set1_epi32(l4));
            }
        }
    }
    for (int h = 0; h < 2; h++) {
        const __m512 a = _mm512_loadu_ps(ab + 16 * h);
        const __m512 b = _mm512_loadu_ps(ab + BLOCK + 16 * h);
        for (int m = 0; m < rows; m++) {
            const __m512i u = _mm512_add_epi32(_mm512_slli_epi32(hi[m][h], 8), lo[m][h]);
            const __m512i t = _mm512_sub_epi32(u, _mm512_set1_epi32(ROW_OFFSET(x, m0 + m, g, G)));
            __m512 c = _mm512_load_ps(acc[m] + 16 * h);
            c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(a, _mm512_set1_ps(ROW_UNIT(x, m0 + m, g, G))), c);
            c = _mm512_fmadd_ps(b, _mm512_set1_ps(ROW_SUM(x, m0 + m, g, G)), c);
            _mm512_store_ps(acc[m] + 16 * h, c);
        }
    }
}

#define Q8_PATH vnni
#define Q8_TARGET TARGET_VNNI
#define Q8_GROUP group_vnni
#include "gemm_q8_i8_path.h"
#endif

/* Per row and weight group of G k's: S = sum (256 hi + lo), its offset 128 * S and unit * S; with `wide`, each
 * 256 hi + lo as int16. Integer sums and one rounding, the same whichever path reads them. */
static void group_sums(int8_t *digits, int16_t *wide, const float *unit, float *sums, int32_t *offset, int64_t M,
                       int64_t K, int64_t G) {
    const int64_t ngw = K / G, ng = K / QGROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ngw; g++) {
            const int8_t *hi = digits + 2 * m * K + g * G, *lo = hi + K;
            int32_t S = 0;
            for (int64_t k = 0; k < G; k++) {
                const int32_t v = 256 * hi[k] + lo[k];
                S += v;
                if (wide) wide[m * K + g * G + k] = (int16_t)v;
            }
            offset[m * ngw + g] = 128 * S;
            sums[m * ngw + g] = unit[m * ng + g * G / QGROUP] * (float)S;
        }
}

/* x: [M, K] fp32 (K a multiple of 32); packed: WEIGHT_Q8_I8 records of G = 16 or 32 k's, plain or in
 * super-blocks of S groups (group_field = G | S << 8, gemm_common.h's group_record); bias: [N] or NULL; y: [M, N];
 * digits: 2 (x to ~15 bits) or 1 (8 bits). Returns 0, or 1 when the buffer cannot be allocated or an argument
 * is outside these. */
int gemm_q8_i8(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
               int64_t group_field, int64_t digits) {
    const int64_t group = RECORD_GROUP(group_field);
    const int supers = RECORD_SUPERS(group_field);
    if ((digits != 1 && digits != 2) || (group != 16 && group != 32) || K % QGROUP || supers < 0 ||
        (supers & (supers - 1)) || (supers && (K / group) % supers))
        return 1;
    const int path = int8_path_for(INT8_GEMM_Q8, M);
    const int64_t ng = K / QGROUP, ngw = K / group;
    const int wide = path != INT8_VNNI && path != INT8_AMX && path != INT8_AMX_EMULATED;
    /* one buffer: the digits, their int16 form, the units, their sums (unused here), the groups' sums */
    const int64_t digits_bytes = (2 * M * K + 63) & ~(int64_t)63, wide_bytes = wide ? digits_bytes : 0;
    const int64_t bytes = digits_bytes + wide_bytes + (2 * M * ng + 2 * M * ngw) * (int64_t)sizeof(float);
    int8_t *xq = aligned_alloc(64, (bytes + 63) & ~(int64_t)63);
    if (!xq) return 1;
    int16_t *x16 = wide ? (int16_t *)(xq + digits_bytes) : NULL;
    float *unit = (float *)(xq + digits_bytes + wide_bytes), *usum = unit + M * ng, *sums = usum + M * ng;
    int32_t *offset = (int32_t *)(sums + M * ngw);
    int8_quantize_rows(path, x, M, K, xq, unit, usum, digits);
    group_sums(xq, x16, unit, sums, offset, M, K, group);
    const q8_rows_t rows = {xq, x16, unit, sums, offset, K};
    switch (path) {
#if defined(__x86_64__)
        case INT8_VNNI:
        case INT8_AMX:
        case INT8_AMX_EMULATED: gemm_blocks_vnni(&rows, packed, bias, y, M, N, (int)group, (int)digits, supers); break;
        case INT8_AVX2: gemm_blocks_avx2(&rows, packed, bias, y, M, N, (int)group, (int)digits, supers); break;
#endif
        default: gemm_blocks_portable(&rows, packed, bias, y, M, N, (int)group, (int)digits, supers); break;
    }
    free(xq);
    return 0;
}
