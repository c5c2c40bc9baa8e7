/* Paged attention straight from the block pool, for queries of any length (decode, 1 + k
 * verification, prefill chunks).
 *
 * The PyTorch path gathers every request's blocks into a padded [B, L, Hkv, D] copy per layer and
 * then runs SDPA over it: the KV bytes cross memory three times, and at 32 requests of ~300 tokens
 * that copy alone took as long as SDPA. Here each (request, kv head) pair reads its blocks once, in
 * place, with an online softmax, for all the query heads that share that kv head and all of the
 * request's query tokens at once.
 *
 * Each output row depends only on its own request's query, keys and values: the same numbers
 * whatever else is in the batch and however many threads run (one thread computes one row).
 *
 * Layouts (fp32, contiguous):
 *   q            [num_tokens, num_heads, head_dim]
 *   out          [num_tokens, num_heads * head_dim]   (rows of the listed requests are written)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  [num_seqs, table_width] int64
 *   query_start, query_len, context_len  [num_seqs] int64
 * Query j of request s sits at absolute position context_len - query_len + j and attends to keys
 * 0 ..= that position.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specserve_math.h"

#define MAX_STACK_ROWS 48
#define MAX_HEAD_DIM 128

static void attend_one(const float *q, float *out, const float *k_cache, const float *v_cache,
                       const int64_t *table, int64_t q_start, int64_t q_len, int64_t c_len,
                       int64_t kvh, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, float scale, float *work) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t rows = group * q_len;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t first_pos = c_len - q_len;
    /* work: acc[rows][head_dim], m[rows], l[rows] */
    float *acc = work, *m = work + rows * head_dim, *l = m + rows;
    float scores[block_size];
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    const int64_t num_blocks = (c_len + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_blocks; b++) {
        const float *kb = k_cache + table[b] * block_stride + kvh * head_dim;
        const float *vb = v_cache + table[b] * block_stride + kvh * head_dim;
        const int64_t base = b * block_size;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t g = r / q_len, j = r % q_len;
            int64_t n = first_pos + j + 1 - base; /* keys of this block row r may see */
            if (n <= 0) continue;
            if (n > block_size) n = block_size;
            const float *qr = q + ((q_start + j) * num_heads + kvh * group + g) * head_dim;
            float mb = -INFINITY;
            for (int64_t t = 0; t < n; t++) {
                const float *kt = kb + t * token_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; d++) s += qr[d] * kt[d];
                s *= scale;
                scores[t] = s;
                mb = s > mb ? s : mb;
            }
            const float m_new = mb > m[r] ? mb : m[r];
            float *ar = acc + r * head_dim;
            if (m[r] != m_new && l[r] != 0.0f) {
                const float alpha = exp_nonpositive(m[r] - m_new);
                l[r] *= alpha;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ar[d] *= alpha;
            }
            m[r] = m_new;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                scores[t] = exp_nonpositive(scores[t] - m_new);
                sum += scores[t];
            }
            l[r] += sum;
            for (int64_t t = 0; t < n; t++) {
                const float p = scores[t];
                const float *vt = vb + t * token_stride;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ar[d] += p * vt[d];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r / q_len, j = r % q_len;
        float *o = out + ((q_start + j) * num_heads + kvh * group + g) * head_dim;
        const float inv = 1.0f / l[r];
        const float *ar = acc + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] = ar[d] * inv;
    }
}

/* ---- Vector path: block_size 16, head_dim = 16 * NC (NC <= 8); one (request, head) pair per work item --
 * GCC vector extensions (zmm on AVX-512, pairs of ymm on AVX2). Per query row, the running max, sum and
 * the head_dim accumulator stay in registers over the whole context. Per block of 16 keys the 16 dot
 * products come out of one transpose-and-add tree as one vector of scores, so max, exp and sum run on
 * whole vectors. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf vmax(vf a, vf b) {
    const vi gt = a > b;
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

static inline float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

static inline float hmax(vf v) {
    v = vmax(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    v = vmax(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    v = vmax(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return v[0];
}

/* exp_nonpositive on a vector; lanes below -87 (and -inf) give exactly 0. */
static inline vf exp_vf(vf x) {
    const vi keep = x >= -87.0f;
    x = vmax(x, (vf){0} - 87.0f);
    const vi ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi); /* x <= 0: rounds */
    const vf n = __builtin_convertvector(ni, vf);
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vf res = p * (vf)((ni + 127) << 23);
    return (vf)((vi)res & keep);
}

/* x[i] holds the 16 partial sums of key BITREV[i]; returns lane t = the full sum for key t. */
static const int BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

static inline vf transpose_sum16(const vf x[16]) {
    const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    vf e[8], f[4], g[2];
    for (int i = 0; i < 8; i++)
        e[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo1) + __builtin_shuffle(x[2 * i], x[2 * i + 1], lo1 + 8);
    for (int i = 0; i < 4; i++)
        f[i] = __builtin_shuffle(e[2 * i], e[2 * i + 1], lo2) + __builtin_shuffle(e[2 * i], e[2 * i + 1], lo2 + 4);
    for (int i = 0; i < 2; i++)
        g[i] = __builtin_shuffle(f[2 * i], f[2 * i + 1], lo3) + __builtin_shuffle(f[2 * i], f[2 * i + 1], lo3 + 2);
    return __builtin_shuffle(g[0], g[1], lo4) + __builtin_shuffle(g[0], g[1], lo4 + 1);
}

/* Rows r0..r1-1 of one (request, kv head) pair; row r is query head kvh * group + r / q_len at query
 * token r % q_len. Blocks are the outer loop, so each block's keys and values come from memory once and
 * from L1 for the other rows; each row's running max, sum and accumulator live in `work` between blocks
 * and in registers within one. */
static inline __attribute__((always_inline)) void attend_rows_vec(
        const float *q, float *out, const float *k_cache, const float *v_cache, const int64_t *table,
        int64_t q_start, int64_t q_len, int64_t c_len, int64_t kvh, int64_t r0, int64_t r1, int64_t num_heads,
        int64_t num_kv_heads, float scale, float *work, const int NC) {
    const int64_t dim = 16 * NC, group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * dim, block_stride = 16 * token_stride;
    const int64_t rows = r1 - r0;
    float *acc_all = work, *ms = work + rows * dim, *ls = ms + rows;
    for (int64_t i = 0; i < rows; i++) {
        ms[i] = -INFINITY;
        ls[i] = 0.0f;
    }
    memset(acc_all, 0, sizeof(float) * rows * dim);
    const vf lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t b = 0, base = 0; base < c_len; b++, base += 16) {
        const float *kb = k_cache + table[b] * block_stride + kvh * dim;
        const float *vb = v_cache + table[b] * block_stride + kvh * dim;
        for (int64_t r = r0; r < r1; r++) {
            const int64_t g = r / q_len, j = r % q_len;
            const int64_t limit = c_len - q_len + j + 1; /* keys this row sees */
            if (limit <= base) continue;
            const int64_t n = limit - base < 16 ? limit - base : 16;
            const float *qr = q + ((q_start + j) * num_heads + kvh * group + g) * dim;
            vf qv[8], acc[8], acc2[8];
            for (int c = 0; c < NC; c++) qv[c] = load_vf(qr + 16 * c) * scale;
            vf x[16];
            for (int i = 0; i < 16; i++) {
                const int t = BITREV[i];
                if (t >= n) {
                    x[i] = (vf){0};
                    continue;
                }
                const float *kt = kb + t * token_stride;
                vf d = qv[0] * load_vf(kt);
                for (int c = 1; c < NC; c++) d += qv[c] * load_vf(kt + 16 * c);
                x[i] = d;
            }
            vf s = transpose_sum16(x);
            if (n < 16) { /* keys past the row's position: -inf */
                const vi beyond = lane >= (float)n;
                s = (vf)(((vi)s & ~beyond) | ((vi)((vf){0} - INFINITY) & beyond));
            }
            float *ar = acc_all + (r - r0) * dim;
            float m = ms[r - r0], l = ls[r - r0];
            for (int c = 0; c < NC; c++) {
                acc[c] = load_vf(ar + 16 * c);
                acc2[c] = (vf){0};
            }
            const float mb = hmax(s);
            if (mb > m) {
                const float alpha = exp_nonpositive(m - mb); /* ~0 on the first block, where l, acc are 0 */
                l *= alpha;
                for (int c = 0; c < NC; c++) acc[c] *= alpha;
                m = mb;
            }
            const vf p = exp_vf(s - m);
            l += hsum(p);
            float ps[16];
            memcpy(ps, &p, sizeof ps);
            int64_t t = 0;
            for (; t + 1 < n; t += 2) { /* two independent accumulator sets hide the FMA latency */
                const float *v0 = vb + t * token_stride, *v1 = v0 + token_stride;
                for (int c = 0; c < NC; c++) {
                    acc[c] += ps[t] * load_vf(v0 + 16 * c);
                    acc2[c] += ps[t + 1] * load_vf(v1 + 16 * c);
                }
            }
            if (t < n) {
                const float *v0 = vb + t * token_stride;
                for (int c = 0; c < NC; c++) acc[c] += ps[t] * load_vf(v0 + 16 * c);
            }
            for (int c = 0; c < NC; c++) {
                const vf sum = acc[c] + acc2[c];
                memcpy(ar + 16 * c, &sum, sizeof sum);
            }
            ms[r - r0] = m;
            ls[r - r0] = l;
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const int64_t g = r / q_len, j = r % q_len;
        float *o = out + ((q_start + j) * num_heads + kvh * group + g) * dim;
        const float inv = 1.0f / ls[r - r0];
        const float *ar = acc_all + (r - r0) * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = ar[d] * inv;
    }
}

#define ROWS_VEC(NC_)                                                                                   \
    attend_rows_vec(q, out, k_cache, v_cache, table, q_start, q_len, c_len, kvh, r0, r1, num_heads,   \
                    num_kv_heads, scale, work, NC_)

static void attend_rows_dispatch(const float *q, float *out, const float *k_cache, const float *v_cache,
                                 const int64_t *table, int64_t q_start, int64_t q_len, int64_t c_len,
                                 int64_t kvh, int64_t r0, int64_t r1, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, float scale, float *work) {
    switch (head_dim / 16) {
        case 1: ROWS_VEC(1); break;
        case 2: ROWS_VEC(2); break;
        case 3: ROWS_VEC(3); break;
        case 4: ROWS_VEC(4); break;
        case 5: ROWS_VEC(5); break;
        case 6: ROWS_VEC(6); break;
        case 7: ROWS_VEC(7); break;
        default: ROWS_VEC(8); break;
    }
}

/* Returns 0 on success, 1 when a request has more rows than the stack buffer and malloc failed. */
int paged_attention_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
                        const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *context_len, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale) {
    const int vector_path = block_size == 16 && head_dim % 16 == 0 && head_dim <= 128;
    const int64_t group = num_heads / num_kv_heads;
    /* Few (request, kv head) pairs, as with one request: split each pair's rows so every thread works
     * (the split pairs read their keys and values once per part). */
    int64_t parts = 1;
    if (vector_path) {
        const int64_t threads = omp_get_max_threads();
        while (num_seqs * num_kv_heads * parts < 2 * threads && parts < group) parts++;
    }
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (int64_t it = 0; it < num_seqs * num_kv_heads * parts; it++) {
        const int64_t part = it % parts, pair = it / parts;
        const int64_t s = pair / num_kv_heads, kvh = pair % num_kv_heads;
        const int64_t rows = group * query_len[s];
        const int64_t r0 = rows * part / parts, r1 = rows * (part + 1) / parts;
        float stack_work[MAX_STACK_ROWS * (MAX_HEAD_DIM + 2)];
        float *work = stack_work;
        if (r1 - r0 > MAX_STACK_ROWS || head_dim > MAX_HEAD_DIM) {
            work = malloc(sizeof(float) * (r1 - r0) * (head_dim + 2));
            if (!work) {
                failed = 1;
                continue;
            }
        }
        if (vector_path)
            attend_rows_dispatch(q, out, k_cache, v_cache, block_table + s * table_width, query_start[s],
                                 query_len[s], context_len[s], kvh, r0, r1, num_heads, num_kv_heads, head_dim,
                                 scale, work);
        else
            attend_one(q, out, k_cache, v_cache, block_table + s * table_width, query_start[s], query_len[s],
                       context_len[s], kvh, num_heads, num_kv_heads, head_dim, block_size, scale, work);
        if (work != stack_work) free(work);
    }
    return failed;
}
