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
#include <stdlib.h>
#include <string.h>

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
 * 48-100 us over SmolLM2's 49,152 logits, a few per cent of a batch-1 decode step. Rows go
 * to the threads one at a time (16 rows of Gemma's 262,144: 0.8 ms on one thread). */
void tm_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (rows >= 2 && n >= 4096)
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

/* ---- sampling: one token a row from softmax(x / t), by inverse CDF ---------------- */

#define SAMPLE_BLOCK 1024 /* logits a block: the draw finds its block, then its token */

/* e^(x[i] / t - m) for i < len (len <= SAMPLE_BLOCK) into e (NULL: not kept); returns
 * their sum. t == 1 skips the division. */
static inline float sample_exps(const float *x, int64_t len, float t, float m, float *e) {
#if TM_VEC_MATH
    const __m512 vt = _mm512_set1_ps(t), vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = tail_mask(len - i);
        __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        if (t != 1.0f) v = _mm512_div_round_ps(v, vt, TM_RN);
        const __m512 ex = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_round_ps(v, vm, TM_RN)));
        acc = _mm512_add_round_ps(acc, ex, TM_RN);
        if (e) _mm512_mask_storeu_ps(e + i, k, ex);
    }
    return lane_sum(acc);
#elif TM_VEC_MATH8
    const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (t != 1.0f) v = _mm256_div_ps(v, vt);
        const __m256 ex = exp8(_mm256_sub_ps(v, vm));
        acc = _mm256_add_ps(acc, ex);
        if (e) _mm256_storeu_ps(e + i, ex);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
    for (; i < len; i++) {
        const float ex = expf((t != 1.0f ? x[i] / t : x[i]) - m);
        sum += ex;
        if (e) e[i] = ex;
    }
    return sum;
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < len; i++) {
        const float ex = expf((t != 1.0f ? x[i] / t : x[i]) - m);
        sum += ex;
        if (e) e[i] = ex;
    }
    return sum;
#endif
}

/* the logits in block b of a row of n */
static inline int64_t block_len(int64_t n, int64_t b) {
    return n - b * SAMPLE_BLOCK < SAMPLE_BLOCK ? n - b * SAMPLE_BLOCK : SAMPLE_BLOCK;
}

/* is f +-inf or NaN (from the bits: -ffast-math assumes neither) */
static inline int not_finite(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (b & 0x7f800000u) == 0x7f800000u;
}

/* One row's draw (see tm_sample_f32); -1 where the row has no finite largest logit
 * (a NaN anywhere, +inf, or every logit -inf) or scratch cannot be had. */
static int64_t sample_row(const float *x, int64_t n, float t, float u) {
    const uint32_t *bits = (const uint32_t *)x;
    float best = x[0];
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        best = x[i] > best ? x[i] : best;
        bad |= (bits[i] & 0x7fffffffu) > 0x7f800000u; /* NaN */
    }
    if (bad || not_finite(best)) return -1;
    const float m = t != 1.0f ? best / t : best;
    const int64_t nb = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    float stack[512], *sums = nb <= 512 ? stack : malloc((size_t)nb * sizeof(float));
    if (!sums) return -1;
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        sums[b] = sample_exps(x + b * SAMPLE_BLOCK, block_len(n, b), t, m, 0);
        total += sums[b];
    }
    /* the first block whose running total reaches (1 - u) of the whole: never one with
     * nothing in it */
    const double target = (1.0 - (double)u) * total;
    double before = 0.0;
    int64_t b = 0, last = 0; /* the largest logit's block has e^0 = 1 in it */
    for (; b < nb; b++) {
        if (sums[b] > 0.0f) {
            last = b;
            if (before + sums[b] >= target) break;
        }
        before += sums[b];
    }
    if (b == nb) { /* past the end by the sums' rounding only: the last block with mass */
        b = last;
        before = target - sums[last];
    }
    if (sums != stack) free(sums);
    float e[SAMPLE_BLOCK];
    const int64_t len = block_len(n, b);
    sample_exps(x + b * SAMPLE_BLOCK, len, t, m, e);
    const double residual = target - before;
    double cum = 0.0;
    int64_t pick = -1;
    for (int64_t j = 0; j < len; j++) {
        if (e[j] > 0.0f) {
            pick = j;
            cum += e[j];
            if (cum >= residual) break;
        }
    }
    return pick < 0 ? -1 : b * SAMPLE_BLOCK + pick;
}

/* out[r] <- one token of row r of x (rows, n) fp32, drawn from softmax(x[r] / temp[r])
 * with the row's uniform u[r] in [0, 1): the first token whose cumulative probability
 * reaches (1 - u[r]) of the total, as sampling_ops.inverse_cdf_draw does over
 * torch.softmax (the same draw but for the rounding of the sums; a token of
 * probability 0, e.g. a logit of -inf, is never taken). -1 for a row it cannot draw
 * (see sample_row): the caller keeps torch's path for it. Rows go to the threads one at
 * a time. */
void tm_sample_f32(const float *x, int64_t rows, int64_t n, const float *temp,
                   const float *u, int64_t *out, int64_t num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (rows >= 2 && n >= 4096)
    for (int64_t r = 0; r < rows; r++) out[r] = sample_row(x + r * n, n, temp[r], u[r]);
}
