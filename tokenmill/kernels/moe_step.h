/* A sparse MoE layer's MLP inside the fused decode step (decode_step.c): router, top-k,
 * and the routed experts on their own records, for the B rows of a step, between the
 * barriers of the step's one parallel region.
 *
 * The arithmetic is the module path's (models/moe.py SparseMoeBlock, moe_compute.py
 * `route` and `grouped`, quant/moe_experts.py RecordExperts):
 *   router  logits (B, E) bf16 = bf16_gemv.c's rows on the (E, hidden) bf16 router
 *           (models/layers.py Linear at a decode step's rows);
 *   route   softmax over the E logits in fp32, the top k chosen as torch.topk chooses
 *           them on the CPU (libstdc++'s nth_element then a sort of the first k - 1, on
 *           (value, index) pairs compared by value alone: ties fall where that puts
 *           them, not by index; `select_top_k` below is that algorithm), renormalized
 *           to sum 1 with norm_topk (Qwen3-MoE's norm_topk_prob, Mixtral);
 *   experts the step's (row, slot) pairs sorted by expert, stably; each active expert
 *           once for all its rows: gate_up on its records, bf16(silu(gate)) * up, down
 *           on its records (q4q8_gemv.c's linear_group, each expert in its own format);
 *           experts nobody chose are not read;
 *   combine out[r] = sum over slots s, in slot order, of bf16(bf16(w[r][s]) * y[r][s])
 *           in fp32, rounded to bf16 (`(pairs * weights.to(bf16)).sum(dim)`).
 * The exp and the fp32 sums of the softmax are not torch's bit for bit: a weight may
 * differ in its last fp32 bit, rarely enough to move its bf16 rounding.
 *
 * Phases, with T threads (every thread calls moe_layer; it ends on a barrier):
 *   1. router groups of 16 experts, in runs;                                  barrier
 *   2. rows split: softmax, top-k, weights;                                   barrier
 *   3. one thread: pairs sorted by expert, the active experts listed,
 *      the layer's read counters;                                             barrier
 *   4. pairs split: each pair's input row gathered and quantized, in the layout of
 *      its expert's rows (one row: quantized once, blocks split);             barrier
 *   5. (active expert, group of 16 gate_up rows) items, in runs;              barrier
 *   6. pairs split: silu * up, quantized;                                     barrier
 *   7. (active expert, group of 16 down rows) items, in runs;                 barrier
 *   8. columns split: the weighted sum of each row's k outputs;               barrier
 */
#ifndef TOKENMILL_MOE_STEP_H
#define TOKENMILL_MOE_STEP_H

#define MAX_TOP_K 64

/* the shared scratch of one MoE layer for up to B rows (moe_scratch_bytes) */
typedef struct {
    uint16_t *logits;            /* (B, E) bf16 */
    int32_t *ids, *pos, *row_of; /* (P,): a pair's expert; its sorted place; a place's row */
    float *w;                    /* (P,) routing weights, fp32 */
    int32_t *count, *start, *active; /* (E,) rows an expert; its first place; active ids */
    int64_t *n_active;           /* how many of active[] */
    uint16_t *xs;                /* (P, max(H, I)) bf16 the pairs' input rows */
    int8_t *q;                   /* the quantized pairs: two planes of (P, max(H, I)) */
    float *d, *s;                /* (P, max(H, I) / 32) */
    int32_t *sum;
    uint16_t *gu, *out;          /* (P, 2 I), (P, H) bf16 */
} moe_scratch_t;

/* the largest expert count, top k and expert width over the model's layers (0: dense) */
static void moe_shape(const tm_model_t *m, int64_t *E, int64_t *k, int64_t *I) {
    *E = *k = *I = 0;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tm_layer_t *L = m->layers + l;
        *E = L->num_experts > *E ? L->num_experts : *E;
        *k = L->top_k > *k ? L->top_k : *k;
        *I = L->expert_inter > *I ? L->expert_inter : *I;
    }
}

/* the bytes moe_scratch lays out for B rows of a model (0: no MoE layer) */
static size_t moe_scratch_bytes(const tm_model_t *m, int64_t B) {
    int64_t E, k, I;
    moe_shape(m, &E, &k, &I);
    if (!E) return 0;
    const size_t P = (size_t)(B * k), K = (size_t)(I > m->hidden ? I : m->hidden);
    return up64(2 * (size_t)B * E) + 4 * up64(4 * P) + 3 * up64(4 * (size_t)E) + 64 +
           up64(2 * P * K) + up64(2 * P * K) + 3 * up64(4 * P * (K / QK)) +
           up64(4 * P * (size_t)I) + up64(2 * P * (size_t)m->hidden);
}

static moe_scratch_t moe_scratch(const tm_model_t *m, int64_t B, char *p) {
    int64_t E, k, I;
    moe_shape(m, &E, &k, &I);
    const size_t P = (size_t)(B * k), K = (size_t)(I > m->hidden ? I : m->hidden);
    moe_scratch_t S;
#define TM_TAKE(ptr, type, bytes) (ptr) = (type)p; p += up64(bytes);
    TM_TAKE(S.logits, uint16_t *, 2 * (size_t)B * E)
    TM_TAKE(S.ids, int32_t *, 4 * P)
    TM_TAKE(S.pos, int32_t *, 4 * P)
    TM_TAKE(S.row_of, int32_t *, 4 * P)
    TM_TAKE(S.w, float *, 4 * P)
    TM_TAKE(S.count, int32_t *, 4 * (size_t)E)
    TM_TAKE(S.start, int32_t *, 4 * (size_t)E)
    TM_TAKE(S.active, int32_t *, 4 * (size_t)E)
    TM_TAKE(S.n_active, int64_t *, 64)
    TM_TAKE(S.xs, uint16_t *, 2 * P * K)
    TM_TAKE(S.q, int8_t *, 2 * P * K)
    TM_TAKE(S.d, float *, 4 * P * (K / QK))
    TM_TAKE(S.s, float *, 4 * P * (K / QK))
    TM_TAKE(S.sum, int32_t *, 4 * P * (K / QK))
    TM_TAKE(S.gu, uint16_t *, 4 * P * (size_t)I)
    TM_TAKE(S.out, uint16_t *, 2 * P * (size_t)m->hidden)
#undef TM_TAKE
    return S;
}

/* the layers' experts are as the kernel takes them: every record and format named, the
 * top k within what torch.topk picks with nth_element (k * 64 > E: select_top_k is
 * that path), the activations quantized (the records' kernel), widths of whole blocks */
static int moe_ok(const tm_model_t *m) {
    for (int64_t l = 0; l < m->num_layers; l++) {
        const tm_layer_t *L = m->layers + l;
        const int64_t E = L->num_experts, k = L->top_k, I = L->expert_inter;
        if (!E) continue;
        if (E < 1 || k < 1 || k > E || k > MAX_TOP_K || k * 64 <= E || I < QK || I % QK ||
            m->bits == 0 || !L->router || !L->expert_gate_up || !L->expert_down ||
            !L->expert_gate_up_fmt || !L->expert_down_fmt)
            return 0;
        for (int64_t e = 0; e < E; e++) {
            const int64_t f[2] = {L->expert_gate_up_fmt[e], L->expert_down_fmt[e]};
            if (!L->expert_gate_up[e] || !L->expert_down[e]) return 0;
            for (int i = 0; i < 2; i++)
                if (f[i] != FMT_Q4 && f[i] != FMT_Q8 && f[i] != FMT_MIXED && f[i] != FMT_Q5 &&
                    f[i] != FMT_Q6 && f[i] != FMT_Q4K)
                    return 0;
        }
    }
    return 1;
}

/* torch.topk's comparator for the largest: a before b */
static inline int topk_before(const float *v, int32_t a, int32_t b) {
    return (isnan(v[a]) && !isnan(v[b])) || v[a] > v[b];
}

/* libstdc++'s __insertion_sort of idx[f, l) by topk_before */
static void topk_insertion(const float *v, int32_t *idx, int64_t f, int64_t l) {
    if (f == l) return;
    for (int64_t i = f + 1; i < l; i++) {
        const int32_t val = idx[i];
        if (topk_before(v, val, idx[f])) {
            memmove(idx + f + 1, idx + f, (size_t)(i - f) * sizeof(int32_t));
            idx[f] = val;
        } else {
            int64_t j = i;
            while (topk_before(v, val, idx[j - 1])) {
                idx[j] = idx[j - 1];
                j--;
            }
            idx[j] = val;
        }
    }
}

/* idx (E,) = 0..E-1 -> its first k the top k of v in torch.topk's order on the CPU
 * (ATen's topk_impl_loop for k * 64 > E: std::nth_element at k - 1, then std::sort of
 * the first k - 1, which at fewer than 17 elements is an insertion sort; libstdc++'s
 * introselect: median of three moved to the front, an unguarded partition, insertion
 * sort under 4 elements). Past the depth limit, where libstdc++ turns to a heap select,
 * this sorts the rest by insertion: the same top k, their ties perhaps elsewhere. */
static void select_top_k(const float *v, int32_t *idx, int64_t E, int64_t k) {
    int64_t f = 0, l = E, depth = 0;
    const int64_t nth = k - 1;
    for (int64_t n = E; n > 1; n >>= 1) depth += 2; /* 2 * floor(log2(E)) */
    while (l - f > 3) {
        if (depth-- == 0) break;
        const int64_t mid = f + (l - f) / 2, a = f + 1, c = l - 1;
        int64_t s;
        if (topk_before(v, idx[a], idx[mid]))
            s = topk_before(v, idx[mid], idx[c]) ? mid : topk_before(v, idx[a], idx[c]) ? c : a;
        else
            s = topk_before(v, idx[a], idx[c]) ? a : topk_before(v, idx[mid], idx[c]) ? c : mid;
        int32_t t = idx[f];
        idx[f] = idx[s];
        idx[s] = t;
        int64_t lo = f + 1, hi = l;
        for (;;) {
            while (topk_before(v, idx[lo], idx[f])) lo++;
            hi--;
            while (topk_before(v, idx[f], idx[hi])) hi--;
            if (!(lo < hi)) break;
            t = idx[lo];
            idx[lo] = idx[hi];
            idx[hi] = t;
            lo++;
        }
        if (lo <= nth) f = lo;
        else l = lo;
    }
    topk_insertion(v, idx, f, l);
    topk_insertion(v, idx, 0, k - 1);
}

/* one row's routing: logits (E,) bf16 -> ids (k,), weights (k,) fp32 */
static void route_row(const uint16_t *logits, int64_t E, int64_t k, int64_t norm_topk,
                      int32_t *ids, float *w) {
    float p[E];
    int32_t idx[E];
    float mx = -INFINITY, total = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        p[e] = bf16_to_f32(logits[e]);
        mx = p[e] > mx ? p[e] : mx;
    }
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        total += p[e];
    }
    for (int64_t e = 0; e < E; e++) {
        p[e] = p[e] / total;
        idx[e] = (int32_t)e;
    }
    select_top_k(p, idx, E, k);
    float picked = 0.0f;
    for (int64_t s = 0; s < k; s++) picked += p[idx[s]];
    for (int64_t s = 0; s < k; s++) {
        ids[s] = idx[s];
        w[s] = norm_topk ? p[idx[s]] / picked : p[idx[s]];
    }
}

/* y (B, H) bf16 = layer L's routed experts on the B rows xin (B, H) bf16 (the post-
 * attention norm's output), every thread of the team calling it (xin may be each
 * thread's own copy of the same rows); ends on a barrier. */
/* Quantize this thread's share [p0, p1) of the (row, slot) pairs, each in the layout of
 * its expert's rows (width inputs a row: the expert's gate_up input or down input). */
static void quantize_expert_rows(const moe_scratch_t *S, int64_t n_active, int64_t p0,
                                 int64_t p1, int64_t width, int64_t bits) {
    const int64_t nb = width / QK;
    for (int64_t a = 0; a < n_active; a++) {
        const int32_t e = S->active[a];
        const int64_t st = S->start[e], n = S->count[e];
        const int64_t lo = st > p0 ? st : p0, hi = st + n < p1 ? st + n : p1;
        for (int64_t p = lo; p < hi; p++)
            for (int64_t b = 0; b < nb; b++)
                quantize_block(S->xs + st * width, n, width, bits, S->q + 2 * st * width,
                               S->d + st * nb, S->s + st * nb, S->sum + st * nb, p - st, b);
    }
}

static void moe_layer(const tm_model_t *m, const tm_layer_t *L, const uint16_t *xin,
                      int64_t B, uint16_t *y, const moe_scratch_t *S, uint64_t *runs,
                      int tid, int nth) {
    const int64_t H = m->hidden, E = L->num_experts, k = L->top_k, I = L->expert_inter;
    const int64_t P = B * k, bits = m->bits, nbH = H / QK, nbI = I / QK;
    /* 1. router logits, the rows in passes bf16_gemv.c takes */
    {
        const int64_t max_rows = tm_bf16_gemv_max_rows();
        own_run(runs, (E + ROWS - 1) / ROWS, tid, nth);
        int from = 0;
        for (int64_t g; (g = next_group(runs, tid, nth, &from)) >= 0;) {
            const int64_t n0 = g * ROWS, n1 = n0 + ROWS < E ? n0 + ROWS : E;
            for (int64_t r0 = 0; r0 < B; r0 += max_rows) {
                const int64_t mr = B - r0 < max_rows ? B - r0 : max_rows;
                rows_out(xin + r0 * H, mr, H, L->router, E, NULL, S->logits + r0 * E, NULL,
                         n0, n1);
            }
        }
    }
#pragma omp barrier
    /* 2. routing */
    {
        int64_t r0, r1;
        share(B, tid, nth, &r0, &r1);
        for (int64_t r = r0; r < r1; r++)
            route_row(S->logits + r * E, E, k, L->norm_topk, S->ids + r * k, S->w + r * k);
    }
#pragma omp barrier
    /* 3. the pairs sorted by expert (stably: row, then slot), the active experts */
    if (tid == 0) {
        memset(S->count, 0, (size_t)E * sizeof(int32_t));
        for (int64_t p = 0; p < P; p++) S->count[S->ids[p]]++;
        int64_t at = 0, n = 0;
        for (int64_t e = 0; e < E; e++) {
            S->start[e] = (int32_t)at;
            at += S->count[e];
            if (S->count[e]) S->active[n++] = (int32_t)e;
        }
        *S->n_active = n;
        for (int64_t p = 0; p < P; p++) {
            const int32_t e = S->ids[p];
            const int32_t place = S->start[e]++;
            S->pos[p] = place;
            S->row_of[place] = (int32_t)(p / k);
        }
        for (int64_t e = 0; e < E; e++) S->start[e] -= S->count[e]; /* back to the first */
        if (L->expert_reads) { /* the traffic the module path counts (ExpertTraffic) */
            for (int64_t a = 0; a < n; a++) L->expert_reads[S->active[a]]++;
            L->expert_reads[E] += B;
        }
    }
#pragma omp barrier
    const int64_t n_active = *S->n_active;
    /* 4. each place's input row, quantized in the layout of its expert's rows; at one row
     * (every expert's one row the same) once, at place 0, for all of them */
    if (B == 1) {
        int64_t b0, b1;
        share(nbH, tid, nth, &b0, &b1);
        for (int64_t b = b0; b < b1; b++)
            quantize_block(xin, 1, H, bits, S->q, S->d, S->s, S->sum, 0, b);
    } else {
        int64_t p0, p1;
        share(P, tid, nth, &p0, &p1);
        for (int64_t p = p0; p < p1; p++)
            memcpy(S->xs + p * H, xin + S->row_of[p] * H, (size_t)H * 2);
        quantize_expert_rows(S, n_active, p0, p1, H, bits);
    }
#pragma omp barrier
    /* 5. gate_up: (active expert, group) items */
    {
        const int64_t groups = 2 * I / ROWS;
        own_run(runs, n_active * groups, tid, nth);
        int from = 0;
        for (int64_t it; (it = next_group(runs, tid, nth, &from)) >= 0;) {
            const int32_t e = S->active[it / groups];
            const int64_t st = S->start[e], n = S->count[e], qs = B == 1 ? 0 : st;
            linear_group(L->expert_gate_up[e], it % groups, n, H, 2 * I,
                         L->expert_gate_up_fmt[e], bits, S->q + 2 * qs * H, S->d + qs * nbH,
                         S->s + qs * nbH, S->sum + qs * nbH, S->gu + st * 2 * I, 0);
        }
    }
#pragma omp barrier
    /* 6. silu * up, quantized in the layout of the expert's rows (of I inputs now) */
    {
        int64_t p0, p1;
        share(P, tid, nth, &p0, &p1);
        for (int64_t p = p0; p < p1; p++)
            silu_mul_row(S->gu + p * 2 * I, S->gu + p * 2 * I + I, S->xs + p * I, I);
        quantize_expert_rows(S, n_active, p0, p1, I, bits);
    }
#pragma omp barrier
    /* 7. down */
    {
        const int64_t groups = (H + ROWS - 1) / ROWS;
        own_run(runs, n_active * groups, tid, nth);
        int from = 0;
        for (int64_t it; (it = next_group(runs, tid, nth, &from)) >= 0;) {
            const int32_t e = S->active[it / groups];
            const int64_t st = S->start[e], n = S->count[e];
            linear_group(L->expert_down[e], it % groups, n, I, H, L->expert_down_fmt[e], bits,
                         S->q + 2 * st * I, S->d + st * nbI, S->s + st * nbI,
                         S->sum + st * nbI, S->out + st * H, 0);
        }
    }
#pragma omp barrier
    /* 8. the weighted sum, in slot order */
    {
        int64_t h0, h1;
        share(H / 16, tid, nth, &h0, &h1);
        h0 *= 16;
        h1 = h1 * 16;
        for (int64_t r = 0; r < B; r++) {
            float acc[h1 - h0 > 0 ? h1 - h0 : 1];
            for (int64_t h = h0; h < h1; h++) acc[h - h0] = 0.0f;
            for (int64_t s = 0; s < k; s++) {
                const float ws = bf16_to_f32(f32_to_bf16(S->w[r * k + s]));
                const uint16_t *o = S->out + (int64_t)S->pos[r * k + s] * H;
                for (int64_t h = h0; h < h1; h++)
                    acc[h - h0] += bf16_to_f32(f32_to_bf16(ws * bf16_to_f32(o[h])));
            }
            for (int64_t h = h0; h < h1; h++) y[r * H + h] = f32_to_bf16(acc[h - h0]);
        }
    }
#pragma omp barrier
}

#endif
