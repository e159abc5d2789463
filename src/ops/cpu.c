/* ops/cpu: run-time CPU feature detection, the KVLM_SIMD cap on it, and the
 * switch that tests use to force the scalar (or AVX2-only) kernels. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "ops/ops_internal.h"
#include "util/log.h"
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

/* KVLM_SIMD=scalar|avx2|avx512|native caps the level as if the CPU had no
 * more (benchmarks pin one ISA on an AVX-512 machine, bench/peers.sh); read
 * once, before the first kernel, so load-time packing follows it too. */
static int env_cap(int detected) {
    const char *e = getenv("KVLM_SIMD");
    if (!e || !*e || !strcmp(e, "native")) return detected;
    static const char *const names[OP_SIMD_LEVELS] = {"scalar", "avx2", "avx512"};
    for (int l = 0; l < OP_SIMD_LEVELS; l++)
        if (!strcmp(e, names[l]) || (l == OP_SIMD_VNNI && !strcmp(e, "vnni")))
            return l < detected ? l : detected;
    LOG_WARN("KVLM_SIMD=%s: not one of scalar, avx2, avx512, native; using the CPU's best (%s)", e,
             names[detected]);
    return detected;
}

/* -1 = not yet detected. Relaxed atomics: the value is idempotent. */
static atomic_int cpu_level = -1;
static atomic_int level_cap = 100;

int op_cpu_simd_level(void) {
    int l = atomic_load_explicit(&cpu_level, memory_order_relaxed);
    if (l < 0) {
        l = env_cap(detect_level());
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

const char *op_simd_name(void) {
    int level = op_simd_level();
    return level == OP_SIMD_VNNI ? "AVX-512 VNNI" : level == OP_SIMD_AVX2 ? "AVX2" : "scalar";
}
