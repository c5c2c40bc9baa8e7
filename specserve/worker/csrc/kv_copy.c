/* Rows copied between paged KV caches, every layer's K and V in one call: a drafter that runs the
 * target's own weights takes the target's verified KV instead of recomputing it. */
#include <stdint.h>
#include <string.h>

/* dst[t] row dst_rows[i] = src[t] row src_rows[i] for every tensor t < num_tensors and i < n; a row is
 * row_floats floats (one token's num_kv_heads * head_dim). */
void copy_rows_f32(float *const *dst, const float *const *src, int64_t num_tensors, const int64_t *dst_rows,
                   const int64_t *src_rows, int64_t n, int64_t row_floats) {
#pragma omp parallel for if (num_tensors * n * row_floats >= (1 << 20))
    for (int64_t t = 0; t < num_tensors; t++)
        for (int64_t i = 0; i < n; i++)
            memcpy(dst[t] + dst_rows[i] * row_floats, src[t] + src_rows[i] * row_floats,
                   sizeof(float) * row_floats);
}
