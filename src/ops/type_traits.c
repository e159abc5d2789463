/* ops/type_traits: the per-weight-type table of the CPU kernels (what
 * type_traits.h describes) and the per-activation-format one. */
#include "ops/type_traits.h"
#include "dtype/dtype.h"

#if defined(__x86_64__) || defined(__i386__)
#define AVX2(f) f
#define VNNI(f) f
#else /* only the scalar kernels are built */
#define AVX2(f) NULL
#define VNNI(f) NULL
#endif

static const op_act_traits act_traits[OP_ACT_COUNT] = {
    [OP_ACT_F32] = {NULL, {NULL}},
    [OP_ACT_Q8A] = {op_q8a_row_size, {op_quantize_q8a_scalar, AVX2(op_quantize_q8a_avx2)}},
    [OP_ACT_Q8K] = {op_q8k_row_size, {op_quantize_q8k_scalar, AVX2(op_quantize_q8k_avx2)}},
};

/* Float rows: f32 activations, 4-row register tiles. */
#define FLOAT_TYPE(T, nm)                                                                         \
    [DT_##T] = {#nm, DT_##T, -1, OP_ACT_F32, 4, 0, NULL, {op_mm_##nm##_scalar, AVX2(op_mm_##nm##_avx2)}}
/* A quantized base type with its packed form. */
#define BASE_TYPE(T, nm, act, packer)                                                                          \
    [DT_##T] = {#nm, DT_##T, OP_##T##_R16, act, 4, 0, packer, {op_mm_##nm##_scalar, AVX2(op_mm_##nm##_avx2)}}
/* A quantized base type without a packed form (every level above AVX2 uses
 * the AVX2 kernel). */
#define PLAIN_TYPE(T, nm, act) [DT_##T] = {#nm, DT_##T, -1, act, 4, 0, NULL, {op_mm_##nm##_scalar, AVX2(op_mm_##nm##_avx2)}}
/* A base type without a packed form whose unpacked rows have a 512-bit kernel
 * at the VNNI level. */
#define WIDE_TYPE(T, nm, act)                                                                                \
    [DT_##T] = {#nm, DT_##T, -1, act, 4, 0, NULL,                                                            \
                {op_mm_##nm##_scalar, AVX2(op_mm_##nm##_avx2), VNNI(op_mm_##nm##_vnni)}}
/* A packed type: groups of 16 rows, read by the VNNI kernels (and by the
 * scalar ones elsewhere; no AVX2 kernel). */
#define PACKED_TYPE(T, nm, act, gbytes)                                                                     \
    [OP_##T##_R16] = {#nm "_r16", DT_##T, -1, act, 16, gbytes, NULL,                                         \
                      {op_mm_##nm##_r16_scalar, NULL, VNNI(op_mm_##nm##_r16_vnni)}}

/* Indexed by type id: GGUF ids below 0x100, packed ones 0x100 + their base's. */
static const op_type_traits traits[] = {
    FLOAT_TYPE(F32, f32),
    FLOAT_TYPE(F16, f16),
    FLOAT_TYPE(BF16, bf16),
    BASE_TYPE(Q8_0, q8_0, OP_ACT_Q8A, op_pack_legacy),
    BASE_TYPE(Q4_0, q4_0, OP_ACT_Q8A, op_pack_legacy),
    BASE_TYPE(Q5_0, q5_0, OP_ACT_Q8A, op_pack_legacy),
    BASE_TYPE(Q4_1, q4_1, OP_ACT_Q8A, op_pack_legacy),
    BASE_TYPE(Q5_1, q5_1, OP_ACT_Q8A, op_pack_legacy),
    BASE_TYPE(Q4_K, q4_K, OP_ACT_Q8K, op_pack_kquant),
    BASE_TYPE(Q5_K, q5_K, OP_ACT_Q8K, op_pack_kquant),
    BASE_TYPE(Q6_K, q6_K, OP_ACT_Q8K, op_pack_q6_K),
    BASE_TYPE(Q2_K, q2_K, OP_ACT_Q8K, op_pack_q23k),
    BASE_TYPE(Q3_K, q3_K, OP_ACT_Q8K, op_pack_q23k),
    BASE_TYPE(IQ4_NL, iq4_nl, OP_ACT_Q8A, op_pack_legacy),
    BASE_TYPE(IQ4_XS, iq4_xs, OP_ACT_Q8K, op_pack_iq4_xs),
    /* the codebook types: table lookups per 8 weights, no packed form */
    PLAIN_TYPE(IQ2_XXS, iq2_xxs, OP_ACT_Q8K),
    PLAIN_TYPE(IQ2_XS, iq2_xs, OP_ACT_Q8K),
    PLAIN_TYPE(IQ2_S, iq2_s, OP_ACT_Q8K),
    PLAIN_TYPE(IQ3_XXS, iq3_xxs, OP_ACT_Q8K),
    PLAIN_TYPE(IQ3_S, iq3_s, OP_ACT_Q8K),
    PLAIN_TYPE(IQ1_S, iq1_s, OP_ACT_Q8K),
    PLAIN_TYPE(IQ1_M, iq1_m, OP_ACT_Q8K),
    BASE_TYPE(MXFP4, mxfp4, OP_ACT_Q8A, op_pack_legacy),
    /* the ternary types: no packed form, a 512-bit kernel of their rows */
    WIDE_TYPE(TQ1_0, tq1_0, OP_ACT_Q8K),
    WIDE_TYPE(TQ2_0, tq2_0, OP_ACT_Q8K),
    PACKED_TYPE(Q8_0, q8_0, OP_ACT_Q8A, 0),
    PACKED_TYPE(Q4_0, q4_0, OP_ACT_Q8A, 0),
    PACKED_TYPE(Q5_0, q5_0, OP_ACT_Q8A, 0),
    PACKED_TYPE(Q4_1, q4_1, OP_ACT_Q8A, 0),
    PACKED_TYPE(Q5_1, q5_1, OP_ACT_Q8A, 0),
    PACKED_TYPE(Q4_K, q4_K, OP_ACT_Q8K, OP_Q4K_R16_BYTES),
    PACKED_TYPE(Q5_K, q5_K, OP_ACT_Q8K, OP_Q5K_R16_BYTES),
    PACKED_TYPE(Q6_K, q6_K, OP_ACT_Q8K, 0),
    PACKED_TYPE(IQ4_NL, iq4_nl, OP_ACT_Q8A, 0),
    PACKED_TYPE(MXFP4, mxfp4, OP_ACT_Q8A, 0),
    PACKED_TYPE(IQ4_XS, iq4_xs, OP_ACT_Q8K, OP_IQ4XS_R16_BYTES),
    PACKED_TYPE(Q2_K, q2_K, OP_ACT_Q8K, 0),
    PACKED_TYPE(Q3_K, q3_K, OP_ACT_Q8K, OP_Q3K_R16_BYTES),
};

const op_type_traits *op_type_traits_of(int wtype) {
    if (wtype < 0 || (size_t)wtype >= sizeof traits / sizeof traits[0] || !traits[wtype].name) return NULL;
    return &traits[wtype];
}

const op_act_traits *op_act_traits_of(int act) {
    return act >= 0 && act < OP_ACT_COUNT ? &act_traits[act] : NULL;
}

/* A per-level array's entry at level, or at the nearest level below that has
 * one (the scalar level's, possibly NULL, at the bottom). */
#define AT_LEVEL(arr, level)                                                        \
    int l = (level) < 0 ? 0 : (level) < OP_SIMD_LEVELS ? (level) : OP_SIMD_LEVELS - 1; \
    while (l > 0 && !(arr)[l]) l--;                                                \
    return (arr)[l]

op_mm_tile_fn op_mm_tile_at(int wtype, int level) {
    const op_type_traits *t = op_type_traits_of(wtype);
    if (!t) return NULL;
    AT_LEVEL(t->tile, level);
}

op_quantize_fn op_act_quantizer(int act, int level) {
    const op_act_traits *a = op_act_traits_of(act);
    if (!a) return NULL;
    AT_LEVEL(a->quantize, level);
}
