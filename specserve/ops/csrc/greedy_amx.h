/* greedy.c's screen on AMX tiles, included there twice: with AMX_EMULATED 0 (the tile instructions) and 1 (the
 * same operations in C, amx_tiles.h, for tests). Per block of 16 columns and 16 activation rows (R of them
 * where R < 16), one int32 C
 * tile summed over K 64 bytes at a time: TDPBUSD of the activations' unsigned bytes (A: 16 rows x 64 bytes,
 * read in place) and the block's signed weights (B: 16 rows of 4 k's x 16 columns x 4 bytes, the screen's own
 * order), then a shorter A and B for the last K4 % 16 quads. Exact integer sums, as on the other paths. */
#define SA_JOIN(a, b) a##_##b
#define SA_NAME(a, b) SA_JOIN(a, b)

#include "amx_tile_ops.h"

SA_TARGET static void SA_NAME(screen_dots, SA_PATH)(const uint8_t *xu, int64_t R, int64_t K4, const int8_t *packed,
                                                    int64_t Np, int32_t *dots) {
    const int64_t chunks = K4 / 16, tail = K4 % 16, chunk = R < 16 ? R : 16;
#pragma omp parallel if (R * K4 * Np >= (1 << 16))
    {
        tile_config_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[3] = (uint8_t)chunk; /* C, A, the tail's A */
        cfg.rows[2] = 16;                                          /* B: 16 quads of k */
        cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = cfg.colsb[4] = 64;
        cfg.colsb[3] = (uint16_t)(4 * (tail ? tail : 16));
        cfg.rows[4] = (uint8_t)(tail ? tail : 16); /* the tail's B */
        TILE_CONFIG(&cfg);
        int32_t cbuf[16][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < Np / SCREEN_COLS; b++) {
            const int8_t *w = packed + b * K4 * 64;
            for (int64_t r0 = 0; r0 < R; r0 += chunk) {
                const uint8_t *x = xu + r0 * K4 * 4;
                TILE_ZERO(0);
                for (int64_t c = 0; c < chunks; c++) {
                    TILE_LOAD(1, x + c * 64, K4 * 4);
                    TILE_LOAD(2, w + c * 16 * 64, 64);
                    TILE_DPBUSD(0, 1, 2);
                }
                if (tail) {
                    TILE_LOAD(3, x + chunks * 64, K4 * 4);
                    TILE_LOAD(4, w + chunks * 16 * 64, 64);
                    TILE_DPBUSD(0, 3, 4);
                }
                TILE_STORE(0, cbuf, 64);
                for (int64_t r = 0; r < chunk && r0 + r < R; r++)
                    memcpy(dots + (r0 + r) * Np + b * SCREEN_COLS, cbuf[r], sizeof cbuf[r]);
            }
        }
    }
}

#include "amx_tile_ops_end.h"
#undef SA_NAME
#undef SA_JOIN
