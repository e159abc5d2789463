/* ops/matmul_vnni: kernels for CPUs with AVX512-VNNI, chosen at run time:
 * packed Q8_0 (OP_Q8_0_R16) with 512-bit vpdpbusd, and the Q4_0 kernel rebuilt
 * with 256-bit vpdpbusd (the work of maddubs + madd in one instruction).
 * Other types, and unpacked Q8_0, use the AVX2 kernels. */
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
#define Q_RN 4
#include "ops/matmul_q8_tmpl.h"

/* ---- OP_Q8_0_R16: packed Q8_0 with 512-bit vpdpbusd --------------------------
 * A 16-row group's block is 8 chunks of 64 bytes (ops.h); each vpdpbusd takes
 * one chunk against one dword of the token's quants broadcast from memory, so
 * the 16 lanes are the 16 rows' partial dots and no horizontal sums or
 * shuffles are needed. The chunk registers of a block serve up to R16_C
 * tokens. The unsigned weights (w + 128) are corrected by starting from the
 * token's -128 x sum of the block's quants (op_q8a_xc). Per (row, token) the
 * block's integer dot is exact, and it meets its scale in one FMA per block in
 * column order, as in the scalar kernel, so every path gives the same bits. */
#define R16_C 8
#define R16_BLOCK (16 * sizeof(block_q8_0))

AI int32_t ld32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

AI void r16_tile(const int RN, int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y, size_t ys,
                 __mmask16 rows) {
    const int nb = n / 32;
    __m512 acc[R16_C];
#pragma GCC unroll 8
    for (int c = 0; c < RN; c++) acc[c] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (size_t)b * R16_BLOCK;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m512i wk[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) wk[k] = _mm512_loadu_si512(blk + 32 + 64 * k);
#pragma GCC unroll 8
        for (int c = 0; c < RN; c++) {
            const uint8_t *xr = x + (size_t)c * xs;
            const int8_t *xq = op_q8a_qs(xr) + b * 32;
            /* two chains halve the latency of the dependent vpdpbusd */
            __m512i i0 = _mm512_set1_epi32(op_q8a_xc(xr, n)[b]), i1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2) {
                i0 = _mm512_dpbusd_epi32(i0, wk[k], _mm512_set1_epi32(ld32(xq + 4 * k)));
                i1 = _mm512_dpbusd_epi32(i1, wk[k + 1], _mm512_set1_epi32(ld32(xq + 4 * k + 4)));
            }
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(op_q8a_d(xr, n)[b]));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), s, acc[c]);
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < RN; c++) _mm512_mask_storeu_ps(y + (size_t)c * ys, rows, acc[c]);
}

typedef void (*r16_fn)(int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y, size_t ys, __mmask16 rows);
#define R16(rn)                                                                                          \
    static void r16_##rn(int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y, size_t ys,     \
                         __mmask16 rows) {                                                              \
        r16_tile(rn, n, g, x, xs, y, ys, rows);                                                         \
    }
R16(1) R16(2) R16(3) R16(4) R16(5) R16(6) R16(7) R16(8)
static const r16_fn r16_tab[R16_C] = {r16_1, r16_2, r16_3, r16_4, r16_5, r16_6, r16_7, r16_8};

static void tile_q8_0_r16_vnni(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y,
                               size_t ys, int nr, int nc) {
    for (int r = 0; r < nr; r += 16) {
        const __mmask16 rows = nr - r >= 16 ? 0xffff : (__mmask16)((1u << (nr - r)) - 1);
        for (int c = 0; c < nc; c += R16_C) {
            int rn = nc - c < R16_C ? nc - c : R16_C;
            r16_tab[rn - 1](n, w + (size_t)r * ws, x + (size_t)c * xs, xs, y + (size_t)c * ys + r, ys, rows);
        }
    }
}

#pragma GCC pop_options

op_mm_tile_fn op_mm_tile_vnni(int wtype) {
    switch (wtype) {
    case OP_Q8_0_R16: return tile_q8_0_r16_vnni;
    case DT_Q4_0: return tile_q4_0_vnni;
    default: return op_mm_tile_avx2(wtype);
    }
}
#else
op_mm_tile_fn op_mm_tile_vnni(int wtype) { return op_mm_tile_scalar(wtype); }
#endif
