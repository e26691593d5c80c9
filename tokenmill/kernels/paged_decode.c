/* Decode attention over tokenmill's paged KV cache, reading each block in place.
 *
 * One query per sequence (a decode step). K/V pools are head-major,
 * (kv_heads, num_blocks, block_size, head_dim) in bfloat16; a sequence's
 * blocks are found through its row of the block table. Nothing is gathered:
 * each (sequence, kv head) pair is one work item that walks its blocks twice
 * (scores, then the weighted sum of V) with fp32 accumulation, and the grouped
 * query heads of that kv head share every K/V row they read.
 *
 * 8-bit pools (int8, fp8 e4m3 / e5m2: --kv-cache-dtype) hold one byte per element and
 * one fp32 scale per (token, kv head), (kv_heads, num_blocks, block_size): the
 * scores are scale_t * (q . k8_t) and the values sum (p_t scale_t) v8_t, the bytes
 * widened to fp32 in registers (int8 by conversion, fp8 through a 256-entry table);
 * no dequantized copy of the cache is made. tm_store_kv_q8 computes a row's scale
 * (absmax / the format's largest value) as the row is stored.
 *
 * Three versions of a bf16 work item: AVX512-BF16 intrinsics (q.k with vdpbf16ps,
 * as torch's bf16 matmul: exact products, fp32 sums) where the compiler
 * targets it and head_dim is a multiple of 32, AVX2 intrinsics (bf16 pairs widened in
 * registers, TM_VEC_MATH8) on CPUs without it, and plain C loops that gcc
 * vectorises for any other CPU.
 *
 * Built at first use by tokenmill/kernels/build.py (cc -O3 -march=native
 * -ffast-math -fopenmp: vectorised loops, expf from glibc's libmvec; linked without
 * -ffast-math, which would flush subnormals process-wide) and called through
 * ctypes with raw pointers (tokenmill/kernels/paged_decode.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vec_math.h"
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TM_AVX512BF16 1
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_D 1024
#define MAX_GROUP_DIM 8192 /* query heads per kv head x head_dim, held on the stack */
#define MAX_GROUP 64

typedef struct {
    const uint16_t *k, *v; /* this kv head's pools: (NB, BS, D) */
    const int32_t *tab;    /* this sequence's blocks */
    int64_t len, BS, D, G, s_stride;
    float scale;
    /* 8-bit pools instead of k, v: bytes (NB, BS, D), scales (NB, BS); lut NULL for int8 */
    const uint8_t *k8, *v8;
    const float *ks, *vs, *lut;
} item_t;

enum { FMT_INT8 = 0, FMT_E4M3 = 1, FMT_E5M2 = 2 };

/* fp8 byte -> float, all 256 codes (NaN codes as NaN), filled once */
static float lut_e4m3[256], lut_e5m2[256];
static float fp8_value(uint32_t code, int mbits, int bias) {
    const int sign = code >> 7, e = (code >> mbits) & ((1 << (7 - mbits)) - 1);
    const int m = code & ((1 << mbits) - 1);
    float v;
    if (e == 0) v = ldexpf((float)m, 1 - bias - mbits); /* subnormal */
    else v = ldexpf((float)((1 << mbits) + m), e - bias - mbits);
    if (mbits == 3 && e == 15 && m == 7) v = NAN;      /* e4m3fn: only S.1111.111 is NaN */
    if (mbits == 2 && e == 31) v = m ? NAN : INFINITY; /* e5m2: IEEE-style inf / NaN */
    return sign ? -v : v;
}
static void init_luts(void) {
    static volatile int done = 0;
    if (done) return;
#pragma omp critical(tm_fp8_lut)
    if (!done) {
        for (uint32_t c = 0; c < 256; c++) {
            lut_e4m3[c] = fp8_value(c, 3, 7);
            lut_e5m2[c] = fp8_value(c, 2, 15);
        }
        done = 1;
    }
}
static const float FMT_MAX[3] = {127.0f, 448.0f, 57344.0f};

/* |x| <= the format's max -> the nearest code, ties to the even code (as torch rounds) */
static uint8_t fp8_encode(float x, const float *lut, int top) {
    const float a = fabsf(x);
    int lo = 0, hi = top; /* lut[0..top] are the non-negative finite values, increasing */
    if (!(a < lut[top])) lo = top;
    else {
        while (hi - lo > 1) { /* lut[lo] <= a < lut[hi] */
            const int mid = (lo + hi) / 2;
            if (lut[mid] <= a) lo = mid; else hi = mid;
        }
        const float dl = a - lut[lo], dh = lut[hi] - a;
        if (dh < dl || (dh == dl && (hi & 1) == 0)) lo = hi;
    }
    return (uint8_t)(lo | (x < 0 && lo ? 0x80 : 0));
}

static inline const uint8_t *block_rows8(const item_t *it, const uint8_t *pool,
                                         const float *scales, int64_t j, int64_t *n,
                                         const float **sc) {
    const int64_t t0 = j * it->BS;
    *n = it->len - t0 < it->BS ? it->len - t0 : it->BS;
    *sc = scales + (int64_t)it->tab[j] * it->BS;
    return pool + (int64_t)it->tab[j] * it->BS * it->D;
}

/* the rows of the sequence's j-th block in `pool` (its K or V), and how many it holds */
static inline const uint16_t *block_rows(const item_t *it, const uint16_t *pool, int64_t j,
                                         int64_t *n) {
    const int64_t t0 = j * it->BS;
    *n = it->len - t0 < it->BS ? it->len - t0 : it->BS;
    return pool + (int64_t)it->tab[j] * it->BS * it->D;
}

/* always_inline: a function whose only effect is a prefetch is "const" to gcc, which then
 * drops every call to it (it did, until 2026-12-01: no prefetch was in the library) */
static inline __attribute__((always_inline)) void prefetch_block(const void *blk,
                                                                 int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)blk + off, 0, 3);
}

/* the same into L2 only (a work item ahead, below) */
static inline __attribute__((always_inline)) void prefetch_block_l2(const void *blk,
                                                                    int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)blk + off, 0, 2);
}

/* the K and V rows of blocks tab[0..n) of one kv head's pools into L2 (K skipped when k
 * is NULL): a work item a thread is likely to take next */
static inline __attribute__((always_inline)) void prefetch_blocks_l2(const uint16_t *k,
                                                                     const uint16_t *v,
                                                                     const int32_t *tab,
                                                                     int64_t n,
                                                                     int64_t block_elems) {
    for (int64_t j = 0; j < n; j++) {
        if (k) prefetch_block_l2(k + tab[j] * block_elems, block_elems * 2);
        prefetch_block_l2(v + tab[j] * block_elems, block_elems * 2);
    }
}

/* Blocks read ahead of the one in use. The blocks of a sequence are scattered over the
 * pool, so the hardware's stream prefetchers do not find them; at 64 sequences x 350
 * tokens (SmolLM2's heads, 30 layers' pools, so from DRAM) decode attention read
 * 13.5 GB/s with none, 20.5 with the next block, 22.5 with three (four: the same). */
#define PREFETCH_BLOCKS 3

/* at block j of the pool's nblocks: the one PREFETCH_BLOCKS on (at j = 0 those between
 * too). pool: elem_bytes per value (2: bf16, 1: an 8-bit pool, whose scales come along;
 * NULL for bf16) */
static inline __attribute__((always_inline)) void prefetch_ahead(const item_t *it,
                                                                 const void *pool,
                                                                 int64_t elem_bytes,
                                                                 const float *scales,
                                                                 int64_t j, int64_t nblocks) {
    const int64_t block_bytes = it->BS * it->D * elem_bytes;
    for (int64_t a = j == 0 ? 1 : PREFETCH_BLOCKS; a <= PREFETCH_BLOCKS; a++)
        if (j + a < nblocks) {
            const int64_t blk = it->tab[j + a];
            prefetch_block((const char *)pool + blk * block_bytes, block_bytes);
            if (scales) prefetch_block(scales + blk * it->BS, it->BS * 4);
        }
}

/* rows i0 .. i0 + nrows of the block PREFETCH_BLOCKS on from block j of a bf16 pool: the
 * AVX2 loops' prefetch, a few rows of that block as each few of block j are read. The
 * whole block at once as block j starts (prefetch_ahead) read 1.05-1.16x slower from
 * DRAM here (a 2-core Zen 3: 16 rows x 200 tokens, 64 and 120 x 350, alternated) */
static inline __attribute__((always_inline)) void prefetch_rows_ahead(const item_t *it,
                                                                      const uint16_t *pool,
                                                                      int64_t j, int64_t nblocks,
                                                                      int64_t i0, int64_t nrows) {
    if (j + PREFETCH_BLOCKS >= nblocks) return;
    if (nrows > it->BS - i0) nrows = it->BS - i0;
    prefetch_block(pool + ((int64_t)it->tab[j + PREFETCH_BLOCKS] * it->BS + i0) * it->D,
                   nrows * it->D * 2);
}

/* a row of bytes widened to fp32 (not yet scaled) */
static inline void widen(const uint8_t *src, const float *lut, float *row, int64_t D) {
    if (lut) {
        for (int64_t d = 0; d < D; d++) row[d] = lut[src[d]];
    } else {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) row[d] = (float)(int8_t)src[d];
    }
}

#if TM_VEC_MATH8
static void scores_q8_avx2(const item_t *it, const uint16_t *qb, float *s, float *mx);
static void weighted_v_q8_avx2(const item_t *it, const float *s, float *acc);
#define Q8_AVX2_MAX_BS 256 /* weighted_v_q8_avx2's block of scaled probabilities */
#endif

/* scores of 8-bit K: s = scale * k_scale_t * (q . k8_t) */
static void scores_q8(const item_t *it, const uint16_t *qb, float *s, float *mx) {
#if TM_VEC_MATH8
    if (it->D % 8 == 0) {
        scores_q8_avx2(it, qb, s, mx);
        return;
    }
#endif
    const int64_t D = it->D, G = it->G, BS = it->BS;
    float qf[MAX_GROUP_DIM] __attribute__((aligned(64)));
    float row[MAX_D] __attribute__((aligned(64)));
    for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_f32(qb[i]);
    for (int64_t g = 0; g < G; g++) mx[g] = -3.0e38f;
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const float *sc;
        const uint8_t *blk = block_rows8(it, it->k8, it->ks, j, &n, &sc);
        prefetch_ahead(it, it->k8, 1, it->ks, j, nblocks);
        for (int64_t i = 0; i < n; i++) {
            widen(blk + i * D, it->lut, row, D);
            const float f = it->scale * sc[i];
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * row[d];
                dot *= f;
                s[g * it->s_stride + t0 + i] = dot;
                if (dot > mx[g]) mx[g] = dot;
            }
        }
    }
}


/* acc[g * D + d] = sum_t (p[g, t] v_scale_t) v8_t[d] */
static void weighted_v_q8(const item_t *it, const float *s, float *acc) {
#if TM_VEC_MATH8
    if (it->D % 16 == 0 && it->BS <= Q8_AVX2_MAX_BS) {
        weighted_v_q8_avx2(it, s, acc);
        return;
    }
#endif
    const int64_t D = it->D, G = it->G, BS = it->BS;
    float row[MAX_D] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const float *sc;
        const uint8_t *blk = block_rows8(it, it->v8, it->vs, j, &n, &sc);
        prefetch_ahead(it, it->v8, 1, it->vs, j, nblocks);
        for (int64_t i = 0; i < n; i++) {
            widen(blk + i * D, it->lut, row, D);
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g * it->s_stride + t0 + i] * sc[i];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ag[d] += p * row[d];
            }
        }
    }
}

#if TM_VEC_MATH8
/* AVX2 (no AVX512-BF16) versions of the two generic work-item loops below, for D % 32
 * == 0. A 256-bit load of 16 bf16 holds them as 8 pairs: shifted left by 16 bits its
 * 32-bit lanes are the pairs' first values as fp32, masked to their high halves the
 * second ones: two instructions widen 16 values, read straight from the pool (no fp32
 * copy of the rows). q . k runs 4 tokens x up to 3 query heads at a time (12
 * accumulators, q's pairs split the same way and read from L1), one horizontal sum per
 * 4 dots; the weighted sum of V keeps up to 3 heads x 16 dims of accumulators in
 * registers, split into first and second values of the pairs and put back in order at
 * the end (each output the same fp32 operations in the same order as a plain loop). */

static inline __m256 bf16_firsts(__m256i w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline __m256 bf16_seconds(__m256i w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

/* the 4 lane sums of a[0..4), in a[i]'s order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
 * (l3 + l7)) */
static inline __m128 hsum4x8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s = _mm256_hadd_ps(s01, s23);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* T (1..4) dots into sg, and the running maximum *vmax over them (lanes past T left out;
 * a NaN dot leaves the maximum as it was: maxps returns its second operand, as the
 * scalar comparison did) */
static inline __attribute__((always_inline)) void store_dots(float *sg, __m128 dots,
                                                             int64_t T, __m128 *vmax) {
    if (T == 4) {
        _mm_storeu_ps(sg, dots);
    } else {
        float d4[4];
        _mm_storeu_ps(d4, dots);
        for (int64_t i = 0; i < T; i++) sg[i] = d4[i];
        const __m128 valid = _mm_castsi128_ps(
            _mm_cmpgt_epi32(_mm_set1_epi32((int)T), _mm_setr_epi32(0, 1, 2, 3)));
        dots = _mm_blendv_ps(_mm_set1_ps(-3.0e38f), dots, valid);
    }
    *vmax = _mm_max_ps(dots, *vmax);
}

/* mx[g]: the largest of vmax[g]'s 4 lanes */
static inline void lane_maxima(const __m128 *vmax, int64_t G, float *mx) {
    for (int64_t g = 0; g < G; g++) {
        __m128 m = _mm_max_ps(vmax[g], _mm_movehl_ps(vmax[g], vmax[g]));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        mx[g] = _mm_cvtss_f32(m);
    }
}

/* q (G, D) bf16 as fp32 pairs split: qp[((g * C + c) * 2 + half) * 8 + j] = q[g][16 c + 2 j
 * + half], C = D / 16 */
static inline void split_pairs(const uint16_t *qb, int64_t G, int64_t D, float *qp) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / 16; c++)
            for (int64_t j = 0; j < 16; j++)
                qp[(g * (D / 16) + c) * 16 + (j & 1) * 8 + j / 2] =
                    bf16_to_f32(qb[g * D + 16 * c + j]);
}

/* scores of heads h0 .. h0 + GH (GH <= 3) over the item's tokens; C = D / 16 (known at
 * compile time once inlined); vmax: each head's running maximum, 4 lanes */
static inline __attribute__((always_inline)) void scores_pairs8(const item_t *it,
                                                                const float *qp, float *s,
                                                                __m128 *vmax, int64_t h0,
                                                                const int GH, const int64_t C) {
    static const uint16_t zero_row[MAX_D] __attribute__((aligned(64)));
    const int64_t BS = it->BS, D = it->D, nblocks = (it->len + BS - 1) / BS;
    const __m128 scale = _mm_set1_ps(it->scale);
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const uint16_t *blk = block_rows(it, it->k, j, &n);
        if (h0 == 0 && j == 0) prefetch_ahead(it, it->k, 2, NULL, j, nblocks);
        for (int64_t i0 = 0; i0 < n; i0 += 4) {
            const int64_t T = n - i0 < 4 ? n - i0 : 4;
            if (h0 == 0) prefetch_rows_ahead(it, it->k, j, nblocks, i0, 4);
            const uint16_t *r[4];
            for (int i = 0; i < 4; i++) r[i] = i < T ? blk + (i0 + i) * D : zero_row;
            __m256 a[4][3];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 3
                for (int h = 0; h < GH; h++) a[i][h] = _mm256_setzero_ps();
            for (int64_t c = 0; c < C; c++)
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(r[i] + 16 * c));
                    const __m256 f = bf16_firsts(w), sec = bf16_seconds(w);
#pragma GCC unroll 3
                    for (int h = 0; h < GH; h++) {
                        const float *q = qp + ((h0 + h) * C + c) * 16;
                        a[i][h] = _mm256_fmadd_ps(_mm256_load_ps(q), f, a[i][h]);
                        a[i][h] = _mm256_fmadd_ps(_mm256_load_ps(q + 8), sec, a[i][h]);
                    }
                }
            for (int h = 0; h < GH; h++) {
                const __m256 col[4] = {a[0][h], a[1][h], a[2][h], a[3][h]};
                store_dots(s + (h0 + h) * it->s_stride + t0 + i0,
                           _mm_mul_ps(hsum4x8(col), scale), T, vmax + h0 + h);
            }
        }
    }
}

static inline __attribute__((always_inline)) void scores_avx2_c(const item_t *it,
                                                                const uint16_t *qb, float *s,
                                                                float *mx, const int64_t G,
                                                                const int64_t C) {
    float qp[MAX_GROUP_DIM] __attribute__((aligned(64)));
    __m128 vmax[MAX_GROUP];
    split_pairs(qb, G, 16 * C, qp);
    for (int64_t g = 0; g < G; g++) vmax[g] = _mm_set1_ps(-3.0e38f);
    for (int64_t h0 = 0; h0 < G; h0 += 3) {
        const int64_t GH = G - h0 < 3 ? G - h0 : 3;
        if (GH == 3) scores_pairs8(it, qp, s, vmax, h0, 3, C);
        else if (GH == 2) scores_pairs8(it, qp, s, vmax, h0, 2, C);
        else scores_pairs8(it, qp, s, vmax, h0, 1, C);
    }
    lane_maxima(vmax, G, mx);
}

static void scores_avx2(const item_t *it, const uint16_t *qb, float *s, float *mx) {
    /* compile-time shapes for SmolLM2's head_dim (kv groups of 3, split between threads
     * in the fused step) */
    if (it->D == 64 && it->G == 3) scores_avx2_c(it, qb, s, mx, 3, 4);
    else if (it->D == 64 && it->G == 2) scores_avx2_c(it, qb, s, mx, 2, 4);
    else if (it->D == 64 && it->G == 1) scores_avx2_c(it, qb, s, mx, 1, 4);
    else if (it->D == 128) scores_avx2_c(it, qb, s, mx, it->G, 8);
    else scores_avx2_c(it, qb, s, mx, it->G, it->D / 16);
}

/* heads g0 .. g0 + GH (GH <= 3), dims d0 .. d0 + 16 of acc: 6 accumulators, the row's
 * 16 values, 3 probabilities (3 x 32 dims kept 12 accumulators and the rest, which
 * spilled two of them: a chain through memory a token) */
static inline __attribute__((always_inline)) void weighted_v_tile(const item_t *it,
                                                                 const float *s, float *acc,
                                                                 int64_t g0, int64_t d0,
                                                                 const int GH) {
    const int64_t D = it->D, BS = it->BS, nblocks = (it->len + BS - 1) / BS;
    __m256 a[3][2]; /* [h]: the firsts of dims d0's pairs, the seconds */
    for (int h = 0; h < GH; h++) a[h][0] = a[h][1] = _mm256_setzero_ps();
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const uint16_t *blk = block_rows(it, it->v, j, &n) + d0;
        if (g0 == 0 && d0 == 0 && j == 0) prefetch_ahead(it, it->v, 2, NULL, j, nblocks);
        const float *sh[3]; /* the block's probabilities of each head */
        for (int h = 0; h < GH; h++) sh[h] = s + (g0 + h) * it->s_stride + t0;
        for (int64_t i = 0; i < n; i++) {
            if (g0 == 0 && d0 == 0) prefetch_rows_ahead(it, it->v, j, nblocks, i, 1);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + i * D));
            const __m256 f = bf16_firsts(w), sec = bf16_seconds(w);
            for (int h = 0; h < GH; h++) {
                const __m256 p = _mm256_broadcast_ss(sh[h] + i);
                a[h][0] = _mm256_fmadd_ps(p, f, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(p, sec, a[h][1]);
            }
        }
    }
    for (int h = 0; h < GH; h++) { /* the pairs back in order */
        const __m256 lo = _mm256_unpacklo_ps(a[h][0], a[h][1]);
        const __m256 hi = _mm256_unpackhi_ps(a[h][0], a[h][1]);
        float *o = acc + (g0 + h) * D + d0;
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

static void weighted_v_avx2(const item_t *it, const float *s, float *acc) {
    for (int64_t g0 = 0; g0 < it->G; g0 += 3)
        for (int64_t d0 = 0; d0 < it->D; d0 += 16) {
            const int64_t GH = it->G - g0 < 3 ? it->G - g0 : 3;
            if (GH == 3) weighted_v_tile(it, s, acc, g0, d0, 3);
            else if (GH == 2) weighted_v_tile(it, s, acc, g0, d0, 2);
            else weighted_v_tile(it, s, acc, g0, d0, 1);
        }
}
/* 8-bit pools on AVX2 (scores_q8 and weighted_v_q8's loops in registers): 8 bytes of a
 * row widened to fp32 by one conversion (int8) or a few bit operations (fp8), the row's
 * scale applied to the 4 dots at once (scores) or folded into the probabilities a block
 * at a time (values), as the plain loops do: at 64 rows x 350 tokens the plain loops (a
 * row widened into memory, a horizontal sum a dot) made an 8-bit cache slower to read
 * than the bf16 one it halves. */

/* fmt: FMT_INT8 converted; an fp8 code's exponent and mantissa bits moved into an fp32's
 * low exponent and high mantissa bits, the sign to bit 31, and the result scaled by
 * 2^(127 - the format's bias): exact for every finite code, subnormals included (the
 * table's values; the NaN / inf codes, which the store never writes, read as finite) */
static inline __attribute__((always_inline)) __m256 widen8(const uint8_t *src, const int fmt) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)src);
    if (fmt == FMT_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256i u = _mm256_cvtepu8_epi32(b);
    const int shift = fmt == FMT_E4M3 ? 20 : 21;
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F)), shift);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const __m256 f = _mm256_castsi256_ps(_mm256_or_si256(mag, sign));
    return _mm256_mul_ps(f, _mm256_set1_ps(fmt == FMT_E4M3 ? 0x1p120f : 0x1p112f));
}

/* heads h0 .. h0 + GH (GH <= 3) of qf (G, D) fp32 over the item's 8-bit K, 4 tokens at a
 * time (12 accumulators, one hsum per 4 dots); C = D / 8; fmt: the bytes' FMT_*
 * (compile-time, as GH and C: a branch in the loop kept the accumulators on the stack,
 * 1.15x slower) */
static inline __attribute__((always_inline)) void scores_q8_rows(const item_t *it,
                                                                 const float *qf, float *s,
                                                                 __m128 *vmax, int64_t h0,
                                                                 const int GH, const int64_t C,
                                                                 const int fmt) {
    static const uint8_t zero_row[MAX_D] __attribute__((aligned(64)));
    const int64_t BS = it->BS, D = it->D, nblocks = (it->len + BS - 1) / BS;
    const __m128 scale = _mm_set1_ps(it->scale);
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const float *sc;
        const uint8_t *blk = block_rows8(it, it->k8, it->ks, j, &n, &sc);
        if (h0 == 0) prefetch_ahead(it, it->k8, 1, it->ks, j, nblocks);
        for (int64_t i0 = 0; i0 < n; i0 += 4) {
            const int64_t T = n - i0 < 4 ? n - i0 : 4;
            const uint8_t *r[4];
            for (int i = 0; i < 4; i++) r[i] = i < T ? blk + (i0 + i) * D : zero_row;
            __m256 a[4][3];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
#pragma GCC unroll 3
                for (int h = 0; h < GH; h++) a[i][h] = _mm256_setzero_ps();
            for (int64_t c = 0; c < C; c++)
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m256 x = widen8(r[i] + 8 * c, fmt);
#pragma GCC unroll 3
                    for (int h = 0; h < GH; h++)
                        a[i][h] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (h0 + h) * D + 8 * c),
                                                  x, a[i][h]);
                }
            float f4[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* the rows' scales */
            for (int64_t i = 0; i < T; i++) f4[i] = sc[i0 + i];
            const __m128 f = _mm_mul_ps(scale, _mm_loadu_ps(f4));
            for (int h = 0; h < GH; h++) {
                const __m256 col[4] = {a[0][h], a[1][h], a[2][h], a[3][h]};
                store_dots(s + (h0 + h) * it->s_stride + t0 + i0,
                           _mm_mul_ps(hsum4x8(col), f), T, vmax + h0 + h);
            }
        }
    }
}

static inline __attribute__((always_inline)) void scores_q8_avx2_c(const item_t *it,
                                                                   const uint16_t *qb,
                                                                   float *s, float *mx,
                                                                   const int64_t G,
                                                                   const int64_t C,
                                                                   const int fmt) {
    float qf[MAX_GROUP_DIM] __attribute__((aligned(64)));
    __m128 vmax[MAX_GROUP];
    for (int64_t i = 0; i < G * it->D; i++) qf[i] = bf16_to_f32(qb[i]);
    for (int64_t g = 0; g < G; g++) vmax[g] = _mm_set1_ps(-3.0e38f);
    for (int64_t h0 = 0; h0 < G; h0 += 3) {
        const int64_t GH = G - h0 < 3 ? G - h0 : 3;
        if (GH == 3) scores_q8_rows(it, qf, s, vmax, h0, 3, C, fmt);
        else if (GH == 2) scores_q8_rows(it, qf, s, vmax, h0, 2, C, fmt);
        else scores_q8_rows(it, qf, s, vmax, h0, 1, C, fmt);
    }
    lane_maxima(vmax, G, mx);
}

static void scores_q8_avx2(const item_t *it, const uint16_t *qb, float *s, float *mx) {
    if (it->lut) { /* fp8 */
        if (it->lut == lut_e4m3) scores_q8_avx2_c(it, qb, s, mx, it->G, it->D / 8, FMT_E4M3);
        else scores_q8_avx2_c(it, qb, s, mx, it->G, it->D / 8, FMT_E5M2);
        return;
    } /* int8: compile-time shapes for SmolLM2's kv groups of 3 split between threads */
    if (it->D == 64 && it->G == 3) scores_q8_avx2_c(it, qb, s, mx, 3, 8, FMT_INT8);
    else if (it->D == 64 && it->G == 2) scores_q8_avx2_c(it, qb, s, mx, 2, 8, FMT_INT8);
    else if (it->D == 64 && it->G == 1) scores_q8_avx2_c(it, qb, s, mx, 1, 8, FMT_INT8);
    else scores_q8_avx2_c(it, qb, s, mx, it->G, it->D / 8, FMT_INT8);
}

/* acc[g * D + d] = sum_t (p[g, t] v_scale_t) v8_t[d]: a block at a time, its rows read
 * from memory once (then from L1) for every 16 dims of up to 3 heads; each output the
 * plain loop's operations in its order (p v_scale rounded, then one FMA a token) */
static inline __attribute__((always_inline)) void weighted_v_q8_heads(const item_t *it,
                                                                      const float *s,
                                                                      float *acc, int64_t g0,
                                                                      const int GH,
                                                                      const int fmt) {
    const int64_t D = it->D, BS = it->BS, nblocks = (it->len + BS - 1) / BS;
    float ps[3][Q8_AVX2_MAX_BS] __attribute__((aligned(64)));
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const float *sc;
        const uint8_t *blk = block_rows8(it, it->v8, it->vs, j, &n, &sc);
        if (g0 == 0) prefetch_ahead(it, it->v8, 1, it->vs, j, nblocks);
        for (int h = 0; h < GH; h++)
            for (int64_t i = 0; i < n; i++) ps[h][i] = s[(g0 + h) * it->s_stride + t0 + i] * sc[i];
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m256 a[3][2];
            for (int h = 0; h < GH; h++) {
                a[h][0] = _mm256_loadu_ps(acc + (g0 + h) * D + d0);
                a[h][1] = _mm256_loadu_ps(acc + (g0 + h) * D + d0 + 8);
            }
            for (int64_t i = 0; i < n; i++) {
                const __m256 x0 = widen8(blk + i * D + d0, fmt);
                const __m256 x1 = widen8(blk + i * D + d0 + 8, fmt);
                for (int h = 0; h < GH; h++) {
                    const __m256 p = _mm256_broadcast_ss(ps[h] + i);
                    a[h][0] = _mm256_fmadd_ps(p, x0, a[h][0]);
                    a[h][1] = _mm256_fmadd_ps(p, x1, a[h][1]);
                }
            }
            for (int h = 0; h < GH; h++) {
                _mm256_storeu_ps(acc + (g0 + h) * D + d0, a[h][0]);
                _mm256_storeu_ps(acc + (g0 + h) * D + d0 + 8, a[h][1]);
            }
        }
    }
}

static void weighted_v_q8_avx2(const item_t *it, const float *s, float *acc) {
    memset(acc, 0, (size_t)(it->G * it->D) * sizeof(float));
    for (int64_t g0 = 0; g0 < it->G; g0 += 3) {
        const int64_t GH = it->G - g0 < 3 ? it->G - g0 : 3;
        const int fmt = !it->lut ? FMT_INT8 : it->lut == lut_e4m3 ? FMT_E4M3 : FMT_E5M2;
#define TM_V_Q8(F)                                                    \
    if (GH == 3) weighted_v_q8_heads(it, s, acc, g0, 3, F);          \
    else if (GH == 2) weighted_v_q8_heads(it, s, acc, g0, 2, F);     \
    else weighted_v_q8_heads(it, s, acc, g0, 1, F);
        if (fmt == FMT_INT8) {
            TM_V_Q8(FMT_INT8)
        } else if (fmt == FMT_E4M3) {
            TM_V_Q8(FMT_E4M3)
        } else {
            TM_V_Q8(FMT_E5M2)
        }
#undef TM_V_Q8
    }
}
#endif

/* scores s[g * s_stride + t] = scale * q_g . k_t, and each row's maximum */
static void scores_generic(const item_t *it, const uint16_t *qb, float *s, float *mx) {
#if TM_VEC_MATH8
    if (it->D % 32 == 0) {
        scores_avx2(it, qb, s, mx);
        return;
    }
#endif
    const int64_t D = it->D, G = it->G, BS = it->BS;
    float qf[MAX_GROUP_DIM] __attribute__((aligned(64)));
    float row[MAX_D] __attribute__((aligned(64)));
    for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_f32(qb[i]);
    for (int64_t g = 0; g < G; g++) mx[g] = -3.0e38f;
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const uint16_t *blk = block_rows(it, it->k, j, &n);
        prefetch_ahead(it, it->k, 2, NULL, j, nblocks);
        for (int64_t i = 0; i < n; i++) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f32(blk[i * D + d]);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qg[d] * row[d];
                dot *= it->scale;
                s[g * it->s_stride + t0 + i] = dot;
                if (dot > mx[g]) mx[g] = dot;
            }
        }
    }
}

/* acc[g * D + d] = sum_t p[g, t] v_t[d], p rounded to bf16 as torch's bf16 matmul sees it */
static void weighted_v_generic(const item_t *it, const float *s, float *acc) {
#if TM_VEC_MATH8
    if (it->D % 32 == 0) {
        weighted_v_avx2(it, s, acc);
        return;
    }
#endif
    const int64_t D = it->D, G = it->G, BS = it->BS;
    float row[MAX_D] __attribute__((aligned(64)));
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const uint16_t *blk = block_rows(it, it->v, j, &n);
        prefetch_ahead(it, it->v, 2, NULL, j, nblocks);
        for (int64_t i = 0; i < n; i++) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f32(blk[i * D + d]);
            for (int64_t g = 0; g < G; g++) {
                const float p = s[g * it->s_stride + t0 + i];
                float *ag = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ag[d] += p * row[d];
            }
        }
    }
}

#ifdef TM_AVX512BF16
/* lane j = sum of the 16 lanes of a[j]: a 16 x 16 transpose folded into adds */
static inline __m512 hsum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++) /* 128-bit lanes [x0+x2, x1+x3, y0+y2, y1+y3] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* lane L: 4 partial sums of vector 4i + L */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
    /* r holds the sum of vector 4m + L at position 4L + m */
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, r);
}

/* a[i] = sum over the C chunks of q . row i of the tile (rows D apart), for i < nt; 0
 * after */
static inline __attribute__((always_inline)) void tile_sums(__m512 *a, const __m512bh *q,
                                                            const uint16_t *rows, int64_t D,
                                                            const int64_t C, const int64_t nt) {
#pragma GCC unroll 16
    for (int64_t i = 0; i < 16; i++) {
        a[i] = _mm512_setzero_ps();
        if (i < nt)
            for (int64_t c = 0; c < C; c++)
                a[i] = _mm512_dpbf16_ps(
                    a[i], q[c], (__m512bh)_mm512_loadu_si512((const void *)(rows + i * D + 32 * c)));
    }
}

/* scores 16 tokens at a time, G and C (= D / 32) known at compile time once inlined */
static inline __attribute__((always_inline)) void scores_tiled(const item_t *it,
                                                               const uint16_t *qb, float *s,
                                                               float *mx, const int64_t G,
                                                               const int64_t C) {
    const int64_t BS = it->BS, D = it->D;
    __m512bh qv[MAX_GROUP_DIM / 32]; /* registers for the small shapes, else spilled */
    for (int64_t i = 0; i < G * C; i++)
        qv[i] = (__m512bh)_mm512_loadu_si512((const void *)(qb + 32 * i));
    __m512 vmax[MAX_GROUP];
    for (int64_t g = 0; g < G; g++) vmax[g] = _mm512_set1_ps(-3.0e38f);
    const __m512 scale = _mm512_set1_ps(it->scale);
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t j = 0, t0 = 0, n; j < nblocks; j++, t0 += BS) {
        const uint16_t *blk = block_rows(it, it->k, j, &n);
        prefetch_ahead(it, it->k, 2, NULL, j, nblocks);
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t nt = n - i0 < 16 ? n - i0 : 16;
            const __mmask16 keep = nt == 16 ? 0xFFFF : (__mmask16)((1u << nt) - 1);
            for (int64_t g = 0; g < G; g++) {
                __m512 a[16];
                /* a whole tile with the constant 16: the test folds away, so gcc unrolls
                 * the loop and a[] stays in registers (with nt it kept a[] on the stack:
                 * each token's sums went through a store and a load, ~3x the time) */
                if (nt == 16) tile_sums(a, qv + g * C, blk + i0 * D, D, C, 16);
                else tile_sums(a, qv + g * C, blk + i0 * D, D, C, nt);
                const __m512 sc = _mm512_mul_ps(hsum16(a), scale);
                _mm512_mask_storeu_ps(s + g * it->s_stride + t0 + i0, keep, sc);
                vmax[g] = _mm512_mask_max_ps(vmax[g], keep, vmax[g], sc);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) mx[g] = _mm512_reduce_max_ps(vmax[g]);
}

/* acc = sum_t p_t v_t with bf16 p (already rounded in s) and bf16 V, two tokens per
 * vdpbf16ps: rows t and t+1 interleaved by unpacklo/hi_epi16, which order the output
 * lanes as d = 32c + 8L + k (lo) and 32c + 8L + 4 + k (hi) in 128-bit lane L.
 * The head dimension runs in passes of W chunks of 32, W such that the G * W lo and hi
 * accumulators stay in registers (2 * 8 of the 32 zmm): with G * C of them at once,
 * Gemma 3's G = 4, D = 256 kept 64 on the stack and every vdpbf16ps went through a store
 * and a load (~half the decode attention's time). A pass reads only its W chunks of each
 * row (the rows of one item stay in L2 between passes) and each accumulator still sums
 * its tokens in order: the same bits as one pass. */
static inline __attribute__((always_inline)) void weighted_v_pairs(const item_t *it,
                                                                   const float *s, float *acc,
                                                                   const int64_t G,
                                                                   const int64_t C) {
    const int64_t BS = it->BS, D = it->D;
    const int64_t W = G * C <= 8 ? C : (G < 8 ? 8 / G : 1); /* chunks of 32 a pass */
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t c0 = 0; c0 < C; c0 += W) {
        const int64_t cw = C - c0 < W ? C - c0 : W;
        __m512 lo[MAX_GROUP_DIM / 32], hi[MAX_GROUP_DIM / 32]; /* [g * W + c] */
        for (int64_t i = 0; i < G * W; i++) lo[i] = hi[i] = _mm512_setzero_ps();
        for (int64_t j = 0, t0 = 0, n; j < nblocks; j++, t0 += BS) {
            const uint16_t *blk = block_rows(it, it->v, j, &n) + 32 * c0;
            if (c0 == 0) prefetch_ahead(it, it->v, 2, NULL, j, nblocks);
            for (int64_t i = 0; i < n; i += 2) {
                const int pair = i + 1 < n; /* a lone last token pairs with itself at p = 0 */
                const uint16_t *r0 = blk + i * D, *r1 = pair ? r0 + D : r0;
                __m512bh pp[MAX_GROUP];
                for (int64_t g = 0; g < G; g++) {
                    union { float f; uint32_t u; } a, b;
                    a.f = s[g * it->s_stride + t0 + i];
                    b.f = pair ? s[g * it->s_stride + t0 + i + 1] : 0.0f;
                    pp[g] = (__m512bh)_mm512_set1_epi32((int)((a.u >> 16) | (b.u & 0xFFFF0000u)));
                }
                for (int64_t c = 0; c < cw; c++) {
                    const __m512i x0 = _mm512_loadu_si512((const void *)(r0 + 32 * c));
                    const __m512i x1 = _mm512_loadu_si512((const void *)(r1 + 32 * c));
                    const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                    const __m512bh h = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                    for (int64_t g = 0; g < G; g++) {
                        lo[g * W + c] = _mm512_dpbf16_ps(lo[g * W + c], l, pp[g]);
                        hi[g * W + c] = _mm512_dpbf16_ps(hi[g * W + c], h, pp[g]);
                    }
                }
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < cw; c++) {
                float l[16], h[16];
                _mm512_storeu_ps(l, lo[g * W + c]);
                _mm512_storeu_ps(h, hi[g * W + c]);
                float *out = acc + g * D + 32 * (c0 + c);
                for (int L = 0; L < 4; L++)
                    for (int k = 0; k < 4; k++) {
                        out[8 * L + k] = l[4 * L + k];
                        out[8 * L + 4 + k] = h[4 * L + k];
                    }
            }
    }
}

/* 16 bytes of a row -> 16 floats (unscaled): int8 converted, fp8 through the table */
static inline __m512 widen16(const uint8_t *src, const float *lut) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    if (lut) return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), lut, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* scores_q8 16 tokens at a time: each row widened once into registers for all G heads,
 * the 16 dot products of a head folded by one hsum16, then scaled by scale * k_scale_t */
static inline __attribute__((always_inline)) void scores_q8_tiled(const item_t *it,
                                                                  const uint16_t *qb, float *s,
                                                                  float *mx, const int64_t G,
                                                                  const int64_t C) {
    const int64_t BS = it->BS, D = it->D; /* C = D / 16 */
    __m512 qv[8 * (MAX_D / 16)];
    for (int64_t i = 0; i < G * C; i++) /* bf16 -> fp32: the high half of each lane */
        qv[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(qb + 16 * i))), 16));
    __m512 vmax[8];
    for (int64_t g = 0; g < G; g++) vmax[g] = _mm512_set1_ps(-3.0e38f);
    const __m512 scale = _mm512_set1_ps(it->scale);
    const int64_t nblocks = (it->len + BS - 1) / BS;
    for (int64_t j = 0, t0 = 0, n; t0 < it->len; j++, t0 += BS) {
        const float *sc;
        const uint8_t *blk = block_rows8(it, it->k8, it->ks, j, &n, &sc);
        prefetch_ahead(it, it->k8, 1, it->ks, j, nblocks);
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t nt = n - i0 < 16 ? n - i0 : 16;
            const __mmask16 keep = nt == 16 ? 0xFFFF : (__mmask16)((1u << nt) - 1);
            __m512 a[8][16];
            for (int64_t i = 0; i < 16; i++) {
                for (int64_t g = 0; g < G; g++) a[g][i] = _mm512_setzero_ps();
                if (i >= nt) continue;
                for (int64_t c = 0; c < C; c++) {
                    const __m512 x = widen16(blk + (i0 + i) * D + 16 * c, it->lut);
                    for (int64_t g = 0; g < G; g++)
                        a[g][i] = _mm512_fmadd_ps(qv[g * C + c], x, a[g][i]);
                }
            }
            const __m512 f = _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(keep, sc + i0));
            for (int64_t g = 0; g < G; g++) {
                const __m512 v = _mm512_mul_ps(hsum16(a[g]), f);
                _mm512_mask_storeu_ps(s + g * it->s_stride + t0 + i0, keep, v);
                vmax[g] = _mm512_mask_max_ps(vmax[g], keep, vmax[g], v);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) mx[g] = _mm512_reduce_max_ps(vmax[g]);
}
#endif

/* Write this step's K and V rows into their slots: k, v (T, KVH, D) bf16 whose token
 * rows are k_stride / v_stride elements apart (views of the fused QKV output).
 * Returns -1, writing nothing, if a slot is outside the pool. */
int tm_store_kv_bf16(const uint16_t *k, const uint16_t *v, int64_t k_stride, int64_t v_stride,
                     uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t T,
                     int64_t KVH, int64_t NB, int64_t BS, int64_t D) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= NB * BS) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t blk = slots[t] / BS, off = slots[t] % BS;
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t dst = ((h * NB + blk) * BS + off) * D;
            memcpy(k_cache + dst, k + t * k_stride + h * D, (size_t)D * 2);
            memcpy(v_cache + dst, v + t * v_stride + h * D, (size_t)D * 2);
        }
    }
    return 0;
}

#ifdef __AVX2__
static inline __m256 widen_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* one K or V row src (D bf16) quantized into dst (D bytes) and its scale: scale = absmax /
 * FMT_MAX, byte = round(x / scale) (int8: clamped to +-127, then half to even; fp8: the
 * nearest code, ties to even). fmt: FMT_*, checked by the caller; D <= MAX_D; the fp8
 * tables filled (init_luts). int8 rows of 8k values in AVX2 registers: the same
 * operations (a division, the clamps, round to nearest even), so the same bytes. */
static void store_row_q8(const uint16_t *src, uint8_t *dst, float *scale, int64_t D,
                         int64_t fmt) {
    const float qmax = FMT_MAX[fmt];
#ifdef __AVX2__
    if (fmt == FMT_INT8 && D % 8 == 0) {
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) /* a NaN lane keeps the maximum, as fmaxf */
            vmax = _mm256_max_ps(_mm256_and_ps(widen_bf16x8(src + d), absmask), vmax);
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        const float sc = _mm_cvtss_f32(m) / qmax;
        *scale = sc;
        if (!(sc > 0.0f)) {
            memset(dst, 0, (size_t)D);
            return;
        }
        const __m256 vs = _mm256_set1_ps(sc), hi = _mm256_set1_ps(qmax),
                     lo = _mm256_set1_ps(-qmax);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 y = _mm256_div_ps(widen_bf16x8(src + d), vs);
            y = _mm256_min_ps(_mm256_max_ps(y, lo), hi); /* NaN -> -qmax, as fminf/fmaxf */
            const __m256i n = _mm256_cvtps_epi32(
                _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(n),
                                              _mm256_extracti128_si256(n, 1));
            _mm_storel_epi64((__m128i *)(dst + d), _mm_packs_epi16(w, w));
        }
        return;
    }
#endif
    const float *lut = fmt == FMT_E4M3 ? lut_e4m3 : lut_e5m2;
    const int top = fmt == FMT_E4M3 ? 0x7E : 0x7B; /* the largest finite code */
    float x[MAX_D], amax = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        x[d] = bf16_to_f32(src[d]);
        amax = fmaxf(amax, fabsf(x[d]));
    }
    const float sc = amax / qmax;
    *scale = sc;
    for (int64_t d = 0; d < D; d++) {
        float y = sc > 0.0f ? x[d] / sc : 0.0f;
        y = fminf(fmaxf(y, -qmax), qmax);
        dst[d] = fmt == FMT_INT8 ? (uint8_t)(int8_t)nearbyintf(y) : fp8_encode(y, lut, top);
    }
}

/* Quantize and write this step's K and V rows: k, v (T, KVH, D) bf16 as in
 * tm_store_kv_bf16, into 8-bit pools (KVH, NB, BS, D) and their scales (KVH, NB, BS)
 * (store_row_q8), a prompt's rows split between num_threads threads. fmt: FMT_*.
 * Returns -1, writing nothing, if a slot is outside the pool or fmt unknown. */
int tm_store_kv_q8(const uint16_t *k, const uint16_t *v, int64_t k_stride, int64_t v_stride,
                   uint8_t *k_cache, uint8_t *v_cache, float *k_scale, float *v_scale,
                   const int64_t *slots, int64_t T, int64_t KVH, int64_t NB, int64_t BS,
                   int64_t D, int64_t fmt, int64_t num_threads) {
    if (fmt < FMT_INT8 || fmt > FMT_E5M2 || D > MAX_D || num_threads < 1) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= NB * BS) return -1;
    init_luts();
    /* a decode step's few rows: not worth a fork */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * KVH >= 64)
    for (int64_t item = 0; item < T * KVH; item++) {
        const int64_t t = item / KVH, h = item % KVH;
        const int64_t row = (h * NB + slots[t] / BS) * BS + slots[t] % BS;
        store_row_q8(k + t * k_stride + h * D, k_cache + row * D, k_scale + row, D, fmt);
        store_row_q8(v + t * v_stride + h * D, v_cache + row * D, v_scale + row, D, fmt);
    }
    return 0;
}

/* scores of an 8-bit item (attend_item's, and the fused decode step's) */
static void scores_q8_any(const item_t *it, const uint16_t *qb, float *s, float *mx) {
#ifdef TM_AVX512BF16
    const int64_t D = it->D, G = it->G;
    if (D % 16 == 0 && G == 3 && D == 64) scores_q8_tiled(it, qb, s, mx, 3, 4);
    else if (D % 16 == 0 && G <= 8) scores_q8_tiled(it, qb, s, mx, G, D / 16);
    else
#endif
        scores_q8(it, qb, s, mx);
}

/* One work item: the G query heads qb (G, D) bf16 of a kv head against its it->len
 * tokens. s: G rows of it->s_stride fp32 scores (left holding the bf16-rounded softmax
 * numerators). Out: acc (G, D) = sum_t exp(s_t - mx) v_t, the row maxima mx and the
 * denominators sum (G). */
static void attend_item(const item_t *it, const uint16_t *qb, float *s, float *acc, float *mx,
                        float *sum) {
    const int quantized = it->k8 != NULL;
    const int64_t G = it->G;
#ifdef TM_AVX512BF16
    const int64_t D = it->D;
    const int vector_path = D % 32 == 0;
#endif
    if (quantized) scores_q8_any(it, qb, s, mx);
    else
#ifdef TM_AVX512BF16
    if (vector_path && G == 3 && D == 64) scores_tiled(it, qb, s, mx, 3, 2);
    else if (vector_path && G == 4 && D == 128) scores_tiled(it, qb, s, mx, 4, 4);
    else if (vector_path && G == 4 && D == 256) scores_tiled(it, qb, s, mx, 4, 8); /* Gemma 3 */
    else if (vector_path && G == 2 && D == 256) scores_tiled(it, qb, s, mx, 2, 8);
    else if (vector_path && G == 1 && D == 64) scores_tiled(it, qb, s, mx, 1, 2);
    else if (vector_path) scores_tiled(it, qb, s, mx, G, D / 32);
    else
#endif
        scores_generic(it, qb, s, mx);
    for (int64_t g = 0; g < G; g++) { /* softmax numerators in place, rounded to bf16 */
        float *sg = s + g * it->s_stride;
        const float m = mx[g];
#if TM_VEC_MATH || TM_VEC_MATH8
        sum[g] = softmax_numerators(sg, it->len, m);
#else
        float total = 0.0f;
        for (int64_t t = 0; t < it->len; t++) {
            const float e = expf(sg[t] - m);
            total += e;
            sg[t] = bf16_to_f32(f32_to_bf16(e));
        }
        sum[g] = total;
#endif
    }
    if (quantized) weighted_v_q8(it, s, acc);
    else
#ifdef TM_AVX512BF16
    if (vector_path && G == 3 && D == 64) weighted_v_pairs(it, s, acc, 3, 2);
    else if (vector_path && G == 4 && D == 128) weighted_v_pairs(it, s, acc, 4, 4);
    else if (vector_path && G == 4 && D == 256) weighted_v_pairs(it, s, acc, 4, 8);
    else if (vector_path && G == 2 && D == 256) weighted_v_pairs(it, s, acc, 2, 8);
    else if (vector_path && G == 1 && D == 64) weighted_v_pairs(it, s, acc, 1, 2);
    else if (vector_path) weighted_v_pairs(it, s, acc, G, D / 32);
    else
#endif
        weighted_v_generic(it, s, acc);
}

/* q: (B, H, D) bf16, rows q_stride elements apart. tables: (B, table_stride) int32;
 * sequence b attends to lens[b] tokens held in blocks tables[b][first_block:].
 * Output (B, H, D): with m_out and l_out NULL, normalised, into out_bf16 (rounded) if
 * given, else into out (fp32); otherwise out holds sum_t exp(s_t - m) v_t with its row
 * maximum m and denominator l (B, H), to be merged with other parts by the caller.
 * scratch: B * H * max_len fp32 scores. num_threads: torch's count (a torch wheel may
 * bundle its own libgomp). Returns 0, or -1 for shapes it does not take. */
static int paged_decode(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                        const uint16_t *v_cache, const uint8_t *k8, const uint8_t *v8,
                        const float *k_scale, const float *v_scale, const float *lut,
                        const int32_t *tables, int64_t table_stride, int64_t first_block,
                        const int32_t *lens, int64_t B, int64_t H, int64_t KVH, int64_t NB,
                        int64_t BS, int64_t D, float scale, float *out, uint16_t *out_bf16,
                        float *m_out, float *l_out, float *scratch, int64_t max_len,
                        int64_t num_threads) {
    const int quantized = k8 != NULL;
    if (KVH <= 0 || H % KVH != 0 || D > MAX_D || (H / KVH) * D > MAX_GROUP_DIM ||
        H / KVH > MAX_GROUP || num_threads < 1)
        return -1;
    const int64_t G = H / KVH;
    for (int64_t b = 0; b < B; b++)
        if (lens[b] < 1 || lens[b] > max_len) return -1;

    /* static: a thread's items are known ahead (item, item + num_threads, ...). As it
     * starts one it prefetches into L2 every K and V row of its item after next, at once
     * (on top of prefetch_ahead within an item): 1.15-1.2x the bandwidth from DRAM of
     * the dynamic schedule without, 18.7 -> 22.8 GB/s at 64 x 350 tokens (means of 5) */
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * KVH; item++) {
        const int64_t b = item / KVH, kh = item % KVH;
#ifdef TM_AVX512BF16
        if (!quantized && item + 2 * num_threads < B * KVH) {
            const int64_t nx = item + 2 * num_threads, nb_ = nx / KVH, nk = nx % KVH;
            prefetch_blocks_l2(k_cache + nk * NB * BS * D, v_cache + nk * NB * BS * D,
                               tables + nb_ * table_stride + first_block,
                               (lens[nb_] + BS - 1) / BS, BS * D);
        }
#endif
        item_t it = {quantized ? NULL : k_cache + kh * NB * BS * D,
                     quantized ? NULL : v_cache + kh * NB * BS * D,
                     tables + b * table_stride + first_block, lens[b], BS, D, G, max_len, scale,
                     quantized ? k8 + kh * NB * BS * D : NULL,
                     quantized ? v8 + kh * NB * BS * D : NULL,
                     quantized ? k_scale + kh * NB * BS : NULL,
                     quantized ? v_scale + kh * NB * BS : NULL, lut};
        const uint16_t *qb = q + b * q_stride + kh * G * D;
        float *s = scratch + (b * H + kh * G) * max_len; /* s[g * max_len + t] */
        float acc[MAX_GROUP_DIM] __attribute__((aligned(64)));
        float mx[MAX_GROUP], sum[MAX_GROUP];
        attend_item(&it, qb, s, acc, mx, sum);
        for (int64_t g = 0; g < G; g++) {
            float *o = out + (b * H + kh * G + g) * D;
            const float *ag = acc + g * D;
            if (m_out) {
                memcpy(o, ag, (size_t)D * sizeof(float));
                m_out[b * H + kh * G + g] = mx[g];
                l_out[b * H + kh * G + g] = sum[g];
            } else if (out_bf16) {
                uint16_t *ob = out_bf16 + (b * H + kh * G + g) * D;
                const float inv = 1.0f / sum[g];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ob[d] = f32_to_bf16(ag[d] * inv);
            } else {
                const float inv = 1.0f / sum[g];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] = ag[d] * inv;
            }
        }
    }
    return 0;
}

int tm_paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *tables, int64_t table_stride,
                         int64_t first_block, const int32_t *lens, int64_t B, int64_t H,
                         int64_t KVH, int64_t NB, int64_t BS, int64_t D, float scale,
                         float *out, uint16_t *out_bf16, float *m_out, float *l_out,
                         float *scratch, int64_t max_len, int64_t num_threads) {
    return paged_decode(q, q_stride, k_cache, v_cache, NULL, NULL, NULL, NULL, NULL, tables,
                        table_stride, first_block, lens, B, H, KVH, NB, BS, D, scale, out,
                        out_bf16, m_out, l_out, scratch, max_len, num_threads);
}

/* As tm_paged_decode_bf16 over 8-bit pools (KVH, NB, BS, D) with their scales
 * (KVH, NB, BS); fmt: FMT_INT8, FMT_E4M3 or FMT_E5M2. */
int tm_paged_decode_q8(const uint16_t *q, int64_t q_stride, const uint8_t *k_cache,
                       const uint8_t *v_cache, const float *k_scale, const float *v_scale,
                       int64_t fmt, const int32_t *tables, int64_t table_stride,
                       int64_t first_block, const int32_t *lens, int64_t B, int64_t H,
                       int64_t KVH, int64_t NB, int64_t BS, int64_t D, float scale, float *out,
                       uint16_t *out_bf16, float *m_out, float *l_out, float *scratch,
                       int64_t max_len, int64_t num_threads) {
    if (fmt < FMT_INT8 || fmt > FMT_E5M2) return -1;
    init_luts();
    const float *lut = fmt == FMT_INT8 ? NULL : fmt == FMT_E4M3 ? lut_e4m3 : lut_e5m2;
    return paged_decode(q, q_stride, NULL, NULL, k_cache, v_cache, k_scale, v_scale, lut,
                        tables, table_stride, first_block, lens, B, H, KVH, NB, BS, D, scale,
                        out, out_bf16, m_out, l_out, scratch, max_len, num_threads);
}

/* ---- Shared-prefix (cascade) decode: one call for a batch whose sequences all start
 * with the same blocks (a cached system prompt, n > 1 siblings).
 *
 * Phase 1, work items (kv head, chunk of the shared prefix): the chunk's K/V rows are
 * read once for all B x G queries of that kv head (queries in vector lanes: one
 * vdpbf16ps per 16 queries and pair of dims, no horizontal sums), softmax relative to
 * the chunk's own maxima, weighted V; the chunk's part (B * G, D), maxima and
 * denominators go to scratch. Phase 2, work items (sequence, kv head): the sequence's
 * own blocks as in paged_decode, then the exact merge with every chunk's part
 * (a shared maximum, one denominator). Both phases in one OpenMP region. */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* tokens per chunk: a multiple of BS, 32..128 tokens, >= ~4 items per thread */
static int64_t cascade_chunk(int64_t P, int64_t BS, int64_t KVH, int64_t threads) {
    int64_t want = (P * KVH + 4 * threads - 1) / (4 * threads);
    if (want < 32) want = 32;
    if (want > 128) want = 128;
    const int64_t ch = round_up(want, BS);
    return ch < P ? ch : P;
}

typedef struct {
    int64_t NQ, NQP, CH, nch, per_thread, own, parts;
} cascade_layout_t;

/* the scratch (fp32 words): own scores B * H * max_len, then per chunk its part
 * (NQP, D), maxima (NQP) and denominators (NQP), then each thread's workspace:
 * queries (D, NQP), scores (CH + 1, NQP), bf16 pairs of weights (CH / 2 + 1, NQP), the
 * tokens' pool rows (CH int32), the chunk's K or V rows as fp32 (CH, D: the AVX2 path) */
static cascade_layout_t cascade_layout(int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                       int64_t shared_blocks, int64_t max_len,
                                       int64_t threads) {
    cascade_layout_t L;
    L.NQ = B * (H / KVH);
    L.NQP = round_up(L.NQ, 16);
    L.CH = cascade_chunk(shared_blocks * BS, BS, KVH, threads);
    L.nch = (shared_blocks * BS + L.CH - 1) / L.CH;
    L.own = B * H * max_len;
    L.parts = KVH * L.nch * L.NQP * (D + 2);
    L.per_thread = round_up((D + L.CH + 1 + L.CH / 2 + 1) * L.NQP + L.CH + L.CH * D, 16);
    return L;
}

/* the scratch a cascade call with this layout needs, in fp32 words */
static inline int64_t cascade_floats(const cascade_layout_t *L, int64_t threads) {
    return L->own + L->parts + threads * L->per_thread;
}

int64_t tm_cascade_scratch_floats(int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                                  int64_t shared_blocks, int64_t max_len, int64_t num_threads) {
    if (KVH <= 0 || H % KVH != 0 || BS < 1 || shared_blocks < 1 || num_threads < 1) return -1;
    const cascade_layout_t L =
        cascade_layout(B, H, KVH, D, BS, shared_blocks, max_len, num_threads);
    return cascade_floats(&L, num_threads);
}

typedef struct {
    const uint16_t *q;     /* (B, H, D), rows q_stride apart */
    int64_t q_stride, G, D, BS, NQ, NQP;
    const uint16_t *k, *v; /* this kv head's pools (NB, BS, D) */
    const int32_t *tab;    /* the shared blocks */
    int64_t t0, n;         /* the chunk: tokens t0 .. t0 + n of the prefix */
    float scale;
    const int32_t *rows;   /* chunk token t's row in the pools, filled by shared_chunk */
} chunk_t;

static inline const uint16_t *prefix_row(const chunk_t *c, const uint16_t *pool, int64_t t) {
    return pool + (int64_t)c->rows[t] * c->D;
}

/* query n = b * G + g of kv head kh */
static inline const uint16_t *query_row(const chunk_t *c, int64_t kh, int64_t n) {
    return c->q + (n / c->G) * c->q_stride + (kh * c->G + n % c->G) * c->D;
}

/* S[t * NQP + n] = scale * q_n . k_t, fp32 products of the bf16 values */
static void chunk_scores_generic(const chunk_t *c, int64_t kh, float *qf, float *S) {
    const int64_t D = c->D, NQP = c->NQP;
    memset(qf, 0, (size_t)(D * NQP) * sizeof(float));
    for (int64_t n = 0; n < c->NQ; n++) {
        const uint16_t *qr = query_row(c, kh, n);
        for (int64_t d = 0; d < D; d++) qf[d * NQP + n] = bf16_to_f32(qr[d]);
    }
    for (int64_t t = 0; t < c->n; t++) {
        const uint16_t *kr = prefix_row(c, c->k, t);
        float *st = S + t * NQP;
        memset(st, 0, (size_t)NQP * sizeof(float));
        for (int64_t d = 0; d < D; d++) {
            const float kd = bf16_to_f32(kr[d]);
            const float *qd = qf + d * NQP;
#pragma omp simd
            for (int64_t n = 0; n < NQP; n++) st[n] += qd[n] * kd;
        }
#pragma omp simd
        for (int64_t n = 0; n < NQP; n++) st[n] *= c->scale;
    }
}

/* po[n * D + d] = sum_t P[t * NQP + n] v_t[d] */
static void chunk_values_generic(const chunk_t *c, const float *P, float *po) {
    const int64_t D = c->D, NQP = c->NQP;
    float row[MAX_D] __attribute__((aligned(64)));
    memset(po, 0, (size_t)(c->NQ * D) * sizeof(float));
    for (int64_t t = 0; t < c->n; t++) {
        const uint16_t *vr = prefix_row(c, c->v, t);
        for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f32(vr[d]);
        for (int64_t n = 0; n < c->NQ; n++) {
            const float p = P[t * NQP + n];
            float *o = po + n * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * row[d];
        }
    }
}

#ifdef TM_AVX512BF16
/* r[i] lane j <- r[j] lane i: a 16 x 16 transpose of 32-bit words */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4a + b] lane 4k + m: row 4a + m, column 4k + b */
    for (int a = 0; a < 16; a += 8)
        for (int b = 0; b < 4; b++) {
            t[a + b] = _mm512_shuffle_i32x4(r[a + b], r[a + b + 4], 0x88);
            t[a + b + 4] = _mm512_shuffle_i32x4(r[a + b], r[a + b + 4], 0xdd);
        }
    for (int b = 0; b < 8; b++) {
        r[b] = _mm512_shuffle_i32x4(t[b], t[b + 8], 0x88);
        r[b + 8] = _mm512_shuffle_i32x4(t[b], t[b + 8], 0xdd);
    }
}

/* scores of 4 tokens x NV vectors of 16 queries: qt[dp * NQP + n] holds query n's dims
 * 2dp, 2dp + 1 as a bf16 pair; each K pair is broadcast against 16 queries at once. A
 * score of a token past its query's last (t > lim[j] lane-wise) is -3e38 (exp -> 0); the
 * rows' maxima so far in mx */
static inline __attribute__((always_inline)) void chunk_scores_tile(
    const chunk_t *c, const uint32_t *qt, int64_t qv0, int64_t t, float *S, const __m512i *lim,
    __m512 *mx, const int NV) {
    const int64_t NQP = c->NQP, half = c->D / 2;
    const int nt = c->n - t < 4 ? (int)(c->n - t) : 4;
    const uint16_t *rows[4];
    for (int i = 0; i < 4; i++) rows[i] = prefix_row(c, c->k, t + (i < nt ? i : 0));
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < half; dp++) {
        __m512bh qq[4];
        for (int j = 0; j < NV; j++)
            qq[j] = (__m512bh)_mm512_loadu_si512((const void *)(qt + dp * NQP + 16 * (qv0 + j)));
        for (int i = 0; i < 4; i++) {
            int32_t pair;
            memcpy(&pair, rows[i] + 2 * dp, sizeof pair);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qq[j], kb);
        }
    }
    const __m512 scale = _mm512_set1_ps(c->scale), masked = _mm512_set1_ps(-3.0e38f);
    for (int i = 0; i < nt; i++) {
        const __m512i tok = _mm512_set1_epi32((int32_t)(t + i));
        for (int j = 0; j < NV; j++) {
            const __m512 sc = _mm512_mask_mov_ps(_mm512_mul_ps(acc[i][j], scale),
                                                 _mm512_cmpgt_epi32_mask(tok, lim[j]), masked);
            mx[j] = _mm512_max_ps(mx[j], sc);
            _mm512_storeu_ps(S + (t + i) * NQP + 16 * (qv0 + j), sc);
        }
    }
}

/* S as chunk_scores_generic's, masked after the diagonal as shared_chunk says, and
 * each query's maximum into pm */
static void chunk_scores_avx(const chunk_t *c, int64_t kh, uint32_t *qt, float *S, float *pm,
                             int64_t causal) {
    const int64_t NQP = c->NQP, half = c->D / 2;
    int64_t n = 0;
    if (half % 16 == 0) /* 16 queries x 16 dim pairs at a time, transposed in registers */
        for (; n + 16 <= c->NQ; n += 16)
            for (int64_t dp = 0; dp < half; dp += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_loadu_si512((const void *)(query_row(c, kh, n + i) + 2 * dp));
                transpose16_epi32(r);
                for (int i = 0; i < 16; i++)
                    _mm512_storeu_si512((void *)(qt + (dp + i) * NQP + n), r[i]);
            }
    for (int64_t dp = 0; dp < half; dp++) /* the padding lanes: queries 0 */
        memset(qt + dp * NQP + n, 0, (size_t)(NQP - n) * sizeof(uint32_t));
    for (; n < c->NQ; n++) {
        const uint16_t *qr = query_row(c, kh, n);
        for (int64_t dp = 0; dp < half; dp++) memcpy(qt + dp * NQP + n, qr + 2 * dp, 4);
    }
    const int64_t NQV = NQP / 16;
    for (int64_t qv0 = 0; qv0 < NQV; qv0 += 4) {
        const int64_t nv = NQV - qv0 < 4 ? NQV - qv0 : 4;
        __m512i lim[4];
        __m512 mx[4];
        for (int64_t j = 0; j < nv; j++) { /* query n's last token: causal + n / G */
            int32_t l[16];
            for (int64_t k = 0; k < 16; k++)
                l[k] = causal < 0 ? INT32_MAX : (int32_t)(causal + (16 * (qv0 + j) + k) / c->G);
            lim[j] = _mm512_loadu_si512((const void *)l);
            mx[j] = _mm512_set1_ps(-3.0e38f);
        }
        for (int64_t t = 0; t < c->n; t += 4) {
            if (nv == 4) chunk_scores_tile(c, qt, qv0, t, S, lim, mx, 4);
            else if (nv == 3) chunk_scores_tile(c, qt, qv0, t, S, lim, mx, 3);
            else if (nv == 2) chunk_scores_tile(c, qt, qv0, t, S, lim, mx, 2);
            else chunk_scores_tile(c, qt, qv0, t, S, lim, mx, 1);
        }
        for (int64_t j = 0; j < nv; j++) _mm512_storeu_ps(pm + 16 * (qv0 + j), mx[j]);
    }
}

/* po[n * D + d] = sum_t p_t,n v_t[d] for 8 queries from n0, 32 dims at a time: rows t and
 * t + 1 interleaved (as weighted_v_pairs), the weights' bf16 pairs p2[tp * NQP + n]
 * broadcast; the lanes put back in d order by two permutes */
static void chunk_values_avx(const chunk_t *c, const uint32_t *p2, float *po) {
    const int64_t D = c->D, NQP = c->NQP, pairs = (c->n + 1) / 2;
    const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx1 =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t n0 = 0; n0 < c->NQ; n0 += 8) {
        for (int64_t cc = 0; cc < D / 32; cc++) {
            __m512 lo[8], hi[8];
            for (int j = 0; j < 8; j++) lo[j] = hi[j] = _mm512_setzero_ps();
            for (int64_t tp = 0; tp < pairs; tp++) {
                const uint16_t *r0 = prefix_row(c, c->v, 2 * tp);
                const uint16_t *r1 = 2 * tp + 1 < c->n ? prefix_row(c, c->v, 2 * tp + 1) : r0;
                const __m512i x0 = _mm512_loadu_si512((const void *)(r0 + 32 * cc));
                const __m512i x1 = _mm512_loadu_si512((const void *)(r1 + 32 * cc));
                const __m512bh l = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                const __m512bh h = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                const uint32_t *pw = p2 + tp * NQP + n0;
                for (int j = 0; j < 8; j++) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pw[j]);
                    lo[j] = _mm512_dpbf16_ps(lo[j], l, pb);
                    hi[j] = _mm512_dpbf16_ps(hi[j], h, pb);
                }
            }
            const int64_t nt = c->NQ - n0 < 8 ? c->NQ - n0 : 8;
            for (int64_t j = 0; j < nt; j++) {
                float *o = po + (n0 + j) * D + 32 * cc;
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo[j], idx0, hi[j]));
                _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo[j], idx1, hi[j]));
            }
        }
    }
}
#endif

#ifdef TM_AVX512BF16
/* softmax numerators of a chunk's scores S (n rows of NQP) against the maxima pm, as
 * bf16 pairs of rows 2tp, 2tp + 1 (p2[tp * NQP + n], the odd row's partner 0), and their
 * fp32 sums into pl: one pass, the numerators never written back as floats */
static void softmax_pairs_avx(const chunk_t *c, const float *S, const float *pm, float *pl,
                              uint32_t *p2) {
    const int64_t NQP = c->NQP, pairs = (c->n + 1) / 2;
    for (int64_t v = 0; v < NQP; v += 16) {
        const __m512 m = _mm512_loadu_ps(pm + v);
        __m512 l = _mm512_setzero_ps();
        for (int64_t tp = 0; tp < pairs; tp++) {
            const __m512 ea = exp16(_mm512_sub_ps(_mm512_loadu_ps(S + 2 * tp * NQP + v), m));
            const __m512 eb = 2 * tp + 1 < c->n
                ? exp16(_mm512_sub_ps(_mm512_loadu_ps(S + (2 * tp + 1) * NQP + v), m))
                : _mm512_setzero_ps();
            l = _mm512_add_ps(l, _mm512_add_ps(ea, eb));
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(ea));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(eb));
            _mm512_storeu_si512((void *)(p2 + tp * NQP + v),
                                _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        _mm512_storeu_ps(pl + v, l);
    }
}
#endif

#if TM_VEC_MATH8
/* AVX2 (no AVX512-BF16): the generic path's arithmetic (q . k and the weighted sum of V
 * as fp32 fused multiply-adds in the same order) in register tiles, on the chunk's K
 * and then V rows widened to fp32 once into rf (n, D); the generic loops instead
 * stream every score row (or output row) through memory once per dimension (or
 * token). D % 32 == 0. */

/* rows t0 .. t0 + T of S (queries n0 .. n0 + 16) */
static inline __attribute__((always_inline)) void chunk_scores_tile8(
    const chunk_t *c, const float *qf, const float *rf, int64_t t0, int64_t n0, float *S, int T) {
    const int64_t D = c->D, NQP = c->NQP;
    __m256 acc[4][2];
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 q0 = _mm256_loadu_ps(qf + d * NQP + n0);
        __m256 q1 = _mm256_loadu_ps(qf + d * NQP + n0 + 8);
        __asm__("" : "+x"(q0), "+x"(q1)); /* held in registers (see chunk_values_tile8) */
        for (int i = 0; i < T; i++) {
            const __m256 k = _mm256_broadcast_ss(rf + (t0 + i) * D + d);
            acc[i][0] = _mm256_fmadd_ps(q0, k, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(q1, k, acc[i][1]);
        }
    }
    const __m256 scale = _mm256_set1_ps(c->scale);
    for (int i = 0; i < T; i++) {
        _mm256_storeu_ps(S + (t0 + i) * NQP + n0, _mm256_mul_ps(acc[i][0], scale));
        _mm256_storeu_ps(S + (t0 + i) * NQP + n0 + 8, _mm256_mul_ps(acc[i][1], scale));
    }
}

/* the chunk's rows ta .. tb of pool (K or V) as fp32 into rf (tb - ta, D) */
static void chunk_rows_f32(const chunk_t *c, const uint16_t *pool, int64_t ta, int64_t tb,
                           float *rf) {
    for (int64_t t = ta; t < tb; t++) {
        const uint16_t *r = prefix_row(c, pool, t);
        for (int64_t d = 0; d < c->D; d += 8)
            _mm256_storeu_ps(rf + (t - ta) * c->D + d, f32x8(r + d));
    }
}

static void chunk_scores_avx2(const chunk_t *c, int64_t kh, float *qf, float *rf, float *S) {
    const int64_t D = c->D, NQP = c->NQP;
    memset(qf, 0, (size_t)(D * NQP) * sizeof(float));
    for (int64_t n = 0; n < c->NQ; n++) {
        const uint16_t *qr = query_row(c, kh, n);
        for (int64_t d = 0; d < D; d++) qf[d * NQP + n] = bf16_to_f32(qr[d]);
    }
    chunk_rows_f32(c, c->k, 0, c->n, rf);
    for (int64_t t0 = 0; t0 < c->n; t0 += 4) {
        const int64_t T = c->n - t0 < 4 ? c->n - t0 : 4;
        for (int64_t n0 = 0; n0 < NQP; n0 += 16) {
            if (T == 4) chunk_scores_tile8(c, qf, rf, t0, n0, S, 4);
            else if (T == 3) chunk_scores_tile8(c, qf, rf, t0, n0, S, 3);
            else if (T == 2) chunk_scores_tile8(c, qf, rf, t0, n0, S, 2);
            else chunk_scores_tile8(c, qf, rf, t0, n0, S, 1);
        }
    }
}

/* po rows n0 .. n0 + Q, dims d0 .. d0 + 32, the sums over tokens ta .. tb (their V rows in
 * rf from row 0) added to what po holds (from zero at ta = 0): the same multiply-adds in
 * the same order either way */
static inline __attribute__((always_inline)) void chunk_values_tile8(
    const chunk_t *c, const float *P, const float *rf, int64_t n0, int64_t d0, float *po, int Q,
    int64_t ta, int64_t tb) {
    const int64_t D = c->D, NQP = c->NQP;
    __m256 acc[2][4];
    for (int j = 0; j < Q; j++)
        for (int v = 0; v < 4; v++)
            acc[j][v] = ta ? _mm256_loadu_ps(po + (n0 + j) * D + d0 + 8 * v) : _mm256_setzero_ps();
    for (int64_t t = ta; t < tb; t++) {
        __m256 r[4];
        for (int v = 0; v < 4; v++) r[v] = _mm256_loadu_ps(rf + (t - ta) * D + d0 + 8 * v);
        /* loaded once into registers: gcc otherwise folds the load into every query's
         * multiply-add, twice the loads from a buffer that outgrows L1 */
        __asm__("" : "+x"(r[0]), "+x"(r[1]), "+x"(r[2]), "+x"(r[3]));
        for (int j = 0; j < Q; j++) {
            const __m256 p = _mm256_broadcast_ss(P + t * NQP + n0 + j);
            for (int v = 0; v < 4; v++) acc[j][v] = _mm256_fmadd_ps(p, r[v], acc[j][v]);
        }
    }
    for (int j = 0; j < Q; j++)
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(po + (n0 + j) * D + d0 + 8 * v, acc[j][v]);
}

/* tokens a block at a time, so that the block's V rows (fp32) and weights stay in L1
 * while every tile of queries and dims passes over them */
#define VALUES_TOKENS 32

static void chunk_values_avx2(const chunk_t *c, const float *P, float *rf, float *po) {
    for (int64_t ta = 0; ta < c->n; ta += VALUES_TOKENS) {
        const int64_t tb = c->n - ta < VALUES_TOKENS ? c->n : ta + VALUES_TOKENS;
        chunk_rows_f32(c, c->v, ta, tb, rf);
        for (int64_t n0 = 0; n0 < c->NQ; n0 += 2)
            for (int64_t d0 = 0; d0 < c->D; d0 += 32) {
                if (c->NQ - n0 >= 2) chunk_values_tile8(c, P, rf, n0, d0, po, 2, ta, tb);
                else chunk_values_tile8(c, P, rf, n0, d0, po, 1, ta, tb);
            }
    }
}
#endif

/* one chunk of the shared prefix for all queries of kv head kh: its unnormalised part
 * po (NQ, D), maxima pm and denominators pl (NQ). causal >= 0: query n = b * G + g sits
 * at chunk token causal + b and sees no token after it (a prompt tile); -1: no mask */
static void shared_chunk(const chunk_t *chunk, int64_t kh, float *ws, float *po, float *pm,
                         float *pl, int64_t causal) {
    const int64_t NQP = chunk->NQP;
    float *qbuf = ws, *S = ws + chunk->D * NQP;
    uint32_t *p2 = (uint32_t *)(S + round_up(chunk->n, 2) * NQP);
    int32_t *rows = (int32_t *)(p2 + (chunk->n + 1) / 2 * NQP);
    /* each token's pool row once, walking the block table (no division per row) */
    for (int64_t t = 0, blk = chunk->t0 / chunk->BS, off = chunk->t0 % chunk->BS; t < chunk->n;
         t++) {
        rows[t] = (int32_t)((int64_t)chunk->tab[blk] * chunk->BS + off);
        if (++off == chunk->BS) off = 0, blk++;
    }
    chunk_t cc = *chunk;
    cc.rows = rows;
    const chunk_t *c = &cc;
#ifdef TM_AVX512BF16
    const int vector_path = c->D % 32 == 0;
    if (vector_path) { /* masked, maxima and numerators in the vector loops */
        chunk_scores_avx(c, kh, (uint32_t *)qbuf, S, pm, causal);
        softmax_pairs_avx(c, S, pm, pl, p2);
        chunk_values_avx(c, p2, po);
        return;
    }
#endif
    float *rf = (float *)(rows + chunk->n); /* CH * D floats (cascade_layout) */
#if TM_VEC_MATH8
    const int avx2_path = c->D % 32 == 0;
    if (avx2_path) chunk_scores_avx2(c, kh, qbuf, rf, S);
    else
#endif
        chunk_scores_generic(c, kh, qbuf, S);
    if (causal >= 0) /* query row b's heads b * G .. b * G + G - 1 see no token past causal + b */
        for (int64_t b = 0; b * c->G < c->NQ; b++)
            for (int64_t t = causal + b + 1; t < c->n; t++)
                for (int64_t g = 0; g < c->G; g++) S[t * NQP + b * c->G + g] = -3.0e38f;
    for (int64_t n = 0; n < NQP; n++) pm[n] = -3.0e38f;
    for (int64_t t = 0; t < c->n; t++) {
        const float *st = S + t * NQP;
#pragma omp simd
        for (int64_t n = 0; n < NQP; n++) pm[n] = st[n] > pm[n] ? st[n] : pm[n];
    }
    for (int64_t n = 0; n < NQP; n++) pl[n] = 0.0f;
#if TM_VEC_MATH8
    if (avx2_path) { /* NQP is a multiple of 16 */
        for (int64_t t = 0; t < c->n; t++) {
            float *st = S + t * NQP;
            for (int64_t n = 0; n < NQP; n += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(st + n), _mm256_loadu_ps(pm + n)));
                _mm256_storeu_ps(pl + n, _mm256_add_ps(_mm256_loadu_ps(pl + n), e));
                _mm256_storeu_ps(st + n, round_bf16x8(e));
            }
        }
        chunk_values_avx2(c, S, rf, po);
        return;
    }
#endif
    (void)rf;
    for (int64_t t = 0; t < c->n; t++) { /* numerators, rounded to bf16 as the own part's */
        float *st = S + t * NQP;
#pragma omp simd
        for (int64_t n = 0; n < NQP; n++) {
            const float e = expf(st[n] - pm[n]);
            pl[n] += e;
            st[n] = round_bf16(e);
        }
    }
    (void)p2;
    chunk_values_generic(c, S, po);
}

/* The work of tm_cascade_decode_bf16 (below) for the threads of an enclosing parallel
 * region, each calling it with its thread number: the shared chunks' parts, then each
 * (sequence, kv head)'s own blocks merged with them. Two orphaned worksharing loops, each
 * ending in a barrier. Its arguments checked and the scratch laid out by the caller. */
typedef struct {
    const uint16_t *q;
    int64_t q_stride;
    const uint16_t *k_cache, *v_cache;
    const int32_t *tables;
    int64_t table_stride, shared_blocks;
    const int32_t *lens;
    int64_t B, H, KVH, NB, BS, D, max_len;
    float scale;
    float *out;         /* (B, H, D) fp32, or NULL */
    uint16_t *out_bf16; /* (B, H, D) bf16, or NULL */
    float *scratch;
    cascade_layout_t L;
} cascade_t;

static void cascade_phases(const cascade_t *a, int tid) {
    const cascade_layout_t L = a->L;
    const int64_t G = a->H / a->KVH, D = a->D, H = a->H, NB = a->NB, BS = a->BS;
    const int64_t P = a->shared_blocks * BS, items = a->KVH * L.nch, max_len = a->max_len;
    float *scratch = a->scratch;
    float *part_o = scratch + L.own, *part_m = part_o + items * L.NQP * D;
    float *part_l = part_m + items * L.NQP, *thread_ws = scratch + L.own + L.parts;
    float *ws = thread_ws + (int64_t)tid * L.per_thread;
    const int nth = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t kh = item / L.nch, t0 = (item % L.nch) * L.CH;
        /* this chunk's V rows (read after its scores) and the K and V rows of the chunk
         * a thread is likely to take next, into L2: the prefix's blocks are scattered */
        for (int64_t nx = item; nx <= item + nth && nx < items; nx += nth) {
            const int64_t nk = nx / L.nch, n0 = (nx % L.nch) * L.CH;
            const int64_t n1 = P - n0 < L.CH ? P : n0 + L.CH;
            prefetch_blocks_l2(nx != item ? a->k_cache + nk * NB * BS * D : NULL,
                               a->v_cache + nk * NB * BS * D, a->tables + n0 / BS,
                               (n1 + BS - 1) / BS - n0 / BS, BS * D);
        }
        const chunk_t c = {a->q, a->q_stride, G, D, BS, L.NQ, L.NQP,
                           a->k_cache + kh * NB * BS * D, a->v_cache + kh * NB * BS * D,
                           a->tables, t0, P - t0 < L.CH ? P - t0 : L.CH, a->scale, NULL};
        shared_chunk(&c, kh, ws, part_o + item * L.NQP * D, part_m + item * L.NQP,
                     part_l + item * L.NQP, -1);
    }
    /* the implicit barrier: every chunk's part is written before any merge */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < a->B * a->KVH; item++) {
        const int64_t b = item / a->KVH, kh = item % a->KVH;
        if (item + nth < a->B * a->KVH) { /* the own blocks a thread is likely to take next */
            const int64_t nb_ = (item + nth) / a->KVH, nk = (item + nth) % a->KVH;
            prefetch_blocks_l2(a->k_cache + nk * NB * BS * D, a->v_cache + nk * NB * BS * D,
                               a->tables + nb_ * a->table_stride + a->shared_blocks,
                               (a->lens[nb_] + BS - 1) / BS, BS * D);
        }
        item_t it = {a->k_cache + kh * NB * BS * D, a->v_cache + kh * NB * BS * D,
                     a->tables + b * a->table_stride + a->shared_blocks, a->lens[b], BS, D, G,
                     max_len, a->scale, NULL, NULL, NULL, NULL, NULL};
        float *s = scratch + (b * H + kh * G) * max_len;
        float acc[MAX_GROUP_DIM] __attribute__((aligned(64)));
        float mx[MAX_GROUP], sum[MAX_GROUP];
        attend_item(&it, a->q + b * a->q_stride + kh * G * D, s, acc, mx, sum);
        for (int64_t g = 0; g < G; g++) {
            const int64_t n = b * G + g;
            float top = mx[g];
            for (int64_t ci = 0; ci < L.nch; ci++) {
                const float m = part_m[(kh * L.nch + ci) * L.NQP + n];
                top = m > top ? m : top;
            }
            float *ag = acc + g * D;
            const float w_own = expf(mx[g] - top);
            float denom = sum[g] * w_own;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ag[d] *= w_own;
            for (int64_t ci = 0; ci < L.nch; ci++) {
                const int64_t pi = (kh * L.nch + ci) * L.NQP + n;
                const float w = expf(part_m[pi] - top);
                const float *po = part_o + pi * D;
                denom += part_l[pi] * w;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ag[d] += w * po[d];
            }
            const float inv = 1.0f / denom;
            const int64_t o = (b * H + kh * G + g) * D;
            if (a->out_bf16) {
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a->out_bf16[o + d] = f32_to_bf16(ag[d] * inv);
            } else {
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a->out[o + d] = ag[d] * inv;
            }
        }
    }
}

/* tm_cascade_decode_bf16's checks of its inputs, and its scratch laid out in *a:
 * 0, or -1 for inputs it does not take */
static int cascade_setup(cascade_t *a, int64_t scratch_floats, int64_t num_threads) {
    const int64_t B = a->B, H = a->H, KVH = a->KVH, D = a->D, BS = a->BS;
    if (KVH <= 0 || H % KVH != 0 || D > MAX_D || D % 2 || (H / KVH) * D > MAX_GROUP_DIM ||
        H / KVH > MAX_GROUP || num_threads < 1 || a->shared_blocks < 1 || BS < 1 || B < 1 ||
        a->table_stride < a->shared_blocks)
        return -1;
    for (int64_t b = 0; b < B; b++) {
        if (a->lens[b] < 1 || a->lens[b] > a->max_len) return -1;
        for (int64_t j = 0; j < a->shared_blocks; j++)
            if (a->tables[b * a->table_stride + j] != a->tables[j]) return -1;
    }
    a->L = cascade_layout(B, H, KVH, D, BS, a->shared_blocks, a->max_len, num_threads);
    if (scratch_floats < cascade_floats(&a->L, num_threads)) return -1;
    return 0;
}

/* q: (B, H, D) bf16, rows q_stride elements apart; tables: (B, table_stride) int32 whose
 * first shared_blocks entries are the same in every row. Sequence b attends to those
 * shared_blocks * BS tokens, then to its own lens[b] tokens in tables[b][shared_blocks:].
 * Output (B, H, D) normalised, into out_bf16 (rounded) if given, else into out (fp32).
 * scratch: tm_cascade_scratch_floats(...) fp32 words (scratch_floats of them given).
 * Returns 0, or -1 (nothing written) for inputs it does not take. */
int tm_cascade_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *tables, int64_t table_stride,
                           int64_t shared_blocks, const int32_t *lens, int64_t B, int64_t H,
                           int64_t KVH, int64_t NB, int64_t BS, int64_t D, float scale,
                           float *out, uint16_t *out_bf16, float *scratch,
                           int64_t scratch_floats, int64_t max_len, int64_t num_threads) {
    cascade_t a = {q, q_stride, k_cache, v_cache, tables, table_stride, shared_blocks, lens,
                   B, H, KVH, NB, BS, D, max_len, scale, out, out_bf16, scratch, {0}};
    if (cascade_setup(&a, scratch_floats, num_threads)) return -1;
#pragma omp parallel num_threads(num_threads)
    cascade_phases(&a, omp_get_thread_num());
    return 0;
}

/* ---- Prompt attention, tiled: a chunk of num_q new tokens of one sequence, whose keys
 * (seq_len of them, the chunk's own last) are all in the cache; query i sits at token
 * seq_len - num_q + i and sees the tokens up to itself. Work items (kv head, tile of
 * PROMPT_TILE queries): the tile's G * PROMPT_TILE query heads in vector lanes against
 * every key up to its last query, as a shared-prefix chunk is (one vdpbf16ps per 16
 * queries and dim pair, no horizontal sums), masked after the diagonal, one softmax,
 * normalised. Per query the same arithmetic as the row-by-row decode kernel but for the
 * order of the fp32 sums within q . k and the exponential (exp16, within 1.2e-7 of expf
 * where the decode kernel calls libmvec's: 0.88 -> 0.54 ms a 512-token layer). */

#define PROMPT_TILE 16

static int64_t prompt_per_thread(int64_t G, int64_t D, int64_t seq_len) {
    const int64_t NQP = round_up(PROMPT_TILE * G, 16), n = round_up(seq_len, 2);
    return round_up((D + n + 1 + n / 2 + 1) * NQP + n + n * D + NQP * (D + 2), 16);
}

int64_t tm_prompt_scratch_floats(int64_t H, int64_t KVH, int64_t D, int64_t seq_len,
                                 int64_t num_threads) {
    if (KVH <= 0 || H % KVH != 0 || seq_len < 1 || num_threads < 1) return -1;
    return num_threads * prompt_per_thread(H / KVH, D, seq_len);
}

/* q (num_q, H, D) bf16, rows q_stride apart; table: the sequence's blocks; out
 * (num_q, H, D) bf16. Returns 0, or -1 (nothing written) for inputs it does not take. */
int tm_prompt_attend_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                          const uint16_t *v_cache, const int32_t *table, int64_t num_q,
                          int64_t seq_len, int64_t H, int64_t KVH, int64_t NB, int64_t BS,
                          int64_t D, float scale, uint16_t *out, float *scratch,
                          int64_t scratch_floats, int64_t num_threads) {
    if (KVH <= 0 || H % KVH != 0 || D > MAX_D || D % 2 || num_q < 1 || num_q > seq_len ||
        BS < 1 || num_threads < 1)
        return -1;
    const int64_t G = H / KVH, per_thread = prompt_per_thread(G, D, seq_len);
    if (scratch_floats < num_threads * per_thread) return -1;
    for (int64_t j = 0; j < (seq_len + BS - 1) / BS; j++)
        if (table[j] < 0 || table[j] >= NB) return -1;
    const int64_t tiles = (num_q + PROMPT_TILE - 1) / PROMPT_TILE, first = seq_len - num_q;
    const int64_t NQP = round_up(PROMPT_TILE * G, 16);
#pragma omp parallel num_threads(num_threads)
    {
        float *ws = scratch + (int64_t)omp_get_thread_num() * per_thread;
        float *po = ws + per_thread - NQP * (D + 2), *pm = po + NQP * D, *pl = pm + NQP;
        /* the last tiles (the most keys) first: a dynamic schedule then balances */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < KVH * tiles; item++) {
            const int64_t kh = item % KVH, tile = tiles - 1 - item / KVH;
            const int64_t i0 = tile * PROMPT_TILE;
            const int64_t rows = num_q - i0 < PROMPT_TILE ? num_q - i0 : PROMPT_TILE;
            const chunk_t c = {q + i0 * q_stride, q_stride, G, D, BS, rows * G, NQP,
                               k_cache + kh * NB * BS * D, v_cache + kh * NB * BS * D,
                               table, 0, first + i0 + rows, scale, NULL};
            shared_chunk(&c, kh, ws, po, pm, pl, first + i0);
            for (int64_t n = 0; n < rows * G; n++) {
                const int64_t b = n / G, g = n % G;
                const float inv = 1.0f / pl[n];
                uint16_t *o = out + ((i0 + b) * H + kh * G + g) * D;
                const float *src = po + n * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(src[d] * inv);
            }
        }
    }
    return 0;
}
