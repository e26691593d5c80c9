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
 * by adapter, and an adapter's A and B are read for a group of its rows at once
 * (shrink: A^T row k against LORA_ROWS of the group's inputs at a time; expand: a chunk of
 * B^T's columns against each of the group's rank vectors); rows of the base get nothing.
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

/* One layer of an adapter. Per linear i: a[i] (K, r[i]) fp32, the transposed A of every
 * sub-projection the adapter targets, stacked along the rank in sub-projection order;
 * b[i] fp32, each targeted sub-projection's scaled B transposed (its rank, its rows), one
 * after the other; part_r[i][p] the rank on sub-projection p (0: not targeted), summing
 * to r[i]; r[i] 0: no delta on the linear. Both hold bf16 values (the module path's
 * installed weights). Transposed so that both products run along contiguous vectors
 * (the rank for the shrink, the output columns for the expand) instead of as short dot
 * products. */
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

#define LORA_CHUNK 64 /* output columns of one row summed at once on the stack */
#define LORA_ROWS 4    /* rows of one shrink pass over A */

/* out[n] += B_p (xa), for the output columns n in [n0, n1) of every targeted
 * sub-projection p of linear i: xa the row's (r[i],) rank vector (bf16 values). Several
 * rows of one adapter at once: `rows` (count) their indices, xa of row `row` at
 * xa + row * xa_stride, out of row `row` at out + row * out_stride; a chunk of B's
 * columns is read from memory once for all of them. */
static void lora_expand(const tm_lora_t *lo, int i, const lora_parts_t *parts,
                        const float *xa, int64_t xa_stride, uint16_t *out, int64_t out_stride,
                        const int64_t *rows, int64_t count, int64_t n0, int64_t n1) {
    int64_t start = 0, r0 = 0;
    const float *bt = lo->b[i];
    for (int p = 0; p < LORA_PARTS && parts->size[p]; p++) {
        const int64_t size = parts->size[p], r = lo->part_r[i][p];
        const int64_t lo_n = n0 > start ? n0 : start;
        const int64_t hi_n = n1 < start + size ? n1 : start + size;
        for (int64_t c0 = lo_n; r && c0 < hi_n; c0 += LORA_CHUNK) {
            const int64_t w = hi_n - c0 < LORA_CHUNK ? hi_n - c0 : LORA_CHUNK;
            const float *col = bt + (c0 - start); /* B^T (r, size): this chunk's columns */
            for (int64_t c = 0; c < count; c++) {
                const int64_t row = rows[c];
                const float *v = xa + row * xa_stride + r0;
                float acc[LORA_CHUNK] = {0};
                for (int64_t j = 0; j < r; j++) {
                    const float vj = v[j], *bj = col + j * size;
#pragma omp simd
                    for (int64_t n = 0; n < w; n++) acc[n] += vj * bj[n];
                }
                uint16_t *y = out + row * out_stride + c0;
                for (int64_t n = 0; n < w; n++)
                    y[n] = f32_to_bf16(bf16_to_f32(y[n]) + round_bf16(acc[n]));
            }
        }
        bt += size * r;
        r0 += r;
        start += size;
    }
}

/* xa[row * xa_stride + j] = A_j x_row rounded to bf16, for the stacked A's rank
 * columns j in [j0, j1) and the `count` rows `rows` (x of row `row` at x + row * K):
 * A^T's rows read once for LORA_ROWS rows at a time */
static void lora_shrink(const tm_lora_t *lo, int i, int64_t K, const uint16_t *x,
                        float *xa, int64_t xa_stride, const int64_t *rows, int64_t count,
                        int64_t j0, int64_t j1) {
    const int64_t R = lo->r[i], w = j1 - j0;
    const float *at = lo->a[i] + j0;
    for (int64_t c0 = 0; c0 < count && w > 0; c0 += LORA_ROWS) {
        const int64_t m = count - c0 < LORA_ROWS ? count - c0 : LORA_ROWS;
        float acc[LORA_ROWS][MAX_LORA_R];
        for (int64_t c = 0; c < m; c++)
            for (int64_t j = 0; j < w; j++) acc[c][j] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float *ak = at + k * R;
            for (int64_t c = 0; c < m; c++) {
                const float xv = bf16_to_f32(x[rows[c0 + c] * K + k]);
                float *ac = acc[c];
#pragma omp simd
                for (int64_t j = 0; j < w; j++) ac[j] += xv * ak[j];
            }
        }
        for (int64_t c = 0; c < m; c++)
            for (int64_t j = 0; j < w; j++)
                xa[rows[c0 + c] * xa_stride + j0 + j] = round_bf16(acc[c][j]);
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
