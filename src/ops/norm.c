/* ops/norm: RMSNorm, SwiGLU (silu(gate) * up) and the residual add, each
 * with a scalar reference and an AVX2 path; SwiGLU also in AVX-512 (the AVX2
 * path's bits). */
#include <math.h>
#include "ops/backend.h"
#include "ops/ops_internal.h"

void op_rmsnorm_ref(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

void op_swiglu_ref(float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        double g = gate[i];
        gate[i] = (float)(g / (1.0 + exp(-g)) * up[i]);
    }
}

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include "ops/simd_math.h"

void op_rmsnorm_avx2(float *out, const float *x, const float *w, int n, float eps) {
    /* two float accumulators of 8 lanes: n * 2^-24 relative error at most,
     * ~1e-7 in practice for hidden sizes of a few thousand */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    double ss = op_hsum256(_mm256_add_ps(a0, a1));
    for (; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vi), _mm256_loadu_ps(w + i)));
    for (; i < n; i++) out[i] = x[i] * inv * w[i];
}

void op_swiglu_avx2(float *gate, const float *up, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = op_exp256(_mm256_sub_ps(zero, g)); /* inf for g < -88.7: g/inf = -0 */
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void op_add_avx2(float *y, const float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] += x[i];
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
#endif
#include "ops/simd_math512.h"

void op_swiglu_avx512(float *gate, const float *up, int n) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = _mm512_loadu_ps(gate + i);
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, op_exp512(_mm512_sub_ps(zero, g))));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
    op_swiglu_avx2(gate + i, up + i, n - i); /* the last 8 in AVX2, the rest as it does */
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

void op_rmsnorm_scalar(float *out, const float *x, const float *w, int n, float eps) {
    float a[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) a[k] += x[i + k] * x[i + k];
    double ss = 0;
    for (int k = 0; k < 8; k++) ss += a[k];
    for (; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + eps));
    for (i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

void op_swiglu_scalar(float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void op_add_scalar(float *y, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += x[i];
}

/* the level's kernel (backend.c) */
void op_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    op_backend_cpu()->rmsnorm(out, x, w, n, eps);
}

void op_swiglu(float *gate, const float *up, int n) { op_backend_cpu()->swiglu(gate, up, n); }

void op_add(float *y, const float *x, int n) { op_backend_cpu()->add(y, x, n); }
