/* dtype/tq: ggml's ternary weight types TQ1_0 and TQ2_0, the format of
 * ternary-trained models (BitNet b1.58, TriLM): every weight of a 256-weight
 * block is d · {-1, 0, +1}, with one f16 d per block (layouts in
 * dtype/dtype.h).
 *
 * Here: the unpacking of a block into its 256 codes 0..2 (weight = d (code -
 * 1)) in element order, which the dequantizer and the scalar kernels share,
 * and the quantizer (tq.c). */
#ifndef KVLM_DTYPE_TQ_H
#define KVLM_DTYPE_TQ_H
#include <stdint.h>
#include "dtype/dtype.h"

static inline int dt_is_tq(int type) { return type == DT_TQ1_0 || type == DT_TQ2_0; }

/* Code n (0: the most significant) of a TQ1_0 byte q. q is the fraction
 * (c0 ... c4)_3 / 243 scaled to 256 and rounded up, so multiplying it by 3^n
 * (mod 256) leaves the fraction that starts at code n, and 3 times that,
 * over 256, is code n. */
static inline int dt_tq1_code(uint8_t q, int n) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    return ((unsigned)(uint8_t)(q * pow3[n]) * 3) >> 8;
}

static inline float dt_tq_d(int type, const void *block) {
    return dt_f16_to_f32(type == DT_TQ1_0 ? ((const block_tq1_0 *)block)->d : ((const block_tq2_0 *)block)->d);
}

/* The 256 codes of a block, element order. */
static inline void dt_tq_unpack(int type, const void *block, uint8_t u[QK_K]) {
    if (type == DT_TQ2_0) {
        const block_tq2_0 *b = block;
        for (int e = 0; e < QK_K; e++) u[e] = (uint8_t)((b->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3);
        return;
    }
    const block_tq1_0 *b = block;
    for (int n = 0; n < 5; n++) {
        for (int m = 0; m < 32; m++) u[32 * n + m] = (uint8_t)dt_tq1_code(b->qs[m], n);
        for (int m = 0; m < 16; m++) u[160 + 16 * n + m] = (uint8_t)dt_tq1_code(b->qs[32 + m], n);
    }
    for (int n = 0; n < 4; n++)
        for (int j = 0; j < 4; j++) u[240 + 4 * n + j] = (uint8_t)dt_tq1_code(b->qh[j], n);
}

/* nb blocks of each type (tq.c). The quantizer is a least-squares ternary
 * fit per block: the k largest magnitudes become ±d with d their mean, for
 * the k that leaves the least error (on weights that are ternary already,
 * the exact d and codes, as ggml's absmax rule gives them). */
void dt_tq_dequantize(int type, const void *src, float *dst, int64_t nb);
void dt_tq_quantize(int type, const float *src, void *dst, int64_t nb);

#endif
