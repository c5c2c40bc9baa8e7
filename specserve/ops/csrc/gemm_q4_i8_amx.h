/* gemm_q4_i8.c's kernel on AMX tiles, included there twice: with AMX_EMULATED 0 (the tile instructions) and 1
 * (the same tile operations written in C, which tests run on any AVX512-VNNI host to check this file's tile
 * layouts, the padding and the epilogue against the other paths). Q4A_PATH names the functions, Q4A_TARGET is
 * their target attribute.
 *
 * Per 32-column block and group of 32 k's: the group's nibbles unpacked to bytes are two B tiles (8 rows of
 * 4 k's x 16 columns x 4 bytes, the packed quads' own order: one for columns 0-15, one for 16-31); the
 * activations' hi and lo digits of 16 rows are two A tiles (16 rows x 32 bytes, read in place from the
 * quantized rows); four TDPBSUD (signed x unsigned bytes, exact int32 sums) give each row's sums of q_w * hi
 * and q_w * lo for the 32 columns, which take the VNNI path's epilogue, operation for operation. A call of
 * fewer than 16 rows has tiles of its rows (nothing stored or epilogued for rows it lacks); larger calls go
 * in chunks of 16 rows, the quantized rows padded with zeros to whole chunks. The configuration stays loaded
 * from call to call of the same chunk size (TILE_CONFIG). */
#define Q4A_JOIN(a, b) a##_##b
#define Q4A_NAME(a, b) Q4A_JOIN(a, b)

#include "amx_tile_ops.h"

/* y [M, N] from the quantized rows (xq: quantize_rows with `digits`, padded with zero rows to amx_rows(M)),
 * the packed blocks and acc_all (per thread, amx_rows(M) rows x 32 fp32 accumulators). */
Q4A_TARGET static void Q4A_NAME(gemm_blocks, Q4A_PATH)(const int8_t *xq, const float *xu, const float *xs,
                                                       const uint8_t *packed, const float *bias, float *y,
                                                       int64_t M, int64_t K, int64_t N, float *acc_all,
                                                       int digits, int supers) {
    const int64_t ng = K / QGROUP, nblocks = (N + BLOCK - 1) / BLOCK;
    const int64_t block_bytes = records_bytes(ng, Q4_QBYTES, supers), stride = block_bytes / ng;
    const int64_t padded = amx_rows(M), chunk = M < AMX_ROWS ? M : AMX_ROWS;
#pragma omp parallel if (M * K * N >= (1 << 18))
    {
        tile_config_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        for (int t = TILE_C0; t <= TILE_C3; t++) cfg.rows[t] = (uint8_t)chunk, cfg.colsb[t] = 64;
        cfg.rows[TILE_AHI] = cfg.rows[TILE_ALO] = (uint8_t)chunk;
        cfg.colsb[TILE_AHI] = cfg.colsb[TILE_ALO] = QGROUP;
        cfg.rows[TILE_B0] = cfg.rows[TILE_B1] = QGROUP / 4;
        cfg.colsb[TILE_B0] = cfg.colsb[TILE_B1] = 64;
        TILE_CONFIG(&cfg);
        uint8_t wbuf[2][QGROUP / 4 * 64] __attribute__((aligned(64)));
        int32_t cbuf[4][AMX_ROWS][16] __attribute__((aligned(64)));
        v16 (*acc)[2] = (v16(*)[2])(acc_all + omp_get_thread_num() * padded * BLOCK);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nblocks; b++) {
            const uint8_t *w = packed + b * block_bytes;
            const int64_t col = b * BLOCK, ncols = N - col < BLOCK ? N - col : BLOCK;
            for (int64_t m = 0; m < M; m++) acc[m][0] = acc[m][1] = (v16){0};
            for (int64_t g = 0; g < ng; g++) {
                float made[2 * BLOCK];
                const float *ab;
                const uint8_t *q = group_record(w, g, Q4_QBYTES, supers, made, &ab);
                for (int line = 0; line < stride; line += 64)
                    __builtin_prefetch(w + (g + I8_PREFETCH) * stride + line);
                v16 a0, a1, b0, b1;
                memcpy(&a0, ab, sizeof a0);
                memcpy(&a1, ab + 16, sizeof a1);
                memcpy(&b0, ab + BLOCK, sizeof b0);
                memcpy(&b1, ab + BLOCK + 16, sizeof b1);
                for (int t = 0; t < QGROUP / 4; t++) {
                    u8v v;
                    memcpy(&v, q + t * 64, sizeof v);
                    const u8v w0 = v & 15, w1 = v >> 4;
                    memcpy(wbuf[0] + t * 64, &w0, 64);
                    memcpy(wbuf[1] + t * 64, &w1, 64);
                }
                TILE_LOAD(TILE_B0, wbuf[0], 64);
                TILE_LOAD(TILE_B1, wbuf[1], 64);
                for (int64_t m0 = 0; m0 < M; m0 += chunk) {
                    const int8_t *x = xq + 2 * m0 * K + g * QGROUP;
                    TILE_LOAD(TILE_AHI, x, 2 * K);
                    TILE_LOAD(TILE_ALO, x + K, 2 * K);
                    TILE_ZERO(TILE_C0);
                    TILE_ZERO(TILE_C1);
                    TILE_ZERO(TILE_C2);
                    TILE_ZERO(TILE_C3);
                    TILE_DPBSUD(TILE_C0, TILE_AHI, TILE_B0);
                    TILE_DPBSUD(TILE_C2, TILE_AHI, TILE_B1);
                    if (digits == 2) { /* one digit: the lo sums stay zero */
                        TILE_DPBSUD(TILE_C1, TILE_ALO, TILE_B0);
                        TILE_DPBSUD(TILE_C3, TILE_ALO, TILE_B1);
                    }
                    TILE_STORE(TILE_C0, cbuf[0], 64);
                    TILE_STORE(TILE_C1, cbuf[1], 64);
                    TILE_STORE(TILE_C2, cbuf[2], 64);
                    TILE_STORE(TILE_C3, cbuf[3], 64);
                    const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t m = m0 + r;
                        i32v hi0, lo0, hi1, lo1;
                        memcpy(&hi0, cbuf[0][r], 64);
                        memcpy(&lo0, cbuf[1][r], 64);
                        memcpy(&hi1, cbuf[2][r], 64);
                        memcpy(&lo1, cbuf[3][r], 64);
                        const v16 u = (v16){0} + xu[m * ng + g], s = (v16){0} + xs[m * ng + g];
                        acc[m][0] = fmadd_vnni(__builtin_convertvector((hi0 << 8) + lo0, v16), a0 * u, acc[m][0]);
                        acc[m][0] = fmadd_vnni(b0, s, acc[m][0]);
                        acc[m][1] = fmadd_vnni(__builtin_convertvector((hi1 << 8) + lo1, v16), a1 * u, acc[m][1]);
                        acc[m][1] = fmadd_vnni(b1, s, acc[m][1]);
                    }
                }
            }
            for (int64_t m = 0; m < M; m++)
                store_rows(acc + m, y + m * N + col, N, ncols, NULL, bias ? bias + col : NULL, 1);
        }
    }
}

#include "amx_tile_ops_end.h"
#undef Q4A_NAME
#undef Q4A_JOIN
