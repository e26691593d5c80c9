/* One row (or one token) of each of layer_ops.c's steps, as static inline functions:
 * layer_ops.c runs them over rows under OpenMP, decode_step.c inside its own parallel
 * region; both compile the same code, so both round the same way. */
#ifndef TOKENMILL_LAYER_OPS_H
#define TOKENMILL_LAYER_OPS_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* out <- weight * bf16(r * rsqrt(mean(r^2) + eps)) for one row of `hidden`, with r = x
 * (res_in NULL), or r = bf16(x + res_in) written to res_out (res_out may be res_in). */
static inline void rms_norm_row(const uint16_t *xr, const uint16_t *res_in, uint16_t *res_out,
                                const uint16_t *weight, uint16_t *orow, int64_t hidden,
                                float eps) {
    float ss = 0.0f;
    if (res_in) {
        for (int64_t i = 0; i < hidden; i++) {
            const float v = round_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(res_in[i]));
            res_out[i] = f32_to_bf16(v);
            ss += v * v;
        }
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hidden; i++) {
            const float v = bf16_to_f32(xr[i]);
            ss += v * v;
        }
    }
    const uint16_t *src = res_in ? res_out : xr;
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        orow[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(src[i]) * inv));
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
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float gv = bf16_to_f32(g[i]);
        const float silu = round_bf16(gv / (1.0f + expf(-gv)));
        o[i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
    }
}
#endif
