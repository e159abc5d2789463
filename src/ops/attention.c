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
 * once for all their rows. On AVX512-VNNI CPUs f32, f16, bf16, q8_0 and q4_0
 * keys and values (any mix) run one 512-bit tile kernel, 16 keys at a time,
 * for decode and prefill alike. H2O's per-key weights come
 * from the same scores, kept per row and normalised after the merge.
 * This file: the driver (plan, threads, key splits and their merge, H2O's
 * weights) and the reference; the kernels of each SIMD level are in
 * attention_scalar.c, attention_avx2.c and attention_avx512.c, chosen
 * through their tables (attention_internal.h). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/attention_internal.h"

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

/* ---- typed caches: tiles of dequantized rows ---------------------------------- */
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
            if (is_typed(a)) load_tile(a, true, h, p, 1, row, op_att_deq_rows_scalar, op_att_f16_to_f32_scalar);
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
    int hd = a->head_dim, G = a->n_heads / a->n_kv_heads, vd = a->v_dim > 0 ? a->v_dim : hd;
    int n_max = a->q_pos0 + a->T;
    double *s = malloc((size_t)n_max * sizeof(double));
    double *o = malloc((size_t)hd * sizeof(double));
    if (!s || !o) { free(s); free(o); return; }
    for (int t = 0; t < a->T; t++) {
        int n = a->q_pos0 + t + 1; /* visible keys: lo .. n-1 */
        int lo = a->window > 0 && n > a->window ? n - a->window : 0;
        for (int hq = 0; hq < a->n_heads; hq++) {
            const float *qr = q + ((size_t)t * a->n_heads + hq) * hd;
            double mx = -INFINITY, sum = 0;
            for (int p = lo; p < n; p++) {
                const float *kp = key_at(a, hq / G, p);
                double d = 0;
                for (int i = 0; i < hd; i++) d += (double)qr[i] * kp[i];
                s[p] = d * a->scale;
                if (a->softcap > 0) s[p] = a->softcap * tanh(s[p] / a->softcap);
                if (s[p] > mx) mx = s[p];
            }
            if (a->sinks && a->sinks[hq] > mx) mx = a->sinks[hq];
            for (int p = lo; p < n; p++) sum += (s[p] = exp(s[p] - mx));
            if (a->sinks) sum += exp((double)a->sinks[hq] - mx); /* a key with no value */
            for (int i = 0; i < vd; i++) o[i] = 0;
            for (int p = lo; p < n; p++) {
                const float *vp = value_at(a, hq / G, p);
                for (int i = 0; i < vd; i++) o[i] += s[p] * vp[i];
            }
            float *dst = out + ((size_t)t * a->n_heads + hq) * vd;
            for (int i = 0; i < vd; i++) dst[i] = (float)(o[i] / sum);
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
            load_tile(a, true, h, 0, n_max, k + (size_t)h * stride, op_att_deq_rows_scalar, op_att_f16_to_f32_scalar);
            load_tile(a, false, h, 0, n_max, v + (size_t)h * stride, op_att_deq_rows_scalar, op_att_f16_to_f32_scalar);
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
        int span = a->q_pos0 + a->T;
        if (a->window > 0 && span > a->window + a->T - 1) span = a->window + a->T - 1;
        int by_len = span / ATT_MIN_CHUNK;
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
    int level; /* op_simd_level() */
    const op_att_kernels *K; /* its kernels */
    int n_tasks;
    atomic_int next;
} att_job;

/* the row of query token t, query head h * G + g in q's layout */
static inline int row_of(const op_attn_args *a, const att_plan *p, int t, int h, int g) {
    return t * a->n_heads + h * p->G + g;
}

static bool args_ok(const op_attn_args *a) {
    return a->T > 0 && a->n_heads > 0 && a->n_kv_heads > 0 && a->head_dim > 0 && a->n_heads % a->n_kv_heads == 0 &&
           (!a->blocks || a->block_size > 0) && !(a->sinks && a->key_weights);
}

/* 1 / the softmax's denominator for a row whose keys summed to l under the
 * max m: l, plus e^(sink - m) when the head has a sink (op_attn_args.sinks),
 * taken under max(m, sink) so that neither term overflows. */
static inline float row_inv(const op_attn_args *a, int hq, float m, float l) {
    if (!a->sinks) return 1.0f / l;
    const float s = a->sinks[hq], mm = m > s ? m : s, e = expf(m - mm);
    return e / (l * e + expf(s - mm));
}

/* The kernels per level, each gap filled from the level below (built once). */
static op_att_kernels levels[OP_SIMD_LEVELS];
static pthread_once_t levels_once = PTHREAD_ONCE_INIT;

static void build_levels(void) {
    const op_att_kernels *own[OP_SIMD_LEVELS] = {&op_att_kernels_scalar, &op_att_kernels_avx2, &op_att_kernels_avx512};
    op_att_kernels k = *own[0];
    for (int l = 0; l < OP_SIMD_LEVELS; l++) {
        const op_att_kernels *o = own[l];
#define FILL(f) if (o->f) k.f = o->f
        FILL(scores); FILL(pv); FILL(exp_sum); FILL(kc_scores); FILL(deq_rows); FILL(f16_to_f32); FILL(scale);
        FILL(add_probs); FILL(quantize_query); FILL(fused_ok); FILL(fused_block); FILL(prefetch_rows);
        FILL(tile_ok); FILL(tile);
#undef FILL
        levels[l] = k;
    }
}

const op_att_kernels *op_att_kernels_at(int level) {
    pthread_once(&levels_once, build_levels);
    return &levels[level < 0 ? 0 : level < OP_SIMD_LEVELS ? level : OP_SIMD_LEVELS - 1];
}

/* The kernel of an item of R rows with a level's kernels. */
/* Starts the hardware prefetcher on the blocks of keys p..p+n-1 (head h's K
 * and V regions): their first lines, and the first lines of every page
 * they cross, asked into L2. The prefetcher then streams each page on its
 * own, without the L1 miss buffers that the next tile's line-by-line
 * prefetch (prefetch_rows, pf_rows) holds. Asked two tiles ahead, on top of
 * that prefetch, it brings f16 and q8_0 caches closer to the bandwidth bound
 * on the Intel VM (bench/results/attention.md). */
enum { KICK_TILES = 2, KICK_LINES = 2 };
static void kick_blocks(const op_attn_args *a, int h, int p, int n) {
    if (!a->blocks || !a->head_bytes) return;
    const int bs = a->block_size;
    for (int b = p / bs; b <= (p + n - 1) / bs; b++) {
        uintptr_t s = (uintptr_t)a->blocks[b] + (size_t)h * a->head_bytes, e = s + a->head_bytes;
        for (uintptr_t pg = s & ~(uintptr_t)63; pg < e; pg = (pg & ~(uintptr_t)4095) + 4096)
            for (int x = 0; x < KICK_LINES; x++) __builtin_prefetch((const void *)(pg + 64 * x), 0, 2);
    }
}

static int pick_kernel(const op_attn_args *a, int R, const op_att_kernels *K) {
    /* soft-capping, and windows over rows of several positions (each row's
     * own first key), need the tiled kernel; one position's rows (decode)
     * share their window, which the item's key range already is */
    if (a->softcap > 0 || (a->window > 0 && a->T > 1)) return K->fused_ok ? OP_ATT_AVX2_TILE : OP_ATT_SCALAR;
    if (K->tile_ok && K->tile_ok(a, R)) return OP_ATT_VNNI_TILE;
    if (K->fused_ok)
        return is_typed(a) && R <= ATT_FUSED_ROWS && K->fused_ok(a) ? OP_ATT_AVX2_FUSED : OP_ATT_AVX2_TILE;
    return OP_ATT_SCALAR;
}

int op_attention_kernel(const op_attn_args *a) {
    if (!args_ok(a)) return -1;
    return pick_kernel(a, make_plan(a).rows, op_att_kernels_at(op_simd_level()));
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
    /* a sliding window: nothing before the first row's window is read */
    const int W = a->window;
    int lo = W > 0 && a->q_pos0 + t0 + 1 > W ? a->q_pos0 + t0 + 1 - W : 0;
    int k0 = lo, k1 = n_keys;
    if (p->n_split > 1) {
        int span = n_keys - lo, per = (span + p->n_split - 1) / p->n_split;
        per = (per + ATT_BK - 1) / ATT_BK * ATT_BK;
        k0 = lo + (split * per < span ? split * per : span);
        k1 = k0 + per < n_keys ? k0 + per : n_keys;
    }
    for (int r = 0; r < R; r++) { M[r] = -INFINITY; L[r] = 0; }
    memset(O, 0, sizeof(float) * (size_t)R * hd);

    const bool typed = is_typed(a);
    float *Kt = (float *)((uint8_t *)L + round64(sizeof(float) * ATT_RMAX));
    float *Vt = (float *)((uint8_t *)Kt + round64(sizeof(float) * ATT_BK * (size_t)hd));
    float *QS = (float *)((uint8_t *)Vt + round64(sizeof(float) * ATT_BK * (size_t)hd));
    const bool kc = typed && a->k_type == KVLM_CACHE_Q4_KC;
    const op_att_kernels *K = j->K;
    deq_rows_fn deq = K->deq_rows;
    deq_f16_fn f16 = K->f16_to_f32;
    const int kernel = pick_kernel(a, R, K);
    const bool vt = kernel == OP_ATT_VNNI_TILE, fused = vt || kernel == OP_ATT_AVX2_FUSED;
    /* q8_0 / q4_0 keys see the query rounded to int8: as codes and scales
     * for the fused kernels, as the floats they stand for for the tile's */
    const bool iq = typed && int_keys(a->k_type);
    const int qg = op_kv_group(a->k_type, hd);
    float *QR = (float *)((uint8_t *)QS + round64(sizeof(float) * (size_t)hd));
    int8_t *QC = (int8_t *)QR;
    float *QD = (float *)((uint8_t *)QR + round64((size_t)ATT_RMAX * hd)); /* after R <= ATT_RMAX rows of codes */
    if (iq)
        for (int r = 0; r < R; r++) {
            const float *src = j->q + ((size_t)(t0 + r / ng) * a->n_heads + (size_t)h * p->G + g0 + r % ng) * hd;
            if (fused) /* fused implies AVX2 and qg % 32 == 0 */
                K->quantize_query(src, QC + (size_t)r * hd, QD + (size_t)r * (hd / qg), hd, qg);
            else round_query(src, QR + (size_t)r * hd, hd, qg);
        }

    for (int kb = k0; kb < k1; kb += ATT_BK) {
        int nk = k1 - kb < ATT_BK ? k1 - kb : ATT_BK;
        /* the keys of this block that the item's last query sees */
        int n_tile = a->q_pos0 + t1 - kb < nk ? a->q_pos0 + t1 - kb : nk;
        if (fused) {
            if (n_tile <= 0) continue;
            const int kk = kb + KICK_TILES * ATT_BK;
            if (kk < k1) kick_blocks(a, h, kk, k1 - kk < ATT_BK ? k1 - kk : ATT_BK);
            /* the cache blocks are scattered pages that the hardware
             * prefetcher does not follow: ask for the next key block's rows
             * while this one is scored (vnni_tile asks chunk by chunk) */
            if (!vt && kb + ATT_BK < k1)
                K->prefetch_rows(a, h, kb + ATT_BK, k1 - kb - ATT_BK < ATT_BK ? k1 - kb - ATT_BK : ATT_BK);
            int vis[ATT_RMAX];
            const float *qrs[ATT_RMAX];
            float *wrow[ATT_RMAX];
            for (int r = 0; r < R; r++) {
                wrow[r] = j->W ? j->W + (size_t)row_of(a, p, t0 + r / ng, h, g0 + r % ng) * j->wn : NULL;
                qrs[r] = j->q + ((size_t)(t0 + r / ng) * a->n_heads + (size_t)h * p->G + g0 + r % ng) * hd;
            }
            if (vt) {
                for (int r = 0; r < R; r++) vis[r] = a->q_pos0 + t0 + r / ng - kb + 1;
                K->tile(a, h, kb, n_tile, R, vis, qrs, QC, QD, S, O, M, L, j->W ? wrow : NULL, k1);
                continue;
            }
            for (int r = 0; r < R; r++) vis[r] = a->q_pos0 + t0 + r / ng - kb + 1;
            K->fused_block(a, h, kb, n_tile, R, vis, qrs, QC, QD, S, O, M, L, QS, j->W ? wrow : NULL,
                           j->level >= OP_SIMD_VNNI && hd % 64 == 0);
            continue;
        }
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
            /* keys kb .. kb+skip-1 are before this token's window */
            int skip = W > 0 ? a->q_pos0 + t0 + ti + 1 - W - kb : 0;
            if (skip < 0) skip = 0;
            if (skip >= vis) continue;
            int vpad = (vis + 7) & ~7;
            for (int gi = 0; gi < ng; gi++) {
                int r = ti * ng + gi;
                const float *qr = iq ? QR + (size_t)r * hd
                                               : j->q + ((size_t)(t0 + ti) * a->n_heads + (size_t)h * p->G + g0 + gi) * hd;
                float *s = S + (size_t)r * ATT_BK, *o = O + (size_t)r * hd;
                float mx = -INFINITY, sum;
                /* key block in runs that are contiguous in the cache */
                for (int x = skip, len; x < vis; x += len) {
                    len = typed && !kc ? vis - x : run_from(a, kb + x, vis - x);
                    int b = kc ? (kb + x) / a->block_size : -1;
                    if (kc && b != a->stage_block) {
                        const uint8_t *region = (const uint8_t *)a->blocks[b] + (size_t)h * a->head_bytes;
                        int slot = (kb + x) % a->block_size;
                        K->kc_scores(s + x, qr, region, hd, a->block_size, slot, len, a->scale, QS);
                        continue;
                    }
                    const float *kx = typed ? Kt + (size_t)x * hd : key_at(a, h, kb + x);
                    K->scores(s + x, qr, kx, len, hd, a->scale);
                }
                for (int x = 0; x < skip; x++) s[x] = -INFINITY;
                if (a->softcap > 0)
                    for (int x = skip; x < vis; x++) s[x] = a->softcap * tanhf(s[x] / a->softcap);
                if (j->W) memcpy(j->W + (size_t)row_of(a, p, t0 + ti, h, g0 + gi) * j->wn + kb, s, sizeof(float) * vis);
                for (int x = skip; x < vis; x++) mx = s[x] > mx ? s[x] : mx;
                for (int x = vis; x < vpad; x++) s[x] = -INFINITY;
                float m_new = M[r] > mx ? M[r] : mx;
                /* over the padding too (its -inf gives 0): the same sum */
                sum = K->exp_sum(s, vpad, m_new);
                if (M[r] != m_new && L[r] > 0) { /* rescale what was summed under the old max */
                    float alpha = expf(M[r] - m_new);
                    L[r] *= alpha;
                    for (int i = 0; i < hd; i++) o[i] *= alpha;
                }
                L[r] += sum;
                M[r] = m_new;
                for (int x = skip, len; x < vis; x += len) {
                    len = typed ? vis - x : run_from(a, kb + x, vis - x);
                    const float *vx = typed ? Vt + (size_t)x * hd : value_at(a, h, kb + x);
                    K->pv(o, s + x, vx, len, hd);
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
                float inv = row_inv(a, h * p->G + g0 + gi, M[r], L[r]);
                int i = 0;
                if (K->scale) i = K->scale(dst, O + (size_t)r * hd, inv, hd);
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
                float inv = row_inv(a, h * p->G + g0 + gi, mx, l);
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
            if (j->K->add_probs) i = j->K->add_probs(kw, s, end - p0, m, il);
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
    j->K = op_att_kernels_at(j->level);
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
