/* ops/matmul_vnni: the Q8_0 and Q4_0 kernels rebuilt with 256-bit vpdpbusd
 * (AVX512-VNNI + AVX512VL), which does the work of maddubs + madd in one
 * instruction; chosen at run time on CPUs that have it. Other types use the
 * AVX2 kernels. */
#include <string.h>
#include "model/dtype.h"
#include "ops/ops_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include "ops/matmul_simd.h"

#define Q_VNNI 1
#define Q_SUFFIX(name) name##_vnni
/* 32 vector registers with EVEX: room for a 4 x 4 tile */
#define Q_DEC_RM 4
#define Q_RM 4
#ifndef Q8_RM
#define Q8_RM 4
#endif
#define Q_RN 4
#ifndef Q8_RN
#define Q8_RN 8 /* Q8_0 tiles: 4 rows x 8 tokens */
#endif
#include "ops/matmul_q8_tmpl.h"

#pragma GCC pop_options

op_mm_tile_fn op_mm_tile_vnni(int wtype) {
    switch (wtype) {
    case DT_Q8_0: return tile_q8_0_vnni;
    case DT_Q4_0: return tile_q4_0_vnni;
    default: return op_mm_tile_avx2(wtype);
    }
}
#else
op_mm_tile_fn op_mm_tile_vnni(int wtype) { return op_mm_tile_scalar(wtype); }
void op_q8x2_from_q8a(const void *q8a, void *dst, int n_in) { (void)q8a, (void)dst, (void)n_in; }
#endif
