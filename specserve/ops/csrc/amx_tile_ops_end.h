/* Ends amx_tile_ops.h's definitions. */
#undef TILE_CONFIG
#undef TILE_LOAD
#undef TILE_STORE
#undef TILE_ZERO
#undef TILE_DPBSUD
#undef TILE_DPBUSD
