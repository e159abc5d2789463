/* ops/matmul_vnni: the kernels for CPUs with AVX512-VNNI, chosen at run time:
 * packed Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS weights
 * (OP_*_R16) with 512-bit vpdpbusd, and the ternary types unpacked. Other types, and unpacked
 * ones, use the AVX2 kernels. */
#include <string.h>
#include "dtype/dtype.h"
#include "dtype/tq.h"
#include "ops/type_traits.h"

#if defined(__x86_64__) || defined(__i386__)
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif
#include "ops/matmul_simd.h"

/* ---- OP_Q8_0_R16, OP_Q4_0_R16: packed weights with 512-bit vpdpbusd ---------
 * A 16-row group's block is 8 chunks of 64 bytes (Q8_0) or 4 (Q4_0, each
 * chunk's low nibbles then its high nibbles) (ops.h); each vpdpbusd takes one
 * chunk against one dword of the token's quants broadcast from memory, so the
 * 16 lanes are the 16 rows' partial dots and no horizontal sums or shuffles
 * are needed. The chunk registers of a block serve up to R16_C tokens. The
 * unsigned weights (Q8_0: w + 128, Q4_0: nibbles 0..15) are corrected by
 * starting from the token's -128 x (or -8 x) sum of the block's quants
 * (op_q8a_xc, exact /16 for Q4_0). Per (row, token) the block's integer dot is
 * exact and meets its scale in one FMA per block in column order, as in the
 * scalar kernels, so every path gives the same bits. A tile takes up to 16
 * tokens (16 float accumulators and the 8 chunk registers), so that at
 * T = 16 each group comes from L3 or memory once, not twice. */
#define R16_C 16
/* A chunk of groups is one contiguous run of weights, which the tiles read
 * faster than the hardware prefetcher brings it from L3 or memory: software
 * prefetch asks for the run R16_PF bytes ahead into L1 and also R16_PF_FAR
 * bytes ahead into L2, which keeps more lines in flight than the L1 fill
 * buffers allow, so decode from memory runs at the read bandwidth
 * (bench/results/matmul.md). */
#define R16_PF 4096
#define R16_PF_FAR 16384

AI int32_t ld32(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The weights R16_PF and R16_PF_FAR ahead of the `bytes` at p, into L1 and L2. */
AI void r16_prefetch(const uint8_t *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) {
        _mm_prefetch((const char *)p + R16_PF + o, _MM_HINT_T0);
        _mm_prefetch((const char *)p + R16_PF_FAR + o, _MM_HINT_T1);
    }
}

/* Q: 0 Q8_0, 1 Q4_0, 2 Q5_0 (Q4_0's chunks, then 64 bytes of 5th bits:
 * byte 4j + i holds bit k for element 4k + i, bit 4 + k for 16 + 4k + i),
 * 3 Q4_1 and 4 Q5_1 (the 16 f16 mins after the scales, then as Q4_0 / Q5_0;
 * no offset, and per block the min times dx times the token's sum), 5 IQ4_NL
 * (Q4_0's chunks, the nibbles looked up as level + 128 by vpshufb: Q8_0's
 * -128 x sum start), 6 MXFP4 (IQ4_NL's, over its levels, after 16 exponent
 * bytes: scales 2^(e - 128) by vscalefps). */
AI void r16_tile(const int Q, const int RN, int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y,
                 size_t ys, __mmask16 rows) {
    const int nb = n / 32, Q4 = Q > 0, HM = Q == 3 || Q == 4, H5 = Q == 2 || Q == 4, IQ = Q >= 5, MX = Q == 6;
    const int qs_at = MX ? 16 : HM ? 64 : 32;
    const size_t bsz = 16 * (Q == 0 ? sizeof(block_q8_0) : Q == 1 ? sizeof(block_q4_0) : Q == 2 ? sizeof(block_q5_0)
                             : Q == 3 ? sizeof(block_q4_1) : Q == 4 ? sizeof(block_q5_1)
                             : Q == 5 ? sizeof(block_iq4_nl) : sizeof(block_mxfp4));
    /* IQ4_NL's (MXFP4's) levels + 128 in every 128-bit lane */
    const __m512i kvu = IQ ? _mm512_broadcast_i32x4(_mm_xor_si128(
                                 _mm_loadu_si128((const __m128i *)(MX ? dt_kvalues_mxfp4 : dt_kvalues_iq4nl)),
                                 _mm_set1_epi8((char)0x80)))
                           : _mm512_setzero_si512();
    const __m512i m4 = _mm512_set1_epi8(0x0f), m10 = _mm512_set1_epi8(0x10);
    __m512 acc[R16_C];
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) acc[c] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (size_t)b * bsz;
        r16_prefetch(blk, bsz);
        const __m512 dw = MX ? _mm512_scalef_ps(_mm512_set1_ps(1.0f),
                                                _mm512_cvtepi32_ps(_mm512_sub_epi32(
                                                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk)),
                                                    _mm512_set1_epi32(128))))
                             : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        /* wk[k] pairs with the token's dword k */
        __m512i wk[8];
        if (Q4) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i raw = _mm512_loadu_si512(blk + qs_at + 64 * k);
                wk[k] = _mm512_and_si512(raw, m4);
                wk[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                if (H5) { /* bits k and 4 + k of the 5th-bit bytes to bit 4 */
                    const __m512i hb = _mm512_loadu_si512(blk + qs_at + 256);
                    wk[k] = _mm512_or_si512(wk[k], _mm512_and_si512(_mm512_slli_epi16(hb, 4 - k), m10));
                    wk[k + 4] = _mm512_or_si512(wk[k + 4], _mm512_and_si512(_mm512_srli_epi16(hb, k), m10));
                }
                if (IQ) {
                    wk[k] = _mm512_shuffle_epi8(kvu, wk[k]);
                    wk[k + 4] = _mm512_shuffle_epi8(kvu, wk[k + 4]);
                }
            }
        } else {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) wk[k] = _mm512_loadu_si512(blk + 32 + 64 * k);
        }
#pragma GCC unroll 16
        for (int c = 0; c < RN; c++) {
            const uint8_t *xr = x + (size_t)c * xs;
            const int8_t *xq = op_q8a_qs(xr) + b * 32;
            __m512i i0 = _mm512_set1_epi32(op_q8a_xc(xr, n)[b]), i1 = _mm512_setzero_si512();
            if (Q == 1 || Q == 2) i0 = _mm512_srai_epi32(i0, Q == 2 ? 3 : 4); /* -8 (Q5_0: -16) x sum */
            if (HM) i0 = i1;
            /* two chains halve the latency of the dependent vpdpbusd */
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2) {
                i0 = _mm512_dpbusd_epi32(i0, wk[k], _mm512_set1_epi32(ld32(xq + 4 * k)));
                i1 = _mm512_dpbusd_epi32(i1, wk[k + 1], _mm512_set1_epi32(ld32(xq + 4 * k + 4)));
            }
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(op_q8a_d(xr, n)[b]));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), s, acc[c]);
            if (HM) { /* + m dx sum, the sum from -128 x sum */
                const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
                acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(mw, _mm512_set1_ps(op_q8a_d(xr, n)[b])),
                                         _mm512_set1_ps((float)(-op_q8a_xc(xr, n)[b] / 128)), acc[c]);
            }
        }
    }
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_mask_storeu_ps(y + (size_t)c * ys, rows, acc[c]);
}

typedef void (*r16_fn)(int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y, size_t ys, __mmask16 rows);
/* The 16 token counts of a tile as functions, and their table: R16_FNS(pfx,
 * tile, v) defines pfx_v_1 .. pfx_v_16, each tile(v, rn, ...) with rn fixed;
 * R16_FNTAB(pfx, v) lists them. */
#define R16_FN(pfx, tile, v, rn)                                                                              \
    static void pfx##_##v##_##rn(int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y, size_t ys,     \
                                 __mmask16 rows) {                                                           \
        tile(v, rn, n, g, x, xs, y, ys, rows);                                                               \
    }
#define R16_FNS(pfx, tile, v)                                                                                 \
    R16_FN(pfx, tile, v, 1) R16_FN(pfx, tile, v, 2) R16_FN(pfx, tile, v, 3) R16_FN(pfx, tile, v, 4)           \
    R16_FN(pfx, tile, v, 5) R16_FN(pfx, tile, v, 6) R16_FN(pfx, tile, v, 7) R16_FN(pfx, tile, v, 8)           \
    R16_FN(pfx, tile, v, 9) R16_FN(pfx, tile, v, 10) R16_FN(pfx, tile, v, 11) R16_FN(pfx, tile, v, 12)        \
    R16_FN(pfx, tile, v, 13) R16_FN(pfx, tile, v, 14) R16_FN(pfx, tile, v, 15) R16_FN(pfx, tile, v, 16)
#define R16_FNTAB(pfx, v)                                                                                     \
    {pfx##_##v##_1,  pfx##_##v##_2,  pfx##_##v##_3,  pfx##_##v##_4,  pfx##_##v##_5,  pfx##_##v##_6,            \
     pfx##_##v##_7,  pfx##_##v##_8,  pfx##_##v##_9,  pfx##_##v##_10, pfx##_##v##_11, pfx##_##v##_12,           \
     pfx##_##v##_13, pfx##_##v##_14, pfx##_##v##_15, pfx##_##v##_16}
R16_FNS(r16, r16_tile, 0) R16_FNS(r16, r16_tile, 1) R16_FNS(r16, r16_tile, 2) R16_FNS(r16, r16_tile, 3)
R16_FNS(r16, r16_tile, 4) R16_FNS(r16, r16_tile, 5) R16_FNS(r16, r16_tile, 6)
static const r16_fn r16_tab[7][R16_C] = {R16_FNTAB(r16, 0), R16_FNTAB(r16, 1), R16_FNTAB(r16, 2),
                                         R16_FNTAB(r16, 3), R16_FNTAB(r16, 4), R16_FNTAB(r16, 5),
                                         R16_FNTAB(r16, 6)};

/* Rows in groups of 16 (w + r * ws is group r / 16: a group takes 16 rows'
 * bytes), the last one masked; tokens R16_C at a time. */
static void r16_groups(const r16_fn *tab, int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                       float *y, size_t ys, int nr, int nc) {
    for (int r = 0; r < nr; r += 16) {
        const __mmask16 rows = nr - r >= 16 ? 0xffff : (__mmask16)((1u << (nr - r)) - 1);
        for (int c = 0; c < nc; c += R16_C) {
            int rn = nc - c < R16_C ? nc - c : R16_C;
            tab[rn - 1](n, w + (size_t)r * ws, x + (size_t)c * xs, xs, y + (size_t)c * ys + r, ys, rows);
        }
    }
}
/* The kernel over any nr x nc of a packed type whose tile table is tab. */
#define R16_TILE(name, tab)                                                                                \
    void name(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys,        \
              int nr, int nc) {                                                                            \
        r16_groups(tab, n, w, ws, x, xs, y, ys, nr, nc);                                                   \
    }
R16_TILE(op_mm_q8_0_r16_vnni, r16_tab[0])
R16_TILE(op_mm_q4_0_r16_vnni, r16_tab[1])
R16_TILE(op_mm_q5_0_r16_vnni, r16_tab[2])
R16_TILE(op_mm_q4_1_r16_vnni, r16_tab[3])
R16_TILE(op_mm_q5_1_r16_vnni, r16_tab[4])
R16_TILE(op_mm_iq4_nl_r16_vnni, r16_tab[5])
R16_TILE(op_mm_mxfp4_r16_vnni, r16_tab[6])

/* ---- OP_Q4_K_R16, OP_Q5_K_R16, OP_Q6_K_R16: packed K-quant weights -----------
 * The same scheme per super-block (ops.h), unsigned weights against the
 * token's int8 quants:
 *   Q4_K: per 32-column sub-block, 8 chunks (a pair's low nibbles give
 *   sub-block 2p, its high ones 2p + 1), the exact dot times the rows' 16
 *   scales (vpmulld) into the super-block's integer sum; the mins meet the
 *   activations' sums of 16 (bsums) through vpdpwssd (each min in both
 *   halves of a dword, against a dword of two bsums); then
 *   fma(xd, fma(d, sumi, -dmin summ), s), as q4k_step in the scalar kernel.
 *   Q5_K: Q4_K with each sub-block's 5th bits or-ed in as bit 4.
 *   Q6_K: per 16-column group, 4 chunks rebuilt from nibbles and top bits
 *   (u = q + 32, 0..63), the dot times the scales; the +32 comes back out as
 *   32 x the scales against the bsums (vpdpwssd, two scales per dword); then
 *   fma(d xd, sumi, s), as q6k_step.
 * The running sums live in L1 between super-blocks (the registers hold the
 * tokens' integer sums and the chunks). */
AI void kq_r16_tile(const int KB, const int RN, int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y,
                    size_t ys, __mmask16 rows) {
    const int Q6 = KB == 6, Q5 = KB == 5; /* KB: the K-quant's bits, 4, 5 or 6 */
    const int nb = n / QK_K;
    const size_t bsz = Q6 ? OP_Q6K_R16_BYTES : Q5 ? OP_Q5K_R16_BYTES : OP_Q4K_R16_BYTES;
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30), lo16 = _mm512_set1_epi32(0xffff);
    const __m512i m10 = _mm512_set1_epi8(0x10);
    float accm[R16_C][16] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_store_ps(accm[c], _mm512_setzero_ps());
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (size_t)b * bsz;
        r16_prefetch(blk, bsz);
        __m512i sumi[R16_C];
#pragma GCC unroll 16
        for (int c = 0; c < RN; c++) sumi[c] = _mm512_setzero_si512();
        /* Q4_K: 8 sub-blocks of 8 chunks; Q6_K: 16 groups of 4 */
        for (int grp = 0; grp < (Q6 ? 16 : 8); grp++) {
            const int nk = Q6 ? 4 : 8;
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + (Q6 ? 32 : 64) + 16 * grp)));
            __m512i wk[8];
            if (Q6) {
                const int u = grp / 2, k0 = 4 * (grp % 2), sh = 2 * (u % 4); /* the unit's 2 bits to bits 4..5 */
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const __m512i lo = _mm512_loadu_si512(blk + 288 + 512 * (u / 2) + 64 * (k0 + k));
                    const __m512i hq = _mm512_loadu_si512(blk + 2336 + 512 * (u / 4) + 64 * (k0 + k));
                    const __m512i hi = sh < 4 ? _mm512_slli_epi16(hq, 4 - sh) : sh > 4 ? _mm512_srli_epi16(hq, sh - 4) : hq;
                    wk[k] = _mm512_or_si512(_mm512_and_si512(u % 2 ? _mm512_srli_epi16(lo, 4) : lo, m4),
                                            _mm512_and_si512(hi, m30));
                }
            } else {
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const __m512i raw = _mm512_loadu_si512(blk + 320 + 512 * (grp / 2) + 64 * k);
                    wk[k] = _mm512_and_si512(grp % 2 ? _mm512_srli_epi16(raw, 4) : raw, m4);
                    if (Q5) { /* bit grp of the 5th-bit chunk to bit 4 */
                        const __m512i hb = _mm512_loadu_si512(blk + OP_Q4K_R16_BYTES + 64 * k);
                        const __m512i h = grp < 4 ? _mm512_slli_epi16(hb, 4 - grp) : _mm512_srli_epi16(hb, grp - 4);
                        wk[k] = _mm512_or_si512(wk[k], _mm512_and_si512(h, m10));
                    }
                }
            }
#pragma GCC unroll 16
            for (int c = 0; c < RN; c++) {
                const int8_t *a = ((const block_q8_K *)(x + (size_t)c * xs))[b].qs + (Q6 ? 16 : 32) * grp;
                __m512i i0 = _mm512_setzero_si512(), i1 = i0;
#pragma GCC unroll 4
                for (int k = 0; k < nk; k += 2) {
                    i0 = _mm512_dpbusd_epi32(i0, wk[k], _mm512_set1_epi32(ld32(a + 4 * k)));
                    i1 = _mm512_dpbusd_epi32(i1, wk[k + 1], _mm512_set1_epi32(ld32(a + 4 * k + 4)));
                }
                sumi[c] = _mm512_add_epi32(sumi[c], _mm512_mullo_epi32(_mm512_add_epi32(i0, i1), sc));
            }
        }
        /* pairs for vpdpwssd: Q4_K each min twice, Q6_K scales 2t and 2t + 1 */
        __m512i pr[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            if (Q6) {
                const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 32 * t)));
                const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 48 + 32 * t)));
                pr[t] = _mm512_or_si512(_mm512_and_si512(s0, lo16), _mm512_slli_epi32(s1, 16));
            } else {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192 + 16 * t)));
                pr[t] = _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dmv = Q6 ? dv : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
#pragma GCC unroll 16
        for (int c = 0; c < RN; c++) {
            const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
            __m512i sm = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) sm = _mm512_dpwssd_epi32(sm, pr[t], _mm512_set1_epi32(ld32(xb->bsums + 2 * t)));
            __m512 acc = _mm512_load_ps(accm[c]);
            if (Q6) {
                const __m512i tot = _mm512_sub_epi32(sumi[c], _mm512_slli_epi32(sm, 5));
                acc = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(tot), acc);
            } else {
                const __m512 m = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(sm));
                const __m512 t = _mm512_fmsub_ps(dv, _mm512_cvtepi32_ps(sumi[c]), m);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(xb->d), t, acc);
            }
            _mm512_store_ps(accm[c], acc);
        }
    }
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_mask_storeu_ps(y + (size_t)c * ys, rows, _mm512_load_ps(accm[c]));
}

R16_FNS(r16k, kq_r16_tile, 4) R16_FNS(r16k, kq_r16_tile, 5) R16_FNS(r16k, kq_r16_tile, 6)
static const r16_fn r16k_tab[3][R16_C] = {R16_FNTAB(r16k, 4), R16_FNTAB(r16k, 5), R16_FNTAB(r16k, 6)};

R16_TILE(op_mm_q4_K_r16_vnni, r16k_tab[0])
R16_TILE(op_mm_q5_K_r16_vnni, r16k_tab[1])
R16_TILE(op_mm_q6_K_r16_vnni, r16k_tab[2])

/* ---- OP_IQ4_XS_R16 -------------------------------------------------------------
 * Per 32-column sub-block 4 chunks, their nibbles looked up as level + 128
 * (unsigned) by vpshufb: 8 vpdpbusd from -128 x the sub-block's sum of quants
 * (two bsums), the exact dot times the 16 rows' signed scales (vpmulld) into
 * the super-block's integer sum; then fma(d xd, sumi, s) as q6k_step. The
 * running sums live in L1 between super-blocks, as in kq_r16_tile. */
AI void iq4xs_r16_tile(const int RN, int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y, size_t ys,
                       __mmask16 rows) {
    const int nb = n / QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i kvu = _mm512_broadcast_i32x4(
        _mm_xor_si128(_mm_loadu_si128((const __m128i *)dt_kvalues_iq4nl), _mm_set1_epi8((char)0x80)));
    float accm[R16_C][16] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_store_ps(accm[c], _mm512_setzero_ps());
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (size_t)b * OP_IQ4XS_R16_BYTES;
        r16_prefetch(blk, OP_IQ4XS_R16_BYTES);
        __m512i sumi[R16_C];
#pragma GCC unroll 16
        for (int c = 0; c < RN; c++) sumi[c] = _mm512_setzero_si512();
        for (int sb = 0; sb < 8; sb++) {
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * sb)));
            __m512i wk[8];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i raw = _mm512_loadu_si512(blk + 160 + 256 * sb + 64 * k);
                wk[k] = _mm512_shuffle_epi8(kvu, _mm512_and_si512(raw, m4));
                wk[k + 4] = _mm512_shuffle_epi8(kvu, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
            }
#pragma GCC unroll 16
            for (int c = 0; c < RN; c++) {
                const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
                const int8_t *a = xb->qs + 32 * sb;
                __m512i i0 = _mm512_set1_epi32(-128 * (xb->bsums[2 * sb] + xb->bsums[2 * sb + 1])), i1 = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 8; k += 2) {
                    i0 = _mm512_dpbusd_epi32(i0, wk[k], _mm512_set1_epi32(ld32(a + 4 * k)));
                    i1 = _mm512_dpbusd_epi32(i1, wk[k + 1], _mm512_set1_epi32(ld32(a + 4 * k + 4)));
                }
                sumi[c] = _mm512_add_epi32(sumi[c], _mm512_mullo_epi32(_mm512_add_epi32(i0, i1), sc));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
#pragma GCC unroll 16
        for (int c = 0; c < RN; c++) {
            const float xd = ((const block_q8_K *)(x + (size_t)c * xs))[b].d;
            const __m512 acc = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xd)), _mm512_cvtepi32_ps(sumi[c]),
                                               _mm512_load_ps(accm[c]));
            _mm512_store_ps(accm[c], acc);
        }
    }
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_mask_storeu_ps(y + (size_t)c * ys, rows, _mm512_load_ps(accm[c]));
}

#define IQ4XS_TILE(v, rn, ...) iq4xs_r16_tile(rn, __VA_ARGS__)
R16_FNS(r16x, IQ4XS_TILE, 0)
static const r16_fn r16x_tab[R16_C] = R16_FNTAB(r16x, 0);
R16_TILE(op_mm_iq4_xs_r16_vnni, r16x_tab)

/* ---- OP_Q2_K_R16, OP_Q3_K_R16 ------------------------------------------------------
 * Per 32-column unit (h, j) 8 chunks of 2-bit fields shifted down by 2j
 * (Q3_K: +4 under the unit's 64-bit hmask mask, codes 0..7; one masked
 * vpaddb, cheaper than rebuilding the bit from hmask bytes with a shift and
 * a vpternlogd; for one token units j = 1, 2 skip the shift): 4 vpdpbusd per
 * 16-column sub-block (Q3_K from -4 x its bsum), times the rows' scales
 * (vpmulld) into the integer sum; Q2_K's mins meet the bsums through
 * vpdpwssd (two mins per dword); then q4k_step's / q6k_step's float steps. */
/* One 32-column unit of q23k_r16_tile's super-block b into sumi. */
AI void q23k_r16_unit(const int Q3, const int RN, const int unit, const uint8_t *blk, const uint8_t *x, size_t xs, int b,
                      __m512i *sumi) {
    const int sc_at = Q3 ? 32 : 64, qs_at = Q3 ? 288 : 320;
    const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), m4 = _mm512_set1_epi32(15);
    const int h = unit / 4, j = unit % 4, sh = 4 * h + j; /* Q3_K: hmask masks 8 sh..8 sh + 7 */
    /* e: with one token, fields 1 and 2 stay in place (codes
     * times 4^j, at most 112: no shift per chunk) and the two dots
     * per token are shifted back down exactly */
    const int e = RN == 1 && (j == 1 || j == 2) ? 2 * j : 0;
    __m512i wk[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m512i lo = _mm512_loadu_si512(blk + qs_at + 512 * h + 64 * k);
        wk[k] = e ? _mm512_and_si512(lo, _mm512_set1_epi8((char)(3 << e))) : _mm512_and_si512(_mm512_srli_epi16(lo, 2 * j), m3);
        if (Q3) { /* +4 (times 4^j) under the unit's hmask bits, one per byte of the chunk */
            uint64_t hm;
            memcpy(&hm, blk + 1312 + 64 * sh + 8 * k, sizeof hm);
            wk[k] = _mm512_mask_add_epi8(wk[k], _cvtu64_mask64(hm), wk[k], e ? _mm512_set1_epi8((char)(4 << e)) : four);
        }
    }
    const int s0 = 2 * unit; /* sub-blocks s0, s0 + 1 */
    __m512i sc0, sc1;
    if (Q3) {
        sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + sc_at + 16 * s0)));
        sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + sc_at + 16 * s0 + 16)));
    } else {
        sc0 = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + sc_at + 16 * s0))), m4);
        sc1 = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + sc_at + 16 * s0 + 16))), m4);
    }
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) {
        const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
        const int8_t *a = xb->qs + 32 * unit;
        __m512i i0 = Q3 ? _mm512_set1_epi32(-4 * xb->bsums[s0] * (1 << e)) : _mm512_setzero_si512();
        __m512i i1 = Q3 ? _mm512_set1_epi32(-4 * xb->bsums[s0 + 1] * (1 << e)) : _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            i0 = _mm512_dpbusd_epi32(i0, wk[k], _mm512_set1_epi32(ld32(a + 4 * k)));
            i1 = _mm512_dpbusd_epi32(i1, wk[k + 4], _mm512_set1_epi32(ld32(a + 16 + 4 * k)));
        }
        if (e) { /* every term a multiple of 4^j: exact */
            i0 = _mm512_srai_epi32(i0, e);
            i1 = _mm512_srai_epi32(i1, e);
        }
        sumi[c] = _mm512_add_epi32(sumi[c], _mm512_add_epi32(_mm512_mullo_epi32(i0, sc0), _mm512_mullo_epi32(i1, sc1)));
    }
}

AI void q23k_r16_tile(const int Q3, const int RN, int n, const uint8_t *g, const uint8_t *x, size_t xs, float *y,
                      size_t ys, __mmask16 rows) {
    const int nb = n / QK_K;
    const size_t bsz = Q3 ? OP_Q3K_R16_BYTES : OP_Q2K_R16_BYTES;
    float accm[R16_C][16] __attribute__((aligned(64)));
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_store_ps(accm[c], _mm512_setzero_ps());
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (size_t)b * bsz;
        r16_prefetch(blk, bsz);
        __m512i sumi[R16_C];
#pragma GCC unroll 16
        for (int c = 0; c < RN; c++) sumi[c] = _mm512_setzero_si512();
        /* unrolled, the shifts are immediates, which is faster; from 9 tokens
         * on the unrolled body no longer fits the op cache and is slower than
         * the loop, so there it stays a loop */
        if (RN <= 8) {
#pragma GCC unroll 8
            for (int unit = 0; unit < 8; unit++) q23k_r16_unit(Q3, RN, unit, blk, x, xs, b, sumi);
        } else {
#pragma GCC unroll 1
            for (int unit = 0; unit < 8; unit++) q23k_r16_unit(Q3, RN, unit, blk, x, xs, b, sumi);
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        if (Q3) {
#pragma GCC unroll 16
            for (int c = 0; c < RN; c++) {
                const float xd = ((const block_q8_K *)(x + (size_t)c * xs))[b].d;
                _mm512_store_ps(accm[c], _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xd)), _mm512_cvtepi32_ps(sumi[c]),
                                                         _mm512_load_ps(accm[c])));
            }
        } else {
            __m512i pr[8]; /* mins 2t (low half) and 2t + 1 (high half) of each row */
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const __m512i v0 = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + 32 * t))), 4);
                const __m512i v1 = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 80 + 32 * t))), 4);
                pr[t] = _mm512_or_si512(v0, _mm512_slli_epi32(v1, 16));
            }
            const __m512 dmv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
#pragma GCC unroll 16
            for (int c = 0; c < RN; c++) {
                const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
                __m512i sm = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) sm = _mm512_dpwssd_epi32(sm, pr[t], _mm512_set1_epi32(ld32(xb->bsums + 2 * t)));
                const __m512 m = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(sm));
                const __m512 t = _mm512_fmsub_ps(dv, _mm512_cvtepi32_ps(sumi[c]), m);
                _mm512_store_ps(accm[c], _mm512_fmadd_ps(_mm512_set1_ps(xb->d), t, _mm512_load_ps(accm[c])));
            }
        }
    }
#pragma GCC unroll 16
    for (int c = 0; c < RN; c++) _mm512_mask_storeu_ps(y + (size_t)c * ys, rows, _mm512_load_ps(accm[c]));
}

R16_FNS(r16q, q23k_r16_tile, 0) R16_FNS(r16q, q23k_r16_tile, 1)
static const r16_fn r16q_tab[2][R16_C] = {R16_FNTAB(r16q, 0), R16_FNTAB(r16q, 1)};
R16_TILE(op_mm_q2_K_r16_vnni, r16q_tab[0])
R16_TILE(op_mm_q3_K_r16_vnni, r16q_tab[1])

/* ---- TQ1_0, TQ2_0 x Q8_K: matmul_avx2.c's tq_tile, 64 codes a vector ------
 * Unpacked weights (no packed form), one row at a time: per block 4 vectors
 * of 64 codes 0..2, each a pair of the AVX2 kernel's 32-code chunks with the
 * activations of both contiguous, met by vpdpbusd; the activations' sum
 * (bsums) off once per block. TQ2_0: 32 bytes of fields in both halves,
 * shifted per half (srlv) by the two fields' offsets. TQ1_0: the source
 * bytes and 3^n multipliers per half as the AVX2 kernel pairs them. */
AI __m512i tq1_codes512(__m512i src, __m512i mul) {
    const __m512i three = _mm512_set1_epi16(3), hi8 = _mm512_set1_epi16((short)0xff00);
    const __m512i ce = _mm512_mulhi_epu16(_mm512_mullo_epi16(_mm512_slli_epi16(src, 8), mul), three);
    const __m512i co = _mm512_mulhi_epu16(_mm512_mullo_epi16(_mm512_and_si512(src, hi8), mul), three);
    return _mm512_or_si512(ce, _mm512_slli_epi16(co, 8));
}
AI __m512i join256(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

AI void tq512_tile(const int T1, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y,
                   size_t ys) {
    const int nb = n / QK_K;
    const size_t bsz = T1 ? sizeof(block_tq1_0) : sizeof(block_tq2_0);
    const pf_plan pf = pf_plan_for((size_t)nb * bsz, 32768, 4, 16384);
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m256i ones = _mm256_set1_epi16(1);
    /* TQ2_0: fields (0, 1) and (2, 3); TQ1_0: codes (0, 1), (2, 3), (4 | qs[32..47]'s
     * 0, 1), (qs[32..47]'s 2, 3 | its 4, qh's 16) */
    const __m512i sh01 = join256(_mm256_setzero_si256(), _mm256_set1_epi16(2));
    const __m512i sh23 = join256(_mm256_set1_epi16(4), _mm256_set1_epi16(6));
    const __m512i mul01 = join256(_mm256_set1_epi16(1), _mm256_set1_epi16(3));
    const __m512i mul23 = join256(_mm256_set1_epi16(9), _mm256_set1_epi16(27));
    const __m512i mul45 = join256(_mm256_set1_epi16(81), _mm256_set_m128i(_mm_set1_epi16(3), _mm_set1_epi16(1)));
    const __m512i mul67 = join256(_mm256_set_m128i(_mm_set1_epi16(27), _mm_set1_epi16(9)),
                                  _mm256_set_m128i(_mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27), _mm_set1_epi16(81)));
    const __m128i qh_spread = _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (RN == 1) pf_step(w, (size_t)b * bsz, (int)bsz, pf); /* decode */
        const uint8_t *blk = w + (size_t)b * bsz;
        __m512i u[4];
        if (T1) {
            const block_tq1_0 *bt = (const block_tq1_0 *)blk;
            const __m256i a = _mm256_loadu_si256((const __m256i *)bt->qs);
            const __m128i q16 = _mm_loadu_si128((const __m128i *)(bt->qs + 32));
            int32_t h32;
            memcpy(&h32, bt->qh, 4);
            const __m128i qh = _mm_shuffle_epi8(_mm_cvtsi32_si128(h32), qh_spread);
            const __m256i bb = _mm256_set_m128i(q16, q16);
            const __m512i aa = join256(a, a);
            u[0] = tq1_codes512(aa, mul01);
            u[1] = tq1_codes512(aa, mul23);
            u[2] = tq1_codes512(join256(a, bb), mul45);
            u[3] = tq1_codes512(join256(bb, _mm256_set_m128i(qh, q16)), mul67);
        } else {
            const block_tq2_0 *bt = (const block_tq2_0 *)blk;
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(bt->qs + 32 * h)));
                u[2 * h] = _mm512_and_si512(_mm512_srlv_epi16(raw, sh01), m3);
                u[2 * h + 1] = _mm512_and_si512(_mm512_srlv_epi16(raw, sh23), m3);
            }
        }
        const float d = _cvtsh_ss(T1 ? ((const block_tq1_0 *)blk)->d : ((const block_tq2_0 *)blk)->d);
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
            __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) s = _mm512_dpbusd_epi32(s, u[k], _mm512_loadu_si512(xb->qs + 64 * k));
            const __m256i s8 = _mm256_sub_epi32(
                _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1)),
                _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), ones));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s8), _mm256_set1_ps(d * xb->d), acc[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}
AI void tq1_tile512(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    tq512_tile(1, RN, n, w, x, xs, y, ys);
}
AI void tq2_tile512(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    tq512_tile(0, RN, n, w, x, xs, y, ys);
}
K_TILE_AT(tq1_0, tq1_tile512, vnni)
K_TILE_AT(tq2_0, tq2_tile512, vnni)

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
