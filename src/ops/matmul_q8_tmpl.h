/* ops/matmul_q8_tmpl: the Q8_0 and Q4_0 tile kernels (x Q8_0-style
 * activations), written once and compiled twice: by matmul_avx2.c with
 * Q_VNNI 0 (maddubs + madd) and by matmul_vnni.c with Q_VNNI 1 (vpdpbusd).
 * Include after matmul_simd.h with Q_VNNI and Q_SUFFIX defined.
 *
 * Decode must keep up with memory, so per-block work is minimal: once per
 * group of 8 blocks, each row's 8 f16 scales are fetched together (four loads
 * and shuffles for Q4_0, a gather otherwise), converted, multiplied by the
 * activation scales and parked in a small array, one group ahead so no load
 * waits on store forwarding; each block then takes its scale with a broadcast
 * load folded into its FMA. Q4_0 nibbles stay unsigned (0..15) and the -8
 * offset of a group is one FMA against the activation's precomputed
 * d * (-8 * sum of quants). The integer block sums are exact and the float
 * operations the same, so both variants give bit-identical results. */
#ifndef Q_SUFFIX
#error "define Q_VNNI and Q_SUFFIX before including matmul_q8_tmpl.h"
#endif

/* u8 x s8 dot of 32 bytes into 8 int32 lanes, lane k = bytes 4k..4k+3 */
AI __m256i q_dot(__m256i u, __m256i s) {
#if Q_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Q4_0 nibbles -> 32 unsigned bytes in element order. With VNNI the high
 * nibbles are only masked, not shifted (16x their value, which vpdpbusd sums
 * without overflow); lanes 4..7 of the accumulators then hold 16x and are
 * scaled back once at the end, exactly, since 16 is a power of two. */
AI __m256i q4_unpack(const uint8_t *qs) {
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
#if Q_VNNI
    const __m256i m = _mm256_setr_epi64x(0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL,
                                         (long long)0xf0f0f0f0f0f0f0f0ULL, (long long)0xf0f0f0f0f0f0f0f0ULL);
    return _mm256_and_si256(raw, m);
#else
    /* shifting the high lane's qwords by 4 brings the high nibbles down */
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0f));
#endif
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
AI void q_scales(const int RM, const int RN, int hi16, int n, int b0, int nb, int bs,
                 const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float sb[MAXR][MAXC][8],
                 __m256 acc[MAXR][MAXC]) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i gidx = _mm256_mullo_epi32(lane, _mm256_set1_epi32(bs));
    const __m256 f16x = _mm256_setr_ps(1, 1, 1, 1, 16, 16, 16, 16);
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
        __m256 xc = _mm256_loadu_ps(op_q8a_dc(xr, n) + b0);
        if (hi16) xc = _mm256_mul_ps(xc, f16x); /* same 16x as the dot lanes 4..7 */
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
#if Q_VNNI
    const int hi16 = 1;
#else
    const int hi16 = 0;
#endif
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
    q_scales(RM, RN, hi16, n, 0, nb, bs, w, ws, x, xs, sb[0], acc);
    for (int b0 = 0, g = 0; b0 < nb; b0 += 8, g ^= 1) {
        const int ng = nb - b0 < 8 ? nb - b0 : 8;
        if (RN == 1) pf_step(w, (size_t)(b0 / 8) * RM * bs * 8, RM * bs * 8, pf); /* decode */
        if (b0 + 8 < nb) q_scales(RM, RN, hi16, n, b0 + 8, nb, bs, w, ws, x, xs, sb[g ^ 1], acc);
        if (ng == 8) {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) qblock(RM, RN, b0 + k, k, w, ws, x, xs, sb[g], acc);
        } else {
            for (int k = 0; k < ng; k++) qblock(RM, RN, b0 + k, k, w, ws, x, xs, sb[g], acc);
        }
    }
    const __m256 undo = _mm256_setr_ps(1, 1, 1, 1, 0.0625f, 0.0625f, 0.0625f, 0.0625f);
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RN; c++)
            y[(size_t)c * ys + r] = hsum_ps(hi16 ? _mm256_mul_ps(acc[r][c], undo) : acc[r][c]);
}

#define QT(rm, rn)                                                                                  \
    static void qt_##rm##x##rn(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, \
                               size_t ys) {                                                         \
        qtile(rm, rn, n, w, ws, x, xs, y, ys);                                                      \
    }
#define QT_ROW(rm) QT(rm, 1) QT(rm, 2) QT(rm, 3) QT(rm, 4)
#define QT_TAB_ROW(rm) {qt_##rm##x1, qt_##rm##x2, qt_##rm##x3, qt_##rm##x4}
QT_ROW(1) QT_ROW(2) QT_ROW(3) QT_ROW(4)
static fixed_fn q4_tab[MAXR][MAXC] = {QT_TAB_ROW(1), QT_TAB_ROW(2), QT_TAB_ROW(3), QT_TAB_ROW(4)};

/* ---- Q8_0: rows in pairs ------------------------------------------------------
 * Per (row, token, block) the integer dot costs one vpdpbusd (VNNI: the
 * activations offset to unsigned and doubled once per call (q8x2), tiles of
 * up to 8 tokens, the dot started from -128 x the lane's weight sum, computed
 * once per row pair and block for the whole tile) or
 * maddubs + madd on the |w| x sign(x, w) trick (AVX2). The 8 int32 lanes of
 * two rows are then folded into one vector (unpack lo/hi + add: lanes 0,2,..
 * row A, 1,3,.. row B), so the conversion and the scale FMA are paid once per
 * two rows: that FMA's scale is a broadcast pair (dA dx, dB dx) from a table
 * built once per group of 8 blocks. Each row's float lanes hold the same
 * exact integer sums and see the same FMAs in the same order whatever its
 * partner row, the tile shape or T (an odd row is paired with itself), and
 * AVX2 and VNNI compute the same integers, so all give the same bits. */
#define MAXP (MAXR / 2)
#if Q_VNNI
/* The VNNI Q8_0 kernels take the activations in the q8x2 layout (see
 * ops_internal.h): per block x + 128 with its dwords doubled into the two
 * patterns unpacklo(xu, xu), unpackhi(xu, xu), so a token costs 2 loads. */
void op_q8x2_from_q8a(const void *q8a, void *dst, int n_in) {
    const __m256i u128 = _mm256_set1_epi8((char)0x80);
    const uint8_t *s = q8a;
    uint8_t *d = dst;
    for (int b = 0; b < n_in / 32; b++) {
        const __m256i xu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s + (size_t)b * 32)), u128);
        _mm256_storeu_si256((__m256i *)(d + (size_t)b * 64), _mm256_unpacklo_epi32(xu, xu));
        _mm256_storeu_si256((__m256i *)(d + (size_t)b * 64 + 32), _mm256_unpackhi_epi32(xu, xu));
    }
    memcpy(d + 2 * (size_t)n_in, op_q8a_d(q8a, n_in), (size_t)(n_in / 32) * sizeof(float));
}
#endif
/* VNNI (32 ymm registers) takes up to 8 tokens per tile: the weight
 * interleave and the correction of a block are then shared by 8 tokens. */
#if Q_VNNI
#define Q8C 8
#else
#define Q8C MAXC
#endif
typedef float q8p_scales[Q8C][MAXP][16]; /* [token][row pair][block k][row of pair] */

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
#if Q_VNNI
        const __m256 dx = _mm256_loadu_ps(op_q8x2_d(x + (size_t)c * xs, n) + b0);
#else
        const __m256 dx = _mm256_loadu_ps(op_q8a_d(x + (size_t)c * xs, n) + b0);
#endif
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
                  size_t xs, q8p_scales sb, __m256 acc[MAXP][Q8C]) {
    __m256i wq[MAXR];
#pragma GCC unroll 4
    for (int r = 0; r < RM; r++)
        wq[r] = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)(w + (size_t)r * ws) + b)->qs);
#if Q_VNNI
    /* Each row pair's dwords interleaved (A0 B0 A1 B1 | A4 B4 A5 B5 and
     * A2 B2 A3 B3 | A6 B6 A7 B7) against each token's dwords doubled: two
     * vpdpbusd give the folded lanes directly, the same integers as the
     * unpack + add below. */
    const __m256i u128 = _mm256_set1_epi8((char)0x80);
    __m256i w1[MAXP], w2[MAXP], corr[MAXP];
#pragma GCC unroll 2
    for (int p = 0; p < (RM + 1) / 2; p++) {
        const __m256i A = wq[2 * p], B = 2 * p + 1 < RM ? wq[2 * p + 1] : A;
        w1[p] = _mm256_unpacklo_epi32(A, B);
        w2[p] = _mm256_unpackhi_epi32(A, B);
        corr[p] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u128, w1[p]),
                                                       u128, w2[p]));
    }
#pragma GCC unroll 8
    for (int c = 0; c < RN; c++) {
        /* x + 128 with its dwords doubled, prepared once per call (op_q8x2) */
        const uint8_t *xb = x + (size_t)c * xs + (size_t)b * 64;
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)xb), x2 = _mm256_loadu_si256((const __m256i *)(xb + 32));
#pragma GCC unroll 2
        for (int p = 0; p < (RM + 1) / 2; p++) {
            const __m256i v = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(corr[p], x1, w1[p]), x2, w2[p]);
            const __m256 s = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&sb[c][p][2 * k]));
            acc[p][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, acc[p][c]);
        }
    }
#else
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
#endif
}

AI void q8p_tile(const int RM, const int RN, int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                 float *y, size_t ys) {
    const int nb = n / 32, bs = (int)sizeof(block_q8_0);
    q8p_scales sb[2] __attribute__((aligned(32))); /* one group ahead, as in qtile */
    const pf_plan pf = pf_plan_for((size_t)RM * ws, 32768, 4, 16384);
    __m256 acc[MAXP][Q8C];
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

#define QP(rm, rn)                                                                                      \
    static void qp_##rm##x##rn(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, \
                               size_t ys) {                                                             \
        q8p_tile(rm, rn, n, w, ws, x, xs, y, ys);                                                       \
    }
#if Q8C == 8
#define QP_ROW(rm) QP(rm, 1) QP(rm, 2) QP(rm, 3) QP(rm, 4) QP(rm, 5) QP(rm, 6) QP(rm, 7) QP(rm, 8)
#define QP_TAB_ROW(rm) \
    {qp_##rm##x1, qp_##rm##x2, qp_##rm##x3, qp_##rm##x4, qp_##rm##x5, qp_##rm##x6, qp_##rm##x7, qp_##rm##x8}
#else
#define QP_ROW(rm) QP(rm, 1) QP(rm, 2) QP(rm, 3) QP(rm, 4)
#define QP_TAB_ROW(rm) {qp_##rm##x1, qp_##rm##x2, qp_##rm##x3, qp_##rm##x4}
#endif
QP_ROW(1) QP_ROW(2) QP_ROW(3) QP_ROW(4)
static fixed_fn q8p_tab[MAXR][Q8C] = {QP_TAB_ROW(1), QP_TAB_ROW(2), QP_TAB_ROW(3), QP_TAB_ROW(4)};

/* run_tiles for q8p_tab (Q8C tokens wide) */
static void q8p_run(const int RM, const int RN, int n, const uint8_t *w, size_t ws, const uint8_t *x,
                    size_t xs, float *y, size_t ys, int nr, int nc) {
    for (int r = 0; r < nr; r += RM) {
        int rm = nr - r < RM ? nr - r : RM;
        for (int c = 0; c < nc; c += RN) {
            int rn = nc - c < RN ? nc - c : RN;
            q8p_tab[rm - 1][rn - 1](n, w + (size_t)r * ws, ws, x + (size_t)c * xs, xs,
                                    y + (size_t)c * ys + r, ys);
        }
    }
}

/* Decode (one token) takes Q_DEC_RM rows at a time; batches Q8_RM x Q_RN. */
static void Q_SUFFIX(tile_q8_0)(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                                float *y, size_t ys, int nr, int nc) {
    if (nc == 1) q8p_run(Q_DEC_RM, 1, n, w, ws, x, xs, y, ys, nr, nc);
    else q8p_run(Q8_RM, Q8_RN, n, w, ws, x, xs, y, ys, nr, nc);
}
static void Q_SUFFIX(tile_q4_0)(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                                float *y, size_t ys, int nr, int nc) {
    if (nc == 1) run_tiles(q4_tab, Q_DEC_RM, 1, n, w, ws, x, xs, y, ys, nr, nc);
    else run_tiles(q4_tab, Q_RM, Q_RN, n, w, ws, x, xs, y, ys, nr, nc);
}
