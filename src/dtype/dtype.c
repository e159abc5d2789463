/* dtype/dtype: type traits and the scalar reference quantizers/dequantizers for
 * F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_NL, IQ4_XS, MXFP4 and Q8_K (block layouts as in GGUF); the codebook
 * types (IQ2_*, IQ3_*, IQ1_*) in dtype/iq.c, the ternary ones in dtype/tq.c. */
#include "dtype/dtype.h"
#include "dtype/iq.h"
#include "dtype/tq.h"
#include <math.h>
#include <strings.h>

/* Every ggml type id with its block layout. `supported` marks the ones kvlm
 * computes with; the others are listed so GGUF files holding them can still be
 * opened, checked and described. */
typedef struct {
    dt_traits t;
    int supported;
} dt_entry;

static const dt_entry k_types[DT_COUNT] = {
    [DT_F32] = {{"f32", 1, 4}, 1},
    [DT_F16] = {{"f16", 1, 2}, 1},
    [DT_Q4_0] = {{"q4_0", QK4_0, sizeof(block_q4_0)}, 1},
    [DT_Q4_1] = {{"q4_1", 32, sizeof(block_q4_1)}, 1},
    [DT_Q5_0] = {{"q5_0", 32, sizeof(block_q5_0)}, 1},
    [DT_Q5_1] = {{"q5_1", 32, sizeof(block_q5_1)}, 1},
    [DT_Q8_0] = {{"q8_0", QK8_0, sizeof(block_q8_0)}, 1},
    [DT_Q8_1] = {{"q8_1", 32, 36}, 0},
    [DT_Q2_K] = {{"q2_K", QK_K, sizeof(block_q2_K)}, 1},
    [DT_Q3_K] = {{"q3_K", QK_K, sizeof(block_q3_K)}, 1},
    [DT_Q4_K] = {{"q4_K", QK_K, sizeof(block_q4_K)}, 1},
    [DT_Q5_K] = {{"q5_K", QK_K, sizeof(block_q5_K)}, 1},
    [DT_Q6_K] = {{"q6_K", QK_K, sizeof(block_q6_K)}, 1},
    [DT_Q8_K] = {{"q8_K", QK_K, sizeof(block_q8_K)}, 1},
    [DT_IQ2_XXS] = {{"iq2_xxs", QK_K, sizeof(block_iq2_xxs)}, 1},
    [DT_IQ2_XS] = {{"iq2_xs", QK_K, sizeof(block_iq2_xs)}, 1},
    [DT_IQ3_XXS] = {{"iq3_xxs", QK_K, sizeof(block_iq3_xxs)}, 1},
    [DT_IQ1_S] = {{"iq1_s", QK_K, sizeof(block_iq1_s)}, 1},
    [DT_IQ4_NL] = {{"iq4_nl", QK4_NL, sizeof(block_iq4_nl)}, 1},
    [DT_IQ3_S] = {{"iq3_s", QK_K, sizeof(block_iq3_s)}, 1},
    [DT_IQ2_S] = {{"iq2_s", QK_K, sizeof(block_iq2_s)}, 1},
    [DT_IQ4_XS] = {{"iq4_xs", QK_K, sizeof(block_iq4_xs)}, 1},
    [24] = {{"i8", 1, 1}, 0},
    [25] = {{"i16", 1, 2}, 0},
    [26] = {{"i32", 1, 4}, 0},
    [27] = {{"i64", 1, 8}, 0},
    [28] = {{"f64", 1, 8}, 0},
    [DT_IQ1_M] = {{"iq1_m", QK_K, sizeof(block_iq1_m)}, 1},
    [DT_BF16] = {{"bf16", 1, 2}, 1},
    [DT_TQ1_0] = {{"tq1_0", QK_K, sizeof(block_tq1_0)}, 1},
    [DT_TQ2_0] = {{"tq2_0", QK_K, sizeof(block_tq2_0)}, 1},
    [DT_MXFP4] = {{"mxfp4", 32, sizeof(block_mxfp4)}, 1},
};

const dt_traits *dt_layout(int type) {
    if (type < 0 || type >= DT_COUNT || !k_types[type].t.name) return NULL;
    return &k_types[type].t;
}

const dt_traits *dt_info(int type) {
    const dt_traits *t = dt_layout(type);
    return t && k_types[type].supported ? t : NULL;
}

const char *dt_name(int type) {
    const dt_traits *t = dt_layout(type);
    return t ? t->name : "unknown";
}

int dt_from_name(const char *name) {
    if (!name) return -1;
    for (int i = 0; i < DT_COUNT; i++)
        if (k_types[i].supported && strcasecmp(name, k_types[i].t.name) == 0) return i;
    return -1;
}

size_t dt_align(int type) {
    switch (type) {
    case DT_F32: case 26: return 4;               /* f32, i32 */
    case 27: case 28: return 8;                   /* i64, f64 */
    case DT_Q8_K: return _Alignof(block_q8_K);    /* a float d */
    case 24: case DT_MXFP4: return 1;             /* i8; MXFP4's e and nibbles */
    default: return 2;                            /* f16, bf16, i16, and blocks of f16 and u16 fields */
    }
}

size_t dt_row_size(int type, int64_t n) {
    const dt_traits *t = dt_layout(type);
    if (!t || n < 0 || n % t->block_size) return 0;
    return (size_t)(n / t->block_size) * t->type_size;
}

/* ---- small helpers --------------------------------------------------------- */

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
/* Round to nearest (ties to even: the current rounding mode), one instruction
 * where roundf would be a library call. Inputs must be finite. */
static inline int round_int(float x) { return (int)lrintf(x); }

/* ---- dequantizers ------------------------------------------------------------ */

static void deq_q4_0(const block_q4_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK4_0) {
        float d = dt_f16_to_f32(b[i].d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = (float)((b[i].qs[j] & 0xf) - 8) * d;
            y[j + QK4_0 / 2] = (float)((b[i].qs[j] >> 4) - 8) * d;
        }
    }
}

/* Q4_1, Q5_0, Q5_1: 32 elements, element j's nibble in byte j % 16 (low
 * nibble for j < 16), its 5th bit (Q5_*) bit j of qh. */
static inline int q5_code(const uint8_t *qs, const uint8_t *qh, int j) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return (j < 16 ? qs[j] & 0xf : qs[j - 16] >> 4) | (int)((h >> j) & 1) << 4;
}
static void deq_q4_1(const block_q4_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = dt_f16_to_f32(b[i].d), m = dt_f16_to_f32(b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[i].qs[j] & 0xf) * d + m;
            y[j + 16] = (float)(b[i].qs[j] >> 4) * d + m;
        }
    }
}
static void deq_q5_0(const block_q5_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = dt_f16_to_f32(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)(q5_code(b[i].qs, b[i].qh, j) - 16) * d;
    }
}
static void deq_q5_1(const block_q5_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = dt_f16_to_f32(b[i].d), m = dt_f16_to_f32(b[i].m);
        for (int j = 0; j < 32; j++) y[j] = (float)q5_code(b[i].qs, b[i].qh, j) * d + m;
    }
}

static void deq_q8_0(const block_q8_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK8_0) {
        float d = dt_f16_to_f32(b[i].d);
        for (int j = 0; j < QK8_0; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

/* Scale and min of sub-block j (0..7) from the 12 packed bytes: the first four
 * sub-blocks keep their 6 bits in the low bits of bytes 0..3 (scales) and
 * 4..7 (mins); the last four split into a nibble in bytes 8..11 and two high
 * bits in the top of bytes 0..7. */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q4_K, and with q5 Q5_K (the same block plus a 5th bit per element from qh:
 * element 64c + l has bit 2c of qh[l], 64c + 32 + l bit 2c + 1). Each
 * 64-element chunk uses 32 bytes: low nibbles are its first 32 elements
 * (sub-block 2c), high nibbles the next 32 (sub-block 2c+1). */
static void deq_qk(int q5, const void *src, float *y, int64_t nb) {
    const size_t bs = q5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    for (int64_t i = 0; i < nb; i++) {
        const block_q4_K *b = (const block_q4_K *)((const uint8_t *)src + (size_t)i * bs); /* d, dmin, scales */
        const uint8_t *q = q5 ? ((const block_q5_K *)b)->qs : b->qs, *qh = q5 ? ((const block_q5_K *)b)->qh : NULL;
        float d = dt_f16_to_f32(b->d), dmin = dt_f16_to_f32(b->dmin);
        for (int c = 0; c < 4; c++, q += 32) {
            int sc, m;
            q4k_scale_min(b->scales, 2 * c, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            q4k_scale_min(b->scales, 2 * c + 1, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)((q[l] & 0xf) | (qh ? (qh[l] >> (2 * c) & 1) << 4 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)((q[l] >> 4) | (qh ? (qh[l] >> (2 * c + 1) & 1) << 4 : 0)) - m2;
        }
    }
}

/* Q6_K element p (0..127) of half h: ql byte (p & 63) of the half, low nibble
 * for p < 64 else high; 2 high bits at bit 2*(p/32) of qh byte (p & 31). */
static void deq_q6_K(const block_q6_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = dt_f16_to_f32(b[i].d);
        for (int h = 0; h < 2; h++, y += 128) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            for (int p = 0; p < 128; p++) {
                int lo = p < 64 ? (ql[p & 63] & 0xf) : (ql[p & 63] >> 4);
                int hi = (qh[p & 31] >> (2 * (p / 32))) & 3;
                int q = (lo | (hi << 4)) - 32;
                y[p] = d * (float)sc[p / 16] * (float)q;
            }
        }
    }
}

static void deq_q8_K(const block_q8_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK_K)
        for (int j = 0; j < QK_K; j++) y[j] = b[i].d * (float)b[i].qs[j];
}

const int8_t dt_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* E2M1's values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, doubled
 * (ggml's kvalues_mxfp4); nibble bit 3 is the sign. */
const int8_t dt_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The 2-bit field of element e (0..255) in Q2_K's and Q3_K's qs: bits
 * 2j..2j+1 of byte 32h + l for e = 128h + 32j + l. */
static inline int q2_field(const uint8_t *qs, int e) {
    return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

static void deq_q2_K(const block_q2_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK_K) {
        float d = dt_f16_to_f32(b[i].d), dmin = dt_f16_to_f32(b[i].dmin);
        for (int e = 0; e < QK_K; e++) {
            int sc = b[i].scales[e / 16];
            float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
            y[e] = dl * (float)q2_field(b[i].qs, e) - ml;
        }
    }
}

/* Q3_K scale i (0..15) less its +32 bias. */
static inline int q3k_scale(const uint8_t *s, int i) {
    return (((s[i % 8] >> (4 * (i / 8))) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
}

static void deq_q3_K(const block_q3_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK_K) {
        float d = dt_f16_to_f32(b[i].d);
        for (int e = 0; e < QK_K; e++) {
            int hbit = (b[i].hmask[e % 32] >> (4 * (e / 128) + (e % 128) / 32)) & 1;
            float dl = d * (float)q3k_scale(b[i].scales, e / 16);
            y[e] = dl * (float)(q2_field(b[i].qs, e) - (hbit ? 0 : 4));
        }
    }
}

/* 32 values d kv[nibble], nibbles as Q4_0's (IQ4_NL, IQ4_XS, MXFP4). */
static void deq_nibbles(const int8_t *kv, float d, const uint8_t *qs, float *y) {
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)kv[qs[j] & 15];
        y[j + 16] = d * (float)kv[qs[j] >> 4];
    }
}

static void deq_iq4_nl(const block_iq4_nl *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK4_NL) deq_nibbles(dt_kvalues_iq4nl, dt_f16_to_f32(b[i].d), b[i].qs, y);
}

static void deq_mxfp4(const block_mxfp4 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) deq_nibbles(dt_kvalues_mxfp4, dt_e8m0_half(b[i].e), b[i].qs, y);
}

/* IQ4_XS sub-block i's 6-bit scale less its +32 bias. */
static inline int iq4xs_scale(const block_iq4_xs *b, int i) {
    return (((b->scales_l[i / 2] >> (4 * (i % 2))) & 15) | (((b->scales_h >> (2 * i)) & 3) << 4)) - 32;
}

static void deq_iq4_xs(const block_iq4_xs *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = dt_f16_to_f32(b[i].d);
        for (int s = 0; s < 8; s++, y += 32) {
            deq_nibbles(dt_kvalues_iq4nl, d * (float)iq4xs_scale(&b[i], s), b[i].qs + 16 * s, y);
        }
    }
}

void dt_dequantize_row(int type, const void *src, float *dst, int64_t n) {
    const dt_traits *t = dt_info(type);
    if (!t || n <= 0 || n % t->block_size) return;
    int64_t nb = n / t->block_size;
    switch (type) {
    case DT_F32: memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case DT_F16: {
        const dt_f16 *h = src;
        for (int64_t i = 0; i < n; i++) dst[i] = dt_f16_to_f32(h[i]);
        break;
    }
    case DT_BF16: {
        const dt_bf16 *h = src;
        for (int64_t i = 0; i < n; i++) dst[i] = dt_bf16_to_f32(h[i]);
        break;
    }
    case DT_Q4_0: deq_q4_0(src, dst, nb); break;
    case DT_Q4_1: deq_q4_1(src, dst, nb); break;
    case DT_Q5_0: deq_q5_0(src, dst, nb); break;
    case DT_Q5_1: deq_q5_1(src, dst, nb); break;
    case DT_Q8_0: deq_q8_0(src, dst, nb); break;
    case DT_Q4_K: deq_qk(0, src, dst, nb); break;
    case DT_Q5_K: deq_qk(1, src, dst, nb); break;
    case DT_Q6_K: deq_q6_K(src, dst, nb); break;
    case DT_Q8_K: deq_q8_K(src, dst, nb); break;
    case DT_Q2_K: deq_q2_K(src, dst, nb); break;
    case DT_Q3_K: deq_q3_K(src, dst, nb); break;
    case DT_IQ4_NL: deq_iq4_nl(src, dst, nb); break;
    case DT_IQ4_XS: deq_iq4_xs(src, dst, nb); break;
    case DT_MXFP4: deq_mxfp4(src, dst, nb); break;
    default:
        if (dt_is_iq(type)) dt_iq_dequantize(type, src, dst, nb);
        else if (dt_is_tq(type)) dt_tq_dequantize(type, src, dst, nb);
        break;
    }
}

/* ---- quantizers ---------------------------------------------------------------- */

/* Q4_0: the element of largest magnitude maps exactly to -8 (the end of the
 * range with one more step), so its sign decides the sign of d. */
static void q_q4_0(const float *x, block_q4_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK4_0) {
        float amax = 0, vmax = 0;
        for (int j = 0; j < QK4_0; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); vmax = x[j]; }
        float d = vmax / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = dt_f32_to_f16(d);
        for (int j = 0; j < QK4_0 / 2; j++) {
            /* +8.5 then truncation: round to nearest into 0..15. */
            int a = clampi((int)(x[j] * id + 8.5f), 0, 15);
            int c = clampi((int)(x[j + QK4_0 / 2] * id + 8.5f), 0, 15);
            b[i].qs[j] = (uint8_t)(a | (c << 4));
        }
    }
}

/* Q5_0: as Q4_0 with 32 steps: the element of largest magnitude maps to -16. */
static void q_q5_0(const float *x, block_q5_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0, vmax = 0;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); vmax = x[j]; }
        float d = vmax / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = dt_f32_to_f16(d);
        uint32_t h = 0;
        memset(b[i].qs, 0, sizeof b[i].qs);
        for (int j = 0; j < 32; j++) {
            int q = clampi((int)(x[j] * id + 16.5f), 0, 31); /* +16.5 then truncation: round to nearest */
            b[i].qs[j % 16] |= (uint8_t)((q & 15) << (j < 16 ? 0 : 4));
            h |= (uint32_t)(q >> 4) << j;
        }
        memcpy(b[i].qh, &h, 4);
    }
}

/* Q4_1 / Q5_1 (qmax 15 / 31): min and step from the block's range. */
static void q_affine32(const float *x, int qmax, dt_f16 *d_out, dt_f16 *m_out, uint8_t codes[32]) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; j++) { lo = fminf(lo, x[j]); hi = fmaxf(hi, x[j]); }
    float d = (hi - lo) / (float)qmax;
    *d_out = dt_f32_to_f16(d);
    *m_out = dt_f32_to_f16(lo);
    float ds = dt_f16_to_f32(*d_out), ms = dt_f16_to_f32(*m_out); /* codes against the stored values */
    for (int j = 0; j < 32; j++) codes[j] = (uint8_t)(ds > 0 ? clampi(round_int((x[j] - ms) / ds), 0, qmax) : 0);
}
static void q_q4_1(const float *x, block_q4_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        uint8_t c[32];
        q_affine32(x, 15, &b[i].d, &b[i].m, c);
        for (int j = 0; j < 16; j++) b[i].qs[j] = (uint8_t)(c[j] | c[j + 16] << 4);
    }
}
static void q_q5_1(const float *x, block_q5_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        uint8_t c[32];
        q_affine32(x, 31, &b[i].d, &b[i].m, c);
        uint32_t h = 0;
        for (int j = 0; j < 16; j++) b[i].qs[j] = (uint8_t)((c[j] & 15) | (c[j + 16] & 15) << 4);
        for (int j = 0; j < 32; j++) h |= (uint32_t)(c[j] >> 4) << j;
        memcpy(b[i].qh, &h, 4);
    }
}

static void q_q8_0(const float *x, block_q8_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK8_0) {
        float amax = 0;
        for (int j = 0; j < QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = dt_f32_to_f16(d);
        for (int j = 0; j < QK8_0; j++) b[i].qs[j] = (int8_t)clampi(round_int(x[j] * id), -127, 127);
    }
}

/* Least-squares fit of x ~ s*q + b from the sums over a sub-block (n
 * elements, codes q): the error is computed from the same sums, so each
 * candidate costs one pass. b <= 0 is forced, since Q4_K stores the offset
 * as an unsigned "min" that is subtracted. Returns the squared error. */
typedef struct { double n, sx, sx2, sq, sq2, sxq; } ls_sums;

static double fit_affine(const ls_sums *m, float *s, float *b) {
    double det = m->n * m->sq2 - m->sq * m->sq, ss, bb;
    if (det > 0) {
        ss = (m->n * m->sxq - m->sq * m->sx) / det;
        bb = (m->sx - ss * m->sq) / m->n;
    } else {
        ss = 0;
        bb = m->sx / m->n;
    }
    if (bb > 0 || ss < 0) { /* offset must not be positive: refit the scale alone */
        bb = bb > 0 ? 0 : bb;
        ss = m->sq2 > 0 ? (m->sxq - bb * m->sq) / m->sq2 : 0;
        if (ss < 0) ss = 0;
    }
    *s = (float)ss;
    *b = (float)bb;
    return m->sx2 + ss * ss * m->sq2 + m->n * bb * bb - 2 * ss * m->sxq - 2 * bb * m->sx + 2 * ss * bb * m->sq;
}

/* Scale s >= 0 and min m >= 0 for one Q4_K / Q5_K sub-block (value = s*q - m,
 * q in 0..qmax, 15 or 31): tries a range of step sizes around
 * (max-min)/qmax, assigns codes for each, refits s and m by least squares,
 * keeps the best. */
static void qk_sub_block(const float *x, int n, int qmax, float *s_out, float *m_out) {
    float lo = x[0], hi = x[0];
    double sx = 0, sx2 = 0;
    for (int i = 0; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
        sx += x[i];
        sx2 += (double)x[i] * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi <= lo) { *s_out = 0; *m_out = -lo; return; }
    float best_s = (hi - lo) / (float)qmax, best_b = lo;
    double best_err = INFINITY;
    for (int step = -10; step <= 10; step++) {
        float iscale = ((float)qmax + 0.1f * (float)step) / (hi - lo);
        float sq = 0, sq2 = 0, sxq = 0; /* exact enough: 32 small integers */
        for (int i = 0; i < n; i++) {
            /* the argument is >= 0, so +0.5 and truncation round to nearest */
            int q = (int)(iscale * (x[i] - lo) + 0.5f);
            q = q > qmax ? qmax : q;
            sq += (float)q;
            sq2 += (float)(q * q);
            sxq += x[i] * (float)q;
        }
        ls_sums m = {n, sx, sx2, sq, sq2, sxq};
        float s, b;
        double err = fit_affine(&m, &s, &b);
        if (err < best_err) { best_err = err; best_s = s; best_b = b; }
    }
    *s_out = best_s;
    *m_out = -best_b;
}

/* One Q4_K / Q5_K super-block: the 8 sub-blocks' scales and mins as 6-bit
 * codes of two f16 super-block scales (packed as Q4_K packs them), and the
 * codes 0..qmax of the 256 elements against the scales as stored (so their
 * rounding adds no systematic error). */
static void qk_super_block(const float *x, int qmax, dt_f16 *d_out, dt_f16 *dmin_out, uint8_t scales[K_SCALE_SIZE],
                           uint8_t codes[QK_K]) {
    float s[8], m[8], smax = 0, mmax = 0;
    for (int j = 0; j < 8; j++) {
        qk_sub_block(x + 32 * j, 32, qmax, &s[j], &m[j]);
        smax = fmaxf(smax, s[j]);
        mmax = fmaxf(mmax, m[j]);
    }
    float d = dt_f16_to_f32(dt_f32_to_f16(smax / 63.0f));
    float dmin = dt_f16_to_f32(dt_f32_to_f16(mmax / 63.0f));
    *d_out = dt_f32_to_f16(d);
    *dmin_out = dt_f32_to_f16(dmin);
    int ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = d > 0 ? clampi(round_int(s[j] / d), 0, 63) : 0;
        lm[j] = dmin > 0 ? clampi(round_int(m[j] / dmin), 0, 63) : 0;
    }
    memset(scales, 0, K_SCALE_SIZE);
    for (int j = 0; j < 4; j++) {
        scales[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        scales[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        scales[j + 8] = (uint8_t)((ls[j + 4] & 0xf) | ((lm[j + 4] & 0xf) << 4));
    }
    for (int j = 0; j < 8; j++) {
        float sj = d * (float)ls[j], mj = dmin * (float)lm[j];
        for (int l = 0; l < 32; l++)
            codes[32 * j + l] = (uint8_t)(sj > 0 ? clampi(round_int((x[32 * j + l] + mj) / sj), 0, qmax) : 0);
    }
}

static void q_q4_K(const float *x, block_q4_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        uint8_t codes[QK_K];
        qk_super_block(x, 15, &b[i].d, &b[i].dmin, b[i].scales, codes);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * c + l] = (uint8_t)(codes[64 * c + l] | (codes[64 * c + 32 + l] << 4));
    }
}

static void q_q5_K(const float *x, block_q5_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        uint8_t codes[QK_K];
        qk_super_block(x, 31, &b[i].d, &b[i].dmin, b[i].scales, codes);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                int lo = codes[64 * c + l], hi = codes[64 * c + 32 + l];
                b[i].qs[32 * c + l] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                b[i].qh[l] |= (uint8_t)(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
            }
    }
}

/* Signed scale for one Q6_K (nmax 32) or Q3_K (nmax 4) sub-block (value =
 * s*q, q in -nmax..nmax-1): the largest-magnitude element maps near -nmax
 * (the longer side of the range); several step sizes are tried with a
 * least-squares refit of s. */
static float sym_sub_block(const float *x, int n, int nmax) {
    float amax = 0, vmax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); vmax = x[i]; }
    if (amax < 1e-30f) return 0;
    /* With the least-squares scale s = sum(xq)/sum(q^2) the error is
     * sum(x^2) - sum(xq)^2/sum(q^2): the best candidate maximises the ratio. */
    float best_s = vmax / -(float)nmax, best_gain = -1;
    for (int step = -10; step <= 10; step++) {
        float iscale = -((float)nmax + 0.1f * (float)step) / vmax;
        float sxq = 0, sq2 = 0;
        for (int i = 0; i < n; i++) {
            int q = clampi(round_int(iscale * x[i]), -nmax, nmax - 1);
            sxq += x[i] * (float)q;
            sq2 += (float)(q * q);
        }
        if (sq2 <= 0) continue;
        float gain = sxq * sxq / sq2;
        if (gain > best_gain) { best_gain = gain; best_s = sxq / sq2; }
    }
    return best_s;
}
static float q6k_sub_block(const float *x, int n) { return sym_sub_block(x, n, 32); }

static void q_q6_K(const float *x, block_q6_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float s[16], smax = 0, vmax = 0;
        for (int j = 0; j < 16; j++) {
            s[j] = q6k_sub_block(x + 16 * j, 16);
            if (fabsf(s[j]) > smax) { smax = fabsf(s[j]); vmax = s[j]; }
        }
        memset(b[i].ql, 0, sizeof b[i].ql);
        memset(b[i].qh, 0, sizeof b[i].qh);
        /* int8 scales: the largest maps to -128 (so d may be negative). */
        float d = vmax != 0 ? dt_f16_to_f32(dt_f32_to_f16(vmax / -128.0f)) : 0.0f;
        b[i].d = dt_f32_to_f16(d);
        int codes[QK_K];
        for (int j = 0; j < 16; j++) {
            int sc = d != 0 ? clampi(round_int(s[j] / d), -128, 127) : 0;
            b[i].scales[j] = (int8_t)sc;
            float sj = d * (float)sc;
            for (int l = 0; l < 16; l++)
                codes[16 * j + l] = sj != 0 ? clampi(round_int(x[16 * j + l] / sj), -32, 31) + 32 : 32;
        }
        for (int h = 0; h < 2; h++) {
            uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int *c = codes + 128 * h;
            for (int p = 0; p < 128; p++) {
                ql[p & 63] |= (uint8_t)((c[p] & 0xf) << (p < 64 ? 0 : 4));
                qh[p & 31] |= (uint8_t)((c[p] >> 4) << (2 * (p / 32)));
            }
        }
    }
}

/* Q8_K: activations for the K-type dot products; bsums lets a kernel fold the
 * Q4_K "min" term into 16 multiplications per super-block. */
static void q_q8_K(const float *x, block_q8_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float amax = 0;
        for (int j = 0; j < QK_K; j++) amax = fmaxf(amax, fabsf(x[j]));
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float iscale = 127.0f / amax;
        b[i].d = 1.0f / iscale;
        for (int j = 0; j < QK_K; j++) b[i].qs[j] = (int8_t)clampi(round_int(iscale * x[j]), -127, 127);
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += b[i].qs[16 * j + l];
            b[i].bsums[j] = (int16_t)sum;
        }
    }
}

/* Q2_K: each 16-element sub-block's scale and min fitted as Q4_K's (codes
 * 0..3), then both as 4-bit codes of two f16 super-block scales, and the
 * codes against the scales as stored. */
static void q_q2_K(const float *x, block_q2_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float s[16], m[16], smax = 0, mmax = 0;
        for (int j = 0; j < 16; j++) {
            qk_sub_block(x + 16 * j, 16, 3, &s[j], &m[j]);
            smax = fmaxf(smax, s[j]);
            mmax = fmaxf(mmax, m[j]);
        }
        float d = dt_f16_to_f32(dt_f32_to_f16(smax / 15.0f)), dmin = dt_f16_to_f32(dt_f32_to_f16(mmax / 15.0f));
        b[i].d = dt_f32_to_f16(d);
        b[i].dmin = dt_f32_to_f16(dmin);
        memset(b[i].qs, 0, sizeof b[i].qs);
        for (int j = 0; j < 16; j++) {
            int ls = d > 0 ? clampi(round_int(s[j] / d), 0, 15) : 0;
            int lm = dmin > 0 ? clampi(round_int(m[j] / dmin), 0, 15) : 0;
            b[i].scales[j] = (uint8_t)(ls | lm << 4);
            float sj = d * (float)ls, mj = dmin * (float)lm;
            for (int l = 0; l < 16; l++) {
                int e = 16 * j + l;
                int q = sj > 0 ? clampi(round_int((x[e] + mj) / sj), 0, 3) : 0;
                b[i].qs[32 * (e / 128) + e % 32] |= (uint8_t)(q << (2 * ((e % 128) / 32)));
            }
        }
    }
}

/* Q3_K: signed scales per 16 elements (codes -4..3), as 6-bit codes (biased
 * by 32) of one f16 scale whose sign lets the largest map to -32. */
static void q_q3_K(const float *x, block_q3_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float s[16], smax = 0, vmax = 0;
        for (int j = 0; j < 16; j++) {
            s[j] = sym_sub_block(x + 16 * j, 16, 4);
            if (fabsf(s[j]) > smax) { smax = fabsf(s[j]); vmax = s[j]; }
        }
        float d = vmax != 0 ? dt_f16_to_f32(dt_f32_to_f16(vmax / -32.0f)) : 0.0f;
        b[i].d = dt_f32_to_f16(d);
        memset(b[i].hmask, 0, sizeof b[i].hmask);
        memset(b[i].qs, 0, sizeof b[i].qs);
        memset(b[i].scales, 0, sizeof b[i].scales);
        for (int j = 0; j < 16; j++) {
            int sc = d != 0 ? clampi(round_int(s[j] / d), -32, 31) : 0, u6 = sc + 32;
            b[i].scales[j % 8] |= (uint8_t)((u6 & 15) << (4 * (j / 8)));
            b[i].scales[8 + j % 4] |= (uint8_t)((u6 >> 4) << (2 * (j / 4)));
            float sj = d * (float)sc;
            for (int l = 0; l < 16; l++) {
                int e = 16 * j + l;
                int u = (sj != 0 ? clampi(round_int(x[e] / sj), -4, 3) : 0) + 4; /* 0..7 */
                b[i].qs[32 * (e / 128) + e % 32] |= (uint8_t)((u & 3) << (2 * ((e % 128) / 32)));
                b[i].hmask[e % 32] |= (uint8_t)((u >> 2) << (4 * (e / 128) + (e % 128) / 32));
            }
        }
    }
}

/* Nearest IQ4 level to v (in level units) by a table over half-unit steps:
 * the levels are integers, so every midpoint between two falls on a step
 * boundary. */
enum { IQ4_LO = -128, IQ4_HI = 114, IQ4_TAB = 2 * (IQ4_HI - IQ4_LO) };
static void iq4_table(uint8_t tab[IQ4_TAB]) {
    for (int k = 0; k < IQ4_TAB; k++) {
        float v = (float)IQ4_LO + 0.5f * (float)k + 0.25f; /* the step's centre */
        int best = 0;
        for (int q = 1; q < 16; q++)
            if (fabsf(v - dt_kvalues_iq4nl[q]) < fabsf(v - dt_kvalues_iq4nl[best])) best = q;
        tab[k] = (uint8_t)best;
    }
}
static inline int iq4_nearest(const uint8_t *tab, float v) {
    v = fmaxf(fminf(v, 2.0f * IQ4_HI), 2.0f * IQ4_LO); /* far values (a tiny scale) convert to int safely */
    int k = (int)floorf(2.0f * (v - (float)IQ4_LO));
    return tab[k < 0 ? 0 : k >= IQ4_TAB ? IQ4_TAB - 1 : k];
}

/* Signed scale of n values on the IQ4 levels: the largest magnitude maps
 * near -127 or near +113 (the two ends), several step sizes each, each with
 * a least-squares refit; the best by the error left. */
static float iq4_sub_block(const uint8_t *tab, const float *x, int n) {
    float amax = 0, vmax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); vmax = x[i]; }
    if (amax < 1e-30f) return 0;
    float best_s = vmax / -127.0f, best_gain = -1;
    for (int end = 0; end < 2; end++)
        for (int step = -6; step <= 6; step++) {
            float iscale = (end ? 113.0f : -127.0f) * (1.0f + 0.02f * (float)step) / vmax;
            float sxq = 0, sq2 = 0;
            for (int i = 0; i < n; i++) {
                float q = (float)dt_kvalues_iq4nl[iq4_nearest(tab, iscale * x[i])];
                sxq += x[i] * q;
                sq2 += q * q;
            }
            float gain = sxq * sxq / sq2;
            if (gain > best_gain) { best_gain = gain; best_s = sxq / sq2; }
        }
    return best_s;
}

/* Nibbles of 32 values against the stored scale dl, as Q4_0 packs them. */
static void iq4_pack32(const uint8_t *tab, const float *x, float dl, uint8_t qs[16]) {
    float id = dl != 0 ? 1.0f / dl : 0.0f;
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)(iq4_nearest(tab, x[j] * id) | iq4_nearest(tab, x[j + 16] * id) << 4);
}

static void q_iq4_nl(const float *x, block_iq4_nl *b, int64_t nb) {
    uint8_t tab[IQ4_TAB];
    iq4_table(tab);
    for (int64_t i = 0; i < nb; i++, x += QK4_NL) {
        b[i].d = dt_f32_to_f16(iq4_sub_block(tab, x, QK4_NL));
        iq4_pack32(tab, x, dt_f16_to_f32(b[i].d), b[i].qs);
    }
}

/* IQ4_XS: IQ4_NL's scale per 32 elements, then as 6-bit codes (biased by 32)
 * of one f16 scale whose sign lets the largest map to -32. */
static void q_iq4_xs(const float *x, block_iq4_xs *b, int64_t nb) {
    uint8_t tab[IQ4_TAB];
    iq4_table(tab);
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        float s[8], smax = 0, vmax = 0;
        for (int j = 0; j < 8; j++) {
            s[j] = iq4_sub_block(tab, x + 32 * j, 32);
            if (fabsf(s[j]) > smax) { smax = fabsf(s[j]); vmax = s[j]; }
        }
        float d = vmax != 0 ? dt_f16_to_f32(dt_f32_to_f16(vmax / -32.0f)) : 0.0f;
        b[i].d = dt_f32_to_f16(d);
        b[i].scales_h = 0;
        memset(b[i].scales_l, 0, sizeof b[i].scales_l);
        for (int j = 0; j < 8; j++) {
            int ls = d != 0 ? clampi(round_int(s[j] / d), -32, 31) : 0, u6 = ls + 32;
            b[i].scales_l[j / 2] |= (uint8_t)((u6 & 15) << (4 * (j % 2)));
            b[i].scales_h |= (uint16_t)((u6 >> 4) << (2 * j));
            iq4_pack32(tab, x + 32 * j, d * (float)ls, b[i].qs + 16 * j);
        }
    }
}

/* MXFP4: the nearest level (doubled E2M1) to v in units of half the scale. */
static inline int mxfp4_nearest(float v) {
    static const float mid[7] = {0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f}; /* between levels 0 1 2 3 4 6 8 12 */
    float a = fabsf(v);
    int k = 0;
    while (k < 7 && a > mid[k]) k++;
    return k == 0 ? 0 : k | (v < 0 ? 8 : 0); /* zero keeps nibble 0 */
}

/* MXFP4: ggml's exponent puts the largest magnitude at level 6 (doubled: 12)
 * or just under; the exponent one below (largest values clipped to 12) and
 * one above are tried too, keeping the one of least squared error. */
static void q_mxfp4(const float *x, block_mxfp4 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        int e0 = amax > 0 ? (int)floorf(log2f(amax)) - 2 + 127 : 1;
        e0 = e0 < 1 ? 1 : e0 > 253 ? 253 : e0; /* the three candidates within 0..254 */
        float best_err = INFINITY;
        for (int e = e0 - 1; e <= e0 + 1; e++) {
            const float d = dt_e8m0_half((uint8_t)e), id = 1.0f / d;
            uint8_t qs[16];
            float err = 0;
            for (int j = 0; j < 16; j++) {
                int lo = mxfp4_nearest(x[j] * id), hi = mxfp4_nearest(x[j + 16] * id);
                float r0 = x[j] - d * (float)dt_kvalues_mxfp4[lo], r1 = x[j + 16] - d * (float)dt_kvalues_mxfp4[hi];
                err += r0 * r0 + r1 * r1;
                qs[j] = (uint8_t)(lo | hi << 4);
            }
            if (err < best_err) {
                best_err = err;
                b[i].e = (uint8_t)e;
                memcpy(b[i].qs, qs, 16);
            }
        }
    }
}

int dt_quantize_row(int type, const float *src, void *dst, int64_t n) {
    const dt_traits *t = dt_info(type);
    if (!t || n < 0 || n % t->block_size) return -1;
    int64_t nb = n / t->block_size;
    switch (type) {
    case DT_F32: memcpy(dst, src, (size_t)n * sizeof(float)); return 0;
    case DT_F16: {
        dt_f16 *h = dst;
        for (int64_t i = 0; i < n; i++) h[i] = dt_f32_to_f16(src[i]);
        return 0;
    }
    case DT_BF16: {
        dt_bf16 *h = dst;
        for (int64_t i = 0; i < n; i++) h[i] = dt_f32_to_bf16(src[i]);
        return 0;
    }
    case DT_Q4_0: q_q4_0(src, dst, nb); return 0;
    case DT_Q4_1: q_q4_1(src, dst, nb); return 0;
    case DT_Q5_0: q_q5_0(src, dst, nb); return 0;
    case DT_Q5_1: q_q5_1(src, dst, nb); return 0;
    case DT_Q8_0: q_q8_0(src, dst, nb); return 0;
    case DT_Q4_K: q_q4_K(src, dst, nb); return 0;
    case DT_Q5_K: q_q5_K(src, dst, nb); return 0;
    case DT_Q6_K: q_q6_K(src, dst, nb); return 0;
    case DT_Q8_K: q_q8_K(src, dst, nb); return 0;
    case DT_Q2_K: q_q2_K(src, dst, nb); return 0;
    case DT_Q3_K: q_q3_K(src, dst, nb); return 0;
    case DT_IQ4_NL: q_iq4_nl(src, dst, nb); return 0;
    case DT_IQ4_XS: q_iq4_xs(src, dst, nb); return 0;
    case DT_MXFP4: q_mxfp4(src, dst, nb); return 0;
    default:
        if (dt_is_iq(type)) dt_iq_quantize(type, src, dst, nb);
        else if (dt_is_tq(type)) dt_tq_quantize(type, src, dst, nb);
        else return -1;
        return 0;
    }
}
