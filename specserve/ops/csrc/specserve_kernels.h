/* The functions each kernel file exports, for the ones that call each other (decoder.c). */
#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H

#include <stdint.h>

void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                      int64_t dim, float eps);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter);
void rope_qk_f32(float *qkv, const float *cos, const float *sin, int64_t rows, int64_t row_stride,
                 int64_t num_heads, int64_t head_dim);
void gemm_packed_f32(const float *x, const float *packed, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N);
void gemm_packed_i8(const float *x, const int8_t *packed, const float *scale, const float *bias, float *y,
                    int64_t M, int64_t K, int64_t N);
/* KV caches stored as kv_dtype (kv_format.h's KV_F32, KV_BF16, KV_I8) */
int paged_attention_f32(const float *q, float *out, const void *k_cache, const void *v_cache,
                        const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *context_len, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale, int64_t window, int64_t kv_dtype);

void store_kv(void *k_cache, void *v_cache, int64_t kv_dtype, int64_t slot, const float *key, const float *value,
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size);

/* A packed weight in one of the formats the GEMMs read (gemm.c, gemm_gguf.c, gemm_q4_i8.c, gemm_q8_i8.c);
 * group: k's per scale record. WEIGHT_Q4_I8 and WEIGHT_Q4_Q8 (group 32 only, the same layout), WEIGHT_Q8_I8
 * and WEIGHT_Q8_Q8 (group 16 or 32, the same layout) multiply int8-quantized activations, as two int8 digits
 * (~15 bits) or one (llama.cpp's Q8_0 activations); their group may be G | S << 8, records in super-blocks of S
 * groups with int8 scales (gemm_common.h's group_record). */
enum {
    WEIGHT_F32 = 0,
    WEIGHT_Q4 = 2,
    WEIGHT_Q8 = 3,
    WEIGHT_F16 = 4,
    WEIGHT_Q4_I8 = 5,
    WEIGHT_Q4_Q8 = 6,
    WEIGHT_Q8_I8 = 7,
    WEIGHT_Q8_Q8 = 8
};
typedef struct {
    const void *data;
    int64_t format, group;
} weight_t;
int gemm_q4_i8(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
               int64_t digits, int64_t supers);
int gemm_q8_i8(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
               int64_t group, int64_t digits);
void int8_quantize_rows(int64_t path, const float *x, int64_t M, int64_t K, int8_t *q, float *unit, float *usum,
                        int64_t digits);
int gemm_weight(const float *x, const weight_t *w, const float *bias, float *y, int64_t M, int64_t K, int64_t N);
float weight_column(const float *x, const weight_t *w, int64_t K, int64_t n);
float half_to_float(uint16_t h);

/* Instruction-set paths of the int8 kernels (gemm_q4_i8.c, gemm_q8_i8.c, the greedy screen in greedy.c): every
 * path gives the same bits. INT8_AMX_EMULATED runs the AMX path's code with its tiles written in C, for tests. */
enum { INT8_PORTABLE, INT8_AVX2, INT8_VNNI, INT8_AMX, INT8_AMX_EMULATED, INT8_PATHS };
/* The int8 kernels, each routed by its calls' row counts to a path (int8_route_set, from measurements): the
 * 4-bit GEMM, the LM head's screen, the Q8-layout GEMM (no AMX path). */
enum { INT8_GEMM, INT8_SCREEN, INT8_GEMM_Q8, INT8_KERNELS };
#define INT8_ROUTE_ROWS 1024 /* row counts routed one by one; larger calls take the last one's path */
int int8_path_for(int kernel, int64_t rows); /* the path a call of `kernel` with `rows` rows takes (counted) */
int q4_i8_select(int64_t path);              /* every row count of every kernel on `path` */
int q4_i8_supported(int64_t path);           /* whether this CPU (and OS) runs `path` */
int screen_amx_self_check(int emulated); /* greedy.c: its AMX screen against its VNNI screen, 1 when equal */

void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out);
void weight_rows_f32(const void *data, int64_t format, int64_t group, int64_t K, const int64_t *ids, int64_t count,
                     float *out);
int lm_head_argmax_f32(const float *x, const void *data, int64_t format, int64_t group, const int8_t *q,
                       const float *scale, const int32_t *col_sum, const double *w_l1, const uint8_t *allowed,
                       int64_t M, int64_t K, int64_t N, int64_t *out);

#endif
