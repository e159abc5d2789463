/* ops/softmax: numerically stable in-place softmax (subtract the max, sum the
 * exponentials, scale by the reciprocal), scalar reference and AVX2. */
#include <math.h>
#include "ops/ops_internal.h"

void op_softmax_ref(float *x, int n) {
    if (n <= 0) return;
    double m = x[0];
    for (int i = 1; i < n; i++) if (x[i] > m) m = x[i];
    double s = 0;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - m);
    for (int i = 0; i < n; i++) x[i] = (float)(exp((double)x[i] - m) / s);
}

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
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
#pragma GCC pop_options
#define HAVE_AVX2_PATHS 1
#endif

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
