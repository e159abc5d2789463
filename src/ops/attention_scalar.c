/* ops/attention_scalar: the portable attention kernels (scores, P.V,
 * exponentials, q4_kc scores, the reference dequantizers): the level every
 * CPU has and the one the SIMD kernels are tested against. */
#include <math.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/attention_internal.h"

/* ---- typed caches: rows dequantized with the reference dequantizers ---------- */
void op_att_deq_rows_scalar(int type, const uint8_t *src, float *y, int n_rows, int hd) {
    size_t rb = op_kv_row_bytes(type, hd);
    for (int i = 0; i < n_rows; i++) op_kv_dequantize_row(type, src + (size_t)i * rb, y + (size_t)i * hd, hd);
}

void op_att_f16_to_f32_scalar(const uint16_t *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = dt_f16_to_f32(x[i]);
}

/* ---- the row kernels: scores of a key block, and P.V accumulation ---------- */
/* s[j] = scale * q . k_j for j < nk (keys hd floats apart) */
static void scores_scalar(float *s, const float *q, const float *k, int nk, int hd, float scale) {
    for (int j = 0; j < nk; j++) {
        const float *kj = k + (size_t)j * hd;
        float d = 0;
        for (int i = 0; i < hd; i++) d += q[i] * kj[i];
        s[j] = d * scale;
    }
}

/* o[i] += sum_j p[j] * v_j[i] */
static void pv_scalar(float *o, const float *p, const float *v, int nk, int hd) {
    for (int j = 0; j < nk; j++) {
        const float *vj = v + (size_t)j * hd;
        float pj = p[j];
        if (pj == 0.0f) continue;
        for (int i = 0; i < hd; i++) o[i] += pj * vj[i];
    }
}

/* exp(s[j] - m) for j < n, returns the sum; s[j] = -inf gives 0 */
static float exp_sum_scalar(float *s, int n, float m) {
    float sum = 0;
    for (int j = 0; j < n; j++) sum += (s[j] = expf(s[j] - m));
    return sum;
}

/* q4_kc keys, scored from their codes without dequantizing: key t's channel
 * c is code_{c,t} * s_c + m_c, so
 *   q . k_t = sum_c (q_c s_c) code_{c,t} + sum_c q_c m_c,
 * the channel scales folded into the query (qs, hd floats of scratch) and the
 * mins into one bias, once per (region, query row). s[i] = scale * q . k_t for
 * the n tokens t = t0 + i of the region. */
static void kc_scores_scalar(float *s, const float *q, const uint8_t *region, int hd, int bs, int t0, int n,
                             float scale, float *qs) {
    const size_t nb = (size_t)(bs + 1) / 2;
    const uint8_t *codes = region + 4 * (size_t)hd;
    float bias = 0;
    for (int c = 0; c < hd; c++) {
        dt_f16 hs, hm;
        memcpy(&hs, region + 2 * (size_t)c, 2);
        memcpy(&hm, region + 2 * ((size_t)hd + c), 2);
        qs[c] = q[c] * dt_f16_to_f32(hs);
        bias += q[c] * dt_f16_to_f32(hm);
    }
    for (int i = 0; i < n; i++) {
        int t = t0 + i, sh = 4 * (t & 1);
        const uint8_t *cc = codes + t / 2;
        float acc = 0;
        for (int c = 0; c < hd; c++) acc += qs[c] * (float)((cc[(size_t)c * nb] >> sh) & 0xf);
        s[i] = (acc + bias) * scale;
    }
}

const op_att_kernels op_att_kernels_scalar = {
    .scores = scores_scalar,
    .pv = pv_scalar,
    .exp_sum = exp_sum_scalar,
    .kc_scores = kc_scores_scalar,
    .deq_rows = op_att_deq_rows_scalar,
    .f16_to_f32 = op_att_f16_to_f32_scalar,
};
