/* ops/quant_act: quantization of f32 activations into the Q8_0-style and Q8_K
 * rows that the integer matmul kernels consume (scalar and AVX2, bit-identical). */
#include <math.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/type_traits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OP_X86 1
#endif

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t op_q8a_row_size(int n_in) {
    size_t nb = (size_t)n_in / 32;
    return round64((size_t)n_in + nb * 12 + 32);
}

size_t op_q8k_row_size(int n_in) { return round64((size_t)(n_in / QK_K) * sizeof(block_q8_K)); }

/* Shared by both quantizers so they agree bit for bit: d = amax/127 and the
 * quant is round-to-nearest-even of x * (127/amax). */
static inline float scale_of(float amax) { return amax / 127.0f; }
static inline float inv_scale_of(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }

void op_quantize_q8a_scalar(const float *x, void *row, int n_in) {
    int nb = n_in / 32;
    int8_t *qs = (int8_t *)row;
    int32_t *xc = (int32_t *)((uint8_t *)row + n_in);
    float *d = (float *)op_q8a_d(row, n_in), *dc = d + nb;
    memset(dc + nb, 0, 32);
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float id = inv_scale_of(amax);
        d[b] = scale_of(amax);
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            qs[b * 32 + i] = (int8_t)nearbyintf(xb[i] * id);
            sum += qs[b * 32 + i];
        }
        dc[b] = d[b] * (float)(-8 * sum);
        xc[b] = -128 * sum;
    }
}

void op_quantize_q8k_scalar(const float *x, void *row, int n_in) {
    block_q8_K *y = row;
    for (int b = 0; b < n_in / QK_K; b++) {
        const float *xb = x + b * QK_K;
        float amax = 0.0f;
        for (int i = 0; i < QK_K; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float id = inv_scale_of(amax);
        y[b].d = scale_of(amax);
        for (int i = 0; i < QK_K; i++) y[b].qs[i] = (int8_t)nearbyintf(xb[i] * id);
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += y[b].qs[j * 16 + i];
            y[b].bsums[j] = (int16_t)s;
        }
    }
}

#ifdef OP_X86
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* 32 floats -> 32 int8 (round to nearest even, as nearbyintf in the default
 * rounding mode), in element order. */
static inline __m256i quant32(const float *x, float id) {
    __m256 vid = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), vid));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), vid));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), vid));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), vid));
    /* packs work within 128-bit lanes; the final permute restores order */
    __m256i s01 = _mm256_packs_epi32(i0, i1), s23 = _mm256_packs_epi32(i2, i3);
    __m256i b = _mm256_packs_epi16(s01, s23);
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline float amax_n(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    return hmax8(m);
}

void op_quantize_q8a_avx2(const float *x, void *row, int n_in) {
    int nb = n_in / 32;
    int8_t *qs = (int8_t *)row;
    int32_t *xc = (int32_t *)((uint8_t *)row + n_in);
    float *d = (float *)op_q8a_d(row, n_in), *dc = d + nb;
    memset(dc + nb, 0, 32);
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        float amax = amax_n(x + b * 32, 32);
        d[b] = scale_of(amax);
        __m256i q = quant32(x + b * 32, inv_scale_of(amax));
        _mm256_storeu_si256((__m256i *)(qs + b * 32), q);
        /* sum of the 32 quants: u8 ones x s8 q, then pairs, then across */
        __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        dc[b] = d[b] * (float)(-8 * _mm_cvtsi128_si32(s));
        xc[b] = -128 * _mm_cvtsi128_si32(s);
    }
}

void op_quantize_q8k_avx2(const float *x, void *row, int n_in) {
    block_q8_K *y = row;
    const __m256i ones8 = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int b = 0; b < n_in / QK_K; b++) {
        const float *xb = x + b * QK_K;
        float amax = amax_n(xb, QK_K);
        float id = inv_scale_of(amax);
        y[b].d = scale_of(amax);
        for (int j = 0; j < QK_K / 32; j++) {
            __m256i q = quant32(xb + j * 32, id);
            _mm256_storeu_si256((__m256i *)(y[b].qs + j * 32), q);
            /* 16-element sums: pair sums, then add the two 8-lane halves of
             * each 128-bit lane via madd + hadd */
            __m256i s2 = _mm256_maddubs_epi16(ones8, q);           /* 16 x i16, pairs */
            __m256i s4 = _mm256_madd_epi16(s2, ones16);             /* 8 x i32, quads */
            __m128i lo = _mm256_castsi256_si128(s4), hi = _mm256_extracti128_si256(s4, 1);
            __m128i h = _mm_hadd_epi32(lo, hi);                     /* 8-sums: a0 a1 b0 b1 */
            h = _mm_hadd_epi32(h, h);                               /* 16-sums: a b a b */
            y[b].bsums[2 * j] = (int16_t)_mm_cvtsi128_si32(h);
            y[b].bsums[2 * j + 1] = (int16_t)_mm_extract_epi32(h, 1);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

/* the quantizer the matmul uses at the current level (type_traits.c) */
void op_quantize_q8a(const float *x, void *row, int n_in) { op_act_quantizer(OP_ACT_Q8A, op_simd_level())(x, row, n_in); }

void op_quantize_q8k(const float *x, void *row, int n_in) { op_act_quantizer(OP_ACT_Q8K, op_simd_level())(x, row, n_in); }

void op_dequantize_q8a(const void *row, float *x, int n_in) {
    const int8_t *qs = op_q8a_qs(row);
    const float *d = op_q8a_d(row, n_in);
    for (int i = 0; i < n_in; i++) x[i] = d[i / 32] * (float)qs[i];
}

void op_dequantize_q8k(const void *row, float *x, int n_in) {
    const block_q8_K *y = row;
    for (int i = 0; i < n_in; i++) x[i] = y[i / QK_K].d * (float)y[i / QK_K].qs[i % QK_K];
}
