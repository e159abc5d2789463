/* ops/attention_mla: attention over a latent (MLA) cache: one shared "KV
 * head" whose key rows are head_dim wide and whose values are the first
 * v_dim elements of those same rows (DeepSeek's absorbed decode: 576-wide
 * keys, 512-wide values). Each tile of key rows is read (dequantized) once
 * for every query head; keys are split in fixed chunks whose partial softmax
 * results are merged (flash-decoding), so the bits do not depend on the
 * thread count. op_attention_ref (v_dim set) is its reference. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include "ops/attention_internal.h"
#include "util/pool.h"

#define MLA_TILE 16      /* keys dequantized at a time */
#define MLA_CHUNK 256    /* keys per work item (a multiple of MLA_TILE) */
#define MLA_TG 4         /* query tokens per round of work items */

static size_t r64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t per_thread_bytes(int H, int hd) {
    return r64((size_t)MLA_TILE * hd * sizeof(float)) + r64((size_t)MLA_TILE * sizeof(float)) +
           r64((size_t)H * ((size_t)hd + 2) * sizeof(float));
}

size_t op_attention_mla_work_size(int n_threads, int n_heads, int head_dim, int n_ctx) {
    size_t chunks = (size_t)(n_ctx + MLA_CHUNK - 1) / MLA_CHUNK;
    return r64((size_t)MLA_TG * n_heads * head_dim * sizeof(float)) +
           r64((size_t)MLA_TG * chunks * n_heads * ((size_t)head_dim + 2) * sizeof(float)) +
           (size_t)(n_threads > 0 ? n_threads : 1) * per_thread_bytes(n_heads, head_dim) + 64;
}

typedef struct {
    const op_attn_args *a;
    const op_att_kernels *K;
    const float *q;       /* rounded (int keys) or as given: [tokens of the round][H][hd] */
    float *part;          /* [token][chunk][H][hd + 2]: o, then m, l */
    uint8_t *thread_work;
    int t0, n_tok, max_chunks;
    int item_tok[MLA_TG + 1]; /* prefix sums of each token's chunk count */
    atomic_int next;
} mla_job;

static int visible(const op_attn_args *a, int t) { return a->q_pos0 + t + 1; }

/* Keys [k0, k1) against the H query rows of token t: o (hd wide: the first
 * v_dim are the output, the rest is the RoPE part carried along), m, l. */
static void mla_item(const mla_job *j, int t, int chunk, uint8_t *w) {
    const op_attn_args *a = j->a;
    const op_att_kernels *K = j->K;
    int H = a->n_heads, hd = a->head_dim, bs = a->block_size;
    float *tile = (float *)w;
    float *s = (float *)(w + r64((size_t)MLA_TILE * hd * sizeof(float)));
    float *part = j->part + ((size_t)(t - j->t0) * j->max_chunks + chunk) * H * ((size_t)hd + 2);
    const float *q = j->q + (size_t)(t - j->t0) * H * hd;
    int k0 = chunk * MLA_CHUNK, k1 = k0 + MLA_CHUNK, vis = visible(a, t);
    if (k1 > vis) k1 = vis;
    for (int h = 0; h < H; h++) {
        float *o = part + (size_t)h * (hd + 2);
        memset(o, 0, (size_t)hd * sizeof(float));
        o[hd] = -INFINITY;
        o[hd + 1] = 0;
    }
    bool typed = a->k_type != KVLM_CACHE_F32;
    for (int p = k0, n; p < k1; p += n) {
        n = k1 - p < MLA_TILE ? k1 - p : MLA_TILE;
        int left = bs - p % bs;
        if (n > left) n = left;
        const uint8_t *row0 = (const uint8_t *)a->blocks[p / bs] + (size_t)(p % bs) * op_kv_row_bytes(a->k_type, hd);
        const float *k = (const float *)row0;
        if (typed) {
            K->deq_rows(a->k_type, row0, tile, n, hd);
            k = tile;
        }
        int n8 = (n + 7) & ~7;
        for (int h = 0; h < H; h++) {
            float *o = part + (size_t)h * (hd + 2);
            K->scores(s, q + (size_t)h * hd, k, n, hd, a->scale);
            float mx = o[hd];
            for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
            for (int i = n; i < n8; i++) s[i] = -INFINITY;
            float corr = expf(o[hd] - mx); /* 0 on the first tile (-inf) */
            if (corr != 1.0f)
                for (int i = 0; i < hd; i++) o[i] *= corr;
            float sum = K->exp_sum(s, n8, mx);
            o[hd] = mx;
            o[hd + 1] = o[hd + 1] * corr + sum;
            K->pv(o, s, k, n, hd);
        }
    }
}

static void mla_worker(void *arg, int ith, int nth) {
    (void)nth;
    mla_job *j = arg;
    uint8_t *w = j->thread_work + (size_t)ith * per_thread_bytes(j->a->n_heads, j->a->head_dim);
    int total = j->item_tok[j->n_tok];
    for (int u; (u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < total;) {
        int i = 0;
        while (j->item_tok[i + 1] <= u) i++;
        mla_item(j, j->t0 + i, u - j->item_tok[i], w);
    }
}

/* q8_0 / q4_0 keys meet the query rounded to int8 per group of the keys'
 * group size, as in every other attention path (attention.c), so this kernel
 * and the reference agree to float rounding. */
static void round_row(const float *x, float *y, int hd, int g) {
    for (int i = 0; i < hd; i += g) {
        float amax = 0;
        for (int k = 0; k < g; k++) amax = fmaxf(amax, fabsf(x[i + k]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int k = 0; k < g; k++) {
            long v = lrintf(x[i + k] * id);
            y[i + k] = (float)(v < -127 ? -127 : v > 127 ? 127 : v) * d;
        }
    }
}

void op_attention_mla(util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work) {
    int H = a->n_heads, hd = a->head_dim, vd = a->v_dim > 0 ? a->v_dim : hd;
    int n_ctx = a->q_pos0 + a->T, max_chunks = (n_ctx + MLA_CHUNK - 1) / MLA_CHUNK;
    int nth = pool ? util_pool_size(pool) : 1;
    uint8_t *w = (uint8_t *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    mla_job j = {.a = a, .K = op_att_kernels_at(op_simd_level()), .max_chunks = max_chunks};
    float *qr = (float *)w;
    j.part = (float *)(w + r64((size_t)MLA_TG * H * hd * sizeof(float)));
    j.thread_work = (uint8_t *)j.part + r64((size_t)MLA_TG * max_chunks * H * ((size_t)hd + 2) * sizeof(float));
    bool round = int_keys(a->k_type);
    for (int t0 = 0; t0 < a->T; t0 += MLA_TG) {
        j.t0 = t0;
        j.n_tok = a->T - t0 < MLA_TG ? a->T - t0 : MLA_TG;
        j.item_tok[0] = 0;
        for (int i = 0; i < j.n_tok; i++)
            j.item_tok[i + 1] = j.item_tok[i] + (visible(a, t0 + i) + MLA_CHUNK - 1) / MLA_CHUNK;
        const float *qt = q + (size_t)t0 * H * hd;
        if (round) {
            for (int r = 0; r < j.n_tok * H; r++)
                round_row(qt + (size_t)r * hd, qr + (size_t)r * hd, hd, op_kv_group(a->k_type, hd));
            qt = qr;
        }
        j.q = qt;
        atomic_store_explicit(&j.next, 0, memory_order_relaxed);
        if (pool && j.item_tok[j.n_tok] > 1 && nth > 1) util_pool_run(pool, mla_worker, &j);
        else mla_worker(&j, 0, 1);
        /* merge each token's chunks (log-sum-exp), in chunk order */
        for (int i = 0; i < j.n_tok; i++) {
            int nc = j.item_tok[i + 1] - j.item_tok[i];
            for (int h = 0; h < H; h++) {
                float *dst = out + ((size_t)(t0 + i) * H + h) * vd;
                const float *p0 = j.part + ((size_t)i * max_chunks * H + h) * ((size_t)hd + 2);
                size_t cstride = (size_t)H * ((size_t)hd + 2);
                float M = -INFINITY;
                for (int c = 0; c < nc; c++) M = fmaxf(M, p0[c * cstride + hd]);
                float L = 0;
                for (int d = 0; d < vd; d++) dst[d] = 0;
                for (int c = 0; c < nc; c++) {
                    const float *pc = p0 + c * cstride;
                    float f = expf(pc[hd] - M);
                    L += f * pc[hd + 1];
                    for (int d = 0; d < vd; d++) dst[d] += f * pc[d];
                }
                float il = 1.0f / L;
                for (int d = 0; d < vd; d++) dst[d] *= il;
            }
        }
    }
}
