/* ops/kvtype: the table of the KV cache element types (op_kv_traits, one row
 * per type; layouts documented in ops/kvtype.h), their scalar reference
 * (de)quantizers, the F16C path of the f16 write, and the public names. */
#include "ops/kvtype.h"
#include <math.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/attention_internal.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#if defined(__clang__) /* clang has no GCC target pragma */
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#endif
/* An f16 row with vcvtps2ph: the bits of dt_f32_to_f16 (both round to
 * nearest even, through subnormals and overflow), but for NaNs, whose
 * payload the instruction keeps: false for a row with one (the caller
 * converts it again, in scalar). The scalar conversion branches on the
 * rounding of each element, which random data mispredicts (a visible share of
 * a decode step's time in the server). */
static bool f16_row_f16c(const float *x, dt_f16 *y, int n) {
    __m256 nan = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) {
        if (isnan(x[i])) return false;
        y[i] = dt_f32_to_f16(x[i]);
    }
    return !_mm256_movemask_ps(nan);
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ---- per-token rows: the scalar references ------------------------------------ */
/* q8_0 / q4_0 groups of g elements, as GGUF quantizes its 32-element blocks
 * (same rounding), so g = 32 gives GGUF's bytes. */
static void q8_group(const float *x, uint8_t *b, int g) {
    float amax = 0;
    for (int j = 0; j < g; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax; /* fmaxf's result, inlined */
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    dt_f16 h = dt_f32_to_f16(d);
    memcpy(b, &h, 2);
    for (int j = 0; j < g; j++) b[2 + j] = (uint8_t)(int8_t)clampi((int)lrintf(x[j] * id), -127, 127);
}

static void q4_group(const float *x, uint8_t *b, int g) {
    float amax = 0, vmax = 0;
    for (int j = 0; j < g; j++)
        if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); vmax = x[j]; }
    float d = vmax / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    dt_f16 h = dt_f32_to_f16(d);
    memcpy(b, &h, 2);
    int half = (g + 1) / 2;
    for (int j = 0; j < half; j++) {
        int lo = clampi((int)(x[j] * id + 8.5f), 0, 15);
        int hi = j + half < g ? clampi((int)(x[j + half] * id + 8.5f), 0, 15) : 8;
        b[2 + j] = (uint8_t)(lo | (hi << 4));
    }
}

static int group_of(int hd) { return hd % 32 == 0 ? 32 : hd; } /* the grouped types' (op_kv_group) */

static void f32_quant(const float *x, void *dst, int hd) { memcpy(dst, x, (size_t)hd * sizeof(float)); }
static void f16_quant(const float *x, void *dst, int hd) {
    for (int i = 0; i < hd; i++) ((dt_f16 *)dst)[i] = dt_f32_to_f16(x[i]);
}
static void bf16_quant(const float *x, void *dst, int hd) {
    for (int i = 0; i < hd; i++) ((dt_bf16 *)dst)[i] = dt_f32_to_bf16(x[i]);
}
static void q8_0_quant(const float *x, void *dst, int hd) {
    uint8_t *b = dst;
    int g = group_of(hd);
    for (int i = 0; i < hd; i += g, b += 2 + g) q8_group(x + i, b, g);
}
static void q4_0_quant(const float *x, void *dst, int hd) {
    uint8_t *b = dst;
    int g = group_of(hd);
    for (int i = 0; i < hd; i += g, b += 2 + (g + 1) / 2) q4_group(x + i, b, g);
}
#if defined(__x86_64__) || defined(__i386__)
static void f16_quant_f16c(const float *x, void *dst, int hd) {
    if (!f16_row_f16c(x, dst, hd)) f16_quant(x, dst, hd);
}
#endif

static void f32_dequant(const void *src, float *y, int hd) { memcpy(y, src, (size_t)hd * sizeof(float)); }
static void f16_dequant(const void *src, float *y, int hd) {
    const uint8_t *b = src;
    for (int i = 0; i < hd; i++) {
        dt_f16 h;
        memcpy(&h, b + 2 * i, 2);
        y[i] = dt_f16_to_f32(h);
    }
}
static void bf16_dequant(const void *src, float *y, int hd) {
    const uint8_t *b = src;
    for (int i = 0; i < hd; i++) {
        dt_bf16 h;
        memcpy(&h, b + 2 * i, 2);
        y[i] = dt_bf16_to_f32(h);
    }
}
static void q8_0_dequant(const void *src, float *y, int hd) {
    const uint8_t *b = src;
    int g = group_of(hd);
    for (int i = 0; i < hd; i += g, b += 2 + g) {
        dt_f16 h;
        memcpy(&h, b, 2);
        float d = dt_f16_to_f32(h);
        for (int j = 0; j < g; j++) y[i + j] = (float)(int8_t)b[2 + j] * d;
    }
}
static void q4_0_dequant(const void *src, float *y, int hd) {
    const uint8_t *b = src;
    int g = group_of(hd), half = (g + 1) / 2;
    for (int i = 0; i < hd; i += g, b += 2 + half) {
        dt_f16 h;
        memcpy(&h, b, 2);
        float d = dt_f16_to_f32(h);
        for (int j = 0; j < half; j++) {
            y[i + j] = (float)((b[2 + j] & 0xf) - 8) * d;
            if (j + half < g) y[i + j + half] = (float)((b[2 + j] >> 4) - 8) * d;
        }
    }
}

static size_t kc_region_bytes(int hd, int bs) { return (size_t)hd * (4 + (size_t)(bs + 1) / 2); }

/* ---- the table ------------------------------------------------------------------ */
#if defined(__x86_64__) || defined(__i386__)
#define AVX2(f) f
#else /* only the scalar kernels are built */
#define AVX2(f) NULL
#endif

/* A per-token type: float (bits 32 / 16) or grouped codes with an f16 scale. */
#define TOKEN_TYPE(T, nm, vals, b, grp, cu, quant_avx2)                                                         \
    {#nm, KVLM_CACHE_##T, true, vals, b, grp, false, NULL, NULL, NULL, false, KVLM_CACHE_##T, cu,          \
     {nm##_quant, quant_avx2}, nm##_dequant, {NULL, AVX2(&op_kv_##nm##_avx2)}}

static const op_kv_traits rows[] = {
    TOKEN_TYPE(F32, f32, true, 32, false, true, NULL),
    TOKEN_TYPE(F16, f16, true, 16, false, true, AVX2(f16_quant_f16c)),
    TOKEN_TYPE(BF16, bf16, true, 16, false, true, NULL),
    TOKEN_TYPE(Q8_0, q8_0, true, 8, true, true, NULL),
    TOKEN_TYPE(Q4_0, q4_0, true, 4, true, true, NULL),
    /* KIVI-style keys: per channel over a block's tokens, so a block is
     * quantized once, when full: rows in order, none taken back across a
     * block; a draft (whose rows are) keeps q8_0 keys */
    {"q4_kc", KVLM_CACHE_Q4_KC, true, false, 4, false, true, kc_region_bytes, op_kv_quantize_kc, op_kv_dequantize_kc,
     true, KVLM_CACHE_Q8_0, false, {NULL}, NULL, {NULL, AVX2(&op_kv_q4_kc_avx2)}},
};
#define N_ROWS (int)(sizeof rows / sizeof rows[0])

const op_kv_traits *op_kv_traits_of(int type) {
    for (int i = 0; i < N_ROWS; i++)
        if (rows[i].id == type) return &rows[i];
    return NULL;
}

const op_kv_traits *op_kv_traits_all(int *n) {
    *n = N_ROWS;
    return rows;
}

int op_kv_type_by_name(const char *name) {
    for (int i = 0; name && i < N_ROWS; i++)
        if (!strcmp(name, rows[i].name)) return rows[i].id;
    return -1;
}

const char *op_kv_type_name(int type) {
    const op_kv_traits *t = op_kv_traits_of(type);
    return t ? t->name : NULL;
}

bool op_kv_type_valid(int type, bool for_values) {
    const op_kv_traits *t = op_kv_traits_of(type);
    return t && (for_values ? t->values : t->keys);
}

bool op_kv_per_block(int type) {
    const op_kv_traits *t = op_kv_traits_of(type);
    return t && t->per_block;
}

bool op_kv_in_order(int type) {
    const op_kv_traits *t = op_kv_traits_of(type);
    return t && t->in_order;
}

int op_kv_draft_type(int type) {
    const op_kv_traits *t = op_kv_traits_of(type);
    return t ? t->draft : type;
}

bool op_kv_int_query(int type) {
    const op_kv_traits *t = op_kv_traits_of(type);
    return t && t->grouped;
}

/* A per-level array's entry at level, or at the nearest level below that has
 * one (the scalar level's, possibly NULL, at the bottom). */
#define AT_LEVEL(arr, level)                                                        \
    int l = (level) < 0 ? 0 : (level) < OP_SIMD_LEVELS ? (level) : OP_SIMD_LEVELS - 1; \
    while (l > 0 && !(arr)[l]) l--;                                                \
    return (arr)[l]

const op_kv_kernels *op_kv_kernels_at(int type, int level) {
    const op_kv_traits *t = op_kv_traits_of(type);
    if (!t) return NULL;
    AT_LEVEL(t->kernels, level);
}

static op_kv_quant_fn quantizer_at(const op_kv_traits *t, int level) { AT_LEVEL(t->quantize, level); }

int op_kv_group(int type, int hd) {
    /* GGUF's 32 where it fits; otherwise one group per row, so any head
     * dimension (stories260K has 8) can be quantized. */
    return op_kv_int_query(type) ? group_of(hd) : 1;
}

size_t op_kv_row_bytes(int type, int hd) {
    const op_kv_traits *t = op_kv_traits_of(type);
    if (!t || t->per_block) return 0;
    int g = t->grouped ? group_of(hd) : 1;
    return (size_t)(hd / g) * ((t->grouped ? 2 : 0) + ((size_t)g * t->bits + 7) / 8);
}

size_t op_kv_region_bytes(int type, int hd, int bs) {
    const op_kv_traits *t = op_kv_traits_of(type);
    if (t && t->per_block) return t->region_bytes(hd, bs);
    return (size_t)bs * op_kv_row_bytes(type, hd);
}

void op_kv_quantize_row(int type, const float *x, void *dst, int hd) {
    const op_kv_traits *t = op_kv_traits_of(type);
    op_kv_quant_fn q = t ? quantizer_at(t, op_simd_level()) : NULL;
    if (q) q(x, dst, hd);
}

void op_kv_quantize_row_ref(int type, const float *x, void *dst, int hd) {
    const op_kv_traits *t = op_kv_traits_of(type);
    if (t && t->quantize[OP_SIMD_SCALAR]) t->quantize[OP_SIMD_SCALAR](x, dst, hd);
}

void op_kv_dequantize_row(int type, const void *src, float *y, int hd) {
    const op_kv_traits *t = op_kv_traits_of(type);
    if (t && t->dequantize) t->dequantize(src, y, hd);
}

/* ---- the public names (kvlm.h) ---------------------------------------------------- */
int kvlm_cache_type_from_name(const char *name) { return op_kv_type_by_name(name); }
const char *kvlm_cache_type_name(int type) { return op_kv_type_name(type); }

int kvlm_cache_types(int *ids, int cap) {
    for (int i = 0; ids && i < N_ROWS && i < cap; i++) ids[i] = rows[i].id;
    return N_ROWS;
}

bool kvlm_cache_type_for_values(int type) { return op_kv_type_valid(type, true); }
int kvlm_cache_type_draft(int type) { return op_kv_type_valid(type, false) ? op_kv_draft_type(type) : -1; }

/* q4_kc: asymmetric per channel (scale and min), because key channels carry
 * large per-channel offsets (KIVI's observation) that a symmetric code would
 * spend its range on. Scale and min are rounded to f16 before the codes are
 * chosen, so the codes fit the values the kernels will reconstruct. */
void op_kv_quantize_kc(const uint16_t *rows, void *region, int hd, int bs, int n_tok) {
    uint8_t *r = region;
    int nb = (bs + 1) / 2;
    uint8_t *codes = r + 4 * (size_t)hd;
    memset(codes, 0, (size_t)hd * nb);
    for (int c = 0; c < hd; c++) {
        float lo = INFINITY, hi = -INFINITY;
        for (int t = 0; t < n_tok; t++) {
            float x = dt_f16_to_f32(rows[(size_t)t * hd + c]);
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
        }
        if (n_tok <= 0) lo = hi = 0;
        dt_f16 hm = dt_f32_to_f16(lo), hs = dt_f32_to_f16((hi - lo) / 15.0f);
        float m = dt_f16_to_f32(hm), s = dt_f16_to_f32(hs), is = s > 0 ? 1.0f / s : 0.0f;
        memcpy(r + 2 * (size_t)c, &hs, 2);
        memcpy(r + 2 * ((size_t)hd + c), &hm, 2);
        uint8_t *cc = codes + (size_t)c * nb;
        for (int t = 0; t < n_tok; t++) {
            float x = dt_f16_to_f32(rows[(size_t)t * hd + c]);
            int q = clampi((int)lrintf((x - m) * is), 0, 15);
            cc[t / 2] |= (uint8_t)(q << (4 * (t & 1)));
        }
    }
}

void op_kv_dequantize_kc(const void *region, float *y, int hd, int bs, int t0, int n) {
    const uint8_t *r = region;
    int nb = (bs + 1) / 2;
    const uint8_t *codes = r + 4 * (size_t)hd;
    for (int c = 0; c < hd; c++) {
        dt_f16 hs, hm;
        memcpy(&hs, r + 2 * (size_t)c, 2);
        memcpy(&hm, r + 2 * ((size_t)hd + c), 2);
        float s = dt_f16_to_f32(hs), m = dt_f16_to_f32(hm);
        const uint8_t *cc = codes + (size_t)c * nb;
        for (int i = 0; i < n; i++) {
            int t = t0 + i;
            int q = (cc[t / 2] >> (4 * (t & 1))) & 0xf;
            y[(size_t)i * hd + c] = (float)q * s + m;
        }
    }
}
