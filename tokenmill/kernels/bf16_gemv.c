/* bf16 linears for the rows of a decode step (up to 48): y (M, N) = x (M, K) W^T (+ bias),
 * x, W and the bias bf16, products summed in fp32, y rounded to bf16 (nearest even), as
 * torch's bf16 linear does (the sums in another order: within a bf16 rounding of it).
 *
 * Why: a model loaded from a bf16 checkpoint (`--quantization none`, the default for
 * float checkpoints) ran its decode linears through F.linear, and oneDNN reorders the
 * weight on every call: at one row on the 2-core Zen 4, 17 GB/s on a 3.5 MB weight and
 * 9.6 GB/s on SmolLM2's 57 MB LM head, where reading the weight once is the whole job.
 * Here each thread streams its own run of the rows (runs.h) once, whatever M is.
 *
 * With AVX512-BF16 a vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 sums (products
 * exact in fp32, flushed subnormals); elsewhere the bf16 values are widened exactly and
 * multiplied-added in fp32, in a loop gcc vectorises (AVX2, AVX-512F).
 * Up to 8 rows a pass reads each weight row once from memory; more rows go in passes of
 * 8, two weight rows at a time (compute-bound there: each x chunk loaded for both), the
 * weight rows read again from L1. One step's linears of SmolLM2-135M at 2 threads on
 * the Zen 4 (random weights, 270 MB, best of 5), this ÷ F.linear: 11.1 vs 22.3 ms at 8
 * rows, 14.5 vs 23.8 at 9, 17.4 vs 28.0 at 16, 25.4 vs 34.1 at 24, 46.4 vs 48.7 at 48,
 * 59.7 vs 58.9 at 64: hence MAX_ROWS.
 * Built at first use by tokenmill/kernels/build.py; see bf16_gemv.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "runs.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TM_GEMV_BF16 1
#else
#define TM_GEMV_BF16 0
#endif

#define GROUP 16     /* weight rows a work item */
#define MAX_M 8      /* activation rows a pass over a weight row (registers) */
#define MAX_ROWS 48  /* activation rows a call: passes of up to MAX_M rows each */
#define PARALLEL_GROUPS 8 /* fewer groups run on the calling thread */
#define PF_BYTES 4096 /* prefetched ahead of the load in use (of 0.5, 2 and 4 KB, 4 read fastest) */

/* the most rows a call takes: MAX_ROWS with vdpbf16ps; without it, the portable loop
 * (~26 G multiply-adds/s from 4 rows on the Zen 4 built for AVX2) against oneDNN's
 * emulated bf16 is not measured past one pass, so it takes one pass at most */
int64_t tm_bf16_gemv_max_rows(void) { return TM_GEMV_BF16 ? MAX_ROWS : MAX_M; }

#if TM_GEMV_BF16
/* sums[i] = W row . x row i for M activation rows, in U * M accumulators (M and U
 * constants once inlined): U chunks of 32 inputs a pass, each into its own accumulator,
 * so that U * M vdpbf16ps chains run side by side. One weight row at a time, the rows in
 * order: one stream from memory (four rows interleaved, 1,152 bytes apart, read ~8 GB/s
 * a core from DRAM against ~13-22 for one) */
static inline __attribute__((always_inline)) void dots(const uint16_t *w, const uint16_t *x,
                                                      int64_t K, const int M, const int U,
                                                      float *sums) {
    __m512 acc[4][MAX_M]; /* [u][i] */
    for (int u = 0; u < U; u++)
        for (int i = 0; i < M; i++) acc[u][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
        for (int u = 0; u < U; u++) {
            const uint16_t *wk = w + k + 32 * u;
            _mm_prefetch((const char *)wk + PF_BYTES, _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)wk);
            for (int i = 0; i < M; i++)
                acc[u][i] = _mm512_dpbf16_ps(
                    acc[u][i], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k + 32 * u)));
        }
    for (; k < K; k += 32) { /* the rest, 32 at a time, the last one masked */
        const __mmask32 keep = K - k >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(keep, w + k);
        for (int i = 0; i < M; i++)
            acc[0][i] = _mm512_dpbf16_ps(
                acc[0][i], wv, (__m512bh)_mm512_maskz_loadu_epi16(keep, x + i * K + k));
    }
    for (int i = 0; i < M; i++) {
        __m512 t = acc[0][i];
        for (int u = 1; u < U; u++) t = _mm512_add_ps(t, acc[u][i]);
        sums[i] = _mm512_reduce_add_ps(t);
    }
}

/* dots(w0, x, K, MAX_M, 1, s0) and dots(w1, x, K, MAX_M, 1, s1) at once, the same sums in
 * the same order: each x chunk loaded once for two weight rows (the passes of more than
 * MAX_M rows are bound by the loads, not by memory) */
static inline __attribute__((always_inline)) void dots_pair(
    const uint16_t *w0, const uint16_t *w1, const uint16_t *x, int64_t K, float *s0,
    float *s1) {
    __m512 a0[MAX_M], a1[MAX_M];
    for (int i = 0; i < MAX_M; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w0 + k) + PF_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + k) + PF_BYTES, _MM_HINT_T0);
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)(w0 + k));
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(w1 + k));
        for (int i = 0; i < MAX_M; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
            a0[i] = _mm512_dpbf16_ps(a0[i], v0, xv);
            a1[i] = _mm512_dpbf16_ps(a1[i], v1, xv);
        }
    }
    if (k < K) { /* the last, masked */
        const __mmask32 keep = (__mmask32)((1u << (K - k)) - 1);
        const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(keep, w0 + k);
        const __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(keep, w1 + k);
        for (int i = 0; i < MAX_M; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + i * K + k);
            a0[i] = _mm512_dpbf16_ps(a0[i], v0, xv);
            a1[i] = _mm512_dpbf16_ps(a1[i], v1, xv);
        }
    }
    for (int i = 0; i < MAX_M; i++) {
        s0[i] = _mm512_reduce_add_ps(a0[i]);
        s1[i] = _mm512_reduce_add_ps(a1[i]);
    }
}
#endif

#if !TM_GEMV_BF16
/* w . x over K bf16 pairs in LANES independent fp32 chains, lane j taking inputs j, j +
 * LANES, ..., then added pairwise, for R <= 4 rows of x at once (each row's sums as
 * alone): gcc vectorises the chains without reassociating any sum (AVX2: two ymm of
 * widened bf16 and FMAs), so strict fp32 flags, which CPUs without AVX-512 build with
 * (build.py), keep it a vector loop. A plain running sum cannot be vectorised there: it
 * ran scalar, at ~2 G multiply-adds/s on the Zen 4. */
#define LANES 16
static inline __attribute__((always_inline)) void lane_dots(const uint16_t *w,
                                                           const uint16_t *x, int64_t K,
                                                           const int R, float *sums) {
    float acc[4][LANES]; /* R <= 4 rows of x against one weight row: w widened once */
    for (int i = 0; i < R; i++)
        for (int j = 0; j < LANES; j++) acc[i][j] = 0.0f;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        float wf[LANES];
        for (int j = 0; j < LANES; j++) wf[j] = bf16_to_f32(w[k + j]);
        for (int i = 0; i < R; i++)
            for (int j = 0; j < LANES; j++) acc[i][j] += wf[j] * bf16_to_f32(x[i * K + k + j]);
    }
    for (int i = 0; i < R; i++) {
        for (int j = 0; k + j < K; j++)
            acc[i][j] += bf16_to_f32(w[k + j]) * bf16_to_f32(x[i * K + k + j]);
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int j = 0; j < width; j++) acc[i][j] += acc[i][j + width];
        sums[i] = acc[i][0];
    }
}
#endif

/* one output: the sum rounded to bf16 into y[at], or that bf16 value widened into yf[at] */
static inline void put(uint16_t *y, float *yf, int64_t at, float sum) {
    const uint16_t v = f32_to_bf16(sum);
    if (yf)
        yf[at] = bf16_to_f32(v);
    else
        y[at] = v;
}

/* rows [n0, n1) of y from x (M <= MAX_M rows): bf16 into y, or, given yf, that bf16 value
 * widened to fp32 into yf (M, N) (decode_step.c's logits: the module path's
 * head(x).float()); y and yf have row stride N. noipa: one compiled body, whatever its
 * callers (decode_step.c compiles this file into its own library: the fused step must
 * give the module path's bits) */
static __attribute__((noipa)) void rows_pass(const uint16_t *x, int64_t M, int64_t K,
                                             const uint16_t *w, int64_t N,
                                             const uint16_t *bias, uint16_t *y, float *yf,
                                             int64_t n0, int64_t n1) {
    float sums[MAX_M];
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wn = w + n * K;
#if TM_GEMV_BF16
        switch (M) { /* accumulators: 4 chains at one or two rows, 2 at 3-4, 1 from 5 */
        case 1: dots(wn, x, K, 1, 4, sums); break;
        case 2: dots(wn, x, K, 2, 4, sums); break;
        case 3: dots(wn, x, K, 3, 2, sums); break;
        case 4: dots(wn, x, K, 4, 2, sums); break;
        case 5: dots(wn, x, K, 5, 1, sums); break;
        case 6: dots(wn, x, K, 6, 1, sums); break;
        case 7: dots(wn, x, K, 7, 1, sums); break;
        default: dots(wn, x, K, 8, 1, sums); break;
        }
#else
        int64_t i = 0; /* four rows of x at a time, then the rest one by one */
        for (; i + 4 <= M; i += 4) lane_dots(wn, x + i * K, K, 4, sums + i);
        for (; i < M; i++) lane_dots(wn, x + i * K, K, 1, sums + i);
#endif
        const float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
        for (int64_t i = 0; i < M; i++) put(y, yf, i * N + n, sums[i] + b);
    }
}

/* rows_pass for any M <= MAX_ROWS: passes of MAX_M rows over each weight row (read
 * again from L1), the last pass's rows, fewer, summed in their own order: the same at
 * every call with this M */
static void rows_out(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                     const uint16_t *bias, uint16_t *y, float *yf, int64_t n0, int64_t n1) {
    if (M <= MAX_M) {
        rows_pass(x, M, K, w, N, bias, y, yf, n0, n1);
        return;
    }
    int64_t n = n0;
#if TM_GEMV_BF16
    for (; n + 2 <= n1; n += 2) /* full passes two weight rows at a time, the rest below */
        for (int64_t i0 = 0; i0 < M; i0 += MAX_M) {
            const int64_t m = M - i0 < MAX_M ? M - i0 : MAX_M;
            if (m < MAX_M) {
                rows_pass(x + i0 * K, m, K, w, N, bias, yf ? NULL : y + i0 * N,
                          yf ? yf + i0 * N : NULL, n, n + 2);
                continue;
            }
            float s[2][MAX_M];
            dots_pair(w + n * K, w + (n + 1) * K, x + i0 * K, K, s[0], s[1]);
            for (int j = 0; j < 2; j++) {
                const float b = bias ? bf16_to_f32(bias[n + j]) : 0.0f;
                for (int64_t i = 0; i < MAX_M; i++)
                    put(y, yf, (i0 + i) * N + n + j, s[j][i] + b);
            }
        }
#endif
    for (; n < n1; n++)
        for (int64_t i0 = 0; i0 < M; i0 += MAX_M) {
            const int64_t m = M - i0 < MAX_M ? M - i0 : MAX_M;
            rows_pass(x + i0 * K, m, K, w, N, bias, yf ? NULL : y + i0 * N,
                      yf ? yf + i0 * N : NULL, n, n + 1);
        }
}

/* y (M, N) bf16 = x (M, K) W (N, K)^T (+ bias (N,)), all bf16 and contiguous, M <= MAX_ROWS,
 * the groups of GROUP rows split across num_threads OpenMP threads in runs. Returns 0;
 * -1 when M is out of range or the scratch cannot be allocated. */
int64_t tm_bf16_gemv(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                     const uint16_t *bias, uint16_t *y, int64_t num_threads) {
    if (M < 1 || M > tm_bf16_gemv_max_rows() || K < 1 || N < 0) return -1;
    const int64_t groups = (N + GROUP - 1) / GROUP;
    const int parallel = groups >= PARALLEL_GROUPS && num_threads > 1;
    const int64_t team = parallel ? num_threads : 1;
    uint64_t *runs = runs_new(team);
    if (!runs) return -1;
#pragma omp parallel num_threads(team) if (parallel)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        own_run(runs, groups, tid, nth);
        int from = 0;
        for (int64_t g; (g = next_group(runs, tid, nth, &from)) >= 0;) {
            const int64_t n0 = g * GROUP, n1 = n0 + GROUP < N ? n0 + GROUP : N;
            rows_out(x, M, K, w, N, bias, y, NULL, n0, n1);
        }
    }
    free(runs);
    return 0;
}
