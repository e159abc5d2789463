/* ops/simd_math512: e^x on 16 lanes with op_exp256's steps (the same bits
 * lane for lane: SiLU and softmax agree across SIMD levels). Include after a
 * `#pragma GCC target` that enables avx512f (and fma). */
#ifndef KVLM_OPS_SIMD_MATH512_H
#define KVLM_OPS_SIMD_MATH512_H
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 op_exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.7f), lo = _mm512_set1_ps(-87.33f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    __m512 xc = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i ni = _mm512_cvtps_epi32(n);
    __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
    __m512 y = _mm512_maskz_mov_ps((__mmask16)~under, _mm512_mul_ps(_mm512_mul_ps(p, s1), s2));
    return _mm512_mask_mov_ps(y, over, _mm512_set1_ps(__builtin_inff()));
}
#endif
