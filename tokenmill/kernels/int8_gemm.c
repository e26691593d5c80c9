/* y = x W^T for bf16 activations x (M, K) and int8 weights W (N, K), on AVX512-VNNI:
 * the batched (16-64 row) linears of a decode step (tokenmill/quant/int8_dynamic.py).
 *
 * W is quantized once, symmetric per output channel: W[n, k] ~ sw[n] * q[n, k],
 * q in -127..127. Each call quantizes x per row (token), asymmetric to unsigned
 * bytes: x[m, k] ~ sx[m] * (u[m, k] - z[m]), u in 0..255, so that vpdpbusd
 * (u8 x s8 -> s32, four products per lane) computes sum_k u[m, k] q[n, k] exactly;
 *   y[m, n] = bf16(sx[m] sw[n] (sum_k u[m, k] q[n, k] - z[m] sum_k q[n, k])).
 * The integer sums are exact; the error is the two roundings to 8 bits (weights
 * once, activations per call), then one fp32 product and the bf16 rounding.
 *
 * Packed weight layout: for each block of 16 output channels and each group of 4
 * input features, 64 bytes [16 channels][4 features], so one 512-bit load feeds
 * one vpdpbusd for 16 channels. N is padded to 16 with zero rows; K % 16 == 0.
 * Register tile: 8 rows x 32 channels, 16 named accumulators (an array of them, or 24,
 * gcc spilled to the stack every iteration); ragged rows and channels take a generic
 * tile. Threads split the output channels; each thread reads its weight panels once,
 * keeps a panel in cache across all row tiles and prefetches the next panel while the
 * first row tile runs: at 16 rows the weights' memory traffic, not the multiply-adds,
 * sets the pace (on Zen 4 vpdpbusd does no more multiply-adds a cycle than oneDNN's
 * bf16 dot product; the win is half the bytes).
 *
 * Built at first use by tokenmill/kernels/build.py (-march=native); where the CPU
 * lacks AVX512-VNNI/BW, tm_int8_gemm_available() returns 0 and Python keeps its
 * bf16 path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TM_HAVE_VNNI 1
#else
#define TM_HAVE_VNNI 0
#endif

#define MR 8  /* rows per register tile */
#define NBLK 2 /* 16-channel blocks per register tile */

int tm_int8_gemm_available(void) { return TM_HAVE_VNNI; }

/* packed (N_pad / 16, K / 4, 16, 4) <- q (N, K) int8; wsum[n] = sum_k q[n, k] for
 * n < N_pad (0 for padding). */
void tm_int8_pack_weight(const int8_t *q, int64_t N, int64_t K, int8_t *packed,
                         int32_t *wsum) {
    const int64_t n_pad = (N + 15) / 16 * 16, k4 = K / 4;
    memset(packed, 0, (size_t)(n_pad * K));
    for (int64_t n = 0; n < n_pad; n++) {
        int32_t s = 0;
        if (n < N) {
            const int8_t *row = q + n * K;
            int8_t *blk = packed + (n / 16) * k4 * 64 + (n % 16) * 4;
            for (int64_t k = 0; k < K; k++) {
                blk[(k / 4) * 64 + k % 4] = row[k];
                s += row[k];
            }
        }
        wsum[n] = s;
    }
}

#if TM_HAVE_VNNI
/* u8 row + (scale, zero point) of one bf16 row of K (K % 16 == 0) values. */
static void quantize_row(const uint16_t *x, int64_t K, uint8_t *u, float *scale,
                         int32_t *zero) {
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + k))), 16));
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    /* the range always holds 0, so z is in 0..255 and 0 is exact */
    const float mn = fminf(_mm512_reduce_min_ps(lo), 0.0f);
    const float mx = fmaxf(_mm512_reduce_max_ps(hi), 0.0f);
    /* int8_dynamic.quantize_activations rounds exactly so: a product by the fp32 1/255,
     * then 1/s. The volatile keeps -ffast-math from folding the two into
     * 255 / (mx - mn), which rounds differently (codes would differ at ties) */
    volatile float s_v = mx > mn ? (mx - mn) * (1.0f / 255.0f) : 1.0f;
    const float s = s_v;
    const float inv_s = 1.0f / s_v;
    const int32_t z = (int32_t)nearbyintf(-mn * inv_s);
    *scale = s;
    *zero = z;
    const __m512 inv = _mm512_set1_ps(inv_s);
    const __m512i zv = _mm512_set1_epi32(z);
    const __m512i lo_i = _mm512_setzero_si512(), hi_i = _mm512_set1_epi32(255);
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + k))), 16));
        __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), zv);
        qi = _mm512_min_epi32(_mm512_max_epi32(qi, lo_i), hi_i);
        _mm_storeu_si128((__m128i *)(u + k), _mm512_cvtepi32_epi8(qi));
    }
}

/* fp32 -> bf16, round to nearest even (as torch; no NaNs reach here). */
static inline __m256i f32_to_bf16_v(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* One register tile: rows m0..m0+mr, channel blocks b0..b0+nb (16 channels each). */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int nb, const uint8_t *xu, const float *sx, const int32_t *zx,
    int64_t K, const int8_t *packed, const int32_t *wsum, const float *sw, int64_t N,
    uint16_t *y, int64_t m0, int64_t b0) {
    const int64_t k4 = K / 4;
    __m512i acc[MR][NBLK];
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 2
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_si512();
    const int8_t *w0 = packed + b0 * k4 * 64;
    const uint8_t *xr = xu + m0 * K;
    for (int64_t g = 0; g < k4; g++) {
        __m512i w[NBLK];
#pragma GCC unroll 2
        for (int j = 0; j < nb; j++)
            w[j] = _mm512_loadu_si512((const void *)(w0 + (j * k4 + g) * 64));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            int32_t a4;
            memcpy(&a4, xr + i * K + g * 4, 4);
            const __m512i a = _mm512_set1_epi32(a4);
#pragma GCC unroll 2
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, w[j]);
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < nb; j++) {
        const int64_t n0 = (b0 + j) * 16;
        const __m512i ws = _mm512_loadu_si512((const void *)(wsum + n0));
        const __m512 swv = _mm512_loadu_ps(sw + n0);
        const int64_t left = N - n0;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const __m512i c = _mm512_sub_epi32(
                acc[i][j], _mm512_mullo_epi32(ws, _mm512_set1_epi32(zx[m0 + i])));
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), swv),
                                           _mm512_set1_ps(sx[m0 + i]));
            _mm256_mask_storeu_epi16((void *)(y + (m0 + i) * N + n0), mask, f32_to_bf16_v(v));
        }
    }
}

/* The full tile, 8 rows x 32 channels, with named accumulators (as an array, gcc
 * copies and spills them). `prefetch`: the next tile's weights (read while this one
 * computes: the first row tile streams the panel from memory), or NULL. */
static void tile8x2(const uint8_t *xu, const float *sx, const int32_t *zx, int64_t K,
                    const int8_t *packed, const int32_t *wsum, const float *sw, int64_t N,
                    uint16_t *y, int64_t m0, int64_t b0, const int8_t *prefetch) {
    const int64_t k4 = K / 4;
    const int8_t *wp = packed + b0 * k4 * 64;
    const uint8_t *xr = xu + m0 * K;
    const __m512i z = _mm512_setzero_si512();
    __m512i c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    __m512i c40 = z, c41 = z, c50 = z, c51 = z, c60 = z, c61 = z, c70 = z, c71 = z;
    for (int64_t g = 0; g < k4; g++) {
        if (prefetch) {
            _mm_prefetch((const char *)(prefetch + g * 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(prefetch + g * 128 + 64), _MM_HINT_T0);
        }
        const __m512i w0 = _mm512_loadu_si512((const void *)(wp + g * 64));
        const __m512i w1 = _mm512_loadu_si512((const void *)(wp + (k4 + g) * 64));
        __m512i a;
        int32_t a4;
#define TM_ROW(i)                                                       \
    memcpy(&a4, xr + (i) * K + g * 4, 4);                               \
    a = _mm512_set1_epi32(a4);                                          \
    c##i##0 = _mm512_dpbusd_epi32(c##i##0, a, w0);                      \
    c##i##1 = _mm512_dpbusd_epi32(c##i##1, a, w1);
        TM_ROW(0) TM_ROW(1) TM_ROW(2) TM_ROW(3) TM_ROW(4) TM_ROW(5) TM_ROW(6) TM_ROW(7)
#undef TM_ROW
    }
    const __m512i ws0 = _mm512_loadu_si512((const void *)(wsum + b0 * 16));
    const __m512i ws1 = _mm512_loadu_si512((const void *)(wsum + b0 * 16 + 16));
    const __m512 sw0 = _mm512_loadu_ps(sw + b0 * 16), sw1 = _mm512_loadu_ps(sw + b0 * 16 + 16);
#define TM_OUT(i, j)                                                                       \
    {                                                                                      \
        const __m512i c = _mm512_sub_epi32(                                                \
            c##i##j, _mm512_mullo_epi32(ws##j, _mm512_set1_epi32(zx[m0 + (i)])));          \
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), sw##j),        \
                                       _mm512_set1_ps(sx[m0 + (i)]));                      \
        _mm256_storeu_si256((__m256i *)(y + (m0 + (i)) * N + (b0 + (j)) * 16),             \
                            f32_to_bf16_v(v));                                             \
    }
    TM_OUT(0, 0) TM_OUT(0, 1) TM_OUT(1, 0) TM_OUT(1, 1) TM_OUT(2, 0) TM_OUT(2, 1)
    TM_OUT(3, 0) TM_OUT(3, 1) TM_OUT(4, 0) TM_OUT(4, 1) TM_OUT(5, 0) TM_OUT(5, 1)
    TM_OUT(6, 0) TM_OUT(6, 1) TM_OUT(7, 0) TM_OUT(7, 1)
#undef TM_OUT
}

#define TILE_CASE(R)                                                                     \
    case R:                                                                              \
        if (nb == 2) tile(R, 2, xu, sx, zx, K, packed, wsum, sw, N, y, m0, b0);          \
        else tile(R, 1, xu, sx, zx, K, packed, wsum, sw, N, y, m0, b0);                  \
        break;

static void tile_any(int mr, int nb, const uint8_t *xu, const float *sx, const int32_t *zx,
                     int64_t K, const int8_t *packed, const int32_t *wsum, const float *sw,
                     int64_t N, uint16_t *y, int64_t m0, int64_t b0) {
    switch (mr) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
        TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
    }
}
#endif

/* y (M, N) bf16 <- x (M, K) bf16 against the packed weight. Scratch: xu (M * K bytes),
 * sx (M floats), zx (M int32). Returns 0, or -1 where the kernel cannot run. */
int tm_int8_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                      const int32_t *wsum, const float *sw, int64_t N, uint16_t *y,
                      uint8_t *xu, float *sx, int32_t *zx, int64_t num_threads) {
#if TM_HAVE_VNNI
    if (K % 16 || M <= 0 || N <= 0) return -1;
    const int64_t blocks = (N + 15) / 16, tiles = (blocks + NBLK - 1) / NBLK;
    /* one thread when the call is too small to pay for waking another */
    const int64_t nt = M * N * K < (int64_t)1 << 20 ? 1 : num_threads;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xu + m * K, sx + m, zx + m);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t b0 = t * NBLK;
            const int nb = (int)(blocks - b0 < NBLK ? blocks - b0 : NBLK);
            /* the next tile's panel lies right after this one; none after the last */
            const int8_t *next = t + 1 < tiles ? packed + (b0 + nb) * (K / 4) * 64 : 0;
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int mr = (int)(M - m0 < MR ? M - m0 : MR);
                /* full tiles whose 32 channels are all real (N % 16 may leave a tail) */
                if (mr == MR && nb == NBLK && (b0 + NBLK) * 16 <= N)
                    tile8x2(xu, sx, zx, K, packed, wsum, sw, N, y, m0, b0,
                            m0 == 0 && next && t + 1 < tiles ? next : 0);
                else
                    tile_any(mr, nb, xu, sx, zx, K, packed, wsum, sw, N, y, m0, b0);
            }
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)packed; (void)wsum; (void)sw; (void)N; (void)y;
    (void)xu; (void)sx; (void)zx; (void)num_threads;
    return -1;
#endif
}
