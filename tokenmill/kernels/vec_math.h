/* e^x and softmax numerators on 16 fp32 lanes that every caller computes alike.
 *
 * The kernels are built with -ffast-math, under which gcc vectorises a loop of expf()
 * with libmvec's vector expf but runs the elements it peels for alignment through
 * scalar expf, and the two differ in the last bit: the same row then gets different
 * numerators in different callers (the module path's kernels and decode_step.c's fused
 * steps), depending on where its buffer lies. Here every fp32 step is a fused or an
 * explicitly rounded intrinsic (round to nearest even, as the plain operators), which
 * gcc keeps as written, so the value depends on the inputs alone. Sums (a norm's sum of
 * squares too, which gcc would otherwise split across lanes by the buffer's alignment)
 * run in 16 lanes and then in lane order. */
#ifndef TOKENMILL_VEC_MATH_H
#define TOKENMILL_VEC_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TM_VEC_MATH 1
#ifndef TM_RN
#define TM_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#endif

/* e^x (Cephes' expf: x = n ln2 + r with ln 2 in two parts, a degree-5 polynomial in r,
 * scaled by 2^n; within 2 ulp of expf), exactly 0 below -87 as expf underflows there
 * (a masked score is -3e38), +inf past 88.7 */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_round_ps(x, _mm512_set1_ps(1.44269504f),
                                                              TM_RN), TM_RN);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_round_ps(r, r, TM_RN),
                        _mm512_add_round_ps(r, _mm512_set1_ps(1.0f), TM_RN));
    return _mm512_maskz_scalef_ps(live, p, _mm512_min_ps(n, _mm512_set1_ps(128.0f)));
}

/* the lanes of a 16-lane step with `left` elements still to go */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 floats -> bf16, rounded to nearest even as f32_to_bf16 */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16));
}

static inline __m512 f32x16(__m256i h) { /* 16 bf16 -> floats */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the 16 lanes of v summed in lane order */
static inline float lane_sum(__m512 v) {
    float lanes[16], sum = 0.0f;
    _mm512_storeu_ps(lanes, v);
    for (int i = 0; i < 16; i++)
        sum = _mm_cvtss_f32(_mm_add_round_ss(_mm_set_ss(sum), _mm_set_ss(lanes[i]), TM_RN));
    return sum;
}

/* s[t] <- bf16(e^(s[t] - m)) as floats for t < len; returns the sum of the unrounded
 * numerators (16 lane sums, then their fixed-order total) */
static inline float softmax_numerators(float *s, int64_t len, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 k = tail_mask(len - t);
        const __m512 e = exp16(_mm512_sub_round_ps(_mm512_maskz_loadu_ps(k, s + t), vm, TM_RN));
        total = _mm512_mask_add_round_ps(total, k, total, e, TM_RN);
        _mm512_mask_storeu_ps(s + t, k, f32x16(bf16x16(e)));
    }
    return lane_sum(total);
}
#define TM_VEC_MATH8 0
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (no AVX-512): the same steps on two 8-lane halves, so the same bits as an
 * AVX-512 machine. The kernels build without -ffast-math on such CPUs (build.py), so
 * the plain intrinsics are kept as written (round to nearest even). */
#include <immintrin.h>
#define TM_VEC_MATH 0
#define TM_VEC_MATH8 1

/* exp16's e^x on 8 lanes: the same polynomial and rounding; its final scalef (p 2^n,
 * n at most 128) as p 2^min(n, 127), exact or rounded once like scalef, times 2 when
 * n is 128 (exact or overflowing as scalef) */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* live lanes have n >= -126 (x >= -87), so 2^e1 is a normal number */
    const __m256 c = _mm256_min_ps(n, _mm256_set1_ps(128.0f));
    const __m256 e1 = _mm256_max_ps(_mm256_min_ps(c, _mm256_set1_ps(127.0f)),
                                    _mm256_set1_ps(-126.0f));
    const __m256 two_e1 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(e1), _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(p, two_e1);
    y = _mm256_blendv_ps(y, _mm256_add_ps(y, y), _mm256_cmp_ps(c, e1, _CMP_GT_OQ));
    return _mm256_and_ps(y, live);
}

/* 8 bf16 -> floats */
static inline __m256 f32x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the bf16 bits (in the low 16 of each lane) of 8 floats, rounded to nearest even */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                              odd), 16);
}

/* floats -> bf16 (rounded to nearest even) into p[0..8) */
static inline void store_bf16x8(uint16_t *p, __m256 v) {
    const __m256i b = bf16_bits8(v);
    _mm_storeu_si128((__m128i *)p,
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* the first n (may be < 1 or > 8) of 8 bf16 as floats, the lanes past n 0 */
static inline __m256 f32x8_n(const uint16_t *p, int64_t n) {
    if (n >= 8) return f32x8(p);
    uint16_t t[8] = {0};
    if (n > 0) memcpy(t, p, (size_t)n * 2);
    return f32x8(t);
}

/* store_bf16x8 of the first n lanes only */
static inline void store_bf16x8_n(uint16_t *p, __m256 v, int64_t n) {
    if (n >= 8) {
        store_bf16x8(p, v);
        return;
    }
    uint16_t t[8];
    store_bf16x8(t, v);
    if (n > 0) memcpy(p, t, (size_t)n * 2);
}

/* v rounded to bf16, as floats */
static inline __m256 round_bf16x8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

/* the 16 lanes lo (0..8) and hi (8..16) summed in lane order, as lane_sum */
static inline float lane_sum8x2(__m256 lo, __m256 hi) {
    float lanes[16], sum = 0.0f;
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    for (int i = 0; i < 16; i++) sum = _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(sum), _mm_set_ss(lanes[i])));
    return sum;
}

/* softmax_numerators of the AVX-512 version, 16 elements a step in two halves; a
 * partial last step runs on a copy padded with -inf (e^-inf = 0 adds nothing) */
static inline float softmax_numerators(float *s, int64_t len, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t t = 0; t < len; t += 16) {
        float pad[16], *src = s + t;
        const int64_t n = len - t < 16 ? len - t : 16;
        if (n < 16) {
            for (int i = 0; i < 16; i++) pad[i] = i < n ? s[t + i] : -INFINITY;
            src = pad;
        }
        for (int h = 0; h < 2; h++) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(src + 8 * h), vm));
            total[h] = _mm256_add_ps(total[h], e);
            _mm256_storeu_ps(src + 8 * h, round_bf16x8(e));
        }
        if (n < 16) memcpy(s + t, pad, (size_t)n * sizeof(float));
    }
    return lane_sum8x2(total[0], total[1]);
}
#else
#define TM_VEC_MATH 0
#define TM_VEC_MATH8 0
#endif
#endif
