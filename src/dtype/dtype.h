/* dtype/dtype: the tensor element types of GGUF (ids as in the file format),
 * their block layouts, half-precision conversions, and the scalar reference
 * quantizers/dequantizers that every fast kernel is tested against. */
#ifndef KVLM_DTYPE_DTYPE_H
#define KVLM_DTYPE_DTYPE_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* GGUF / ggml type ids. Only the ones with a name in dt_info are supported. */
typedef enum {
    DT_F32 = 0,
    DT_F16 = 1,
    DT_Q4_0 = 2,
    DT_Q4_1 = 3,
    DT_Q5_0 = 6,
    DT_Q5_1 = 7,
    DT_Q8_0 = 8,
    DT_Q8_1 = 9,
    DT_Q2_K = 10,
    DT_Q3_K = 11,
    DT_Q4_K = 12,
    DT_Q5_K = 13,
    DT_Q6_K = 14,
    DT_Q8_K = 15,
    DT_IQ2_XXS = 16,
    DT_IQ2_XS = 17,
    DT_IQ3_XXS = 18,
    DT_IQ1_S = 19,
    DT_IQ4_NL = 20,
    DT_IQ3_S = 21,
    DT_IQ2_S = 22,
    DT_IQ4_XS = 23,
    DT_IQ1_M = 29,
    DT_BF16 = 30,
    DT_TQ1_0 = 34,
    DT_TQ2_0 = 35,
    DT_MXFP4 = 39,
    DT_COUNT = 40
} dt_type;

#define QK4_0 32
#define QK8_0 32
#define QK_K 256
#define K_SCALE_SIZE 12

typedef uint16_t dt_f16;  /* IEEE half, stored as bits */
typedef uint16_t dt_bf16; /* bfloat16, stored as bits */

/* Block layouts, byte-for-byte those of GGUF files. */
typedef struct { dt_f16 d; uint8_t qs[QK4_0 / 2]; } block_q4_0;           /* 18 bytes */
typedef struct { dt_f16 d; int8_t qs[QK8_0]; } block_q8_0;                /* 34 bytes */
/* value = d q + m, q the nibble (elements j and j + 16 share byte j) */
typedef struct { dt_f16 d, m; uint8_t qs[16]; } block_q4_1;               /* 20 bytes */
/* value = d (q - 16), q the nibble plus bit e of qh (little-endian) as bit 4 */
typedef struct { dt_f16 d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;   /* 22 bytes */
/* value = d q + m, q as Q5_0's */
typedef struct { dt_f16 d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1; /* 24 bytes */
typedef struct {
    dt_f16 d;                       /* super-block scale for the 6-bit scales */
    dt_f16 dmin;                    /* super-block scale for the 6-bit mins */
    uint8_t scales[K_SCALE_SIZE];   /* 8 scales + 8 mins, 6 bits each, packed */
    uint8_t qs[QK_K / 2];           /* 4-bit quants */
} block_q4_K;                       /* 144 bytes */
typedef struct {
    dt_f16 d;                       /* super-block scale for the 6-bit scales */
    dt_f16 dmin;                    /* super-block scale for the 6-bit mins */
    uint8_t scales[K_SCALE_SIZE];   /* as Q4_K's */
    uint8_t qh[QK_K / 8];           /* 5th bits: bit 2c of byte l for element 64c + l, bit 2c+1 for 64c + 32 + l */
    uint8_t qs[QK_K / 2];           /* low 4 bits, as Q4_K's quants */
} block_q5_K;                       /* 176 bytes */
typedef struct {
    uint8_t ql[QK_K / 2];           /* low 4 bits */
    uint8_t qh[QK_K / 4];           /* high 2 bits */
    int8_t scales[QK_K / 16];       /* 16 8-bit scales */
    dt_f16 d;                       /* super-block scale */
} block_q6_K;                       /* 210 bytes */
typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
} block_q8_K;                       /* activation type for K-quant dot products */
/* value = d (sc & 15) q - dmin (sc >> 4), 16 sub-blocks of 16, q 0..3: element
 * 128h + 32j + l (l < 32) is bits 2j..2j+1 of qs[32h + l], its sub-block 8h + 2j + l / 16 */
typedef struct {
    uint8_t scales[QK_K / 16];      /* per sub-block: scale in the low nibble, min in the high one */
    uint8_t qs[QK_K / 4];           /* 2-bit quants */
    dt_f16 d;                       /* super-block scale for the scales */
    dt_f16 dmin;                    /* super-block scale for the mins */
} block_q2_K;                       /* 84 bytes */
/* value = d (s - 32) q, q = low 2 bits (as Q2_K's) - 4 unless the element's
 * hmask bit is set: element 128h + 32j + l has bit 4h + j of hmask[l]. The 16
 * 6-bit scales s: low 4 bits in nibble i / 8 of scales[i % 8], high 2 bits at
 * bit 2 (i / 4) of scales[8 + i % 4]. */
typedef struct {
    uint8_t hmask[QK_K / 8];        /* high bits of the quants */
    uint8_t qs[QK_K / 4];           /* low 2 bits */
    uint8_t scales[K_SCALE_SIZE];   /* 16 scales, 6 bits each, packed */
    dt_f16 d;                       /* super-block scale */
} block_q3_K;                       /* 110 bytes */
#define QK4_NL 32
/* value = d dt_kvalues_iq4nl[nibble], nibbles as Q4_0's (element j in byte j % 16, low for j < 16) */
typedef struct { dt_f16 d; uint8_t qs[QK4_NL / 2]; } block_iq4_nl;       /* 18 bytes */
/* 8 sub-blocks of 32 laid out as IQ4_NL's quants, value = d (ls - 32)
 * kvalue[nibble]; the 6-bit ls of sub-block i: nibble i % 2 of scales_l[i / 2],
 * high 2 bits at bit 2i of scales_h */
typedef struct {
    dt_f16 d;
    uint16_t scales_h;
    uint8_t scales_l[QK_K / 64];
    uint8_t qs[QK_K / 2];
} block_iq4_xs;                     /* 136 bytes */
/* The codebook types (dtype/iq.h): each group of 8 weights is a point of a
 * fixed lattice codebook, looked up by index, times a sign pattern (IQ2, IQ3)
 * or plus a shift of +-1/8 (IQ1), times a 3- or 4-bit scale per 16 or 32
 * weights and the block's f16 d. Bit fields of sub-block ib (32 weights) in
 * dtype/iq.h; the layouts are ggml's, byte for byte. */
/* 2.0625 bits: per sub-block two u32 (qs[4ib..]), the first 4 byte-wide point
 * indices, the second 4 x 7-bit sign indices and a 4-bit scale on top */
typedef struct { dt_f16 d; uint16_t qs[QK_K / 8]; } block_iq2_xxs;                          /* 66 bytes */
/* 2.3125 bits: qs = 9-bit point index | 7-bit sign index << 9; a 4-bit scale per 16 */
typedef struct { dt_f16 d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; } block_iq2_xs; /* 74 bytes */
/* 2.5625 bits: 10-bit point indices (low bytes qs[0..31], 2 high bits each in
 * qh), 8 sign bits per group (qs[32..63]), a 4-bit scale per 16 */
typedef struct { dt_f16 d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; } block_iq2_s; /* 82 bytes */
/* 3.0625 bits: 8-bit indices of 4-weight points (qs[0..63]), then per
 * sub-block a u32 of 4 x 7-bit sign indices and a 4-bit scale */
typedef struct { dt_f16 d; uint8_t qs[3 * QK_K / 8]; } block_iq3_xxs;                        /* 98 bytes */
/* 3.4375 bits: 9-bit indices of 4-weight points (low bytes qs, high bits qh),
 * 8 sign bits per group, a 4-bit scale per sub-block */
typedef struct {
    dt_f16 d;
    uint8_t qs[QK_K / 4];
    uint8_t qh[QK_K / 32];
    uint8_t signs[QK_K / 8];
    uint8_t scales[QK_K / 64];
} block_iq3_s;                                                                              /* 110 bytes */
/* 1.5625 bits: 11-bit indices of ternary points (low bytes qs, 3 high bits
 * each in qh[ib]), qh[ib]'s bits 12..14 a 3-bit scale, bit 15 the shift's sign */
typedef struct { dt_f16 d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; } block_iq1_s;    /* 50 bytes */
/* 1.75 bits: IQ1_S's points with a shift per group (qh), 3-bit scales per 16,
 * and the f16 d spread over the top nibbles of the four u16 of scales */
typedef struct { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; } block_iq1_m; /* 56 bytes */
_Static_assert(sizeof(block_iq2_xxs) == 66 && sizeof(block_iq2_xs) == 74 && sizeof(block_iq2_s) == 82, "iq2 layouts");
_Static_assert(sizeof(block_iq3_xxs) == 98 && sizeof(block_iq3_s) == 110, "iq3 layouts");
_Static_assert(sizeof(block_iq1_s) == 50 && sizeof(block_iq1_m) == 56, "iq1 layouts");
/* The 16 non-uniform levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl). */
extern const int8_t dt_kvalues_iq4nl[16];
/* The ternary types (dtype/tq.h): weight = d (code - 1), code 0..2.
 * TQ1_0, 1.6875 bits: five codes per byte of qs as the base-3 fraction
 * (c0 c1 c2 c3 c4)_3 / 243 rounded up to 8 bits (code n of byte m of qs[0..31]
 * is element 32n + m, of qs[32..47] element 160 + 16n + m), four per byte of
 * qh (element 240 + 4n + j, the fifth code 0). TQ2_0, 2.0625 bits: code l of
 * byte 32h + m (bits 2l..2l+1) is element 128h + 32l + m. */
typedef struct { uint8_t qs[48]; uint8_t qh[4]; dt_f16 d; } block_tq1_0; /* 54 bytes */
typedef struct { uint8_t qs[QK_K / 4]; dt_f16 d; } block_tq2_0;          /* 66 bytes */
/* MXFP4 (OCP microscaling, gpt-oss): 32 FP4 (E2M1) values, nibbles as
 * IQ4_NL's, times the power of two e (E8M0, bias 127). The levels are held
 * doubled as integers (dt_kvalues_mxfp4), so value = dt_e8m0_half(e) level. */
typedef struct { uint8_t e; uint8_t qs[16]; } block_mxfp4;               /* 17 bytes */
extern const int8_t dt_kvalues_mxfp4[16];
/* 2^(e - 128): half the E8M0 scale (e = 0 and 1 are subnormal floats; 255,
 * NaN in the OCP format, reads as 2^127 as in ggml). */
static inline float dt_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
_Static_assert(sizeof(block_tq1_0) == 54 && sizeof(block_tq2_0) == 66 && sizeof(block_mxfp4) == 17,
               "tq1_0 tq2_0 mxfp4 layouts");
_Static_assert(sizeof(block_q2_K) == 84 && sizeof(block_q3_K) == 110, "q2_K q3_K layouts");
_Static_assert(sizeof(block_iq4_nl) == 18 && sizeof(block_iq4_xs) == 136, "iq4_nl iq4_xs layouts");

_Static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
_Static_assert(sizeof(block_q4_1) == 20 && sizeof(block_q5_0) == 22 && sizeof(block_q5_1) == 24, "q4_1 q5_0 q5_1 layouts");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K layout");
_Static_assert(sizeof(block_q8_K) == 292, "q8_K layout");

typedef struct {
    const char *name;    /* "f32", "q8_0", ...; NULL = unsupported id */
    int block_size;      /* elements per block */
    size_t type_size;    /* bytes per block */
} dt_traits;

/* Traits of a type id; NULL if the id is unknown or unsupported. */
const dt_traits *dt_info(int type);
/* Name of a type id ("q4_K"); also names the ggml types kvlm cannot compute
 * with ("q5_K", "iq2_xxs", ...); "unknown" for ids that are no ggml type. */
const char *dt_name(int type);
/* Block layout of any ggml type id, supported or not (so that a GGUF file
 * holding e.g. q5_K tensors can still be opened and listed); NULL for ids
 * that are no ggml type. Computing code must use dt_info instead. */
const dt_traits *dt_layout(int type);
/* Type id for a name ("q8_0", "Q8_0", "f16", ...), or -1. */
int dt_from_name(const char *name);
/* The alignment a type's elements (blocks) need in memory, as the C
 * structs that read them in place have it: f32 4, f16 2, a block with f16 or
 * u16 fields 2, MXFP4's byte blocks 1. Any known id (dt_layout). */
size_t dt_align(int type);
/* Bytes for n elements (n must be a multiple of the block size; 0 if not). */
size_t dt_row_size(int type, int64_t n);

/* Scalar reference conversions. n must be a multiple of the block size. */
void dt_dequantize_row(int type, const void *src, float *dst, int64_t n);
/* Returns 0, or -1 if the type has no quantizer. */
int dt_quantize_row(int type, const float *src, void *dst, int64_t n);

/* Half-precision conversions (round to nearest even). */
static inline float dt_f16_to_f32(dt_f16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) bits = sign;
        else { /* subnormal: normalise */
            int e = -1;
            do { e++; mant <<= 1; } while (!(mant & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (mant << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline dt_f16 dt_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (dt_f16)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (dt_f16)(sign | 0x7c00); /* overflow -> inf */
    if (ax < 0x38800000u) { /* subnormal or zero in half */
        if (ax < 0x33000000u) return (dt_f16)sign;
        uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (dt_f16)(sign | r);
    }
    uint32_t r = ((ax - 0x38000000u) >> 13);
    uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (dt_f16)(sign | r);
}
static inline float dt_bf16_to_f32(dt_bf16 h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline dt_bf16 dt_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (dt_bf16)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (dt_bf16)(x >> 16);
}
#endif
