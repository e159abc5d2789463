/* dtype/tq: the ternary types' dequantizer and quantizer (dtype/tq.h). */
#include "dtype/tq.h"
#include <math.h>
#include <stdlib.h>

void dt_tq_dequantize(int type, const void *src, float *dst, int64_t nb) {
    const size_t bs = type == DT_TQ1_0 ? sizeof(block_tq1_0) : sizeof(block_tq2_0);
    uint8_t u[QK_K];
    for (int64_t i = 0; i < nb; i++, dst += QK_K) {
        const uint8_t *b = (const uint8_t *)src + (size_t)i * bs;
        const float d = dt_tq_d(type, b);
        dt_tq_unpack(type, b, u);
        for (int e = 0; e < QK_K; e++) dst[e] = (float)((int)u[e] - 1) * d;
    }
}

static int cmp_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* The d of the least-squares ternary fit of 256 values: setting the k
 * largest magnitudes to ±d (d their mean) leaves sum x² - S_k² / k, S_k the
 * sum of those magnitudes, so the best k maximizes S_k² / k. */
static float ternary_scale(const float *x) {
    float a[QK_K];
    for (int i = 0; i < QK_K; i++) a[i] = fabsf(x[i]);
    qsort(a, QK_K, sizeof a[0], cmp_desc);
    double s = 0, best = 0, d = 0;
    for (int k = 1; k <= QK_K; k++) {
        s += a[k - 1];
        if (s * s / k > best) best = s * s / k, d = s / k;
    }
    return (float)d;
}

/* Base-3 digits c[0..4] (c[0] the most significant) as TQ1_0 stores them:
 * the fraction over 243, scaled to 256 and rounded up. */
static uint8_t tq1_pack(const uint8_t *c, int n) {
    unsigned q = 0;
    for (int k = 0; k < 5; k++) q = 3 * q + (k < n ? c[k] : 0);
    return (uint8_t)((q * 256 + 242) / 243);
}

void dt_tq_quantize(int type, const float *src, void *dst, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, src += QK_K) {
        const dt_f16 dh = dt_f32_to_f16(ternary_scale(src));
        const float d = dt_f16_to_f32(dh);
        uint8_t c[QK_K]; /* the nearest of -d, 0, d */
        for (int e = 0; e < QK_K; e++) c[e] = (uint8_t)(d > 0 && fabsf(src[e]) > 0.5f * d ? (src[e] > 0 ? 2 : 0) : 1);
        if (type == DT_TQ2_0) {
            block_tq2_0 *b = (block_tq2_0 *)dst + i;
            memset(b->qs, 0, sizeof b->qs);
            for (int e = 0; e < QK_K; e++) b->qs[32 * (e / 128) + e % 32] |= (uint8_t)(c[e] << (2 * ((e % 128) / 32)));
            b->d = dh;
            continue;
        }
        block_tq1_0 *b = (block_tq1_0 *)dst + i;
        uint8_t g[5];
        for (int m = 0; m < 32; m++) {
            for (int n = 0; n < 5; n++) g[n] = c[32 * n + m];
            b->qs[m] = tq1_pack(g, 5);
        }
        for (int m = 0; m < 16; m++) {
            for (int n = 0; n < 5; n++) g[n] = c[160 + 16 * n + m];
            b->qs[32 + m] = tq1_pack(g, 5);
        }
        for (int j = 0; j < 4; j++) {
            for (int n = 0; n < 4; n++) g[n] = c[240 + 4 * n + j];
            b->qh[j] = tq1_pack(g, 4);
        }
        b->d = dh;
    }
}
