/* Writes a token's key into a paged key cache. Values are stored token by token, [num_blocks,
 * block_size, num_kv_heads * head_dim]; keys transposed within each block, [num_blocks, num_kv_heads *
 * head_dim, block_size] (paged_attention.c reads a block's keys dimension by dimension). */
#include <stdint.h>

/* Where slot `slot`'s first key float lies; its i-th is block_size floats further for each i. */
static inline int64_t key_offset(int64_t slot, int64_t row_floats, int64_t block_size) {
    return slot / block_size * row_floats * block_size + slot % block_size;
}

/* Slot `slot`'s key (row_floats floats: num_kv_heads * head_dim) into a key cache. */
void store_key(float *k_cache, int64_t slot, const float *key, int64_t row_floats, int64_t block_size) {
    float *dst = k_cache + key_offset(slot, row_floats, block_size);
    for (int64_t i = 0; i < row_floats; i++) dst[i * block_size] = key[i];
}
