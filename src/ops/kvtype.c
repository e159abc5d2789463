/* ops/kvtype: byte layouts, sizes and scalar reference (de)quantizers of the
 * KV cache element types (layouts documented in ops/kvtype.h), and the F16C
 * path of the f16 write. */
#include "ops/kvtype.h"
#include <math.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/ops_internal.h"
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
 * rounding of each element, which random data mispredicts: a decode step's
 * f16 writes took 8% of the server's time. */
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

bool op_kv_type_valid(int type, bool for_values) {
    switch (type) {
    case KVLM_CACHE_F32: case KVLM_CACHE_F16: case KVLM_CACHE_BF16: case KVLM_CACHE_Q8_0: case KVLM_CACHE_Q4_0:
        return true;
    case KVLM_CACHE_Q4_KC: return !for_values;
    default: return false;
    }
}

int op_kv_group(int type, int hd) {
    if (type != KVLM_CACHE_Q8_0 && type != KVLM_CACHE_Q4_0) return 1;
    /* GGUF's 32 where it fits; otherwise one group per row, so any head
     * dimension (stories260K has 8) can be quantized. */
    return hd % 32 == 0 ? 32 : hd;
}

size_t op_kv_row_bytes(int type, int hd) {
    int g = op_kv_group(type, hd);
    switch (type) {
    case KVLM_CACHE_F32: return 4 * (size_t)hd;
    case KVLM_CACHE_F16: case KVLM_CACHE_BF16: return 2 * (size_t)hd;
    case KVLM_CACHE_Q8_0: return (size_t)(hd / g) * (2 + (size_t)g);
    case KVLM_CACHE_Q4_0: return (size_t)(hd / g) * (2 + (size_t)(g + 1) / 2);
    default: return 0;
    }
}

size_t op_kv_region_bytes(int type, int hd, int bs) {
    if (type == KVLM_CACHE_Q4_KC) return (size_t)hd * (4 + (size_t)(bs + 1) / 2);
    return (size_t)bs * op_kv_row_bytes(type, hd);
}

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

void op_kv_quantize_row(int type, const float *x, void *dst, int hd) {
#if defined(__x86_64__) || defined(__i386__)
    if (type == KVLM_CACHE_F16 && op_simd_level() >= OP_SIMD_AVX2 && f16_row_f16c(x, dst, hd)) return;
#endif
    op_kv_quantize_row_ref(type, x, dst, hd);
}

void op_kv_quantize_row_ref(int type, const float *x, void *dst, int hd) {
    uint8_t *b = dst;
    int g = op_kv_group(type, hd);
    switch (type) {
    case KVLM_CACHE_F32: memcpy(dst, x, (size_t)hd * sizeof(float)); break;
    case KVLM_CACHE_F16: for (int i = 0; i < hd; i++) ((dt_f16 *)dst)[i] = dt_f32_to_f16(x[i]); break;
    case KVLM_CACHE_BF16: for (int i = 0; i < hd; i++) ((dt_bf16 *)dst)[i] = dt_f32_to_bf16(x[i]); break;
    case KVLM_CACHE_Q8_0:
        for (int i = 0; i < hd; i += g, b += 2 + g) q8_group(x + i, b, g);
        break;
    case KVLM_CACHE_Q4_0:
        for (int i = 0; i < hd; i += g, b += 2 + (g + 1) / 2) q4_group(x + i, b, g);
        break;
    default: break;
    }
}

void op_kv_dequantize_row(int type, const void *src, float *y, int hd) {
    const uint8_t *b = src;
    int g = op_kv_group(type, hd);
    switch (type) {
    case KVLM_CACHE_F32: memcpy(y, src, (size_t)hd * sizeof(float)); break;
    case KVLM_CACHE_F16:
        for (int i = 0; i < hd; i++) {
            dt_f16 h;
            memcpy(&h, b + 2 * i, 2);
            y[i] = dt_f16_to_f32(h);
        }
        break;
    case KVLM_CACHE_BF16:
        for (int i = 0; i < hd; i++) {
            dt_bf16 h;
            memcpy(&h, b + 2 * i, 2);
            y[i] = dt_bf16_to_f32(h);
        }
        break;
    case KVLM_CACHE_Q8_0:
        for (int i = 0; i < hd; i += g, b += 2 + g) {
            dt_f16 h;
            memcpy(&h, b, 2);
            float d = dt_f16_to_f32(h);
            for (int j = 0; j < g; j++) y[i + j] = (float)(int8_t)b[2 + j] * d;
        }
        break;
    case KVLM_CACHE_Q4_0: {
        int half = (g + 1) / 2;
        for (int i = 0; i < hd; i += g, b += 2 + half) {
            dt_f16 h;
            memcpy(&h, b, 2);
            float d = dt_f16_to_f32(h);
            for (int j = 0; j < half; j++) {
                y[i + j] = (float)((b[2 + j] & 0xf) - 8) * d;
                if (j + half < g) y[i + j + half] = (float)((b[2 + j] >> 4) - 8) * d;
            }
        }
        break;
    }
    default: break;
    }
}

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
