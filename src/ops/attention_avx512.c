/* ops/attention_avx512: the AVX-512 (F, BW, VL, VNNI) attention kernels: the
 * tile of 16 keys over f32 / f16 / bf16 / q8_0 / q4_0 keys and values (decode
 * and prefill), and the q8_0 rows the AVX2 fused decode uses on these CPUs. The
 * rest of this level is the AVX2 kernels'. */
#include <math.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/attention_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* outside the target regions: each intrinsic keeps its own target */

/* ---- VNNI kernels for q8_0 / q4_0 keys and values (AVX512 F/BW/VL/VNNI) -----
 * The fused AVX2 kernels spend about 35 cycles per key and head at decode
 * (the project's machine, cache hot), so long contexts were bound by
 * arithmetic rather than by reading the cache; these spend about 22. They
 * take 16 keys of one cache block at a time in 512-bit registers (hd % 64
 * == 0: a key's two 32-element groups fill one register). */
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif

/* the f16 group scales at byte `off` of m (<= 16) rows rb bytes apart, as
 * floats (0 in lanes >= m) */
static inline __attribute__((always_inline)) __m512 vnni_scales(const uint8_t *row, size_t off, size_t rb, int m) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)rb));
    __mmask16 mk = (__mmask16)((1u << m) - 1);
    __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mk, idx, row + off, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
}

/* q . k_j (unscaled) of m <= 16 q8_0 (q4: q4_0) key rows rb bytes apart
 * and the int8 query qc with group scales qd, key j in lane j (0 in lanes >=
 * m). Per key and pair of groups, vpdpbusd of the codes as unsigned bytes
 * (q8_0: + 128; q4_0: the nibbles, code + 8) with the query, from lanes
 * preset to -128 (-8) * (the query's sums), leaves 16 lanes that sum to the
 * two groups' exact integer dot products (q8_0: 128-bit lanes 0, 1 the first
 * group, 2, 3 the second; q4_0: a row's low nibbles then its high ones, so
 * lanes 0, 2 and 1, 3, and the query's lanes are put in that order); the 16
 * keys' registers reduce together (unpack and add, then 128-bit shuffles) to
 * one register per group with a key per lane, which the group scales
 * multiply. A key's score does not depend on its lane. */
static inline __attribute__((always_inline)) __m512 vnni_qk16(const int8_t *qc, const float *qd, const uint8_t *rows,
                                                              size_t rb, int m, int hd, bool q4) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), nib = _mm512_set1_epi8(0x0f);
    const size_t gb = q4 ? 18 : 34; /* bytes of a group */
    __m512 acc = _mm512_setzero_ps();
    for (int P = 0; P < hd / 64; P++) {
        const uint8_t *g = rows + (size_t)P * 2 * gb;
        __m512i q = _mm512_loadu_si512(qc + 64 * P);
        if (q4) q = _mm512_shuffle_i64x2(q, q, 0xd8); /* elements 0-15, 32-47, 16-31, 48-63 */
        __m512i bias = _mm512_sub_epi32(_mm512_setzero_si512(),
                                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), q4 ? _mm512_set1_epi8(8) : flip, q));
        __m512i v[16];
#pragma GCC unroll 16
        for (int x = 0; x < 16; x++) {
            if (x >= m) { v[x] = _mm512_setzero_si512(); continue; }
            const uint8_t *r = g + (size_t)x * rb;
            __m512i kc;
            if (q4) {
                __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(r + 2))),
                                                    _mm_loadu_si128((const __m128i *)(r + 20)), 1);
                kc = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1), nib);
            } else
                kc = _mm512_xor_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r + 2))),
                                       _mm256_loadu_si256((const __m256i *)(r + 36)), 1),
                    flip);
            v[x] = _mm512_dpbusd_epi32(bias, kc, q);
        }
        __m512i t[8], u[4];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                    _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                    _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
        /* u[i], 128-bit lane l: keys 4i..4i+3, sums of their dwords 4l..4l+3
         * (q8_0: lanes 0, 1 the first group, 2, 3 the second; q4_0: 0, 2 and
         * 1, 3); z: per key, the first group's sum then the second's */
#define VNNI_PAIR(a_, b_)                                                                                              \
    (q4 ? _mm512_add_epi32(_mm512_shuffle_i32x4(a_, b_, 0x44), _mm512_shuffle_i32x4(a_, b_, 0xee))                    \
        : _mm512_add_epi32(_mm512_shuffle_i32x4(a_, b_, 0x88), _mm512_shuffle_i32x4(a_, b_, 0xdd)))
        __m512i z0 = VNNI_PAIR(u[0], u[1]), z1 = VNNI_PAIR(u[2], u[3]);
#undef VNNI_PAIR
        __m512 ia = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(z0, z1, 0x88));
        __m512 ib = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(z0, z1, 0xdd));
        acc = _mm512_fmadd_ps(ia, _mm512_mul_ps(vnni_scales(g, 0, rb, m), _mm512_set1_ps(qd[2 * P])), acc);
        acc = _mm512_fmadd_ps(ib, _mm512_mul_ps(vnni_scales(g, gb, rb, m), _mm512_set1_ps(qd[2 * P + 1])), acc);
    }
    return acc;
}

/* s[j] = scale * q . k_j for n q8_0 key rows rb bytes apart */
void op_att_qkey_scores_avx512(float *s, const int8_t *qc, const float *qd, const uint8_t *k, size_t rb, int n,
                               int hd, float scale) {
    for (int c = 0; c < n; c += 16) {
        int m = n - c < 16 ? n - c : 16;
        __m512 d = vnni_qk16(qc, qd, k + (size_t)c * rb, rb, m, hd, false);
        _mm512_mask_storeu_ps(s + c, (__mmask16)((1u << m) - 1), _mm512_mul_ps(d, _mm512_set1_ps(scale)));
    }
}

/* The 64 codes of a pair of groups of a q8_0 (q4: q4_0) row, as floats, 16
 * elements a register: widening loads (q4_0: each of a group's 16 bytes
 * holds element j in its low nibble and j + 16 in its high one, + 8) */
static inline __attribute__((always_inline)) void vnni_codes64(const uint8_t *r, bool q4, __m512 *f) {
    if (!q4) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + 2 + 16 * i + 2 * (i / 2)))));
        return;
    }
    const __m512i nib = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
#pragma GCC unroll 2
    for (int g = 0; g < 2; g++) {
        __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + 2 + 18 * g)));
        f[2 * g] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(z, nib), eight));
        f[2 * g + 1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(z, 4), eight));
    }
}

/* o[i] += sum_j p_j v_j[i], i < 64, for m <= 16 q8_0 (q4: q4_0) value rows
 * rb bytes apart (rows: a pair of groups; p_j in lane j, 0 in lanes >= m):
 * the keys' p times their group scales in one multiply, then per key and 16
 * elements a widening load, a conversion and an FMA into accumulators that
 * stay in registers. The probabilities stay f32: rounding them to integers
 * per tile (for vpdpbusd / vpdpwssd) would cost more accuracy than the tests
 * allow for the few cycles it saves. */
static inline __attribute__((always_inline)) void vnni_pv16(float *o, __m512 p, const uint8_t *rows, size_t rb, int m,
                                                            bool q4) {
    __m512 a0 = _mm512_loadu_ps(o), a1 = _mm512_loadu_ps(o + 16), a2 = _mm512_loadu_ps(o + 32),
           a3 = _mm512_loadu_ps(o + 48);
    float c0[16], c1[16];
    _mm512_storeu_ps(c0, _mm512_mul_ps(p, vnni_scales(rows, 0, rb, m)));
    _mm512_storeu_ps(c1, _mm512_mul_ps(p, vnni_scales(rows, q4 ? 18 : 34, rb, m)));
    /* odd keys in a second set of accumulators: half the FMA chain */
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0, f[4];
    int x = 0;
    for (; x + 2 <= m; x += 2) {
        const uint8_t *r = rows + (size_t)x * rb, *r2 = r + rb;
        __m512 w0 = _mm512_set1_ps(c0[x]), w1 = _mm512_set1_ps(c1[x]);
        vnni_codes64(r, q4, f);
        a0 = _mm512_fmadd_ps(w0, f[0], a0);
        a1 = _mm512_fmadd_ps(w0, f[1], a1);
        a2 = _mm512_fmadd_ps(w1, f[2], a2);
        a3 = _mm512_fmadd_ps(w1, f[3], a3);
        w0 = _mm512_set1_ps(c0[x + 1]);
        w1 = _mm512_set1_ps(c1[x + 1]);
        vnni_codes64(r2, q4, f);
        b0 = _mm512_fmadd_ps(w0, f[0], b0);
        b1 = _mm512_fmadd_ps(w0, f[1], b1);
        b2 = _mm512_fmadd_ps(w1, f[2], b2);
        b3 = _mm512_fmadd_ps(w1, f[3], b3);
    }
    if (x < m) {
        __m512 w0 = _mm512_set1_ps(c0[x]), w1 = _mm512_set1_ps(c1[x]);
        vnni_codes64(rows + (size_t)x * rb, q4, f);
        a0 = _mm512_fmadd_ps(w0, f[0], a0);
        a1 = _mm512_fmadd_ps(w0, f[1], a1);
        a2 = _mm512_fmadd_ps(w1, f[2], a2);
        a3 = _mm512_fmadd_ps(w1, f[3], a3);
    }
    _mm512_storeu_ps(o, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(o + 16, _mm512_add_ps(a1, b1));
    _mm512_storeu_ps(o + 32, _mm512_add_ps(a2, b2));
    _mm512_storeu_ps(o + 48, _mm512_add_ps(a3, b3));
}

/* vnni_pv16 for two rows (oa, pa) and (ob, pb) sharing the values: each
 * code widened and converted once for both */
static inline __attribute__((always_inline)) void vnni_pv16x2(float *oa, float *ob, __m512 pa, __m512 pb,
                                                              const uint8_t *rows, size_t rb, int m, bool q4) {
    __m512 a0 = _mm512_loadu_ps(oa), a1 = _mm512_loadu_ps(oa + 16), a2 = _mm512_loadu_ps(oa + 32),
           a3 = _mm512_loadu_ps(oa + 48);
    __m512 b0 = _mm512_loadu_ps(ob), b1 = _mm512_loadu_ps(ob + 16), b2 = _mm512_loadu_ps(ob + 32),
           b3 = _mm512_loadu_ps(ob + 48);
    float ca0[16], ca1[16], cb0[16], cb1[16];
    __m512 d0 = vnni_scales(rows, 0, rb, m), d1 = vnni_scales(rows, q4 ? 18 : 34, rb, m);
    _mm512_storeu_ps(ca0, _mm512_mul_ps(pa, d0));
    _mm512_storeu_ps(ca1, _mm512_mul_ps(pa, d1));
    _mm512_storeu_ps(cb0, _mm512_mul_ps(pb, d0));
    _mm512_storeu_ps(cb1, _mm512_mul_ps(pb, d1));
    for (int x = 0; x < m; x++) {
        __m512 f[4];
        vnni_codes64(rows + (size_t)x * rb, q4, f);
        __m512 f0 = f[0], f1 = f[1], f2 = f[2], f3 = f[3];
        __m512 wa0 = _mm512_set1_ps(ca0[x]), wa1 = _mm512_set1_ps(ca1[x]);
        __m512 wb0 = _mm512_set1_ps(cb0[x]), wb1 = _mm512_set1_ps(cb1[x]);
        a0 = _mm512_fmadd_ps(wa0, f0, a0);
        a1 = _mm512_fmadd_ps(wa0, f1, a1);
        a2 = _mm512_fmadd_ps(wa1, f2, a2);
        a3 = _mm512_fmadd_ps(wa1, f3, a3);
        b0 = _mm512_fmadd_ps(wb0, f0, b0);
        b1 = _mm512_fmadd_ps(wb0, f1, b1);
        b2 = _mm512_fmadd_ps(wb1, f2, b2);
        b3 = _mm512_fmadd_ps(wb1, f3, b3);
    }
    _mm512_storeu_ps(oa, a0);
    _mm512_storeu_ps(oa + 16, a1);
    _mm512_storeu_ps(oa + 32, a2);
    _mm512_storeu_ps(oa + 48, a3);
    _mm512_storeu_ps(ob, b0);
    _mm512_storeu_ps(ob + 16, b1);
    _mm512_storeu_ps(ob + 32, b2);
    _mm512_storeu_ps(ob + 48, b3);
}

/* o[i] += sum_j p[j] * v_j[i] for n q8_0 value rows rb bytes apart */
void op_att_qval_pv_avx512(float *o, const float *p, const uint8_t *v, size_t rb, int n, int hd) {
    for (int c = 0; c < n; c += 16) {
        int m = n - c < 16 ? n - c : 16;
        __m512 pv = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), p + c);
        for (int i = 0; i < hd; i += 64) vnni_pv16(o + i, pv, v + (size_t)c * rb + (size_t)i / 32 * 34, rb, m, false);
    }
}

#include "ops/simd_math512.h"

/* ---- f32 / f16 / bf16 rows in 512-bit registers ------------------------------ */
/* 16 elements from element i of a row of a float type, as floats (f16:
 * vcvtph2ps, bf16: a shift; both exact, as the reference dequantizers) */
static inline __attribute__((always_inline)) __m512 vf_ld16(const uint8_t *row, int i, int type) {
    if (type == KVLM_CACHE_F32) return _mm512_loadu_ps((const float *)row + i);
    __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    if (type == KVLM_CACHE_F16) return _mm512_cvtph_ps(w);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}

/* lane x = the sum of v[x]'s 16 lanes: pairs of registers unpacked and added,
 * then 128-bit shuffles. Every lane sums in the same tree, so a dot product
 * does not depend on the lane it lands in. */
static inline __attribute__((always_inline)) __m512 vf_sum16(const __m512 *v) {
    __m512 t[8], u[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

/* Prefetches the K and V rows of keys lo..hi-1 (of n) at kp[], vp[], into
 * L2 (prefetcht1), not L1: a prefetcht0 holds one of the L1's few miss
 * buffers until its line arrives from DRAM, and with a tile of prefetches in
 * flight the core stalled on them (a third of the scoring loop's cycles on
 * the instruction after the prefetch, perf); the L2 tracks many more misses,
 * and the tile's loads then hit it (docs/attention.md). kp or vp NULL: the
 * other's rows alone. */
static inline __attribute__((always_inline)) void pf_rows(const uint8_t *const *kp, const uint8_t *const *vp, int n,
                                                          int lo, int hi, size_t krb, size_t vrb) {
    for (int x = lo; x < hi && x < n; x++) {
        if (kp)
            for (uintptr_t q = (uintptr_t)kp[x] & ~(uintptr_t)63; q < (uintptr_t)kp[x] + krb; q += 64)
                __builtin_prefetch((const void *)q, 0, 2);
        if (vp)
            for (uintptr_t q = (uintptr_t)vp[x] & ~(uintptr_t)63; q < (uintptr_t)vp[x] + vrb; q += 64)
                __builtin_prefetch((const void *)q, 0, 2);
    }
}

/* sa[j] = scale * qa . k_j for the n keys at kp[] (hd % 16 == 0), and with
 * `two` sb[j] for qb too, each key loaded and converted once for both. Per
 * key one head-dim-wide FMA chain, then vf_sum16 reduces 16 keys (one row)
 * or 8 keys of each row at once. kpn[] (nn keys): the next tile's rows,
 * prefetched chunk by chunk, ATT_BK keys ahead (and vpn[]'s, unless NULL:
 * float values' rows are asked for during P.V, vf_pv). */
static inline __attribute__((always_inline)) void vf_scores(float *sa, float *sb, const float *qa, const float *qb,
                                                            const uint8_t *const *kp, int n, int hd, int type,
                                                            bool two, __m512 vscale, const uint8_t *const *kpn,
                                                            const uint8_t *const *vpn, int nn, size_t krb, size_t vrb) {
    const int step = two ? 8 : 16;
    for (int c = 0; c < n; c += step) {
        int m = n - c < step ? n - c : step;
        if (kpn) pf_rows(kpn, vpn, nn, c, c + step, krb, vrb);
        __m512 v[16];
#pragma GCC unroll 16
        for (int x = 0; x < 16; x++) v[x] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int x = 0; x < 16; x++) {
            if (x >= step || x >= m) continue;
            const uint8_t *k = kp[c + x];
            __m512 a = _mm512_setzero_ps(), b = a;
#pragma GCC unroll 8
            for (int i = 0; i < hd; i += 16) {
                __m512 kv = vf_ld16(k, i, type);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qa + i), kv, a);
                if (two) b = _mm512_fmadd_ps(_mm512_loadu_ps(qb + i), kv, b);
            }
            v[x] = a;
            if (two) v[8 + x] = b;
        }
        __m512 d = _mm512_mul_ps(vf_sum16(v), vscale);
        __mmask16 mk = (__mmask16)((1u << m) - 1);
        _mm512_mask_storeu_ps(sa + c, mk, d);
        if (two) _mm512_mask_storeu_ps(sb + c - 8, (__mmask16)(mk << 8), d); /* lanes 8.. to sb + c.. */
    }
}

/* oa[i] += sum_j pa[j] v_j[i] (and ob with pb with `two`) for the n values
 * at vp[] (hd % 16 == 0), 64 output elements at a time in registers; keys
 * of even and odd index in the tile in two sets of accumulators (the FMA
 * chains' latency), added at the end: the sums depend on the tile alone,
 * never on how the cache splits it into blocks. vpn[] (nn keys, or NULL):
 * the next tile's value rows, asked into L2 two keys at a time as this
 * tile's are summed. The scores ask for the next tile's keys, so the
 * misses in flight are spread over the whole tile rather than bunched in
 * its first half, so memory is not idle at the tile's end (q8_0 values
 * were slower so and keep both requests in the scoring loop;
 * docs/attention.md). */
static inline __attribute__((always_inline)) void vf_pv(float *oa, float *ob, const float *pa, const float *pb,
                                                        const uint8_t *const *vp, int n, int hd, int type, bool two,
                                                        const uint8_t *const *vpn, int nn, size_t vrb) {
    for (int i = 0; i < hd; i += 64) {
        const int nz = hd - i < 64 ? (hd - i) / 16 : 4;
        __m512 a[4], a2[4], b[4], b2[4];
#pragma GCC unroll 4
        for (int z = 0; z < 4; z++) {
            a[z] = a2[z] = b[z] = b2[z] = _mm512_setzero_ps();
            if (z >= nz) continue;
            a[z] = _mm512_loadu_ps(oa + i + 16 * z);
            if (two) b[z] = _mm512_loadu_ps(ob + i + 16 * z);
        }
        int x = 0;
        for (; x + 2 <= n; x += 2) {
            if (vpn && i == 0) pf_rows(NULL, vpn, nn, x, x + 2, 0, vrb);
            const uint8_t *r0 = vp[x], *r1 = vp[x + 1];
            __m512 p0 = _mm512_set1_ps(pa[x]), p1 = _mm512_set1_ps(pa[x + 1]);
            __m512 q0 = two ? _mm512_set1_ps(pb[x]) : p0, q1 = two ? _mm512_set1_ps(pb[x + 1]) : p1;
#pragma GCC unroll 4
            for (int z = 0; z < 4; z++) {
                if (z >= nz) continue;
                __m512 f0 = vf_ld16(r0, i + 16 * z, type), f1 = vf_ld16(r1, i + 16 * z, type);
                a[z] = _mm512_fmadd_ps(p0, f0, a[z]);
                a2[z] = _mm512_fmadd_ps(p1, f1, a2[z]);
                if (two) {
                    b[z] = _mm512_fmadd_ps(q0, f0, b[z]);
                    b2[z] = _mm512_fmadd_ps(q1, f1, b2[z]);
                }
            }
        }
        if (x < n) {
            __m512 p0 = _mm512_set1_ps(pa[x]), q0 = two ? _mm512_set1_ps(pb[x]) : p0;
#pragma GCC unroll 4
            for (int z = 0; z < 4; z++) {
                if (z >= nz) continue;
                __m512 f0 = vf_ld16(vp[x], i + 16 * z, type);
                a[z] = _mm512_fmadd_ps(p0, f0, a[z]);
                if (two) b[z] = _mm512_fmadd_ps(q0, f0, b[z]);
            }
        }
#pragma GCC unroll 4
        for (int z = 0; z < 4; z++) {
            if (z >= nz) continue;
            _mm512_storeu_ps(oa + i + 16 * z, _mm512_add_ps(a[z], a2[z]));
            if (two) _mm512_storeu_ps(ob + i + 16 * z, _mm512_add_ps(b[z], b2[z]));
        }
    }
    if (vpn) pf_rows(NULL, vpn, nn, n & ~1, nn, 0, vrb); /* the rest, past this tile's keys */
}

/* vf_scores and vf_pv compiled per type, row count and head dim (64 and
 * 128 unrolled, with the query in registers; any other multiple of 16) */
#define VF_DISPATCH(call, type, two, hd)                                                               \
    do {                                                                                               \
        if (type == KVLM_CACHE_F32) VF_HD(call, KVLM_CACHE_F32, two, hd);                              \
        else if (type == KVLM_CACHE_F16) VF_HD(call, KVLM_CACHE_F16, two, hd);                         \
        else VF_HD(call, KVLM_CACHE_BF16, two, hd);                                                    \
    } while (0)
#define VF_HD(call, t, two, hd)                                                                        \
    do {                                                                                               \
        if (hd == 64) VF_TWO(call, t, two, 64);                                                        \
        else if (hd == 128) VF_TWO(call, t, two, 128);                                                 \
        else VF_TWO(call, t, two, hd);                                                                 \
    } while (0)
#define VF_TWO(call, t, two, h)                                                                        \
    do {                                                                                               \
        if (two) call(t, true, h);                                                                     \
        else call(t, false, h);                                                                        \
    } while (0)

static void vf_scores_any(float *sa, float *sb, const float *qa, const float *qb, const uint8_t *const *kp, int n,
                          int hd, int type, bool two, __m512 vscale, const uint8_t *const *kpn,
                          const uint8_t *const *vpn, int nn, size_t krb, size_t vrb) {
#define VF_S(t, tw, h) vf_scores(sa, sb, qa, qb, kp, n, h, t, tw, vscale, kpn, vpn, nn, krb, vrb)
    VF_DISPATCH(VF_S, type, two, hd);
#undef VF_S
}

static void vf_pv_any(float *oa, float *ob, const float *pa, const float *pb, const uint8_t *const *vp, int n,
                      int hd, int type, bool two, const uint8_t *const *vpn, int nn, size_t vrb) {
#define VF_P(t, tw, h) vf_pv(oa, ob, pa, pb, vp, n, h, t, tw, vpn, nn, vrb)
    VF_DISPATCH(VF_P, type, two, hd);
#undef VF_P
}
#undef VF_DISPATCH
#undef VF_HD
#undef VF_TWO

/* The K and V rows of KV head h at positions p..p+n-1 into kp[], vp[], in
 * any layout (the block and slot advance run by run: no division per run). */
static void row_ptrs(const op_attn_args *a, int h, int p, int n, size_t krb, size_t vrb, const uint8_t **kp,
                     const uint8_t **vp) {
    if (!a->blocks) {
        const uint8_t *k = (const uint8_t *)key_at(a, h, p), *v = (const uint8_t *)value_at(a, h, p);
        for (int x = 0; x < n; x++) { kp[x] = k + (size_t)x * krb; vp[x] = v + (size_t)x * vrb; }
        return;
    }
    const int bs = a->block_size;
    for (int x = 0, b = p / bs, slot = p % bs, len; x < n; x += len, b++, slot = 0) {
        len = bs - slot < n - x ? bs - slot : n - x;
        const uint8_t *k, *v;
        if (a->head_bytes) {
            k = (const uint8_t *)a->blocks[b] + (size_t)h * a->head_bytes;
            v = k + a->v_bytes + (size_t)slot * vrb;
            k += (size_t)slot * krb;
        } else {
            k = (const uint8_t *)(a->blocks[b] + (size_t)h * a->head_stride + (size_t)slot * a->head_dim);
            v = k + a->v_offset * sizeof(float);
        }
        for (int i = 0; i < len; i++) { kp[x + i] = k + (size_t)i * krb; vp[x + i] = v + (size_t)i * vrb; }
    }
}

/* The cache types the AVX512 tile takes: f32, f16, bf16 (hd % 16 == 0)
 * and q8_0, q4_0 (hd % 64 == 0), keys and values chosen separately; an
 * untyped layout is f32. */
static int tile_type(const op_attn_args *a, bool key) {
    return a->blocks && a->head_bytes ? (key ? a->k_type : a->v_type) : KVLM_CACHE_F32;
}
static bool vnni_tile_ok(const op_attn_args *a) {
    for (int i = 0; i < 2; i++) {
        int t = tile_type(a, i == 0);
        bool flt = t == KVLM_CACHE_F32 || t == KVLM_CACHE_F16 || t == KVLM_CACHE_BF16;
        if (int_keys(t) ? a->head_dim % 64 : !flt || a->head_dim % 16) return false;
    }
    return true;
}

/* The AVX512 tile, for the types vnni_tile_ok takes: keys kb..kb+n-1 (a
 * tile of up to ATT_BK) and the R rows of an item (decode or prefill). The
 * scores of the whole tile first (f32 / f16 / bf16 keys: vf_scores, rows two
 * at a time; q8_0 / q4_0 keys: vnni_qk16 run by run), then the online
 * softmax in 512-bit registers, then P.V (vf_pv, rows two at a time; q8_0 /
 * q4_0: vnni_pv16). k_end bounds the prefetch of the next tile. qr: the rows'
 * queries; qc, qd: as int8 for q8_0 / q4_0 keys; other arguments as
 * fused_block's. */
static void vnni_tile(const op_attn_args *a, int h, int kb, int n, int R, const int *vis, const float *const *qr,
                      const int8_t *qc, const float *qd, float *S, float *O, float *M, float *L, float *const *W,
                      int k_end) {
    const int hd = a->head_dim, bs = a->block_size, nq = hd / 32, kt = tile_type(a, true), vt = tile_type(a, false);
    const size_t krb = op_kv_row_bytes(kt, hd), vrb = op_kv_row_bytes(vt, hd);
    const __m512 vscale = _mm512_set1_ps(a->scale);
    int vr[ATT_RMAX];
    for (int r = 0; r < R; r++) vr[r] = vis[r] < n ? (vis[r] > 0 ? vis[r] : 0) : n;
    const uint8_t *kp[ATT_BK], *vp[ATT_BK], *kpn[ATT_BK], *vpn[ATT_BK];
    /* the next tile's rows, prefetched into L2 while this one is scored: the
     * hardware prefetcher follows a page, not the jump to the next scattered
     * block. (With prefetcht0, f32 blocks that fill a page were better left
     * to the hardware; into L2 they pay for f32 too. A tile further ahead
     * took more cycles for f16 and q8_0.) */
    int nn = k_end - kb - n < ATT_BK ? k_end - kb - n : ATT_BK;
    if (!a->blocks) nn = 0;
    row_ptrs(a, h, kb, n, krb, vrb, kp, vp);
    if (nn > 0) row_ptrs(a, h, kb + n, nn, krb, vrb, kpn, vpn);
    /* the next tile's value rows while scoring only for q8_0 values: float
     * values' are asked for during P.V (vf_pv) */
    const bool kq = int_keys(kt), vq = int_keys(vt); /* q8_0 or q4_0 */
    const uint8_t *const *vps = vq ? vpn : NULL;
    if (kq) {
        for (int x = 0, len, b = kb / bs, slot = kb % bs; x < n; x += len, b++, slot = 0) {
            len = bs - slot < n - x ? bs - slot : n - x;
            if (nn > 0) pf_rows(kpn, vps, nn, x, x + len, krb, vrb);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < len && x + c < vr[r]; c += 16) {
                    int m = vr[r] - x - c < 16 ? vr[r] - x - c : 16;
                    m = len - c < m ? len - c : m;
                    __m512 d = vnni_qk16(qc + (size_t)r * hd, qd + (size_t)r * nq, kp[x + c], krb, m, hd,
                                         kt == KVLM_CACHE_Q4_0);
                    _mm512_mask_storeu_ps(S + (size_t)r * ATT_BK + x + c, (__mmask16)((1u << m) - 1),
                                          _mm512_mul_ps(d, vscale));
                }
        }
    } else
        for (int r = 0; r < R; r += 2) {
            bool two = r + 1 < R;
            int nv = two && vr[r + 1] > vr[r] ? vr[r + 1] : vr[r];
            float *s = S + (size_t)r * ATT_BK;
            const uint8_t *const *pk = r == 0 && nn > 0 ? kpn : NULL;
            vf_scores_any(s, s + ATT_BK, qr[r], two ? qr[r + 1] : NULL, kp, nv, hd, kt, two, vscale, pk, vps, nn,
                          krb, vrb);
        }
    for (int r = 0; r < R; r++) {
        float *s = S + (size_t)r * ATT_BK, *o = O + (size_t)r * hd;
        if (vr[r] <= 0) {
            memset(s, 0, sizeof(float) * (size_t)n);
            continue;
        }
        if (W) memcpy(W[r] + kb, s, sizeof(float) * (size_t)vr[r]); /* H2O: raw scores */
        __m512 vm = _mm512_set1_ps(-INFINITY);
        for (int x = 0; x < vr[r]; x += 16) {
            __mmask16 mk = vr[r] - x >= 16 ? 0xffff : (__mmask16)((1u << (vr[r] - x)) - 1);
            vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mk, s + x));
        }
        float mx = _mm512_reduce_max_ps(vm);
        if (mx > M[r]) { /* rescale what was summed under the old max */
            float alpha = expf(M[r] - mx);
            __m512 va = _mm512_set1_ps(alpha);
            for (int i = 0; i < hd; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), va));
            L[r] *= alpha;
            M[r] = mx;
        }
        __m512 vmax = _mm512_set1_ps(M[r]), sum = _mm512_setzero_ps();
        for (int x = 0; x < n; x += 16) { /* keys the row does not see get 0 */
            int m = vr[r] - x < 16 ? (vr[r] - x > 0 ? vr[r] - x : 0) : 16;
            __m512 e = op_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), s + x), vmax));
            e = _mm512_maskz_mov_ps((__mmask16)((1u << m) - 1), e);
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(s + x, e);
        }
        L[r] += _mm512_reduce_add_ps(sum);
    }
    /* rows two at a time (the query heads of a GQA group share each value
     * row), over the keys either sees (the other's weights are 0) */
    for (int r = 0; r < R; r += 2) {
        bool two = r + 1 < R;
        int nv = two && vr[r + 1] > vr[r] ? vr[r + 1] : vr[r];
        float *oa = O + (size_t)r * hd, *ob = oa + hd, *pa = S + (size_t)r * ATT_BK, *pb = pa + ATT_BK;
        if (vq) {
            for (int x = 0, len, slot = kb % bs; x < nv; x += len, slot = 0) {
                len = bs - slot < nv - x ? bs - slot : nv - x;
                for (int c = 0; c < len; c += 16) {
                    int m = len - c < 16 ? len - c : 16;
                    __mmask16 mk = (__mmask16)((1u << m) - 1);
                    __m512 p0 = _mm512_maskz_loadu_ps(mk, pa + x + c);
                    for (int i = 0; i < hd; i += 64) {
                        const uint8_t *vi = vp[x + c] + (size_t)i / 64 * (vrb * 64 / hd);
                        if (two)
                            vnni_pv16x2(oa + i, ob + i, p0, _mm512_maskz_loadu_ps(mk, pb + x + c), vi, vrb, m,
                                        vt == KVLM_CACHE_Q4_0);
                        else vnni_pv16(oa + i, p0, vi, vrb, m, vt == KVLM_CACHE_Q4_0);
                    }
                }
            }
        } else vf_pv_any(oa, ob, pa, pb, vp, nv, hd, vt, two, r == 0 && nn > 0 ? vpn : NULL, nn, vrb);
    }
}
/* The tile for an item of any number of rows (decode and prefill alike):
 * the types vnni_tile_ok takes. */
static bool tile_ok(const op_attn_args *a, int R) {
    (void)R;
    return vnni_tile_ok(a);
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

const op_att_kernels op_att_kernels_avx512 = {
    .tile_ok = tile_ok,
    .tile = vnni_tile,
};
#else
const op_att_kernels op_att_kernels_avx512; /* never chosen: the CPU level is scalar */
#endif
