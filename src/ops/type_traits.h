/* ops/type_traits: one table of what the kernels need to know about each
 * weight type (GGUF types and this CPU backend's packed ones): the rows it
 * stores, the activation format, its packed form and packer, its tile kernel
 * per SIMD level. A new weight type is one row here plus its kernels. The
 * file-format facts (block size and bytes) stay in dtype/dtype.c's dt_info. */
#ifndef KVLM_OPS_TYPE_TRAITS_H
#define KVLM_OPS_TYPE_TRAITS_H
#include <stddef.h>
#include <stdint.h>
#include "ops/ops_internal.h"

/* Activation formats (op_matmul_act_kind's values; layouts in ops_internal.h). */
enum { OP_ACT_F32 = 0, OP_ACT_Q8A = 1, OP_ACT_Q8K = 2, OP_ACT_COUNT };

/* What an activation format costs and how X becomes it. */
typedef void (*op_quantize_fn)(const float *x, void *row, int n_in);
typedef struct {
    size_t (*row_size)(int n_in);             /* bytes of one quantized row; NULL for f32 */
    op_quantize_fn quantize[OP_SIMD_LEVELS];  /* NULL: the level below's */
} op_act_traits;

/* Packs n_out x n_in weights of base type wtype into the packed layout (ops.h). */
typedef void (*op_pack_fn)(int wtype, const void *src, void *dst, int n_in, int n_out);

typedef struct {
    const char *name;     /* NULL: no kernel takes this type */
    int base;             /* the GGUF type whose rows (and dt_info block) it stores: itself unless packed */
    int packed;           /* a base type's 16-row packed type, -1 none */
    int act;              /* OP_ACT_*: how X is quantized for it */
    int tile_rows;        /* a thread's rows come in multiples of this (a register tile, a packed group) */
    /* packed types: bytes per group of 16 rows and block; 0: 16 rows of the base type's */
    int group_block_bytes;
    op_pack_fn pack;      /* base types with a packed form: the packer */
    op_mm_tile_fn tile[OP_SIMD_LEVELS]; /* NULL: the level below's */
} op_type_traits;

/* The row of a weight type (packed or not), NULL if no kernel takes it. */
const op_type_traits *op_type_traits_of(int wtype);
const op_act_traits *op_act_traits_of(int act);
/* Tile kernel of a weight type at a SIMD level or the nearest level below
 * that has one; NULL for unsupported types. */
op_mm_tile_fn op_mm_tile_at(int wtype, int level);
/* Likewise the quantizer of an activation format; NULL for f32. */
op_quantize_fn op_act_quantizer(int act, int level);

/* ---- the kernels the table names -------------------------------------------------
 * op_mm_<type>_<level>: tile kernels (ops_internal.h's op_mm_tile_fn). */
#define OP_MM_TILE_DECL(name)                                                                         \
    void name(int n, const uint8_t *w, size_t w_stride, const uint8_t *x, size_t x_stride, float *y, \
              size_t y_stride, int nr, int nc)
OP_MM_TILE_DECL(op_mm_f32_scalar);
OP_MM_TILE_DECL(op_mm_f16_scalar);
OP_MM_TILE_DECL(op_mm_bf16_scalar);
OP_MM_TILE_DECL(op_mm_q8_0_scalar);
OP_MM_TILE_DECL(op_mm_q4_0_scalar);
OP_MM_TILE_DECL(op_mm_q4_1_scalar);
OP_MM_TILE_DECL(op_mm_q5_0_scalar);
OP_MM_TILE_DECL(op_mm_q5_1_scalar);
OP_MM_TILE_DECL(op_mm_q4_K_scalar);
OP_MM_TILE_DECL(op_mm_q5_K_scalar);
OP_MM_TILE_DECL(op_mm_q6_K_scalar);
OP_MM_TILE_DECL(op_mm_q2_K_scalar);
OP_MM_TILE_DECL(op_mm_q3_K_scalar);
OP_MM_TILE_DECL(op_mm_iq4_nl_scalar);
OP_MM_TILE_DECL(op_mm_iq4_xs_scalar);
OP_MM_TILE_DECL(op_mm_iq2_xxs_scalar);
OP_MM_TILE_DECL(op_mm_iq2_xs_scalar);
OP_MM_TILE_DECL(op_mm_iq2_s_scalar);
OP_MM_TILE_DECL(op_mm_iq3_xxs_scalar);
OP_MM_TILE_DECL(op_mm_iq3_s_scalar);
OP_MM_TILE_DECL(op_mm_iq1_s_scalar);
OP_MM_TILE_DECL(op_mm_iq1_m_scalar);
OP_MM_TILE_DECL(op_mm_mxfp4_scalar);
OP_MM_TILE_DECL(op_mm_tq1_0_scalar);
OP_MM_TILE_DECL(op_mm_tq2_0_scalar);
OP_MM_TILE_DECL(op_mm_q8_0_r16_scalar);
OP_MM_TILE_DECL(op_mm_q4_0_r16_scalar);
OP_MM_TILE_DECL(op_mm_q5_0_r16_scalar);
OP_MM_TILE_DECL(op_mm_q4_1_r16_scalar);
OP_MM_TILE_DECL(op_mm_q5_1_r16_scalar);
OP_MM_TILE_DECL(op_mm_q4_K_r16_scalar);
OP_MM_TILE_DECL(op_mm_q5_K_r16_scalar);
OP_MM_TILE_DECL(op_mm_q6_K_r16_scalar);
OP_MM_TILE_DECL(op_mm_iq4_nl_r16_scalar);
OP_MM_TILE_DECL(op_mm_mxfp4_r16_scalar);
OP_MM_TILE_DECL(op_mm_iq4_xs_r16_scalar);
OP_MM_TILE_DECL(op_mm_q2_K_r16_scalar);
OP_MM_TILE_DECL(op_mm_q3_K_r16_scalar);
OP_MM_TILE_DECL(op_mm_f32_avx2);
OP_MM_TILE_DECL(op_mm_f16_avx2);
OP_MM_TILE_DECL(op_mm_bf16_avx2);
OP_MM_TILE_DECL(op_mm_q8_0_avx2);
OP_MM_TILE_DECL(op_mm_q4_0_avx2);
OP_MM_TILE_DECL(op_mm_q4_1_avx2);
OP_MM_TILE_DECL(op_mm_q5_0_avx2);
OP_MM_TILE_DECL(op_mm_q5_1_avx2);
OP_MM_TILE_DECL(op_mm_q4_K_avx2);
OP_MM_TILE_DECL(op_mm_q5_K_avx2);
OP_MM_TILE_DECL(op_mm_q6_K_avx2);
OP_MM_TILE_DECL(op_mm_q2_K_avx2);
OP_MM_TILE_DECL(op_mm_q3_K_avx2);
OP_MM_TILE_DECL(op_mm_iq4_nl_avx2);
OP_MM_TILE_DECL(op_mm_iq4_xs_avx2);
OP_MM_TILE_DECL(op_mm_iq2_xxs_avx2);
OP_MM_TILE_DECL(op_mm_iq2_xs_avx2);
OP_MM_TILE_DECL(op_mm_iq2_s_avx2);
OP_MM_TILE_DECL(op_mm_iq3_xxs_avx2);
OP_MM_TILE_DECL(op_mm_iq3_s_avx2);
OP_MM_TILE_DECL(op_mm_iq1_s_avx2);
OP_MM_TILE_DECL(op_mm_iq1_m_avx2);
OP_MM_TILE_DECL(op_mm_mxfp4_avx2);
OP_MM_TILE_DECL(op_mm_tq1_0_avx2);
OP_MM_TILE_DECL(op_mm_tq2_0_avx2);
OP_MM_TILE_DECL(op_mm_tq1_0_vnni);
OP_MM_TILE_DECL(op_mm_tq2_0_vnni);
OP_MM_TILE_DECL(op_mm_q8_0_r16_vnni);
OP_MM_TILE_DECL(op_mm_q4_0_r16_vnni);
OP_MM_TILE_DECL(op_mm_q5_0_r16_vnni);
OP_MM_TILE_DECL(op_mm_q4_1_r16_vnni);
OP_MM_TILE_DECL(op_mm_q5_1_r16_vnni);
OP_MM_TILE_DECL(op_mm_q4_K_r16_vnni);
OP_MM_TILE_DECL(op_mm_q5_K_r16_vnni);
OP_MM_TILE_DECL(op_mm_q6_K_r16_vnni);
OP_MM_TILE_DECL(op_mm_iq4_nl_r16_vnni);
OP_MM_TILE_DECL(op_mm_mxfp4_r16_vnni);
OP_MM_TILE_DECL(op_mm_iq4_xs_r16_vnni);
OP_MM_TILE_DECL(op_mm_q2_K_r16_vnni);
OP_MM_TILE_DECL(op_mm_q3_K_r16_vnni);

/* Packers (pack.c): Q8_0 / Q4_0 / Q5_0 / Q4_1 / Q5_1 / IQ4_NL; Q4_K / Q5_K; Q6_K; IQ4_XS; Q2_K / Q3_K. */
void op_pack_legacy(int wtype, const void *src, void *dst, int n_in, int n_out);
void op_pack_iq4_xs(int wtype, const void *src, void *dst, int n_in, int n_out);
void op_pack_q23k(int wtype, const void *src, void *dst, int n_in, int n_out);
void op_pack_kquant(int wtype, const void *src, void *dst, int n_in, int n_out);
void op_pack_q6_K(int wtype, const void *src, void *dst, int n_in, int n_out);

/* Activation quantizers per level (quant_act.c). */
void op_quantize_q8a_scalar(const float *x, void *row, int n_in);
void op_quantize_q8k_scalar(const float *x, void *row, int n_in);
#endif
