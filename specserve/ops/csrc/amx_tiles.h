/* AMX tile state for the kernels' AMX paths (gemm_q4_i8_amx.h, greedy.c): the ldtilecfg operand, and the tile
 * operations written in C as Intel's pseudo-code defines them, on per-thread tiles, so that the AMX paths'
 * code runs (as their "emulated" variants) and is tested on CPUs without AMX. */
#ifndef SPECSERVE_AMX_TILES_H
#define SPECSERVE_AMX_TILES_H

#include <stdint.h>
#include <string.h>

/* The tile intrinsics need GCC 11 or Clang 12: an older compiler builds every other path, and the emulated
 * one (INT8_AMX_BUILT 0). */
#ifndef INT8_AMX_BUILT
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define INT8_AMX_BUILT 1
#else
#define INT8_AMX_BUILT 0
#endif
#endif

/* The 64-byte operand of ldtilecfg (palette 1). */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config_t;

static __thread struct {
    tile_config_t cfg;
    uint8_t data[8][16][64];
} emu;

static inline void emu_tile_config(const tile_config_t *cfg) {
    emu.cfg = *cfg;
    memset(emu.data, 0, sizeof emu.data);
}

/* emu_tile_config unless `cfg` is the configuration already loaded (what TILE_CONFIG does on real tiles) */
static inline void emu_tile_config_kept(const tile_config_t *cfg) {
    if (memcmp(&emu.cfg, cfg, sizeof *cfg) != 0) emu_tile_config(cfg);
}

static inline void emu_tile_load(int t, const void *p, int64_t stride) {
    memset(emu.data[t], 0, sizeof emu.data[t]);
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy(emu.data[t][r], (const uint8_t *)p + r * stride, emu.cfg.colsb[t]);
}

static inline void emu_tile_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu.cfg.rows[t]; r++) memcpy((uint8_t *)p + r * stride, emu.data[t][r], emu.cfg.colsb[t]);
}

static inline void emu_tile_zero(int t) { memset(emu.data[t], 0, sizeof emu.data[t]); }

/* c[m][n] += sum over k of the 4 products a[m][4k + i] * b[k][4n + i] into int32 lanes, the bytes of a and b
 * signed or not as a_signed and b_signed say (TDPBSUD: 1, 0; TDPBUSD: 0, 1). */
static inline void emu_tile_dp(int c, int a, int b, int a_signed, int b_signed) {
    for (int m = 0; m < emu.cfg.rows[c]; m++)
        for (int n = 0; n < emu.cfg.colsb[c] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &emu.data[c][m][4 * n], 4);
            for (int k = 0; k < emu.cfg.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t x = emu.data[a][m][4 * k + i], y = emu.data[b][k][4 * n + i];
                    sum += (a_signed ? (int32_t)(int8_t)x : (int32_t)x) * (b_signed ? (int32_t)(int8_t)y : (int32_t)y);
                }
            memcpy(&emu.data[c][m][4 * n], &sum, 4);
        }
}

#endif
