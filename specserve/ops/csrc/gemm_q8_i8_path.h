/* One instruction-set path of gemm_q8_i8.c, included there once per path with these defined: Q8_PATH (the
 * suffix of its functions' names), Q8_TARGET (their target attribute, or nothing) and Q8_GROUP (one weight
 * group's step for up to Q8_ROWS rows, from its fp32 a[32], b[32] and its q bytes: the exact integer sums T,
 * then each row's 32 accumulators acc =
 * fma(T, a * unit, acc), acc = fma(b, unit * S, acc), the same fp32 operations on every path). The header
 * undefines these at its end, ready for the next path. */
#define Q8_JOIN(a, b) a##_##b
#define Q8_NAME(a, b) Q8_JOIN(a, b)

/* One block of 32 columns for `rows` rows (from row m0), weight group by weight group. */
Q8_TARGET static inline ALWAYS_INLINE void Q8_NAME(block_rows, Q8_PATH)(
    const uint8_t *restrict w, const q8_rows_t *restrict x, int64_t m0, float *restrict y, int64_t N, int64_t ncols,
    const float *bias, const int rows, const int G, const int digits, const int supers, float *restrict scales,
    const int make) {
    float acc[Q8_ROWS][BLOCK] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    const int64_t ngw = x->K / G, stride = records_bytes(ngw, G * BLOCK, supers) / ngw; /* bytes a group */
    float made[2 * BLOCK];
    for (int64_t g = 0; g < ngw; g++) {
        /* a, b: the record's own, or made here (into the block's scales on its first pass, which later passes
         * read) */
        const float *ab;
        const uint8_t *q;
        if (scales && !make) {
            q = group_q(w, g, G * BLOCK, supers);
            ab = scales + g * 2 * BLOCK;
        } else {
            q = group_record(w, g, G * BLOCK, supers, scales ? scales + g * 2 * BLOCK : made, &ab);
        }
        for (int64_t line = 0; line < stride; line += 64) __builtin_prefetch(w + g * stride + Q8_PREFETCH + line);
        Q8_GROUP(ab, q, x, m0, g, acc, rows, G, digits);
    }
    store_acc(acc, y, N, ncols, bias, rows);
}

/* The rows of one block in chunks of Q8_ROWS, G and digits compile-time constants. */
Q8_TARGET static inline ALWAYS_INLINE void Q8_NAME(block, Q8_PATH)(const uint8_t *w, const q8_rows_t *x, int64_t M,
                                                                    float *y, int64_t N, int64_t ncols,
                                                                    const float *bias, const int G, const int digits,
                                                                    const int supers, float *scales) {
    int64_t m = 0;
#define CALL_Q8(rows) \
    Q8_NAME(block_rows, Q8_PATH)(w, x, m, y + m * N, N, ncols, bias, rows, G, digits, supers, scales, m == 0)
    for (; m + Q8_ROWS <= M; m += Q8_ROWS) CALL_Q8(Q8_ROWS);
    switch (M - m) {
        case 1: CALL_Q8(1); break;
        case 2: CALL_Q8(2); break;
        case 3: CALL_Q8(3); break;
        default: break;
    }
#undef CALL_Q8
}

/* y [M, N] from the prepared rows and the packed blocks, blocks of 32 columns shared among the threads. */
Q8_TARGET static void Q8_NAME(gemm_blocks, Q8_PATH)(const q8_rows_t *x, const uint8_t *packed, const float *bias,
                                                    float *y, int64_t M, int64_t N, int G, int digits,
                                                    int supers) {
    const int64_t K = x->K, nblocks = (N + BLOCK - 1) / BLOCK, block_bytes = records_bytes(K / G, G * BLOCK, supers);
    /* a block in super-blocks that takes more than one pass: its scales made on the first, not on each */
    const int once = supers && M > Q8_ROWS;
#pragma omp parallel if (M * K * N >= (1 << 18))
    {
        float *scales = once ? aligned_alloc(64, K / G * 2 * BLOCK * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *w = packed + b * block_bytes;
            const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
            const float *bb = bias ? bias + col : NULL;
            if (G == 32 && digits == 2) Q8_NAME(block, Q8_PATH)(w, x, M, y + col, N, ncols, bb, 32, 2, supers, scales);
            else if (G == 32) Q8_NAME(block, Q8_PATH)(w, x, M, y + col, N, ncols, bb, 32, 1, supers, scales);
            else if (digits == 2) Q8_NAME(block, Q8_PATH)(w, x, M, y + col, N, ncols, bb, 16, 2, supers, scales);
            else Q8_NAME(block, Q8_PATH)(w, x, M, y + col, N, ncols, bb, 16, 1, supers, scales);
        }
        free(scales);
    }
}

#undef Q8_NAME
#undef Q8_JOIN
#undef Q8_PATH
#undef Q8_TARGET
#undef Q8_GROUP
