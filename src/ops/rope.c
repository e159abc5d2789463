/* ops/rope: rotary position embedding, normal (pairs 2i, 2i+1) and NeoX
 * (pairs i, i + rope_dim/2). Angles pos * base^(-2i/rope_dim) (divided by a
 * per-pair frequency factor where the model has them: Llama 3.1's scaling)
 * are computed in double, so large positions (32k and beyond) lose no
 * precision; a position's cos/sin can be computed once (op_rope_cossin) and
 * applied to many rows. */
#include <math.h>
#include "ops/ops_internal.h"

static inline double rope_angle(int pos, double base, int i, int rope_dim, const float *ff) {
    double th = (double)pos * pow(base, -2.0 * i / rope_dim);
    return ff ? th / ff[i] : th;
}

static inline void rotate(float *a, float *b, float c, float s) {
    float x0 = *a, x1 = *b;
    *a = x0 * c - x1 * s;
    *b = x0 * s + x1 * c;
}

void op_rope_ref(float *x, int n_heads, int head_dim, int rope_dim, int pos, float base, const float *ff, bool neox) {
    int half = rope_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            double th = rope_angle(pos, base, i, rope_dim, ff);
            float c = (float)cos(th), s = (float)sin(th);
            if (neox) rotate(v + i, v + i + half, c, s);
            else rotate(v + 2 * i, v + 2 * i + 1, c, s);
        }
    }
}

/* cos/sin of a chunk of pair indices are computed once and applied to every
 * head; the chunk bounds the stack use for any rope_dim. */
#define ROPE_CHUNK 64

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>
/* pairs [i0, i0+n) of every head; n a multiple of 8 */
static void rope_chunk_avx2(float *x, int n_heads, int head_dim, int half, int i0, int n,
                            const float *cs, const float *sn, bool neox) {
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < n; i += 8) {
            __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
            if (neox) {
                float *a = v + i0 + i, *b = a + half;
                __m256 x0 = _mm256_loadu_ps(a), x1 = _mm256_loadu_ps(b);
                _mm256_storeu_ps(a, _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, s)));
                _mm256_storeu_ps(b, _mm256_add_ps(_mm256_mul_ps(x0, s), _mm256_mul_ps(x1, c)));
            } else {
                /* 8 interleaved pairs in two vectors: de-interleave, rotate,
                 * re-interleave (within 128-bit lanes, undone the same way) */
                float *a = v + 2 * (i0 + i);
                __m256 p0 = _mm256_loadu_ps(a), p1 = _mm256_loadu_ps(a + 8);
                __m256 ev = _mm256_shuffle_ps(p0, p1, 0x88), od = _mm256_shuffle_ps(p0, p1, 0xdd);
                /* ev/od hold pairs in the order 0 1 4 5 2 3 6 7: permute c, s alike */
                __m256i perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
                __m256 cp = _mm256_permutevar8x32_ps(c, perm), sp = _mm256_permutevar8x32_ps(s, perm);
                __m256 r0 = _mm256_sub_ps(_mm256_mul_ps(ev, cp), _mm256_mul_ps(od, sp));
                __m256 r1 = _mm256_add_ps(_mm256_mul_ps(ev, sp), _mm256_mul_ps(od, cp));
                _mm256_storeu_ps(a, _mm256_unpacklo_ps(r0, r1));
                _mm256_storeu_ps(a + 8, _mm256_unpackhi_ps(r0, r1));
            }
        }
    }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define HAVE_AVX2_PATHS 1
#endif

/* pairs [i0, i0+n) of every head with the angles' cos/sin cs[0..n), sn[0..n) */
static void rope_apply_pairs(float *x, int n_heads, int head_dim, int half, int i0, int n, const float *cs,
                             const float *sn, bool neox) {
    int done = 0;
#ifdef HAVE_AVX2_PATHS
    if (op_simd_level() >= OP_SIMD_AVX2) {
        done = n & ~7;
        if (done) rope_chunk_avx2(x, n_heads, head_dim, half, i0, done, cs, sn, neox);
    }
#endif
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = done; i < n; i++) {
            if (neox) rotate(v + i0 + i, v + i0 + i + half, cs[i], sn[i]);
            else rotate(v + 2 * (i0 + i), v + 2 * (i0 + i) + 1, cs[i], sn[i]);
        }
    }
}

static void rope_cossin(float *cs, float *sn, int rope_dim, int pos, float base, const float *ff, int i0, int n) {
    for (int i = 0; i < n; i++) {
        double th = rope_angle(pos, base, i0 + i, rope_dim, ff);
        cs[i] = (float)cos(th);
        sn[i] = (float)sin(th);
    }
}

void op_rope(float *x, int n_heads, int head_dim, int rope_dim, int pos, float base, const float *ff, bool neox) {
    int half = rope_dim / 2;
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    /* chunks are multiples of 8 pairs: the AVX2 and scalar pairs are those of
     * op_rope_apply over all of them, so both give the same bits */
    for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        int n = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        rope_cossin(cs, sn, rope_dim, pos, base, ff, i0, n);
        rope_apply_pairs(x, n_heads, head_dim, half, i0, n, cs, sn, neox);
    }
}

void op_rope_cossin(float *cs, float *sn, int rope_dim, int pos, float base, const float *ff) {
    rope_cossin(cs, sn, rope_dim, pos, base, ff, 0, rope_dim / 2);
}

void op_rope_apply(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, const float *sn, bool neox) {
    rope_apply_pairs(x, n_heads, head_dim, rope_dim / 2, 0, rope_dim / 2, cs, sn, neox);
}
