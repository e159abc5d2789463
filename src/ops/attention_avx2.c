/* ops/attention_avx2: the AVX2/FMA/F16C attention kernels: f32 rows
 * (scores, P.V, exponentials), the typed caches' dequantizers, and the
 * decode kernels that convert typed key/value rows in registers (fused). */
#include <math.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/attention_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* outside the target regions: each intrinsic keeps its own target */

/* Prefetches the K and V rows of KV head h at positions p0..p0+n-1 (the
 * whole K region of a q4_kc block). */
static void prefetch_rows(const op_attn_args *a, int h, int p0, int n) {
    const int hd = a->head_dim;
    const size_t krb = op_kv_row_bytes(a->k_type, hd), vrb = op_kv_row_bytes(a->v_type, hd);
    for (int x = 0, len; x < n; x += len) {
        int p = p0 + x, slot = p % a->block_size;
        len = run_from(a, p, n - x);
        const uint8_t *region = (const uint8_t *)a->blocks[p / a->block_size] + (size_t)h * a->head_bytes;
        const uint8_t *k = a->k_type == KVLM_CACHE_Q4_KC ? region : region + slot * krb;
        size_t kn = a->k_type == KVLM_CACHE_Q4_KC ? op_kv_region_bytes(a->k_type, hd, a->block_size) : len * krb;
        const uint8_t *v = region + a->v_bytes + slot * vrb;
        /* into L2 (prefetcht1): see pf_rows in attention_avx512.c */
        for (size_t i = 0; i < kn; i += 64) __builtin_prefetch(k + i, 0, 2);
        for (size_t i = 0; i < len * vrb; i += 64) __builtin_prefetch(v + i, 0, 2);
    }
}

#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include "ops/simd_math.h"

static void scores_avx2(float *s, const float *q, const float *k, int nk, int hd, float scale) {
    const int h8 = hd & ~7;
    int j = 0;
    /* four keys at a time: one q load serves four FMAs, and one hadd tree
     * reduces the four dot products together */
    for (; j + 4 <= nk; j += 4) {
        const float *k0 = k + (size_t)j * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < h8; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
        }
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m128 d = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        float dd[4];
        _mm_storeu_ps(dd, d);
        for (int i = h8; i < hd; i++) {
            dd[0] += q[i] * k0[i];
            dd[1] += q[i] * k1[i];
            dd[2] += q[i] * k2[i];
            dd[3] += q[i] * k3[i];
        }
        for (int x = 0; x < 4; x++) s[j + x] = dd[x] * scale;
    }
    for (; j < nk; j++) {
        const float *kj = k + (size_t)j * hd;
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < h8; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), a);
        /* the same reduction order as the 4-key path, so a key's score does
         * not depend on which path (or cache block boundary) it fell in */
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
        float d = _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
        for (int i = h8; i < hd; i++) d += q[i] * kj[i];
        s[j] = d * scale;
    }
}

static void pv_avx2(float *o, const float *p, const float *v, int nk, int hd) {
    int i = 0;
    /* 32 output dims stay in registers while all nk keys pass */
    for (; i + 32 <= hd; i += 32) {
        __m256 o0 = _mm256_loadu_ps(o + i), o1 = _mm256_loadu_ps(o + i + 8);
        __m256 o2 = _mm256_loadu_ps(o + i + 16), o3 = _mm256_loadu_ps(o + i + 24);
        for (int j = 0; j < nk; j++) {
            const float *vj = v + (size_t)j * hd + i;
            __m256 pj = _mm256_broadcast_ss(p + j);
            o0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), o0);
            o1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), o1);
            o2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), o2);
            o3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), o3);
        }
        _mm256_storeu_ps(o + i, o0);
        _mm256_storeu_ps(o + i + 8, o1);
        _mm256_storeu_ps(o + i + 16, o2);
        _mm256_storeu_ps(o + i + 24, o3);
    }
    for (; i + 8 <= hd; i += 8) {
        __m256 o0 = _mm256_loadu_ps(o + i);
        for (int j = 0; j < nk; j++)
            o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + (size_t)j * hd + i), o0);
        _mm256_storeu_ps(o + i, o0);
    }
    for (; i < hd; i++) {
        float acc = o[i];
        for (int j = 0; j < nk; j++) acc += p[j] * v[(size_t)j * hd + i];
        o[i] = acc;
    }
}

/* Typed-cache tiles: the same floats as the scalar dequantizers (integer
 * codes convert exactly, then one rounding in the multiply by the scale). */
static void f16_to_f32_avx2(const uint16_t *x, float *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = dt_f16_to_f32(x[i]);
}

static void deq_rows_avx2(int type, const uint8_t *src, float *y, int n_rows, int hd) {
    size_t rb = op_kv_row_bytes(type, hd);
    int g = op_kv_group(type, hd);
    if (type == KVLM_CACHE_F16) { f16_to_f32_avx2((const uint16_t *)src, y, (size_t)n_rows * hd); return; }
    if (type == KVLM_CACHE_BF16) {
        size_t n = (size_t)n_rows * hd, i = 0;
        const uint16_t *x = (const uint16_t *)src;
        for (; i + 8 <= n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i)));
            _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        for (; i < n; i++) y[i] = dt_bf16_to_f32(x[i]);
        return;
    }
    if ((type != KVLM_CACHE_Q8_0 && type != KVLM_CACHE_Q4_0) || g % 16 != 0) {
        op_att_deq_rows_scalar(type, src, y, n_rows, hd);
        return;
    }
    for (int r = 0; r < n_rows; r++) {
        const uint8_t *b = src + (size_t)r * rb;
        float *yr = y + (size_t)r * hd;
        for (int i = 0; i < hd; i += g) {
            dt_f16 h;
            memcpy(&h, b, 2);
            __m256 d = _mm256_set1_ps(dt_f16_to_f32(h));
            if (type == KVLM_CACHE_Q8_0) {
                for (int j = 0; j < g; j += 8) {
                    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + j)));
                    _mm256_storeu_ps(yr + i + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
                }
                b += 2 + g;
            } else {
                int half = g / 2;
                const __m256i eight = _mm256_set1_epi32(8), m4 = _mm256_set1_epi32(0xf);
                for (int j = 0; j < half; j += 8) {
                    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + j)));
                    __m256i lo = _mm256_sub_epi32(_mm256_and_si256(w, m4), eight);
                    __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(w, 4), eight);
                    _mm256_storeu_ps(yr + i + j, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d));
                    _mm256_storeu_ps(yr + i + half + j, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d));
                }
                b += 2 + half;
            }
        }
    }
}

/* kc_scores_scalar with the same sums in another order: 16 tokens at a time
 * from 8 code bytes per channel (even tokens in the low nibbles, odd in the
 * high), the channel loop split in two accumulator pairs to hide FMA latency;
 * tokens whose 8 bytes would run past the channel's codes go one at a time. */
static void kc_scores_avx2(float *s, const float *q, const uint8_t *region, int hd, int bs, int t0, int n,
                           float scale, float *qs) {
    const int nb = (bs + 1) / 2;
    const uint8_t *codes = region + 4 * (size_t)hd;
    const int h8 = hd & ~7;
    __m256 vb = _mm256_setzero_ps();
    for (int c = 0; c < h8; c += 8) {
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(region + 2 * (size_t)c)));
        __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(region + 2 * ((size_t)hd + c))));
        __m256 qv = _mm256_loadu_ps(q + c);
        _mm256_storeu_ps(qs + c, _mm256_mul_ps(qv, sc));
        vb = _mm256_fmadd_ps(qv, mn, vb);
    }
    float bias = op_hsum256(vb);
    for (int c = h8; c < hd; c++) {
        dt_f16 hs, hm;
        memcpy(&hs, region + 2 * (size_t)c, 2);
        memcpy(&hm, region + 2 * ((size_t)hd + c), 2);
        qs[c] = q[c] * dt_f16_to_f32(hs);
        bias += q[c] * dt_f16_to_f32(hm);
    }
    const __m256i m4 = _mm256_set1_epi32(0xf);
    const __m256 vbias = _mm256_set1_ps(bias), vscale = _mm256_set1_ps(scale);
    int i = 0;
    while (i < n) {
        int t = t0 + i;
        if (!(t & 1) && t / 2 + 8 <= nb) {
            const uint8_t *cc = codes + t / 2;
            __m256 e0 = _mm256_setzero_ps(), o0 = e0, e1 = e0, o1 = e0;
            int c = 0;
            for (; c + 2 <= hd; c += 2) {
                __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cc + (size_t)c * nb)));
                __m256i w1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cc + (size_t)(c + 1) * nb)));
                __m256 q0 = _mm256_broadcast_ss(qs + c), q1 = _mm256_broadcast_ss(qs + c + 1);
                e0 = _mm256_fmadd_ps(q0, _mm256_cvtepi32_ps(_mm256_and_si256(w0, m4)), e0);
                o0 = _mm256_fmadd_ps(q0, _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)), o0);
                e1 = _mm256_fmadd_ps(q1, _mm256_cvtepi32_ps(_mm256_and_si256(w1, m4)), e1);
                o1 = _mm256_fmadd_ps(q1, _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4)), o1);
            }
            for (; c < hd; c++) {
                __m256i w0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cc + (size_t)c * nb)));
                __m256 q0 = _mm256_broadcast_ss(qs + c);
                e0 = _mm256_fmadd_ps(q0, _mm256_cvtepi32_ps(_mm256_and_si256(w0, m4)), e0);
                o0 = _mm256_fmadd_ps(q0, _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4)), o0);
            }
            __m256 ev = _mm256_add_ps(e0, e1), od = _mm256_add_ps(o0, o1);
            /* lanes hold even tokens 0,2,..,14 and odd 1,3,..,15: interleave */
            __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);
            float r[16];
            _mm256_storeu_ps(r, _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), vbias), vscale));
            _mm256_storeu_ps(r + 8, _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x31), vbias), vscale));
            int m = n - i < 16 ? n - i : 16;
            memcpy(s + i, r, sizeof(float) * (size_t)m);
            i += m;
        } else {
            int sh = 4 * (t & 1);
            const uint8_t *cc = codes + t / 2;
            float acc = 0;
            for (int c = 0; c < hd; c++) acc += qs[c] * (float)((cc[(size_t)c * nb] >> sh) & 0xf);
            s[i] = (acc + bias) * scale;
            i++;
        }
    }
}

/* quantize_query's codes and scales, the same bits (g % 8 == 0): the max is
 * exact in any order, and cvtps rounds to nearest even as lrintf does */
static void quantize_query_avx2(const float *x, int8_t *c, float *d, int hd, int g) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < hd; i += g) {
        __m256 vm = _mm256_setzero_ps();
        for (int j = 0; j < g; j += 8) vm = _mm256_max_ps(vm, _mm256_and_ps(_mm256_loadu_ps(x + i + j), absm));
        float dd = op_hmax256(vm) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        d[i / g] = dd;
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
        for (int j = 0; j < g; j += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + j), vid));
            v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
            __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(c + i + j), _mm_packs_epi16(w, w));
        }
    }
}

/* q8_0 / q4_0 keys scored straight from their rows, dequantized in registers:
 * for decode (one or two rows per item) there is no tile of rows to spread a
 * dequantization over, and the tile's store and reload cost as much as the
 * dot products. Per group: the codes' dot product with q, then times the
 * group's scale. g % 16 == 0; nk rows rb bytes apart. */
/* n is padded to a multiple of 8 with -inf entries, which give 0 */
static float exp_sum_avx2(float *s, int n, float m) {
    __m256 vm = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        __m256 e = op_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return op_hsum256(sum);
}

/* y[i] = x[i] * s for i < n & ~7; returns how many */
static int scale_avx2(float *y, const float *x, float s, int n) {
    __m256 vs = _mm256_set1_ps(s);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    return i;
}

/* H2O: kw[i] += exp(s[i] - m) * il for i < n & ~7; returns how many */
static int add_probs_avx2(float *kw, const float *s, int n, float m, float il) {
    __m256 vm = _mm256_set1_ps(m), vi = _mm256_set1_ps(il);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(kw + i, _mm256_fmadd_ps(op_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm)), vi,
                                                 _mm256_loadu_ps(kw + i)));
    return i;
}

/* ---- fused kernels: keys and values used straight from their cache rows ------
 * Decode has one or a few query rows per KV head, too few to spread a tile's
 * dequantization over: there the tile's store and reload cost more than the
 * arithmetic. These kernels convert each key or value in registers as they
 * read it: F16C for f16, a shift for bf16, and for q8_0 / q4_0 keys integer
 * dot products with the int8 query (maddubs + madd), the two scales applied
 * once per 32-element group; q8_0 / q4_0 values are widened to f32 and
 * scaled by p_j times the group's scale. */

/* the four dot products of a0..a3 (lane sums) into d, in scores_avx2's order */
static inline __attribute__((always_inline)) void hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(d, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

static inline __attribute__((always_inline)) float f16_at(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b, 2);
    return _cvtsh_ss(h);
}

/* 32 codes of a q8_0 / q4_0 group as signed bytes, in element order */
static inline __attribute__((always_inline)) __m256i group_codes(const uint8_t *b, bool q4) {
    if (!q4) return _mm256_loadu_si256((const __m256i *)(b + 2));
    __m128i x = _mm_loadu_si128((const __m128i *)(b + 2));
    __m256i k = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0xf));
    return _mm256_sub_epi8(k, _mm256_set1_epi8(8));
}

/* lanes summing to q . k for a q8_0 / q4_0 key row (g = 32) and the int8
 * query qc with group scales qd */
static inline __attribute__((always_inline)) __m256 qkey_dot(const uint8_t *row, const int8_t *qc, const float *qd,
                                                             int ng, bool q4) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int gi = 0; gi < ng; gi++) {
        const uint8_t *b = row + (size_t)gi * (q4 ? 18 : 34);
        __m256i k = group_codes(b, q4), q = _mm256_loadu_si256((const __m256i *)(qc + 32 * gi));
        /* |k| (unsigned) times q with k's sign: pairs of products fit int16 */
        __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(k), _mm256_sign_epi8(q, k)), ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(f16_at(b) * qd[gi]), acc);
    }
    return acc;
}

/* s[j] = scale * q . k_j for n key rows rb bytes apart */
static inline __attribute__((always_inline)) void qkey_scores(float *s, const int8_t *qc, const float *qd,
                                                              const uint8_t *k, size_t rb, int n, int hd, float scale,
                                                              bool q4) {
    const int ng = hd / 32;
    float d[4];
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const uint8_t *r = k + (size_t)j * rb;
        hsum4(qkey_dot(r, qc, qd, ng, q4), qkey_dot(r + rb, qc, qd, ng, q4), qkey_dot(r + 2 * rb, qc, qd, ng, q4),
              qkey_dot(r + 3 * rb, qc, qd, ng, q4), d);
        for (int x = 0; x < 4; x++) s[j + x] = d[x] * scale;
    }
    for (; j < n; j++) {
        __m256 a = qkey_dot(k + (size_t)j * rb, qc, qd, ng, q4);
        hsum4(a, a, a, a, d);
        s[j] = d[0] * scale;
    }
}

/* The 32 codes of a q8_0 / q4_0 group as four vectors of floats. */
#define QGROUP_FLOATS(b, q4, f0, f1, f2, f3)                                                              \
    do {                                                                                                  \
        if (q4) {                                                                                         \
            __m128i x_ = _mm_loadu_si128((const __m128i *)((b) + 2)), m4_ = _mm_set1_epi8(0xf);            \
            __m128i e8_ = _mm_set1_epi8(8);                                                               \
            __m128i lo_ = _mm_sub_epi8(_mm_and_si128(x_, m4_), e8_);                                      \
            __m128i hi_ = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(x_, 4), m4_), e8_);                   \
            f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo_));                                           \
            f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo_, 8)));                        \
            f2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi_));                                           \
            f3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi_, 8)));                        \
        } else {                                                                                          \
            f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((b) + 2))));   \
            f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((b) + 10))));  \
            f2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((b) + 18))));  \
            f3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((b) + 26))));  \
        }                                                                                                 \
    } while (0)

/* qkey_scores for two query rows (a, b) sharing each key: its codes, their
 * absolute values and its scales are loaded once for both */
static inline __attribute__((always_inline)) void qkey_scores2(float *sa, float *sb, const int8_t *qa, const float *da,
                                                               const int8_t *qb, const float *db, const uint8_t *k,
                                                               size_t rb, int n, int hd, float scale, bool q4) {
    const int ng = hd / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    float d[4];
    for (int j = 0; j < n; j += 4) {
        int m = n - j < 4 ? n - j : 4;
        __m256 a[4], b[4];
        for (int x = 0; x < 4; x++) a[x] = b[x] = _mm256_setzero_ps();
        for (int gi = 0; gi < ng; gi++) {
            __m256i q0 = _mm256_loadu_si256((const __m256i *)(qa + 32 * gi));
            __m256i q1 = _mm256_loadu_si256((const __m256i *)(qb + 32 * gi));
            for (int x = 0; x < m; x++) {
                const uint8_t *g = k + (size_t)(j + x) * rb + (size_t)gi * (q4 ? 18 : 34);
                __m256i c = group_codes(g, q4), ac = _mm256_abs_epi8(c);
                float dk = f16_at(g);
                __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, _mm256_sign_epi8(q0, c)), ones);
                __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ac, _mm256_sign_epi8(q1, c)), ones);
                a[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(dk * da[gi]), a[x]);
                b[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(dk * db[gi]), b[x]);
            }
        }
        /* a key's sums reduce as in qkey_scores, whatever its place in the four */
        if (m == 4) {
            hsum4(a[0], a[1], a[2], a[3], d);
            for (int x = 0; x < 4; x++) sa[j + x] = d[x] * scale;
            hsum4(b[0], b[1], b[2], b[3], d);
            for (int x = 0; x < 4; x++) sb[j + x] = d[x] * scale;
        } else
            for (int x = 0; x < m; x++) {
                hsum4(a[x], a[x], a[x], a[x], d);
                sa[j + x] = d[0] * scale;
                hsum4(b[x], b[x], b[x], b[x], d);
                sb[j + x] = d[0] * scale;
            }
    }
}

/* o[i] += sum_j p[j] * v_j[i] for n q8_0 / q4_0 value rows rb bytes apart:
 * even and odd keys in two sets of accumulators, to hide the FMA latency */
static inline __attribute__((always_inline)) void qval_pv(float *o, const float *p, const uint8_t *v, size_t rb, int n,
                                                          int hd, bool q4) {
    const size_t gb = q4 ? 18 : 34;
    for (int gi = 0; gi < hd / 32; gi++) {
        float *og = o + 32 * gi;
        __m256 a0 = _mm256_loadu_ps(og), a1 = _mm256_loadu_ps(og + 8);
        __m256 a2 = _mm256_loadu_ps(og + 16), a3 = _mm256_loadu_ps(og + 24);
        __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0, f0, f1, f2, f3;
        const uint8_t *g = v + (size_t)gi * gb;
        int j = 0;
        for (; j + 2 <= n; j += 2) {
            const uint8_t *x0 = g + (size_t)j * rb, *x1 = x0 + rb;
            __m256 c = _mm256_set1_ps(p[j] * f16_at(x0));
            QGROUP_FLOATS(x0, q4, f0, f1, f2, f3);
            a0 = _mm256_fmadd_ps(c, f0, a0);
            a1 = _mm256_fmadd_ps(c, f1, a1);
            a2 = _mm256_fmadd_ps(c, f2, a2);
            a3 = _mm256_fmadd_ps(c, f3, a3);
            c = _mm256_set1_ps(p[j + 1] * f16_at(x1));
            QGROUP_FLOATS(x1, q4, f0, f1, f2, f3);
            b0 = _mm256_fmadd_ps(c, f0, b0);
            b1 = _mm256_fmadd_ps(c, f1, b1);
            b2 = _mm256_fmadd_ps(c, f2, b2);
            b3 = _mm256_fmadd_ps(c, f3, b3);
        }
        if (j < n) {
            const uint8_t *x0 = g + (size_t)j * rb;
            __m256 c = _mm256_set1_ps(p[j] * f16_at(x0));
            QGROUP_FLOATS(x0, q4, f0, f1, f2, f3);
            a0 = _mm256_fmadd_ps(c, f0, a0);
            a1 = _mm256_fmadd_ps(c, f1, a1);
            a2 = _mm256_fmadd_ps(c, f2, a2);
            a3 = _mm256_fmadd_ps(c, f3, a3);
        }
        _mm256_storeu_ps(og, _mm256_add_ps(a0, b0));
        _mm256_storeu_ps(og + 8, _mm256_add_ps(a1, b1));
        _mm256_storeu_ps(og + 16, _mm256_add_ps(a2, b2));
        _mm256_storeu_ps(og + 24, _mm256_add_ps(a3, b3));
    }
}

/* eight f16 (or bf16) elements as floats */
static inline __attribute__((always_inline)) __m256 ld_half(const uint16_t *x, bool bf) {
    __m128i w = _mm_loadu_si128((const __m128i *)x);
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
    return _mm256_cvtph_ps(w);
}

/* scores_avx2 for f16 / bf16 keys (hd % 8 == 0) */
static inline __attribute__((always_inline)) void half_scores(float *s, const float *q, const uint16_t *k, int n,
                                                              int hd, float scale, bool bf) {
    float d[4];
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const uint16_t *k0 = k + (size_t)j * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < hd; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(qv, ld_half(k0 + i, bf), a0);
            a1 = _mm256_fmadd_ps(qv, ld_half(k1 + i, bf), a1);
            a2 = _mm256_fmadd_ps(qv, ld_half(k2 + i, bf), a2);
            a3 = _mm256_fmadd_ps(qv, ld_half(k3 + i, bf), a3);
        }
        hsum4(a0, a1, a2, a3, d);
        for (int x = 0; x < 4; x++) s[j + x] = d[x] * scale;
    }
    for (; j < n; j++) {
        const uint16_t *kj = k + (size_t)j * hd;
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), ld_half(kj + i, bf), a);
        hsum4(a, a, a, a, d);
        s[j] = d[0] * scale;
    }
}

/* half_scores for two query rows sharing each key, converted once */
static inline __attribute__((always_inline)) void half_scores2(float *sa, float *sb, const float *qa, const float *qb,
                                                               const uint16_t *k, int n, int hd, float scale, bool bf) {
    float d[4];
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const uint16_t *k0 = k + (size_t)j * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int i = 0; i < hd; i += 8) {
            __m256 x0 = _mm256_loadu_ps(qa + i), x1 = _mm256_loadu_ps(qb + i), kv;
            kv = ld_half(k0 + i, bf);
            a0 = _mm256_fmadd_ps(x0, kv, a0);
            b0 = _mm256_fmadd_ps(x1, kv, b0);
            kv = ld_half(k1 + i, bf);
            a1 = _mm256_fmadd_ps(x0, kv, a1);
            b1 = _mm256_fmadd_ps(x1, kv, b1);
            kv = ld_half(k2 + i, bf);
            a2 = _mm256_fmadd_ps(x0, kv, a2);
            b2 = _mm256_fmadd_ps(x1, kv, b2);
            kv = ld_half(k3 + i, bf);
            a3 = _mm256_fmadd_ps(x0, kv, a3);
            b3 = _mm256_fmadd_ps(x1, kv, b3);
        }
        hsum4(a0, a1, a2, a3, d);
        for (int x = 0; x < 4; x++) sa[j + x] = d[x] * scale;
        hsum4(b0, b1, b2, b3, d);
        for (int x = 0; x < 4; x++) sb[j + x] = d[x] * scale;
    }
    if (j < n) {
        half_scores(sa + j, qa, k + (size_t)j * hd, n - j, hd, scale, bf);
        half_scores(sb + j, qb, k + (size_t)j * hd, n - j, hd, scale, bf);
    }
}

/* pv_avx2 for f16 / bf16 values (hd % 8 == 0) */
static inline __attribute__((always_inline)) void half_pv(float *o, const float *p, const uint16_t *v, int n, int hd,
                                                          bool bf) {
    int i = 0;
    for (; i + 32 <= hd; i += 32) {
        __m256 o0 = _mm256_loadu_ps(o + i), o1 = _mm256_loadu_ps(o + i + 8);
        __m256 o2 = _mm256_loadu_ps(o + i + 16), o3 = _mm256_loadu_ps(o + i + 24);
        __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0; /* odd keys: hides FMA latency */
        int j = 0;
        for (; j + 2 <= n; j += 2) {
            const uint16_t *vj = v + (size_t)j * hd + i, *vk = vj + hd;
            __m256 pj = _mm256_broadcast_ss(p + j), pk = _mm256_broadcast_ss(p + j + 1);
            o0 = _mm256_fmadd_ps(pj, ld_half(vj, bf), o0);
            o1 = _mm256_fmadd_ps(pj, ld_half(vj + 8, bf), o1);
            o2 = _mm256_fmadd_ps(pj, ld_half(vj + 16, bf), o2);
            o3 = _mm256_fmadd_ps(pj, ld_half(vj + 24, bf), o3);
            b0 = _mm256_fmadd_ps(pk, ld_half(vk, bf), b0);
            b1 = _mm256_fmadd_ps(pk, ld_half(vk + 8, bf), b1);
            b2 = _mm256_fmadd_ps(pk, ld_half(vk + 16, bf), b2);
            b3 = _mm256_fmadd_ps(pk, ld_half(vk + 24, bf), b3);
        }
        if (j < n) {
            const uint16_t *vj = v + (size_t)j * hd + i;
            __m256 pj = _mm256_broadcast_ss(p + j);
            o0 = _mm256_fmadd_ps(pj, ld_half(vj, bf), o0);
            o1 = _mm256_fmadd_ps(pj, ld_half(vj + 8, bf), o1);
            o2 = _mm256_fmadd_ps(pj, ld_half(vj + 16, bf), o2);
            o3 = _mm256_fmadd_ps(pj, ld_half(vj + 24, bf), o3);
        }
        _mm256_storeu_ps(o + i, _mm256_add_ps(o0, b0));
        _mm256_storeu_ps(o + i + 8, _mm256_add_ps(o1, b1));
        _mm256_storeu_ps(o + i + 16, _mm256_add_ps(o2, b2));
        _mm256_storeu_ps(o + i + 24, _mm256_add_ps(o3, b3));
    }
    for (; i < hd; i += 8) {
        __m256 o0 = _mm256_loadu_ps(o + i);
        for (int j = 0; j < n; j++) o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), ld_half(v + (size_t)j * hd + i, bf), o0);
        _mm256_storeu_ps(o + i, o0);
    }
}

/* qval_pv for two query rows (a, b) sharing the values: each group's codes
 * are widened once for both */
static inline __attribute__((always_inline)) void qval_pv2(float *oa, float *ob, const float *pa, const float *pb,
                                                           const uint8_t *v, size_t rb, int n, int hd, bool q4) {
    const size_t gb = q4 ? 18 : 34;
    for (int gi = 0; gi < hd / 32; gi++) {
        float *ga = oa + 32 * gi, *gb_ = ob + 32 * gi;
        __m256 a0 = _mm256_loadu_ps(ga), a1 = _mm256_loadu_ps(ga + 8);
        __m256 a2 = _mm256_loadu_ps(ga + 16), a3 = _mm256_loadu_ps(ga + 24);
        __m256 b0 = _mm256_loadu_ps(gb_), b1 = _mm256_loadu_ps(gb_ + 8);
        __m256 b2 = _mm256_loadu_ps(gb_ + 16), b3 = _mm256_loadu_ps(gb_ + 24), f0, f1, f2, f3;
        const uint8_t *g = v + (size_t)gi * gb;
        for (int j = 0; j < n; j++) {
            const uint8_t *x = g + (size_t)j * rb;
            float d = f16_at(x);
            __m256 ca = _mm256_set1_ps(pa[j] * d), cb = _mm256_set1_ps(pb[j] * d);
            QGROUP_FLOATS(x, q4, f0, f1, f2, f3);
            a0 = _mm256_fmadd_ps(ca, f0, a0);
            a1 = _mm256_fmadd_ps(ca, f1, a1);
            a2 = _mm256_fmadd_ps(ca, f2, a2);
            a3 = _mm256_fmadd_ps(ca, f3, a3);
            b0 = _mm256_fmadd_ps(cb, f0, b0);
            b1 = _mm256_fmadd_ps(cb, f1, b1);
            b2 = _mm256_fmadd_ps(cb, f2, b2);
            b3 = _mm256_fmadd_ps(cb, f3, b3);
        }
        _mm256_storeu_ps(ga, a0);
        _mm256_storeu_ps(ga + 8, a1);
        _mm256_storeu_ps(ga + 16, a2);
        _mm256_storeu_ps(ga + 24, a3);
        _mm256_storeu_ps(gb_, b0);
        _mm256_storeu_ps(gb_ + 8, b1);
        _mm256_storeu_ps(gb_ + 16, b2);
        _mm256_storeu_ps(gb_ + 24, b3);
    }
}

/* half_pv for two query rows sharing the values (hd % 8 == 0) */
static inline __attribute__((always_inline)) void half_pv2(float *oa, float *ob, const float *pa, const float *pb,
                                                           const uint16_t *v, int n, int hd, bool bf) {
    int i = 0;
    for (; i + 16 <= hd; i += 16) {
        __m256 a0 = _mm256_loadu_ps(oa + i), a1 = _mm256_loadu_ps(oa + i + 8);
        __m256 b0 = _mm256_loadu_ps(ob + i), b1 = _mm256_loadu_ps(ob + i + 8);
        for (int j = 0; j < n; j++) {
            const uint16_t *vj = v + (size_t)j * hd + i;
            __m256 f0 = ld_half(vj, bf), f1 = ld_half(vj + 8, bf);
            __m256 ca = _mm256_broadcast_ss(pa + j), cb = _mm256_broadcast_ss(pb + j);
            a0 = _mm256_fmadd_ps(ca, f0, a0);
            a1 = _mm256_fmadd_ps(ca, f1, a1);
            b0 = _mm256_fmadd_ps(cb, f0, b0);
            b1 = _mm256_fmadd_ps(cb, f1, b1);
        }
        _mm256_storeu_ps(oa + i, a0);
        _mm256_storeu_ps(oa + i + 8, a1);
        _mm256_storeu_ps(ob + i, b0);
        _mm256_storeu_ps(ob + i + 8, b1);
    }
    for (; i < hd; i += 8) {
        __m256 a0 = _mm256_loadu_ps(oa + i), b0 = _mm256_loadu_ps(ob + i);
        for (int j = 0; j < n; j++) {
            __m256 f0 = ld_half(v + (size_t)j * hd + i, bf);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + j), f0, a0);
            b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + j), f0, b0);
        }
        _mm256_storeu_ps(oa + i, a0);
        _mm256_storeu_ps(ob + i, b0);
    }
}

/* Whether the fused kernels take these types at this head dim. */
static bool fused_ok(const op_attn_args *a) {
    const int hd = a->head_dim;
    const int t[2] = {a->k_type, a->v_type};
    for (int i = 0; i < 2; i++) {
        if ((t[i] == KVLM_CACHE_F16 || t[i] == KVLM_CACHE_BF16 || t[i] == KVLM_CACHE_Q4_KC) && hd % 8) return false;
        if (int_keys(t[i]) && hd % 32) return false;
    }
    return true;
}

/* Scores of the n keys from position p on (within one cache block) of KV
 * head h for one query row: qr in f32, or qc / qd as int8 for q8_0 / q4_0
 * keys; qs: q4_kc's scratch. */
static void fused_scores(const op_attn_args *a, int h, int p, int n, float *s, const float *qr, const int8_t *qc,
                         const float *qd, float *qs) {
    const int hd = a->head_dim, bs = a->block_size, b = p / bs, slot = p % bs;
    const uint8_t *region = (const uint8_t *)a->blocks[b] + (size_t)h * a->head_bytes;
    const size_t rb = op_kv_row_bytes(a->k_type, hd);
    const uint8_t *row = region + (size_t)slot * rb;
    switch (a->k_type) {
    case KVLM_CACHE_F32: scores_avx2(s, qr, (const float *)row, n, hd, a->scale); break;
    case KVLM_CACHE_F16: half_scores(s, qr, (const uint16_t *)row, n, hd, a->scale, false); break;
    case KVLM_CACHE_BF16: half_scores(s, qr, (const uint16_t *)row, n, hd, a->scale, true); break;
    case KVLM_CACHE_Q8_0: qkey_scores(s, qc, qd, row, rb, n, hd, a->scale, false); break;
    case KVLM_CACHE_Q4_0: qkey_scores(s, qc, qd, row, rb, n, hd, a->scale, true); break;
    case KVLM_CACHE_Q4_KC:
        if (b == a->stage_block)
            half_scores(s, qr, a->k_stage + ((size_t)h * bs + slot) * hd, n, hd, a->scale, false);
        else kc_scores_avx2(s, qr, region, hd, bs, slot, n, a->scale, qs);
        break;
    default: break;
    }
}

/* fused_scores for two rows (sa, qa) and (sb, qb) sharing each key */
static void fused_scores2(const op_attn_args *a, int h, int p, int n, float *sa, float *sb, const float *qa,
                          const float *qb, const int8_t *ca, const int8_t *cb, const float *da, const float *db,
                          float *qs) {
    const int hd = a->head_dim, bs = a->block_size;
    const size_t rb = op_kv_row_bytes(a->k_type, hd);
    const uint8_t *row = (const uint8_t *)a->blocks[p / bs] + (size_t)h * a->head_bytes + (size_t)(p % bs) * rb;
    switch (a->k_type) {
    case KVLM_CACHE_F16: half_scores2(sa, sb, qa, qb, (const uint16_t *)row, n, hd, a->scale, false); break;
    case KVLM_CACHE_BF16: half_scores2(sa, sb, qa, qb, (const uint16_t *)row, n, hd, a->scale, true); break;
    case KVLM_CACHE_Q8_0: qkey_scores2(sa, sb, ca, da, cb, db, row, rb, n, hd, a->scale, false); break;
    case KVLM_CACHE_Q4_0: qkey_scores2(sa, sb, ca, da, cb, db, row, rb, n, hd, a->scale, true); break;
    default:
        fused_scores(a, h, p, n, sa, qa, ca, da, qs);
        fused_scores(a, h, p, n, sb, qb, cb, db, qs);
        break;
    }
}

/* o += sum_j p[j] v_j over the n values from position p on (one cache block). */
static void fused_pv(const op_attn_args *a, int h, int p, int n, float *o, const float *pj) {
    const int hd = a->head_dim, bs = a->block_size;
    const size_t rb = op_kv_row_bytes(a->v_type, hd);
    const uint8_t *row = (const uint8_t *)a->blocks[p / bs] + (size_t)h * a->head_bytes + a->v_bytes +
                         (size_t)(p % bs) * rb;
    switch (a->v_type) {
    case KVLM_CACHE_F32: pv_avx2(o, pj, (const float *)row, n, hd); break;
    case KVLM_CACHE_F16: half_pv(o, pj, (const uint16_t *)row, n, hd, false); break;
    case KVLM_CACHE_BF16: half_pv(o, pj, (const uint16_t *)row, n, hd, true); break;
    case KVLM_CACHE_Q8_0: qval_pv(o, pj, row, rb, n, hd, false); break;
    case KVLM_CACHE_Q4_0: qval_pv(o, pj, row, rb, n, hd, true); break;
    default: break;
    }
}
/* fused_pv for two rows (o, p) and (o2, p2) at once */
static void fused_pv2(const op_attn_args *a, int h, int p, int n, float *o, const float *pj, float *o2, const float *pj2) {
    const int hd = a->head_dim, bs = a->block_size;
    const size_t rb = op_kv_row_bytes(a->v_type, hd);
    const uint8_t *row = (const uint8_t *)a->blocks[p / bs] + (size_t)h * a->head_bytes + a->v_bytes +
                         (size_t)(p % bs) * rb;
    switch (a->v_type) {
    case KVLM_CACHE_F16: half_pv2(o, o2, pj, pj2, (const uint16_t *)row, n, hd, false); break;
    case KVLM_CACHE_BF16: half_pv2(o, o2, pj, pj2, (const uint16_t *)row, n, hd, true); break;
    case KVLM_CACHE_Q8_0: qval_pv2(o, o2, pj, pj2, row, rb, n, hd, false); break;
    case KVLM_CACHE_Q4_0: qval_pv2(o, o2, pj, pj2, row, rb, n, hd, true); break;
    default:
        fused_pv(a, h, p, n, o, pj);
        fused_pv(a, h, p, n, o2, pj2);
        break;
    }
}

/* One key block (positions kb..kb+n-1) for the R rows of an item, read
 * straight from the cache: each row's scores and online-softmax update, then
 * P.V for the rows two at a time (the query heads of a GQA group share each
 * value row, converted once per pair). vis[r]: the block's keys row r sees
 * (the last row sees all n); qr[r]: its query; qc, qd: the int8 query rows
 * of q8_0 / q4_0 keys. Keys a row does not see get weight 0. */
static void fused_block(const op_attn_args *a, int h, int kb, int n, int R, const int *vis, const float *const *qr,
                        const int8_t *qc, const float *qd, float *S, float *O, float *M, float *L, float *QS,
                        float *const *W, bool vnni) {
    const int hd = a->head_dim, nq = int_keys(a->k_type) ? hd / 32 : 0, npad = (n + 7) & ~7;
    const size_t krb = op_kv_row_bytes(a->k_type, hd), vrb = op_kv_row_bytes(a->v_type, hd);
    const bool vk = vnni && a->k_type == KVLM_CACHE_Q8_0, vv = vnni && a->v_type == KVLM_CACHE_Q8_0;
    /* scores, rows two at a time over the keys either sees (the extra keys
     * of the row that sees fewer are masked below) */
    for (int r = 0; r < R; r += 2) {
        int v = vis[R - 1 < r + 1 ? R - 1 : r + 1];
        v = v < n ? v : n;
        for (int x = 0, len; x < v; x += len) {
            len = run_from(a, kb + x, v - x);
            float *s = S + (size_t)r * ATT_BK + x;
            if (vk) {
                int p = kb + x;
                const uint8_t *row = (const uint8_t *)a->blocks[p / a->block_size] + (size_t)h * a->head_bytes +
                                     (size_t)(p % a->block_size) * krb;
                for (int y = r; y < R && y < r + 2; y++)
                    op_att_qkey_scores_avx512(s + (size_t)(y - r) * ATT_BK, qc + (size_t)y * hd, qd + (size_t)y * nq, row, krb,
                                     len, hd, a->scale);
                continue;
            }
            if (r + 1 < R)
                fused_scores2(a, h, kb + x, len, s, s + ATT_BK, qr[r], qr[r + 1], qc + (size_t)r * hd,
                              qc + (size_t)(r + 1) * hd, qd + (size_t)r * nq, qd + (size_t)(r + 1) * nq, QS);
            else fused_scores(a, h, kb + x, len, s, qr[r], qc + (size_t)r * hd, qd + (size_t)r * nq, QS);
        }
    }
    if (W) /* H2O: each row's raw scores, for after the merge */
        for (int r = 0; r < R; r++) {
            int v = vis[r] < n ? vis[r] : n;
            if (v > 0) memcpy(W[r] + kb, S + (size_t)r * ATT_BK, sizeof(float) * (size_t)v);
        }
    for (int r = 0; r < R; r++) {
        float *s = S + (size_t)r * ATT_BK, *o = O + (size_t)r * hd;
        int v = vis[r] < n ? vis[r] : n;
        if (v <= 0) {
            memset(s, 0, sizeof(float) * (size_t)n);
            continue;
        }
        __m256 vm = _mm256_set1_ps(-INFINITY);
        int x = 0;
        for (; x + 8 <= v; x += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + x));
        float mx = op_hmax256(vm);
        for (; x < v; x++) mx = s[x] > mx ? s[x] : mx;
        for (x = v; x < npad; x++) s[x] = -INFINITY;
        float m_new = M[r] > mx ? M[r] : mx;
        float sum = exp_sum_avx2(s, npad, m_new);
        if (M[r] != m_new && L[r] > 0) { /* rescale what was summed under the old max */
            __m256 alpha = _mm256_set1_ps(expf(M[r] - m_new));
            L[r] *= _mm256_cvtss_f32(alpha);
            for (int i = 0; i < hd; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), alpha));
        }
        L[r] += sum;
        M[r] = m_new;
    }
    for (int x = 0, len; x < n; x += len) {
        len = run_from(a, kb + x, n - x);
        int r = 0;
        if (vv) {
            int p = kb + x;
            const uint8_t *row = (const uint8_t *)a->blocks[p / a->block_size] + (size_t)h * a->head_bytes +
                                 a->v_bytes + (size_t)(p % a->block_size) * vrb;
            for (; r < R; r++) op_att_qval_pv_avx512(O + (size_t)r * hd, S + (size_t)r * ATT_BK + x, row, vrb, len, hd);
        }
        for (; r + 2 <= R; r += 2)
            fused_pv2(a, h, kb + x, len, O + (size_t)r * hd, S + (size_t)r * ATT_BK + x, O + (size_t)(r + 1) * hd,
                      S + (size_t)(r + 1) * ATT_BK + x);
        if (r < R) fused_pv(a, h, kb + x, len, O + (size_t)r * hd, S + (size_t)r * ATT_BK + x);
    }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

const op_att_kernels op_att_kernels_avx2 = {
    .scores = scores_avx2,
    .pv = pv_avx2,
    .exp_sum = exp_sum_avx2,
    .kc_scores = kc_scores_avx2,
    .deq_rows = deq_rows_avx2,
    .f16_to_f32 = f16_to_f32_avx2,
    .scale = scale_avx2,
    .add_probs = add_probs_avx2,
    .quantize_query = quantize_query_avx2,
    .fused_ok = fused_ok,
    .fused_block = fused_block,
    .prefetch_rows = prefetch_rows,
};
#else
const op_att_kernels op_att_kernels_avx2; /* never chosen: the CPU level is scalar */
#endif
