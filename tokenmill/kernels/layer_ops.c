/* The small per-layer steps of a Llama decoder, each fused into one call, for
 * bfloat16 activations: residual add + RMSNorm, rotary embedding in place, and
 * SiLU(gate) * up. In torch each is 3-9 separate ops, and at decode batch sizes
 * the cost of an op is its dispatch, not its arithmetic. And greedy sampling's argmax
 * over fp32 logits, which torch runs one element at a time.
 *
 * Every function rounds where torch's bf16 ops round, so results match the
 * plain torch path of tokenmill/models/layers.py except for the order of fp32
 * sums (RMSNorm's mean of squares). Rows go to the OpenMP threads only when
 * there are enough of them to pay for it, a few at a time as the threads come
 * free (on a busy host one vCPU runs slower than the other: static halves would
 * wait for it).
 *
 * The per-row bodies are in layer_ops.h (decode_step.c runs them too).
 * Built at first use by tokenmill/kernels/build.py; see layer_ops.py.
 */
#include <math.h>
#include <stdint.h>

#include "layer_ops.h"

#define PARALLEL_ROWS 32 /* fewer rows run on the calling thread */

/* the rows a thread takes at a time: about 4 takes a thread, at most 8 rows */
static inline int64_t row_chunk(int64_t rows, int64_t num_threads) {
    const int64_t c = rows / (4 * (num_threads > 0 ? num_threads : 1));
    return c < 1 ? 1 : c > 8 ? 8 : c;
}

/* out <- weight * bf16(r * rsqrt(mean(r^2) + eps)) with r = x, or, given a residual,
 * r = bf16(x + residual) stored back into residual (the next layer's input).
 * x, residual, out: (rows, hidden) contiguous, out may be x; weight: (hidden,) bf16. */
void tm_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                      uint16_t *out, int64_t rows, int64_t hidden, float eps,
                      int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, row_chunk(rows, num_threads)) num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *rr = residual ? residual + r * hidden : 0;
        rms_norm_row(x + r * hidden, rr, rr, weight, out + r * hidden, hidden, eps);
    }
}

/* Neox rotary embedding in place: for each token t and head h of x (tokens,
 * heads, D) with row stride `row_stride` elements, x <- x * cos + roll(x, D/2) * sin
 * at position pos[t]; cos, sin: (max_pos, D) fp32 with rotate_half's sign in sin. */
void tm_rotary_bf16(uint16_t *x, const int64_t *pos, const float *cos_table,
                    const float *sin_table, int64_t tokens, int64_t heads, int64_t D,
                    int64_t row_stride, int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, row_chunk(tokens, num_threads)) num_threads(num_threads) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + pos[t] * D, *s = sin_table + pos[t] * D;
        for (int64_t h = 0; h < heads; h++) rotary_head(x + t * row_stride + h * D, c, s, D);
    }
}

/* out <- bf16(silu(gate)) * up, rounded, for gate_up (rows, 2 * inter) = [gate | up]. */
void tm_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter,
                      int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, row_chunk(rows, num_threads)) num_threads(num_threads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter;
        silu_mul_row(g, g + inter, out + r * inter, inter);
    }
}

/* out <- bf16(gelu_tanh(gate)) * up, rounded, for gate_up (rows, 2 * inter) = [gate | up]
 * (Gemma's GeGLU; the same rows as decode_step.c's). */
void tm_gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows,
                           int64_t inter, int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, row_chunk(rows, num_threads)) num_threads(num_threads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter;
        gelu_tanh_mul_row(g, g + inter, out + r * inter, inter);
    }
}

/* out[r] <- the first index of the largest of row r of x (rows, n) fp32, as
 * torch.argmax: a NaN counts as larger than any number (the first NaN's index), and
 * -0.0 equals 0.0. Two passes a row, each a plain loop gcc vectorises: the largest
 * value (and whether a NaN is there, from the bits: -ffast-math assumes none), then the
 * first index that holds it. torch's own argmax keeps an index beside every compare:
 * 48-100 us over SmolLM2's 49,152 logits, a few per cent of a batch-1 decode step. */
void tm_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        const uint32_t *bits = (const uint32_t *)row;
        float best = -INFINITY;
        uint32_t nan = 0;
        for (int64_t i = 0; i < n; i++) {
            best = row[i] > best ? row[i] : best;
            nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        }
        int64_t at = 0;
        if (nan) {
            while ((bits[at] & 0x7fffffffu) <= 0x7f800000u) at++;
        } else {
            while (at < n - 1 && row[at] != best) at++;
        }
        out[r] = at;
    }
}
