/* ops/matmul_q8_tmpl: the Q4_0 tile kernel (x Q8_0-style activations) and
 * the integer block dot, written once and compiled twice: by matmul_avx2.c
 * with Q_VNNI 0 (maddubs + madd) and by matmul_vnni.c with Q_VNNI 1 (vpdpbusd).
 * Include after matmul_simd.h with Q_VNNI and Q_SUFFIX defined.
 *
 * Decode must keep up with memory, so per-block work is minimal: once per
 * group of 8 blocks, each row's 8 f16 scales are fetched together (four loads
 * and shuffles), converted, multiplied by the
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

/* Decode (one token) takes Q_DEC_RM rows at a time; batches Q_RM x Q_RN. */
static void Q_SUFFIX(tile_q4_0)(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                                float *y, size_t ys, int nr, int nc) {
    if (nc == 1) run_tiles(q4_tab, Q_DEC_RM, 1, n, w, ws, x, xs, y, ys, nr, nc);
    else run_tiles(q4_tab, Q_RM, Q_RN, n, w, ws, x, xs, y, ys, nr, nc);
}
