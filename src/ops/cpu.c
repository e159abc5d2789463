/* ops/cpu: run-time CPU feature detection and the switch that tests use to
 * force the scalar (or AVX2-only) kernels. */
#include <stdatomic.h>
#include "ops/ops_internal.h"
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports has no "f16c"). */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
#endif

static int detect_level(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          has_f16c()))
        return OP_SIMD_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return OP_SIMD_VNNI;
    return OP_SIMD_AVX2;
#else
    return OP_SIMD_SCALAR;
#endif
}

/* -1 = not yet detected. Relaxed atomics: the value is idempotent. */
static atomic_int cpu_level = -1;
static atomic_int level_cap = 100;

int op_cpu_simd_level(void) {
    int l = atomic_load_explicit(&cpu_level, memory_order_relaxed);
    if (l < 0) {
        l = detect_level();
        atomic_store_explicit(&cpu_level, l, memory_order_relaxed);
    }
    return l;
}

int op_simd_level(void) {
    int l = op_cpu_simd_level(), cap = atomic_load_explicit(&level_cap, memory_order_relaxed);
    return l < cap ? l : cap;
}

bool op_cpu_has_avx2(void) { return op_cpu_simd_level() >= OP_SIMD_AVX2; }

void op_set_simd(bool enabled) { atomic_store(&level_cap, enabled ? 100 : OP_SIMD_SCALAR); }

void op_set_simd_level(int level) { atomic_store(&level_cap, level < 0 ? 100 : level); }
