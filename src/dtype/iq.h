/* dtype/iq: ggml's codebook weight types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
 * IQ3_S, IQ1_S and IQ1_M (block layouts in dtype/dtype.h). Each group of 8
 * weights (IQ3: each half of one) is a point of a fixed lattice codebook,
 * looked up by index, with a sign per weight (IQ2, IQ3) or a shift of ±1/8
 * (IQ1), times an odd scale ls per 16 or 32 weights and the block's f16 d.
 *
 * Here: the codebooks (expanded at load from iq_grids.c), the unpacking of a
 * 32-weight sub-block into integers w[32] and ls[2] such that
 *     weight j = d · ls[j / 16] · w[j] / dt_iq_div(type)
 * (IQ1: w = 8·g ± 1 for the ternary point coordinate g), which the
 * dequantizer and the scalar kernels share, and the quantizers. */
#ifndef KVLM_DTYPE_IQ_H
#define KVLM_DTYPE_IQ_H
#include <stdint.h>
#include <string.h>
#include "dtype/dtype.h"

/* The codebooks as ggml's tables hold them: byte j of an entry is coordinate
 * j. IQ2 points: 8 magnitudes of 8, 25 or 43; IQ3_XXS: 4 magnitudes of 4, 12,
 * ..., 52, 62; IQ3_S: 4 of 1, 3, ..., 15; IQ1: 8 int8 coordinates -1, 0, 1. */
extern uint64_t dt_iq2xxs_grid[256], dt_iq2xs_grid[512], dt_iq2s_grid[1024], dt_iq1s_grid[2048];
extern uint32_t dt_iq3xxs_grid[256], dt_iq3s_grid[512];
/* The same points stored compactly (iq_grids.c): 2 bits per coordinate
 * (the level's index) for IQ2 and IQ1, 3 bits for IQ3, coordinate 0 lowest. */
extern const uint16_t dt_iq_points_iq2xxs[256], dt_iq_points_iq2xs[512], dt_iq_points_iq2s[1024],
    dt_iq_points_iq1s[2048], dt_iq_points_iq3xxs[256], dt_iq_points_iq3s[512];
/* A 7-bit sign index i stands for the byte i with bit 7 set where i has an
 * odd number of bits (every pattern has an even number of minus signs). */
extern uint8_t dt_iq_ksigns[128];
/* The 8 bits of a byte as 8 bytes, 0xff (-1) where set and 0x01 where not;
 * dt_iq_ksigns64[i] = dt_iq_signs64[dt_iq_ksigns[i]]. */
extern uint64_t dt_iq_signs64[256], dt_iq_ksigns64[128];

#define IQ1_DELTA 0.125f /* IQ1's shift, ggml's IQ1S_DELTA */

static inline int dt_is_iq(int type) {
    return type == DT_IQ2_XXS || type == DT_IQ2_XS || type == DT_IQ2_S || type == DT_IQ3_XXS || type == DT_IQ3_S ||
           type == DT_IQ1_S || type == DT_IQ1_M;
}
/* The power of two the integers are over: w / div is the weight in units of d · ls. */
static inline int dt_iq_div(int type) {
    return type == DT_IQ3_S ? 1 : type == DT_IQ3_XXS ? 4 : 8;
}
static inline uint32_t dt_iq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline uint16_t dt_iq_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
/* IQ1_M's d: the top nibbles of its four u16 scale words, in order. */
static inline dt_f16 dt_iq1m_d(const block_iq1_m *b) {
    const uint8_t *s = b->scales;
    return (dt_f16)((dt_iq_u16(s) >> 12) | ((dt_iq_u16(s + 2) >> 8) & 0x00f0) | ((dt_iq_u16(s + 4) >> 4) & 0x0f00) |
                    (dt_iq_u16(s + 6) & 0xf000));
}
static inline float dt_iq_d(int type, const void *block) {
    return dt_f16_to_f32(type == DT_IQ1_M ? dt_iq1m_d(block) : *(const dt_f16 *)block);
}
/* Stores a block's d (IQ1_M: in the top nibbles of its four u16 scale words). */
static inline void dt_iq_set_d(int type, void *block, dt_f16 d) {
    if (type != DT_IQ1_M) {
        memcpy(block, &d, 2);
        return;
    }
    uint8_t *hi = ((block_iq1_m *)block)->scales + 1; /* the high bytes, little-endian */
    for (int k = 0; k < 4; k++) hi[2 * k] = (uint8_t)((hi[2 * k] & 0x0f) | ((d >> (4 * k)) & 15) << 4);
}

/* 8 signed magnitudes: byte j of grid, negative where bit j of signs is set. */
static inline void iq_signed8(uint64_t grid, unsigned signs, int8_t *w) {
    for (int j = 0; j < 8; j++) {
        int g = (int)((grid >> (8 * j)) & 255);
        w[j] = (int8_t)((signs >> j) & 1 ? -g : g);
    }
}
/* 8 IQ1 integers 8 g + shift (shift = ±1). */
static inline void iq_ternary8(uint64_t grid, int shift, int8_t *w) {
    for (int j = 0; j < 8; j++) w[j] = (int8_t)(8 * (int8_t)((grid >> (8 * j)) & 255) + shift);
}

/* Sub-block ib (weights 32 ib .. 32 ib + 31) of a block of an IQ type. */
static inline void dt_iq_unpack(int type, const void *block, int ib, int8_t w[32], int ls[2]) {
    switch (type) {
    case DT_IQ2_XXS: { /* u32 of 4 point indices, u32 of 4 sign indices (7 bits each) and the scale */
        const uint8_t *q = (const uint8_t *)((const block_iq2_xxs *)block)->qs + 8 * ib;
        const uint32_t a0 = dt_iq_u32(q), a1 = dt_iq_u32(q + 4);
        ls[0] = ls[1] = 2 * (int)(a1 >> 28) + 1;
        for (int l = 0; l < 4; l++) iq_signed8(dt_iq2xxs_grid[(a0 >> (8 * l)) & 255], dt_iq_ksigns[(a1 >> (7 * l)) & 127], w + 8 * l);
        break;
    }
    case DT_IQ2_XS: { /* u16: 9-bit point index, 7-bit sign index */
        const block_iq2_xs *b = block;
        ls[0] = 2 * (b->scales[ib] & 15) + 1;
        ls[1] = 2 * (b->scales[ib] >> 4) + 1;
        for (int l = 0; l < 4; l++) {
            const unsigned v = dt_iq_u16((const uint8_t *)b->qs + 2 * (4 * ib + l));
            iq_signed8(dt_iq2xs_grid[v & 511], dt_iq_ksigns[v >> 9], w + 8 * l);
        }
        break;
    }
    case DT_IQ2_S: { /* index bits 8..9 at bits 2l..2l+1 of qh[ib]; 8 sign bits per group */
        const block_iq2_s *b = block;
        ls[0] = 2 * (b->scales[ib] & 15) + 1;
        ls[1] = 2 * (b->scales[ib] >> 4) + 1;
        for (int l = 0; l < 4; l++) {
            const unsigned idx = b->qs[4 * ib + l] | ((b->qh[ib] << (8 - 2 * l)) & 0x300);
            iq_signed8(dt_iq2s_grid[idx], b->qs[QK_K / 8 + 4 * ib + l], w + 8 * l);
        }
        break;
    }
    case DT_IQ3_XXS: { /* 8 indices of 4-weight points, then the u32 of sign indices and scale */
        const block_iq3_xxs *b = block;
        const uint8_t *q = b->qs + 8 * ib;
        const uint32_t a = dt_iq_u32(b->qs + QK_K / 4 + 4 * ib);
        ls[0] = ls[1] = 2 * (int)(a >> 28) + 1;
        for (int l = 0; l < 4; l++) {
            const uint64_t g = dt_iq3xxs_grid[q[2 * l]] | (uint64_t)dt_iq3xxs_grid[q[2 * l + 1]] << 32;
            iq_signed8(g, dt_iq_ksigns[(a >> (7 * l)) & 127], w + 8 * l);
        }
        break;
    }
    case DT_IQ3_S: { /* index bit 8 of point k (0..7) at bit k of qh[ib]; 8 sign bits per group */
        const block_iq3_s *b = block;
        const uint8_t *q = b->qs + 8 * ib;
        ls[0] = ls[1] = 2 * ((b->scales[ib / 2] >> (4 * (ib % 2))) & 15) + 1;
        for (int l = 0; l < 4; l++) {
            const unsigned i1 = q[2 * l] | ((b->qh[ib] << (8 - 2 * l)) & 256);
            const unsigned i2 = q[2 * l + 1] | ((b->qh[ib] << (7 - 2 * l)) & 256);
            iq_signed8(dt_iq3s_grid[i1] | (uint64_t)dt_iq3s_grid[i2] << 32, b->signs[4 * ib + l], w + 8 * l);
        }
        break;
    }
    case DT_IQ1_S: { /* qh[ib]: 3 index bits per group, the scale at bits 12..14, the shift's sign at 15 */
        const block_iq1_s *b = block;
        const unsigned h = dt_iq_u16((const uint8_t *)b->qh + 2 * ib);
        const int shift = h & 0x8000 ? -1 : 1;
        ls[0] = ls[1] = 2 * (int)((h >> 12) & 7) + 1;
        for (int l = 0; l < 4; l++) iq_ternary8(dt_iq1s_grid[b->qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8)], shift, w + 8 * l);
        break;
    }
    case DT_IQ1_M: { /* per group a nibble of qh: 3 index bits and the shift's sign; 3-bit scales per 16 */
        const block_iq1_m *b = block;
        const unsigned sc = dt_iq_u16(b->scales + 2 * (ib / 2)) >> (6 * (ib % 2));
        ls[0] = 2 * (int)(sc & 7) + 1;
        ls[1] = 2 * (int)((sc >> 3) & 7) + 1;
        for (int l = 0; l < 4; l++) {
            const unsigned nib = (b->qh[2 * ib + l / 2] >> (4 * (l % 2))) & 15;
            iq_ternary8(dt_iq1s_grid[b->qs[4 * ib + l] | ((nib & 7) << 8)], nib & 8 ? -1 : 1, w + 8 * l);
        }
        break;
    }
    default: memset(w, 0, 32); ls[0] = ls[1] = 0; break;
    }
}

/* Reference conversions of nb blocks (dtype.c's entry points call these). */
void dt_iq_dequantize(int type, const void *src, float *y, int64_t nb);
/* Quantizes nb blocks by least squares (no importance matrix): per group of
 * 8 weights the signs, then per scale group the best point of the codebook
 * for each of a range of scales, then d, then the scales' codes and the
 * points again against the scales as stored. */
void dt_iq_quantize(int type, const float *x, void *dst, int64_t nb);
#endif
