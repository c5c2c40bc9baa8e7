/* Writes into and copies between paged KV caches (a drafter that runs the target's own weights takes the
 * target's verified KV instead of recomputing it). Values are stored token by token, [num_blocks,
 * block_size, num_kv_heads * head_dim]; keys transposed within each block, [num_blocks, num_kv_heads *
 * head_dim, block_size] (paged_attention.c reads a block's keys dimension by dimension). */
#include <stdint.h>
#include <string.h>

/* Where slot `slot`'s first key float lies; its i-th is block_size floats further for each i. */
static inline int64_t key_offset(int64_t slot, int64_t row_floats, int64_t block_size) {
    return slot / block_size * row_floats * block_size + slot % block_size;
}

/* Slot `slot`'s key (row_floats floats: num_kv_heads * head_dim) into a key cache. */
void store_key(float *k_cache, int64_t slot, const float *key, int64_t row_floats, int64_t block_size) {
    float *dst = k_cache + key_offset(slot, row_floats, block_size);
    for (int64_t i = 0; i < row_floats; i++) dst[i * block_size] = key[i];
}

/* For every layer l < num_layers, rows dst_rows[i] of dst[2l] (keys) and dst[2l + 1] (values) = rows
 * src_rows[i] of src[2l] and src[2l + 1], for i < n; a row is one token's row_floats floats. */
void copy_kv_rows_f32(float *const *dst, const float *const *src, int64_t num_layers, const int64_t *dst_rows,
                      const int64_t *src_rows, int64_t n, int64_t row_floats, int64_t block_size) {
#pragma omp parallel for if (num_layers * n * row_floats >= (1 << 19))
    for (int64_t l = 0; l < num_layers; l++)
        for (int64_t i = 0; i < n; i++) {
            const int64_t d = dst_rows[i], s = src_rows[i];
            float *dk = dst[2 * l] + key_offset(d, row_floats, block_size);
            const float *sk = src[2 * l] + key_offset(s, row_floats, block_size);
            for (int64_t j = 0; j < row_floats; j++) dk[j * block_size] = sk[j * block_size];
            memcpy(dst[2 * l + 1] + d * row_floats, src[2 * l + 1] + s * row_floats, sizeof(float) * row_floats);
        }
}
