/* ops/attention: causal attention of a sequence's query tokens over its
 * cached keys/values. The reference materialises each score row; the fast
 * kernel is FlashAttention-style: work items of (KV head, query heads sharing
 * it, query tile), keys streamed in blocks with an online softmax (running max
 * and sum), memory linear in T, scratch per thread from `work`. When those
 * items are too few to occupy the threads (decoding with few KV heads at long
 * context), the keys are split into parts too (flash-decoding): each part
 * leaves a partial (max, sum, unnormalised output) that a log-sum-exp merge
 * combines. Typed caches: decode items (a few rows) read each key/value row
 * straight from its block with fused kernels; prefill items dequantize a tile
 * once for all their rows. On AVX512-VNNI CPUs f32, f16, bf16 and q8_0 keys
 * and values (any mix) run one 512-bit tile kernel, 16 keys at a time, for
 * decode and (but for q8_0 keys) prefill alike. H2O's per-key weights come
 * from the same scores, kept per row and normalised after the merge. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "model/dtype.h"
#include "ops/kvtype.h"
#include "ops/ops_internal.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* outside the target regions: each intrinsic keeps its own target */
#endif

/* Rows (query token x query head) per work item, and keys per block. */
#define ATT_RMAX 64
#define ATT_BK 64
/* Items of at most this many rows (decode) read typed caches with the fused
 * kernels; larger ones (prefill) dequantize a tile once for all their rows. */
#define ATT_FUSED_ROWS 8
/* Flash-decoding: with fewer items than this (a few KV heads decoding; twice
 * the threads of a 16-thread pool) the keys are split into parts too, aiming
 * at ATT_TARGET_TASKS tasks of at least ATT_MIN_CHUNK keys, with at most
 * ATT_PART_ROWS rows of partial results in all (the scratch holds that many).
 * The split depends on the shape alone, never on the thread count, so results
 * are the same bits on any pool. */
#define ATT_SPLIT_ITEMS 32
#define ATT_TARGET_TASKS 64
#define ATT_MIN_CHUNK 512
#define ATT_PART_ROWS 1024

/* Key (value) of KV head h at position p of an f32 cache, in either layout;
 * keys of one block (or of the whole contiguous cache) are head_dim floats
 * apart. */
static inline const float *key_at(const op_attn_args *a, int h, int p) {
    if (a->blocks && a->head_bytes)
        return (const float *)((const uint8_t *)a->blocks[p / a->block_size] + (size_t)h * a->head_bytes +
                               (size_t)(p % a->block_size) * a->head_dim * sizeof(float));
    if (a->blocks)
        return a->blocks[p / a->block_size] + (size_t)h * a->head_stride + (size_t)(p % a->block_size) * a->head_dim;
    return a->k + (size_t)h * a->kv_head_stride + (size_t)p * a->head_dim;
}
static inline const float *value_at(const op_attn_args *a, int h, int p) {
    if (a->blocks && a->head_bytes) return (const float *)((const uint8_t *)key_at(a, h, p) + a->v_bytes);
    if (a->blocks) return key_at(a, h, p) + a->v_offset;
    return a->v + (size_t)h * a->kv_head_stride + (size_t)p * a->head_dim;
}
/* How many positions from p on are contiguous in memory. */
static inline int run_from(const op_attn_args *a, int p, int n) {
    if (!a->blocks) return n;
    int left = a->block_size - p % a->block_size;
    return left < n ? left : n;
}
/* Whether keys or values need dequantizing (only the paged layout is typed). */
static inline bool is_typed(const op_attn_args *a) {
    return a->blocks && a->head_bytes && (a->k_type != KVLM_CACHE_F32 || a->v_type != KVLM_CACHE_F32);
}

/* ---- typed caches: tiles of dequantized rows ---------------------------------- */
typedef void (*deq_rows_fn)(int type, const uint8_t *src, float *y, int n_rows, int hd);
typedef void (*deq_f16_fn)(const uint16_t *x, float *y, size_t n);

static void deq_rows_scalar(int type, const uint8_t *src, float *y, int n_rows, int hd) {
    size_t rb = op_kv_row_bytes(type, hd);
    for (int i = 0; i < n_rows; i++) op_kv_dequantize_row(type, src + (size_t)i * rb, y + (size_t)i * hd, hd);
}

static void f16_to_f32_scalar(const uint16_t *x, float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = dt_f16_to_f32(x[i]);
}

/* Keys (is_key) or values of KV head h, positions p0..p0+n-1, into n rows of
 * head_dim floats at y: the same floats the reference dequantizers give. */
static void load_tile(const op_attn_args *a, bool is_key, int h, int p0, int n, float *y, deq_rows_fn deq,
                      deq_f16_fn f16) {
    const int hd = a->head_dim, bs = a->block_size, type = is_key ? a->k_type : a->v_type;
    for (int x = 0, len; x < n; x += len) {
        int p = p0 + x, b = p / bs, slot = p % bs;
        len = run_from(a, p, n - x);
        const uint8_t *region = (const uint8_t *)a->blocks[b] + (size_t)h * a->head_bytes + (is_key ? 0 : a->v_bytes);
        float *dst = y + (size_t)x * hd;
        if (type != KVLM_CACHE_Q4_KC) deq(type, region + (size_t)slot * op_kv_row_bytes(type, hd), dst, len, hd);
        else if (b == a->stage_block)
            f16(a->k_stage + ((size_t)h * bs + slot) * hd, dst, (size_t)len * hd);
        else op_kv_dequantize_kc(region, dst, hd, bs, slot, len);
    }
}

/* ---- the query seen by q8_0 / q4_0 keys ---------------------------------------- */
/* Keys of these types meet the query rounded to int8 per group of the keys'
 * own group size g (as llama.cpp's vec_dot rounds it to q8_0, but with an f32
 * scale): the fast kernels then score a key with integer dot products. Every
 * path (reference, tile, fused) uses these codes, so they agree to float
 * rounding. */
static bool int_keys(int k_type) { return k_type == KVLM_CACHE_Q8_0 || k_type == KVLM_CACHE_Q4_0; }

/* codes c (NULL: none) and scales d of a row; y (NULL: none) gets the floats
 * the codes stand for (y may equal x) */
static void quantize_query(const float *x, int8_t *c, float *d, float *y, int hd, int g) {
    for (int i = 0; i < hd; i += g) {
        float amax = 0;
        for (int j = 0; j < g; j++) amax = fmaxf(amax, fabsf(x[i + j]));
        float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        d[i / g] = dd;
        for (int j = 0; j < g; j++) {
            long v = lrintf(x[i + j] * id);
            int8_t cj = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
            if (c) c[i + j] = cj;
            if (y) y[i + j] = (float)cj * dd;
        }
    }
}

static void round_query(const float *x, float *y, int hd, int g) {
    for (int i = 0; i < hd; i += g) {
        float d;
        quantize_query(x + i, NULL, &d, y + i, g, g);
    }
}

/* H2O (key_weights != NULL), the reference: adds to key_weights[p] each
 * visible key's softmax probability summed over the queries and query heads:
 * per KV head, the score rows of its queries (one key row dequantized at a
 * time; q8_0 / q4_0 keys see the query rounded as the kernels do), then
 * softmax. The output of the attention itself is untouched. */
static void accumulate_key_weights(const op_attn_args *a, const float *q) {
    int hd = a->head_dim, G = a->n_heads / a->n_kv_heads, R = a->T * G, n_max = a->q_pos0 + a->T;
    float *sc = malloc((size_t)R * n_max * sizeof(float)), *row = malloc((size_t)hd * sizeof(float));
    size_t nq = (size_t)a->T * a->n_heads * hd;
    float *qr = is_typed(a) && int_keys(a->k_type) ? malloc(nq * sizeof(float)) : NULL;
    if (!sc || !row || (!qr && is_typed(a) && int_keys(a->k_type))) goto done;
    if (qr) {
        for (size_t i = 0; i < nq; i += hd) round_query(q + i, qr + i, hd, op_kv_group(a->k_type, hd));
        q = qr;
    }
    for (int h = 0; h < a->n_kv_heads; h++) {
        for (int p = 0; p < n_max; p++) {
            const float *k = row;
            if (is_typed(a)) load_tile(a, true, h, p, 1, row, deq_rows_scalar, f16_to_f32_scalar);
            else k = key_at(a, h, p);
            for (int t = p > a->q_pos0 ? p - a->q_pos0 : 0; t < a->T; t++)
                for (int g = 0; g < G; g++) {
                    const float *qr = q + ((size_t)t * a->n_heads + (size_t)h * G + g) * hd;
                    float d = 0;
                    for (int i = 0; i < hd; i++) d += qr[i] * k[i];
                    sc[(size_t)(t * G + g) * n_max + p] = d * a->scale;
                }
        }
        for (int r = 0; r < R; r++) {
            float *s = sc + (size_t)r * n_max, mx = -INFINITY;
            int n = a->q_pos0 + r / G + 1; /* visible keys */
            double sum = 0;
            for (int p = 0; p < n; p++) mx = s[p] > mx ? s[p] : mx;
            for (int p = 0; p < n; p++) sum += (s[p] = expf(s[p] - mx));
            for (int p = 0; p < n; p++) a->key_weights[p] += (float)(s[p] / sum);
        }
    }
done:
    free(sc);
    free(row);
    free(qr);
}

/* ---- reference ---------------------------------------------------------------- */
static void attention_ref_f32(float *out, const float *q, const op_attn_args *a) {
    int hd = a->head_dim, G = a->n_heads / a->n_kv_heads;
    int n_max = a->q_pos0 + a->T;
    double *s = malloc((size_t)n_max * sizeof(double));
    double *o = malloc((size_t)hd * sizeof(double));
    if (!s || !o) { free(s); free(o); return; }
    for (int t = 0; t < a->T; t++) {
        int n = a->q_pos0 + t + 1; /* visible keys */
        for (int hq = 0; hq < a->n_heads; hq++) {
            const float *qr = q + ((size_t)t * a->n_heads + hq) * hd;
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p < n; p++) {
                const float *kp = key_at(a, hq / G, p);
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)qr[i] * kp[i];
                s[p] = d * a->scale;
                if (s[p] > mx) mx = s[p];
            }
            for (int p = 0; p < n; p++) sum += (s[p] = exp(s[p] - mx));
            for (int i = 0; i < hd; i++) o[i] = 0;
            for (int p = 0; p < n; p++) {
                const float *vp = value_at(a, hq / G, p);
                for (int i = 0; i < hd; i++) o[i] += s[p] * vp[i];
            }
            float *dst = out + ((size_t)t * a->n_heads + hq) * hd;
            for (int i = 0; i < hd; i++) dst[i] = (float)(o[i] / sum);
        }
    }
    free(s);
    free(o);
}

/* Typed caches: dequantize every visible key and value with the reference
 * dequantizers into a contiguous f32 cache, then the f32 reference. */
void op_attention_ref(float *out, const float *q, const op_attn_args *a) {
    if (a->key_weights) accumulate_key_weights(a, q);
    if (!is_typed(a)) { attention_ref_f32(out, q, a); return; }
    int n_max = a->q_pos0 + a->T, hd = a->head_dim;
    size_t stride = (size_t)n_max * hd;
    float *k = malloc(stride * a->n_kv_heads * sizeof(float)), *v = malloc(stride * a->n_kv_heads * sizeof(float));
    size_t nq = (size_t)a->T * a->n_heads * hd;
    float *qr = int_keys(a->k_type) ? malloc(nq * sizeof(float)) : NULL;
    if (qr) {
        for (size_t i = 0; i < nq; i += hd) round_query(q + i, qr + i, hd, op_kv_group(a->k_type, hd));
        q = qr;
    }
    if (k && v && (qr || !int_keys(a->k_type))) {
        for (int h = 0; h < a->n_kv_heads; h++) {
            load_tile(a, true, h, 0, n_max, k + (size_t)h * stride, deq_rows_scalar, f16_to_f32_scalar);
            load_tile(a, false, h, 0, n_max, v + (size_t)h * stride, deq_rows_scalar, f16_to_f32_scalar);
        }
        op_attn_args c = *a;
        c.blocks = NULL;
        c.k = k;
        c.v = v;
        c.kv_head_stride = stride;
        attention_ref_f32(out, q, &c);
    }
    free(qr);
    free(k);
    free(v);
}

/* ---- tiling plan ------------------------------------------------------------------ */
typedef struct {
    int G;         /* query heads per KV head */
    int hc, n_hc;  /* query heads per item, chunks of the group */
    int tq, n_tt;  /* query tokens per item, tiles */
    int rows;      /* the most rows of an item: tq * hc */
    int n_items, n_split;
} att_plan;

static att_plan make_plan(const op_attn_args *a) {
    att_plan p;
    p.G = a->n_heads / a->n_kv_heads;
    p.hc = p.G < ATT_RMAX ? p.G : ATT_RMAX;
    p.n_hc = (p.G + p.hc - 1) / p.hc;
    p.tq = ATT_RMAX / p.hc;
    if (p.tq > a->T) p.tq = a->T;
    p.n_tt = (a->T + p.tq - 1) / p.tq;
    p.rows = p.tq * p.hc;
    p.n_items = a->n_kv_heads * p.n_hc * p.n_tt;
    p.n_split = 1;
    if (p.n_items < ATT_SPLIT_ITEMS) {
        int s = (ATT_TARGET_TASKS + p.n_items - 1) / p.n_items;
        int by_len = (a->q_pos0 + a->T) / ATT_MIN_CHUNK;
        int by_mem = ATT_PART_ROWS / (p.n_items * p.rows);
        if (s > by_len) s = by_len;
        if (s > by_mem) s = by_mem;
        p.n_split = s > 1 ? s : 1;
    }
    return p;
}

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

/* scores, outputs, max and sum per row, then the K and V tiles of typed caches,
 * the q4_kc folded query, and the query rows as q8_0 / q4_0 keys see them */
static size_t per_thread_bytes(int hd) {
    return round64(sizeof(float) * ATT_RMAX * ATT_BK) + round64(sizeof(float) * ATT_RMAX * (size_t)hd) +
           2 * round64(sizeof(float) * ATT_RMAX) + 2 * round64(sizeof(float) * ATT_BK * (size_t)hd) +
           round64(sizeof(float) * (size_t)hd) + round64(sizeof(float) * ATT_RMAX * (size_t)hd);
}

/* A task's partial result: max and sum of each of its rows, then the rows'
 * unnormalised outputs. */
static size_t part_floats(const att_plan *p, int hd) { return (size_t)p->rows * (size_t)(hd + 2); }

size_t op_attention_work_size(int n_threads, int head_dim) {
    if (n_threads < 1) n_threads = 1;
    return (size_t)n_threads * per_thread_bytes(head_dim) +
           round64(sizeof(float) * ATT_PART_ROWS * (size_t)(head_dim + 2)) + 64;
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

#if defined(__x86_64__) || defined(__i386__)
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
        for (size_t i = 0; i < kn; i += 64) __builtin_prefetch(k + i);
        for (size_t i = 0; i < len * vrb; i += 64) __builtin_prefetch(v + i);
    }
}

/* ---- VNNI decode kernels for q8_0 keys and values (AVX512 F/BW/VL/VNNI) -----
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

/* q . k_j (unscaled) of m <= 16 q8_0 key rows rb bytes apart and the int8
 * query qc with group scales qd, key j in lane j (0 in lanes >= m). Per key
 * and pair of groups, vpdpbusd of the codes + 128 (unsigned) with the query,
 * from lanes preset to -128 * (the query's sums), leaves 16 lanes whose
 * halves sum to the two groups' exact integer dot products; the 16 keys'
 * registers reduce together (unpack and add, then 128-bit shuffles) to one
 * register per group with a key per lane, which the group scales multiply.
 * A key's score does not depend on its lane. */
static inline __attribute__((always_inline)) __m512 vnni_qk16(const int8_t *qc, const float *qd, const uint8_t *rows,
                                                              size_t rb, int m, int hd) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int P = 0; P < hd / 64; P++) {
        const uint8_t *g = rows + (size_t)P * 68;
        __m512i q = _mm512_loadu_si512(qc + 64 * P);
        __m512i bias = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, q));
        __m512i v[16];
#pragma GCC unroll 16
        for (int x = 0; x < 16; x++) {
            if (x >= m) { v[x] = _mm512_setzero_si512(); continue; }
            const uint8_t *r = g + (size_t)x * rb;
            __m512i kc = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r + 2))),
                                            _mm256_loadu_si256((const __m256i *)(r + 36)), 1);
            v[x] = _mm512_dpbusd_epi32(bias, _mm512_xor_si512(kc, flip), q);
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
         * (lanes 0, 1: the first group, 2, 3: the second) */
        __m512i z0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xdd));
        __m512i z1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88), _mm512_shuffle_i32x4(u[2], u[3], 0xdd));
        __m512 ia = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(z0, z1, 0x88));
        __m512 ib = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(z0, z1, 0xdd));
        acc = _mm512_fmadd_ps(ia, _mm512_mul_ps(vnni_scales(g, 0, rb, m), _mm512_set1_ps(qd[2 * P])), acc);
        acc = _mm512_fmadd_ps(ib, _mm512_mul_ps(vnni_scales(g, 34, rb, m), _mm512_set1_ps(qd[2 * P + 1])), acc);
    }
    return acc;
}

/* s[j] = scale * q . k_j for n q8_0 key rows rb bytes apart */
static void vnni_qkey_scores(float *s, const int8_t *qc, const float *qd, const uint8_t *k, size_t rb, int n, int hd,
                             float scale) {
    for (int c = 0; c < n; c += 16) {
        int m = n - c < 16 ? n - c : 16;
        __m512 d = vnni_qk16(qc, qd, k + (size_t)c * rb, rb, m, hd);
        _mm512_mask_storeu_ps(s + c, (__mmask16)((1u << m) - 1), _mm512_mul_ps(d, _mm512_set1_ps(scale)));
    }
}

/* o[i] += sum_j p_j v_j[i], i < 64, for m <= 16 q8_0 value rows rb bytes
 * apart (rows: a pair of groups; p_j in lane j, 0 in lanes >= m): the keys'
 * p times their group scales in one multiply, then per key and 16 elements a
 * widening load, a conversion and an FMA into accumulators that stay in
 * registers. The probabilities stay f32: rounding them to integers per tile
 * (for vpdpbusd / vpdpwssd) would cost more accuracy than the tests allow
 * for the few cycles it saves. */
static inline __attribute__((always_inline)) void vnni_pv16(float *o, __m512 p, const uint8_t *rows, size_t rb, int m) {
    __m512 a0 = _mm512_loadu_ps(o), a1 = _mm512_loadu_ps(o + 16), a2 = _mm512_loadu_ps(o + 32),
           a3 = _mm512_loadu_ps(o + 48);
    float c0[16], c1[16];
    _mm512_storeu_ps(c0, _mm512_mul_ps(p, vnni_scales(rows, 0, rb, m)));
    _mm512_storeu_ps(c1, _mm512_mul_ps(p, vnni_scales(rows, 34, rb, m)));
    /* odd keys in a second set of accumulators: half the FMA chain */
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
#define VNNI_WIDEN(r_, o_) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((r_) + (o_)))))
    int x = 0;
    for (; x + 2 <= m; x += 2) {
        const uint8_t *r = rows + (size_t)x * rb, *r2 = r + rb;
        __m512 w0 = _mm512_set1_ps(c0[x]), w1 = _mm512_set1_ps(c1[x]);
        a0 = _mm512_fmadd_ps(w0, VNNI_WIDEN(r, 2), a0);
        a1 = _mm512_fmadd_ps(w0, VNNI_WIDEN(r, 18), a1);
        a2 = _mm512_fmadd_ps(w1, VNNI_WIDEN(r, 36), a2);
        a3 = _mm512_fmadd_ps(w1, VNNI_WIDEN(r, 52), a3);
        w0 = _mm512_set1_ps(c0[x + 1]);
        w1 = _mm512_set1_ps(c1[x + 1]);
        b0 = _mm512_fmadd_ps(w0, VNNI_WIDEN(r2, 2), b0);
        b1 = _mm512_fmadd_ps(w0, VNNI_WIDEN(r2, 18), b1);
        b2 = _mm512_fmadd_ps(w1, VNNI_WIDEN(r2, 36), b2);
        b3 = _mm512_fmadd_ps(w1, VNNI_WIDEN(r2, 52), b3);
    }
    if (x < m) {
        const uint8_t *r = rows + (size_t)x * rb;
        __m512 w0 = _mm512_set1_ps(c0[x]), w1 = _mm512_set1_ps(c1[x]);
        a0 = _mm512_fmadd_ps(w0, VNNI_WIDEN(r, 2), a0);
        a1 = _mm512_fmadd_ps(w0, VNNI_WIDEN(r, 18), a1);
        a2 = _mm512_fmadd_ps(w1, VNNI_WIDEN(r, 36), a2);
        a3 = _mm512_fmadd_ps(w1, VNNI_WIDEN(r, 52), a3);
    }
    _mm512_storeu_ps(o, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(o + 16, _mm512_add_ps(a1, b1));
    _mm512_storeu_ps(o + 32, _mm512_add_ps(a2, b2));
    _mm512_storeu_ps(o + 48, _mm512_add_ps(a3, b3));
}

/* vnni_pv16 for two rows (oa, pa) and (ob, pb) sharing the values: each
 * code widened and converted once for both */
static inline __attribute__((always_inline)) void vnni_pv16x2(float *oa, float *ob, __m512 pa, __m512 pb,
                                                              const uint8_t *rows, size_t rb, int m) {
    __m512 a0 = _mm512_loadu_ps(oa), a1 = _mm512_loadu_ps(oa + 16), a2 = _mm512_loadu_ps(oa + 32),
           a3 = _mm512_loadu_ps(oa + 48);
    __m512 b0 = _mm512_loadu_ps(ob), b1 = _mm512_loadu_ps(ob + 16), b2 = _mm512_loadu_ps(ob + 32),
           b3 = _mm512_loadu_ps(ob + 48);
    float ca0[16], ca1[16], cb0[16], cb1[16];
    __m512 d0 = vnni_scales(rows, 0, rb, m), d1 = vnni_scales(rows, 34, rb, m);
    _mm512_storeu_ps(ca0, _mm512_mul_ps(pa, d0));
    _mm512_storeu_ps(ca1, _mm512_mul_ps(pa, d1));
    _mm512_storeu_ps(cb0, _mm512_mul_ps(pb, d0));
    _mm512_storeu_ps(cb1, _mm512_mul_ps(pb, d1));
    for (int x = 0; x < m; x++) {
        const uint8_t *r = rows + (size_t)x * rb;
        __m512 f0 = VNNI_WIDEN(r, 2), f1 = VNNI_WIDEN(r, 18), f2 = VNNI_WIDEN(r, 36), f3 = VNNI_WIDEN(r, 52);
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
#undef VNNI_WIDEN

/* o[i] += sum_j p[j] * v_j[i] for n q8_0 value rows rb bytes apart */
static void vnni_qval_pv(float *o, const float *p, const uint8_t *v, size_t rb, int n, int hd) {
    for (int c = 0; c < n; c += 16) {
        int m = n - c < 16 ? n - c : 16;
        __m512 pv = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), p + c);
        for (int i = 0; i < hd; i += 64) vnni_pv16(o + i, pv, v + (size_t)c * rb + (size_t)i / 32 * 34, rb, m);
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

/* Prefetches the K and V rows of keys lo..hi-1 (of n) at kp[], vp[]. */
static inline __attribute__((always_inline)) void pf_rows(const uint8_t *const *kp, const uint8_t *const *vp, int n,
                                                          int lo, int hi, size_t krb, size_t vrb) {
    for (int x = lo; x < hi && x < n; x++) {
        for (uintptr_t q = (uintptr_t)kp[x] & ~(uintptr_t)63; q < (uintptr_t)kp[x] + krb; q += 64)
            __builtin_prefetch((const void *)q);
        for (uintptr_t q = (uintptr_t)vp[x] & ~(uintptr_t)63; q < (uintptr_t)vp[x] + vrb; q += 64)
            __builtin_prefetch((const void *)q);
    }
}

/* sa[j] = scale * qa . k_j for the n keys at kp[] (hd % 16 == 0), and with
 * `two` sb[j] for qb too, each key loaded and converted once for both. Per
 * key one head-dim-wide FMA chain, then vf_sum16 reduces 16 keys (one row)
 * or 8 keys of each row at once. kpn[] (nn keys): the next tile's rows,
 * prefetched chunk by chunk, ATT_BK keys ahead. */
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
 * never on how the cache splits it into blocks. */
static inline __attribute__((always_inline)) void vf_pv(float *oa, float *ob, const float *pa, const float *pb,
                                                        const uint8_t *const *vp, int n, int hd, int type, bool two) {
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
                      int hd, int type, bool two) {
#define VF_P(t, tw, h) vf_pv(oa, ob, pa, pb, vp, n, h, t, tw)
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
 * and q8_0 (hd % 64 == 0), keys and values chosen separately; an untyped
 * layout is f32. */
static int tile_type(const op_attn_args *a, bool key) {
    return a->blocks && a->head_bytes ? (key ? a->k_type : a->v_type) : KVLM_CACHE_F32;
}
static bool vnni_tile_ok(const op_attn_args *a) {
    for (int i = 0; i < 2; i++) {
        int t = tile_type(a, i == 0);
        bool flt = t == KVLM_CACHE_F32 || t == KVLM_CACHE_F16 || t == KVLM_CACHE_BF16;
        if (t == KVLM_CACHE_Q8_0 ? a->head_dim % 64 : !flt || a->head_dim % 16) return false;
    }
    return true;
}

/* The AVX512 tile, for the types vnni_tile_ok takes: keys kb..kb+n-1 (a
 * tile of up to ATT_BK) and the R rows of an item (decode, or prefill unless
 * the keys are q8_0). The scores of the whole tile first (f32 / f16 / bf16
 * keys: vf_scores, rows two at a time; q8_0 keys: vnni_qk16 run by run),
 * then the online softmax in 512-bit registers, then P.V (vf_pv, rows two at
 * a time; q8_0: vnni_pv16). k_end bounds the prefetch of the next tile. qr:
 * the rows' queries; qc, qd: as int8 for q8_0 keys; other arguments as
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
    /* the next tile's rows, prefetched while this one is scored where a
     * cache block holds less than a 4 KiB page of a head's keys: the hardware
     * prefetcher follows a page, not the jump to the next scattered block
     * (f32 at head dim 64 fills pages, and extra prefetches only slow it) */
    int nn = k_end - kb - n < ATT_BK ? k_end - kb - n : ATT_BK;
    if (!a->blocks || (size_t)bs * krb >= 4096) nn = 0;
    row_ptrs(a, h, kb, n, krb, vrb, kp, vp);
    if (nn > 0) row_ptrs(a, h, kb + n, nn, krb, vrb, kpn, vpn);
    if (kt == KVLM_CACHE_Q8_0) {
        for (int x = 0, len, b = kb / bs, slot = kb % bs; x < n; x += len, b++, slot = 0) {
            len = bs - slot < n - x ? bs - slot : n - x;
            if (nn > 0) pf_rows(kpn, vpn, nn, x, x + len, krb, vrb);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < len && x + c < vr[r]; c += 16) {
                    int m = vr[r] - x - c < 16 ? vr[r] - x - c : 16;
                    m = len - c < m ? len - c : m;
                    __m512 d = vnni_qk16(qc + (size_t)r * hd, qd + (size_t)r * nq, kp[x + c], krb, m, hd);
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
            vf_scores_any(s, s + ATT_BK, qr[r], two ? qr[r + 1] : NULL, kp, nv, hd, kt, two, vscale, pk, vpn, nn,
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
        if (vt == KVLM_CACHE_Q8_0) {
            for (int x = 0, len, slot = kb % bs; x < nv; x += len, slot = 0) {
                len = bs - slot < nv - x ? bs - slot : nv - x;
                for (int c = 0; c < len; c += 16) {
                    int m = len - c < 16 ? len - c : 16;
                    __mmask16 mk = (__mmask16)((1u << m) - 1);
                    __m512 p0 = _mm512_maskz_loadu_ps(mk, pa + x + c);
                    for (int i = 0; i < hd; i += 64) {
                        const uint8_t *vi = vp[x + c] + (size_t)i / 32 * 34;
                        if (two)
                            vnni_pv16x2(oa + i, ob + i, p0, _mm512_maskz_loadu_ps(mk, pb + x + c), vi, vrb, m);
                        else vnni_pv16(oa + i, p0, vi, vrb, m);
                    }
                }
            }
        } else vf_pv_any(oa, ob, pa, pb, vp, nv, hd, vt, two);
    }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define HAVE_VNNI_PATHS 1
#endif

#if defined(__x86_64__) || defined(__i386__)
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
        deq_rows_scalar(type, src, y, n_rows, hd);
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
#ifdef HAVE_VNNI_PATHS
            if (vk) {
                int p = kb + x;
                const uint8_t *row = (const uint8_t *)a->blocks[p / a->block_size] + (size_t)h * a->head_bytes +
                                     (size_t)(p % a->block_size) * krb;
                for (int y = r; y < R && y < r + 2; y++)
                    vnni_qkey_scores(s + (size_t)(y - r) * ATT_BK, qc + (size_t)y * hd, qd + (size_t)y * nq, row, krb,
                                     len, hd, a->scale);
                continue;
            }
#endif
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
#ifdef HAVE_VNNI_PATHS
        if (vv) {
            int p = kb + x;
            const uint8_t *row = (const uint8_t *)a->blocks[p / a->block_size] + (size_t)h * a->head_bytes +
                                 a->v_bytes + (size_t)(p % a->block_size) * vrb;
            for (; r < R; r++) vnni_qval_pv(O + (size_t)r * hd, S + (size_t)r * ATT_BK + x, row, vrb, len, hd);
        }
#endif
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
#define HAVE_AVX2_PATHS 1
#endif


/* ---- one work item: rows x a key range, online softmax ---------------------- */
typedef struct {
    const op_attn_args *a;
    const float *q;
    float *out;
    att_plan p;
    uint8_t *scratch;
    size_t per_thread;
    float *parts;
    /* H2O (W != NULL): raw scores of row (t, query head) at W + row * wn,
     * its final max and sum at WM[row], WL[row] */
    float *W, *WM, *WL;
    size_t wn;
    int level, simd; /* op_simd_level(), and whether it is AVX2 or better */
    int n_tasks;
    atomic_int next;
} att_job;

/* the row of query token t, query head h * G + g in q's layout */
static inline int row_of(const op_attn_args *a, const att_plan *p, int t, int h, int g) {
    return t * a->n_heads + h * p->G + g;
}

static bool args_ok(const op_attn_args *a) {
    return a->T > 0 && a->n_heads > 0 && a->n_kv_heads > 0 && a->head_dim > 0 && a->n_heads % a->n_kv_heads == 0 &&
           (!a->blocks || a->block_size > 0);
}

/* The kernel of an item of R rows at a SIMD level. */
static int pick_kernel(const op_attn_args *a, int R, int level) {
#ifdef HAVE_VNNI_PATHS
    /* f32 / f16 / bf16 / q8_0 keys and values on AVX512 CPUs: one kernel per
     * key tile, any layout, decode and (but for q8_0 keys) prefill alike, so
     * the two give the same bits */
    if (level >= OP_SIMD_VNNI && vnni_tile_ok(a) && (R <= ATT_FUSED_ROWS || !int_keys(tile_type(a, true))))
        return OP_ATT_VNNI_TILE;
#endif
#ifdef HAVE_AVX2_PATHS
    if (level >= OP_SIMD_AVX2)
        return is_typed(a) && R <= ATT_FUSED_ROWS && fused_ok(a) ? OP_ATT_AVX2_FUSED : OP_ATT_AVX2_TILE;
#endif
    (void)a; (void)R; (void)level;
    return OP_ATT_SCALAR;
}

int op_attention_kernel(const op_attn_args *a) {
    if (!args_ok(a)) return -1;
    return pick_kernel(a, make_plan(a).rows, op_simd_level());
}

static void run_task(const att_job *j, int task, uint8_t *scr) {
    const op_attn_args *a = j->a;
    const att_plan *p = &j->p;
    const int hd = a->head_dim;
    /* (no division by 1: decode runs many small tasks) */
    int item = p->n_split > 1 ? task / p->n_split : task, split = p->n_split > 1 ? task % p->n_split : 0;
    /* the last query tiles see the most keys: hand them out first */
    int tt = p->n_tt > 1 ? p->n_tt - 1 - item % p->n_tt : 0;
    int rest = p->n_tt > 1 ? item / p->n_tt : item;
    int hci = p->n_hc > 1 ? rest % p->n_hc : 0, h = p->n_hc > 1 ? rest / p->n_hc : rest;
    int t0 = tt * p->tq, t1 = t0 + p->tq < a->T ? t0 + p->tq : a->T;
    int g0 = hci * p->hc, g1 = g0 + p->hc < p->G ? g0 + p->hc : p->G;
    int nt = t1 - t0, ng = g1 - g0, R = nt * ng;

    float *S = (float *)scr;
    float *O = (float *)(scr + round64(sizeof(float) * ATT_RMAX * ATT_BK));
    float *M = (float *)((uint8_t *)O + round64(sizeof(float) * ATT_RMAX * (size_t)hd));
    float *L = (float *)((uint8_t *)M + round64(sizeof(float) * ATT_RMAX));

    int n_keys = a->q_pos0 + t1;
    int k0 = 0, k1 = n_keys;
    if (p->n_split > 1) {
        int per = (n_keys + p->n_split - 1) / p->n_split;
        per = (per + ATT_BK - 1) / ATT_BK * ATT_BK;
        k0 = split * per < n_keys ? split * per : n_keys;
        k1 = k0 + per < n_keys ? k0 + per : n_keys;
    }
    for (int r = 0; r < R; r++) { M[r] = -INFINITY; L[r] = 0; }
    memset(O, 0, sizeof(float) * (size_t)R * hd);

    const bool typed = is_typed(a);
    float *Kt = (float *)((uint8_t *)L + round64(sizeof(float) * ATT_RMAX));
    float *Vt = (float *)((uint8_t *)Kt + round64(sizeof(float) * ATT_BK * (size_t)hd));
    float *QS = (float *)((uint8_t *)Vt + round64(sizeof(float) * ATT_BK * (size_t)hd));
    const bool kc = typed && a->k_type == KVLM_CACHE_Q4_KC;
    deq_rows_fn deq = deq_rows_scalar;
    deq_f16_fn f16 = f16_to_f32_scalar;
#ifdef HAVE_AVX2_PATHS
    if (j->simd) { deq = deq_rows_avx2; f16 = f16_to_f32_avx2; }
#endif
    const int kernel = pick_kernel(a, R, j->level);
    const bool vt = kernel == OP_ATT_VNNI_TILE, fused = vt || kernel == OP_ATT_AVX2_FUSED;
    (void)vt;
    /* q8_0 / q4_0 keys see the query rounded to int8: as codes and scales
     * for the fused kernels, as the floats they stand for for the tile's */
    const bool iq = typed && int_keys(a->k_type);
    const int qg = op_kv_group(a->k_type, hd);
    float *QR = (float *)((uint8_t *)QS + round64(sizeof(float) * (size_t)hd));
    int8_t *QC = (int8_t *)QR;
    float *QD = (float *)((uint8_t *)QR + round64((size_t)ATT_FUSED_ROWS * hd));
    if (iq)
        for (int r = 0; r < R; r++) {
            const float *src = j->q + ((size_t)(t0 + r / ng) * a->n_heads + (size_t)h * p->G + g0 + r % ng) * hd;
            if (fused) /* fused implies AVX2 and qg % 32 == 0 */
#ifdef HAVE_AVX2_PATHS
                quantize_query_avx2(src, QC + (size_t)r * hd, QD + (size_t)r * (hd / qg), hd, qg);
#else
                quantize_query(src, QC + (size_t)r * hd, QD + (size_t)r * (hd / qg), NULL, hd, qg);
#endif
            else round_query(src, QR + (size_t)r * hd, hd, qg);
        }

    for (int kb = k0; kb < k1; kb += ATT_BK) {
        int nk = k1 - kb < ATT_BK ? k1 - kb : ATT_BK;
        /* the keys of this block that the item's last query sees */
        int n_tile = a->q_pos0 + t1 - kb < nk ? a->q_pos0 + t1 - kb : nk;
#ifdef HAVE_AVX2_PATHS
        if (fused) {
            if (n_tile <= 0) continue;
            /* the cache blocks are scattered pages that the hardware
             * prefetcher does not follow: ask for the next key block's rows
             * while this one is scored (vnni_tile asks chunk by chunk) */
            if (!vt && kb + ATT_BK < k1)
                prefetch_rows(a, h, kb + ATT_BK, k1 - kb - ATT_BK < ATT_BK ? k1 - kb - ATT_BK : ATT_BK);
            int vis[ATT_RMAX];
            const float *qrs[ATT_RMAX];
            float *wrow[ATT_RMAX];
            for (int r = 0; r < R; r++) {
                wrow[r] = j->W ? j->W + (size_t)row_of(a, p, t0 + r / ng, h, g0 + r % ng) * j->wn : NULL;
                qrs[r] = j->q + ((size_t)(t0 + r / ng) * a->n_heads + (size_t)h * p->G + g0 + r % ng) * hd;
            }
#ifdef HAVE_VNNI_PATHS
            if (vt) {
                for (int r = 0; r < R; r++) vis[r] = a->q_pos0 + t0 + r / ng - kb + 1;
                vnni_tile(a, h, kb, n_tile, R, vis, qrs, QC, QD, S, O, M, L, j->W ? wrow : NULL, k1);
                continue;
            }
#endif
            for (int r = 0; r < R; r++) vis[r] = a->q_pos0 + t0 + r / ng - kb + 1;
            fused_block(a, h, kb, n_tile, R, vis, qrs, QC, QD, S, O, M, L, QS, j->W ? wrow : NULL,
                        j->level >= OP_SIMD_VNNI && hd % 64 == 0);
            continue;
        }
#endif
        if (typed) {
            /* Dequantize the keys and values this tile's last query sees,
             * once for all its rows: then the f32 kernels run on the tile. */
            if (n_tile <= 0) continue;
            if (!kc) load_tile(a, true, h, kb, n_tile, Kt, deq, f16);
            else /* quantized q4_kc keys are scored from their codes;
                          * only the staged (f16) block's keys are converted */
                for (int x = 0, len; x < n_tile; x += len) {
                    len = run_from(a, kb + x, n_tile - x);
                    if ((kb + x) / a->block_size == a->stage_block)
                        f16(a->k_stage + ((size_t)h * a->block_size + (kb + x) % a->block_size) * hd, Kt + (size_t)x * hd,
                            (size_t)len * hd);
                }
            load_tile(a, false, h, kb, n_tile, Vt, deq, f16);
        }
        for (int ti = 0; ti < nt; ti++) {
            /* keys kb .. kb+vis-1 are at or before this token's position */
            int vis = a->q_pos0 + t0 + ti - kb + 1;
            if (vis > nk) vis = nk;
            if (vis <= 0) continue;
            int vpad = (vis + 7) & ~7;
            for (int gi = 0; gi < ng; gi++) {
                int r = ti * ng + gi;
                const float *qr = iq ? QR + (size_t)r * hd
                                               : j->q + ((size_t)(t0 + ti) * a->n_heads + (size_t)h * p->G + g0 + gi) * hd;
                float *s = S + (size_t)r * ATT_BK, *o = O + (size_t)r * hd;
                float mx = -INFINITY, sum;
                /* key block in runs that are contiguous in the cache */
                for (int x = 0, len; x < vis; x += len) {
                    len = typed && !kc ? vis : run_from(a, kb + x, vis - x);
                    int b = kc ? (kb + x) / a->block_size : -1;
                    if (kc && b != a->stage_block) {
                        const uint8_t *region = (const uint8_t *)a->blocks[b] + (size_t)h * a->head_bytes;
                        int slot = (kb + x) % a->block_size;
#ifdef HAVE_AVX2_PATHS
                        if (j->simd) kc_scores_avx2(s + x, qr, region, hd, a->block_size, slot, len, a->scale, QS);
                        else
#endif
                            kc_scores_scalar(s + x, qr, region, hd, a->block_size, slot, len, a->scale, QS);
                        continue;
                    }
                    const float *kx = typed ? Kt + (size_t)x * hd : key_at(a, h, kb + x);
#ifdef HAVE_AVX2_PATHS
                    if (j->simd) scores_avx2(s + x, qr, kx, len, hd, a->scale);
                    else
#endif
                        scores_scalar(s + x, qr, kx, len, hd, a->scale);
                }
                if (j->W) memcpy(j->W + (size_t)row_of(a, p, t0 + ti, h, g0 + gi) * j->wn + kb, s, sizeof(float) * vis);
                for (int x = 0; x < vis; x++) mx = s[x] > mx ? s[x] : mx;
                for (int x = vis; x < vpad; x++) s[x] = -INFINITY;
                float m_new = M[r] > mx ? M[r] : mx;
#ifdef HAVE_AVX2_PATHS
                if (j->simd) sum = exp_sum_avx2(s, vpad, m_new);
                else
#endif
                    sum = exp_sum_scalar(s, vis, m_new);
                if (M[r] != m_new && L[r] > 0) { /* rescale what was summed under the old max */
                    float alpha = expf(M[r] - m_new);
                    L[r] *= alpha;
                    for (int i = 0; i < hd; i++) o[i] *= alpha;
                }
                L[r] += sum;
                M[r] = m_new;
                for (int x = 0, len; x < vis; x += len) {
                    len = typed ? vis : run_from(a, kb + x, vis - x);
                    const float *vx = typed ? Vt : value_at(a, h, kb + x);
#ifdef HAVE_AVX2_PATHS
                    if (j->simd) pv_avx2(o, s + x, vx, len, hd);
                    else
#endif
                        pv_scalar(o, s + x, vx, len, hd);
                }
            }
        }
    }

    for (int ti = 0; ti < nt; ti++)
        for (int gi = 0; gi < ng; gi++) {
            int r = ti * ng + gi;
            if (p->n_split == 1 && j->W) {
                int g = row_of(a, p, t0 + ti, h, g0 + gi);
                j->WM[g] = M[r];
                j->WL[g] = L[r];
            }
            if (p->n_split == 1) {
                float *dst = j->out + ((size_t)(t0 + ti) * a->n_heads + (size_t)h * p->G + g0 + gi) * hd;
                float inv = 1.0f / L[r];
                int i = 0;
#ifdef HAVE_AVX2_PATHS
                if (j->simd) i = scale_avx2(dst, O + (size_t)r * hd, inv, hd);
#endif
                for (; i < hd; i++) dst[i] = O[(size_t)r * hd + i] * inv;
            } else {
                float *part = j->parts + (size_t)task * part_floats(p, hd);
                part[r] = M[r];
                part[p->rows + r] = L[r];
                memcpy(part + 2 * (size_t)p->rows + (size_t)r * hd, O + (size_t)r * hd, sizeof(float) * hd);
            }
        }
}

static void att_worker(void *ctx, int ith, int nth) {
    (void)nth;
    att_job *j = ctx;
    uint8_t *scr = j->scratch + (size_t)ith * j->per_thread;
    for (;;) {
        int task = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (task >= j->n_tasks) break;
        run_task(j, task, scr);
    }
}

/* Combines the key-split parts of each item in a fixed order: weights
 * e^(m_s - max m), the log-sum-exp merge of the parts' softmaxes. */
static void merge_parts(const att_job *j) {
    const op_attn_args *a = j->a;
    const att_plan *p = &j->p;
    const int hd = a->head_dim, R = p->rows;
    const size_t pf = part_floats(p, hd);
    for (int item = 0; item < p->n_items; item++) {
        int tt = p->n_tt - 1 - item % p->n_tt;
        int rest = item / p->n_tt;
        int hci = rest % p->n_hc, h = rest / p->n_hc;
        int t0 = tt * p->tq, t1 = t0 + p->tq < a->T ? t0 + p->tq : a->T;
        int g0 = hci * p->hc, g1 = g0 + p->hc < p->G ? g0 + p->hc : p->G;
        int ng = g1 - g0;
        const float *parts = j->parts + (size_t)item * p->n_split * pf;
        for (int ti = 0; ti < t1 - t0; ti++)
            for (int gi = 0; gi < ng; gi++) {
                int r = ti * ng + gi;
                float mx = -INFINITY, l = 0;
                for (int s = 0; s < p->n_split; s++) {
                    float ms = parts[s * pf + r];
                    mx = ms > mx ? ms : mx;
                }
                float *dst = j->out + ((size_t)(t0 + ti) * a->n_heads + (size_t)h * p->G + g0 + gi) * hd;
                for (int i = 0; i < hd; i++) dst[i] = 0;
                for (int s = 0; s < p->n_split; s++) {
                    const float *ps = parts + s * pf;
                    if (ps[R + r] == 0.0f) continue; /* no visible key in this part */
                    float w = expf(ps[r] - mx);
                    l += ps[R + r] * w;
                    const float *o = ps + 2 * (size_t)R + (size_t)r * hd;
                    for (int i = 0; i < hd; i++) dst[i] += o[i] * w;
                }
                float inv = 1.0f / l;
                for (int i = 0; i < hd; i++) dst[i] *= inv;
                if (j->W) {
                    int g = row_of(a, p, t0 + ti, h, g0 + gi);
                    j->WM[g] = mx;
                    j->WL[g] = l;
                }
            }
    }
}

/* H2O, after the merge: key_weights[p] += exp(s - m) / l of every row that
 * sees key p, rows in a fixed order. Threads take key ranges of whole 64-key
 * blocks (so which keys the vector loop takes depends on p alone): the same
 * bits on any thread count, and no two threads write one key. */
static void weights_worker(void *ctx, int ith, int nth) {
    const att_job *j = ctx;
    const op_attn_args *a = j->a;
    int n = a->q_pos0 + a->T, per = ((n + nth - 1) / nth + ATT_BK - 1) / ATT_BK * ATT_BK;
    int p0 = ith * per < n ? ith * per : n, p1 = p0 + per < n ? p0 + per : n;
    for (int t = 0; t < a->T; t++) {
        int end = a->q_pos0 + t + 1 < p1 ? a->q_pos0 + t + 1 : p1;
        if (end <= p0) continue;
        for (int hq = 0; hq < a->n_heads; hq++) {
            int g = t * a->n_heads + hq, i = 0;
            const float *s = j->W + (size_t)g * j->wn + p0;
            float *kw = a->key_weights + p0, m = j->WM[g], il = 1.0f / j->WL[g];
#ifdef HAVE_AVX2_PATHS
            if (j->simd) i = add_probs_avx2(kw, s, end - p0, m, il);
#endif
            for (; i < end - p0; i++) kw[i] += expf(s[i] - m) * il;
        }
    }
}

size_t op_attention_score_floats(int T, int n_heads, int n_keys) {
    return (size_t)T * n_heads * ((size_t)n_keys + 2);
}

/* A call's job: T query tokens; W: score scratch for H2O's weights or NULL. */
static void job_init(att_job *j, util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work,
                     float *W) {
    j->a = a;
    j->q = q;
    j->out = out;
    j->p = make_plan(a);
    j->per_thread = per_thread_bytes(a->head_dim);
    j->scratch = (uint8_t *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    j->parts = (float *)(j->scratch + (size_t)util_pool_size(pool) * j->per_thread);
    j->W = W;
    j->wn = (size_t)a->q_pos0 + a->T;
    j->WM = W ? W + (size_t)a->T * a->n_heads * j->wn : NULL;
    j->WL = W ? j->WM + (size_t)a->T * a->n_heads : NULL;
    j->level = op_simd_level();
    j->simd = j->level >= OP_SIMD_AVX2;
    j->n_tasks = j->p.n_items * j->p.n_split;
    atomic_init(&j->next, 0);
}

static void attend(util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work, float *W) {
    att_job j;
    job_init(&j, pool, out, q, a, work, W);
    util_pool_run(pool, att_worker, &j);
    if (j.p.n_split > 1) merge_parts(&j);
    if (W) util_pool_run(pool, weights_worker, &j);
}


void op_attention(util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work) {
    if (!args_ok(a)) return;
    if (!a->key_weights) { attend(pool, out, q, a, work, NULL); return; }
    size_t per_token = op_attention_score_floats(1, a->n_heads, a->q_pos0 + a->T);
    size_t fit = a->score_work ? a->score_work_floats / per_token : 0;
    if (fit == 0) { /* no room for one token's scores: the reference's pass */
        attend(pool, out, q, a, work, NULL);
        accumulate_key_weights(a, q);
        return;
    }
    /* as many query tokens at a time as the scores of fit in score_work */
    int step = fit < (size_t)a->T ? (int)fit : a->T;
    for (int t0 = 0; t0 < a->T; t0 += step) {
        op_attn_args c = *a;
        c.T = a->T - t0 < step ? a->T - t0 : step;
        c.q_pos0 = a->q_pos0 + t0;
        size_t off = (size_t)t0 * a->n_heads * a->head_dim;
        attend(pool, out + off, q + off, &c, work, a->score_work);
    }
}

/* The calls of op_attention_n share one pass of the threads: their tasks are
 * numbered one after another and taken from one counter (ATT_MULTI calls at
 * most per pass). */
#define ATT_MULTI 64
typedef struct {
    att_job *jobs;
    const int *first; /* first task of each job; first[n] = all */
    int n;
    atomic_int next;
} att_multi;

static void multi_worker(void *ctx, int ith, int nth) {
    att_multi *m = ctx;
    const int total = m->first[m->n];
    /* a few tasks per grab where there are many: each grab moves the
     * counter's cache line between the cores */
    const int grab = total >= 32 * nth ? 4 : 1;
    int k = 0;
    for (;;) {
        int t0 = atomic_fetch_add_explicit(&m->next, grab, memory_order_relaxed);
        if (t0 >= total) break;
        for (int task = t0; task < t0 + grab && task < total; task++) {
            while (task >= m->first[k + 1]) k++; /* tasks come in increasing order */
            while (task < m->first[k]) k--;
            run_task(&m->jobs[k], task - m->first[k], m->jobs[k].scratch + (size_t)ith * m->jobs[k].per_thread);
        }
    }
}

/* Calls idx[0..m) of op_attention_n in one pass. */
static void run_multi(util_pool *pool, float *const *out, const float *const *q, const op_attn_args *a,
                      void *work, const int *idx, int m) {
    att_job jobs[ATT_MULTI];
    int first[ATT_MULTI + 1];
    first[0] = 0;
    for (int k = 0; k < m; k++) {
        job_init(&jobs[k], pool, out[idx[k]], q[idx[k]], &a[idx[k]], work, NULL);
        first[k + 1] = first[k] + jobs[k].n_tasks;
    }
    att_multi mj;
    mj.jobs = jobs;
    mj.first = first;
    mj.n = m;
    atomic_init(&mj.next, 0);
    util_pool_run(pool, multi_worker, &mj);
}

void op_attention_n(util_pool *pool, int n, float *const *out, const float *const *q, const op_attn_args *a,
                    void *work) {
    int idx[ATT_MULTI], m = 0;
    for (int i = 0; i < n; i++) {
        if (!args_ok(&a[i])) continue;
        /* H2O weights and key-split calls (few sequences, long contexts) keep
         * their own passes: their scratch is per call */
        if (a[i].key_weights || make_plan(&a[i]).n_split > 1) {
            op_attention(pool, out[i], q[i], &a[i], work);
            continue;
        }
        idx[m++] = i;
        if (m == ATT_MULTI) { run_multi(pool, out, q, a, work, idx, m); m = 0; }
    }
    if (m) run_multi(pool, out, q, a, work, idx, m);
}
