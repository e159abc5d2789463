/* ops/matmul_f16_avx512: AVX-512 tile kernels for F16 and BF16 weights x f32
 * activations (the VNNI level's entries for these types in type_traits.c). */
#include "ops/type_traits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
#endif

#include "ops/matmul_simd.h"

/* Decode streams 2 bytes per weight, so the kernel only has to keep loads in
 * flight: 16 weights per load, converted in registers (vcvtph2ps; BF16 is the
 * top half of an f32, a widen and a shift), a register tile of RM rows x RN
 * tokens so one activation load serves RM rows and one converted weight
 * vector RN tokens, one 16-lane accumulator per pair. Each pair's sum runs
 * over k in the same order whatever the tile's shape, so an output does not
 * depend on T, the thread split or the tile that computed it. */
enum { W_F16, W_BF16 };

AI __m512 w16(const int kind, const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (kind == W_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The last n & 15 weights: masked loads, lanes past the row read nothing and are 0. */
AI __m512 w16_tail(const int kind, const uint16_t *p, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (kind == W_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 lanes summed in one fixed order. */
AI float hsum16(__m512 v) {
    return hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

AI void htile(const int kind, const int RM, const int RN, int n, const uint8_t *w, size_t ws,
              const uint8_t *x, size_t xs, float *y, size_t ys) {
    __m512 acc[MAXR][MAXC];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) acc[r][c] = _mm512_setzero_ps();
    const int n16 = n & ~15;
    /* as the AVX2 kernel: the next group into L1, 32 KiB or 2 groups ahead into L2 */
    const pf_plan pf = pf_plan_for((size_t)RM * ws, 65536, 2, 32768);
    for (int k = 0; k < n16; k += 16) {
        if (RN == 1) pf_step(w, (size_t)k * 2 * RM, 2 * RM * 16, pf); /* decode */
        __m512 xv[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) xv[c] = _mm512_loadu_ps((const float *)(x + (size_t)c * xs) + k);
#pragma GCC unroll 4
        for (int r = 0; r < RM; r++) {
            const __m512 wv = w16(kind, (const uint16_t *)(w + (size_t)r * ws) + k);
#pragma GCC unroll 4
            for (int c = 0; c < RN; c++) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
        }
    }
    if (n16 < n) {
        const __mmask16 m = (__mmask16)((1u << (n - n16)) - 1);
        __m512 xv[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) xv[c] = _mm512_maskz_loadu_ps(m, (const float *)(x + (size_t)c * xs) + n16);
#pragma GCC unroll 4
        for (int r = 0; r < RM; r++) {
            const __m512 wv = w16_tail(kind, (const uint16_t *)(w + (size_t)r * ws) + n16, m);
#pragma GCC unroll 4
            for (int c = 0; c < RN; c++) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) y[(size_t)c * ys + r] = hsum16(acc[r][c]);
}

#define HT(kind, rm, rn)                                                                                    \
    static void ht_##kind##_##rm##x##rn(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, \
                                       float *y, size_t ys) {                                             \
        htile(kind, rm, rn, n, w, ws, x, xs, y, ys);                                                       \
    }
#define HT_ROW(kind, rm) HT(kind, rm, 1) HT(kind, rm, 2) HT(kind, rm, 3) HT(kind, rm, 4)
#define HT_TAB_ROW(kind, rm) {ht_##kind##_##rm##x1, ht_##kind##_##rm##x2, ht_##kind##_##rm##x3, ht_##kind##_##rm##x4}
#define HT_ALL(kind)                                                                                 \
    HT_ROW(kind, 1) HT_ROW(kind, 2) HT_ROW(kind, 3) HT_ROW(kind, 4)                                  \
    static fixed_fn tab_##kind[MAXR][MAXC] = {HT_TAB_ROW(kind, 1), HT_TAB_ROW(kind, 2), HT_TAB_ROW(kind, 3), \
                                              HT_TAB_ROW(kind, 4)};
HT_ALL(W_F16)
HT_ALL(W_BF16)

/* Decode and batches alike take 4-row tiles (the table's tile_rows), batches 4 tokens at a time. */
void op_mm_f16_avx512(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys, int nr,
                      int nc) {
    run_tiles(tab_W_F16, 4, 4, n, w, ws, x, xs, y, ys, nr, nc);
}
void op_mm_bf16_avx512(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys,
                       int nr, int nc) {
    run_tiles(tab_W_BF16, 4, 4, n, w, ws, x, xs, y, ys, nr, nc);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
