/* LoRA adapters' low-rank deltas inside the fused decode step (decode_step.c).
 *
 * After a linear y = W x (fused qkv and gate_up stay fused), an adapter adds, on each
 * of the linear's sub-projections p (q, k, v / o / gate, up / down) that it targets,
 * B_p (A_p x) into that sub-projection's slice of y. The arithmetic is models/lora.py's:
 * x (bf16) times every sub-projection's A at once (the stacked A), each product rounded
 * to bf16; then per sub-projection B_p times its slice of that, rounded to bf16, and
 * added to the bf16 output. The sums run in their own (vector) order, not torch's: the
 * same values to a bf16 rounding, not the same bits.
 *
 * A batch of rows with several adapters is computed SGMV-style: the rows are grouped
 * by adapter and each row of an adapter's A and B is read once for all of its rows
 * (shrink: A row j against the group's inputs; expand: B row n against the group's
 * rank vectors); rows of the base get nothing.
 */
#ifndef TOKENMILL_LORA_DELTA_H
#define TOKENMILL_LORA_DELTA_H
#include <stdint.h>

#include "bf16.h"

/* one linear's stacked adapter rank at most: its (R,) product on the stack, and the
 * batch's rank vectors' row stride */
#define MAX_LORA_R 512
#define LORA_LINEARS 4 /* qkv, o, gate_up, down */
#define LORA_PARTS 3   /* sub-projections of one linear at most (q, k, v) */

/* One layer of an adapter. Per linear i: a[i] (r[i], K) fp32, the A of every
 * sub-projection the adapter targets, stacked in sub-projection order; b[i] fp32, each
 * targeted sub-projection's scaled B (its rows, its rank) one after the other, row-major;
 * part_r[i][p] the rank on sub-projection p (0: not targeted), summing to r[i]; r[i] 0:
 * no delta on the linear. Both hold bf16 values (the module path's installed weights). */
typedef struct {
    const float *a[LORA_LINEARS], *b[LORA_LINEARS];
    int64_t r[LORA_LINEARS];
    int64_t part_r[LORA_LINEARS][LORA_PARTS];
} tm_lora_t;

/* a linear's sub-projections: their output sizes (the rest 0) */
typedef struct {
    int64_t size[LORA_PARTS];
} lora_parts_t;

/* the ranks agree with each other and the pointers are set */
static inline int lora_layer_ok(const tm_lora_t *lo, const lora_parts_t parts[LORA_LINEARS]) {
    for (int i = 0; i < LORA_LINEARS; i++) {
        int64_t sum = 0;
        for (int p = 0; p < LORA_PARTS; p++) {
            const int64_t r = lo->part_r[i][p];
            if (r < 0 || (r && !parts[i].size[p])) return 0;
            sum += r;
        }
        if (lo->r[i] != sum || sum > MAX_LORA_R || (sum && (!lo->a[i] || !lo->b[i])))
            return 0;
    }
    return 1;
}

static inline float lora_dot_bf16(const float *a, const uint16_t *x, int64_t K) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < K; k++) sum += a[k] * bf16_to_f32(x[k]);
    return sum;
}

static inline float lora_dot_f32(const float *b, const float *v, int64_t R) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t r = 0; r < R; r++) sum += b[r] * v[r];
    return sum;
}

/* out[n] += B_p (xa), for the output columns n in [n0, n1) of every targeted
 * sub-projection p of linear i: xa the row's (r[i],) rank vector (bf16 values). Rows of
 * several adapter rows at once: `rows` (count) their indices, xa of row `row` at
 * xa + row * xa_stride, out of row `row` at out + row * out_stride. */
static void lora_expand(const tm_lora_t *lo, int i, const lora_parts_t *parts,
                        const float *xa, int64_t xa_stride, uint16_t *out, int64_t out_stride,
                        const int64_t *rows, int64_t count, int64_t n0, int64_t n1) {
    int64_t start = 0, r0 = 0;
    const float *b = lo->b[i];
    for (int p = 0; p < LORA_PARTS && parts->size[p]; p++) {
        const int64_t size = parts->size[p], r = lo->part_r[i][p];
        const int64_t lo_n = n0 > start ? n0 : start;
        const int64_t hi_n = n1 < start + size ? n1 : start + size;
        for (int64_t n = lo_n; r && n < hi_n; n++) {
            const float *bn = b + (n - start) * r; /* read once for the group's rows */
            for (int64_t c = 0; c < count; c++) {
                const int64_t row = rows[c];
                uint16_t *y = out + row * out_stride + n;
                *y = f32_to_bf16(bf16_to_f32(*y) +
                                 round_bf16(lora_dot_f32(bn, xa + row * xa_stride + r0, r)));
            }
        }
        b += size * r;
        r0 += r;
        start += size;
    }
}

/* xa[row * xa_stride + j] = A_j x_row rounded to bf16, for the stacked A's rows j in
 * [j0, j1) and the `count` rows `rows` (x of row `row` at x + row * K): each A row read
 * once for all of them */
static void lora_shrink(const tm_lora_t *lo, int i, int64_t K, const uint16_t *x,
                        float *xa, int64_t xa_stride, const int64_t *rows, int64_t count,
                        int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
        const float *a = lo->a[i] + j * K;
        for (int64_t c = 0; c < count; c++)
            xa[rows[c] * xa_stride + j] = round_bf16(lora_dot_bf16(a, x + rows[c] * K, K));
    }
}

/* One row (batch 1): out columns [n0, n1) += the adapter's delta for input x (K,).
 * Every caller computes the whole (R,) product A x itself (a few microseconds): no
 * barrier to share it. */
static void lora_add_row(const tm_lora_t *lo, int i, const lora_parts_t *parts, int64_t K,
                         const uint16_t *x, uint16_t *out, int64_t n0, int64_t n1) {
    float xa[MAX_LORA_R];
    const int64_t row = 0;
    lora_shrink(lo, i, K, x, xa, 0, &row, 1, 0, lo->r[i]);
    lora_expand(lo, i, parts, xa, 0, out, 0, &row, 1, n0, n1);
}

#endif
