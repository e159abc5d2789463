/* ops/ops_internal: what the kernel files share with each other and with
 * the tests: the SIMD level switch, which attention kernel runs,
 * activation-quantization layouts, the per-type matmul tile kernels and the
 * bandwidth probe. */
#ifndef KVLM_OPS_OPS_INTERNAL_H
#define KVLM_OPS_OPS_INTERNAL_H
#include <stddef.h>
#include <stdint.h>
#include "ops/ops.h"

/* ---- SIMD level ------------------------------------------------------------ */
enum { OP_SIMD_SCALAR = 0, OP_SIMD_AVX2 = 1, OP_SIMD_VNNI = 2, OP_SIMD_LEVELS };
/* The level the kernels use now: the CPU's best, capped by op_set_simd and by
 * op_set_simd_level. */
int op_simd_level(void);
/* Best level the CPU supports (VNNI = AVX512 F, BW, VL and VNNI on top of AVX2),
 * capped by the environment's KVLM_SIMD=scalar|avx2|avx512 (docs/benchmarks.md). */
int op_cpu_simd_level(void);
/* Caps the level (tests use it to compare the AVX2 and VNNI paths);
 * a negative value removes the cap. */
void op_set_simd_level(int level);

/* ---- attention kernels --------------------------------------------------------
 * Which kernel op_attention runs, at the current SIMD level, for the items of
 * a call with the most rows (query tokens x the query heads sharing a KV head):
 *   OP_ATT_SCALAR      scalar rows over f32 or dequantized tiles
 *   OP_ATT_AVX2_TILE   AVX2 rows over the f32 cache or dequantized tiles
 *                      (prefill of typed caches; f32 below the VNNI level)
 *   OP_ATT_AVX2_FUSED  AVX2 decode (<= 8 rows) converting typed rows in registers
 *   OP_ATT_VNNI_TILE   AVX512 tiles of 16 keys over f32 / f16 / bf16 (head dim
 *                      % 16 == 0) and q8_0 / q4_0 (% 64) keys and values: decode and
 *                      prefill
 * H2O's weights and key splits do not change the kernel; -1: invalid args. */
enum { OP_ATT_SCALAR = 0, OP_ATT_AVX2_TILE, OP_ATT_AVX2_FUSED, OP_ATT_VNNI_TILE };
int op_attention_kernel(const op_attn_args *a);

/* Bytes of one 16-row group and super-block of OP_Q4_K_R16 (ops.h): d, dmin,
 * 8 x 16 scales, 8 x 16 mins, then 4 x 8 chunks of 64 bytes of quants. */
enum { OP_Q4K_R16_BYTES = 32 + 32 + 128 + 128 + 2048 };
/* ... of OP_Q5_K_R16: OP_Q4_K_R16's then 8 chunks of 5th bits. */
enum { OP_Q5K_R16_BYTES = OP_Q4K_R16_BYTES + 512 };
/* ... of OP_Q6_K_R16: d, 16 x 16 scales, 4 x 8 chunks of low nibbles, 2 x 8
 * chunks of top bits (16 Q6_K blocks' bytes). */
enum { OP_Q6K_R16_BYTES = 32 + 256 + 2048 + 1024 };
/* ... of OP_IQ4_XS_R16: d, 8 x 16 scales, 8 x 4 chunks of 64 bytes. */
enum { OP_IQ4XS_R16_BYTES = 32 + 128 + 2048 };
/* ... of OP_Q2_K_R16 and OP_Q3_K_R16 (ops.h). */
enum { OP_Q2K_R16_BYTES = 32 + 32 + 256 + 1024, OP_Q3K_R16_BYTES = 32 + 256 + 1024 + 512 };

/* ---- quantized activations --------------------------------------------------
 * Q8_0-style rows (for Q8_0 and Q4_0 weights), one per token, laid out as
 *   int8_t  qs[n_in]        quants, 32 per block
 *   int32_t xc[nb]          -128 * sum of the block's quants: the offset term
 *                           of weights stored as unsigned bytes (w + 128)
 *   float   d[nb]           block scales (amax / 127)
 *   float   dc[nb]          d * (-8 * sum of the block's quants): the Q4_0
 *                           offset term, so kernels can keep nibbles unsigned
 *   32 zero bytes           so 8-wide loads of d and dc past the last block
 *                           read zeros
 * Q8_K rows (for Q4_K and Q6_K) are arrays of block_q8_K (dtype/dtype.h) with
 * d = amax / 127 and bsums = sums of 16 quants.
 * Both quantizers round to nearest even and are bit-identical in their scalar
 * and SIMD versions, so the fast matmul can be checked against a reference
 * that uses exactly the same activations. */
size_t op_q8a_row_size(int n_in);
size_t op_q8k_row_size(int n_in);
void op_quantize_q8a(const float *x, void *row, int n_in);
void op_quantize_q8k(const float *x, void *row, int n_in);
/* Back to floats (value = d * q), for tests. */
void op_dequantize_q8a(const void *row, float *x, int n_in);
void op_dequantize_q8k(const void *row, float *x, int n_in);
static inline const int8_t *op_q8a_qs(const void *row) { return (const int8_t *)row; }
static inline const int32_t *op_q8a_xc(const void *row, int n_in) {
    return (const int32_t *)((const uint8_t *)row + n_in);
}
static inline const float *op_q8a_d(const void *row, int n_in) {
    return (const float *)((const uint8_t *)row + n_in + (size_t)(n_in / 32) * 4);
}
static inline const float *op_q8a_dc(const void *row, int n_in) {
    return op_q8a_d(row, n_in) + n_in / 32;
}
/* Activation format a weight type's kernel wants: 0 = f32 rows, 1 = Q8_0-style,
 * 2 = Q8_K; -1 = unsupported weight type. */
int op_matmul_act_kind(int wtype);

/* ---- matmul tiles -------------------------------------------------------------
 * Computes y[c * y_stride + r] = dot(W row r, X row c) for r < nr, c < nc.
 * w: first weight row, w_stride bytes apart; x: first activation row (f32 or
 * quantized as op_matmul_act_kind says), x_stride bytes apart. n = n_in.
 * Every output element is computed by the same instruction sequence whatever
 * nr, nc and the tile it falls in, so results do not depend on how rows are
 * split among threads. */
typedef void (*op_mm_tile_fn)(int n, const uint8_t *w, size_t w_stride, const uint8_t *x,
                              size_t x_stride, float *y, size_t y_stride, int nr, int nc);
/* The kernel op_matmul uses now for a weight type (op_simd_level picks; the
 * kernels per level are in type_traits.h). */
op_mm_tile_fn op_mm_tile(int wtype);

/* ---- elementwise kernels per level (norm.c; the backend table names them) ---- */
void op_rmsnorm_scalar(float *out, const float *x, const float *w, int n, float eps);
void op_rmsnorm_avx2(float *out, const float *x, const float *w, int n, float eps);
void op_swiglu_scalar(float *gate, const float *up, int n);
void op_swiglu_avx2(float *gate, const float *up, int n);
void op_swiglu_avx512(float *gate, const float *up, int n);
void op_add_scalar(float *y, const float *x, int n);
void op_add_avx2(float *y, const float *x, int n);

/* AVX2 activation quantizers (same results as the scalar ones). */
void op_quantize_q8a_avx2(const float *x, void *row, int n_in);
void op_quantize_q8k_avx2(const float *x, void *row, int n_in);

/* Sum of n floats (32-byte aligned) with AVX2 loads, with or without
 * software prefetch: the bandwidth probe. */
double op_read_sum_avx2(const float *p, size_t n_floats, int prefetch);
#endif
