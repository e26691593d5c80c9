/* One batch-1 decode step of a Llama decoder (every layer, the final norm and the LM
 * head) in one native call and one OpenMP parallel region.
 *
 * The module path runs each layer as ~8 separate native calls (norm, QKV GEMV, rotary,
 * KV store, paged decode, o_proj, gate_up, silu + down), each its own OpenMP fork/join,
 * with Python between them: at batch 1 that glue and the fork/joins cost as much as the
 * arithmetic. Here the threads stay in one region (llama.cpp's model: one thread pool,
 * a barrier between dependent phases). Per layer, with T threads:
 *   1. every thread: residual add + RMSNorm and the activation quantizer, redundantly
 *      into its own buffers (one row: cheaper than a barrier); thread 0 alone writes
 *      the residual stream; then its share of the QKV GEMV's groups of 16 rows,
 *      and the K heads (rotated) and V heads whose rows it computed into the KV
 *      cache;                                                                     barrier
 *   2. attention split by query head (both threads busy at batch 1), a thread's heads
 *      of one kv head in one pass over its blocks, q rotated by its owner;        barrier
 *   3. o_proj groups (input quantized per thread);                                barrier
 *   4. residual add + norm per thread, gate_up groups;                            barrier
 *   5. silu * up per thread, down groups;                                         barrier
 * then the final norm and the LM head's groups (fp32 logits, as the module path's).
 * A sparse MoE layer (num_experts > 0) runs moe_step.h's moe_layer in place of 4's
 * gate_up and 5: router, top k, the routed experts on their records, their weighted sum.
 * The groups of 3-5 and the LM head go to the threads in runs (runs.h): each its
 * own contiguous run, then what is left of the others' (each thread holds the whole
 * quantized row), so that each reads one stream and a vCPU that runs slower on a busy
 * host takes fewer instead of holding the other at the barrier.
 *
 * The arithmetic is the module path's own, compiled from the same source:
 * q4q8_gemv.c's quantizer and linear_group (for a bf16 model, bits 0: bf16_gemv.c's rows
 * on the plain bf16 weights, no activation quantized), layer_ops.h's rows, paged_decode.c's
 * score and weighted-V tiles (over some of a kv head's query heads where the
 * module path takes all of them: each head's sums are the same operations). The residual
 * stream alternates between two buffers, so a thread reading one never races with
 * thread 0 writing the other.
 *
 * Built at first use by tokenmill/kernels/build.py (which hashes the .c files included
 * here); see tokenmill/kernels/decode_step.py and tokenmill/engine/fused_decode.py.
 */
#include "q4q8_gemv.c"
#include "paged_decode.c"
#include "bf16_gemv.c"
#include "layer_ops.h"
#include "lora_delta.h"

/* a linear's weight as plain (N, K) bf16 rows, multiplied as bf16_gemv.c does (its rows
 * of 16 are q4q8_gemv.c's groups): a bf16 model's, whose record says bits 0 (no
 * activation quantized) and every linear FMT_BF16 */
#define FMT_BF16 2

#include <omp.h>

typedef struct {
    const uint16_t *input_norm, *post_norm; /* (hidden,) bf16 */
    const uint8_t *qkv, *o, *gate_up, *down; /* q4q8_gemv.c records, or FMT_BF16 rows */
    int64_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    /* (KVH, NB, BS, D) bf16; with the model's kv_fmt >= 0, 8-bit pools of that format
     * (the bytes) and their scales (KVH, NB, BS) fp32 in k_scale, v_scale */
    uint16_t *k_cache, *v_cache;
    /* (N,) bf16 biases of qkv, o, gate_up, down (Qwen2's q/k/v): FMT_BF16 weights only,
     * added to the fp32 sum before it is rounded, as bf16_gemv.c does; NULL: none */
    const uint16_t *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    float *k_scale, *v_scale;
    /* Gemma 3's differences (NULL / 0 on a Llama layer, which then runs as before):
     * q_norm, k_norm (head_dim,) bf16: RMSNorm of every query and key head before RoPE
     * (Qwen3's too); attn_out_norm, mlp_out_norm (hidden,) bf16: the norms of the
     * attention's and the MLP's outputs before they join the residual stream (post_norm
     * is then the pre-feedforward norm); cos, sin: this layer's rotary tables
     * (max_pos, head_dim) fp32, NULL: the model's; window > 0: a local layer, key k
     * visible to query q iff 0 <= q - k < window */
    const uint16_t *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm;
    const float *cos, *sin;
    int64_t window;
    /* a sparse MoE layer (num_experts 0: the dense MLP above; moe_step.h): the router
     * (E, hidden) bf16; per expert its gate_up records (2 I rows) and down records
     * (hidden rows), each with its own format; top_k, norm_topk (renormalize the top k's
     * weights to sum 1), the experts' width I; expert_reads (E + 1,) int64 counters or
     * NULL: [e] += 1 for each step expert e ran in, [E] += the step's rows */
    const uint16_t *router;
    const uint8_t *const *expert_gate_up, *const *expert_down;
    const int64_t *expert_gate_up_fmt, *expert_down_fmt;
    int64_t num_experts, top_k, norm_topk, expert_inter;
    int64_t *expert_reads;
} tm_layer_t;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, vocab, bits;
    int64_t num_blocks, block_size, max_pos;
    float eps, scale;
    const uint16_t *embed;      /* (vocab, hidden) bf16 */
    const float *cos, *sin;     /* (max_pos, head_dim) fp32 */
    const uint16_t *final_norm; /* (hidden,) bf16 */
    const uint8_t *lm_head;     /* records, vocab rows; NULL: no logits */
    int64_t lm_head_fmt;
    const tm_layer_t *layers;
    /* batches of this many rows or more (16-bit activations, an AVX2 build) run the
     * linears as tm_q4q8_gemm16 does (the records widened a few groups at a time): the
     * same bits; 0: never */
    int64_t wide_min_rows;
    /* the KV pools' format: -1 bf16, else paged_decode.c's FMT_INT8 / FMT_E4M3 / FMT_E5M2
     * (--kv-cache-dtype: stored by store_row_q8, read by the 8-bit score and value loops
     * as the module path's tm_store_kv_q8 and tm_paged_decode_q8) */
    int64_t kv_fmt;
    /* the MLP's activation: ACT_SILU (Llama's silu * up) or ACT_GELU_TANH (Gemma's GeGLU) */
    int64_t act;
    /* the attention linears' (qkv, o) activation width, 8 or 16, where it differs from
     * `bits` (the MLP's and the LM head's); 0: `bits` too. gguf-a8 runs them at 16: int8
     * activations there cost the embedded Q4_1 its accuracy gate (docs/accuracy_gate.md) */
    int64_t attn_bits;
} tm_model_t;

/* the activations' width of the attention linears' inputs */
static inline int64_t attn_bits(const tm_model_t *m) {
    return m->attn_bits ? m->attn_bits : m->bits;
}

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* o <- act(g) * u for one row of inter (layer_ops.h's rows, as the module path's) */
static inline void act_mul_row(const tm_model_t *m, const uint16_t *g, const uint16_t *u,
                               uint16_t *o, int64_t inter) {
    if (m->act == ACT_GELU_TANH)
        gelu_tanh_mul_row(g, u, o, inter);
    else
        silu_mul_row(g, u, o, inter);
}

/* layer L's rotary rows at position pos */
static inline const float *layer_cos(const tm_model_t *m, const tm_layer_t *L, int64_t pos) {
    return (L->cos ? L->cos : m->cos) + pos * m->head_dim;
}
static inline const float *layer_sin(const tm_model_t *m, const tm_layer_t *L, int64_t pos) {
    return (L->sin ? L->sin : m->sin) + pos * m->head_dim;
}

/* one query or key head (D,) of layer L: its RMSNorm (norm: q_norm or k_norm, NULL
 * none) in place, then RoPE at `pos` (the module path's order) */
static inline void norm_rotate_head(const tm_model_t *m, const tm_layer_t *L,
                                    const uint16_t *norm, uint16_t *head, int64_t pos) {
    if (norm) rms_norm_row(head, NULL, NULL, norm, head, m->head_dim, m->eps);
    rotary_head(head, layer_cos(m, L, pos), layer_sin(m, L, pos), m->head_dim);
}

/* the structs' sizes, for decode_step.py to check its ctypes mirror of them */
int64_t tm_decode_step_abi(void) {
    return (int64_t)sizeof(tm_model_t) * 1000 + (int64_t)sizeof(tm_layer_t);
}

/* per-thread buffers for one row's quantized activations (K inputs at most), and the
 * bf16 rows they were quantized from (what an FMT_BF16 weight multiplies) */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *sum;
    const uint16_t *x;
} act_t;

static inline void quantize_row(const uint16_t *x, int64_t K, int64_t bits, act_t *a) {
    a->x = x;
    if (bits) tm_q8_quantize_bf16(x, 1, K, bits, a->q, a->d, a->s, a->sum);
}

/* rows [16 g, 16 g + 16) of y (M, N) = the M rows of a times w: q4q8_gemv.c's
 * linear_group, or bf16_gemv.c's rows for an FMT_BF16 weight (y fp32 when y_f32) */
static inline void group_out(const uint8_t *w, int64_t fmt, const uint16_t *bias, int64_t g,
                             int64_t M, int64_t K, int64_t N, int64_t bits, const act_t *a,
                             void *y, int64_t y_f32) {
    if (fmt == FMT_BF16) {
        const int64_t n0 = g * ROWS, n1 = n0 + ROWS < N ? n0 + ROWS : N;
        rows_out(a->x, M, K, (const uint16_t *)w, N, bias, y_f32 ? NULL : (uint16_t *)y,
                 y_f32 ? (float *)y : NULL, n0, n1);
    } else {
        linear_group(w, g, M, K, N, fmt, bits, a->q, a->d, a->s, a->sum, y, y_f32);
    }
}

/* the weights' formats agree with the activations: every one FMT_BF16 with bits 0 (a
 * bf16 model, at most tm_bf16_gemv_max_rows() rows a call), none of them with 8 or 16;
 * biases only on FMT_BF16 weights */
static int formats_ok(const tm_model_t *m) {
    if (m->bits != 0 && m->bits != 8 && m->bits != 16) return 0;
    if (m->attn_bits != 0 && (m->bits == 0 || (m->attn_bits != 8 && m->attn_bits != 16)))
        return 0; /* a bf16 model has no second width */
    if (m->act != ACT_SILU && m->act != ACT_GELU_TANH) return 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tm_layer_t *L = m->layers + l;
        const int64_t f[4] = {L->qkv_fmt, L->o_fmt, L->gate_up_fmt, L->down_fmt};
        const uint16_t *b[4] = {L->qkv_bias, L->o_bias, L->gate_up_bias, L->down_bias};
        for (int i = 0; i < (L->num_experts ? 2 : 4); i++)
            if ((f[i] == FMT_BF16) != (m->bits == 0) || (b[i] && f[i] != FMT_BF16)) return 0;
    }
    return !m->lm_head || (m->lm_head_fmt == FMT_BF16) == (m->bits == 0);
}

/* the sub-projections of qkv (q, k, v), o, gate_up (gate, up) and down: what an
 * adapter's delta on each is split by (lora_delta.h) */
static void lora_parts(const tm_model_t *m, lora_parts_t parts[LORA_LINEARS]) {
    memset(parts, 0, sizeof(lora_parts_t) * LORA_LINEARS);
    parts[0].size[0] = m->heads * m->head_dim;
    parts[0].size[1] = parts[0].size[2] = m->kv_heads * m->head_dim;
    parts[1].size[0] = parts[3].size[0] = m->hidden;
    parts[2].size[0] = parts[2].size[1] = m->inter;
}

/* an adapter's records for every layer (NULL: none) are consistent */
static int lora_ok(const tm_model_t *m, const tm_lora_t *lora) {
    lora_parts_t parts[LORA_LINEARS];
    lora_parts(m, parts);
    for (int64_t l = 0; lora && l < m->num_layers; l++)
        if (!lora_layer_ok(lora + l, parts) ||
            (m->layers[l].num_experts && (lora[l].r[2] || lora[l].r[3])))
            return 0; /* a sparse layer's experts take no adapter */
    return 1;
}

/* the KV pools' format is one the kernels read (the 8-bit ones' tables filled) */
static int kv_ok(const tm_model_t *m) {
    if (m->kv_fmt < 0) return m->kv_fmt == -1;
    if (m->kv_fmt > FMT_E5M2) return 0;
    for (int64_t l = 0; l < m->num_layers; l++)
        if (!m->layers[l].k_scale || !m->layers[l].v_scale) return 0;
    init_luts();
    return 1;
}

/* some layer attends over a sliding window (the cascade has no window: not with it) */
static int windowed(const tm_model_t *m) {
    for (int64_t l = 0; l < m->num_layers; l++)
        if (m->layers[l].window) return 1;
    return 0;
}

/* this thread's share [*lo, *hi) of n items, contiguous */
static inline void share(int64_t n, int tid, int nth, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nth;
    *hi = n * (tid + 1) / nth;
}

/* A batched step's adapters: its rows grouped by adapter slot (SGMV's segments), the
 * rank vectors of every adapter row between a linear's shrink and its expand. */
typedef struct {
    int64_t slots;                /* 0: no adapter in the step */
    const tm_lora_t *const *lora; /* (slots,): each slot's records, one per layer */
    const int64_t *order;         /* (B,): the adapter rows, slot by slot, ascending */
    const int64_t *start;         /* (slots + 1,): slot s's rows order[start[s]..start[s+1]) */
    uint16_t *xa;                 /* (B, MAX_LORA_R) bf16 */
    lora_parts_t parts[LORA_LINEARS];
} lora_batch_t;

/* some slot has a delta on linear i of layer l (the same answer on every thread) */
static inline int lora_any(const lora_batch_t *lb, int64_t l, int i) {
    for (int64_t s = 0; s < lb->slots; s++)
        if (lb->lora[s][l].r[i]) return 1;
    return 0;
}

/* the rank vectors of linear i of layer l for this thread's rows r0..r1 of its input x
 * (B, K): where the thread has just made those rows, before the barrier that precedes
 * the linear (which then shares them); each slot's A read once for its rows here */
static void lora_shrink_mine(const lora_batch_t *lb, int64_t l, int i, int64_t K,
                             const uint16_t *x, int64_t r0, int64_t r1) {
    for (int64_t s = 0; s < lb->slots; s++) {
        const tm_lora_t *lo = &lb->lora[s][l];
        const int64_t *rows = lb->order + lb->start[s], count = lb->start[s + 1] - lb->start[s];
        if (!lo->r[i]) continue;
        int64_t a = 0, b;
        while (a < count && rows[a] < r0) a++;
        for (b = a; b < count && rows[b] < r1;) b++;
        if (b > a) lora_shrink(lo, i, K, x, K, rows + a, b - a, lb->xa, MAX_LORA_R);
    }
}

/* linear i of layer l's expand into out (B rows of `stride`) in *e; NULL when no slot
 * has a delta on it */
static inline const lora_out_t *lora_out(const lora_batch_t *lb, int64_t l, int i,
                                         uint16_t *out, int64_t stride, lora_out_t *e) {
    if (!lb->slots || !lora_any(lb, l, i)) return NULL;
    const lora_out_t v = {lb->slots, l, i, &lb->parts[i], lb->lora, lb->order, lb->start,
                          lb->xa, MAX_LORA_R, out, stride};
    *e = v;
    return e;
}

/* a share's boundary b (in groups of 16 rows) moved up to a head's first group past
 * the q_groups of Q, so that one thread computes every row of a K or V head */
static inline int64_t head_aligned(int64_t b, int64_t q_groups, int64_t head_groups) {
    return b <= q_groups ? b : q_groups + (b - q_groups + head_groups - 1) / head_groups *
                                              head_groups;
}

/* The next layer's K and V blocks, prefetched while this layer's MLP runs. The MLP's
 * GEMVs are compute-bound at a decode batch's rows and leave the memory bus idle, while
 * attention (a few hundred KB a row a layer) waits on it: a cursor over a thread's rows'
 * (row, kv head, block) items issues a few blocks' L2 prefetches after each group of
 * 16 output rows. Lines pushed out of L2 by then land in L3 (a victim cache on Zen),
 * still far closer than DRAM. Only the order of loads changes: the same bits. */
#define KV_PREFETCH_MAX_BYTES (3 << 20) /* a layer's whole batch; more: none */
#define KV_PREFETCH_CALLS 96             /* groups a thread takes in the MLP, about */
typedef struct {
    const uint16_t *k, *v;      /* the next layer's pools (KVH, NB, BS, D) bf16; NULL: off */
    const int32_t *tables;
    const int64_t *lens;
    int64_t stride, shared, sh0, sh1, r0, r1, r, kh, j, KVH, NB, BS, D, per_call;
} kv_prefetch_t;

/* the cursor of a thread with rows r0..r1 (and its share of `shared` blocks every
 * row's table starts with, the cascade's, first: row -1, row 0's table), for no layer
 * yet (kv_prefetch_layer); per_call 0 (off) where the batch's blocks of a layer exceed
 * KV_PREFETCH_MAX_BYTES. The rows and their lengths are the step's: once a step. */
static inline kv_prefetch_t kv_prefetch_init(const int32_t *tables, int64_t stride,
                                             const int64_t *lens, int64_t B, int64_t shared,
                                             int64_t r0, int64_t r1, int tid, int nth,
                                             int64_t KVH, int64_t NB, int64_t BS, int64_t D) {
    kv_prefetch_t c = {NULL, NULL, tables, lens, stride, shared, 0, 0, r0, r1, 0, 0, 0,
                       KVH, NB, BS, D, 0};
    share(shared, tid, nth, &c.sh0, &c.sh1);
    int64_t all = shared, mine = c.sh1 - c.sh0;
    for (int64_t r = 0; r < B; r++) {
        const int64_t own = (lens[r] + BS - 1) / BS - shared;
        all += own;
        if (r >= r0 && r < r1) mine += own;
    }
    if ((size_t)(all * KVH) * 4 * (size_t)(BS * D) > KV_PREFETCH_MAX_BYTES) return c;
    c.r = c.sh1 > c.sh0 ? -1 : r0;
    c.j = c.sh1 > c.sh0 ? c.sh0 : shared;
    c.per_call = (mine * KVH + KV_PREFETCH_CALLS - 1) / KV_PREFETCH_CALLS;
    return c;
}

/* the step's cursor c at its start, over layer L's bf16 pools (NULL: none, off) */
static inline kv_prefetch_t kv_prefetch_layer(const kv_prefetch_t *c, const tm_layer_t *L) {
    kv_prefetch_t l = *c;
    l.k = L ? L->k_cache : NULL;
    l.v = L ? L->v_cache : NULL;
    return l;
}

/* the next per_call items' K and V blocks (paged_decode.c's L2 prefetch) */
static inline void kv_prefetch_step(kv_prefetch_t *c) {
    if (!c || !c->k) return;
    const int64_t elems = c->BS * c->D;
    for (int64_t n = 0; n < c->per_call && c->r < c->r1; n++) {
        const int64_t row = c->r < 0 ? 0 : c->r;
        const int64_t head = c->kh * c->NB * elems;
        prefetch_blocks_l2(c->k + head, c->v + head, c->tables + row * c->stride + c->j, 1,
                           elems);
        const int64_t lo = c->r < 0 ? c->sh0 : c->shared;
        const int64_t hi = c->r < 0 ? c->sh1 : (c->lens[c->r] + c->BS - 1) / c->BS;
        if (++c->j < hi) continue;
        c->j = lo;
        if (++c->kh < c->KVH) continue;
        c->kh = 0;
        c->r = c->r < 0 ? c->r0 : c->r + 1;
        c->j = c->shared;
    }
}

/* a thread's share of the groups of w (N rows, K inputs) on the M rows quantized in a
 * (tm_q8_quantize_bf16's layout for M rows of K), into y (M, N) bf16 (fp32 when y_f32).
 * Every thread of the team calls it, between barriers: its own run of the groups, then
 * what is left of the others' (runs.h; nth runs, all empty between
 * linears). lx: LoRA adapters' deltas added to each group as it is done (NULL: none) */
static inline void gemv_share(const uint8_t *w, int64_t fmt, const uint16_t *bias, int64_t K,
                              int64_t N, int64_t bits, int64_t M, const act_t *a, void *y,
                              int64_t y_f32, uint64_t *runs, int tid, int nth,
                              kv_prefetch_t *pf, const lora_out_t *lx) {
    own_run(runs, (N + ROWS - 1) / ROWS, tid, nth);
    int from = 0;
    for (int64_t g; (g = next_group(runs, tid, nth, &from)) >= 0;) {
        group_out(w, fmt, bias, g, M, K, N, bits, a, y, y_f32);
        if (lx) lora_expand_group(lx, g);
        kv_prefetch_step(pf);
    }
}

/* gemv_share, or gemm16's share when `wide` (a->q then holds the int16 activations of
 * quantize16_rows): the same bits; nonzero when gemm16 finds no scratch. lx: as
 * gemv_share's, not with `wide` (whose caller adds the deltas after a barrier) */
static inline int linear_share(const uint8_t *w, int64_t fmt, const uint16_t *bias, int64_t K,
                               int64_t N, int64_t bits, int64_t M, const act_t *a, int wide,
                               uint16_t *y, uint64_t *runs, int tid, int nth,
                               kv_prefetch_t *pf, const lora_out_t *lx) {
    if (wide)
        return gemm16_share(w, fmt, K, N, M, (const int16_t *)a->q, a->d, a->s, y, 0, nth);
    gemv_share(w, fmt, bias, K, N, bits, M, a, y, 0, runs, tid, nth, pf, lx);
    return 0;
}

/* the work item of G query heads of kv head kh of layer L over a sequence's blocks tab,
 * len tokens: its bf16 pools, or its 8-bit ones and their scales (the model's kv_fmt) */
static inline item_t layer_item(const tm_model_t *m, const tm_layer_t *L, int64_t kh,
                                int64_t G, const int32_t *tab, int64_t len) {
    const int64_t head = kh * m->num_blocks * m->block_size;
    item_t it = {NULL, NULL, tab, len, m->block_size, m->head_dim, G, len, m->scale,
                 NULL, NULL, NULL, NULL, NULL};
    if (m->kv_fmt < 0) {
        it.k = L->k_cache + head * m->head_dim;
        it.v = L->v_cache + head * m->head_dim;
    } else {
        it.k8 = (const uint8_t *)L->k_cache + head * m->head_dim;
        it.v8 = (const uint8_t *)L->v_cache + head * m->head_dim;
        it.ks = L->k_scale + head;
        it.vs = L->v_scale + head;
        it.lut = m->kv_fmt == FMT_E4M3 ? lut_e4m3 : m->kv_fmt == FMT_E5M2 ? lut_e5m2 : NULL;
    }
    return it;
}

/* row (D bf16) of kv head h, slot `slot`, into layer L's K (which 0) or V (1) pool */
static inline void store_head(const tm_model_t *m, const tm_layer_t *L, int which, int64_t h,
                              int64_t slot, const uint16_t *row) {
    const int64_t BS = m->block_size, D = m->head_dim;
    const int64_t at = (h * m->num_blocks + slot / BS) * BS + slot % BS;
    uint16_t *pool = which ? L->v_cache : L->k_cache;
    if (m->kv_fmt < 0)
        memcpy(pool + at * D, row, (size_t)D * 2);
    else
        store_row_q8(row, (uint8_t *)pool + at * D, (which ? L->v_scale : L->k_scale) + at, D,
                     m->kv_fmt);
}

/* query heads q (G, D) of one kv head over its blocks (`it`, layer_item's):
 * paged_decode()'s work item, for all G heads of the kv head or some of them (each
 * head's sums are the same operations either way); s: G * len fp32 scratch; out (G, D)
 * bf16. Tokens before `start` (a sliding window's first key, inside the item's first
 * block) are masked: their scores -3e38 (numerators exactly 0, so their V rows add
 * exact zeros) and the maxima taken over the visible ones. */
static void attend_heads(const item_t *item, const uint16_t *q, float *s, uint16_t *out,
                         int64_t start) {
    const item_t it = *item;
    const int64_t G = it.G, D = it.D;
    const int64_t len = it.len;
    float acc[MAX_GROUP_DIM] __attribute__((aligned(64)));
    float mx[MAX_GROUP], sum[MAX_GROUP];
#ifdef TM_AVX512BF16
    const int vector_path = D % 32 == 0;
#endif
    if (it.k8) {
        scores_q8_any(&it, q, s, mx);
    } else {
#ifdef TM_AVX512BF16
    /* compile-time shapes for SmolLM2's kv groups of 3 split between two threads */
    if (vector_path && G == 3 && D == 64) scores_tiled(&it, q, s, mx, 3, 2);
    else if (vector_path && G == 2 && D == 64) scores_tiled(&it, q, s, mx, 2, 2);
    else if (vector_path && G == 1 && D == 64) scores_tiled(&it, q, s, mx, 1, 2);
    /* Llama 3's and Gemma 3's groups: the tiles' loops unrolled at compile time */
    else if (vector_path && G == 4 && D == 128) scores_tiled(&it, q, s, mx, 4, 4);
    else if (vector_path && G == 4 && D == 256) scores_tiled(&it, q, s, mx, 4, 8);
    else if (vector_path && G == 2 && D == 256) scores_tiled(&it, q, s, mx, 2, 8);
    else if (vector_path) scores_tiled(&it, q, s, mx, G, D / 32);
    else
#endif
        scores_generic(&it, q, s, mx);
    }
    for (int64_t g = 0; start > 0 && g < G; g++) {
        float *sg = s + g * len, top = sg[start];
        for (int64_t t = 0; t < start; t++) sg[t] = -3e38f;
        for (int64_t t = start + 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
        mx[g] = top;
    }
    for (int64_t g = 0; g < G; g++) { /* softmax numerators in place, rounded to bf16 */
        float *sg = s + g * len;
        const float m = mx[g];
#if TM_VEC_MATH || TM_VEC_MATH8
        sum[g] = softmax_numerators(sg, len, m);
#else
        float total = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            const float e = expf(sg[t] - m);
            total += e;
            sg[t] = bf16_to_f32(f32_to_bf16(e));
        }
        sum[g] = total;
#endif
    }
    if (it.k8) {
        weighted_v_q8(&it, s, acc);
    } else {
#ifdef TM_AVX512BF16
    if (vector_path && G == 3 && D == 64) weighted_v_pairs(&it, s, acc, 3, 2);
    else if (vector_path && G == 2 && D == 64) weighted_v_pairs(&it, s, acc, 2, 2);
    else if (vector_path && G == 1 && D == 64) weighted_v_pairs(&it, s, acc, 1, 2);
    else if (vector_path && G == 4 && D == 128) weighted_v_pairs(&it, s, acc, 4, 4);
    else if (vector_path && G == 4 && D == 256) weighted_v_pairs(&it, s, acc, 4, 8);
    else if (vector_path && G == 2 && D == 256) weighted_v_pairs(&it, s, acc, 2, 8);
    else if (vector_path) weighted_v_pairs(&it, s, acc, G, D / 32);
    else
#endif
        weighted_v_generic(&it, s, acc);
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.0f / sum[g];
        const float *ag = acc + g * D;
        uint16_t *ob = out + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) ob[d] = f32_to_bf16(ag[d] * inv);
    }
}

/* layer L's MLP output x as it joins the residual stream: x itself, or (Gemma) its
 * norm written into `normed` */
static inline const uint16_t *out_normed(const tm_model_t *m, const tm_layer_t *L,
                                         const uint16_t *x, uint16_t *normed) {
    if (!L->mlp_out_norm) return x;
    rms_norm_row(x, NULL, NULL, L->mlp_out_norm, normed, m->hidden, m->eps);
    return normed;
}

/* query heads q (G, D) of kv head kh of layer L attending over a sequence's len tokens
 * in the blocks tab (attend_heads' s and out): on a local layer (window W) past its
 * window, only the last W tokens, the blocks wholly before them skipped */
static void attend_layer(const tm_model_t *m, const tm_layer_t *L, int64_t kh, int64_t G,
                         const int32_t *tab, int64_t len, const uint16_t *q, float *s,
                         uint16_t *out) {
    int64_t skip = 0, start = 0; /* whole blocks before the window; its first key in the next */
    if (L->window > 0 && len > L->window) {
        const int64_t first = len - L->window;
        skip = first / m->block_size;
        start = first - skip * m->block_size;
    }
    const item_t it = layer_item(m, L, kh, G, tab + skip, len - skip * m->block_size);
    attend_heads(&it, q, s, out, start);
}

static inline size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

#include "moe_step.h" /* a sparse MoE layer's MLP: moe_layer */

/* One row's rank values for linear i, made by the team together: the rank rows in
 * chunks of 8, each claimed by whichever thread takes it next (sync[0]), sync[1]
 * counting the chunks written (release). A thread claims chunks until none is left,
 * so a thread that comes late (descheduled on a shared machine) finds them all
 * made and one that comes early makes them all: the expand's wait (lora_wait on
 * sync[1]) is at most for a chunk another thread is making. Returns the chunk count. */
#define LORA_CHUNK 8
static inline int64_t lora_shrink_team(const tm_lora_t *lo, int i, int64_t K,
                                       const uint16_t *x, uint16_t *xa, int64_t *sync) {
    const int64_t R = lo->r[i], chunks = (R + LORA_CHUNK - 1) / LORA_CHUNK;
    for (int64_t c; (c = __atomic_fetch_add(sync, 1, __ATOMIC_RELAXED)) < chunks;) {
        const int64_t j1 = (c + 1) * LORA_CHUNK < R ? (c + 1) * LORA_CHUNK : R;
        lora_shrink_rank_rows(lo, i, K, x, c * LORA_CHUNK, j1, xa);
        __atomic_fetch_add(sync + 1, 1, __ATOMIC_RELEASE);
    }
    return chunks;
}

/* The step for token `token` at position `pos`: its K/V into `slot`, attention over the
 * seq_len tokens of the blocks `table`. hidden_out (hidden,) bf16: the final norm's
 * output; logits (vocab,) fp32 when the model has an LM head here; lora: the sequence's
 * LoRA adapter (lora_delta.h, one record per layer; NULL: the base), its delta added
 * after each linear. Returns 0; -1 when an input is out of range (nothing written), -2
 * when the scratch cannot be allocated. */
int64_t tm_decode_step(const tm_model_t *m, int64_t token, int64_t pos, int64_t slot,
                       const int32_t *table, int64_t seq_len, uint16_t *hidden_out,
                       float *logits, const tm_lora_t *lora, int64_t num_threads) {
    const int64_t H = m->hidden, NH = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int64_t I = m->inter, BS = m->block_size, NB = m->num_blocks;
    if (token < 0 || token >= m->vocab || pos < 0 || pos >= m->max_pos || slot < 0 ||
        slot >= NB * BS || seq_len < 1 || num_threads < 1 || D > MAX_D || D % ROWS ||
        KVH < 1 || NH % KVH || NH / KVH > MAX_GROUP || (NH / KVH) * D > MAX_GROUP_DIM ||
        H % QK || I % QK || (NH * D) % QK || !formats_ok(m) || !kv_ok(m) || !lora_ok(m, lora) ||
        !moe_ok(m))
        return -1;
    for (int64_t j = 0; j < (seq_len + BS - 1) / BS; j++)
        if (table[j] < 0 || table[j] >= NB) return -1;
    const int64_t G = NH / KVH, QKV = (NH + 2 * KVH) * D, K_MAX = I > H ? I : H;
    const int64_t K_ATTN = NH * D > K_MAX ? NH * D : K_MAX;
    const int64_t q_groups = NH * D / ROWS, head_groups = D / ROWS;
    /* shared: x, two residual buffers, qkv, attention output, gate_up; with an adapter,
     * the row's rank vectors and lora_shrink_team's counters */
    const size_t lora_sync_bytes = 16 * LORA_LINEARS * (size_t)m->num_layers;
    const size_t lora_bytes = lora ? up64(2 * (size_t)MAX_LORA_R) + up64(lora_sync_bytes) : 0;
    const size_t shared_bytes = up64(2 * (size_t)(4 * H + QKV + NH * D + 2 * I)) + lora_bytes;
    /* per thread: a normed row, a private residual, a normed output (Gemma's attention and
     * MLP outputs), the quantized row, the scores */
    const size_t thread_bytes = up64(2 * (size_t)(K_ATTN + 2 * H)) + up64(2 * (size_t)K_ATTN) +
                                up64(12 * (size_t)(K_ATTN / QK)) +
                                up64(4 * (size_t)(G * seq_len));
    const size_t moe_bytes = moe_scratch_bytes(m, 1);
    char *buf = aligned_alloc(64, shared_bytes + (size_t)num_threads * thread_bytes +
                                      runs_bytes(num_threads) + moe_bytes);
    if (!buf) return -2;
    uint64_t *runs = (uint64_t *)(buf + shared_bytes + (size_t)num_threads * thread_bytes);
    const moe_scratch_t moe = moe_scratch(m, 1, (char *)runs + runs_bytes(num_threads));
    memset(runs, 0, runs_bytes(num_threads)); /* every run empty */
    uint16_t *x = (uint16_t *)buf, *res[2] = {x + H, x + 2 * H}, *o_out = x + 3 * H;
    uint16_t *qkv = x + 4 * H, *attn = qkv + QKV, *gu = attn + NH * D;
    memcpy(res[0], m->embed + token * H, (size_t)H * 2);
    lora_parts_t parts[LORA_LINEARS];
    lora_parts(m, parts);
    /* with an adapter: the row's rank vectors, and per layer and linear the two counters
     * of lora_shrink_team */
    uint16_t *lora_xa = (uint16_t *)(buf + shared_bytes - lora_bytes);
    int64_t *lora_sync = (int64_t *)((char *)lora_xa + up64(2 * (size_t)MAX_LORA_R));
    if (lora) memset(lora_sync, 0, lora_sync_bytes);

#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        char *mine = buf + shared_bytes + (size_t)tid * thread_bytes;
        uint16_t *xn = (uint16_t *)mine, *my_res = xn + K_ATTN, *normed = my_res + H;
        char *p = mine + up64(2 * (size_t)(K_ATTN + 2 * H));
        act_t a;
        a.q = (int8_t *)p;
        p += up64(2 * (size_t)K_ATTN);
        a.d = (float *)p;
        a.s = a.d + K_ATTN / QK;
        a.sum = (int32_t *)(a.s + K_ATTN / QK);
        p += up64(12 * (size_t)(K_ATTN / QK));
        float *scores = (float *)p;
        int cur = 0; /* res[cur]: the residual stream so far */
        /* with an adapter: the row's rank vectors made by the team (lora_shrink_team:
         * reading A is most of a shrink's time, and each thread reads its part), then each
         * linear's expand, which waits for the chunks the others are making (no barrier) */
        const int64_t lora_row = 0, lora_start[2] = {0, 1};
        int64_t *sync;
        lora_out_t lora_e;
#define TM_LORA_ROW(i, K, x_in, out)                                                      \
    (lo && lo->r[(i)]                                                                     \
         ? (sync = lora_sync + 2 * (l * LORA_LINEARS + (i)),                              \
            lora_e = (lora_out_t){1, l, (i), &parts[(i)], &lora, &lora_row, lora_start,      \
                                  lora_xa, 0, (out), 0, sync + 1,                        \
                                  lora_shrink_team(lo, (i), (K), (x_in), lora_xa, sync)}, \
            &lora_e)                                                                      \
         : NULL)

        for (int64_t l = 0; l < m->num_layers; l++) {
            const tm_layer_t *L = m->layers + l;
            const tm_lora_t *lo = lora ? lora + l : NULL;
            /* 1. norm (layer 0: of the embedding itself, which is then the residual) */
            if (l == 0) {
                rms_norm_row(res[0], NULL, NULL, L->input_norm, xn, H, m->eps);
            } else {
                uint16_t *dst = tid == 0 ? res[cur ^ 1] : my_res;
                rms_norm_row(out_normed(m, L - 1, x, normed), res[cur], dst, L->input_norm,
                             xn, H, m->eps);
            }
            quantize_row(xn, H, attn_bits(m), &a);
            {   /* QKV rows (with an adapter's delta, before they are rotated and stored);
                 * a K head rotated and stored, a V head stored, by the thread that computed
                 * all its rows (shares end on head boundaries past Q) */
                const lora_out_t *lx = TM_LORA_ROW(0, H, xn, qkv);
                int64_t g0, g1;
                share(QKV / ROWS, tid, nth, &g0, &g1);
                g0 = head_aligned(g0, q_groups, head_groups);
                g1 = head_aligned(g1, q_groups, head_groups);
                for (int64_t g = g0; g < g1; g++) {
                    group_out(L->qkv, L->qkv_fmt, L->qkv_bias, g, 1, H, QKV, attn_bits(m), &a,
                              qkv, 0);
                    if (lx) lora_expand_group(lx, g);
                }
                for (int64_t g = g0 > q_groups ? g0 : q_groups; g < g1; g += head_groups) {
                    const int64_t u = (g - q_groups) / head_groups; /* K heads, then V */
                    const int64_t h = u % KVH;
                    uint16_t *row = qkv + (NH + u) * D;
                    if (u < KVH) norm_rotate_head(m, L, L->k_norm, row, pos);
                    store_head(m, L, u >= KVH, h, slot, row);
                }
            }
#pragma omp barrier
            if (l > 0) cur ^= 1;
            /* 2. attention: this thread's query heads, those of one kv head together.
             * A kv head whose query heads a share boundary splits is read by both
             * threads: the even thread takes its kv heads last to first, so that both
             * start on the one they share (tid 0's last, tid 1's first) and the second
             * read finds it in the shared cache instead of memory. */
            {
                int64_t h0, h1;
                share(NH, tid, nth, &h0, &h1);
                for (int64_t h = h0; h < h1; h++)
                    norm_rotate_head(m, L, L->q_norm, qkv + h * D, pos);
                if (h1 > h0) {
                    const int64_t k0 = h0 / G, k1 = (h1 - 1) / G, back = tid % 2 == 0;
                    for (int64_t i = 0; i <= k1 - k0; i++) {
                        const int64_t kh = back ? k1 - i : k0 + i;
                        const int64_t lo = kh * G > h0 ? kh * G : h0;
                        const int64_t hi = (kh + 1) * G < h1 ? (kh + 1) * G : h1;
                        attend_layer(m, L, kh, hi - lo, table, seq_len, qkv + lo * D, scores,
                                     attn + lo * D);
                    }
                }
            }
#pragma omp barrier
            /* 3. o_proj */
            quantize_row(attn, NH * D, attn_bits(m), &a);
            gemv_share(L->o, L->o_fmt, L->o_bias, NH * D, H, attn_bits(m), 1, &a, o_out, 0,
                       runs, tid, nth, NULL, TM_LORA_ROW(1, NH * D, attn, o_out));
#pragma omp barrier
            /* 4. residual add + norm, gate_up */
            const uint16_t *o_in = L->attn_out_norm ? normed : o_out;
            if (L->attn_out_norm)
                rms_norm_row(o_out, NULL, NULL, L->attn_out_norm, normed, H, m->eps);
            rms_norm_row(o_in, res[cur], tid == 0 ? res[cur ^ 1] : my_res, L->post_norm, xn,
                         H, m->eps);
            if (L->num_experts) { /* router, top k and the routed experts, into x */
                moe_layer(m, L, xn, 1, x, &moe, runs, tid, nth);
                cur ^= 1;
                continue;
            }
            quantize_row(xn, H, m->bits, &a);
            gemv_share(L->gate_up, L->gate_up_fmt, L->gate_up_bias, H, 2 * I, m->bits, 1, &a,
                       gu, 0, runs, tid, nth, NULL, TM_LORA_ROW(2, H, xn, gu));
#pragma omp barrier
            cur ^= 1;
            /* 5. silu * up, down */
            act_mul_row(m, gu, gu + I, xn, I);
            quantize_row(xn, I, m->bits, &a);
            gemv_share(L->down, L->down_fmt, L->down_bias, I, H, m->bits, 1, &a, x, 0, runs,
                       tid, nth, NULL, TM_LORA_ROW(3, I, xn, x));
#pragma omp barrier
        }
#undef TM_LORA_ROW
        /* the final norm (every thread, for the LM head's input), then the LM head */
        rms_norm_row(out_normed(m, m->layers + m->num_layers - 1, x, normed), res[cur],
                     tid == 0 ? res[cur ^ 1] : my_res, m->final_norm, xn, H, m->eps);
        if (tid == 0) memcpy(hidden_out, xn, (size_t)H * 2);
        if (m->lm_head && logits) {
            quantize_row(xn, H, m->bits, &a);
            gemv_share(m->lm_head, m->lm_head_fmt, NULL, H, m->vocab, m->bits, 1, &a, logits,
                       1, runs, tid, nth, NULL, NULL);
        }
    }
    free(buf);
    return 0;
}

/* A decode step of B sequences, one new token each (B >= 1), in one call and one
 * parallel region: the batched form of tm_decode_step, with the module path's
 * arithmetic row by row (linear_group's rows are independent of the batch, and each
 * (row, kv head) attends as paged_decode.c's item does). Per layer, with T threads:
 *   1. rows split: residual add + RMSNorm, the rows' activations quantized;    barrier
 *   2. QKV groups (all B rows per pass over a group's weights);                barrier
 *   3. (row, kv head) items, dynamically: K head rotated and stored, V head stored,
 *      the kv head's query heads rotated and attending;                        barrier
 *      with shared_blocks > 0 (the rows' tables all start with those blocks, a cached
 *      prefix), the items only store and rotate;                               barrier
 *      then paged_decode.c's cascade: the shared blocks read once for all rows,
 *      each row's own blocks, the merge (tm_cascade_decode_bf16's two phases)
 *      ;                                                                  2 barriers
 *   4. rows split: attention output quantized;                                 barrier
 *      o_proj groups;                                                          barrier
 *   5. rows split: residual add + norm, quantized;                             barrier
 *      gate_up groups;                                                         barrier
 *   6. rows split: silu * up, quantized;                                       barrier
 *      down groups;                                                            barrier
 *      (between the groups of 5 and 6, the next layer's K/V blocks are prefetched:
 *      kv_prefetch_step)
 *   with LoRA adapters, at each linear: the adapters' shrink (their rows' x A) in the
 *   row phase before it, by the rows' threads, and their expand inside the linear, on
 *   each group of outputs as it is done (lora_delta.h): no barrier of their own (with
 *   `wide`, gemm16's split: the expand after the linear's barrier;            barrier)
 * then the final norm, hidden_out, and the LM head's groups (fp32 logits, as
 * the module path's). tokens, positions, slots, seq_lens: (B,) int64; tables
 * (B, table_stride) int32 block-table rows; shared_blocks: 0, or how many leading
 * blocks every row's table has in common (the module path's cascade: same bits);
 * hidden_out (B, hidden) bf16; logits (B, vocab) fp32 or NULL. LoRA: lora_slots
 * adapters, slot_lora[s] the records (one per layer, lora_delta.h) of slot s, row_slot
 * (B,) each row's slot or -1 (the base; NULL: every row); after each linear, each slot's
 * rows get its delta, the slot's A and B read once for all of them (lora_batch_t).
 * Returns 0; -1 when an input is out of range (nothing written), -2 when the scratch
 * cannot be allocated. */
int64_t tm_decode_batch(const tm_model_t *m, int64_t B, const int64_t *tokens,
                        const int64_t *positions, const int64_t *slots, const int32_t *tables,
                        int64_t table_stride, int64_t shared_blocks, const int64_t *seq_lens,
                        uint16_t *hidden_out, float *logits, int64_t lora_slots,
                        const tm_lora_t *const *slot_lora, const int64_t *row_slot,
                        int64_t num_threads) {
    const int64_t H = m->hidden, NH = m->heads, KVH = m->kv_heads, D = m->head_dim;
    const int64_t I = m->inter, BS = m->block_size, NB = m->num_blocks;
    if (B < 1 || num_threads < 1 || D > MAX_D || D % ROWS || KVH < 1 || NH % KVH ||
        NH / KVH > MAX_GROUP || (NH / KVH) * D > MAX_GROUP_DIM || H % QK || I % QK ||
        (NH * D) % QK || !formats_ok(m) || !kv_ok(m) || lora_slots < 0 ||
        (lora_slots && (!slot_lora || !row_slot)) ||
        (m->bits == 0 && B > tm_bf16_gemv_max_rows()) || shared_blocks < 0 || !moe_ok(m) ||
        shared_blocks > table_stride || (shared_blocks && (m->kv_fmt >= 0 || windowed(m))))
        return -1;
    /* the widened weights' batches (all or none of the linears: one activation layout) */
    const int wide = TM_AVX2 && m->bits == 16 && attn_bits(m) == 16 && m->wide_min_rows > 0 &&
                     B >= m->wide_min_rows;
    int64_t max_len = 1, max_own = 1;
    for (int64_t r = 0; r < B; r++) {
        const int64_t len = seq_lens[r];
        if (tokens[r] < 0 || tokens[r] >= m->vocab || positions[r] < 0 ||
            positions[r] >= m->max_pos || slots[r] < 0 || slots[r] >= NB * BS || len < 1 ||
            (len + BS - 1) / BS > table_stride)
            return -1;
        for (int64_t j = 0; j < (len + BS - 1) / BS; j++)
            if (tables[r * table_stride + j] < 0 || tables[r * table_stride + j] >= NB)
                return -1;
        max_len = len > max_len ? len : max_len;
        const int64_t own = len - shared_blocks * BS; /* at least the new token */
        if (own < 1) return -1;
        max_own = own > max_own ? own : max_own;
    }
    for (int64_t s = 0; s < lora_slots; s++)
        if (!slot_lora[s] || !lora_ok(m, slot_lora[s])) return -1;
    for (int64_t r = 0; lora_slots && r < B; r++)
        if (row_slot[r] < -1 || row_slot[r] >= lora_slots) return -1;
    const int64_t G = NH / KVH, QKV = (NH + 2 * KVH) * D, K_MAX = I > H ? I : H;
    const int64_t K_ATTN = NH * D > K_MAX ? NH * D : K_MAX, nbk = K_ATTN / QK;
    /* with adapters: the rows grouped by slot, and their rank vectors */
    const size_t lora_bytes = lora_slots ? up64(8 * (size_t)(B + lora_slots + 1)) +
                                               up64(2 * (size_t)B * MAX_LORA_R)
                                         : 0;
    /* shared, B rows each: down output, residual, o_proj output, the linears' input
     * rows (the attention output too), qkv, gate_up; the quantized activations (two planes) */
    const size_t rows_bytes = up64(2 * (size_t)B * (3 * H + K_ATTN + QKV + 2 * I));
    const size_t act_bytes = up64(2 * (size_t)B * K_ATTN) + up64(12 * (size_t)B * nbk);
    const size_t thread_bytes = up64(4 * (size_t)(G * max_len));
    /* with a shared prefix: the cascade's scratch and the rows' own lengths (int32) */
    cascade_t cas = {NULL, QKV, NULL, NULL, tables, table_stride, shared_blocks, NULL, B, NH,
                     KVH, NB, BS, D, max_own, m->scale, NULL, NULL, NULL, {0}};
    int64_t cascade_words = 0;
    size_t cascade_bytes = 0;
    if (shared_blocks) {
        cas.L = cascade_layout(B, NH, KVH, D, BS, shared_blocks, max_own, num_threads);
        cascade_words = cascade_floats(&cas.L, num_threads);
        cascade_bytes = up64(4 * (size_t)cascade_words) + up64(4 * (size_t)B);
    }
    /* the scratch is kept from call to call (one per calling thread), grown when a
     * step needs more: a fresh allocation a step, of a size that changes with the
     * batch and its longest sequence, fragmented the heap (RSS crept up under a soak) */
    static __thread char *kept = NULL;
    static __thread size_t kept_bytes = 0;
    const size_t moe_bytes = moe_scratch_bytes(m, B);
    const size_t need = rows_bytes + act_bytes + (size_t)num_threads * thread_bytes +
                        cascade_bytes + moe_bytes + lora_bytes + runs_bytes(num_threads);
    if (need > kept_bytes) {
        const size_t grown = up64(need + need / 4);
        char *fresh = aligned_alloc(64, grown);
        if (!fresh) return -2;
        free(kept);
        kept = fresh;
        kept_bytes = grown;
    }
    char *buf = kept;
    uint16_t *x = (uint16_t *)buf, *res = x + B * H, *o_out = res + B * H;
    uint16_t *xn = o_out + B * H, *qkv = xn + B * K_ATTN, *gu = qkv + B * QKV;
    act_t act; /* the B rows' quantized activations, shared by the threads */
    act.q = (int8_t *)(buf + rows_bytes);
    act.d = (float *)(buf + rows_bytes + up64(2 * (size_t)B * K_ATTN));
    act.s = act.d + B * nbk;
    act.sum = (int32_t *)(act.s + B * nbk);
    act.x = xn; /* every linear's input rows (B, K), K its inputs */
    if (shared_blocks) {
        char *cb = buf + rows_bytes + act_bytes + (size_t)num_threads * thread_bytes;
        cas.scratch = (float *)cb;
        int32_t *own = (int32_t *)(cb + cascade_bytes - up64(4 * (size_t)B));
        for (int64_t r = 0; r < B; r++) own[r] = (int32_t)(seq_lens[r] - shared_blocks * BS);
        cas.lens = own;
        cas.q = qkv;
        cas.out_bf16 = xn; /* (B, NH * D): the o_proj input */
        if (cascade_setup(&cas, cascade_words, num_threads))
            return -1; /* tables that differ in the shared blocks */
    }
    lora_batch_t lb = {0};
    lora_parts(m, lb.parts);
    if (lora_slots) { /* counting sort of the rows by slot (the base's rows left out) */
        int64_t *order = (int64_t *)(buf + need - runs_bytes(num_threads) - lora_bytes);
        int64_t *start = order + B;
        memset(start, 0, 8 * (size_t)(lora_slots + 1));
        for (int64_t r = 0; r < B; r++)
            if (row_slot[r] >= 0) start[row_slot[r] + 1]++;
        for (int64_t s = 0; s < lora_slots; s++) start[s + 1] += start[s];
        for (int64_t s = 0, at = 0; s < lora_slots; s++)
            for (int64_t r = 0; r < B; r++)
                if (row_slot[r] == s) order[at++] = r;
        lb.slots = lora_slots;
        lb.lora = slot_lora;
        lb.order = order;
        lb.start = start;
        lb.xa = (uint16_t *)((char *)order + up64(8 * (size_t)(B + lora_slots + 1)));
    }
    uint64_t *runs = (uint64_t *)(buf + need - runs_bytes(num_threads));
    memset(runs, 0, runs_bytes(num_threads)); /* every run empty */
    /* [... cascade | moe | lora | runs] */
    const moe_scratch_t moe = moe_scratch(m, B, (char *)runs - lora_bytes - moe_bytes);
    for (int64_t r = 0; r < B; r++)
        memcpy(res + r * H, m->embed + tokens[r] * H, (size_t)H * 2);

    int failed = 0; /* gemm16 found no scratch for its widened groups */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        float *scores = (float *)(buf + rows_bytes + act_bytes + (size_t)tid * thread_bytes);
        int64_t r0, r1; /* this thread's rows for the row-wise phases */
        share(B, tid, nth, &r0, &r1);
        /* the next layer's K/V prefetch during each MLP (kv_prefetch_t) */
        const kv_prefetch_t pf0 = kv_prefetch_init(tables, table_stride, seq_lens, B,
                                                   shared_blocks, r0, r1, tid, nth, KVH, NB,
                                                   BS, D);
/* the rows r0..r1 of the (B, K) linear input xn, quantized at `bits` in the layout of
 * B rows */
#define TM_QUANTIZE_MINE(K, bits)                                                     \
    if (wide)                                                                         \
        quantize16_rows(xn, (K), r0, r1, (int16_t *)act.q, act.d, act.s);             \
    else if (bits)                                                                    \
        for (int64_t r = r0; r < r1; r++)                                             \
            for (int64_t b = 0; b < (K) / QK; b++)                                    \
                quantize_block(xn, B, (K), (bits), act.q, act.d, act.s, act.sum, r, b);
/* linear i's adapter rank vectors of this thread's rows of its input xn (B, K): before
 * the barrier that precedes the linear */
#define TM_LORA_SHRINK(i, K)                                                          \
    if (lb.slots) lora_shrink_mine(&lb, l, (i), (K), xn, r0, r1);
/* linear i's adapter deltas into its output (B rows of `stride`): inside the linear's
 * groups (lx); with `wide` (gemm16's own split), after its barrier, the threads' shares
 * of the groups, then another barrier */
#define TM_LORA_OUT(i, out, stride) lora_out(&lb, l, (i), (out), (stride), &lora_e)
#define TM_LORA_WIDE(lx, N)                                                           \
    if (wide && (lx)) {                                                               \
        int64_t g0, g1;                                                               \
        share((N) / LORA_COLS, tid, nth, &g0, &g1);                                   \
        for (int64_t g = g0; g < g1; g++) lora_expand_group((lx), g);                 \
        _Pragma("omp barrier")                                                        \
    }
        lora_out_t lora_e;
        const lora_out_t *lx;

        for (int64_t l = 0; l < m->num_layers; l++) {
            const tm_layer_t *L = m->layers + l;
            /* 1. norm (layer 0: of the embedding itself, which is the residual) */
            for (int64_t r = r0; r < r1; r++) {
                if (l == 0)
                    rms_norm_row(res + r * H, NULL, NULL, L->input_norm, xn + r * H, H, m->eps);
                else
                    rms_norm_row(out_normed(m, L - 1, x + r * H, x + r * H), res + r * H,
                                 res + r * H, L->input_norm, xn + r * H, H, m->eps);
            }
            TM_QUANTIZE_MINE(H, attn_bits(m))
            TM_LORA_SHRINK(0, H)
#pragma omp barrier
            /* 2. QKV (and the adapters' deltas on each group of it) */
            lx = TM_LORA_OUT(0, qkv, QKV);
            failed |= linear_share(L->qkv, L->qkv_fmt, L->qkv_bias, H, QKV, attn_bits(m), B,
                                   &act, wide, qkv, runs, tid, nth, NULL, lx);
#pragma omp barrier
            TM_LORA_WIDE(lx, QKV)
            /* 3. per (row, kv head): K/V into the cache, q rotated, attention */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < B * KVH; item++) {
                const int64_t r = item / KVH, kh = item % KVH, pos = positions[r];
                uint16_t *row = qkv + r * QKV;
                uint16_t *k_head = row + (NH + kh) * D, *v_head = row + (NH + KVH + kh) * D;
                norm_rotate_head(m, L, L->k_norm, k_head, pos);
                store_head(m, L, 0, kh, slots[r], k_head);
                store_head(m, L, 1, kh, slots[r], v_head);
                for (int64_t h = kh * G; h < (kh + 1) * G; h++)
                    norm_rotate_head(m, L, L->q_norm, row + h * D, pos);
                if (shared_blocks) continue; /* the cascade below, once every row is stored */
                attend_layer(m, L, kh, G, tables + r * table_stride, seq_lens[r],
                             row + kh * G * D, scores, xn + r * NH * D + kh * G * D);
            }
            if (shared_blocks) {
                cascade_t layer_cas = cas;
                layer_cas.k_cache = L->k_cache;
                layer_cas.v_cache = L->v_cache;
                cascade_phases(&layer_cas, tid);
            }
            /* 4. o_proj (its input: the attention rows, written into xn) */
            TM_QUANTIZE_MINE(NH * D, attn_bits(m))
            TM_LORA_SHRINK(1, NH * D)
#pragma omp barrier
            lx = TM_LORA_OUT(1, o_out, H);
            failed |= linear_share(L->o, L->o_fmt, L->o_bias, NH * D, H, attn_bits(m), B,
                                   &act, wide, o_out, runs, tid, nth, NULL, lx);
#pragma omp barrier
            TM_LORA_WIDE(lx, H)
            /* 5. residual add + norm, gate_up (and down, below) with the next layer's
             * K/V blocks prefetched (bf16 pools only) */
            kv_prefetch_t pf = kv_prefetch_layer(
                &pf0, l + 1 < m->num_layers && m->kv_fmt < 0 ? L + 1 : NULL);
            for (int64_t r = r0; r < r1; r++) {
                if (L->attn_out_norm) /* Gemma: the attention output's own norm, in place */
                    rms_norm_row(o_out + r * H, NULL, NULL, L->attn_out_norm, o_out + r * H, H,
                                 m->eps);
                rms_norm_row(o_out + r * H, res + r * H, res + r * H, L->post_norm, xn + r * H,
                             H, m->eps);
            }
            if (L->num_experts) { /* router, top k, the experts grouped by expert, into x */
#pragma omp barrier
                moe_layer(m, L, xn, B, x, &moe, runs, tid, nth);
                continue;
            }
            TM_QUANTIZE_MINE(H, m->bits)
            TM_LORA_SHRINK(2, H)
#pragma omp barrier
            lx = TM_LORA_OUT(2, gu, 2 * I);
            failed |= linear_share(L->gate_up, L->gate_up_fmt, L->gate_up_bias, H, 2 * I,
                                   m->bits, B, &act, wide, gu, runs, tid, nth, &pf, lx);
#pragma omp barrier
            TM_LORA_WIDE(lx, 2 * I)
            /* 6. silu * up, down */
            for (int64_t r = r0; r < r1; r++)
                act_mul_row(m, gu + r * 2 * I, gu + r * 2 * I + I, xn + r * I, I);
            TM_QUANTIZE_MINE(I, m->bits)
            TM_LORA_SHRINK(3, I)
#pragma omp barrier
            lx = TM_LORA_OUT(3, x, H);
            failed |= linear_share(L->down, L->down_fmt, L->down_bias, I, H, m->bits, B, &act,
                                   wide, x, runs, tid, nth, &pf, lx);
#pragma omp barrier
            TM_LORA_WIDE(lx, H)
        }
        /* the final norm, then the LM head */
        for (int64_t r = r0; r < r1; r++) {
            rms_norm_row(out_normed(m, m->layers + m->num_layers - 1, x + r * H, x + r * H),
                         res + r * H, res + r * H, m->final_norm, xn + r * H, H, m->eps);
            memcpy(hidden_out + r * H, xn + r * H, (size_t)H * 2);
        }
        if (m->lm_head && logits) {
            TM_QUANTIZE_MINE(H, m->bits)
#pragma omp barrier
            if (wide) {
                failed |= gemm16_share(m->lm_head, m->lm_head_fmt, H, m->vocab, B,
                                       (const int16_t *)act.q, act.d, act.s, logits, 1, nth);
            } else {
                gemv_share(m->lm_head, m->lm_head_fmt, NULL, H, m->vocab, m->bits, B, &act,
                           logits, 1, runs, tid, nth, NULL, NULL);
            }
        }
#undef TM_QUANTIZE_MINE
#undef TM_LORA_SHRINK
#undef TM_LORA_OUT
#undef TM_LORA_WIDE
    }
    return failed ? -2 : 0;
}

/* Sparse layer `layer`'s MLP alone (moe_step.h's moe_layer, as a step runs it) on B rows
 * x (B, hidden) bf16, the post-attention norm's output, into y (B, hidden) bf16: for
 * tests that hold it against the module path's SparseMoeBlock layer by layer. Returns
 * 0; -1 when the layer is not a sparse one the kernel takes; -2 without scratch. */
int64_t tm_moe_layer(const tm_model_t *m, int64_t layer, const uint16_t *x, int64_t B,
                     uint16_t *y, int64_t num_threads) {
    if (layer < 0 || layer >= m->num_layers || !m->layers[layer].num_experts || B < 1 ||
        num_threads < 1 || m->hidden % QK || !moe_ok(m))
        return -1;
    const size_t moe_bytes = moe_scratch_bytes(m, B);
    char *buf = aligned_alloc(64, moe_bytes + runs_bytes(num_threads));
    if (!buf) return -2;
    uint64_t *runs = (uint64_t *)(buf + moe_bytes);
    memset(runs, 0, runs_bytes(num_threads));
    const moe_scratch_t moe = moe_scratch(m, B, buf);
#pragma omp parallel num_threads(num_threads)
    moe_layer(m, m->layers + layer, x, B, y, &moe, runs, omp_get_thread_num(),
              omp_get_num_threads());
    free(buf);
    return 0;
}
