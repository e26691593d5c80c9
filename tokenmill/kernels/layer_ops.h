/* One row (or one token) of each of layer_ops.c's steps, as static inline functions:
 * layer_ops.c runs them over rows under OpenMP, decode_step.c inside its own parallel
 * region; both compile the same code, so both round the same way. */
#ifndef TOKENMILL_LAYER_OPS_H
#define TOKENMILL_LAYER_OPS_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "vec_math.h"

/* out <- weight * bf16(r * rsqrt(mean(r^2) + eps)) for one row of `hidden`, with r = x
 * (res_in NULL), or r = bf16(x + res_in) written to res_out (res_out may be res_in). */
static inline void rms_norm_row(const uint16_t *xr, const uint16_t *res_in, uint16_t *res_out,
                                const uint16_t *weight, uint16_t *orow, int64_t hidden,
                                float eps) {
#if TM_VEC_MATH
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 k = tail_mask(hidden - i);
        __m512 v = f32x16(_mm256_maskz_loadu_epi16(k, xr + i));
        if (res_in) {
            const __m256i r = bf16x16(_mm512_add_round_ps(
                v, f32x16(_mm256_maskz_loadu_epi16(k, res_in + i)), TM_RN));
            _mm256_mask_storeu_epi16(res_out + i, k, r);
            v = f32x16(r);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const uint16_t *src = res_in ? res_out : xr;
    const __m128 mean = _mm_div_round_ss(_mm_set_ss(lane_sum(acc)), _mm_set_ss((float)hidden),
                                         TM_RN);
    const float inv = _mm_cvtss_f32(_mm_div_round_ss(
        _mm_set_ss(1.0f),
        _mm_sqrt_round_ss(_mm_setzero_ps(), _mm_add_round_ss(mean, _mm_set_ss(eps), TM_RN),
                          TM_RN),
        TM_RN));
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 k = tail_mask(hidden - i);
        const __m512 x = f32x16(bf16x16(_mm512_mul_round_ps(
            f32x16(_mm256_maskz_loadu_epi16(k, src + i)), vinv, TM_RN)));
        _mm256_mask_storeu_epi16(orow + i, k, bf16x16(_mm512_mul_round_ps(
            f32x16(_mm256_maskz_loadu_epi16(k, weight + i)), x, TM_RN)));
    }
#elif TM_VEC_MATH8
    /* the AVX-512 path's steps on two 8-lane halves (same bits); past the end, lanes of
     * zeros (0 * 0 adds nothing to a lane) */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0; i < hidden; i += 16)
        for (int h = 0; h < 2; h++) {
            const int64_t at = i + 8 * h, n = hidden - at;
            __m256 v = f32x8_n(xr + at, n);
            if (res_in) {
                v = round_bf16x8(_mm256_add_ps(v, f32x8_n(res_in + at, n)));
                store_bf16x8_n(res_out + at, v, n);
            }
            acc[h] = _mm256_fmadd_ps(v, v, acc[h]);
        }
    const uint16_t *src = res_in ? res_out : xr;
    const float mean = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(lane_sum8x2(acc[0], acc[1])),
                                                _mm_set_ss((float)hidden)));
    const __m256 vinv = _mm256_set1_ps(_mm_cvtss_f32(_mm_div_ss(
        _mm_set_ss(1.0f), _mm_sqrt_ss(_mm_add_ss(_mm_set_ss(mean), _mm_set_ss(eps))))));
    for (int64_t i = 0; i < hidden; i += 8) {
        const __m256 x = round_bf16x8(_mm256_mul_ps(f32x8_n(src + i, hidden - i), vinv));
        store_bf16x8_n(orow + i, _mm256_mul_ps(f32x8_n(weight + i, hidden - i), x), hidden - i);
    }
#else
    /* the vector path's sum: 16 lanes of fused multiply-adds, then in lane order (the
     * same bits as an AVX-512 machine's; build.py compiles this without -ffast-math) */
    float lanes[16] = {0.0f}, ss = 0.0f;
    for (int64_t i = 0; i < hidden; i++) {
        float v = bf16_to_f32(xr[i]);
        if (res_in) {
            v = round_bf16(v + bf16_to_f32(res_in[i]));
            res_out[i] = f32_to_bf16(v);
        }
        lanes[i % 16] = fmaf(v, v, lanes[i % 16]);
    }
    for (int l = 0; l < 16; l++) ss += lanes[l];
    const uint16_t *src = res_in ? res_out : xr;
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++)
        orow[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(src[i]) * inv));
#endif
}

/* Neox rotary of one head v (D,) in place with that position's rows c, s of the tables */
static inline void rotary_head(uint16_t *v, const float *c, const float *s, int64_t D) {
    const int64_t half = D / 2;
    float a[512], b[512]; /* first and second halves (D <= 1024) */
    for (int64_t i = 0; i < half; i++) {
        a[i] = bf16_to_f32(v[i]);
        b[i] = bf16_to_f32(v[i + half]);
    }
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        v[i] = f32_to_bf16(a[i] * c[i] + b[i] * s[i]);
        v[i + half] = f32_to_bf16(b[i] * c[i + half] + a[i] * s[i + half]);
    }
}

/* o <- bf16(silu(g)) * u, rounded, for one row of `inter` */
static inline void silu_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *o,
                                int64_t inter) {
#if TM_VEC_MATH
    for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 k = tail_mask(inter - i);
        const __m512 gv = f32x16(_mm256_maskz_loadu_epi16(k, g + i));
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 silu = f32x16(bf16x16(_mm512_div_round_ps(
            gv, _mm512_add_round_ps(_mm512_set1_ps(1.0f), e, TM_RN), TM_RN)));
        const __m512 uv = f32x16(_mm256_maskz_loadu_epi16(k, u + i));
        _mm256_mask_storeu_epi16(o + i, k, bf16x16(_mm512_mul_round_ps(silu, uv, TM_RN)));
    }
#elif TM_VEC_MATH8
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 gv = f32x8_n(g + i, inter - i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 silu =
            round_bf16x8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        store_bf16x8_n(o + i, _mm256_mul_ps(silu, f32x8_n(u + i, inter - i)), inter - i);
    }
#else
    for (int64_t i = 0; i < inter; i++) {
        const float gv = bf16_to_f32(g[i]);
        const float silu = round_bf16(gv / (1.0f + expf(-gv)));
        o[i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
    }
#endif
}
/* o <- bf16(gelu_tanh(g)) * u, rounded, for one row of `inter` (Gemma's GeGLU).
 * gelu_tanh(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi), computed as
 * x / (1 + e^(-2 k (x + 0.044715 x^3))) (the same function, no cancellation near 0)
 * with exp16, so the module path (tm_gelu_tanh_mul_bf16) and decode_step.c agree */
#define TM_GELU_C1 1.5957691216057308f  /* 2 sqrt(2 / pi) */
#define TM_GELU_C3 0.07135481627159119f /* 2 sqrt(2 / pi) 0.044715 */
static inline void gelu_tanh_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *o,
                                     int64_t inter) {
#if TM_VEC_MATH
    for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 k = tail_mask(inter - i);
        const __m512 gv = f32x16(_mm256_maskz_loadu_epi16(k, g + i));
        const __m512 inner = _mm512_fmadd_ps(
            _mm512_mul_round_ps(gv, gv, TM_RN), _mm512_set1_ps(TM_GELU_C3),
            _mm512_set1_ps(TM_GELU_C1));
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(),
                                             _mm512_mul_round_ps(gv, inner, TM_RN)));
        const __m512 gelu = f32x16(bf16x16(_mm512_div_round_ps(
            gv, _mm512_add_round_ps(_mm512_set1_ps(1.0f), e, TM_RN), TM_RN)));
        const __m512 uv = f32x16(_mm256_maskz_loadu_epi16(k, u + i));
        _mm256_mask_storeu_epi16(o + i, k, bf16x16(_mm512_mul_round_ps(gelu, uv, TM_RN)));
    }
#elif TM_VEC_MATH8
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 gv = f32x8_n(g + i, inter - i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(gv, gv),
                                             _mm256_set1_ps(TM_GELU_C3),
                                             _mm256_set1_ps(TM_GELU_C1));
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(gv, inner)));
        const __m256 gelu =
            round_bf16x8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        store_bf16x8_n(o + i, _mm256_mul_ps(gelu, f32x8_n(u + i, inter - i)), inter - i);
    }
#else
    for (int64_t i = 0; i < inter; i++) {
        const float gv = bf16_to_f32(g[i]);
        const float inner = fmaf(gv * gv, TM_GELU_C3, TM_GELU_C1);
        const float gelu = round_bf16(gv / (1.0f + expf(-(gv * inner))));
        o[i] = f32_to_bf16(gelu * bf16_to_f32(u[i]));
    }
#endif
}
#endif
