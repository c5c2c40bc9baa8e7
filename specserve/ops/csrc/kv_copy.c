/* Writes a token's keys and values into a paged KV cache in its storage format (kv_format.h). Values are
 * stored token by token, [num_blocks, block_size, num_kv_heads, row]; keys transposed within each block,
 * [num_blocks, num_kv_heads, row, block_size] (paged_attention.c reads a block's keys dimension by
 * dimension); row = head_dim, or head_dim + 4 scale bytes for int8. */
#include <stdint.h>

#include "kv_format.h"

/* Slot `slot`'s key and value (num_kv_heads * head_dim floats each) into the caches, stored as kv_dtype. */
void store_kv(void *k_cache, void *v_cache, int64_t kv_dtype, int64_t slot, const float *key, const float *value,
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t row = kv_row_elems(head_dim, kv_dtype), esz = kv_elem_bytes(kv_dtype);
    char *kb = (char *)k_cache + (slot / block_size * num_kv_heads * row * block_size + slot % block_size) * esz;
    char *vt = (char *)v_cache + slot * num_kv_heads * row * esz;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        kv_encode_row(kb + h * row * block_size * esz, key + h * head_dim, head_dim, block_size, kv_dtype);
        kv_encode_row(vt + h * row * esz, value + h * head_dim, head_dim, 1, kv_dtype);
    }
}
