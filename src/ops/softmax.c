/* ops/softmax: numerically stable in-place softmax (subtract the max, sum the
 * exponentials, scale by the reciprocal) and the argmax of a row (greedy
 * sampling), scalar reference and AVX2. */
#include <math.h>
#include "ops/ops_internal.h"

int op_argmax_ref(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

void op_softmax_ref(float *x, int n) {
    if (n <= 0) return;
    double m = x[0];
    for (int i = 1; i < n; i++) if (x[i] > m) m = x[i];
    double s = 0;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - m);
    for (int i = 0; i < n; i++) x[i] = (float)(exp((double)x[i] - m) / s);
}

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include "ops/simd_math.h"

static void softmax_avx2(float *x, int n) {
    int i = 0;
    __m256 vm = _mm256_set1_ps(-__builtin_inff());
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
    float m = op_hmax256(vm);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    vm = _mm256_set1_ps(m);
    /* float lanes over chunks of 256, then double: vocabulary-sized rows
     * (32k+) keep ~1e-7 relative accuracy in the sum */
    double s = 0;
    for (i = 0; i + 8 <= n;) {
        __m256 vs = _mm256_setzero_ps();
        for (int end = i + 256; i + 8 <= n && i < end; i += 8) {
            __m256 e = op_exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
            _mm256_storeu_ps(x + i, e);
            vs = _mm256_add_ps(vs, e);
        }
        s += op_hsum256(vs);
    }
    for (; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    float inv = (float)(1.0 / s);
    __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vi));
    for (; i < n; i++) x[i] *= inv;
}
/* The max first (max_ps keeps its second operand when the first is NaN, so
 * NaNs are skipped, and a NaN x[0] stays the max, as in the reference), then
 * the first index holding it. */
static int argmax_avx2(const float *x, int n) {
    if (x[0] != x[0]) return 0;
    int i = 0;
    __m256 vm = _mm256_set1_ps(x[0]);
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + i), vm);
    float m = op_hmax256(vm);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    const __m256 vmax = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vmax, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0;
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define HAVE_AVX2_PATHS 1
#endif

int op_argmax(const float *x, int n) {
    if (n <= 0) return -1;
#ifdef HAVE_AVX2_PATHS
    if (op_simd_level() >= OP_SIMD_AVX2) return argmax_avx2(x, n);
#endif
    return op_argmax_ref(x, n);
}

void op_softmax(float *x, int n) {
    if (n <= 0) return;
#ifdef HAVE_AVX2_PATHS
    if (op_simd_level() >= OP_SIMD_AVX2) { softmax_avx2(x, n); return; }
#endif
    float m = x[0];
    for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    double s = 0; /* double: long rows stay accurate */
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    float inv = (float)(1.0 / s);
    for (int i = 0; i < n; i++) x[i] *= inv;
}
