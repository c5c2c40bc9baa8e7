/* How a paged KV cache stores one kv head's key or value of one token (a "row" of head_dim numbers), for
 * kv_copy.c (writes) and paged_attention.c (reads); specserve/ops/kv_cache.py is the PyTorch side.
 *   KV_F32   head_dim floats.
 *   KV_BF16  head_dim bfloat16s: fp32's top 16 bits, rounded to nearest even (torch's .to(bfloat16)).
 *   KV_I8    head_dim int8s q, then an fp32 scale (its 4 bytes) per group of KV_GROUP numbers (the last
 *            group may be shorter): number i is q[i] * s[i / KV_GROUP], with s = max|x| / 127 over the group
 *            and q = round(x / s). Scales of a token's own numbers make its stored bits a function of its
 *            own key or value, so a verification step writes what a one-token step would (a scale per block
 *            would change as later tokens join the block, and with it the numbers earlier tokens read back).
 *            80 bytes for head_dim 64 (3.2x fewer than fp32), 160 for head_dim 128.
 * Values are stored row after row; keys transposed within each block ([kv head][row element][block slot]),
 * so element i + 1 of a key row, or the next byte of its int8 scales, lies block_size elements further. */
#ifndef SPECSERVE_KV_FORMAT_H
#define SPECSERVE_KV_FORMAT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 }; /* specserve/ops/kv_cache.py's KV_CODES */
#define KV_SCALE_BYTES 4
#define KV_GROUP 16 /* numbers of an int8 row that share a scale (kv_cache.py's INT8_GROUP) */

static inline int64_t kv_elem_bytes(int64_t kv) { return kv == KV_F32 ? 4 : kv == KV_BF16 ? 2 : 1; }

/* Scales of an int8 row of head_dim numbers. */
static inline int64_t kv_groups(int64_t head_dim) { return (head_dim + KV_GROUP - 1) / KV_GROUP; }

/* Elements of a stored row: head_dim, and for int8 its scales' bytes. */
static inline int64_t kv_row_elems(int64_t head_dim, int64_t kv) {
    return head_dim + (kv == KV_I8 ? KV_SCALE_BYTES * kv_groups(head_dim) : 0);
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN to 0x7FC0: torch's float -> bfloat16. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* A scale of an int8 row, whose 4 bytes lie `step` bytes apart from p. */
static inline float kv_scale(const int8_t *p, int64_t step) {
    unsigned char b[KV_SCALE_BYTES];
    for (int j = 0; j < KV_SCALE_BYTES; j++) b[j] = (unsigned char)p[j * step];
    float s;
    memcpy(&s, b, sizeof s);
    return s;
}

/* The row x (head_dim floats) stored at dst, its elements `step` elements apart. */
static inline void kv_encode_row(void *dst, const float *x, int64_t head_dim, int64_t step, int64_t kv) {
    if (kv == KV_F32) {
        for (int64_t i = 0; i < head_dim; i++) ((float *)dst)[i * step] = x[i];
    } else if (kv == KV_BF16) {
        for (int64_t i = 0; i < head_dim; i++) ((uint16_t *)dst)[i * step] = float_to_bf16(x[i]);
    } else {
        int8_t *q = dst;
        for (int64_t g0 = 0; g0 < head_dim; g0 += KV_GROUP) {
            const int64_t g1 = g0 + KV_GROUP < head_dim ? g0 + KV_GROUP : head_dim;
            float amax = 0.0f;
            for (int64_t i = g0; i < g1; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            float s = amax / 127.0f;
            s = s < 1.17549435e-38f ? 1.17549435e-38f : s; /* an all-zero group: q = 0 (torch's clamp_min) */
            for (int64_t i = g0; i < g1; i++) {
                float r = rintf(x[i] / s); /* ties to even, as torch.round */
                r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
                q[i * step] = (int8_t)r;
            }
            unsigned char b[KV_SCALE_BYTES];
            memcpy(b, &s, sizeof s);
            const int64_t at = head_dim + KV_SCALE_BYTES * (g0 / KV_GROUP);
            for (int j = 0; j < KV_SCALE_BYTES; j++) q[(at + j) * step] = (int8_t)b[j];
        }
    }
}

/* Element i of a stored row (for int8 without its scale), its elements `step` elements apart. */
static inline float kv_load(const void *row, int64_t i, int64_t step, int64_t kv) {
    if (kv == KV_F32) return ((const float *)row)[i * step];
    if (kv == KV_BF16) return bf16_to_float(((const uint16_t *)row)[i * step]);
    return (float)((const int8_t *)row)[i * step];
}

/* A stored row as head_dim floats (int8: q * its group's scale). */
static inline void kv_decode_row(float *x, const void *row, int64_t head_dim, int64_t step, int64_t kv) {
    if (kv != KV_I8) {
        for (int64_t i = 0; i < head_dim; i++) x[i] = kv_load(row, i, step, kv);
        return;
    }
    for (int64_t g0 = 0; g0 < head_dim; g0 += KV_GROUP) {
        const int64_t g1 = g0 + KV_GROUP < head_dim ? g0 + KV_GROUP : head_dim;
        const float s = kv_scale((const int8_t *)row + (head_dim + KV_SCALE_BYTES * (g0 / KV_GROUP)) * step, step);
        for (int64_t i = g0; i < g1; i++) x[i] = kv_load(row, i, step, kv) * s;
    }
}

#endif
