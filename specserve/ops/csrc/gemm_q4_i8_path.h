/* One instruction-set path of gemm_q4_i8.c, included there once per path with these defined: Q4_PATH (the
 * suffix of its functions' names), Q4_TARGET (their target attribute, or nothing), Q4_DOT4 (16 lanes of 4 u8 x
 * s8 products added to int32), Q4_FMADD (fused multiply-add of 16 floats) and Q4_QUANTIZE_GROUP (32 values to
 * two int8 digits). Every path does the same arithmetic in the same order. */
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

Q4_TARGET static inline ALWAYS_INLINE void Q4_NAME(block_rows, Q4_PATH)(
    const uint8_t *restrict w, const int8_t *restrict xq, const float *restrict xu, const float *restrict xs,
    int64_t K, float *restrict y, int64_t N, int64_t ncols, const float *bias, const int rows, const int digits) {
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
        i32v hi[I8_ROWS][2], lo[I8_ROWS][2]; /* per row and half: sums of q_w * hi and q_w * lo */
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
                hi[m][0] = Q4_DOT4(hi[m][0], w0, h4);
                hi[m][1] = Q4_DOT4(hi[m][1], w1, h4);
                if (digits == 2) {
                    lo[m][0] = Q4_DOT4(lo[m][0], w0, l4);
                    lo[m][1] = Q4_DOT4(lo[m][1], w1, l4);
                }
            }
        }
        for (int m = 0; m < rows; m++) {
            /* 256 * hi + lo is exact in int32 (|.| < 2^24) and in fp32 */
            const v16 u = (v16){0} + xu[m * ng + g], s = (v16){0} + xs[m * ng + g];
            acc[m][0] = Q4_FMADD(__builtin_convertvector((hi[m][0] << 8) + lo[m][0], v16), a0 * u, acc[m][0]);
            acc[m][0] = Q4_FMADD(b0, s, acc[m][0]);
            acc[m][1] = Q4_FMADD(__builtin_convertvector((hi[m][1] << 8) + lo[m][1], v16), a1 * u, acc[m][1]);
            acc[m][1] = Q4_FMADD(b1, s, acc[m][1]);
        }
    }
    store_rows(acc, y, N, ncols, NULL, bias, rows);
}

/* y [M, N] from the quantized rows (xq, xu, xs: quantize_rows with `digits`) and the packed blocks, blocks
 * of 32 columns shared among the threads. */
Q4_TARGET static void Q4_NAME(gemm_blocks, Q4_PATH)(const int8_t *xq, const float *xu, const float *xs,
                                                    const uint8_t *packed, const float *bias, float *y, int64_t M,
                                                    int64_t K, int64_t N, int digits) {
    const int64_t ng = K / QGROUP, nblocks = (N + BLOCK - 1) / BLOCK, block_bytes = ng * Q4_RECORD;
#pragma omp parallel for schedule(static) if (M * K * N >= (1 << 18))
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *w = packed + b * block_bytes;
        const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
        const float *bb = bias ? bias + col : NULL;
        int64_t m = 0;
#define CALL_I8(rows, digits)                                                                                \
    Q4_NAME(block_rows, Q4_PATH)(w, xq + 2 * m * K, xu + m * ng, xs + m * ng, K, y + m * N + col, N, ncols, bb, \
                                 rows, digits)
#define ROWS_I8(digits)                                                      \
    for (; m + I8_ROWS <= M; m += I8_ROWS) CALL_I8(I8_ROWS, digits);         \
    switch (M - m) {                                                         \
        case 1: CALL_I8(1, digits); break;                                   \
        case 2: CALL_I8(2, digits); break;                                   \
        case 3: CALL_I8(3, digits); break;                                   \
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
}

#undef Q4_NAME
#undef Q4_JOIN
