/* The tile operations of the AMX paths (gemm_q4_i8_amx.h, greedy_amx.h): included (no guard) after defining
 * AMX_EMULATED 0 for the tile instructions or 1 for their C emulation (amx_tiles.h); #undef with
 * amx_tile_ops_end.h. */
/* TILE_CONFIG loads a configuration only where the thread's tiles hold another (read back with sttilecfg:
 * whatever else ran on the thread, oneDNN's AMX kernels say, may have loaded or released one), so that the
 * pool's threads keep one from call to call instead of paying ldtilecfg, which also zeroes the tiles, each
 * time; the kernels leave it loaded (no tilerelease). */
#if AMX_EMULATED
#define TILE_CONFIG(cfg) emu_tile_config_kept(cfg)
#define TILE_LOAD(t, p, stride) emu_tile_load(t, p, stride)
#define TILE_STORE(t, p, stride) emu_tile_store(t, p, stride)
#define TILE_ZERO(t) emu_tile_zero(t)
#define TILE_DPBSUD(c, a, b) emu_tile_dp(c, a, b, 1, 0)
#define TILE_DPBUSD(c, a, b) emu_tile_dp(c, a, b, 0, 1)
#else
#define TILE_CONFIG(cfg)                                              \
    do {                                                              \
        tile_config_t loaded_;                                        \
        _tile_storeconfig(&loaded_);                                  \
        if (memcmp(&loaded_, (cfg), sizeof loaded_) != 0) _tile_loadconfig(cfg); \
    } while (0)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#endif
