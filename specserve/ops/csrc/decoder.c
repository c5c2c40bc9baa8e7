/* A whole decoder stack in one call: the same kernels, in the same order, as DecoderLayer._forward_c runs
 * from Python, without the ~45 us of Python and dispatch per layer between them (at one token a step,
 * ~1.3 ms of a ~15 ms SmolLM2 step, and ~20% of an int8 draft model's step). Every row's numbers are
 * bitwise those of the Python sequence: each kernel is called on the same inputs.
 *
 * Layouts (fp32, contiguous): x [N, hidden] (the embeddings; used as the residual stream and
 * overwritten), out [N, hidden] (the final norm's output), cos/sin [N, head_dim], slot_mapping [num_slots]
 * with slot_rows [num_slots] (write w stores row slot_rows[w]'s key and value at slot slot_mapping[w]; NULL:
 * row w, num_slots = N; a tree step writes a node into each draft path's blocks), attention metadata as in
 * paged_attention.c, caches as there (keys transposed within each block).
 * aux_layers [num_aux] (ascending) names the layers whose input (the residual stream entering the layer,
 * before its norm) is copied to aux_out [num_aux, N, hidden], for drafters that read intermediate states.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "specserve_kernels.h"

/* Seconds spent in each part of the stack since the last reset, when profiling is on (benchmarks only:
 * decoder_profile_f32). Order: projections, attention, the rest (norms, rotary, activation, cache writes). */
enum { PROFILE_PROJECTIONS, PROFILE_ATTENTION, PROFILE_OTHER, PROFILE_PARTS };
static int profile_on;
static double profile[PROFILE_PARTS];

static inline double profile_mark(int part, double since) {
    if (!profile_on) return 0.0;
    const double now = omp_get_wtime();
    if (part >= 0) profile[part] += now - since;
    return now;
}

/* on: 1 profiles from now on, 0 stops; out (PROFILE_PARTS doubles, or NULL) gets the totals, then reset. */
void decoder_profile_f32(int64_t on, double *out) {
    if (out) memcpy(out, profile, sizeof profile);
    memset(profile, 0, sizeof profile);
    profile_on = (int)on;
}

/* One projection: int8 weights with per-column scales (scale set), or packed blocks of another format
 * (scale NULL: gemm_weight's fp32, F16 or GGUF blocks). */
typedef struct {
    const void *weight;
    const float *scale;
    const float *bias;
    int64_t format, group;
} linear_t;

/* Field order mirrors specserve/ops/kernels.py's DecoderLayerC. */
typedef struct {
    linear_t qkv, o_proj, gate_up, down;
    const float *input_norm, *post_norm;
    void *k_cache, *v_cache;
    int64_t window;   /* sliding attention window, 0 for none */
    int64_t kv_dtype; /* how the caches store K and V (kv_format.h) */
} layer_t;

static void linear(const linear_t *l, const float *x, float *y, int64_t rows, int64_t in, int64_t out) {
    if (l->scale) {
        gemm_packed_i8(x, (const int8_t *)l->weight, l->scale, l->bias, y, rows, in, out);
    } else {
        const weight_t w = {l->weight, l->format, l->group};
        gemm_weight(x, &w, l->bias, y, rows, in, out);
    }
}

/* Each write w stores fused qkv row slot_rows[w] (NULL: row w)'s key and value at cache slot slot_mapping[w]. */
static void store_rows(void *k_cache, void *v_cache, int64_t kv_dtype, const float *qkv, int64_t qkv_size,
                       int64_t q_size, int64_t num_kv_heads, int64_t head_dim, const int64_t *slot_mapping,
                       const int64_t *slot_rows, int64_t num_slots, int64_t block_size) {
    const int64_t kv_size = num_kv_heads * head_dim;
    for (int64_t w = 0; w < num_slots; w++) {
        const float *row = qkv + (slot_rows ? slot_rows[w] : w) * qkv_size;
        store_kv(k_cache, v_cache, kv_dtype, slot_mapping[w], row + q_size, row + q_size + kv_size, num_kv_heads,
                 head_dim, block_size);
    }
}

/* Returns 0 on success, 1 when a buffer could not be allocated. */
int decoder_forward_f32(const layer_t *layers, int64_t num_layers, float *x, float *out, const float *final_norm,
                        const float *cos, const float *sin, const int64_t *slot_mapping,
                        const int64_t *slot_rows, int64_t num_slots, const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *context_len, int64_t num_seqs, int64_t N,
                        int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                        int64_t block_size, float eps, float scale, const int64_t *aux_layers, int64_t num_aux,
                        float *aux_out) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    /* h: a norm's output; qkv; q: the rotated queries, contiguous; attn; gate_up; act; mlp: a layer's
     * output, added to the residual stream (x) by the next norm */
    const int64_t floats = N * (hidden + qkv_size + q_size + q_size + 2 * inter + inter + hidden);
    float *buf = malloc(sizeof(float) * (floats ? floats : 1));
    if (!buf) return 1;
    float *h = buf, *qkv = h + N * hidden, *q = qkv + N * qkv_size, *attn = q + N * q_size;
    float *gate_up = attn + N * q_size, *act = gate_up + N * 2 * inter, *mlp = act + N * inter;
    int failed = 0;
    int64_t next_aux = 0;
    double t = profile_mark(-1, 0.0);
    for (int64_t i = 0; i < num_layers && !failed; i++) {
        const layer_t *L = &layers[i];
        add_rms_norm_f32(i ? mlp : NULL, x, L->input_norm, h, N, hidden, eps);
        if (next_aux < num_aux && aux_layers[next_aux] == i)  /* x now holds the layer's input */
            memcpy(aux_out + next_aux++ * N * hidden, x, sizeof(float) * N * hidden);
        t = profile_mark(PROFILE_OTHER, t);
        linear(&L->qkv, h, qkv, N, hidden, qkv_size);
        t = profile_mark(PROFILE_PROJECTIONS, t);
        rope_qk_f32(qkv, cos, sin, N, qkv_size, num_heads + num_kv_heads, head_dim);
        for (int64_t r = 0; r < N; r++) memcpy(q + r * q_size, qkv + r * qkv_size, sizeof(float) * q_size);
        store_rows(L->k_cache, L->v_cache, L->kv_dtype, qkv, qkv_size, q_size, num_kv_heads, head_dim, slot_mapping,
                   slot_rows, num_slots, block_size);
        t = profile_mark(PROFILE_OTHER, t);
        failed = paged_attention_f32(q, attn, L->k_cache, L->v_cache, block_table, table_width, query_start,
                                     query_len, context_len, num_seqs, num_heads, num_kv_heads, head_dim,
                                     block_size, scale, L->window, L->kv_dtype);
        t = profile_mark(PROFILE_ATTENTION, t);
        linear(&L->o_proj, attn, mlp, N, q_size, hidden);
        t = profile_mark(PROFILE_PROJECTIONS, t);
        add_rms_norm_f32(mlp, x, L->post_norm, h, N, hidden, eps);
        t = profile_mark(PROFILE_OTHER, t);
        linear(&L->gate_up, h, gate_up, N, hidden, 2 * inter);
        t = profile_mark(PROFILE_PROJECTIONS, t);
        silu_mul_f32(gate_up, act, N, inter);
        t = profile_mark(PROFILE_OTHER, t);
        linear(&L->down, act, mlp, N, inter, hidden);
        t = profile_mark(PROFILE_PROJECTIONS, t);
    }
    if (!failed) add_rms_norm_f32(num_layers ? mlp : NULL, x, final_norm, out, N, hidden, eps);
    profile_mark(PROFILE_OTHER, t);
    free(buf);
    return failed;
}

/* A mixture-of-experts MLP's routed experts over a step's rows, in one call: for each used expert e (ascending
 * ids in `used`), its rows rows[offsets[i] ..) of h [N, hidden] are gathered, run through gate_up, SiLU-and-mul
 * and down (the same kernels, on the same inputs, as specserve/models/moe.py's Python loop), and each output row
 * times its routing weight is added to out [N, hidden] (zeroed by the caller): the product rounded first, then
 * the sum, expert by expert, as torch's index_add_ of the weighted outputs. gate_up, down: every expert's
 * linear_t, indexed by expert id. Returns 0, or 1 when a buffer could not be allocated. */
__attribute__((optimize("fp-contract=off"))) int moe_experts_f32(
        const float *h, float *out, int64_t hidden, int64_t inter, const linear_t *gate_up, const linear_t *down,
        const int64_t *used, int64_t num_used, const int64_t *offsets, const int64_t *rows, const float *weights) {
    int64_t most = 0;
    for (int64_t i = 0; i < num_used; i++)
        if (offsets[i + 1] - offsets[i] > most) most = offsets[i + 1] - offsets[i];
    float *buf = malloc(sizeof(float) * (most * (2 * hidden + 3 * inter) + 1));
    if (!buf) return 1;
    float *x = buf, *gu = x + most * hidden, *act = gu + most * 2 * inter, *y = act + most * inter;
    for (int64_t i = 0; i < num_used; i++) {
        const int64_t e = used[i], first = offsets[i], m = offsets[i + 1] - first;
        for (int64_t j = 0; j < m; j++) memcpy(x + j * hidden, h + rows[first + j] * hidden, sizeof(float) * hidden);
        linear(&gate_up[e], x, gu, m, hidden, 2 * inter);
        silu_mul_f32(gu, act, m, inter);
        linear(&down[e], act, y, m, inter, hidden);
        for (int64_t j = 0; j < m; j++) {
            float *o = out + rows[first + j] * hidden;
            const float *yj = y + j * hidden, w = weights[first + j];
            for (int64_t d = 0; d < hidden; d++) {
                const float p = yj[d] * w;
                o[d] += p;
            }
        }
    }
    free(buf);
    return 0;
}

/* An EAGLE-3 head's greedy draft chains in one call: the same kernels, on the same inputs and in the same order,
 * as specserve/models/eagle.py's Eagle3Head runs them a step at a time from Python (greedy_tokens, then forward
 * on the draft just made), so every draft is bitwise the Python loop's; without ~0.5 ms of Python and dispatch
 * per draft token. Fields mirror specserve/ops/kernels.py's Eagle3C. */
typedef struct {
    linear_t qkv, o_proj, gate_up, down, lm_head;
    const float *input_norm, *hidden_norm, *post_norm, *norm;
    const void *embed; /* the token embedding: rows through weight_rows (embed_format >= 0), or fp32 [V, H] */
    int64_t embed_format, embed_group;
    /* the LM head's argmax screen (greedy.c; screen_q NULL: the LM head's GEMM, then argmax_rows) */
    const int8_t *screen_q;
    const float *screen_scale;
    const int32_t *screen_col_sum;
    const double *screen_w_l1;
    const int64_t *draft_ids; /* [Vd] target id of each draft id; NULL: the same */
    void *k_cache, *v_cache;
    int64_t window, norm_before_residual;
    int64_t kv_dtype; /* how the caches store K and V (kv_format.h) */
} eagle3_t;

/* One forward of the head's layer over n rows (Eagle3Head.forward): x = [input_norm(embed(ids)); hidden_norm(hidden)],
 * residual hidden (or its norm), then attention (K/V of row slot_rows[w] (NULL: w) written at slot_mapping[w] first),
 * o_proj + residual, post norm, MLP + residual -> g [n, H]. Returns 0, or 1 when out of memory. */
static int eagle3_layer(const eagle3_t *E, const float *hidden, const int64_t *ids, int64_t n, const float *cos,
                        const float *sin, const int64_t *slot_mapping, const int64_t *slot_rows, int64_t num_slots,
                        const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *context_len, int64_t num_seqs, int64_t H,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t block_size,
                        float eps, float scale, float *g) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    float *buf = malloc(sizeof(float) * (n * (H + H + H + 2 * H + qkv_size + 2 * q_size + H + 3 * inter) + 1));
    if (!buf) return 1;
    float *normed = buf, *emb = normed + n * H, *h = emb + n * H, *x = h + n * H, *qkv = x + n * 2 * H;
    float *q = qkv + n * qkv_size, *attn = q + n * q_size, *res = attn + n * q_size, *gate_up = res + n * H;
    float *act = gate_up + n * 2 * inter;
    add_rms_norm_f32(NULL, (float *)hidden, E->hidden_norm, normed, n, H, eps); /* no add: hidden is only read */
    if (E->embed_format >= 0) {
        weight_rows_f32(E->embed, E->embed_format, E->embed_group, H, ids, n, emb);
    } else {
        for (int64_t j = 0; j < n; j++) memcpy(emb + j * H, (const float *)E->embed + ids[j] * H, sizeof(float) * H);
    }
    add_rms_norm_f32(NULL, emb, E->input_norm, h, n, H, eps);
    for (int64_t j = 0; j < n; j++) {
        memcpy(x + j * 2 * H, h + j * H, sizeof(float) * H);
        memcpy(x + j * 2 * H + H, normed + j * H, sizeof(float) * H);
    }
    const float *residual = E->norm_before_residual ? normed : hidden;
    linear(&E->qkv, x, qkv, n, 2 * H, qkv_size);
    rope_qk_f32(qkv, cos, sin, n, qkv_size, num_heads + num_kv_heads, head_dim);
    for (int64_t j = 0; j < n; j++) memcpy(q + j * q_size, qkv + j * qkv_size, sizeof(float) * q_size);
    store_rows(E->k_cache, E->v_cache, E->kv_dtype, qkv, qkv_size, q_size, num_kv_heads, head_dim, slot_mapping,
               slot_rows, num_slots, block_size);
    int failed = paged_attention_f32(q, attn, E->k_cache, E->v_cache, block_table, table_width, query_start,
                                     query_len, context_len, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                     scale, E->window, E->kv_dtype);
    if (!failed) {
        linear(&E->o_proj, attn, res, n, q_size, H);
        for (int64_t i = 0; i < n * H; i++) res[i] += residual[i];
        add_rms_norm_f32(NULL, res, E->post_norm, h, n, H, eps);
        linear(&E->gate_up, h, gate_up, n, H, 2 * inter);
        silu_mul_f32(gate_up, act, n, inter);
        linear(&E->down, act, g, n, inter, H);
        for (int64_t i = 0; i < n * H; i++) g[i] += res[i];
    }
    free(buf);
    return failed;
}

/* Eagle3Head.forward in one call: hidden [N, H], ids [N], cos/sin [N, head_dim], the attention metadata's writes
 * (slot_mapping with slot_rows, as decoder_forward_f32) and kernel batch -> g [N, H]. */
int eagle3_forward_f32(const eagle3_t *E, const float *hidden, const int64_t *ids, int64_t N, const float *cos,
                       const float *sin, const int64_t *slot_mapping, const int64_t *slot_rows, int64_t num_slots,
                       const int64_t *block_table, int64_t table_width, const int64_t *query_start,
                       const int64_t *query_len, const int64_t *context_len, int64_t num_seqs, int64_t H,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t block_size,
                       float eps, float scale, float *g) {
    return eagle3_layer(E, hidden, ids, N, cos, sin, slot_mapping, slot_rows, num_slots, block_table, table_width,
                        query_start, query_len, context_len, num_seqs, H, num_heads, num_kv_heads, head_dim, inter,
                        block_size, eps, scale, g);
}

static int eagle3_draw(const eagle3_t *E, const float *g, float *h, float *logits, int64_t n, int64_t H, int64_t Vd,
                       float eps, int64_t *ids) {
    add_rms_norm_f32(NULL, (float *)g, E->norm, h, n, H, eps); /* g is only read: no add */
    if (E->screen_q) {
        if (lm_head_argmax_f32(h, E->lm_head.weight, E->lm_head.format, E->lm_head.group, E->screen_q, E->screen_scale,
                               E->screen_col_sum, E->screen_w_l1, NULL, n, H, Vd, ids))
            return 1;
    } else {
        linear(&E->lm_head, h, logits, n, H, Vd);
        argmax_rows_f32(logits, n, Vd, ids);
    }
    if (E->draft_ids)
        for (int64_t r = 0; r < n; r++) ids[r] = E->draft_ids[ids[r]];
    return 0;
}

/* g0 [R, H]: each row's head output to draw its first draft from; num_drafts [R] (>= 1); for draft step s of row r
 * (s < max_drafts - 1, the steps that feed a draft back), at [r * (max_drafts - 1) + s]: cos/sin [.., head_dim] of
 * its position, slots (where its K/V go) and context_len (the keys it attends to, itself included);
 * block_table [R, table_width]. out [R, max_drafts]: the drafts (target ids), -1 past a row's num_drafts.
 * Returns 0, or 1 when a buffer could not be allocated. */
int eagle3_chains_f32(const eagle3_t *E, const float *g0, int64_t R, const int64_t *num_drafts, int64_t max_drafts,
                      const float *cos, const float *sin, const int64_t *slots, const int64_t *context_len,
                      const int64_t *block_table, int64_t table_width, int64_t H, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t Vd, int64_t block_size, float eps,
                      float scale, int64_t *out) {
    const int64_t steps = max_drafts - 1;
    float *buf = malloc(sizeof(float) * R * (3 * H + Vd + 2 * head_dim) + sizeof(int64_t) * R * (6 + table_width));
    if (!buf) return 1;
    float *g = buf, *next = g + R * H, *h = next + R * H, *logits = h + R * H, *cs = logits + R * Vd;
    float *sn = cs + R * head_dim;
    int64_t *live = (int64_t *)(sn + R * head_dim), *ids = live + R, *query_start = ids + R, *ctx = query_start + R;
    int64_t *qlen = ctx + R, *slot = qlen + R, *table = slot + R;
    for (int64_t i = 0; i < R * max_drafts; i++) out[i] = -1;
    memcpy(g, g0, sizeof(float) * R * H);
    int64_t n = R;
    int failed = 0;
    for (int64_t r = 0; r < R; r++) live[r] = r;
    for (int64_t s = 0; s < max_drafts && n; s++) {
        /* g holds the live rows' outputs, in the order of live */
        if ((failed = eagle3_draw(E, g, h, logits, n, H, Vd, eps, ids))) break;
        int64_t m = 0;
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = live[j];
            out[r * max_drafts + s] = ids[j];
            if (s + 1 < num_drafts[r] && s < steps) { /* feeds this draft back: compact the rows that go on */
                live[m] = r;
                ids[m] = ids[j];
                if (m != j) memmove(g + m * H, g + j * H, sizeof(float) * H);
                m++;
            }
        }
        n = m;
        if (!n) break;
        for (int64_t j = 0; j < n; j++) {
            const int64_t at = live[j] * steps + s;
            memcpy(cs + j * head_dim, cos + at * head_dim, sizeof(float) * head_dim);
            memcpy(sn + j * head_dim, sin + at * head_dim, sizeof(float) * head_dim);
            query_start[j] = j;
            qlen[j] = 1;
            ctx[j] = context_len[at];
            slot[j] = slots[at];
            memcpy(table + j * table_width, block_table + live[j] * table_width, sizeof(int64_t) * table_width);
        }
        if ((failed = eagle3_layer(E, g, ids, n, cs, sn, slot, NULL, n, table, table_width, query_start, qlen, ctx, n,
                                   H, num_heads, num_kv_heads, head_dim, inter, block_size, eps, scale, next)))
            break;
        memcpy(g, next, sizeof(float) * n * H);
    }
    free(buf);
    return failed;
}
