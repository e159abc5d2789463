/* ops/pack: the packed 16-row weight layouts of the CPU backend (ops.h):
 * their sizes, and the packers the type table (type_traits.c) names. */
#include <string.h>
#include "dtype/dtype.h"
#include "ops/matmul_kq.h"
#include "ops/type_traits.h"

int op_pack_type(int wtype) {
    const op_type_traits *t = op_type_traits_of(wtype);
    return t && op_simd_level() >= OP_SIMD_VNNI ? t->packed : -1;
}

size_t op_pack_row_size(int wtype, int n_in) {
    const op_type_traits *t = op_type_traits_of(wtype);
    if (!t) return dt_row_size(wtype, n_in);
    if (!t->group_block_bytes) return dt_row_size(t->base, n_in);
    const int bs = dt_info(t->base)->block_size;
    return n_in > 0 && n_in % bs == 0 ? (size_t)(n_in / bs) * (size_t)t->group_block_bytes / 16 : 0;
}

size_t op_pack_size(int wtype, int n_in, int n_out) {
    const op_type_traits *t = op_type_traits_of(wtype);
    if (!t || t->packed < 0) return 0; /* the layout is the same on every CPU */
    return (size_t)(n_out + 15) / 16 * 16 * op_pack_row_size(t->packed, n_in);
}

void op_pack(int wtype, const void *src, void *dst, int n_in, int n_out) {
    const op_type_traits *t = op_type_traits_of(wtype);
    if (t && t->pack) t->pack(wtype, src, dst, n_in, n_out);
}

/* Q4_K (or with q5 Q5_K) into OP_Q4_K_R16 (OP_Q5_K_R16; ops.h): per group
 * and super-block the d, dmin, scales and mins of the 16 rows, then the
 * quants' low 4 bits in 4-byte chunks (then Q5_K's 5th bits). */
void op_pack_kquant(int wtype, const void *src, void *dst, int n_in, int n_out) {
    const int q5 = wtype == DT_Q5_K;
    const int nb = n_in / QK_K;
    const size_t rs = dt_row_size(q5 ? DT_Q5_K : DT_Q4_K, n_in), bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    static const block_q5_K zero; /* rows past n_out: scales 0, quants 0 */
    uint8_t *d = dst;
    for (int g = 0; g < (n_out + 15) / 16; g++)
        for (int b = 0; b < nb; b++, d += q5 ? OP_Q5K_R16_BYTES : OP_Q4K_R16_BYTES)
            for (int j = 0; j < 16; j++) {
                int r = g * 16 + j;
                /* Q5_K starts as Q4_K: d, dmin, scales */
                const block_q4_K *blk =
                    r < n_out ? (const block_q4_K *)((const uint8_t *)src + (size_t)r * rs + (size_t)b * bs)
                              : (const block_q4_K *)&zero;
                const uint8_t *qs = q5 ? ((const block_q5_K *)blk)->qs : blk->qs;
                uint8_t sc[8], mn[8];
                op_q4k_scales(blk->scales, sc, mn);
                memcpy(d + 2 * j, &blk->d, sizeof(dt_f16));
                memcpy(d + 32 + 2 * j, &blk->dmin, sizeof(dt_f16));
                for (int s = 0; s < 8; s++) {
                    d[64 + 16 * s + j] = sc[s];
                    d[192 + 16 * s + j] = mn[s];
                }
                for (int p = 0; p < 4; p++)
                    for (int k = 0; k < 8; k++) memcpy(d + 320 + 512 * p + 64 * k + 4 * j, qs + 32 * p + 4 * k, 4);
                if (!q5) continue;
                /* column 32s + t's 5th bit is bit s of qh[t] in Q5_K too: chunk k takes qh[4k..4k+3] */
                for (int k = 0; k < 8; k++)
                    memcpy(d + OP_Q4K_R16_BYTES + 64 * k + 4 * j, ((const block_q5_K *)blk)->qh + 4 * k, 4);
            }
}

/* Q6_K into OP_Q6_K_R16 (ops.h): per group and super-block the d and
 * scales of the 16 rows, then the quants + 32 split into nibbles and top bits. */
void op_pack_q6_K(int wtype, const void *src, void *dst, int n_in, int n_out) {
    (void)wtype;
    const int nb = n_in / QK_K;
    const size_t rs = dt_row_size(DT_Q6_K, n_in);
    static const block_q6_K zero; /* rows past n_out: scales 0 */
    uint8_t *d = dst;
    for (int g = 0; g < (n_out + 15) / 16; g++)
        for (int b = 0; b < nb; b++, d += OP_Q6K_R16_BYTES) {
            for (int j = 0; j < 16; j++) {
                int r = g * 16 + j;
                const block_q6_K *blk = r < n_out ? (const block_q6_K *)((const uint8_t *)src + (size_t)r * rs) + b : &zero;
                int8_t q[QK_K];
                op_q6k_unpack(blk, q);
                memcpy(d + 2 * j, &blk->d, sizeof(dt_f16));
                for (int s = 0; s < 16; s++) d[32 + 16 * s + j] = (uint8_t)blk->scales[s];
                uint8_t v[QK_K]; /* q + 32: 0..63 */
                for (int e = 0; e < QK_K; e++) v[e] = (uint8_t)(q[e] + 32);
                for (int k = 0; k < 8; k++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t *c = v + 4 * k + i; /* unit u's column: c[32 u] */
                        for (int p = 0; p < 4; p++)
                            d[288 + 512 * p + 64 * k + 4 * j + i] = (uint8_t)((c[64 * p] & 15) | (c[64 * p + 32] & 15) << 4);
                        for (int h = 0; h < 2; h++)
                            d[2336 + 512 * h + 64 * k + 4 * j + i] =
                                (uint8_t)(c[128 * h] >> 4 | (c[128 * h + 32] >> 4) << 2 | (c[128 * h + 64] >> 4) << 4 |
                                          (c[128 * h + 96] >> 4) << 6);
                    }
            }
        }
}

/* Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL, MXFP4 into their packed types (ops.h):
 * per group and block the 16 rows' scales (and mins; MXFP4: its exponent
 * bytes), then the quants in 4-byte chunks (and Q5's 5th bits regrouped). */
void op_pack_legacy(int wtype, const void *src, void *dst, int n_in, int n_out) {
    const int nb = n_in / 32, hm = wtype == DT_Q4_1 || wtype == DT_Q5_1, q5 = wtype == DT_Q5_0 || wtype == DT_Q5_1;
    const int mx = wtype == DT_MXFP4, sb = mx ? 1 : 2; /* bytes of a row's scale */
    const int q4 = wtype != DT_Q8_0, qs_at = mx ? 16 : hm ? 64 : 32; /* nibble chunks after the scales (and mins) */
    const size_t rs = dt_row_size(wtype, n_in), bs = dt_row_size(wtype, 32);
    const int chunks = q4 ? 4 : 8;
    static const uint8_t zero[sizeof(block_q8_0)]; /* rows past n_out: scale 0, quants 0 */
    uint8_t *d = dst;
    for (int g = 0; g < (n_out + 15) / 16; g++)
        for (int b = 0; b < nb; b++, d += 16 * bs)
            for (int j = 0; j < 16; j++) {
                int r = g * 16 + j;
                const uint8_t *blk = r < n_out ? (const uint8_t *)src + (size_t)r * rs + (size_t)b * bs : zero;
                memcpy(d + sb * j, blk, (size_t)sb); /* every such block starts with its scale */
                if (hm) memcpy(d + 32 + 2 * j, blk + 2, sizeof(dt_f16)); /* then Q4_1's and Q5_1's min */
                const uint8_t *qs = blk + sb + 2 * hm + 4 * q5;
                if (q5) { /* the 5th bits, regrouped by chunk (ops.h) */
                    uint32_t h;
                    memcpy(&h, blk + 2 + 2 * hm, 4);
                    for (int i = 0; i < 4; i++) {
                        uint8_t v = 0;
                        for (int k = 0; k < 4; k++)
                            v |= (uint8_t)((h >> (4 * k + i) & 1) << k | (h >> (16 + 4 * k + i) & 1) << (4 + k));
                        d[qs_at + 256 + 4 * j + i] = v;
                    }
                }
                for (int k = 0; k < chunks; k++) { /* 4 bytes at a time; w + 128 flips the sign bit */
                    uint32_t v;
                    memcpy(&v, qs + 4 * k, 4);
                    if (!q4) v ^= 0x80808080u;
                    memcpy(d + qs_at + 64 * k + 4 * j, &v, 4);
                }
            }
}


/* IQ4_XS into OP_IQ4_XS_R16 (ops.h): per group and super-block the d and
 * signed sub-block scales of the 16 rows, then each sub-block's quant bytes
 * in 4-byte chunks. */
void op_pack_iq4_xs(int wtype, const void *src, void *dst, int n_in, int n_out) {
    (void)wtype;
    const int nb = n_in / QK_K;
    const size_t rs = dt_row_size(DT_IQ4_XS, n_in);
    static const block_iq4_xs zero; /* rows past n_out: d 0 */
    uint8_t *d = dst;
    for (int g = 0; g < (n_out + 15) / 16; g++)
        for (int b = 0; b < nb; b++, d += OP_IQ4XS_R16_BYTES)
            for (int j = 0; j < 16; j++) {
                int r = g * 16 + j;
                const block_iq4_xs *blk = r < n_out ? (const block_iq4_xs *)((const uint8_t *)src + (size_t)r * rs) + b : &zero;
                memcpy(d + 2 * j, &blk->d, sizeof(dt_f16));
                for (int s = 0; s < 8; s++) {
                    d[32 + 16 * s + j] = (uint8_t)(int8_t)op_iq4xs_scale(blk, s);
                    for (int k = 0; k < 4; k++) memcpy(d + 160 + 256 * s + 64 * k + 4 * j, blk->qs + 16 * s + 4 * k, 4);
                }
            }
}

/* Q2_K / Q3_K into OP_Q2_K_R16 / OP_Q3_K_R16 (ops.h): per group and
 * super-block the 16 rows' d (and Q2_K's dmin), their scales, then the 2-bit
 * fields in 4-byte chunks (and Q3_K's hmask bits as one 64-bit mask per
 * 32-column unit and chunk). */
void op_pack_q23k(int wtype, const void *src, void *dst, int n_in, int n_out) {
    const int q3 = wtype == DT_Q3_K, nb = n_in / QK_K;
    const size_t rs = dt_row_size(wtype, n_in), bs = q3 ? sizeof(block_q3_K) : sizeof(block_q2_K);
    static const block_q3_K zero; /* rows past n_out: d 0 (the larger of the two blocks) */
    const int qs_at = q3 ? 288 : 320;
    uint8_t *d = dst;
    for (int g = 0; g < (n_out + 15) / 16; g++)
        for (int b = 0; b < nb; b++, d += q3 ? OP_Q3K_R16_BYTES : OP_Q2K_R16_BYTES)
            for (int j = 0; j < 16; j++) {
                int r = g * 16 + j;
                const uint8_t *blk = r < n_out ? (const uint8_t *)src + (size_t)r * rs + (size_t)b * bs : (const uint8_t *)&zero;
                const block_q2_K *b2 = (const block_q2_K *)blk;
                const block_q3_K *b3 = (const block_q3_K *)blk;
                const uint8_t *qs = q3 ? b3->qs : b2->qs;
                if (q3) {
                    int8_t sc[16];
                    op_q3k_scales(b3->scales, sc);
                    memcpy(d + 2 * j, &b3->d, sizeof(dt_f16));
                    for (int s = 0; s < 16; s++) d[32 + 16 * s + j] = (uint8_t)sc[s];
                    if (j == 0) memset(d + 1312, 0, 512); /* the hmask bits are or-ed in row by row */
                    for (int sh = 0; sh < 8; sh++)
                        for (int k = 0; k < 8; k++)
                            for (int i = 0; i < 4; i++)
                                d[1312 + 64 * sh + 8 * k + j / 2] |= (uint8_t)(((b3->hmask[4 * k + i] >> sh) & 1) << (4 * (j % 2) + i));
                } else {
                    memcpy(d + 2 * j, &b2->d, sizeof(dt_f16));
                    memcpy(d + 32 + 2 * j, &b2->dmin, sizeof(dt_f16));
                    for (int s = 0; s < 16; s++) d[64 + 16 * s + j] = b2->scales[s];
                }
                for (int h = 0; h < 2; h++)
                    for (int k = 0; k < 8; k++) memcpy(d + qs_at + 512 * h + 64 * k + 4 * j, qs + 32 * h + 4 * k, 4);
            }
}
