/* ops/matmul_kq: unpacking helpers for the K-quant weight blocks (6-bit
 * scales of Q4_K, 6-bit quants of Q6_K), shared by the scalar and SIMD kernels. */
#ifndef KVLM_OPS_MATMUL_KQ_H
#define KVLM_OPS_MATMUL_KQ_H
#include <stdint.h>
#include "dtype/dtype.h"

/* The 8 scales and 8 mins (6 bits each) of a Q4_K block: entries 0..3 in the
 * low 6 bits of bytes 0..3 (scales) and 4..7 (mins); entries 4..7 take their
 * low 4 bits from bytes 8..11 and their top 2 bits from the spare top bits of
 * bytes 0..7. */
static inline void op_q4k_scales(const uint8_t s[K_SCALE_SIZE], uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* The 256 quants of a Q6_K block as signed values q - 32 in element order.
 * Per 128 elements: ql holds 64 bytes (low nibbles: elements 0..63, high
 * nibbles: 64..127), qh 32 bytes with 2 bits for each of l, l+32, l+64, l+96. */
static inline void op_q6k_unpack(const block_q6_K *b, int8_t q[QK_K]) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        int8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (int8_t)(((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32);
            o[l + 32] = (int8_t)(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

/* The 16 signed scales (6-bit codes less 32) of a Q3_K block: scale i has its
 * low 4 bits in nibble i / 8 of byte i % 8 and its high 2 bits at bit
 * 2 (i / 4) of byte 8 + i % 4. */
static inline void op_q3k_scales(const uint8_t s[K_SCALE_SIZE], int8_t sc[16]) {
    for (int i = 0; i < 16; i++)
        sc[i] = (int8_t)((((s[i % 8] >> (4 * (i / 8))) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32);
}

/* IQ4_XS sub-block i's signed scale: nibble i % 2 of scales_l[i / 2], high
 * bits at bit 2i of scales_h, less 32. */
static inline int op_iq4xs_scale(const block_iq4_xs *b, int i) {
    return (((b->scales_l[i / 2] >> (4 * (i % 2))) & 15) | (((b->scales_h >> (2 * i)) & 3) << 4)) - 32;
}
#endif
