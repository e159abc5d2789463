/* ops/matmul_scalar: portable matmul tile kernels for every weight type; the
 * fallback on CPUs without AVX2 and the baseline the SIMD kernels are tested
 * against (same quantized activations, integer dot products per block). */
#include <math.h>
#include "dtype/dtype.h"
#include "dtype/iq.h"
#include "dtype/tq.h"
#include "ops/matmul_kq.h"
#include "ops/type_traits.h"

typedef float (*dot_fn)(int n, const uint8_t *w, const uint8_t *x);

static float dot_f32(int n, const uint8_t *w, const uint8_t *x) {
    const float *a = (const float *)w, *b = (const float *)x;
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static float dot_f16(int n, const uint8_t *w, const uint8_t *x) {
    const dt_f16 *a = (const dt_f16 *)w;
    const float *b = (const float *)x;
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += dt_f16_to_f32(a[i]) * b[i];
    return s;
}

static float dot_bf16(int n, const uint8_t *w, const uint8_t *x) {
    const dt_bf16 *a = (const dt_bf16 *)w;
    const float *b = (const float *)x;
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += dt_bf16_to_f32(a[i]) * b[i];
    return s;
}

static float dot_q8_0(int n, const uint8_t *w, const uint8_t *x) {
    const block_q8_0 *wb = (const block_q8_0 *)w;
    const int8_t *xq = op_q8a_qs(x);
    const float *xd = op_q8a_d(x, n);
    float s = 0.0f;
    for (int b = 0; b < n / 32; b++) {
        int isum = 0;
        for (int i = 0; i < 32; i++) isum += wb[b].qs[i] * xq[b * 32 + i];
        s = fmaf((float)isum, dt_f16_to_f32(wb[b].d) * xd[b], s); /* as the packed VNNI kernel */
    }
    return s;
}

static float dot_q4_0(int n, const uint8_t *w, const uint8_t *x) {
    const block_q4_0 *wb = (const block_q4_0 *)w;
    const int8_t *xq = op_q8a_qs(x);
    const float *xd = op_q8a_d(x, n);
    float s = 0.0f;
    for (int b = 0; b < n / 32; b++) {
        const int8_t *xb = xq + b * 32;
        int isum = 0;
        for (int i = 0; i < 16; i++) {
            isum += ((wb[b].qs[i] & 0x0f) - 8) * xb[i];
            isum += ((wb[b].qs[i] >> 4) - 8) * xb[i + 16];
        }
        s = fmaf((float)isum, dt_f16_to_f32(wb[b].d) * xd[b], s); /* as the packed VNNI kernel */
    }
    return s;
}

/* A Q4_K super-block's share, in the packed VNNI kernel's operations:
 * s + xd (d sumi - dmin summ), the inner difference as one FMA. */
static inline float q4k_step(float s, float xd, dt_f16 d, dt_f16 dmin, int sumi, int summ) {
    float m = dt_f16_to_f32(dmin) * (float)summ;
    return fmaf(xd, fmaf(dt_f16_to_f32(d), (float)sumi, -m), s);
}

/* Q4_K, or with q5 Q5_K (a 5th bit per element from qh). */
static inline float dot_qk(int q5, int n, const uint8_t *w, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    const size_t bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const block_q4_K *wb = (const block_q4_K *)(w + (size_t)b * bs); /* Q5_K: d, dmin, scales alike */
        const uint8_t *qh = q5 ? ((const block_q5_K *)wb)->qh : NULL;
        uint8_t sc[8], mn[8];
        op_q4k_scales(wb->scales, sc, mn);
        const uint8_t *q = q5 ? ((const block_q5_K *)wb)->qs : wb->qs;
        const int8_t *a = xb[b].qs;
        int sumi = 0, summ = 0;
        for (int j = 0; j < QK_K / 64; j++) {
            int lo = 0, hi = 0;
            for (int l = 0; l < 32; l++) {
                int h0 = qh ? (qh[l] >> (2 * j) & 1) << 4 : 0, h1 = qh ? (qh[l] >> (2 * j + 1) & 1) << 4 : 0;
                lo += ((q[l] & 0x0f) | h0) * a[l];
                hi += ((q[l] >> 4) | h1) * a[l + 32];
            }
            sumi += sc[2 * j] * lo + sc[2 * j + 1] * hi;
            q += 32;
            a += 64;
        }
        for (int j = 0; j < 8; j++) summ += mn[j] * (xb[b].bsums[2 * j] + xb[b].bsums[2 * j + 1]);
        s = q4k_step(s, xb[b].d, wb->d, wb->dmin, sumi, summ);
    }
    return s;
}
static float dot_q4_K(int n, const uint8_t *w, const uint8_t *x) { return dot_qk(0, n, w, x); }

/* Q4_1, Q5_0, Q5_1 (the legacy 32-element types llama.cpp falls back to when
 * a row is not whole 256-column super-blocks): the block's integer dot of
 * its codes with the token's quants, then its scale, and for Q4_1 / Q5_1 the
 * min against the token's sum of quants (-xc / 128). */
static inline float dot_legacy(int type, int n, const uint8_t *w, const uint8_t *x) {
    const int8_t *xq = op_q8a_qs(x);
    const float *xd = op_q8a_d(x, n);
    const int32_t *xc = op_q8a_xc(x, n);
    const size_t bs = type == DT_Q4_1 ? sizeof(block_q4_1) : type == DT_Q5_0 ? sizeof(block_q5_0) : sizeof(block_q5_1);
    float s = 0.0f;
    for (int b = 0; b < n / 32; b++) {
        const uint8_t *blk = w + (size_t)b * bs;
        const uint8_t *qs = blk + (type == DT_Q4_1 ? 4 : type == DT_Q5_0 ? 6 : 8);
        uint32_t qh = 0;
        if (type != DT_Q4_1) memcpy(&qh, blk + (type == DT_Q5_0 ? 2 : 4), 4);
        const int off = type == DT_Q5_0 ? 16 : 0;
        int isum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (j < 16 ? qs[j] & 0xf : qs[j - 16] >> 4) | (int)((qh >> j) & 1) << 4;
            isum += (q - off) * xq[b * 32 + j];
        }
        dt_f16 d, m;
        memcpy(&d, blk, sizeof d);
        s = fmaf((float)isum, dt_f16_to_f32(d) * xd[b], s);
        if (type != DT_Q5_0) {
            memcpy(&m, blk + 2, sizeof m);
            s = fmaf(dt_f16_to_f32(m) * xd[b], (float)(-xc[b] / 128), s);
        }
    }
    return s;
}
static float dot_q4_1(int n, const uint8_t *w, const uint8_t *x) { return dot_legacy(DT_Q4_1, n, w, x); }
static float dot_q5_0(int n, const uint8_t *w, const uint8_t *x) { return dot_legacy(DT_Q5_0, n, w, x); }
static float dot_q5_1(int n, const uint8_t *w, const uint8_t *x) { return dot_legacy(DT_Q5_1, n, w, x); }
static float dot_q5_K(int n, const uint8_t *w, const uint8_t *x) { return dot_qk(1, n, w, x); }

/* A Q6_K super-block's share, in the packed VNNI kernel's operations. */
static inline float q6k_step(float s, float xd, dt_f16 d, int sumi) {
    return fmaf(dt_f16_to_f32(d) * xd, (float)sumi, s);
}

static float dot_q6_K(int n, const uint8_t *w, const uint8_t *x) {
    const block_q6_K *wb = (const block_q6_K *)w;
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        int8_t q[QK_K];
        op_q6k_unpack(&wb[b], q);
        int sumi = 0;
        for (int g = 0; g < QK_K / 16; g++) {
            int isum = 0;
            for (int i = 0; i < 16; i++) isum += q[g * 16 + i] * xb[b].qs[g * 16 + i];
            sumi += wb[b].scales[g] * isum;
        }
        s = q6k_step(s, xb[b].d, wb[b].d, sumi);
    }
    return s;
}

/* ---- Q2_K, Q3_K, IQ4_NL, IQ4_XS -------------------------------------------------
 * The 2-bit field of element e in Q2_K's and Q3_K's qs (dtype/dtype.h). */
static inline int q2_field(const uint8_t *qs, int e) {
    return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

/* Q2_K: per 16-element sub-block the code dot times its 4-bit scale, the
 * mins against the activation's sums of 16; then q4k_step. */
static float dot_q2_K(int n, const uint8_t *w, const uint8_t *x) {
    const block_q2_K *wb = (const block_q2_K *)w;
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        int sumi = 0, summ = 0;
        for (int g = 0; g < 16; g++) {
            int isum = 0;
            for (int l = 0; l < 16; l++) isum += q2_field(wb[b].qs, 16 * g + l) * xb[b].qs[16 * g + l];
            sumi += (wb[b].scales[g] & 15) * isum;
            summ += (wb[b].scales[g] >> 4) * xb[b].bsums[g];
        }
        s = q4k_step(s, xb[b].d, wb[b].d, wb[b].dmin, sumi, summ);
    }
    return s;
}

/* Q3_K: signed codes (2 bits, less 4 unless the hmask bit is set) times the
 * signed 6-bit scales per 16 elements; then q6k_step. */
static float dot_q3_K(int n, const uint8_t *w, const uint8_t *x) {
    const block_q3_K *wb = (const block_q3_K *)w;
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        int8_t sc[16];
        op_q3k_scales(wb[b].scales, sc);
        int sumi = 0;
        for (int g = 0; g < 16; g++) {
            int isum = 0;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * g + l, hbit = (wb[b].hmask[e % 32] >> (4 * (e / 128) + (e % 128) / 32)) & 1;
                isum += (q2_field(wb[b].qs, e) - (hbit ? 0 : 4)) * xb[b].qs[e];
            }
            sumi += sc[g] * isum;
        }
        s = q6k_step(s, xb[b].d, wb[b].d, sumi);
    }
    return s;
}

/* IQ4_NL and MXFP4 (MX): Q8_0's loop with the nibbles looked up in the
 * levels; MXFP4's doubled E2M1 levels under a power-of-two scale. */
static inline float dot_nl4(const int MX, int n, const uint8_t *w, const uint8_t *x) {
    const int8_t *kv = MX ? dt_kvalues_mxfp4 : dt_kvalues_iq4nl;
    const size_t bs = MX ? sizeof(block_mxfp4) : sizeof(block_iq4_nl);
    const int8_t *xq = op_q8a_qs(x);
    const float *xd = op_q8a_d(x, n);
    float s = 0.0f;
    for (int b = 0; b < n / 32; b++) {
        const uint8_t *blk = w + (size_t)b * bs, *qs = MX ? ((const block_mxfp4 *)blk)->qs : ((const block_iq4_nl *)blk)->qs;
        const int8_t *xb = xq + b * 32;
        int isum = 0;
        for (int i = 0; i < 16; i++) isum += kv[qs[i] & 15] * xb[i] + kv[qs[i] >> 4] * xb[i + 16];
        const float dw = MX ? dt_e8m0_half(blk[0]) : dt_f16_to_f32(((const block_iq4_nl *)blk)->d);
        s = fmaf((float)isum, dw * xd[b], s);
    }
    return s;
}
static float dot_iq4_nl(int n, const uint8_t *w, const uint8_t *x) { return dot_nl4(0, n, w, x); }
static float dot_mxfp4(int n, const uint8_t *w, const uint8_t *x) { return dot_nl4(1, n, w, x); }

/* The ternary types (dtype/tq.h): the codes 0..2 against the activations,
 * less the activations' sum (the bsums), times d · dx. */
static inline float dot_tq(int type, int n, const uint8_t *w, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    const size_t bs = dt_layout(type)->type_size;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *wb = w + (size_t)b * bs;
        uint8_t u[QK_K];
        dt_tq_unpack(type, wb, u);
        int sumi = 0;
        for (int e = 0; e < QK_K; e++) sumi += u[e] * xb[b].qs[e];
        for (int g = 0; g < QK_K / 16; g++) sumi -= xb[b].bsums[g];
        s = fmaf((float)sumi, dt_tq_d(type, wb) * xb[b].d, s);
    }
    return s;
}
static float dot_tq1_0(int n, const uint8_t *w, const uint8_t *x) { return dot_tq(DT_TQ1_0, n, w, x); }
static float dot_tq2_0(int n, const uint8_t *w, const uint8_t *x) { return dot_tq(DT_TQ2_0, n, w, x); }

/* IQ4_XS: per 32-element sub-block the level dot times its signed 6-bit
 * scale; then q6k_step. */
static float dot_iq4_xs(int n, const uint8_t *w, const uint8_t *x) {
    const block_iq4_xs *wb = (const block_iq4_xs *)w;
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        int sumi = 0;
        for (int g = 0; g < 8; g++) {
            const uint8_t *q = wb[b].qs + 16 * g;
            const int8_t *a = xb[b].qs + 32 * g;
            int isum = 0;
            for (int i = 0; i < 16; i++)
                isum += dt_kvalues_iq4nl[q[i] & 15] * a[i] + dt_kvalues_iq4nl[q[i] >> 4] * a[i + 16];
            sumi += op_iq4xs_scale(&wb[b], g) * isum;
        }
        s = q6k_step(s, xb[b].d, wb[b].d, sumi);
    }
    return s;
}

/* The codebook types (dtype/iq.h): per 32-weight sub-block the integers w
 * against the activations, per 16 times the odd scale; the block's sum times
 * d · dx / div. */
static inline float dot_iq(int type, int n, const uint8_t *w, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    const size_t bs = dt_layout(type)->type_size;
    const float inv = 1.0f / (float)dt_iq_div(type);
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *wb = w + (size_t)b * bs;
        int sumi = 0;
        for (int ib = 0; ib < QK_K / 32; ib++) {
            int8_t q[32];
            int ls[2];
            dt_iq_unpack(type, wb, ib, q, ls);
            const int8_t *a = xb[b].qs + 32 * ib;
            for (int h = 0; h < 2; h++) {
                int isum = 0;
                for (int j = 16 * h; j < 16 * h + 16; j++) isum += q[j] * a[j];
                sumi += ls[h] * isum;
            }
        }
        s = fmaf((float)sumi, dt_iq_d(type, wb) * xb[b].d * inv, s);
    }
    return s;
}
static float dot_iq2_xxs(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ2_XXS, n, w, x); }
static float dot_iq2_xs(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ2_XS, n, w, x); }
static float dot_iq2_s(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ2_S, n, w, x); }
static float dot_iq3_xxs(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ3_XXS, n, w, x); }
static float dot_iq3_s(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ3_S, n, w, x); }
static float dot_iq1_s(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ1_S, n, w, x); }
static float dot_iq1_m(int n, const uint8_t *w, const uint8_t *x) { return dot_iq(DT_IQ1_M, n, w, x); }

static inline void tile(dot_fn f, int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs,
                        float *y, size_t ys, int nr, int nc) {
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++) y[(size_t)c * ys + r] = f(n, w + (size_t)r * ws, x + (size_t)c * xs);
}

#define TILE(name)                                                                              \
    void op_mm_##name##_scalar(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, \
                               float *y, size_t ys, int nr, int nc) {                           \
        tile(dot_##name, n, w, ws, x, xs, y, ys, nr, nc);                                       \
    }
TILE(f32)
TILE(f16)
TILE(bf16)
TILE(q8_0)
TILE(q4_0)
TILE(q4_1)
TILE(q5_0)
TILE(q5_1)
TILE(q4_K)
TILE(q5_K)
TILE(q6_K)
TILE(q2_K)
TILE(q3_K)
TILE(iq4_nl)
TILE(iq4_xs)
TILE(iq2_xxs)
TILE(iq2_xs)
TILE(iq2_s)
TILE(iq3_xxs)
TILE(iq3_s)
TILE(iq1_s)
TILE(iq1_m)
TILE(mxfp4)
TILE(tq1_0)
TILE(tq2_0)

/* Row j of a 16-row group of packed weights (ops.h; q4: OP_Q4_0_R16, else
 * OP_Q8_0_R16): the same operations as dot_q8_0 / dot_q4_0 on the unpacked row. */
/* q4: 0 Q8_0, 1 Q4_0, 2 Q5_0, 3 Q4_1, 4 Q5_1, 5 IQ4_NL, 6 MXFP4 (ops.h);
 * dot_legacy's operations for Q4_1 / Q5_0 / Q5_1, dot_nl4's for IQ4_NL and
 * MXFP4. */
static float dot_r16(int q4, int n, const uint8_t *g, int j, const uint8_t *x) {
    const int8_t *xq = op_q8a_qs(x);
    const float *xd = op_q8a_d(x, n);
    const int32_t *xc = op_q8a_xc(x, n);
    const int q5 = q4 == 2 || q4 == 4, hm = q4 == 3 || q4 == 4, off = hm ? 0 : q5 ? 16 : 8;
    const int qs_at = q4 == 6 ? 16 : hm ? 64 : 32;
    const size_t bs = 16 * (q4 == 0 ? sizeof(block_q8_0) : q4 == 1 ? sizeof(block_q4_0) : q4 == 2 ? sizeof(block_q5_0)
                            : q4 == 3 ? sizeof(block_q4_1) : q4 == 4 ? sizeof(block_q5_1)
                            : q4 == 5 ? sizeof(block_iq4_nl) : sizeof(block_mxfp4));
    float s = 0.0f;
    for (int b = 0; b < n / 32; b++) {
        const uint8_t *blk = g + (size_t)b * bs;
        const int8_t *xb = xq + b * 32;
        int isum = 0;
        for (int k = 0; k < (q4 ? 4 : 8); k++)
            for (int i = 0; i < 4; i++) {
                int q = blk[qs_at + 64 * k + 4 * j + i];
                if (q4 >= 5) {
                    const int8_t *kv = q4 == 5 ? dt_kvalues_iq4nl : dt_kvalues_mxfp4;
                    isum += kv[q & 15] * xb[4 * k + i] + kv[q >> 4] * xb[16 + 4 * k + i];
                } else if (q4) {
                    int h = q5 ? blk[qs_at + 256 + 4 * j + i] : 0; /* the 5th bits (ops.h) */
                    isum += (((q & 0x0f) | (h >> k & 1) << 4) - off) * xb[4 * k + i] +
                            (((q >> 4) | (h >> (4 + k) & 1) << 4) - off) * xb[16 + 4 * k + i];
                } else isum += (q - 128) * xb[4 * k + i];
            }
        dt_f16 d, m;
        memcpy(&d, blk + 2 * j, sizeof d);
        s = fmaf((float)isum, (q4 == 6 ? dt_e8m0_half(blk[j]) : dt_f16_to_f32(d)) * xd[b], s);
        if (hm) {
            memcpy(&m, blk + 32 + 2 * j, sizeof m);
            s = fmaf(dt_f16_to_f32(m) * xd[b], (float)(-xc[b] / 128), s);
        }
    }
    return s;
}

/* A packed type's scalar kernel: row r is row r % 16 (j) of group r / 16 (g). */
#define R16_SCALAR(name, dot_call)                                                                         \
    void name(int n, const uint8_t *w, size_t ws, const uint8_t *x, size_t xs, float *y, size_t ys,        \
              int nr, int nc) {                                                                            \
        for (int c = 0; c < nc; c++)                                                                       \
            for (int r = 0; r < nr; r++) {                                                                 \
                const uint8_t *g = w + (size_t)(r / 16) * 16 * ws, *xr = x + (size_t)c * xs;               \
                const int j = r % 16;                                                                      \
                y[(size_t)c * ys + r] = dot_call;                                                          \
            }                                                                                              \
    }
R16_SCALAR(op_mm_q8_0_r16_scalar, dot_r16(0, n, g, j, xr))
R16_SCALAR(op_mm_q4_0_r16_scalar, dot_r16(1, n, g, j, xr))
R16_SCALAR(op_mm_q5_0_r16_scalar, dot_r16(2, n, g, j, xr))
R16_SCALAR(op_mm_q4_1_r16_scalar, dot_r16(3, n, g, j, xr))
R16_SCALAR(op_mm_q5_1_r16_scalar, dot_r16(4, n, g, j, xr))
R16_SCALAR(op_mm_iq4_nl_r16_scalar, dot_r16(5, n, g, j, xr))
R16_SCALAR(op_mm_mxfp4_r16_scalar, dot_r16(6, n, g, j, xr))

/* Row j of a group of OP_Q4_K_R16 (with q5 OP_Q5_K_R16; ops.h): dot_qk's operations. */
static float dot_qk_r16(int q5, int n, const uint8_t *g, int j, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = g + (size_t)b * (q5 ? OP_Q5K_R16_BYTES : OP_Q4K_R16_BYTES);
        int sumi = 0, summ = 0;
        for (int p = 0; p < 4; p++) {
            int lo = 0, hi = 0;
            for (int k = 0; k < 8; k++)
                for (int i = 0; i < 4; i++) {
                    int q = blk[320 + 512 * p + 64 * k + 4 * j + i];
                    int h = q5 ? blk[OP_Q4K_R16_BYTES + 64 * k + 4 * j + i] : 0; /* bit s: sub-block s */
                    lo += ((q & 0x0f) | ((h >> (2 * p) & 1) << 4)) * xb[b].qs[64 * p + 4 * k + i];
                    hi += ((q >> 4) | ((h >> (2 * p + 1) & 1) << 4)) * xb[b].qs[64 * p + 32 + 4 * k + i];
                }
            sumi += blk[64 + 16 * (2 * p) + j] * lo + blk[64 + 16 * (2 * p + 1) + j] * hi;
        }
        for (int t = 0; t < 8; t++) summ += blk[192 + 16 * t + j] * (xb[b].bsums[2 * t] + xb[b].bsums[2 * t + 1]);
        dt_f16 d, dmin;
        memcpy(&d, blk + 2 * j, sizeof d);
        memcpy(&dmin, blk + 32 + 2 * j, sizeof dmin);
        s = q4k_step(s, xb[b].d, d, dmin, sumi, summ);
    }
    return s;
}

/* Row j of a group of OP_Q6_K_R16 (ops.h): dot_q6_K's operations. */
static float dot_q6k_r16(int n, const uint8_t *g, int j, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = g + (size_t)b * OP_Q6K_R16_BYTES;
        int sumi = 0;
        for (int grp = 0; grp < 16; grp++) {
            const int u = grp / 2;
            int isum = 0;
            for (int k = 4 * (grp % 2); k < 4 * (grp % 2) + 4; k++)
                for (int i = 0; i < 4; i++) {
                    int lo = (blk[288 + 512 * (u / 2) + 64 * k + 4 * j + i] >> (4 * (u % 2))) & 15;
                    int hi = (blk[2336 + 512 * (u / 4) + 64 * k + 4 * j + i] >> (2 * (u % 4))) & 3;
                    isum += ((lo | hi << 4) - 32) * xb[b].qs[32 * u + 4 * k + i];
                }
            sumi += (int8_t)blk[32 + 16 * grp + j] * isum;
        }
        dt_f16 d;
        memcpy(&d, blk + 2 * j, sizeof d);
        s = q6k_step(s, xb[b].d, d, sumi);
    }
    return s;
}

R16_SCALAR(op_mm_q6_K_r16_scalar, dot_q6k_r16(n, g, j, xr))

/* Row j of a group of OP_IQ4_XS_R16 (ops.h): dot_iq4_xs's operations. */
static float dot_iq4xs_r16(int n, const uint8_t *g, int j, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = g + (size_t)b * OP_IQ4XS_R16_BYTES;
        int sumi = 0;
        for (int sb = 0; sb < 8; sb++) {
            const int8_t *a = xb[b].qs + 32 * sb;
            int isum = 0;
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 4; i++) {
                    int q = blk[160 + 256 * sb + 64 * k + 4 * j + i];
                    isum += dt_kvalues_iq4nl[q & 15] * a[4 * k + i] + dt_kvalues_iq4nl[q >> 4] * a[16 + 4 * k + i];
                }
            sumi += (int8_t)blk[32 + 16 * sb + j] * isum;
        }
        dt_f16 d;
        memcpy(&d, blk + 2 * j, sizeof d);
        s = q6k_step(s, xb[b].d, d, sumi);
    }
    return s;
}
R16_SCALAR(op_mm_iq4_xs_r16_scalar, dot_iq4xs_r16(n, g, j, xr))

/* Row j of a group of OP_Q2_K_R16 / OP_Q3_K_R16 (ops.h): dot_q2_K's /
 * dot_q3_K's operations. */
static float dot_q23k_r16(int q3, int n, const uint8_t *g, int j, const uint8_t *x) {
    const block_q8_K *xb = (const block_q8_K *)x;
    const int sc_at = q3 ? 32 : 64, qs_at = q3 ? 288 : 320;
    float s = 0.0f;
    for (int b = 0; b < n / QK_K; b++) {
        const uint8_t *blk = g + (size_t)b * (q3 ? OP_Q3K_R16_BYTES : OP_Q2K_R16_BYTES);
        const int8_t *a = xb[b].qs;
        int sumi = 0, summ = 0;
        for (int sub = 0; sub < 16; sub++) {
            const int h = sub / 8, u = (sub % 8) / 2, half = sub % 2;
            int isum = 0;
            for (int k = 4 * half; k < 4 * half + 4; k++)
                for (int i = 0; i < 4; i++) {
                    int q = (blk[qs_at + 512 * h + 64 * k + 4 * j + i] >> (2 * u)) & 3;
                    if (q3) q |= ((blk[1312 + 64 * (4 * h + u) + 8 * k + j / 2] >> (4 * (j % 2) + i)) & 1) << 2;
                    isum += q * a[128 * h + 32 * u + 4 * k + i];
                }
            const int sc = blk[sc_at + 16 * sub + j];
            if (q3) sumi += (int8_t)sc * (isum - 4 * xb[b].bsums[sub]);
            else {
                sumi += (sc & 15) * isum;
                summ += (sc >> 4) * xb[b].bsums[sub];
            }
        }
        dt_f16 d, dmin;
        memcpy(&d, blk + 2 * j, sizeof d);
        if (q3) s = q6k_step(s, xb[b].d, d, sumi);
        else {
            memcpy(&dmin, blk + 32 + 2 * j, sizeof dmin);
            s = q4k_step(s, xb[b].d, d, dmin, sumi, summ);
        }
    }
    return s;
}
R16_SCALAR(op_mm_q2_K_r16_scalar, dot_q23k_r16(0, n, g, j, xr))
R16_SCALAR(op_mm_q3_K_r16_scalar, dot_q23k_r16(1, n, g, j, xr))

R16_SCALAR(op_mm_q4_K_r16_scalar, dot_qk_r16(0, n, g, j, xr))
R16_SCALAR(op_mm_q5_K_r16_scalar, dot_qk_r16(1, n, g, j, xr))
