/* ops/backend: the CPU backend's instances, one per SIMD level. Matmul and
 * attention are shared drivers that pick each level's kernels from their own
 * tables (type_traits.c, attention_internal.h); the elementwise kernels are
 * the level's own. */
#include "ops/backend.h"
#include "ops/kvtype.h"
#include "ops/ops_internal.h"

#define CPU_BACKEND(nm, rms, swi, ad)                                                                          \
    {                                                                                                          \
        .name = nm, .matmul_work_size = op_matmul_work_size, .matmul_n = op_matmul_n,                          \
        .matmul_prep = op_matmul_prep, .rmsnorm = rms, .rope = op_rope, .rope_cossin = op_rope_cossin,         \
        .rope_apply = op_rope_apply, .swiglu = swi, .add = ad, .attention_work_size = op_attention_work_size, \
        .attention = op_attention, .attention_n = op_attention_n, .kv_quantize_row = op_kv_quantize_row,     \
        .kv_quantize_kc = op_kv_quantize_kc,                                                                   \
    }

static const op_backend cpu[OP_SIMD_LEVELS] = {
    CPU_BACKEND("cpu-scalar", op_rmsnorm_scalar, op_swiglu_scalar, op_add_scalar),
#if defined(__x86_64__) || defined(__i386__)
    CPU_BACKEND("cpu-avx2", op_rmsnorm_avx2, op_swiglu_avx2, op_add_avx2),
    CPU_BACKEND("cpu-avx512", op_rmsnorm_avx2, op_swiglu_avx512, op_add_avx2),
#endif
};

const op_backend *op_backend_cpu(void) {
    int l = op_simd_level();
    return &cpu[l < (int)(sizeof cpu / sizeof cpu[0]) ? l : 0];
}
