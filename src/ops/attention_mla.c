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
#include <immintrin.h>

#define MLA_TILE 16      /* keys dequantized at a time */
#define MLA_CHUNK 256    /* keys per work item (a multiple of MLA_TILE) */
#define MLA_TG 4         /* query tokens per round of work items */

static size_t r64(size_t n) { return (n + 63) & ~(size_t)63; }

static size_t per_thread_bytes(int H, int hd) {
    return r64((size_t)MLA_TILE * hd * sizeof(float)) + r64((size_t)H * MLA_TILE * sizeof(float)) +
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
    bool avx2;            /* the SIMD level has AVX2: heads four at a time */
    int item_tok[MLA_TG + 1]; /* prefix sums of each token's chunk count */
    atomic_int next;
} mla_job;

static int visible(const op_attn_args *a, int t) { return a->q_pos0 + t + 1; }

/* One tile of n key rows k (hd floats each) for every head: S[h][0..n) the
 * scores, then each head's online softmax (m at o[hd], l at o[hd + 1]; the
 * output o rescaled when the max grows) and o += P k. o of head h is at
 * part + h * (hd + 2); only its first v_dim floats are read at the end.
 * This level: the table's row kernels, head by head. */
static void tile_rows(const op_att_kernels *K, const float *q, const float *k, int n, int H, int hd, float scale,
                      float *S, float *part) {
    int n8 = (n + 7) & ~7;
    for (int h = 0; h < H; h++) {
        float *o = part + (size_t)h * (hd + 2), *s = S + (size_t)h * MLA_TILE;
        K->scores(s, q + (size_t)h * hd, k, n, hd, scale);
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

/* AVX2: the same, heads four at a time so a loaded key chunk serves four
 * queries (scores: 4 heads x 2 keys per chunk; P.V: 4 heads x 16 dims in
 * registers while the tile's keys pass, the rescale folded in). Each head's
 * result equals tile_rows' up to float rounding (sums in another order). */
__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) static void tile_rows_avx2(const op_att_kernels *K, const float *q,
                                                                const float *k, int n, int H, int hd, int vd,
                                                                float scale, float *S, float *part) {
    /* P.V only over the value's width when it is whole chunks (the RoPE part
     * of the rows is never output) */
    int pd = vd % 16 == 0 ? vd : hd;
    int n8 = (n + 7) & ~7, h = 0;
    for (; h + 4 <= H && hd % 16 == 0; h += 4) {
        const float *q0 = q + (size_t)h * hd, *q1 = q0 + hd, *q2 = q1 + hd, *q3 = q2 + hd;
        float *s0 = S + (size_t)h * MLA_TILE;
        for (int j = 0; j < n; j += 2) {
            const float *ka = k + (size_t)j * hd, *kb = j + 1 < n ? ka + hd : ka;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int i = 0; i < hd; i += 8) {
                __m256 x = _mm256_loadu_ps(ka + i), y = _mm256_loadu_ps(kb + i), v;
                v = _mm256_loadu_ps(q0 + i), a0 = _mm256_fmadd_ps(v, x, a0), b0 = _mm256_fmadd_ps(v, y, b0);
                v = _mm256_loadu_ps(q1 + i), a1 = _mm256_fmadd_ps(v, x, a1), b1 = _mm256_fmadd_ps(v, y, b1);
                v = _mm256_loadu_ps(q2 + i), a2 = _mm256_fmadd_ps(v, x, a2), b2 = _mm256_fmadd_ps(v, y, b2);
                v = _mm256_loadu_ps(q3 + i), a3 = _mm256_fmadd_ps(v, x, a3), b3 = _mm256_fmadd_ps(v, y, b3);
            }
            s0[j] = hsum8(a0) * scale, s0[MLA_TILE + j] = hsum8(a1) * scale;
            s0[2 * MLA_TILE + j] = hsum8(a2) * scale, s0[3 * MLA_TILE + j] = hsum8(a3) * scale;
            if (j + 1 < n) {
                s0[j + 1] = hsum8(b0) * scale, s0[MLA_TILE + j + 1] = hsum8(b1) * scale;
                s0[2 * MLA_TILE + j + 1] = hsum8(b2) * scale, s0[3 * MLA_TILE + j + 1] = hsum8(b3) * scale;
            }
        }
        float corr[4];
        for (int g = 0; g < 4; g++) {
            float *o = part + (size_t)(h + g) * (hd + 2), *s = s0 + (size_t)g * MLA_TILE;
            float mx = o[hd];
            for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
            for (int i = n; i < n8; i++) s[i] = -INFINITY;
            corr[g] = expf(o[hd] - mx);
            float sum = K->exp_sum(s, n8, mx);
            o[hd] = mx;
            o[hd + 1] = o[hd + 1] * corr[g] + sum;
        }
        float *o0 = part + (size_t)h * (hd + 2), *o1 = o0 + hd + 2, *o2 = o1 + hd + 2, *o3 = o2 + hd + 2;
        __m256 c0 = _mm256_set1_ps(corr[0]), c1 = _mm256_set1_ps(corr[1]), c2 = _mm256_set1_ps(corr[2]),
               c3 = _mm256_set1_ps(corr[3]);
        for (int i = 0; i < pd; i += 16) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(o0 + i), c0), y0 = _mm256_mul_ps(_mm256_loadu_ps(o0 + i + 8), c0);
            __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(o1 + i), c1), y1 = _mm256_mul_ps(_mm256_loadu_ps(o1 + i + 8), c1);
            __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(o2 + i), c2), y2 = _mm256_mul_ps(_mm256_loadu_ps(o2 + i + 8), c2);
            __m256 x3 = _mm256_mul_ps(_mm256_loadu_ps(o3 + i), c3), y3 = _mm256_mul_ps(_mm256_loadu_ps(o3 + i + 8), c3);
            for (int j = 0; j < n; j++) {
                __m256 va = _mm256_loadu_ps(k + (size_t)j * hd + i), vb = _mm256_loadu_ps(k + (size_t)j * hd + i + 8), p;
                p = _mm256_broadcast_ss(s0 + j), x0 = _mm256_fmadd_ps(p, va, x0), y0 = _mm256_fmadd_ps(p, vb, y0);
                p = _mm256_broadcast_ss(s0 + MLA_TILE + j), x1 = _mm256_fmadd_ps(p, va, x1), y1 = _mm256_fmadd_ps(p, vb, y1);
                p = _mm256_broadcast_ss(s0 + 2 * MLA_TILE + j), x2 = _mm256_fmadd_ps(p, va, x2), y2 = _mm256_fmadd_ps(p, vb, y2);
                p = _mm256_broadcast_ss(s0 + 3 * MLA_TILE + j), x3 = _mm256_fmadd_ps(p, va, x3), y3 = _mm256_fmadd_ps(p, vb, y3);
            }
            _mm256_storeu_ps(o0 + i, x0), _mm256_storeu_ps(o0 + i + 8, y0);
            _mm256_storeu_ps(o1 + i, x1), _mm256_storeu_ps(o1 + i + 8, y1);
            _mm256_storeu_ps(o2 + i, x2), _mm256_storeu_ps(o2 + i + 8, y2);
            _mm256_storeu_ps(o3 + i, x3), _mm256_storeu_ps(o3 + i + 8, y3);
        }
    }
    if (h < H) /* the heads left over (or a width that is not whole 16-float chunks) */
        tile_rows(K, q + (size_t)h * hd, k, n, H - h, hd, scale, S + (size_t)h * MLA_TILE,
                  part + (size_t)h * (hd + 2));
}

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
        if (j->avx2) tile_rows_avx2(K, q, k, n, H, hd, a->v_dim > 0 ? a->v_dim : hd, a->scale, s, part);
        else tile_rows(K, q, k, n, H, hd, a->scale, s, part);
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
    mla_job j = {.a = a, .K = op_att_kernels_at(op_simd_level()), .max_chunks = max_chunks,
                 .avx2 = op_simd_level() >= OP_SIMD_AVX2};
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
