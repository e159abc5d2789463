/* ops/matmul_avx2: AVX2/FMA/F16C matmul tile kernels. Each kernel keeps a
 * register tile of RM weight rows x RN tokens so that every weight vector
 * loaded (and unpacked) serves RN tokens, and every activation vector RM rows. */
#include <string.h>
#include "dtype/dtype.h"
#include "dtype/iq.h"
#include "dtype/tq.h"
#include "ops/matmul_kq.h"
#include "ops/type_traits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "ops/matmul_simd.h"

#define Q_DEC_RM 4 /* rows per decode tile */
#define Q_RM 2     /* rows x tokens per batch tile */
#define Q_RN 4
/* ---- Q4_0 ------------------------------------------------------------------------
 * (CPUs with AVX512-VNNI read Q4_0 weights packed: OP_Q4_0_R16, matmul_vnni.c.)
 * Decode must keep up with memory, so per-block work is minimal: once per
 * group of 8 blocks, each row's 8 f16 scales are fetched together (four loads
 * and shuffles), converted, multiplied by the activation scales and parked in
 * a small array, one group ahead so no load waits on store forwarding; each
 * block then takes its scale with a broadcast load folded into its FMA. Q4_0
 * nibbles stay unsigned (0..15) and the -8 offset of a group is one FMA
 * against the activation's precomputed d * (-8 * sum of quants). */

/* u8 x s8 dot of 32 bytes into 8 int32 lanes, lane k = bytes 4k..4k+3 */
AI __m256i q_dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* Q4_0 nibbles -> 32 unsigned bytes in element order. */
AI __m256i q4_unpack(const uint8_t *qs) {
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    /* shifting the high lane's qwords by 4 brings the high nibbles down */
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
}

/* Block k of the current group of 8, for all RM x RN pairs; sb holds each
 * pair's 8 block scales dw * dx. */
AI void qblock(const int RM, const int RN, int b, int k, const uint8_t *w, size_t ws, const uint8_t *x,
               size_t xs, float sb[MAXR][MAXC][8], __m256 acc[MAXR][MAXC]) {
    __m256i wq[MAXR];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++) wq[r] = q4_unpack(((const block_q4_0 *)(w + (size_t)r * ws) + b)->qs);
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(op_q8a_qs(x + (size_t)c * xs) + b * 32));
#pragma GCC unroll 4
        for (int r = 0; r < RM; r++) {
            __m256i i = q_dot(wq[r], xq);
            /* the scale is a broadcast load: no shuffle or multiply per block */
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_broadcast_ss(&sb[r][c][k]), acc[r][c]);
        }
    }
}

/* The f16 scales of 8 whole Q4_0 blocks (144 bytes) without a gather: four
 * 32-byte loads 36 bytes apart each hold one scale at the start of their low
 * lane and one 2 bytes into their high lane; shuffles move them to distinct
 * 16-bit slots and ORs merge them. */
AI __m256 q4_group_scales(const uint8_t *base) {
#define Q4_SH(i)                                                                                       \
    _mm256_setr_epi8(i == 0 ? 0 : -1, i == 0 ? 1 : -1, -1, -1, i == 1 ? 0 : -1, i == 1 ? 1 : -1, -1, -1, \
                     i == 2 ? 0 : -1, i == 2 ? 1 : -1, -1, -1, i == 3 ? 0 : -1, i == 3 ? 1 : -1, -1, -1, \
                     -1, -1, i == 0 ? 2 : -1, i == 0 ? 3 : -1, -1, -1, i == 1 ? 2 : -1, i == 1 ? 3 : -1, \
                     -1, -1, i == 2 ? 2 : -1, i == 2 ? 3 : -1, -1, -1, i == 3 ? 2 : -1, i == 3 ? 3 : -1)
    __m256i u = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)base), Q4_SH(0));
    u = _mm256_or_si256(u, _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(base + 36)), Q4_SH(1)));
    u = _mm256_or_si256(u, _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(base + 72)), Q4_SH(2)));
    u = _mm256_or_si256(u, _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(base + 108)), Q4_SH(3)));
#undef Q4_SH
    /* low lane: scales 0 2 4 6 in words 0 2 4 6; high lane: 1 3 5 7 in 1 3 5 7 */
    return _mm256_cvtph_ps(_mm_or_si128(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

/* The 8 block scales dw * dx of every pair for the group at b0, and the Q4_0
 * offset term of the group added into the accumulators. */
AI void q_scales(const int RM, const int RN, int n, int b0, int nb, int bs,
                 const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float sb[MAXR][MAXC][8],
                 __m256 acc[MAXR][MAXC]) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i gidx = _mm256_mullo_epi32(lane, _mm256_set1_epi32(bs));
    const int ng = nb - b0 < 8 ? nb - b0 : 8;
    /* lanes past the row's last block gather nothing and stay 0 */
    const __m256i gm = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng), lane);
    __m256 DW[MAXR];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++) {
        const uint8_t *base = w + (size_t)r * ws + (size_t)b0 * bs;
        if (ng == 8) DW[r] = q4_group_scales(base);
        else DW[r] = f16_lo_halves(_mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)base, gidx, gm, 1));
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) {
        const uint8_t *xr = x + (size_t)c * xs;
        const __m256 dx = _mm256_loadu_ps(op_q8a_d(xr, n) + b0);
        const __m256 xc = _mm256_loadu_ps(op_q8a_dc(xr, n) + b0);
#pragma GCC unroll 4
        for (int r = 0; r < RM; r++) {
            _mm256_store_ps(sb[r][c], _mm256_mul_ps(DW[r], dx));
            acc[r][c] = _mm256_fmadd_ps(DW[r], xc, acc[r][c]);
        }
    }
}

AI void qtile(const int RM, const int RN, int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
              float *y, size_t ys) {
    const int nb = n / 32, bs = (int)sizeof(block_q4_0);
    /* Scales of a group are stored one group ahead (double buffer), so the
     * per-block broadcast loads read committed data instead of waiting on
     * store forwarding. */
    float sb[2][MAXR][MAXC][8] __attribute__((aligned(32)));
    const pf_plan pf = pf_plan_for((size_t)RM * ws, 32768, 4, 16384);
    __m256 acc[MAXR][MAXC];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) acc[r][c] = _mm256_setzero_ps();
    q_scales(RM, RN, n, 0, nb, bs, w, ws, x, xs, sb[0], acc);
    for (int b0 = 0, g = 0; b0 < nb; b0 += 8, g ^= 1) {
        const int ng = nb - b0 < 8 ? nb - b0 : 8;
        if (RN == 1) pf_step(w, (size_t)(b0 / 8) * RM * bs * 8, RM * bs * 8, pf); /* decode */
        if (b0 + 8 < nb) q_scales(RM, RN, n, b0 + 8, nb, bs, w, ws, x, xs, sb[g ^ 1], acc);
        if (ng == 8) {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) qblock(RM, RN, b0 + k, k, w, ws, x, xs, sb[g], acc);
        } else {
            for (int k = 0; k < ng; k++) qblock(RM, RN, b0 + k, k, w, ws, x, xs, sb[g], acc);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++)
            y[(size_t)c * ys + r] = hsum_ps(acc[r][c]);
}

/* Fixed-size instances tf_RxC of a tile kernel tf(RM, RN, ...), their table
 * tf_tab, and the kernel over any nr x nc: decode (one token) takes Q_DEC_RM
 * rows at a time, batches Q_RM x Q_RN. */
#define QFIX(tf, rm, rn)                                                                                   \
    static void tf##_##rm##x##rn(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, \
                                 size_t ys) {                                                             \
        tf(rm, rn, n, w, ws, x, xs, y, ys);                                                               \
    }
#define QFIX_ROW(tf, rm) QFIX(tf, rm, 1) QFIX(tf, rm, 2) QFIX(tf, rm, 3) QFIX(tf, rm, 4)
#define QFIX_TAB_ROW(tf, rm) {tf##_##rm##x1, tf##_##rm##x2, tf##_##rm##x3, tf##_##rm##x4}
#define QFIX_ALL(tf, name)                                                                            \
    QFIX_ROW(tf, 1) QFIX_ROW(tf, 2) QFIX_ROW(tf, 3) QFIX_ROW(tf, 4)                                   \
    static fixed_fn tf##_tab[MAXR][MAXC] = {QFIX_TAB_ROW(tf, 1), QFIX_TAB_ROW(tf, 2), QFIX_TAB_ROW(tf, 3), \
                                           QFIX_TAB_ROW(tf, 4)};                                    \
    void name(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys,        \
              int nr, int nc) {                                                                     \
        if (nc == 1) run_tiles(tf##_tab, Q_DEC_RM, 1, n, w, ws, x, xs, y, ys, nr, nc);               \
        else run_tiles(tf##_tab, Q_RM, Q_RN, n, w, ws, x, xs, y, ys, nr, nc);                        \
    }
QFIX_ALL(qtile, op_mm_q4_0_avx2)

/* ---- Q4_1, Q5_0, Q5_1 ------------------------------------------------------------
 * One row x RN tokens. Per block the codes as 32 unsigned bytes (Q4_0's
 * nibbles, or-ed with the 5th bits of qh), their dot with the token's
 * quants times dw dx; the offset (Q5_0: -16 x the sum of quants; Q4_1 / Q5_1:
 * the min times it) from the activation's precomputed dx (-8 x sum), summed
 * apart and added at the end. */

/* Bit j of qh as 0x10 in byte j. */
AI __m256i q5_bits(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i byte_of = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                             3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), byte_of), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

AI void legacy_tile(const int TY, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y,
                    size_t ys) {
    const int nb = n / 32, q5 = TY != DT_Q4_1, has_m = TY != DT_Q5_0;
    const int bs = TY == DT_Q4_1 ? (int)sizeof(block_q4_1) : TY == DT_Q5_0 ? (int)sizeof(block_q5_0) : (int)sizeof(block_q5_1);
    const int qs_at = TY == DT_Q4_1 ? 4 : TY == DT_Q5_0 ? 6 : 8, qh_at = TY == DT_Q5_0 ? 2 : 4;
    const pf_plan pf = pf_plan_for((size_t)nb * bs, 32768, 4, 16384);
    __m256 acc[MAXC];
    float off[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) { acc[c] = _mm256_setzero_ps(); off[c] = 0; }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * bs;
        if (RN == 1) pf_step(w, (size_t)b * bs, bs, pf); /* decode */
        __m256i u = q4_unpack(blk + qs_at);
        if (q5) u = _mm256_or_si256(u, q5_bits(blk + qh_at));
        dt_f16 h16[2];
        memcpy(h16, blk, sizeof h16);
        const float dw = _cvtsh_ss(h16[0]), m = has_m ? _cvtsh_ss(h16[1]) : 0.0f;
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const uint8_t *xr = x + (size_t)c * xs;
            const __m256i i = q_dot(u, _mm256_loadu_si256((const __m256i *)(op_q8a_qs(xr) + b * 32)));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(dw * op_q8a_d(xr, n)[b]), acc[c]);
            const float dc = op_q8a_dc(xr, n)[b]; /* dx (-8 x sum) */
            off[c] += has_m ? m * dc * -0.125f : 2.0f * dw * dc;
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]) + off[c];
}
AI void q41_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    legacy_tile(DT_Q4_1, RN, n, w, x, xs, y, ys);
}
AI void q50_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    legacy_tile(DT_Q5_0, RN, n, w, x, xs, y, ys);
}
AI void q51_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    legacy_tile(DT_Q5_1, RN, n, w, x, xs, y, ys);
}

/* ---- Q8_0: rows in pairs ------------------------------------------------------
 * (CPUs with AVX512-VNNI read Q8_0 weights packed: OP_Q8_0_R16, matmul_vnni.c.)
 * Per (row, token, block) the integer dot costs maddubs + madd on the
 * |w| x sign(x, w) trick. The 8 int32 lanes of
 * two rows are then folded into one vector (unpack lo/hi + add: lanes 0,2,..
 * row A, 1,3,.. row B), so the conversion and the scale FMA are paid once per
 * two rows: that FMA's scale is a broadcast pair (dA dx, dB dx) from a table
 * built once per group of 8 blocks. Each row's float lanes hold the same
 * exact integer sums and see the same FMAs in the same order whatever its
 * partner row, the tile shape or T (an odd row is paired with itself), so all
 * give the same bits. */
#define MAXP (MAXR / 2)
typedef float q8p_scales[MAXC][MAXP][16]; /* [token][row pair][block k][row of pair] */

AI void q8p_scales_group(const int RM, const int RN, int n, int b0, int nb, const uint8_t *w, size_t ws,
                         const uint8_t *x, size_t xs, q8p_scales sb) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i gidx = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)sizeof(block_q8_0)));
    const int ng = nb - b0 < 8 ? nb - b0 : 8;
    const __m256i gm = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng), lane); /* past the row: 0 */
    __m256 DW[MAXR];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++) {
        const uint8_t *base = w + (size_t)r * ws + (size_t)b0 * sizeof(block_q8_0);
        DW[r] = f16_lo_halves(_mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)base, gidx, gm, 1));
    }
#pragma GCC unroll 8
    for (int c = 0; c < RN; c++) {
        const __m256 dx = _mm256_loadu_ps(op_q8a_d(x + (size_t)c * xs, n) + b0);
#pragma GCC unroll 2
        for (int p = 0; p < (RM + 1) / 2; p++) {
            const __m256 a = _mm256_mul_ps(DW[2 * p], dx);
            const __m256 b = 2 * p + 1 < RM ? _mm256_mul_ps(DW[2 * p + 1], dx) : a;
            /* blocks 0,1 | 4,5 and 2,3 | 6,7 as (A, B) pairs, then in order */
            const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
            _mm256_store_ps(sb[c][p], _mm256_permute2f128_ps(lo, hi, 0x20));
            _mm256_store_ps(sb[c][p] + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
    }
}

AI void q8p_block(const int RM, const int RN, int b, int k, const uint8_t *w, size_t ws, const uint8_t *x,
                  size_t xs, q8p_scales sb, __m256 acc[MAXP][MAXC]) {
    __m256i wq[MAXR];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
        wq[r] = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)(w + (size_t)r * ws) + b)->qs);
    __m256i wa[MAXR];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++) wa[r] = _mm256_abs_epi8(wq[r]); /* |w| x (x with w's sign) */
#pragma GCC unroll 8
    for (int c = 0; c < RN; c++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(op_q8a_qs(x + (size_t)c * xs) + b * 32));
        __m256i i[MAXR];
#pragma GCC unroll 4
        for (int r = 0; r < RM; r++) i[r] = q_dot(wa[r], _mm256_sign_epi8(xq, wq[r]));
#pragma GCC unroll 2
        for (int p = 0; p < (RM + 1) / 2; p++) {
            const __m256i A = i[2 * p], B = 2 * p + 1 < RM ? i[2 * p + 1] : A;
            const __m256i v = _mm256_add_epi32(_mm256_unpacklo_epi32(A, B), _mm256_unpackhi_epi32(A, B));
            const __m256 s = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&sb[c][p][2 * k]));
            acc[p][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, acc[p][c]);
        }
    }
}

AI void q8p_tile(const int RM, const int RN, int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                 float *y, size_t ys) {
    const int nb = n / 32, bs = (int)sizeof(block_q8_0);
    q8p_scales sb[2] __attribute__((aligned(32))); /* one group ahead, as in qtile */
    const pf_plan pf = pf_plan_for((size_t)RM * ws, 32768, 4, 16384);
    __m256 acc[MAXP][MAXC];
#pragma GCC unroll 2
    for (int p = 0; p < (RM + 1) / 2; p++)
#pragma GCC unroll 8
        for (int c = 0; c < RN; c++) acc[p][c] = _mm256_setzero_ps();
    q8p_scales_group(RM, RN, n, 0, nb, w, ws, x, xs, sb[0]);
    for (int b0 = 0, g = 0; b0 < nb; b0 += 8, g ^= 1) {
        const int ng = nb - b0 < 8 ? nb - b0 : 8;
        if (RN == 1) pf_step(w, (size_t)(b0 / 8) * RM * bs * 8, RM * bs * 8, pf); /* decode */
        if (b0 + 8 < nb) q8p_scales_group(RM, RN, n, b0 + 8, nb, w, ws, x, xs, sb[g ^ 1]);
        if (ng == 8) {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) q8p_block(RM, RN, b0 + k, k, w, ws, x, xs, sb[g], acc);
        } else {
            for (int k = 0; k < ng; k++) q8p_block(RM, RN, b0 + k, k, w, ws, x, xs, sb[g], acc);
        }
    }
    /* row A: (a0 + a4) + (a2 + a6); row B: (a1 + a5) + (a3 + a7) */
#pragma GCC unroll 2
    for (int p = 0; p < (RM + 1) / 2; p++)
#pragma GCC unroll 8
        for (int c = 0; c < RN; c++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[p][c]), _mm256_extractf128_ps(acc[p][c], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            y[(size_t)c * ys + 2 * p] = _mm_cvtss_f32(h);
            if (2 * p + 1 < RM) y[(size_t)c * ys + 2 * p + 1] = _mm_cvtss_f32(_mm_movehdup_ps(h));
        }
}

QFIX_ALL(q8p_tile, op_mm_q8_0_avx2)

/* ---- float weights (F32, F16, BF16) ------------------------------------------ */
enum { W_F32, W_F16, W_BF16 };

AI __m256 load_w8(int kind, const uint8_t *row, int k) {
    if (kind == W_F32) return _mm256_loadu_ps((const float *)row + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (kind == W_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI float load_w1(int kind, const uint8_t *row, int k) {
    if (kind == W_F32) return ((const float *)row)[k];
    uint16_t h = ((const uint16_t *)row)[k];
    if (kind == W_F16) return _cvtsh_ss(h);
    return dt_bf16_to_f32(h);
}

AI void ftile(const int kind, const int RM, const int RN, int n, const uint8_t *w, size_t ws,
              const uint8_t *x, size_t xs, float *y, size_t ys) {
    __m256 acc[MAXR][MAXC];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) acc[r][c] = _mm256_setzero_ps();
    const int n8 = n & ~7;
    const int esz = kind == W_F32 ? 4 : 2;
    /* L1 prefetch one group ahead paid off for the 2-byte types (up to
     * 45 KiB groups measured) but not for f32's 32 KiB groups */
    const pf_plan pf = pf_plan_for((size_t)RM * ws, esz == 2 ? 65536 : 16384, 2, 32768);
    for (int k = 0; k < n8; k += 8) {
        if (RN == 1) pf_step(w, (size_t)k * esz * RM, esz * RM * 8, pf); /* decode */
        __m256 xv[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) xv[c] = _mm256_loadu_ps((const float *)(x + (size_t)c * xs) + k);
#pragma GCC unroll 4
        for (int r = 0; r < RM; r++) {
            __m256 wv = load_w8(kind, w + (size_t)r * ws, k);
#pragma GCC unroll 4
            for (int c = 0; c < RN; c++) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            float s = hsum_ps(acc[r][c]);
            const float *xr = (const float *)(x + (size_t)c * xs);
            for (int k = n8; k < n; k++) s += load_w1(kind, w + (size_t)r * ws, k) * xr[k];
            y[(size_t)c * ys + r] = s;
        }
}

/* ---- Q4_K and Q6_K weights x Q8_K activations -------------------------------- */
/* One weight row x RN tokens; the unpacked quants and scales of a block serve
 * all RN tokens. Q4_K, or with Q5 Q5_K (the same block plus a 5th bit per
 * element in qh). */
AI void qk_tile(const int Q5, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y,
                size_t ys) {
    const int nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m10 = _mm256_set1_epi8(0x10);
    const size_t bsz = Q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    const pf_plan pf = pf_plan_for((size_t)nb * bsz, 32768, 4, 16384);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (RN == 1) pf_step(w, (size_t)b * bsz, (int)bsz, pf); /* decode */
        const block_q4_K *wb4 = (const block_q4_K *)(w + (size_t)b * bsz); /* Q5_K: d, dmin, scales alike */
        const uint8_t *qs = Q5 ? ((const block_q5_K *)wb4)->qs : wb4->qs;
        const __m256i hb = Q5 ? _mm256_loadu_si256((const __m256i *)((const block_q5_K *)wb4)->qh) : m4;
        /* the 8 scales and 8 mins (6 bits each, packed as in op_q4k_scales),
         * unpacked four at a time in 32-bit words */
        uint32_t u[3];
        memcpy(u, wb4->scales, sizeof u);
        uint64_t scv = (u[0] & 0x3f3f3f3fu) |
                       (uint64_t)((u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u)) << 32;
        uint64_t mnv = (u[1] & 0x3f3f3f3fu) |
                       (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)) << 32;
        const __m256i scb = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scv)));
        /* mins duplicated per 16-element half so madd with bsums gives each
         * 32-element sub-block's sum of x times its min */
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mnv));
        const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16), _mm_unpacklo_epi16(mn16, mn16));
        const float d = _cvtsh_ss(wb4->d), dmin = _cvtsh_ss(wb4->dmin);
        __m256i sumi[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) sumi[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < QK_K / 64; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(raw, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (Q5) { /* bits 2j and 2j + 1 of qh to bit 4 */
                lo = _mm256_or_si256(lo, _mm256_and_si256(j < 2 ? _mm256_slli_epi16(hb, 4 - 2 * j)
                                                                 : _mm256_srli_epi16(hb, 2 * j - 4), m10));
                hi = _mm256_or_si256(hi, _mm256_and_si256(j < 2 ? _mm256_slli_epi16(hb, 3 - 2 * j)
                                                                 : _mm256_srli_epi16(hb, 2 * j - 3), m10));
            }
            /* scale words 2j and 2j+1 broadcast to all 16 positions */
            const __m256i slo = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)((4 * j + 1) << 8 | 4 * j)));
            const __m256i shi = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2))));
#pragma GCC unroll 4
            for (int c = 0; c < RN; c++) {
                const int8_t *a = ((const block_q8_K *)(x + (size_t)c * xs))[b].qs + 64 * j;
                __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)a));
                __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 32)));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(_mm256_madd_epi16(plo, slo),
                                                                     _mm256_madd_epi16(phi, shi)));
            }
        }
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
            __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsums)); /* Q5_K too */
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[c]), _mm256_set1_ps(d * xb->d), acc[c]);
            acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * xb->d), acc[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}

AI void q6k_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    const int nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m3 = _mm256_set1_epi8(0x30);
    const block_q6_K *wb = (const block_q6_K *)w;
    const pf_plan pf = pf_plan_for((size_t)nb * sizeof(block_q6_K), 32768, 4, 16384);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (RN == 1) pf_step(w, (size_t)b * sizeof(block_q6_K), (int)sizeof(block_q6_K), pf); /* decode */
        const __m128i s8 = _mm_loadu_si128((const __m128i *)wb[b].scales);
        const __m256i s16 = _mm256_cvtepi8_epi16(s8);
        const float d = _cvtsh_ss(wb[b].d);
        __m256i sumi[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) sumi[c] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(wb[b].ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(wb[b].ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(wb[b].qh + 32 * h));
            __m256i q[4], sv[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m3));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m3));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m3));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), m3));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                /* 32 elements = 16-element groups g, g+1: their scales fill
                 * the low and the high 128-bit lane */
                const int g = 8 * h + 2 * k;
                const __m128i sh = _mm_setr_epi8((char)g, (char)g, (char)g, (char)g, (char)g, (char)g,
                                                 (char)g, (char)g, (char)(g + 1), (char)(g + 1),
                                                 (char)(g + 1), (char)(g + 1), (char)(g + 1),
                                                 (char)(g + 1), (char)(g + 1), (char)(g + 1));
                sv[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, sh));
            }
#pragma GCC unroll 4
            for (int c = 0; c < RN; c++) {
                const int8_t *a = ((const block_q8_K *)(x + (size_t)c * xs))[b].qs + 128 * h;
                __m256i s = sumi[c];
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(a + 32 * k)));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, sv[k]));
                }
                sumi[c] = s;
            }
        }
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
            /* quants are stored +32: subtract 32 * sum(scale_g * sum of x in g) */
            __m256i m = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)xb->bsums));
            __m256i s = _mm256_sub_epi32(sumi[c], _mm256_slli_epi32(m, 5));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}

/* ---- Q2_K, Q3_K, IQ4_XS x Q8_K; IQ4_NL x Q8_0-style --------------------------
 * One weight row x RN tokens, as qk_tile. Q2_K / Q3_K: per 128 elements one
 * 32-byte load of qs gives four vectors of 2-bit codes (shifts by 2j); a
 * vector's low lane is one 16-element sub-block, its high lane the next, so
 * its scale vector is one 16-bit scale per lane, picked by a shuffle from the
 * half's 8 scales. Q3_K's codes keep the hmask bit as +4 (0..7, unsigned for
 * maddubs) and the 4 x scale x sum of x comes back out through the bsums.
 * IQ4: the nibbles (Q4_0's order) index the 16 levels with one vpshufb; the
 * signed levels meet the signed quants as |w| x sign(x, w). */

/* Words 2j (low lane) and 2j + 1 (high lane) of a vector holding 8 words in
 * each lane, broadcast across their lanes. */
AI __m256i q2_pair_scales(__m256i s16, int j) {
    const __m128i lo = _mm_set1_epi16((short)((4 * j + 1) << 8 | 4 * j));
    const __m128i hi = _mm_set1_epi16((short)((4 * j + 3) << 8 | (4 * j + 2)));
    return _mm256_shuffle_epi8(s16, _mm256_set_m128i(hi, lo));
}

AI void q23k_tile(const int Q3, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y,
                  size_t ys) {
    const int nb = n / QK_K;
    const size_t bsz = Q3 ? sizeof(block_q3_K) : sizeof(block_q2_K);
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const pf_plan pf = pf_plan_for((size_t)nb * bsz, 32768, 4, 16384);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (RN == 1) pf_step(w, (size_t)b * bsz, (int)bsz, pf); /* decode */
        const block_q2_K *b2 = (const block_q2_K *)w + b;
        const block_q3_K *b3 = (const block_q3_K *)w + b;
        __m128i sc8, mn8 = _mm_setzero_si128(); /* 16 scales (Q3_K: signed), Q2_K's 16 mins */
        __m256i hm = _mm256_setzero_si256();
        if (Q3) { /* op_q3k_scales four at a time in 32-bit words */
            uint32_t u[3];
            memcpy(u, b3->scales, sizeof u);
            const uint32_t lo4 = 0x0f0f0f0fu, hi2 = 0x03030303u;
            sc8 = _mm_setr_epi32((int)((u[0] & lo4) | (u[2] & hi2) << 4), (int)((u[1] & lo4) | (u[2] >> 2 & hi2) << 4),
                                 (int)((u[0] >> 4 & lo4) | (u[2] >> 4 & hi2) << 4),
                                 (int)((u[1] >> 4 & lo4) | (u[2] >> 6 & hi2) << 4));
            sc8 = _mm_sub_epi8(sc8, _mm_set1_epi8(32));
            hm = _mm256_loadu_si256((const __m256i *)b3->hmask);
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)b2->scales);
            sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
            mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
        }
        const uint8_t *qs = Q3 ? b3->qs : b2->qs;
        __m256i sumi[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) sumi[c] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m128i s8h = h ? _mm_srli_si128(sc8, 8) : sc8;
            const __m256i s16 = _mm256_broadcastsi128_si256(Q3 ? _mm_cvtepi8_epi16(s8h) : _mm_cvtepu8_epi16(s8h));
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i u = _mm256_and_si256(j ? _mm256_srli_epi16(raw, 2 * j) : raw, m3);
                if (Q3) { /* bit 4h + j of hmask[l]: +4 */
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + j)));
                    u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four));
                }
                const __m256i sv = q2_pair_scales(s16, j);
#pragma GCC unroll 4
                for (int c = 0; c < RN; c++) {
                    const int8_t *a = ((const block_q8_K *)(x + (size_t)c * xs))[b].qs + 128 * h + 32 * j;
                    const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)a));
                    sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p, sv));
                }
            }
        }
        const __m256i corr16 = Q3 ? _mm256_cvtepi8_epi16(sc8) : _mm256_cvtepu8_epi16(mn8);
        const float d = _cvtsh_ss(Q3 ? b3->d : b2->d), dmin = Q3 ? 0.0f : _cvtsh_ss(b2->dmin);
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
            const __m256i m = _mm256_madd_epi16(corr16, _mm256_loadu_si256((const __m256i *)xb->bsums));
            if (Q3) { /* codes were stored + 4: less 4 x scale x sum of each 16 */
                const __m256i t = _mm256_sub_epi32(sumi[c], _mm256_slli_epi32(m, 2));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * xb->d), acc[c]);
            } else {
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[c]), _mm256_set1_ps(d * xb->d), acc[c]);
                acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * xb->d), acc[c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}
AI void q2k_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    q23k_tile(0, RN, n, w, x, xs, y, ys);
}
AI void q3k_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    q23k_tile(1, RN, n, w, x, xs, y, ys);
}

/* 32 IQ4 levels of the nibbles at qs (Q4_0's order) as signed bytes. */
AI __m256i iq4_levels(const uint8_t *qs) {
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)dt_kvalues_iq4nl));
    return _mm256_shuffle_epi8(kv, q4_unpack(qs));
}

/* IQ4_NL and MXFP4 (MX): 32 nibbles per block looked up in 16 signed levels,
 * an f16 scale (MXFP4: a power of two, dt_e8m0_half). */
AI void nl4_tile(const int MX, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y,
                 size_t ys) {
    const int nb = n / 32;
    const size_t bsz = MX ? sizeof(block_mxfp4) : sizeof(block_iq4_nl);
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(MX ? dt_kvalues_mxfp4 : dt_kvalues_iq4nl)));
    const pf_plan pf = pf_plan_for((size_t)nb * bsz, 32768, 4, 16384);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (RN == 1) pf_step(w, (size_t)b * bsz, (int)bsz, pf); /* decode */
        const uint8_t *blk = w + (size_t)b * bsz;
        const __m256i wv = _mm256_shuffle_epi8(kv, q4_unpack(MX ? ((const block_mxfp4 *)blk)->qs
                                                                 : ((const block_iq4_nl *)blk)->qs)),
                      wa = _mm256_abs_epi8(wv);
        const float dw = MX ? dt_e8m0_half(blk[0]) : _cvtsh_ss(((const block_iq4_nl *)blk)->d);
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const uint8_t *xr = x + (size_t)c * xs;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(op_q8a_qs(xr) + b * 32));
            const __m256i i = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(xq, wv)), ones);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(dw * op_q8a_d(xr, n)[b]), acc[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}
AI void iq4nl_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    nl4_tile(0, RN, n, w, x, xs, y, ys);
}
AI void mxfp4_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    nl4_tile(1, RN, n, w, x, xs, y, ys);
}

/* ---- TQ1_0, TQ2_0 x Q8_K (dtype/tq.h) -----------------------------------------
 * Per block 8 vectors of 32 codes 0..2, one maddubs each per token, summed in
 * 16 bits (at most 8 x 2 x 2 x 127); the activations' sum (the bsums) taken
 * off once per block, then d · dx. TQ2_0: the 2-bit fields of 32 bytes.
 * TQ1_0: code n of byte q is 3 q_n / 256 with q_n = q 3^n mod 256, so q_{n+1}
 * is q_n + q_n + q_n in wrapping byte adds and the code is (q_n >= 86) +
 * (q_n >= 171): no multiplies. Codes 0, 1 of qs[32..47] share a vector (low
 * and high lane), 2 and 3 too; code 4 shares one with qh's 16 codes (element
 * 240 + 4n + j from qh[j] 3^n). */
AI __m256i tq1_code(__m256i q) {
    const __m256i one = _mm256_set1_epi8(1);
    return _mm256_add_epi8(_mm256_min_epu8(_mm256_subs_epu8(q, _mm256_set1_epi8(85)), one),
                           _mm256_min_epu8(_mm256_subs_epu8(q, _mm256_set1_epi8((char)170)), one));
}
AI __m256i times3_256(__m256i q) { return _mm256_add_epi8(q, _mm256_add_epi8(q, q)); }
AI __m128i times3_128(__m128i q) { return _mm_add_epi8(q, _mm_add_epi8(q, q)); }

/* The 8 code vectors of a TQ1_0 block. */
AI void tq1_unpack(const block_tq1_0 *bt, __m256i u[8]) {
    __m256i q = _mm256_loadu_si256((const __m256i *)bt->qs);
#pragma GCC unroll 5
    for (int k = 0; k < 5; k++, q = times3_256(q)) u[k] = tq1_code(q);
    __m128i b[5];
    b[0] = _mm_loadu_si128((const __m128i *)(bt->qs + 32));
#pragma GCC unroll 4
    for (int k = 1; k < 5; k++) b[k] = times3_128(b[k - 1]);
    const __m128i h1 = _mm_cvtsi32_si128((int)dt_iq_u32(bt->qh)), h3 = times3_128(h1), h9 = times3_128(h3),
                  h27 = times3_128(h9);
    const __m128i hq = _mm_unpacklo_epi64(_mm_unpacklo_epi32(h1, h3), _mm_unpacklo_epi32(h9, h27));
    u[5] = tq1_code(_mm256_set_m128i(b[1], b[0]));
    u[6] = tq1_code(_mm256_set_m128i(b[3], b[2]));
    u[7] = tq1_code(_mm256_set_m128i(hq, b[4]));
}

AI void tq_tile(const int T1, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y,
                size_t ys) {
    const int nb = n / QK_K;
    const size_t bsz = T1 ? sizeof(block_tq1_0) : sizeof(block_tq2_0);
    const pf_plan pf = pf_plan_for((size_t)nb * bsz, 32768, 4, 16384);
    const __m256i ones = _mm256_set1_epi16(1), m3 = _mm256_set1_epi8(3);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        if (RN == 1) pf_step(w, (size_t)b * bsz, (int)bsz, pf); /* decode */
        const uint8_t *blk = w + (size_t)b * bsz;
        __m256i u[8];
        if (T1) {
            tq1_unpack((const block_tq1_0 *)blk, u);
        } else {
            const block_tq2_0 *bt = (const block_tq2_0 *)blk;
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(bt->qs + 32 * h));
#pragma GCC unroll 4
                for (int l = 0; l < 4; l++) u[4 * h + l] = _mm256_and_si256(l ? _mm256_srli_epi16(raw, 2 * l) : raw, m3);
            }
        }
        const float d = _cvtsh_ss(T1 ? ((const block_tq1_0 *)blk)->d : ((const block_tq2_0 *)blk)->d);
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const block_q8_K *xb = (const block_q8_K *)(x + (size_t)c * xs) + b;
            __m256i s16 = _mm256_maddubs_epi16(u[0], _mm256_loadu_si256((const __m256i *)xb->qs));
#pragma GCC unroll 7
            for (int k = 1; k < 8; k++)
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i *)(xb->qs + 32 * k))));
            const __m256i s = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones),
                                               _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), ones));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * xb->d), acc[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}
AI void tq1_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    tq_tile(1, RN, n, w, x, xs, y, ys);
}
AI void tq2_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    tq_tile(0, RN, n, w, x, xs, y, ys);
}

/* ---- IQ4_XS and the codebook types x Q8_K (dtype/iq.h) -------------------------
 * Per 32-weight sub-block: the 4 points as one vector of unsigned bytes from
 * table loads (IQ3: 8 half-points), their signs as ±1 bytes applied to the
 * activations, one maddubs per token; the pairs times the odd scales (low
 * lane: weights 0..15, high: 16..31). IQ1: 8 g ± 1 as signed bytes, taken
 * as |w| x sign(x, w); IQ4_XS likewise its 32 levels, one signed 6-bit scale. */
AI __m256i iq_scales(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}
/* 4 sign bytes (bit j of byte l: weight 8l + j negative) as 32 bytes of -1 / +1. */
AI __m256i iq_signs_bytes(const uint8_t *s) {
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)dt_iq_u32(s)), spread);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits), _mm256_set1_epi8(1));
}
AI __m256i iq_set4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_set_epi64x((long long)d, (long long)c, (long long)b, (long long)a);
}
AI void iq_sub(const int T, const uint8_t *blk, int ib, __m256i *u, __m256i *sg, __m256i *sc) {
    if (T == DT_IQ4_XS) {
        const block_iq4_xs *b = (const block_iq4_xs *)blk;
        const __m256i wv = iq4_levels(b->qs + 16 * ib);
        *u = _mm256_abs_epi8(wv);
        *sg = wv;
        *sc = _mm256_set1_epi16((short)op_iq4xs_scale(b, ib));
    } else if (T == DT_IQ2_XXS) {
        const uint8_t *q = (const uint8_t *)((const block_iq2_xxs *)blk)->qs + 8 * ib;
        const uint32_t a1 = dt_iq_u32(q + 4);
        *u = iq_set4(dt_iq2xxs_grid[q[0]], dt_iq2xxs_grid[q[1]], dt_iq2xxs_grid[q[2]], dt_iq2xxs_grid[q[3]]);
        *sg = iq_set4(dt_iq_ksigns64[a1 & 127], dt_iq_ksigns64[(a1 >> 7) & 127], dt_iq_ksigns64[(a1 >> 14) & 127],
                      dt_iq_ksigns64[(a1 >> 21) & 127]);
        *sc = _mm256_set1_epi16((short)(2 * (a1 >> 28) + 1));
    } else if (T == DT_IQ2_XS) {
        const block_iq2_xs *b = (const block_iq2_xs *)blk;
        const uint8_t *q = (const uint8_t *)b->qs + 8 * ib;
        const unsigned v0 = dt_iq_u16(q), v1 = dt_iq_u16(q + 2), v2 = dt_iq_u16(q + 4), v3 = dt_iq_u16(q + 6);
        *u = iq_set4(dt_iq2xs_grid[v0 & 511], dt_iq2xs_grid[v1 & 511], dt_iq2xs_grid[v2 & 511], dt_iq2xs_grid[v3 & 511]);
        *sg = iq_set4(dt_iq_ksigns64[v0 >> 9], dt_iq_ksigns64[v1 >> 9], dt_iq_ksigns64[v2 >> 9], dt_iq_ksigns64[v3 >> 9]);
        *sc = iq_scales(2 * (b->scales[ib] & 15) + 1, 2 * (b->scales[ib] >> 4) + 1);
    } else if (T == DT_IQ2_S) {
        const block_iq2_s *b = (const block_iq2_s *)blk;
        const uint8_t *q = b->qs + 4 * ib, *s = b->qs + QK_K / 8 + 4 * ib;
        const unsigned h = b->qh[ib];
        *u = iq_set4(dt_iq2s_grid[q[0] | ((h << 8) & 0x300)], dt_iq2s_grid[q[1] | ((h << 6) & 0x300)],
                     dt_iq2s_grid[q[2] | ((h << 4) & 0x300)], dt_iq2s_grid[q[3] | ((h << 2) & 0x300)]);
        *sg = iq_signs_bytes(s);
        *sc = iq_scales(2 * (b->scales[ib] & 15) + 1, 2 * (b->scales[ib] >> 4) + 1);
    } else if (T == DT_IQ3_XXS) {
        const block_iq3_xxs *b = (const block_iq3_xxs *)blk;
        const uint8_t *q = b->qs + 8 * ib;
        const uint32_t a = dt_iq_u32(b->qs + QK_K / 4 + 4 * ib);
        *u = _mm256_set_epi32((int)dt_iq3xxs_grid[q[7]], (int)dt_iq3xxs_grid[q[6]], (int)dt_iq3xxs_grid[q[5]],
                              (int)dt_iq3xxs_grid[q[4]], (int)dt_iq3xxs_grid[q[3]], (int)dt_iq3xxs_grid[q[2]],
                              (int)dt_iq3xxs_grid[q[1]], (int)dt_iq3xxs_grid[q[0]]);
        *sg = iq_set4(dt_iq_ksigns64[a & 127], dt_iq_ksigns64[(a >> 7) & 127], dt_iq_ksigns64[(a >> 14) & 127],
                      dt_iq_ksigns64[(a >> 21) & 127]);
        *sc = _mm256_set1_epi16((short)(2 * (a >> 28) + 1));
    } else if (T == DT_IQ3_S) {
        const block_iq3_s *b = (const block_iq3_s *)blk;
        const uint8_t *q = b->qs + 8 * ib, *s = b->signs + 4 * ib;
        const unsigned h = b->qh[ib];
#define G3(k) (int)dt_iq3s_grid[q[k] | (((h >> (k)) & 1) << 8)]
        *u = _mm256_set_epi32(G3(7), G3(6), G3(5), G3(4), G3(3), G3(2), G3(1), G3(0));
#undef G3
        *sg = iq_signs_bytes(s);
        *sc = _mm256_set1_epi16((short)(2 * ((b->scales[ib / 2] >> (4 * (ib % 2))) & 15) + 1));
    } else { /* IQ1_S, IQ1_M: w = 8 g + shift, shift = ±1 per 32 (S) or per 8 (M) */
        __m256i g, sh;
        if (T == DT_IQ1_S) {
            const block_iq1_s *b = (const block_iq1_s *)blk;
            const uint8_t *q = b->qs + 4 * ib;
            const unsigned h = dt_iq_u16((const uint8_t *)b->qh + 2 * ib);
            g = iq_set4(dt_iq1s_grid[q[0] | ((h << 8) & 0x700)], dt_iq1s_grid[q[1] | ((h << 5) & 0x700)],
                        dt_iq1s_grid[q[2] | ((h << 2) & 0x700)], dt_iq1s_grid[q[3] | ((h >> 1) & 0x700)]);
            sh = _mm256_set1_epi8(h & 0x8000 ? -1 : 1);
            *sc = _mm256_set1_epi16((short)(2 * ((h >> 12) & 7) + 1));
        } else {
            const block_iq1_m *b = (const block_iq1_m *)blk;
            const uint8_t *q = b->qs + 4 * ib;
            const unsigned h = dt_iq_u16(b->qh + 2 * ib); /* a nibble per group */
            g = iq_set4(dt_iq1s_grid[q[0] | ((h << 8) & 0x700)], dt_iq1s_grid[q[1] | ((h << 4) & 0x700)],
                        dt_iq1s_grid[q[2] | (h & 0x700)], dt_iq1s_grid[q[3] | ((h >> 4) & 0x700)]);
            /* group l's shift bit 4l + 3 as a whole qword of -1 or +1 bytes */
            const __m256i f = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x((long long)h), _mm256_setr_epi64x(3, 7, 11, 15)),
                                               _mm256_set1_epi64x(1));
            sh = _mm256_or_si256(_mm256_cmpeq_epi64(f, _mm256_set1_epi64x(1)), _mm256_set1_epi8(1));
            const unsigned s = dt_iq_u16(b->scales + 2 * (ib / 2)) >> (6 * (ib % 2));
            *sc = iq_scales(2 * (int)(s & 7) + 1, 2 * (int)((s >> 3) & 7) + 1);
        }
        const __m256i w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), sh);
        *u = _mm256_abs_epi8(w);
        *sg = w;
    }
}

AI void iq_tile(const int T, const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    const int nb = n / QK_K;
    const size_t bs = T == DT_IQ4_XS ? sizeof(block_iq4_xs) : T == DT_IQ2_XXS ? sizeof(block_iq2_xxs) : T == DT_IQ2_XS ? sizeof(block_iq2_xs)
                    : T == DT_IQ2_S ? sizeof(block_iq2_s) : T == DT_IQ3_XXS ? sizeof(block_iq3_xxs)
                    : T == DT_IQ3_S ? sizeof(block_iq3_s) : T == DT_IQ1_S ? sizeof(block_iq1_s) : sizeof(block_iq1_m);
    const float inv = T == DT_IQ4_XS ? 1.0f : 1.0f / (float)dt_iq_div(T);
    const pf_plan pf = pf_plan_for((size_t)nb * bs, 32768, 4, 16384);
    __m256 acc[MAXC];
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) acc[c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * bs;
        if (RN == 1) pf_step(w, (size_t)b * bs, (int)bs, pf); /* decode */
        __m256i sumi[MAXC];
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) sumi[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int ib = 0; ib < QK_K / 32; ib++) {
            __m256i u, sg, sc;
            iq_sub(T, blk, ib, &u, &sg, &sc);
#pragma GCC unroll 4
            for (int c = 0; c < RN; c++) {
                const int8_t *a = ((const block_q8_K *)(x + (size_t)c * xs))[b].qs + 32 * ib;
                const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a), sg));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(p, sc));
            }
        }
        const float d = _cvtsh_ss(T == DT_IQ1_M ? dt_iq1m_d((const block_iq1_m *)blk) : *(const dt_f16 *)blk) * inv;
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++) {
            const float xd = ((const block_q8_K *)(x + (size_t)c * xs))[b].d;
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[c]), _mm256_set1_ps(d * xd), acc[c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < RN; c++) y[(size_t)c * ys] = hsum_ps(acc[c]);
}
#define IQ_TILE_FN(nm, T)                                                                                         \
    AI void nm##_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) { \
        iq_tile(T, RN, n, w, x, xs, y, ys);                                                                       \
    }
IQ_TILE_FN(iq4xs, DT_IQ4_XS)
IQ_TILE_FN(iq2xxs, DT_IQ2_XXS)
IQ_TILE_FN(iq2xs, DT_IQ2_XS)
IQ_TILE_FN(iq2s, DT_IQ2_S)
IQ_TILE_FN(iq3xxs, DT_IQ3_XXS)
IQ_TILE_FN(iq3s, DT_IQ3_S)
IQ_TILE_FN(iq1s, DT_IQ1_S)
IQ_TILE_FN(iq1m, DT_IQ1_M)

/* ---- tile drivers: full RM x RN register tiles, then the edges ------------- */
#define FT(kind, rm, rn) \
    static void ft_##kind##_##rm##x##rn(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys) { \
        ftile(kind, rm, rn, n, w, ws, x, xs, y, ys); }

#define FT_ROW(kind, rm) FT(kind, rm, 1) FT(kind, rm, 2) FT(kind, rm, 3)
#define FT_ALL(kind) FT_ROW(kind, 1) FT_ROW(kind, 2) FT_ROW(kind, 3) FT_ROW(kind, 4)
#define FT_TAB_ROW(kind, rm) {ft_##kind##_##rm##x1, ft_##kind##_##rm##x2, ft_##kind##_##rm##x3, NULL}
#define FT_TAB(kind) {FT_TAB_ROW(kind, 1), FT_TAB_ROW(kind, 2), FT_TAB_ROW(kind, 3), FT_TAB_ROW(kind, 4)}
FT_ALL(W_F32)
FT_ALL(W_F16)
FT_ALL(W_BF16)
static fixed_fn tab_f32[MAXR][MAXC] = FT_TAB(W_F32);
static fixed_fn tab_f16[MAXR][MAXC] = FT_TAB(W_F16);
static fixed_fn tab_bf16[MAXR][MAXC] = FT_TAB(W_BF16);

AI void q4k_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    qk_tile(0, RN, n, w, x, xs, y, ys);
}
AI void q5k_tile(const int RN, int n, const uint8_t *w, const uint8_t *x, size_t xs, float *y, size_t ys) {
    qk_tile(1, RN, n, w, x, xs, y, ys);
}

void op_mm_f32_avx2(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys, int nr, int nc) {
    run_tiles(tab_f32, 4, 3, n, w, ws, x, xs, y, ys, nr, nc);
}
void op_mm_f16_avx2(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys, int nr, int nc) {
    run_tiles(tab_f16, 4, 3, n, w, ws, x, xs, y, ys, nr, nc);
}
void op_mm_bf16_avx2(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys, int nr, int nc) {
    run_tiles(tab_bf16, 4, 3, n, w, ws, x, xs, y, ys, nr, nc);
}

#define K_TILE(name, tf) K_TILE_AT(name, tf, avx2)
K_TILE(q4_K, q4k_tile)
K_TILE(q5_K, q5k_tile)
K_TILE(q6_K, q6k_tile)
K_TILE(q4_1, q41_tile)
K_TILE(q5_0, q50_tile)
K_TILE(q5_1, q51_tile)
K_TILE(q2_K, q2k_tile)
K_TILE(q3_K, q3k_tile)
K_TILE(iq4_nl, iq4nl_tile)
K_TILE(iq4_xs, iq4xs_tile)
K_TILE(iq2_xxs, iq2xxs_tile)
K_TILE(iq2_xs, iq2xs_tile)
K_TILE(iq2_s, iq2s_tile)
K_TILE(iq3_xxs, iq3xxs_tile)
K_TILE(iq3_s, iq3s_tile)
K_TILE(iq1_s, iq1s_tile)
K_TILE(iq1_m, iq1m_tile)
K_TILE(mxfp4, mxfp4_tile)
K_TILE(tq1_0, tq1_tile)
K_TILE(tq2_0, tq2_tile)

/* Bandwidth probe: 4 independent accumulators keep several loads in flight;
 * with prefetch, lines are also requested 4 KiB ahead into L2, which on some
 * machines reads faster than the hardware prefetcher alone. */
double op_read_sum_avx2(const float *p, size_t n, int prefetch) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        if (prefetch) {
            _mm_prefetch((const char *)(p + i) + 4096, _MM_HINT_T1);
            _mm_prefetch((const char *)(p + i) + 4096 + 64, _MM_HINT_T1);
        }
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
    }
    double s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += p[i];
    return s;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else
double op_read_sum_avx2(const float *p, size_t n, int prefetch) {
    (void)prefetch;
    double s = 0;
    for (size_t i = 0; i < n; i++) s += p[i];
    return s;
}
#endif
