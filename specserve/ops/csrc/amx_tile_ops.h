/* The tile operations of the AMX paths (gemm_q4_i8_amx.h, greedy_amx.h): included (no guard) after defining
 * AMX_EMULATED 0 for the tile instructions or 1 for their C emulation (amx_tiles.h); #undef with
 * amx_tile_ops_end.h. */
#if AMX_EMULATED
#define TILE_CONFIG(cfg) emu_tile_config(cfg)
#define TILE_LOAD(t, p, stride) emu_tile_load(t, p, stride)
#define TILE_STORE(t, p, stride) emu_tile_store(t, p, stride)
#define TILE_ZERO(t) emu_tile_zero(t)
#define TILE_DPBSUD(c, a, b) emu_tile_dp(c, a, b, 1, 0)
#define TILE_DPBUSD(c, a, b) emu_tile_dp(c, a, b, 0, 1)
#define TILE_RELEASE() emu_tile_release()
#else
#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define TILE_RELEASE() _tile_release()
#endif
