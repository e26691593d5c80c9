/* Low-bit GGUF weights times dynamically quantized int8 activations, for the few
 * rows of a decode step (what llama.cpp's vec_dot_q4_1_q8_1 / q8_0_q8_0 do).
 *
 * Activations: each row of x (M, K) bf16 is quantized per block of 32 inputs,
 *   v = round(x / dx), dx = max|x| / vmax (fp32), kept with the block's sum of v:
 *   8 bits (vmax 127, llama.cpp's Q8 activations) or 16 bits (vmax 32512, stored as
 *   two int8 planes v = 256 qh + ql, each plane a vpdpbusd pass: twice the integer
 *   work for an activation error 256x smaller, below bf16's own rounding).
 * Weights, repacked at load (tokenmill/quant/vnni.py) in groups of 16 output rows,
 * one record per (group, block of 32 inputs), records of a group contiguous:
 *   Q4 (Q4_0, Q4_1, int4): w = d * q + m, q in 0..15, record of 320 bytes:
 *     qs[4][16][4]: chunk c, row r, byte j holds q[4c + j] (low nibble) and
 *                   q[16 + 4c + j] (high nibble) of that row's block (GGUF's order)
 *     d[16], m[16]: fp16
 *   Q8 (Q8_0):      w = d * q, q int8, record of 544 bytes:
 *     qs[8][16][4]: chunk c, row r, byte j holds q[4c + j] + 128 (as uint8)
 *     d[16]: fp16
 *   Q5, Q6 (Q5_0, Q5_1, Q5_K; Q6_K): a Q4 record with q in 0..31 or 0..63, its nibbles
 *     as Q4's, then a plane of hb = 1 or 2 high bits a weight (64 hb bytes: 384 and 448
 *     bytes a record), chunk c's 16 hb bytes at 320 + 16 hb c (add_high512 below)
 *   Q4K (Q4_K): Q4_K's own super-blocks of 256 inputs, w = d sc q - dmin mn per
 *     sub-block of 32 (sc, mn 6-bit), one record per (group, super-block) of 2,304
 *     bytes (4.5 bits a weight, the file's): 8 sub-blocks' nibbles as a Q4 record's
 *     (256 bytes each), then d[16], dmin[16] fp16, lows[8][16] (sc & 15 | (mn & 15) << 4
 *     of sub-block j, row r) and highs[4][16] (bits 0-1 sc_t >> 4, 2-3 mn_t >> 4, 4-5
 *     sc_t+4 >> 4, 6-7 mn_t+4 >> 4). The scales are unpacked once per super-block into
 *     fp32 d sc and -dmin mn (exact products: an 11-bit mantissa times 6 bits), then each
 *     sub-block runs a Q4 record's arithmetic with them, as llama.cpp's Q4_K x Q8_K dot
 *     applies scale * sum - min * bsum (here with the activations' per-32 scale dx).
 *   MIXED: the parts of a fused linear, each in its own format (group_records below)
 * A block's dot product is an exact int32 sum of products (vpdpbusd: unsigned
 * weight bytes times signed activation bytes, 16 rows per instruction), scaled
 * in fp32:  Q4: d dx sum(q v) + m dx sum(v);  Q8: d dx (sum((q+128) v) - 128 sum(v)).
 * Sums over blocks are fp32 in block order, per row.
 *
 * Without AVX512-VNNI the same arithmetic runs as plain C (exact integer sums, the
 * same fp32 order within a block), so results match to fp32 rounding.
 * Built at first use by tokenmill/kernels/build.py; see q4q8_gemv.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TM_VNNI 1
/* The fp32 steps use the explicitly rounded intrinsics (TM_RN, vec_math.h: round to
 * nearest even, as the plain ones): gcc keeps those as written under -ffast-math, where
 * it may reassociate a plain product (or divide by a reciprocal) differently in each
 * caller it inlines into, and decode_step.c's fused steps must match the module path
 * bit for bit. */
#else
#define TM_VNNI 0
#endif
/* AVX2 (x86-64-v3: every x86 server since Haswell and Zen 1) without AVX512-VNNI: the
 * same exact int32 block sums from vpmaddubsw (unsigned weight bytes times signed
 * activation bytes, adjacent pairs summed in int16) and vpmaddwd (pairs of those in
 * int32), as llama.cpp's AVX2 dot products. A Q4 pair is at most 2 * 15 * 128 = 3840 and a
 * block's eight pairs per lane at most 30720, so the int16 sums never saturate; Q8 bytes
 * (0..255) would, so they run as two nibble planes, w = 16 hi + lo. */
#if !TM_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TM_AVX2 1
#else
#define TM_AVX2 0
#endif

#include "bf16.h"
#include "layer_ops.h" /* silu_mul_row */
#include "runs.h"      /* own_run, next_group */
#include "vec_math.h"  /* TM_RN, f32x16 */

#define QK 32                       /* inputs per block */
#define ROWS 16                     /* output rows per group */
#define Q4_RECORD (ROWS * 16 + ROWS * 4) /* 320 bytes */
#define Q8_RECORD (ROWS * 32 + ROWS * 2) /* 544 bytes */
/* activation rows per pass over a group's weights (AVX2: fewer registers, see there) */
#define MR (TM_VNNI ? 16 : TM_AVX2 ? 4 : 8)
/* records ahead the first pass over a group prefetches, and into which cache (-D for the
 * sweep of benchmarks/kernels/records_stream.c) */
#ifndef PF_RECORDS
#define PF_RECORDS 6
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#define PARALLEL_GROUPS 8           /* fewer groups run on the calling thread */

/* 2 is decode_step.c's FMT_BF16 */
enum { FMT_Q4 = 0, FMT_Q8 = 1, FMT_MIXED = 3, FMT_Q5 = 4, FMT_Q6 = 5, FMT_Q4K = 6 };
#define HIGH_PLANE 64 /* bytes of a Q5 / Q6 record's high-bit plane, per high bit */
#define Q4K_SUB 8                                   /* blocks of 32 a super-block */
#define Q4K_META (Q4K_SUB * ROWS * 16)              /* 2,048: the scales' offset */
#define Q4K_RECORD (Q4K_META + ROWS * 16)           /* 2,304 bytes a super-block */

/* FMT_MIXED: a fused linear whose parts keep their own formats (a q/k in Q4 beside a v
 * in Q8): a header of MIXED_HEADER bytes, int32 parts (1..MIXED_PARTS), then per part
 * int32 end group (exclusive) and int32 format (not FMT_MIXED); then each part's
 * records in turn, groups of one part all in its format (its rows a multiple of 16 but
 * the last's). The header's sizes are written and checked by q4q8_gemv.py. */
#define MIXED_HEADER 64
#define MIXED_PARTS 7

/* high bits a weight has beyond a Q4 record's nibble: Q5 1, Q6 2 */
static inline int high_bits(int64_t format) {
    return format == FMT_Q5 ? 1 : format == FMT_Q6 ? 2 : 0;
}

/* bytes a (group, block of 32): for Q4K a super-block's record over its 8 blocks (288),
 * so that a group's records are nb * record_bytes for every format (K % 256 == 0 there) */
static inline int64_t record_bytes(int64_t format) {
    return format == FMT_Q8    ? Q8_RECORD
           : format == FMT_Q4K ? Q4K_RECORD / Q4K_SUB
                               : Q4_RECORD + HIGH_PLANE * high_bits(format);
}

/* block b's Q4 nibbles (a Q4 record's first 256 bytes) in a group's records: rb bytes a
 * record, or a Q4K super-block's sub-block */
static inline const uint8_t *block_nibbles(const uint8_t *wg, int64_t b, int64_t rb, int k4) {
    return k4 ? wg + (b / Q4K_SUB) * Q4K_RECORD + (b % Q4K_SUB) * 256 : wg + b * rb;
}

/* group g's records (nb blocks) in w, and the format they are in */
static inline const uint8_t *group_records(const uint8_t *w, int64_t format, int64_t g,
                                           int64_t nb, int64_t *fmt) {
    if (format != FMT_MIXED) {
        *fmt = format;
        return w + g * nb * record_bytes(format);
    }
    int32_t h[1 + 2 * MIXED_PARTS];
    memcpy(h, w, sizeof h);
    const uint8_t *p = w + MIXED_HEADER;
    int64_t g0 = 0, i = 0;
    for (; i < h[0] - 1 && g >= h[1 + 2 * i]; i++) { /* past part i */
        p += (h[1 + 2 * i] - g0) * nb * record_bytes(h[2 + 2 * i]);
        g0 = h[1 + 2 * i];
    }
    *fmt = h[2 + 2 * i];
    return p + (g - g0) * nb * record_bytes(*fmt);
}

int64_t tm_q4q8_has_vnni(void) { return TM_VNNI; }
/* the integer dot products this build runs: 2 AVX512-VNNI, 1 AVX2, 0 plain C */
int64_t tm_q4q8_isa(void) { return TM_VNNI ? 2 : TM_AVX2; }

static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                   man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0) { /* zero or subnormal */
        c.f = (float)man * 5.9604644775390625e-8f; /* 2^-24 */
        c.u |= sign;
    } else if (exp == 31) {
        c.u = sign | 0x7f800000u | (man << 13);
    } else {
        c.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return c.f;
}

/* A Q4K super-block's scales (meta: its record + Q4K_META) -> wd[j][r] = d_r sc_jr and
 * wm[j][r] = -dmin_r mn_jr in fp32 for sub-block j, row r: exact products (d's 11-bit
 * mantissa times 6 bits), so every ISA's version gives the same values. Once a
 * super-block (8 blocks) of a group, beside 2,048 bytes of nibbles. */
static inline __attribute__((always_inline)) void q4k_scales(const uint8_t *meta,
                                                             float wd[Q4K_SUB][ROWS],
                                                             float wm[Q4K_SUB][ROWS]) {
#if TM_VNNI
    uint8_t sc[Q4K_SUB][ROWS] __attribute__((aligned(64))), mn[Q4K_SUB][ROWS]
        __attribute__((aligned(64)));
    const __m512i l0 = _mm512_loadu_si512((const void *)(meta + 64));
    const __m512i l1 = _mm512_loadu_si512((const void *)(meta + 128));
    const __m512i h = _mm512_loadu_si512((const void *)(meta + 192));
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* a | (b & c) (0xF8); the 16-bit shifts' bits that cross a byte fall outside 0x30 */
    _mm512_store_si512((void *)sc[0], _mm512_ternarylogic_epi32(
        _mm512_and_si512(l0, m4), _mm512_slli_epi16(h, 4), m30, 0xF8));
    _mm512_store_si512((void *)sc[4], _mm512_ternarylogic_epi32(_mm512_and_si512(l1, m4), h,
                                                                m30, 0xF8));
    _mm512_store_si512((void *)mn[0], _mm512_ternarylogic_epi32(
        _mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_slli_epi16(h, 2), m30, 0xF8));
    _mm512_store_si512((void *)mn[4], _mm512_ternarylogic_epi32(
        _mm512_and_si512(_mm512_srli_epi16(l1, 4), m4), _mm512_srli_epi16(h, 2), m30, 0xF8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)meta));
    const __m512 nm = _mm512_sub_ps(_mm512_setzero_ps(),
                                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(meta + 32))));
    for (int j = 0; j < Q4K_SUB; j++) {
        _mm512_store_ps(wd[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                    _mm_load_si128((const __m128i *)sc[j])))));
        _mm512_store_ps(wm[j], _mm512_mul_ps(nm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                     _mm_load_si128((const __m128i *)mn[j])))));
    }
#elif TM_AVX2
    uint8_t sc[Q4K_SUB][ROWS] __attribute__((aligned(32))), mn[Q4K_SUB][ROWS]
        __attribute__((aligned(32)));
    const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int t = 0; t < 2; t++) { /* sub-blocks 2t, 2t + 1 and 4 + 2t, 5 + 2t */
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(meta + 64 + 32 * t));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(meta + 128 + 32 * t));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(meta + 192 + 32 * t));
        _mm256_store_si256((__m256i *)sc[2 * t], _mm256_or_si256(
            _mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)));
        _mm256_store_si256((__m256i *)sc[4 + 2 * t], _mm256_or_si256(
            _mm256_and_si256(l1, m4), _mm256_and_si256(h, m30)));
        _mm256_store_si256((__m256i *)mn[2 * t], _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
            _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)));
        _mm256_store_si256((__m256i *)mn[4 + 2 * t], _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)));
    }
    for (int half = 0; half < 2; half++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 16 * half)));
        const __m256 nm = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(meta + 32 + 16 * half))));
        for (int j = 0; j < Q4K_SUB; j++) {
            _mm256_storeu_ps(wd[j] + 8 * half, _mm256_mul_ps(d, _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc[j] + 8 * half))))));
            _mm256_storeu_ps(wm[j] + 8 * half, _mm256_mul_ps(nm, _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn[j] + 8 * half))))));
        }
    }
#else
    for (int r = 0; r < ROWS; r++) {
        uint16_t hd, hm;
        memcpy(&hd, meta + 2 * r, 2);
        memcpy(&hm, meta + 32 + 2 * r, 2);
        const float d = half_to_f32(hd), dmin = half_to_f32(hm);
        for (int j = 0; j < Q4K_SUB; j++) {
            const int lo = meta[64 + 16 * j + r], hi = meta[192 + 16 * (j % 4) + r] >> (j / 4 * 4);
            wd[j][r] = d * (float)((lo & 15) | (hi & 3) << 4);
            wm[j][r] = (0.0f - dmin) * (float)((lo >> 4) | (hi >> 2 & 3) << 4);
        }
    }
#endif
}

/* Block b of row m of x (M, K) bf16 -> per block of 32: x = dx * v, v an integer,
 * |v| <= vmax:
 *   bits 8:  vmax 127, v = q (one int8 plane q);
 *   bits 16: vmax 32512 = 127 * 256, v = 256 qh + ql with qh in -127..127 and ql in
 *            -128..127 (planes q = qh and q + M * K = ql), so each plane is int8.
 * d, s (M, K/32) fp32 with s = dx * sum(v); sum (M, K/32) int32 = -128 sum(v). The AVX-512
 * version computes exactly what the plain one does (the same fp32 products, rounded to
 * nearest even). */
/* noipa: one compiled body for every caller (inlined with a constant `bits`, -ffast-math
 * turned x / 32512 into a product by an inexact reciprocal in one caller and not another) */
static __attribute__((noipa)) void quantize_block(const uint16_t *x, int64_t M, int64_t K,
                                                 int64_t bits,
                                  int8_t *q, float *d, float *s, int32_t *sum, int64_t m,
                                  int64_t b) {
    const int64_t nb = K / QK;
    const float vmax = bits == 16 ? 32512.0f : 127.0f;
    const uint16_t *xb = x + m * K + b * QK;
    int8_t *qh = q + m * K + b * QK, *ql = qh + M * K;
    int32_t total = 0;
    float dd;
#if TM_VNNI
    const __m512i raw = _mm512_loadu_si512((const void *)xb);
    const __m512 v0 = f32x16(_mm512_castsi512_si256(raw));
    const __m512 v1 = f32x16(_mm512_extracti64x4_epi64(raw, 1));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    dd = _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(amax), _mm_set_ss(vmax), TM_RN));
    const float id =
        dd > 0.0f ? _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(1.0f), _mm_set_ss(dd), TM_RN))
                  : 0.0f;
    const __m512 vid = _mm512_set1_ps(id), hi = _mm512_set1_ps(vmax), lo = _mm512_set1_ps(-vmax);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(
        _mm512_roundscale_ps(_mm512_mul_round_ps(v0, vid, TM_RN), TM_RN), hi), lo));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(
        _mm512_roundscale_ps(_mm512_mul_round_ps(v1, vid, TM_RN), TM_RN), hi), lo));
    total = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    if (bits == 16) {
        const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
        const __m512i l0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i0, c128), c255), c128);
        const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(i1, c128), c255), c128);
        _mm_storeu_si128((__m128i *)qh, _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(i0, l0), 8)));
        _mm_storeu_si128((__m128i *)(qh + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(i1, l1), 8)));
        _mm_storeu_si128((__m128i *)ql, _mm512_cvtepi32_epi8(l0));
        _mm_storeu_si128((__m128i *)(ql + 16), _mm512_cvtepi32_epi8(l1));
    } else {
        _mm_storeu_si128((__m128i *)qh, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(qh + 16), _mm512_cvtepi32_epi8(i1));
    }
#else
    float v[QK], amax = 0.0f;
    for (int i = 0; i < QK; i++) {
        v[i] = bf16_to_f32(xb[i]);
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    dd = amax / vmax;
    const float id = dd > 0.0f ? 1.0f / dd : 0.0f;
    for (int i = 0; i < QK; i++) {
        float r = nearbyintf(v[i] * id);
        r = r > vmax ? vmax : (r < -vmax ? -vmax : r);
        const int32_t vi = (int32_t)r;
        total += vi;
        if (bits == 16) {
            const int32_t low = ((vi + 128) & 255) - 128;
            qh[i] = (int8_t)((vi - low) / 256);
            ql[i] = (int8_t)low;
        } else {
            qh[i] = (int8_t)vi;
        }
    }
#endif
    d[m * nb + b] = dd;
    sum[m * nb + b] = -128 * total; /* what the Q8 records add (q8_group) */
#if TM_VNNI
    s[m * nb + b] = _mm_cvtss_f32(_mm_mul_round_ss(_mm_set_ss(dd), _mm_set_ss((float)total), TM_RN));
#else
    s[m * nb + b] = dd * (float)total;
#endif
}

/* Rows ids (n,) of a weight of N rows in Q8 records (K inputs) -> out (n, K) fp32, each
 * weight as the kernel multiplies it: d (q - 128), exact in fp32 (record_rows.py's Q8
 * rows: a tied embedding's lookups from the LM head's records). Returns 0; -1 (nothing
 * written) when K is not a multiple of QK or an id is outside [0, N). */
int64_t tm_q8_record_rows(const uint8_t *w, int64_t N, int64_t K, const int64_t *ids,
                          int64_t n, float *out) {
    if (K % QK || N < 1) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < n; i++) {
        const int64_t g = ids[i] / ROWS, r = ids[i] % ROWS;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = w + (g * nb + b) * Q8_RECORD;
            uint16_t h;
            memcpy(&h, rec + ROWS * 32 + 2 * r, 2);
            const float d = half_to_f32(h);
            float *o = out + i * K + b * QK;
            for (int k = 0; k < QK; k++)
                o[k] = d * (float)((int)rec[64 * (k / 4) + 4 * r + k % 4] - 128);
        }
    }
    return 0;
}

void tm_q8_quantize_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t bits, int8_t *q,
                         float *d, float *s, int32_t *sum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / QK; b++) quantize_block(x, M, K, bits, q, d, s, sum, m, b);
}

#if TM_VNNI
/* acc + w (unsigned bytes) . the 4 signed bytes at p in every lane: vpdpbusd with its
 * third operand broadcast from memory ({1to16}), which gcc does not fold from
 * _mm512_set1_epi32 (it emits a vpbroadcastd for each) */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w,
                                                                 const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* The int32 dot products of 16 rows with one activation block: Q4 records. With two
 * planes, 256 * (w . qh) + (w . ql); |w . qh| <= 32 * 15 * 127, so no overflow. Each
 * plane's 8 vpdpbusd run as two chains of 4 (the low nibbles' inputs and the high
 * ones'): a single chain of 8 dependent instructions a row left the cores waiting on
 * vpdpbusd's latency. Integer sums: any order gives the same exact values. */
static inline __attribute__((always_inline)) __m512i q4_dots(
    const __m512i *lo, const __m512i *hi, const int8_t *xb, const int8_t *xl, int planes) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        a = dpbusd_bcast(a, lo[c], xb + 4 * c);
        b = dpbusd_bcast(b, hi[c], xb + 16 + 4 * c);
    }
    __m512i s = _mm512_add_epi32(a, b);
    if (planes == 2) {
        __m512i e = _mm512_setzero_si512(), f = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            e = dpbusd_bcast(e, lo[c], xl + 4 * c);
            f = dpbusd_bcast(f, hi[c], xl + 16 + 4 * c);
        }
        s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), _mm512_add_epi32(e, f));
    }
    return s;
}

/* A Q5 / Q6 record's high bits of chunk c (hb a weight; plane p = the record's plane
 * + 16 hb c) into the chunk's nibbles lo, hi (bit 4 up): byte i of the chunk's 64 has
 * e = its low nibble's high bits | its high nibble's << hb, stored at bits 2 hb t of
 * the plane's byte i - 16 hb t, t = i / (16 hb) */
static inline __attribute__((always_inline)) void add_high512(const uint8_t *p, int hb,
                                                               __m512i *lo, __m512i *hi) {
    /* e: each byte's low nibble's high bits at bit 0, its high nibble's at bit hb, and
     * junk above them (no masking here: a 16-bit shift's bits that cross into the next
     * byte and the junk both fall outside the 0x30 / 0x10 that vpternlogd keeps below;
     * 7 instructions a chunk instead of 12 for Q6, 6 instead of 10 for Q5) */
    __m512i e;
    if (hb == 2) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)p);
        e = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 4), 1);
    } else { /* each 16-byte lane t of the chunk: the plane's 16 bytes >> 2t */
        const __m512i h = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
        const __m512i by = _mm512_set_epi32(0x60006, 0x60006, 0x60006, 0x60006, 0x40004,
                                            0x40004, 0x40004, 0x40004, 0x20002, 0x20002,
                                            0x20002, 0x20002, 0, 0, 0, 0);
        e = _mm512_srlv_epi16(h, by);
    }
    /* the high bits to bit 4 up: lo | (e << 4 & keep), hi | (e << (4 - hb) & keep);
     * 0xF8 is vpternlogd's table for a | (b & c) */
    const __m512i keep = _mm512_set1_epi8((char)(((1 << hb) - 1) << 4));
    *lo = _mm512_ternarylogic_epi32(*lo, _mm512_slli_epi16(e, 4), keep, 0xF8);
    *hi = _mm512_ternarylogic_epi32(*hi, _mm512_slli_epi16(e, 4 - hb), keep, 0xF8);
}

/* out[i][r] = row r of the group . activation row i, for i < mr (a constant at each
 * call site, so the loops over i unroll and acc stays in registers). hb: the records'
 * high bits (Q4 0, Q5 1, Q6 2), a constant too. */
static inline __attribute__((always_inline)) void q4x_group(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const float *s, const int32_t *sum, int mr, int planes, int pf, float *out,
    int hb, int k4) {
    (void)sum;
    __m512 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int64_t rb = k4 ? Q4K_RECORD / Q4K_SUB : Q4_RECORD + HIGH_PLANE * hb;
    float kd[Q4K_SUB][ROWS] __attribute__((aligned(64))), km[Q4K_SUB][ROWS]
        __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = block_nibbles(wg, b, rb, k4);
        if (pf) /* Q4K: the group's records as one stream, rb bytes a block on average */
            for (int l = 0; l < rb; l += 64)
                _mm_prefetch((const char *)wg + (b + PF_RECORDS) * rb + l, PF_HINT);
        if (k4 && b % Q4K_SUB == 0) q4k_scales(rec + Q4K_META, kd, km);
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const __m512i w = _mm512_loadu_si512((const void *)(rec + 64 * c));
            lo[c] = _mm512_and_si512(w, low);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            if (hb) add_high512(rec + Q4_RECORD + 16 * hb * c, hb, &lo[c], &hi[c]);
        }
        const __m512 wd = k4 ? _mm512_load_ps(kd[b % Q4K_SUB]) : _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(rec + 256)));
        const __m512 wm = k4 ? _mm512_load_ps(km[b % Q4K_SUB]) : _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)(rec + 288)));
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            const int8_t *xb = q + i * K + b * QK;
            const __m512 dot = _mm512_cvtepi32_ps(q4_dots(lo, hi, xb, xb + plane, planes));
            acc[i] = _mm512_fmadd_round_ps(
                dot, _mm512_mul_round_ps(wd, _mm512_set1_ps(d[i * nb + b]), TM_RN), acc[i], TM_RN);
            acc[i] = _mm512_fmadd_round_ps(wm, _mm512_set1_ps(s[i * nb + b]), acc[i], TM_RN);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out + i * ROWS, acc[i]);
}

/* Q8 records: sum((w + 128) v) - 128 sum(v) = sum(w v); with two planes the first term
 * is 256 * sum((w + 128) qh) + sum((w + 128) ql), each < 32 * 255 * 128. */
static inline __attribute__((always_inline)) void q8_group(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const float *s, const int32_t *sum, int mr, int planes, int pf, float *out) {
    (void)s;
    __m512 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = wg + b * Q8_RECORD;
        if (pf)
            for (int l = 0; l < Q8_RECORD + 64; l += 64)
                _mm_prefetch((const char *)rec + PF_RECORDS * Q8_RECORD + l, PF_HINT);
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(rec + 64 * c));
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 512)));
        for (int i = 0; i < mr; i++) {
            const int8_t *xb = q + i * K + b * QK;
            /* one plane: the chain starts at - 128 sum(v) (no subtraction after it) */
            const __m512i neg = _mm512_set1_epi32(sum[i * nb + b]);
            __m512i dot = planes == 2 ? _mm512_setzero_si512() : neg;
            for (int c = 0; c < 8; c++) dot = dpbusd_bcast(dot, w[c], xb + 4 * c);
            if (planes == 2) {
                const int8_t *xl = xb + plane;
                __m512i t = neg;
                for (int c = 0; c < 8; c++) t = dpbusd_bcast(t, w[c], xl + 4 * c);
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), t);
            }
            acc[i] = _mm512_fmadd_round_ps(
                _mm512_cvtepi32_ps(dot),
                _mm512_mul_round_ps(wd, _mm512_set1_ps(d[i * nb + b]), TM_RN), acc[i], TM_RN);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(out + i * ROWS, acc[i]);
}
#elif TM_AVX2
/* out[i][r] <- row r's sum for activation row i: rows 0..8 in acc[i][0], 8..16 in acc[i][1] */
static inline __attribute__((always_inline)) void store_halves(__m256 acc[][2], int mr,
                                                               float *out) {
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(out + i * ROWS, acc[i][0]);
        _mm256_storeu_ps(out + i * ROWS + 8, acc[i][1]);
    }
}

/* AVX2 has 16 ymm registers where AVX-512 has 32 zmm: a version holding a group's 16
 * rows of weights for a block (16 registers of Q4 nibbles, 32 of Q8 nibble planes) beside
 * 2 accumulators a row spills to the stack from the first row. So the AVX2 groups run a
 * chunk of 4 inputs at a time. For 3 rows or more a pass, one half (8 output rows, a ymm
 * lane each) at a time over the blocks, at most 4 activation rows a pass (MR is 4 with
 * AVX2): one weight register, and each row's (and plane's) sum in its own register, so
 * the rows' chains of adds interleave. For 1-2 rows (q4_rows, q8_halves below), both halves
 * a chunk, so that the activations' broadcasts serve both (run twice, the halves lose
 * there: 1 row 4.9 -> 9.5 ms). Q8 weights multiply 16-bit words (vpmaddwd) instead of
 * bytes: they need no nibble planes. One step's linears (benchmarks/q4q8_step.py, Zen 3,
 * 2 threads): 16 rows 43.0 -> 36.5 ms (halves), -> 28.4 ms (chunk order, Q8 on words: the
 * LM head is a fifth of the multiply-adds and was a third of the time); against a block's
 * registers held at once, 960 x 576 in L2 on one thread, 1 row: Q4 1.17x, Q8 1.56x a
 * call; 2 rows: 1.18x, 1.81x. The integer sums are the same exact values in any order
 * (vpmaddubsw's int16 pair sums are within 2 * 15 * 128, and 8 of them are added in
 * int16: no saturation) and each row's fp32 steps are unchanged, so every version gives
 * the same bits. */

/* A Q5 / Q6 record's high bits of chunk c, half h (bytes 32h..32h+32 of the chunk; p =
 * the record's plane + 16 hb c), into that half's nibbles lo, hi: add_high512's layout */
static inline __attribute__((always_inline)) void add_high256(const uint8_t *p, int hb, int h,
                                                               __m256i *lo, __m256i *hi) {
    __m256i e;
    if (hb == 2) {
        e = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)p),
                                              _mm_cvtsi32_si128(4 * h)),
                             _mm256_set1_epi8(0x0f));
    } else { /* lanes 2h, 2h + 1 of the chunk: the plane's 16 bytes >> 4h, >> 4h + 2 */
        const __m256i by = _mm256_setr_epi32(4 * h, 4 * h, 4 * h, 4 * h, 4 * h + 2, 4 * h + 2,
                                             4 * h + 2, 4 * h + 2);
        e = _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(
                                 _mm_loadu_si128((const __m128i *)p)), by),
                             _mm256_set1_epi8(3));
    }
    const __m256i mask = _mm256_set1_epi8((char)((1 << hb) - 1));
    const __m256i eh = hb == 2 ? _mm256_srli_epi16(e, 2) : _mm256_srli_epi16(e, 1);
    *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(e, mask), 4));
    *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(eh, mask), 4));
}

/* Q4 (Q5, Q6 with hb 1, 2), rows 8h..8h+8, a chunk at a time: its 8 rows x 4 bytes
 * unpacked once (the low nibbles inputs 4c..4c+4, the high ones 16 + 4c..), then every
 * row's and plane's int16 sum in a register of its own; then the fp32 steps a row. With
 * high bits (hb) a pair of products reaches 2 * 63 * 128, so eight do not fit in int16:
 * the sums are int32 then, each vpmaddubsw's pairs added by a vpmaddwd. */
static inline __attribute__((always_inline)) void q4_half(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const float *s, int mr, int planes, int pf, int h, float *out, int hb,
    int k4) {
    __m256 acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int64_t rb = k4 ? Q4K_RECORD / Q4K_SUB : Q4_RECORD + HIGH_PLANE * hb;
    float kd[Q4K_SUB][ROWS] __attribute__((aligned(32))), km[Q4K_SUB][ROWS]
        __attribute__((aligned(32)));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = block_nibbles(wg, b, rb, k4);
        if (pf)
            for (int l = 0; l < rb; l += 64)
                _mm_prefetch((const char *)wg + (b + PF_RECORDS) * rb + l, PF_HINT);
        if (k4 && b % Q4K_SUB == 0) q4k_scales(rec + Q4K_META, kd, km);
        __m256i sum16[MR][2]; /* int32 sums with hb */
        for (int i = 0; i < mr; i++) sum16[i][0] = sum16[i][1] = _mm256_setzero_si256();
        const int8_t *xb = q + b * QK;
        for (int c = 0; c < 4; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * h));
            __m256i wn[2] = {_mm256_and_si256(w, low),
                             _mm256_and_si256(_mm256_srli_epi16(w, 4), low)};
            if (hb) add_high256(rec + Q4_RECORD + 16 * hb * c, hb, h, &wn[0], &wn[1]);
            for (int hi = 0; hi < 2; hi++) {
                const __m256i wc = wn[hi];
                const int cc = c + 4 * hi;
                for (int i = 0; i < mr; i++)
                    for (int p = 0; p < planes; p++) {
                        int32_t v;
                        memcpy(&v, xb + i * K + p * plane + 4 * cc, 4);
                        const __m256i pairs = _mm256_maddubs_epi16(wc, _mm256_set1_epi32(v));
                        sum16[i][p] = hb ? _mm256_add_epi32(sum16[i][p],
                                                            _mm256_madd_epi16(pairs, ones))
                                         : _mm256_add_epi16(sum16[i][p], pairs);
                    }
            }
        }
        const __m256 wd = k4 ? _mm256_load_ps(kd[b % Q4K_SUB] + 8 * h) : _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));
        const __m256 wm = k4 ? _mm256_load_ps(km[b % Q4K_SUB] + 8 * h) : _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
        for (int i = 0; i < mr; i++) {
            __m256i dot = hb ? sum16[i][0] : _mm256_madd_epi16(sum16[i][0], ones);
            if (planes == 2)
                dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8),
                                       hb ? sum16[i][1] : _mm256_madd_epi16(sum16[i][1], ones));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                     _mm256_mul_ps(wd, _mm256_set1_ps(d[i * nb + b])), acc[i]);
            acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(s[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(out + i * ROWS + 8 * h, acc[i]);
}

/* Q4, one or two activation rows (batch-1 and batch-2 decode): a chunk of both halves at
 * a time, its 4 nibble registers (the low nibbles inputs 4c..4c+4, the high ones 16 +
 * 4c..) and the chunk's activation broadcasts (one per row, plane and nibble) shared by
 * both halves, each row's, half's and plane's int16 sum in a register of its own (int32
 * with high bits, as in q4_half) */
static inline __attribute__((always_inline)) void q4_rows(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const float *s, int mr, int planes, int pf, float *out, int hb, int k4) {
    __m256 acc[2][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int64_t rb = k4 ? Q4K_RECORD / Q4K_SUB : Q4_RECORD + HIGH_PLANE * hb;
    float kd[Q4K_SUB][ROWS] __attribute__((aligned(32))), km[Q4K_SUB][ROWS]
        __attribute__((aligned(32)));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = block_nibbles(wg, b, rb, k4);
        if (pf)
            for (int l = 0; l < rb; l += 64)
                _mm_prefetch((const char *)wg + (b + PF_RECORDS) * rb + l, PF_HINT);
        if (k4 && b % Q4K_SUB == 0) q4k_scales(rec + Q4K_META, kd, km);
        __m256i sum16[2][2][2]; /* [row][half][plane] */
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2; h++) sum16[i][h][0] = sum16[i][h][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * h));
                lo[h] = _mm256_and_si256(w, low);
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                if (hb) add_high256(rec + Q4_RECORD + 16 * hb * c, hb, h, &lo[h], &hi[h]);
            }
            for (int i = 0; i < mr; i++)
                for (int p = 0; p < planes; p++) {
                    const int8_t *xb = q + i * K + p * plane + b * QK;
                    int32_t vl, vh;
                    memcpy(&vl, xb + 4 * c, 4);
                    memcpy(&vh, xb + 4 * (c + 4), 4);
                    const __m256i xl = _mm256_set1_epi32(vl), xh = _mm256_set1_epi32(vh);
                    for (int h = 0; h < 2; h++) {
                        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                               _mm256_maddubs_epi16(hi[h], xh));
                        sum16[i][h][p] = hb ? _mm256_add_epi32(sum16[i][h][p],
                                                               _mm256_madd_epi16(pairs, ones))
                                            : _mm256_add_epi16(sum16[i][h][p], pairs);
                    }
                }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 wd = k4 ? _mm256_load_ps(kd[b % Q4K_SUB] + 8 * h) : _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));
            const __m256 wm = k4 ? _mm256_load_ps(km[b % Q4K_SUB] + 8 * h) : _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
            for (int i = 0; i < mr; i++) {
                __m256i dot = hb ? sum16[i][h][0] : _mm256_madd_epi16(sum16[i][h][0], ones);
                if (planes == 2)
                    dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8),
                                           hb ? sum16[i][h][1]
                                              : _mm256_madd_epi16(sum16[i][h][1], ones));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                            _mm256_mul_ps(wd, _mm256_set1_ps(d[i * nb + b])),
                                            acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(wm, _mm256_set1_ps(s[i * nb + b]), acc[i][h]);
            }
        }
    }
    store_halves(acc, mr, out);
}

static inline __attribute__((always_inline)) void q4x_group(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const float *s, const int32_t *sum, int mr, int planes, int pf, float *out,
    int hb, int k4) {
    (void)sum;
    if (mr <= 2) {
        q4_rows(wg, nb, K, q, plane, d, s, mr, planes, pf, out, hb, k4);
        return;
    }
    q4_half(wg, nb, K, q, plane, d, s, mr, planes, pf, 0, out, hb, k4);
    q4_half(wg, nb, K, q, plane, d, s, mr, planes, 0, 1, out, hb, k4);
}

/* the byte shuffle that zero-extends bytes j0, j0 + 1 of each row's 4 (a dword) to that
 * row's pair of int16 (j0 0 or 2) */
static inline __m256i pair_shuffle(int j0) {
    return _mm256_setr_epi8(j0, -1, j0 + 1, -1, j0 + 4, -1, j0 + 5, -1, j0 + 8, -1, j0 + 9, -1,
                            j0 + 12, -1, j0 + 13, -1, j0, -1, j0 + 1, -1, j0 + 4, -1, j0 + 5, -1,
                            j0 + 8, -1, j0 + 9, -1, j0 + 12, -1, j0 + 13, -1);
}

/* block b of mr rows' 16-bit activations (256 qh + ql, or the int8 values with one
 * plane) as int16, into out[row] */
static inline __attribute__((always_inline)) void block_words(
    const int8_t *q, int64_t K, int64_t plane, int planes, int64_t b, int mr,
    int16_t (*out)[QK]) {
    for (int i = 0; i < mr; i++)
        for (int k = 0; k < QK; k += 16) {
            const int8_t *xh = q + i * K + b * QK + k;
            __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)xh));
            if (planes == 2)
                v = _mm256_add_epi16(_mm256_slli_epi16(v, 8), _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(xh + plane))));
            _mm256_store_si256((__m256i *)(out[i] + k), v);
        }
}

/* Q8, the halves h0..h0+nh (rows 8h..8h+8 each) a chunk at a time, on vpmaddwd: each
 * row's 16-bit activations (256 qh + ql, or the int8 values with one plane) rebuilt as
 * int16 once per block, the record's bytes u = q + 128 widened to int16 pairs by a byte
 * shuffle, and int32 sums of u v taken 16 products a vpmaddwd (|u v| pair sums <= 2 * 255
 * * 32767, a block's sum <= 32 * 255 * 32767: no overflow), then - 128 sum(v) as in the
 * VNNI version: a quarter of the integer multiplies of vpmaddubsw, which needs u split
 * into nibbles and v into bytes. One or two rows take both halves in one pass (each
 * row's pair broadcasts shared by them); 3-4 rows one half a pass (register room). */
static inline __attribute__((always_inline)) void q8_halves(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const int32_t *sum, int mr, int planes, int pf, int h0, int nh,
    float *out) {
    __m256 acc[MR][2];
    for (int i = 0; i < mr; i++)
        for (int h = h0; h < h0 + nh; h++) acc[i][h] = _mm256_setzero_ps();
    const __m256i pair01 = pair_shuffle(0), pair23 = pair_shuffle(2);
    /* a block's int16 rows are built one block ahead (a broadcast from a store still in
     * flight waits for it) */
    int16_t v16[2][MR][QK] __attribute__((aligned(32)));
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) block_words(q, K, plane, planes, b, mr, v16[b & 1]);
        if (b == 0) continue;
        const int64_t bb = b - 1; /* the block multiplied now */
        const uint8_t *rec = wg + bb * Q8_RECORD;
        if (pf)
            for (int l = 0; l < Q8_RECORD + 64; l += 64)
                _mm_prefetch((const char *)rec + PF_RECORDS * Q8_RECORD + l, PF_HINT);
        const int16_t(*vb)[QK] = v16[bb & 1];
        __m256i dot[MR][2];
        for (int i = 0; i < mr; i++)
            for (int h = h0; h < h0 + nh; h++) dot[i][h] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            __m256i e01[2], e23[2];
            for (int h = h0; h < h0 + nh; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * h));
                e01[h] = _mm256_shuffle_epi8(w, pair01);
                e23[h] = _mm256_shuffle_epi8(w, pair23);
            }
            for (int i = 0; i < mr; i++) {
                int32_t p01, p23;
                memcpy(&p01, vb[i] + 4 * c, 4);
                memcpy(&p23, vb[i] + 4 * c + 2, 4);
                const __m256i x01 = _mm256_set1_epi32(p01), x23 = _mm256_set1_epi32(p23);
                for (int h = h0; h < h0 + nh; h++)
                    dot[i][h] = _mm256_add_epi32(
                        dot[i][h], _mm256_add_epi32(_mm256_madd_epi16(e01[h], x01),
                                                    _mm256_madd_epi16(e23[h], x23)));
            }
        }
        for (int h = h0; h < h0 + nh; h++) {
            const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 512 + 16 * h)));
            for (int i = 0; i < mr; i++) {
                const __m256i dt = _mm256_add_epi32(dot[i][h],
                                                    _mm256_set1_epi32(sum[i * nb + bb]));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dt),
                                            _mm256_mul_ps(wd, _mm256_set1_ps(d[i * nb + bb])),
                                            acc[i][h]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int h = h0; h < h0 + nh; h++) _mm256_storeu_ps(out + i * ROWS + 8 * h, acc[i][h]);
}

static inline __attribute__((always_inline)) void q8_group(
    const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,
    const float *d, const float *s, const int32_t *sum, int mr, int planes, int pf, float *out) {
    (void)s;
    if (mr <= 2) {
        q8_halves(wg, nb, K, q, plane, d, sum, mr, planes, pf, 0, 2, out);
        return;
    }
    q8_halves(wg, nb, K, q, plane, d, sum, mr, planes, pf, 0, 1, out);
    q8_halves(wg, nb, K, q, plane, d, sum, mr, planes, 0, 1, 1, out);
}
#else
static inline int32_t act_value(const int8_t *xb, int64_t plane, int planes, int k) {
    return planes == 2 ? 256 * xb[k] + xb[plane + k] : xb[k];
}

/* the high bits of byte i (0..63) of chunk c of a Q5 / Q6 record (add_high512's layout):
 * its low nibble's | its high nibble's << hb */
static inline int high_of(const uint8_t *rec, int hb, int c, int i) {
    const int per = 16 * hb; /* plane bytes a chunk */
    return (rec[Q4_RECORD + per * c + i % per] >> (2 * hb * (i / per))) & ((1 << 2 * hb) - 1);
}

static inline void q4x_group(const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q,
                             int64_t plane, const float *d, const float *s, const int32_t *sum,
                             int mr, int planes, int pf, float *out, int hb, int k4) {
    (void)pf;
    (void)sum;
    float kd[Q4K_SUB][ROWS], km[Q4K_SUB][ROWS];
    for (int i = 0; i < mr; i++) {
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *rec = block_nibbles(wg, b, Q4_RECORD + HIGH_PLANE * hb, k4);
                if (k4 && b % Q4K_SUB == 0) q4k_scales(rec + Q4K_META, kd, km);
                const int8_t *xb = q + i * K + b * QK;
                int32_t dot = 0;
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = rec[64 * c + 4 * r + j];
                        const int e = hb ? high_of(rec, hb, c, 4 * r + j) : 0;
                        const int lo = (byte & 15) | (e & ((1 << hb) - 1)) << 4,
                                  hi = (byte >> 4) | (e >> hb) << 4;
                        dot += lo * act_value(xb, plane, planes, 4 * c + j)
                             + hi * act_value(xb, plane, planes, 16 + 4 * c + j);
                    }
                uint16_t hd, hm;
                memcpy(&hd, rec + 256 + 2 * r, 2);
                memcpy(&hm, rec + 288 + 2 * r, 2);
                const float wd = k4 ? kd[b % Q4K_SUB][r] : half_to_f32(hd),
                            wm = k4 ? km[b % Q4K_SUB][r] : half_to_f32(hm);
                acc = fmaf((float)dot, wd * d[i * nb + b], acc);
                acc = fmaf(wm, s[i * nb + b], acc);
            }
            out[i * ROWS + r] = acc;
        }
    }
}

static inline void q8_group(const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q,
                            int64_t plane, const float *d, const float *s, const int32_t *sum,
                            int mr, int planes, int pf, float *out) {
    (void)pf;
    (void)s;
    for (int i = 0; i < mr; i++) {
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *rec = wg + b * Q8_RECORD;
                const int8_t *xb = q + i * K + b * QK;
                int32_t dot = sum[i * nb + b];
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 4; j++)
                        dot += rec[64 * c + 4 * r + j] * act_value(xb, plane, planes, 4 * c + j);
                uint16_t hd;
                memcpy(&hd, rec + 512 + 2 * r, 2);
                acc = fmaf((float)dot, half_to_f32(hd) * d[i * nb + b], acc);
            }
            out[i * ROWS + r] = acc;
        }
    }
}
#endif

/* Q4 records and those with a plane of 1 or 2 high bits (Q5, Q6) */
#define TM_Q4_FAMILY(name, hb, k4)                                                          \
    static inline __attribute__((always_inline)) void name(                                \
        const uint8_t *wg, int64_t nb, int64_t K, const int8_t *q, int64_t plane,           \
        const float *d, const float *s, const int32_t *sum, int mr, int planes, int pf,     \
        float *out) {                                                                       \
        q4x_group(wg, nb, K, q, plane, d, s, sum, mr, planes, pf, out, hb, k4);             \
    }
TM_Q4_FAMILY(q4_group, 0, 0)
TM_Q4_FAMILY(q5_group, 1, 0)
TM_Q4_FAMILY(q6_group, 2, 0)
TM_Q4_FAMILY(q4k_group, 0, 1)

#define TM_GROUP(fn, mr, planes) \
    fn(wg, nb, K, qm, plane, dm, sm, summ, mr, planes, m0 == 0, out)
#define TM_ROWS(fn, planes)                                          \
    switch (mr) {                                                    \
    case 1: TM_GROUP(fn, 1, planes); break;                          \
    case 2: TM_GROUP(fn, 2, planes); break;                          \
    case 3: TM_GROUP(fn, 3, planes); break;                          \
    case 4: TM_GROUP(fn, 4, planes); break;                          \
    case 5: if (MR > 4) TM_GROUP(fn, 5, planes); break;              \
    case 6: if (MR > 4) TM_GROUP(fn, 6, planes); break;              \
    case 7: if (MR > 4) TM_GROUP(fn, 7, planes); break;              \
    case 8: if (MR > 4) TM_GROUP(fn, 8, planes); break;              \
    default: if (MR > 8) TM_GROUP(fn, 16, planes); break;            \
    }

/* out[i][r] (mr rows x 16, fp32) -> rows m0.. of y's group g (its rows below N): bf16
 * (rounded to nearest even), or fp32 when y_f32 */
static inline void store_rows(const float *out, int64_t mr, int64_t m0, int64_t g, int64_t N,
                              void *y, int64_t y_f32) {
    const int64_t rows = N - g * ROWS < ROWS ? N - g * ROWS : ROWS;
    for (int64_t i = 0; i < mr; i++) {
        const int64_t at = (m0 + i) * N + g * ROWS;
        if (y_f32) {
            memcpy((float *)y + at, out + i * ROWS, (size_t)rows * sizeof(float));
        } else {
            uint16_t *yr = (uint16_t *)y + at;
            for (int64_t r = 0; r < rows; r++) yr[r] = f32_to_bf16(out[i * ROWS + r]);
        }
    }
}

/* Group g (16 output rows) of y (M, N) from the quantized activations q, d, s, sum
 * (tm_q8_quantize_bf16's layout for M rows of K): bf16 (rounded to nearest even), or
 * fp32 when y_f32. tm_q4q8_linear hands the groups to the threads as they come free;
 * decode_step.c runs them inside its own parallel region. */
static inline void linear_group(const uint8_t *w, int64_t g, int64_t M, int64_t K, int64_t N,
                                int64_t format, int64_t bits, const int8_t *q, const float *d,
                                const float *s, const int32_t *sum, void *y, int64_t y_f32) {
    const int64_t nb = K / QK, plane = M * K;
    const uint8_t *wg = group_records(w, format, g, nb, &format);
    for (int64_t m0 = 0, mr; m0 < M; m0 += mr) {
        /* a pass of MR rows, or of at most 8 (passes of 9-15 rows would each be a
         * build of the unrolled loops of their own) */
        mr = M - m0 >= MR ? MR : M - m0 < 8 ? M - m0 : 8;
        const int8_t *qm = q + m0 * K;
        const float *dm = d + m0 * nb, *sm = s + m0 * nb;
        const int32_t *summ = sum + m0 * nb;
        float out[MR * ROWS];
        if (format == FMT_Q8) {
            if (bits == 16) { TM_ROWS(q8_group, 2) } else { TM_ROWS(q8_group, 1) }
        } else if (format == FMT_Q5) {
            if (bits == 16) { TM_ROWS(q5_group, 2) } else { TM_ROWS(q5_group, 1) }
        } else if (format == FMT_Q6) {
            if (bits == 16) { TM_ROWS(q6_group, 2) } else { TM_ROWS(q6_group, 1) }
        } else if (format == FMT_Q4K) {
            if (bits == 16) { TM_ROWS(q4k_group, 2) } else { TM_ROWS(q4k_group, 1) }
        } else {
            if (bits == 16) { TM_ROWS(q4_group, 2) } else { TM_ROWS(q4_group, 1) }
        }
        store_rows(out, mr, m0, g, N, y, y_f32);
    }
}

/* the items (groups, activation blocks) a thread takes at a time when they are shared
 * dynamically: about 8 takes a thread, so that the atomic counter costs nothing beside
 * the work and the last take leaves little to wait for */
static inline int64_t group_chunk(int64_t items, int64_t nth) {
    const int64_t c = items / (8 * nth);
    return c > 1 ? c : 1;
}

/* y (M, N) = x (M, K) bf16 times the repacked weight (N rows, K inputs; `format` Q4 or
 * Q8), quantizing x as tm_q8_quantize_bf16 does with `bits` 8 or 16. y is bf16 (rounded
 * to nearest even), or fp32 when y_f32. Groups of 16 rows are split across OpenMP
 * threads in runs (runs.h). Returns 0, or -1 when K is not a multiple of 32, bits is
 * neither 8 nor 16, or the scratch cannot be allocated. */
int64_t tm_q4q8_linear(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       int64_t format, int64_t bits, void *y, int64_t y_f32,
                       int64_t num_threads) {
    if (K % QK || M < 0 || N < 0 || (bits != 8 && bits != 16)) return -1;
    const int64_t nb = K / QK, groups = (N + ROWS - 1) / ROWS;
    const size_t qbytes = ((size_t)(2 * M * K) + 63) & ~(size_t)63;
    const size_t bytes = (qbytes + (size_t)(M * nb) * 12 + 63) & ~(size_t)63;
    char *scratch = aligned_alloc(64, bytes ? bytes : 64);
    if (!scratch) return -1;
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(scratch + qbytes), *s = d + M * nb;
    int32_t *sum = (int32_t *)(s + M * nb);
    const int parallel = groups >= PARALLEL_GROUPS && num_threads > 1;
    const int64_t team = parallel ? num_threads : 1;
    uint64_t *runs = runs_new(team);
    if (!runs) {
        free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(team) if (parallel)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp for schedule(dynamic, group_chunk(M * nb, nth))
        for (int64_t i = 0; i < M * nb; i++)
            quantize_block(x, M, K, bits, q, d, s, sum, i / nb, i % nb);
        own_run(runs, groups, tid, nth);
        int from = 0;
        for (int64_t g; (g = next_group(runs, tid, nth, &from)) >= 0;)
            linear_group(w, g, M, K, N, format, bits, q, d, s, sum, y, y_f32);
    }
    free(runs);
    free(scratch);
    return 0;
}

/* The MLP's down projection on its gate_up (M, 2K) = [gate | up] bf16: the input
 * bf16(silu(gate)) * up rounded to bf16, as tm_silu_mul_bf16 (layer_ops.c) computes it,
 * then tm_q4q8_linear, in one call. */
int64_t tm_q4q8_silu_linear(const uint16_t *gate_up, int64_t M, int64_t K, const uint8_t *w,
                            int64_t N, int64_t format, int64_t bits, void *y, int64_t y_f32,
                            int64_t num_threads) {
    uint16_t *act = malloc((size_t)(M * K) * sizeof(uint16_t) + 2);
    if (!act) return -1;
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *g = gate_up + r * 2 * K;
        silu_mul_row(g, g + K, act + r * K, K);
    }
    const int64_t rc = tm_q4q8_linear(act, M, K, w, N, format, bits, y, y_f32, num_threads);
    free(act);
    return rc;
}

/* ---- Many rows at once on AVX2 (prefill, large decode batches), 16-bit activations ----
 *
 * The per-row kernel above rebuilds each weight block from its record for every pass of
 * MR rows (nibbles unpacked, or bytes widened by a shuffle) and multiplies int8 planes.
 * With many rows the weights are worth widening once per call: a few groups at a time,
 * each thread widens the records' integers into int16 pairs, per (group, block) 16 pairs
 * x 16 rows x 2 values (1,024 bytes, L2-resident: pair p of row r at [p][r]), and every
 * tile of its rows reads them there, so that one vpmaddwd multiplies a pair of inputs for
 * 8 rows by a row's broadcast pair of int16 activations (v = 256 qh + ql) and sums them
 * in int32: 16 multiply-adds an instruction, twice the fp32 FMA's 8. (Widened once at
 * load instead, the weights read from memory triple: slower at decode batches.)
 * A block's integer sum is exactly sum(q v) (Q4: q in 0..15; Q8: q = byte - 128, the
 * same value as sum((q + 128) v) - 128 sum(v)), and the fp32 steps are the per-row
 * kernel's, in the same order: the same bits as tm_q4q8_linear with 16-bit activations.
 * Builds without AVX2 (or with AVX512-VNNI) run tm_q4q8_linear itself. */
#define PANEL_BLOCK_VALUES (QK * ROWS)   /* int16 values per (group, block) */
#ifndef GEMM_MT
#define GEMM_MT 6                        /* activation rows a tile */
#endif
#ifndef GEMM_GROUPS
#define GEMM_GROUPS 4                    /* groups a pass over the rows */
#endif

#if TM_AVX2
/* a group's nb blocks of records wg, widened into out (PANEL_BLOCK_VALUES a block): the
 * bytes of a row's 4 inputs in a chunk become int16 pairs by a byte shuffle */
static inline void widen_group(const uint8_t *wg, int64_t format, int64_t nb, int16_t *out) {
    const __m256i pair01 = pair_shuffle(0), pair23 = pair_shuffle(2);
    const __m256i low = _mm256_set1_epi8(0x0f), c128 = _mm256_set1_epi16(128);
    for (int64_t b = 0; b < nb; b++) {
        int16_t *o = out + b * PANEL_BLOCK_VALUES;
        if (format == FMT_Q8) { /* chunk c: inputs 4c..4c+4, bytes q + 128 */
            const uint8_t *rec = wg + b * Q8_RECORD;
            for (int c = 0; c < 8; c++)
                for (int h = 0; h < 2; h++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * h));
                    _mm256_store_si256((__m256i *)(o + (2 * c) * 2 * ROWS + ROWS * h),
                                       _mm256_sub_epi16(_mm256_shuffle_epi8(w, pair01), c128));
                    _mm256_store_si256((__m256i *)(o + (2 * c + 1) * 2 * ROWS + ROWS * h),
                                       _mm256_sub_epi16(_mm256_shuffle_epi8(w, pair23), c128));
                }
        } else { /* chunk c: low nibbles inputs 4c..4c+4, high ones 16 + 4c.. (Q5, Q6: and
                  * their high bits) */
            const int hb = high_bits(format);
            const uint8_t *rec = block_nibbles(wg, b, record_bytes(format), format == FMT_Q4K);
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * h));
                    __m256i lo = _mm256_and_si256(w, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    if (hb == 1) add_high256(rec + Q4_RECORD + 16 * c, 1, h, &lo, &hi);
                    if (hb == 2) add_high256(rec + Q4_RECORD + 32 * c, 2, h, &lo, &hi);
                    _mm256_store_si256((__m256i *)(o + (2 * c) * 2 * ROWS + ROWS * h),
                                       _mm256_shuffle_epi8(lo, pair01));
                    _mm256_store_si256((__m256i *)(o + (2 * c + 1) * 2 * ROWS + ROWS * h),
                                       _mm256_shuffle_epi8(lo, pair23));
                    _mm256_store_si256((__m256i *)(o + (8 + 2 * c) * 2 * ROWS + ROWS * h),
                                       _mm256_shuffle_epi8(hi, pair01));
                    _mm256_store_si256((__m256i *)(o + (9 + 2 * c) * 2 * ROWS + ROWS * h),
                                       _mm256_shuffle_epi8(hi, pair23));
                }
        }
    }
}

/* quantize_block's 16-bit values of one block, as int16 (not planes), in AVX2: the same
 * fp32 steps (an exact division each, the product by the reciprocal, round to nearest
 * even, the clamp), so the same values, d and s */
static inline void quantize_block16(const uint16_t *xb, int16_t *v, float *d, float *s) {
    __m256 f[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        f[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + 8 * i))), 16));
        amax = _mm256_max_ps(amax, _mm256_and_ps(f[i], nosign));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    /* _mm_div_ss: a division gcc keeps as written under -ffast-math (a plain one by the
     * constant 32512 it may turn into a product by an inexact reciprocal) */
    const float dd = _mm_cvtss_f32(_mm_div_ss(m4, _mm_set_ss(32512.0f)));
    const float id = dd > 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), _mm_set_ss(dd)))
                               : 0.0f;
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(32512.0f),
                 lo = _mm256_set1_ps(-32512.0f);
    __m256i tot = _mm256_setzero_si256(), iv[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(f[i], vid),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        iv[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, hi), lo));
        tot = _mm256_add_epi32(tot, iv[i]);
    }
    /* packs works within 128-bit lanes: the 64-bit quarters back in order */
    for (int i = 0; i < 2; i++)
        _mm256_storeu_si256((__m256i *)(v + 16 * i), _mm256_permute4x64_epi64(
            _mm256_packs_epi32(iv[2 * i], iv[2 * i + 1]), 0xd8));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    const int32_t total = _mm_cvtsi128_si32(t4);
    *d = dd;
    *s = _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(dd), _mm_set_ss((float)total)));
}

/* acc + dot wd dx: a block's step of the per-row kernel (q4_half, q8_halves) */
static inline __m256 scaled_dot(__m256 acc, __m256i dot, __m256 wd, __m256 dx) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(wd, dx), acc);
}

/* rows m..m+mt of y's group (16 outputs) into out[mt][16]: v (mt rows of K int16, row
 * stride K), d and s of those rows (stride nb) */
static inline __attribute__((always_inline)) void gemm16_tile(
    const int16_t *pg, const uint8_t *wg, int64_t nb, int64_t K, int64_t format,
    const int16_t *v, const float *d, const float *s, int mt, float *out) {
    const int64_t record = record_bytes(format);
    float kd[Q4K_SUB][ROWS] __attribute__((aligned(32))), km[Q4K_SUB][ROWS]
        __attribute__((aligned(32)));
    __m256 acc[GEMM_MT][2];
    for (int t = 0; t < mt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int16_t *pb = pg + b * PANEL_BLOCK_VALUES;
        __m256i dot[GEMM_MT][2];
        for (int t = 0; t < mt; t++) dot[t][0] = dot[t][1] = _mm256_setzero_si256();
        for (int p = 0; p < QK / 2; p++) {
            __m256i w0 = _mm256_load_si256((const __m256i *)(pb + p * 2 * ROWS));
            __m256i w1 = _mm256_load_si256((const __m256i *)(pb + p * 2 * ROWS + ROWS));
            /* in registers: gcc folds them into every vpmaddwd, a load each */
            __asm__("" : "+x"(w0), "+x"(w1));
            for (int t = 0; t < mt; t++) {
                float pair; /* a float broadcast: a load, no shuffle (the same 32 bits) */
                memcpy(&pair, v + t * K + b * QK + 2 * p, 4);
                const __m256i x = _mm256_castps_si256(_mm256_set1_ps(pair));
                dot[t][0] = _mm256_add_epi32(_mm256_madd_epi16(w0, x), dot[t][0]);
                dot[t][1] = _mm256_add_epi32(_mm256_madd_epi16(w1, x), dot[t][1]);
                __asm__("" : "+x"(dot[t][0]), "+x"(dot[t][1]));
            }
        }
        const uint8_t *rec = block_nibbles(wg, b, record, format == FMT_Q4K);
        const int64_t doff = format == FMT_Q8 ? 512 : 256;
        __m256 wd0, wd1, wm0, wm1;
        if (format == FMT_Q4K) {
            if (b % Q4K_SUB == 0) q4k_scales(rec + Q4K_META, kd, km);
            wd0 = _mm256_load_ps(kd[b % Q4K_SUB]), wd1 = _mm256_load_ps(kd[b % Q4K_SUB] + 8);
            wm0 = _mm256_load_ps(km[b % Q4K_SUB]), wm1 = _mm256_load_ps(km[b % Q4K_SUB] + 8);
        } else {
            wd0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + doff)));
            wd1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + doff + 16)));
            wm0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288)));
            wm1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 304)));
        }
        if (format == FMT_Q8) {
            for (int t = 0; t < mt; t++) {
                const __m256 dx = _mm256_set1_ps(d[t * nb + b]);
                acc[t][0] = scaled_dot(acc[t][0], dot[t][0], wd0, dx);
                acc[t][1] = scaled_dot(acc[t][1], dot[t][1], wd1, dx);
            }
        } else {
            for (int t = 0; t < mt; t++) {
                const __m256 dx = _mm256_set1_ps(d[t * nb + b]), sx = _mm256_set1_ps(s[t * nb + b]);
                acc[t][0] = _mm256_fmadd_ps(wm0, sx, scaled_dot(acc[t][0], dot[t][0], wd0, dx));
                acc[t][1] = _mm256_fmadd_ps(wm1, sx, scaled_dot(acc[t][1], dot[t][1], wd1, dx));
            }
        }
    }
    store_halves(acc, mt, out);
}
/* a thread's share of y (M, N) = the activations v, d, s (quantize16_rows' layout for M
 * rows of K) times w's records and their widened integers. Every thread of the team
 * calls it (an orphaned worksharing loop, no barrier at its end): the threads take work
 * items as they come free, so that a vCPU that runs slower (a busy host) takes fewer
 * instead of holding the other at the next barrier. */
static inline int gemm16_share(const uint8_t *w, int64_t format, int64_t K, int64_t N,
                               int64_t M, const int16_t *v, const float *d, const float *s,
                               void *y, int64_t y_f32, int nth) {
    const int64_t nb = K / QK, groups = (N + ROWS - 1) / ROWS;
    const int64_t tiles = (M + GEMM_MT - 1) / GEMM_MT;
    /* with 2+ tiles a thread, an item is (a few groups, a run of tiles), group-major:
     * the tiles' activations stay in L1 across the few groups, their widened panels in
     * L2, and a thread that takes the next run of the same groups widens them once.
     * Else an item is a group. Each output is the same tile's, whoever computes it:
     * the same bits. */
    const int64_t rows_split = tiles >= 2 * nth;
    const int64_t gsize = rows_split ? GEMM_GROUPS : 1;
    const int64_t gblocks = (groups + gsize - 1) / gsize;
    const int64_t runs = rows_split ? 2 * nth : 1;  /* runs of tiles a group block */
    const int64_t run_tiles = (tiles + runs - 1) / runs;
    const int64_t items = gblocks * runs;
    /* the widened groups: a buffer per thread, kept from call to call */
    static __thread int16_t *panel = NULL;
    static __thread size_t panel_bytes = 0;
    const size_t need = (size_t)(gsize * nb * PANEL_BLOCK_VALUES) * sizeof(int16_t);
    int failed = 0;
    if (need > panel_bytes) {
        int16_t *fresh = aligned_alloc(64, need);
        if (fresh) {
            free(panel);
            panel = fresh;
            panel_bytes = need;
        } else {
            failed = 1; /* still through the loop below, which every thread must meet */
        }
    }
    int64_t widened = -1; /* the group block in this thread's panel */
    const int64_t chunk = rows_split ? 1 : group_chunk(items, nth);
#pragma omp for schedule(dynamic, chunk) nowait
    for (int64_t item = 0; item < items; item++) {
        if (failed) continue;
        const int64_t gb = item / runs, t0 = item % runs * run_tiles;
        const int64_t t1 = t0 + run_tiles < tiles ? t0 + run_tiles : tiles;
        if (t0 >= t1) continue;
        const int64_t g0 = gb * gsize, g1 = g0 + gsize < groups ? g0 + gsize : groups;
        if (gb != widened) {
            for (int64_t g = g0; g < g1; g++) {
                int64_t f;
                const uint8_t *wg = group_records(w, format, g, nb, &f);
                widen_group(wg, f, nb, panel + (g - g0) * nb * PANEL_BLOCK_VALUES);
            }
            widened = gb;
        }
        for (int64_t tile = t0; tile < t1; tile++) {
            const int64_t m0 = tile * GEMM_MT, mt = M - m0 < GEMM_MT ? M - m0 : GEMM_MT;
            const int16_t *vm = v + m0 * K;
            const float *dm = d + m0 * nb, *sm = s + m0 * nb;
            for (int64_t g = g0; g < g1; g++) {
                const int16_t *pg = panel + (g - g0) * nb * PANEL_BLOCK_VALUES;
                int64_t f;
                const uint8_t *wg = group_records(w, format, g, nb, &f);
                float out[GEMM_MT * ROWS];
                switch (mt) {
#define TM_TILE(n) gemm16_tile(pg, wg, nb, K, f, vm, dm, sm, n, out)
                case 1: TM_TILE(1); break;
                case 2: if (GEMM_MT > 2) TM_TILE(2); break;
                case 3: if (GEMM_MT > 3) TM_TILE(3); break;
                case 4: if (GEMM_MT > 4) TM_TILE(4); break;
                case 5: if (GEMM_MT > 5) TM_TILE(5); break;
                default: TM_TILE(GEMM_MT); break;
#undef TM_TILE
                }
                store_rows(out, mt, m0, g, N, y, y_f32);
            }
        }
    }
    return failed ? -1 : 0;
}

/* rows r0..r1 of x (rows of K) quantized as quantize_block16 does, into v, d, s */
static inline void quantize16_rows(const uint16_t *x, int64_t K, int64_t r0, int64_t r1,
                                   int16_t *v, float *d, float *s) {
    const int64_t nb = K / QK;
    for (int64_t i = r0 * nb; i < r1 * nb; i++)
        quantize_block16(x + i * QK, v + i * QK, d + i, s + i);
}
#else
/* never called without AVX2 (the callers run the per-row kernel instead) */
static inline int gemm16_share(const uint8_t *w, int64_t format, int64_t K, int64_t N,
                               int64_t M, const int16_t *v, const float *d, const float *s,
                               void *y, int64_t y_f32, int nth) {
    (void)w, (void)format, (void)K, (void)N, (void)M, (void)v, (void)d, (void)s, (void)y;
    (void)y_f32, (void)nth;
    return -1;
}
static inline void quantize16_rows(const uint16_t *x, int64_t K, int64_t r0, int64_t r1,
                                   int16_t *v, float *d, float *s) {
    (void)x, (void)K, (void)r0, (void)r1, (void)v, (void)d, (void)s;
}
#endif

/* y (M, N) = x (M, K) bf16 times w (records) with 16-bit activations, many rows at once:
 * tm_q4q8_linear's result, bit for bit. Returns as tm_q4q8_linear does. */
int64_t tm_q4q8_gemm16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                       int64_t format, void *y, int64_t y_f32, int64_t num_threads) {
#if !TM_AVX2
    return tm_q4q8_linear(x, M, K, w, N, format, 16, y, y_f32, num_threads);
#else
    if (K % QK || M < 0 || N < 0) return -1;
    const int64_t nb = K / QK;
    const size_t vbytes = ((size_t)(2 * M * K) + 63) & ~(size_t)63;
    const size_t bytes = (vbytes + (size_t)(M * nb) * 8 + 63) & ~(size_t)63;
    char *scratch = aligned_alloc(64, bytes ? bytes : 64);
    if (!scratch) return -1;
    int16_t *v = (int16_t *)scratch; /* the activations, (M, K) */
    float *d = (float *)(scratch + vbytes), *s = d + M * nb;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
#pragma omp for schedule(dynamic, group_chunk(M * nb, omp_get_num_threads()))
        for (int64_t i = 0; i < M * nb; i++)
            quantize_block16(x + i * QK, v + i * QK, d + i, s + i);
        failed |= gemm16_share(w, format, K, N, M, v, d, s, y, y_f32,
                               omp_get_num_threads()) != 0;
    }
    free(scratch);
    return failed ? -1 : 0;
#endif
}
