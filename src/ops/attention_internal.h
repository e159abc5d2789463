/* ops/attention_internal: what the attention driver (attention.c) shares
 * with its kernels per SIMD level (attention_scalar.c, attention_avx2.c,
 * attention_avx512.c): the work-item sizes, the cache addressing, and the
 * table of kernels each level fills. */
#ifndef KVLM_OPS_ATTENTION_INTERNAL_H
#define KVLM_OPS_ATTENTION_INTERNAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "ops/kvtype.h"
#include "ops/ops_internal.h"

/* Rows (query token x query head) per work item, and keys per block. */
#define ATT_RMAX 64
#define ATT_BK 64
/* Items of at most this many rows (decode) read typed caches with the fused
 * kernels; larger ones (prefill) dequantize a tile once for all their rows. */
#define ATT_FUSED_ROWS 8

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
/* Keys meeting the query as int8 codes (attention.c, "the query seen by
 * q8_0 / q4_0 keys"). */
static inline bool int_keys(int k_type) { return op_kv_int_query(k_type); }

/* n rows of a typed cache (hd elements each) into floats; f16 into f32. */
typedef void (*deq_rows_fn)(int type, const uint8_t *src, float *y, int n_rows, int hd);
typedef void (*deq_f16_fn)(const uint16_t *x, float *y, size_t n);

/* ---- the kernels of one KV type at one SIMD level (ops/kvtype.c's table) ---------
 * The decode kernels that read a type's rows straight from a cache block
 * (the AVX2 fused block): scores of the n keys from position p on of KV head
 * h (qr: the f32 query; qc / qd: its int8 codes and scales for grouped keys;
 * qs: hd floats of scratch), o += sum p[j] v_j over its values, and the same
 * for two query rows at once (NULL: the one-row kernel twice); deq_rows: the
 * prefill tiles' dequantizer (NULL: the scalar one). */
struct op_kv_kernels {
    int hd_multiple; /* the head dims the kernels take: multiples of this */
    void (*scores)(const op_attn_args *a, int h, int p, int n, float *s, const float *qr, const int8_t *qc,
                   const float *qd, float *qs);
    void (*scores2)(const op_attn_args *a, int h, int p, int n, float *sa, float *sb, const float *qa,
                    const float *qb, const int8_t *ca, const int8_t *cb, const float *da, const float *db);
    void (*pv)(const op_attn_args *a, int h, int p, int n, float *o, const float *pj); /* NULL: keys only */
    void (*pv2)(const op_attn_args *a, int h, int p, int n, float *o, const float *pj, float *o2, const float *pj2);
    deq_rows_fn deq_rows;
};
extern const op_kv_kernels op_kv_f32_avx2, op_kv_f16_avx2, op_kv_bf16_avx2, op_kv_q8_0_avx2, op_kv_q4_0_avx2,
    op_kv_q4_kc_avx2;

/* ---- the kernels of one SIMD level ------------------------------------------------
 * Each level's file fills the fields it has; NULL takes the level below's
 * (op_att_kernels_at resolves them), so the AVX-512 level adds its tile to
 * the AVX2 kernels. Where the scalar level has NULL the driver runs its own
 * scalar loop (scale, add_probs) or that path does not exist (fused, tile). */
typedef struct {
    /* f32 rows: the f32 cache, or tiles of dequantized rows (prefill) */
    void (*scores)(float *s, const float *q, const float *k, int nk, int hd, float scale); /* s[j] = scale q.k_j */
    void (*pv)(float *o, const float *p, const float *v, int nk, int hd);                 /* o += sum p[j] v_j */
    float (*exp_sum)(float *s, int n, float m); /* s[j] = exp(s[j] - m), returns the sum; n a multiple of 8 */
    /* q4_kc keys scored from their codes; qs: hd floats of scratch */
    void (*kc_scores)(float *s, const float *q, const uint8_t *region, int hd, int bs, int t0, int n, float scale,
                      float *qs);
    deq_rows_fn deq_rows;
    deq_f16_fn f16_to_f32;
    /* y[i] = x[i] * s and kw[i] += exp(s[i] - m) * il for the first i they
     * return (the driver finishes the rest) */
    int (*scale)(float *y, const float *x, float s, int n);
    int (*add_probs)(float *kw, const float *s, int n, float m, float il);
    /* q8_0 / q4_0 keys: the query's int8 codes c and scales d per group g */
    void (*quantize_query)(const float *x, int8_t *c, float *d, int hd, int g);
    /* decode: typed key/value rows converted in registers (OP_ATT_AVX2_FUSED).
     * fused_block: one key block kb..kb+n-1 for the R rows of an item, each
     * row's online softmax in S, O, M, L; vis[r]: the keys row r sees; qr:
     * the rows' queries, qc / qd as int8 for q8_0 / q4_0 keys; W: H2O's raw
     * scores or NULL; vnni: q8_0 rows through op_att_qkey_scores_avx512 /
     * op_att_qval_pv_avx512 (hd % 64 == 0). */
    bool (*fused_ok)(const op_attn_args *a);
    void (*fused_block)(const op_attn_args *a, int h, int kb, int n, int R, const int *vis, const float *const *qr,
                        const int8_t *qc, const float *qd, float *S, float *O, float *M, float *L, float *QS,
                        float *const *W, bool vnni);
    void (*prefetch_rows)(const op_attn_args *a, int h, int p0, int n); /* K and V rows of KV head h */
    /* the 16-key tile (OP_ATT_VNNI_TILE) for items of R rows that tile_ok
     * takes; arguments as fused_block's, k_end bounds its prefetch */
    bool (*tile_ok)(const op_attn_args *a, int R);
    void (*tile)(const op_attn_args *a, int h, int kb, int n, int R, const int *vis, const float *const *qr,
                 const int8_t *qc, const float *qd, float *S, float *O, float *M, float *L, float *const *W,
                 int k_end);
} op_att_kernels;

extern const op_att_kernels op_att_kernels_scalar, op_att_kernels_avx2, op_att_kernels_avx512;
/* The kernels at a SIMD level, the gaps filled from the levels below. */
const op_att_kernels *op_att_kernels_at(int level);

/* Scalar dequantizers (the reference's, attention_scalar.c). */
void op_att_deq_rows_scalar(int type, const uint8_t *src, float *y, int n_rows, int hd);
void op_att_f16_to_f32_scalar(const uint16_t *x, float *y, size_t n);
/* AVX-512 VNNI rows of q8_0 keys (scores of n keys rb bytes apart against
 * the query's codes qc and scales qd) and values (o += sum p[j] v_j), which
 * the AVX2 fused block uses on CPUs that have them (attention_avx512.c). */
void op_att_qkey_scores_avx512(float *s, const int8_t *qc, const float *qd, const uint8_t *k, size_t rb, int n,
                               int hd, float scale);
void op_att_qval_pv_avx512(float *o, const float *p, const uint8_t *v, size_t rb, int n, int hd);
#endif
