/* LoRA adapters' low-rank deltas inside the fused decode step (decode_step.c).
 *
 * After a linear y = W x (fused qkv and gate_up stay fused), an adapter adds, on each
 * of the linear's sub-projections p (q, k, v / o / gate, up / down) that it targets,
 * B_p (A_p x) into that sub-projection's slice of y. The arithmetic is models/lora.py's:
 * x (bf16) times every sub-projection's A at once (the stacked A), each product rounded
 * to bf16 (the shrink); then per sub-projection B_p times its slice of that, rounded to
 * bf16, and added to the bf16 output (the expand). A and B are bf16, as the module
 * path's installed weights are: every product is exact in fp32 and the sums run in fp32
 * (vdpbf16ps where the CPU has AVX512-BF16, the same pairs widened on AVX2), in their own
 * order, not torch's: the same values to a bf16 rounding, not the same bits.
 *
 * Where the work goes, so that no barrier is added to the step's: the shrink of a row
 * runs where the linear's input row is made (the batched step's row phase, by the row's
 * thread, before the barrier that precedes the linear; at batch 1, where every thread
 * makes the input row, the threads share its rank rows in chunks, and a linear's expand
 * waits for the chunks the others are still making: decode_step.c's lora_shrink_team);
 * the expand runs inside the linear, on each group
 * of ROWS (16) output columns just after the base computed them (lora_expand_group), by
 * whichever thread took the group. A batch's rows are grouped by adapter (SGMV's
 * segments): a group's columns of an adapter's B are read once for all of its rows.
 *
 * Layouts (built by models/lora.py's native_pair), per linear i of one layer:
 *   a[i]  (r[i], K) bf16: every targeted sub-projection's A (rank, K), stacked along the
 *         rank in sub-projection order: each rank row a contiguous dot product with x;
 *   b[i]  each targeted sub-projection's scaled B, one after the other, as
 *         (size / 16, rank / 2, 16, 2) bf16: for each group of 16 output columns, its
 *         rank pairs, each 16 columns by the pair (j, j + 1) interleaved: one vdpbf16ps
 *         operand, and a group's rows of B contiguous in memory;
 *   part_r[i][p] the rank on sub-projection p, even (an odd rank padded with a zero row
 *         of A and a zero column of B: the same sums), 0 not targeted; r[i] their sum.
 * The rank vectors (A x) are kept as bf16, (rows, MAX_LORA_R).
 */
#ifndef TOKENMILL_LORA_DELTA_H
#define TOKENMILL_LORA_DELTA_H
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LORA_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_ISA 1
#else
#define LORA_ISA 0
#endif

/* one linear's stacked adapter rank at most: the rank vectors' row stride */
#define MAX_LORA_R 512
#define LORA_LINEARS 4 /* qkv, o, gate_up, down */
#define LORA_PARTS 3   /* sub-projections of one linear at most (q, k, v) */
#define LORA_COLS 16   /* output columns of one expand group: decode_step.c's ROWS */

/* One layer of an adapter (the layouts above). r[i] 0: no delta on linear i. */
typedef struct {
    const uint16_t *a[LORA_LINEARS], *b[LORA_LINEARS];
    int64_t r[LORA_LINEARS];
    int64_t part_r[LORA_LINEARS][LORA_PARTS];
} tm_lora_t;

/* a linear's sub-projections: their output sizes (the rest 0) */
typedef struct {
    int64_t size[LORA_PARTS];
} lora_parts_t;

/* the ranks agree with each other, are even, the targeted sub-projections are whole
 * groups of columns, and the pointers are set */
static inline int lora_layer_ok(const tm_lora_t *lo, const lora_parts_t parts[LORA_LINEARS]) {
    for (int i = 0; i < LORA_LINEARS; i++) {
        int64_t sum = 0;
        for (int p = 0; p < LORA_PARTS; p++) {
            const int64_t r = lo->part_r[i][p];
            if (r < 0 || r % 2 || (r && (!parts[i].size[p] || parts[i].size[p] % LORA_COLS)))
                return 0;
            sum += r;
        }
        if (lo->r[i] != sum || sum > MAX_LORA_R || (sum && (!lo->a[i] || !lo->b[i])))
            return 0;
    }
    return 1;
}

/* ---- the shrink: xa[row][j] = bf16(sum_k x[row][k] a[j][k]) for every rank row j ---- */

#if LORA_ISA == 2
/* sum of x (K,) and the rank rows a[0..JB) (K each) into out[0..JB); K % 32 == 0 */
#define LORA_SHRINK_DOTS(JB)                                                         \
    static inline void lora_dots_##JB(const uint16_t *x, const uint16_t *const *a,   \
                                      int64_t K, float *out) {                       \
        __m512 acc[JB];                                                              \
        for (int j = 0; j < JB; j++) acc[j] = _mm512_setzero_ps();                   \
        for (int64_t k = 0; k < K; k += 32) {                                        \
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);                 \
            for (int j = 0; j < JB; j++)                                             \
                acc[j] = _mm512_dpbf16_ps(acc[j], xv,                                \
                                          (__m512bh)_mm512_loadu_si512(a[j] + k));   \
        }                                                                            \
        for (int j = 0; j < JB; j++) out[j] = _mm512_reduce_add_ps(acc[j]);          \
    }
LORA_SHRINK_DOTS(8)
LORA_SHRINK_DOTS(2)
#undef LORA_SHRINK_DOTS

/* 4 rows of x against 4 rank rows at once (each A chunk loaded once for the 4 rows):
 * out[c * 4 + j] */
static inline void lora_dots_4x4(const uint16_t *const *x, const uint16_t *const *a,
                                 int64_t K, float *out) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh av[4];
        for (int j = 0; j < 4; j++) av[j] = (__m512bh)_mm512_loadu_si512(a[j] + k);
        for (int c = 0; c < 4; c++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[c] + k);
            for (int j = 0; j < 4; j++) acc[c * 4 + j] = _mm512_dpbf16_ps(acc[c * 4 + j], xv, av[j]);
        }
    }
    for (int t = 0; t < 16; t++) out[t] = _mm512_reduce_add_ps(acc[t]);
}
#elif LORA_ISA == 1
/* bf16 pairs widened: the even elements (low halves of each 32-bit word) shifted up,
 * the odd ones masked: vdpbf16ps's products, in two fused multiply-adds */
static inline __m256 lora_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 lora_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* K % 16 == 0 */
#define LORA_SHRINK_DOTS(JB)                                                         \
    static inline void lora_dots_##JB(const uint16_t *x, const uint16_t *const *a,   \
                                      int64_t K, float *out) {                       \
        __m256 acc[JB];                                                              \
        for (int j = 0; j < JB; j++) acc[j] = _mm256_setzero_ps();                   \
        for (int64_t k = 0; k < K; k += 16) {                                        \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + k));         \
            const __m256 xe = lora_even(xv), xo = lora_odd(xv);                      \
            for (int j = 0; j < JB; j++) {                                           \
                const __m256i av = _mm256_loadu_si256((const __m256i *)(a[j] + k));  \
                acc[j] = _mm256_fmadd_ps(xe, lora_even(av), acc[j]);                 \
                acc[j] = _mm256_fmadd_ps(xo, lora_odd(av), acc[j]);                  \
            }                                                                        \
        }                                                                            \
        for (int j = 0; j < JB; j++) {                                               \
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[j]),                    \
                                  _mm256_extractf128_ps(acc[j], 1));                 \
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                  \
            s = _mm_add_ss(s, _mm_movehdup_ps(s));                                   \
            out[j] = _mm_cvtss_f32(s);                                               \
        }                                                                            \
    }
LORA_SHRINK_DOTS(4)
LORA_SHRINK_DOTS(2)
#undef LORA_SHRINK_DOTS
#endif

/* one dot product of length K, in any order (the scalar build's, and a tail's) */
static inline float lora_dot(const uint16_t *x, const uint16_t *a, int64_t K) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; k++) s += bf16_to_f32(x[k]) * bf16_to_f32(a[k]);
    return s;
}

/* one input row xr's rank values dst[j] for linear i's rank rows [j0, j1) (j0 even): a
 * row's rank values are the same bits however its rank rows are split (each a dot
 * product of its own, summed in the same order by every block width) */
static void lora_shrink_rank_rows(const tm_lora_t *lo, int i, int64_t K, const uint16_t *xr,
                                  int64_t j0, int64_t j1, uint16_t *dst) {
    const uint16_t *A = lo->a[i];
    int64_t j = j0;
#if LORA_ISA == 2
    for (; j + 8 <= j1; j += 8) {
        const uint16_t *ar[8];
        float out[8];
        for (int t = 0; t < 8; t++) ar[t] = A + (j + t) * K;
        lora_dots_8(xr, ar, K, out);
        for (int t = 0; t < 8; t++) dst[j + t] = f32_to_bf16(out[t]);
    }
#elif LORA_ISA == 1
    for (; j + 4 <= j1; j += 4) {
        const uint16_t *ar[4];
        float out[4];
        for (int t = 0; t < 4; t++) ar[t] = A + (j + t) * K;
        lora_dots_4(xr, ar, K, out);
        for (int t = 0; t < 4; t++) dst[j + t] = f32_to_bf16(out[t]);
    }
#endif
#if LORA_ISA
    for (; j + 2 <= j1; j += 2) {
        const uint16_t *ar[2] = {A + j * K, A + (j + 1) * K};
        float out[2];
        lora_dots_2(xr, ar, K, out);
        dst[j] = f32_to_bf16(out[0]);
        dst[j + 1] = f32_to_bf16(out[1]);
    }
#endif
    for (; j < j1; j++) dst[j] = f32_to_bf16(lora_dot(xr, A + j * K, K));
}

/* xa[row * xa_stride + j] for the `count` rows `rows` (x of row `row` at x + row *
 * x_stride) and every rank row j of linear i's stacked A (K inputs; K % 32 == 0) */
static void lora_shrink(const tm_lora_t *lo, int i, int64_t K, const uint16_t *x,
                        int64_t x_stride, const int64_t *rows, int64_t count, uint16_t *xa,
                        int64_t xa_stride) {
    const int64_t R = lo->r[i];
    const uint16_t *A = lo->a[i];
    int64_t c = 0;
#if LORA_ISA == 2
    for (; c + 4 <= count; c += 4) { /* a batch's rows of one adapter, 4 at a time */
        const uint16_t *xr[4];
        for (int t = 0; t < 4; t++) xr[t] = x + rows[c + t] * x_stride;
        for (int64_t j = 0; j < R; j += 4) {
            /* R is even: a last block of 2 repeats its rank rows, stored once */
            const uint16_t *ar[4];
            for (int t = 0; t < 4; t++) ar[t] = A + (j + t < R ? j + t : j + t - 2) * K;
            float out[16];
            lora_dots_4x4(xr, ar, K, out);
            for (int t = 0; t < 4; t++)
                for (int u = 0; u < 4 && j + u < R; u++)
                    xa[rows[c + t] * xa_stride + j + u] = f32_to_bf16(out[t * 4 + u]);
        }
    }
#endif
    for (; c < count; c++)
        lora_shrink_rank_rows(lo, i, K, x + rows[c] * x_stride, 0, lo->r[i],
                              xa + rows[c] * xa_stride);
}

/* ---- the expand: out[row][n] += bf16(sum_j xa[row][j] b[j][n]) on one column group ---- */

/* Where linear i's output goes and whose deltas it gets: `slots` adapters, lora[s] the
 * records (one per layer) of adapter s, its rows order[start[s] .. start[s + 1]), their
 * rank vectors at xa + row * xa_stride, their outputs at out + row * out_stride. */
typedef struct {
    int64_t slots, layer;
    int i;
    const lora_parts_t *parts;
    const tm_lora_t *const *lora;
    const int64_t *order, *start;
    const uint16_t *xa;
    int64_t xa_stride;
    uint16_t *out;
    int64_t out_stride;
    /* NULL, or the rank vectors are made by several threads (each some rank rows, as
     * the batch-1 step does): the expand waits until *ready >= ready_at (each thread
     * adds 1 to *ready once its share is written) */
    const int64_t *ready;
    int64_t ready_at;
} lora_out_t;

/* until *ready >= at: the other threads' rank values written (acquire: their stores
 * seen). They write them just before, so this rarely spins; it yields the core now and
 * then in case a peer is descheduled (a shared machine). */
static inline void lora_wait(const int64_t *ready, int64_t at) {
    for (unsigned spin = 1; __atomic_load_n(ready, __ATOMIC_ACQUIRE) < at; spin++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (!(spin & 1023)) sched_yield();
    }
}

/* y (16,) bf16 += bf16(acc (16,)), each sum rounded to bf16 (as torch's index_add_ on
 * bf16 rows: the delta rounded, then the sum) */
static inline void lora_add16(uint16_t *y, const float *acc) {
    for (int n = 0; n < LORA_COLS; n++)
        y[n] = f32_to_bf16(bf16_to_f32(y[n]) + round_bf16(acc[n]));
}

/* `count` rows (their indices rows[]) of one adapter: the 16 columns of group bg
 * (rank/2 pairs, each 16 columns x 2, contiguous) against their rank vectors' slice
 * xa + row * xa_stride (rank values), added into out + row * out_stride */
static inline void lora_expand_rows(const uint16_t *bg, int64_t rank, const uint16_t *xa,
                                    int64_t xa_stride, uint16_t *out, int64_t out_stride,
                                    const int64_t *rows, int64_t count) {
    const int64_t pairs = rank / 2;
#if LORA_ISA == 2
    for (int64_t c0 = 0; c0 < count; c0 += 8) {
        const int64_t m = count - c0 < 8 ? count - c0 : 8;
        __m512 acc[8];
        const uint16_t *v[8];
        for (int t = 0; t < 8; t++) {
            acc[t] = _mm512_setzero_ps();
            v[t] = xa + rows[c0 + (t < m ? t : 0)] * xa_stride;
        }
        for (int64_t p = 0; p < pairs; p++) {
            const __m512bh bv = (__m512bh)_mm512_loadu_si512(bg + p * 32);
            for (int t = 0; t < 8; t++) {
                if (t >= m) break;
                int32_t pair; /* the rank values 2p, 2p + 1: one bf16 pair */
                memcpy(&pair, v[t] + 2 * p, 4);
                acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_set1_epi32(pair), bv);
            }
        }
        for (int t = 0; t < m; t++) {
            /* y + bf16(acc), rounded to nearest even as f32_to_bf16 */
            uint16_t *y = out + rows[c0 + t] * out_stride;
            const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
            __m512i d = _mm512_castps_si512(acc[t]);
            d = _mm512_add_epi32(d, _mm512_add_epi32(half, _mm512_and_si512(
                                                         _mm512_srli_epi32(d, 16), one)));
            d = _mm512_slli_epi32(_mm512_srli_epi32(d, 16), 16);
            const __m512i yw = _mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)y)), 16);
            __m512i s = _mm512_castps_si512(
                _mm512_add_ps(_mm512_castsi512_ps(yw), _mm512_castsi512_ps(d)));
            s = _mm512_add_epi32(s, _mm512_add_epi32(half, _mm512_and_si512(
                                                         _mm512_srli_epi32(s, 16), one)));
            _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(_mm512_srli_epi32(s, 16)));
        }
    }
#elif LORA_ISA == 1
    for (int64_t c0 = 0; c0 < count; c0 += 4) {
        const int64_t m = count - c0 < 4 ? count - c0 : 4;
        __m256 lo[4], hi[4];
        const uint16_t *v[4];
        for (int t = 0; t < 4; t++) {
            lo[t] = hi[t] = _mm256_setzero_ps();
            v[t] = xa + rows[c0 + (t < m ? t : 0)] * xa_stride;
        }
        for (int64_t p = 0; p < pairs; p++) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(bg + p * 32));
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(bg + p * 32 + 16));
            const __m256 e0 = lora_even(b0), o0 = lora_odd(b0);
            const __m256 e1 = lora_even(b1), o1 = lora_odd(b1);
            for (int t = 0; t < 4; t++) {
                if (t >= m) break;
                const __m256 xe = _mm256_set1_ps(bf16_to_f32(v[t][2 * p]));
                const __m256 xo = _mm256_set1_ps(bf16_to_f32(v[t][2 * p + 1]));
                lo[t] = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, lo[t]));
                hi[t] = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, hi[t]));
            }
        }
        for (int t = 0; t < m; t++) {
            float acc[LORA_COLS];
            _mm256_storeu_ps(acc, lo[t]);
            _mm256_storeu_ps(acc + 8, hi[t]);
            lora_add16(out + rows[c0 + t] * out_stride, acc);
        }
    }
#else
    for (int64_t c = 0; c < count; c++) {
        const uint16_t *v = xa + rows[c] * xa_stride;
        float acc[LORA_COLS] = {0};
        for (int64_t p = 0; p < pairs; p++)
            for (int n = 0; n < LORA_COLS; n++)
                acc[n] += bf16_to_f32(v[2 * p]) * bf16_to_f32(bg[p * 32 + 2 * n]) +
                          bf16_to_f32(v[2 * p + 1]) * bf16_to_f32(bg[p * 32 + 2 * n + 1]);
        lora_add16(out + rows[c] * out_stride, acc);
    }
#endif
}

/* Every adapter's delta on the output columns [16 g, 16 g + 16) of the linear (its
 * groups never straddle two sub-projections: each a multiple of 16 columns). Called by
 * the thread that just computed those columns of the base. */
static inline void lora_expand_group(const lora_out_t *e, int64_t g) {
    if (e->ready) lora_wait(e->ready, e->ready_at);
    const int64_t n0 = g * LORA_COLS;
    int64_t p = 0, start = 0;
    while (p + 1 < LORA_PARTS && e->parts->size[p + 1] && n0 >= start + e->parts->size[p])
        start += e->parts->size[p++];
    if (n0 >= start + e->parts->size[p]) return; /* past the last sub-projection */
    for (int64_t s = 0; s < e->slots; s++) {
        const tm_lora_t *lo = &e->lora[s][e->layer];
        const int64_t rank = lo->part_r[e->i][p], count = e->start[s + 1] - e->start[s];
        if (!rank || !count) continue;
        const uint16_t *b = lo->b[e->i];
        int64_t r0 = 0;
        for (int64_t q = 0; q < p; q++) {
            b += e->parts->size[q] * lo->part_r[e->i][q];
            r0 += lo->part_r[e->i][q];
        }
        lora_expand_rows(b + (n0 - start) * rank, rank, e->xa + r0, e->xa_stride,
                         e->out + n0, e->out_stride, e->order + e->start[s], count);
    }
}

#endif
