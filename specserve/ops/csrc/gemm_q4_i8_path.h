/* One instruction-set path of gemm_q4_i8.c, included there once per path with these defined: Q4_PATH (the
 * suffix of its functions' names), Q4_TARGET (their target attribute, or nothing), Q4_L (the lanes of its
 * vectors: 16 for 512-bit registers, 8 for 256-bit ones, whose wider vectors GCC would keep in memory), Q4_F /
 * Q4_I / Q4_U (its vectors of Q4_L floats, Q4_L int32 and 4 * Q4_L bytes), Q4_DOT4 (Q4_L lanes of 4 u8 x s8
 * products added to int32), Q4_FMADD (fused multiply-add of Q4_L floats) and Q4_QUANTIZE_GROUP (32 values to
 * two int8 digits); optionally Q4_ACC, the type Q4_DOT4 adds into within a group, and Q4_ACC_SUM, which turns
 * it into Q4_I once a group (by default Q4_I itself, unchanged). Every path does the same arithmetic in the
 * same order, lane for lane, and the integer sums are exact on each. The header undefines these at its end,
 * ready for the next path. */
#ifndef Q4_ACC
#define Q4_ACC Q4_I
#define Q4_ACC_SUM(x) (x)
#endif
#define Q4_JOIN(a, b) a##_##b
#define Q4_NAME(a, b) Q4_JOIN(a, b)

Q4_TARGET static void Q4_NAME(quantize_rows, Q4_PATH)(const float *x, int64_t M, int64_t K, int8_t *q, float *unit,
                                                      float *usum, int digits) {
    const int64_t ng = K / QGROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ng; g++) {
            int8_t *hi = q + 2 * m * K + g * QGROUP;
            float d;
            const int32_t sum = digits == 2 ? Q4_QUANTIZE_GROUP(x + m * K + g * QGROUP, hi, hi + K, &d, 2)
                                            : Q4_QUANTIZE_GROUP(x + m * K + g * QGROUP, hi, hi + K, &d, 1);
            unit[m * ng + g] = d / 256.0f;
            usum[m * ng + g] = d / 256.0f * (float)sum;
        }
}

#define Q4_P (16 / Q4_L) /* vectors per half block (16 columns) */

/* Columns h * 16 + p * Q4_L + lane of acc[m][h][p]: each row's 32 accumulators in column order. */
Q4_TARGET static inline ALWAYS_INLINE void Q4_NAME(block_rows, Q4_PATH)(
    const uint8_t *restrict w, const int8_t *restrict xq, const float *restrict xu, const float *restrict xs,
    int64_t K, float *restrict y, int64_t N, int64_t ncols, const float *bias, const int rows, const int digits,
    const int supers, float *restrict scales, const int make) {
    Q4_F acc[Q4_ROWS][2][Q4_P];
    for (int m = 0; m < rows; m++)
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < Q4_P; p++) acc[m][h][p] = (Q4_F){0};
    const int64_t ng = K / QGROUP, stride = records_bytes(ng, Q4_QBYTES, supers) / ng; /* bytes a group */
    float made[2 * BLOCK];
    for (int64_t g = 0; g < ng; g++) {
        /* a, b: the record's own, or made here (into the block's scales on its first pass, which later passes
         * read) */
        const float *ab;
        const uint8_t *q;
        if (scales && !make) {
            q = group_q(w, g, Q4_QBYTES, supers);
            ab = scales + g * 2 * BLOCK;
        } else {
            q = group_record(w, g, Q4_QBYTES, supers, scales ? scales + g * 2 * BLOCK : made, &ab);
        }
        for (int line = 0; line < stride; line += 64) __builtin_prefetch(w + (g + I8_PREFETCH) * stride + line);
        Q4_ACC hi[Q4_ROWS][2][Q4_P], lo[Q4_ROWS][2][Q4_P]; /* per row, half and part: sums of q_w * hi, q_w * lo */
        for (int m = 0; m < rows; m++)
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < Q4_P; p++) hi[m][h][p] = lo[m][h][p] = (Q4_ACC){0};
        for (int t = 0; t < QGROUP / 4; t++)
            for (int p = 0; p < Q4_P; p++) {
                Q4_U v;
                memcpy(&v, q + t * 64 + p * sizeof v, sizeof v);
                const Q4_U w0 = v & 15, w1 = v >> 4;
                for (int m = 0; m < rows; m++) {
                    const int8_t *xm = xq + 2 * m * K + g * QGROUP + 4 * t;
                    int32_t h4, l4;
                    memcpy(&h4, xm, sizeof h4);
                    memcpy(&l4, xm + K, sizeof l4);
                    hi[m][0][p] = Q4_DOT4(hi[m][0][p], w0, h4);
                    hi[m][1][p] = Q4_DOT4(hi[m][1][p], w1, h4);
                    if (digits == 2) {
                        lo[m][0][p] = Q4_DOT4(lo[m][0][p], w0, l4);
                        lo[m][1][p] = Q4_DOT4(lo[m][1][p], w1, l4);
                    }
                }
            }
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < Q4_P; p++) {
                Q4_F a, b;
                memcpy(&a, ab + h * 16 + p * Q4_L, sizeof a);
                memcpy(&b, ab + BLOCK + h * 16 + p * Q4_L, sizeof b);
                for (int m = 0; m < rows; m++) {
                    /* 256 * hi + lo is exact in int32 (|.| < 2^24) and in fp32 */
                    const Q4_F u = (Q4_F){0} + xu[m * ng + g], s = (Q4_F){0} + xs[m * ng + g];
                    const Q4_I sum = (Q4_ACC_SUM(hi[m][h][p]) << 8) + Q4_ACC_SUM(lo[m][h][p]);
                    acc[m][h][p] = Q4_FMADD(__builtin_convertvector(sum, Q4_F), a * u, acc[m][h][p]);
                    acc[m][h][p] = Q4_FMADD(b, s, acc[m][h][p]);
                }
            }
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

/* y [M, N] from the quantized rows (xq, xu, xs: quantize_rows with `digits`) and the packed blocks, blocks
 * of 32 columns shared among the threads. */
Q4_TARGET static void Q4_NAME(gemm_blocks, Q4_PATH)(const int8_t *xq, const float *xu, const float *xs,
                                                    const uint8_t *packed, const float *bias, float *y, int64_t M,
                                                    int64_t K, int64_t N, int digits, int supers) {
    const int64_t ng = K / QGROUP, nblocks = (N + BLOCK - 1) / BLOCK;
    const int64_t block_bytes = records_bytes(ng, Q4_QBYTES, supers);
    /* a block in super-blocks that takes more than one pass: its scales made on the first, not on each */
    const int once = supers && M > Q4_ROWS;
#pragma omp parallel if (M * K * N >= (1 << 18))
    {
        float *scales = once ? aligned_alloc(64, ng * 2 * BLOCK * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *w = packed + b * block_bytes;
            const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
            const float *bb = bias ? bias + col : NULL;
            int64_t m = 0;
#define CALL_I8(rows, digits)                                                                                \
    Q4_NAME(block_rows, Q4_PATH)(w, xq + 2 * m * K, xu + m * ng, xs + m * ng, K, y + m * N + col, N, ncols, bb, \
                                 rows, digits, supers, scales, m == 0)
#define ROWS_I8(digits)                                                      \
    for (; m + Q4_ROWS <= M; m += Q4_ROWS) CALL_I8(Q4_ROWS, digits);         \
    switch (M - m) {                                                         \
        case 1: CALL_I8(1, digits); break;                                   \
        case 2: if (Q4_ROWS > 2) CALL_I8(2, digits); break;                  \
        case 3: if (Q4_ROWS > 3) CALL_I8(3, digits); break;                  \
        default: break;                                                      \
    }
            if (digits == 2) {
                ROWS_I8(2)
            } else {
                ROWS_I8(1)
            }
#undef ROWS_I8
#undef CALL_I8
        }
        free(scales);
    }
}

#undef Q4_P
#undef Q4_NAME
#undef Q4_JOIN
#undef Q4_PATH
#undef Q4_TARGET
#undef Q4_L
#undef Q4_F
#undef Q4_I
#undef Q4_U
#undef Q4_ROWS
#undef Q4_DOT4
#undef Q4_ACC
#undef Q4_ACC_SUM
#undef Q4_FMADD
#undef Q4_QUANTIZE_GROUP
