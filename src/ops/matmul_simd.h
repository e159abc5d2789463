/* ops/matmul_simd: helpers shared by the x86 SIMD matmul files. Include it
 * after the file's `#pragma GCC target`, so the helpers get that target. */
#ifndef KVLM_OPS_MATMUL_SIMD_H
#define KVLM_OPS_MATMUL_SIMD_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define AI static inline __attribute__((always_inline))
/* Largest register tile, rows x tokens. */
#define MAXR 4
#define MAXC 4

/* Horizontal sum in one fixed order, so every output element gets the same
 * rounding whichever tile computed it. */
AI float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 f16 values in the low halves of 8 dwords -> 8 floats. */
AI __m256 f16_lo_halves(__m256i g) {
    const __m256i sh = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(g, sh), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(t));
}

/* Decode prefetch. A tile reads its RM rows in lockstep, and as it consumes a
 * fraction of them it requests the same fraction of the rows some groups
 * ahead: into L2 at least min_far groups and min_bytes ahead (L2 requests do
 * not hold the few L1 fill buffers, so many lines can be in flight), and,
 * when a group is at most near_max bytes, the next group also into L1 (from
 * further away it would evict lines before their use). The hardware
 * prefetcher alone leaves these loops well short of the memory bandwidth.
 * Distances are bytes from the current position; near = 0 means none. The
 * constants were tuned on a 2-core Sapphire Rapids slice. */
typedef struct {
    size_t near, far;
} pf_plan;

AI pf_plan pf_plan_for(size_t group_bytes, size_t near_max, int min_far, size_t min_bytes) {
    pf_plan p;
    if (group_bytes == 0) group_bytes = 1;
    size_t g = (min_bytes + group_bytes - 1) / group_bytes;
    if (g < (size_t)min_far) g = (size_t)min_far;
    p.far = g * group_bytes;
    p.near = group_bytes <= near_max ? group_bytes : 0;
    return p;
}

/* Prefetches len bytes (lines 64 apart) at base + offset for both distances. */
AI void pf_step(const uint8_t *base, size_t offset, int len, pf_plan p) {
#pragma GCC unroll 16
    for (int i = 0; i < len; i += 64) {
        if (p.near) _mm_prefetch((const char *)base + p.near + offset + i, _MM_HINT_T0);
        _mm_prefetch((const char *)base + p.far + offset + i, _MM_HINT_T1);
    }
}

/* A tile of fixed size: rows x tokens known at compile time. */
typedef void (*fixed_fn)(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y,
                         size_t ys);

/* Covers nr x nc with RM x RN tiles from tab[rm-1][rn-1], smaller at the edges. */
AI void run_tiles(fixed_fn tab[MAXR][MAXC], const int RM, const int RN, int n, const uint8_t *w,
                  size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys, int nr, int nc) {
    for (int r = 0; r < nr; r += RM) {
        int rm = nr - r < RM ? nr - r : RM;
        for (int c = 0; c < nc; c += RN) {
            int rn = nc - c < RN ? nc - c : RN;
            tab[rm - 1][rn - 1](n, w + (size_t)r * ws, ws, x + (size_t)c * xs, xs,
                                y + (size_t)c * ys + r, ys);
        }
    }
}

/* One weight row x 1..4 tokens per call (kernels tf(RN, ...)): the
 * instances, their table and op_mm_<name>_<level> over any nr x nc. */
#define KT(name, rn)                                                                                           \
    static void name##_1x##rn(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y,       \
                              size_t ys) {                                                                     \
        (void)ws;                                                                                              \
        name(rn, n, w, x, xs, y, ys);                                                                          \
    }
#define K_TILE_AT(name, tf, level)                                                                             \
    KT(tf, 1) KT(tf, 2) KT(tf, 3) KT(tf, 4)                                                                    \
    static fixed_fn tab_##name[MAXR][MAXC] = {{tf##_1x1, tf##_1x2, tf##_1x3, tf##_1x4}};                       \
    void op_mm_##name##_##level(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y,     \
                                size_t ys, int nr, int nc) {                                                   \
        run_tiles(tab_##name, 1, 4, n, w, ws, x, xs, y, ys, nr, nc);                                           \
    }
#endif
