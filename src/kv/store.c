/* kv/store: the facade over the block pool (kv/paged): the engine's write
 * path and attention view, the scheduler's admission probe, sequence
 * operations, and which block of each sequence keeps q4_kc keys in staging. */
#include "kv/store.h"
#include <stdlib.h>
#include <string.h>
#include "model/dtype.h"
#include "ops/kvtype.h"
#include "util/error.h"

struct kv_store {
    kv_cache *c;
    kv_params p;           /* the pool's, as it settled them */
    size_t k_row, v_row;   /* bytes of one token's row of one head (per-token types) */
    int *stage_block;      /* per sequence: q4_kc keys' block still filling, -1: none */
};

kv_store *kv_store_create(const kv_store_params *p, kvlm_error *err) {
    kv_store *s = calloc(1, sizeof *s);
    if (!s) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    s->c = kv_create(&p->pool, err);
    if (!s->c) { free(s); return NULL; }
    s->p = *kv_get_params(s->c);
    s->k_row = op_kv_row_bytes(s->p.k_type, s->p.head_dim);
    s->v_row = op_kv_row_bytes(s->p.v_type, s->p.head_dim);
    s->stage_block = malloc((size_t)s->p.max_seqs * sizeof(int));
    if (!s->stage_block) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        kv_store_free(s);
        return NULL;
    }
    for (int i = 0; i < s->p.max_seqs; i++) s->stage_block[i] = -1;
    return s;
}

void kv_store_free(kv_store *s) {
    if (!s) return;
    kv_free(s->c);
    free(s->stage_block);
    free(s);
}

const kv_params *kv_store_params_of(const kv_store *s) { return &s->p; }
kv_cache *kv_store_pool(kv_store *s) { return s->c; }

/* ---- sequences ---- */

bool kv_store_seq_valid(const kv_store *s, int seq) { return kv_seq_valid(s->c, seq); }
int kv_store_seq_len(const kv_store *s, int seq) { return kv_seq_len(s->c, seq); }
const int32_t *kv_store_seq_tokens(const kv_store *s, int seq) { return kv_seq_tokens(s->c, seq); }
int kv_store_reserve(kv_store *s, int seq, int n_new, kvlm_error *err) { return kv_seq_reserve(s->c, seq, n_new, err); }
void kv_store_trim(kv_store *s, int seq, int n_keep) { kv_seq_trim(s->c, seq, n_keep); }
void kv_store_commit(kv_store *s, int seq, const int32_t *tokens, int n) { kv_seq_commit(s->c, seq, tokens, n); }
void kv_store_release(kv_store *s, int seq) { kv_seq_release(s->c, seq); }
int kv_store_fork(kv_store *s, int src, int dst, kvlm_error *err) {
    int rc = kv_seq_fork(s->c, src, dst, err);
    if (!rc) s->stage_block[dst] = s->stage_block[src];
    return rc;
}
int kv_store_match_prefix(kv_store *s, int seq, const int32_t *tokens, int n) {
    return kv_seq_match_prefix(s->c, seq, tokens, n);
}

int kv_store_compact(kv_store *s, int seq, const int32_t *keep, int n_keep, kv_rekey_fn rekey, void *user,
                     kvlm_error *err) {
    int rc = kv_seq_compact(s->c, seq, keep, n_keep, rekey, user, err);
    if (rc) return rc;
    /* q4_kc: a partial last block's keys now sit in the staging */
    int bs = s->p.block_size;
    s->stage_block[seq] = s->p.k_type == KVLM_CACHE_Q4_KC && n_keep % bs ? n_keep / bs : -1;
    return KVLM_OK;
}

/* ---- the write path and the attention view ---- */

void kv_store_write_row(kv_store *s, int layer, int seq, int pos, int head, const float *k, const float *v) {
    int HD = s->p.head_dim, bs = s->p.block_size, slot = pos % bs;
    int32_t b = kv_seq_blocks(s->c, seq, NULL)[pos / bs];
    if (s->p.k_type == KVLM_CACHE_Q4_KC) {
        uint16_t *st = kv_seq_stage(s->c, seq, layer, head);
        for (int i = 0; i < HD; i++) st[(size_t)slot * HD + i] = dt_f32_to_f16(k[i]);
        if (slot == bs - 1) op_kv_quantize_kc(st, kv_block_k(s->c, b, layer, head), HD, bs, bs);
    } else op_kv_quantize_row(s->p.k_type, k, kv_block_k(s->c, b, layer, head) + slot * s->k_row, HD);
    op_kv_quantize_row(s->p.v_type, v, kv_block_v(s->c, b, layer, head) + slot * s->v_row, HD);
}

void kv_store_rows_written(kv_store *s, const int32_t *seq, const int32_t *pos, int T) {
    int bs = s->p.block_size;
    bool kc = s->p.k_type == KVLM_CACHE_Q4_KC;
    for (int t = 0; t < T; t++) s->stage_block[seq[t]] = kc && pos[t] % bs != bs - 1 ? pos[t] / bs : -1;
}

void kv_store_attn_view(const kv_store *s, int layer, int seq, int last_pos, const float **bp, op_attn_args *a) {
    const int32_t *blocks = kv_seq_blocks(s->c, seq, NULL);
    int need = last_pos / s->p.block_size + 1;
    for (int i = 0; i < need; i++) bp[i] = (const float *)kv_block_k(s->c, blocks[i], layer, 0);
    a->blocks = bp;
    a->block_size = s->p.block_size;
    a->k_type = s->p.k_type;
    a->v_type = s->p.v_type;
    a->head_bytes = kv_head_bytes(s->c);
    a->v_bytes = kv_v_offset_bytes(s->c);
    a->k_stage = kv_seq_stage(s->c, seq, layer, 0);
    /* the sequence's newest block holds keys in staging only while it
     * fills; blocks before it were quantized when they filled */
    a->stage_block = a->k_stage ? s->stage_block[seq] : -1;
    if (a->stage_block >= need) a->stage_block = -1;
}

/* ---- admission ---- */

static int blocks_for(const kv_store *s, int n) { return (n + s->p.block_size - 1) / s->p.block_size; }

void kv_store_probe_prefix(const kv_store *s, const int32_t *tokens, int n_lookup, int n_hold, kv_store_probe *out) {
    memset(out, 0, sizeof *out);
    int unref = 0, matched = n_lookup > 0 ? kv_prefix_probe(s->c, tokens, n_lookup, &unref) : 0;
    out->ram_tokens = matched * s->p.block_size;
    out->cached_tokens = out->ram_tokens;
    out->blocks_needed = blocks_for(s, n_hold) - matched;
    if (out->blocks_needed < 0) out->blocks_needed = 0;
    out->blocks_available = kv_available_blocks(s->c) - unref;
}

int kv_store_seq_blocks_needed(const kv_store *s, int seq, int n_hold) {
    int have = 0;
    kv_seq_blocks(s->c, seq, &have);
    int need = blocks_for(s, n_hold) - have;
    return need > 0 ? need : 0;
}

void kv_store_seq_info(const kv_store *s, int seq, int *n_blocks, int *n_shared) {
    int n = 0, shared = 0;
    const int32_t *b = kv_seq_blocks(s->c, seq, &n);
    for (int i = 0; i < n; i++) shared += kv_block_refs(s->c, b[i]) > 1;
    if (n_blocks) *n_blocks = n;
    if (n_shared) *n_shared = shared;
}

/* ---- sizes and statistics ---- */

size_t kv_store_block_bytes(const kv_store *s) { return kv_block_bytes(s->c); }
size_t kv_store_token_bytes(const kv_store *s) { return kv_token_bytes(s->c); }
size_t kv_store_stage_bytes(const kv_store *s) { return kv_stage_bytes(s->c); }
void kv_store_stats(const kv_store *s, kv_stats *st) { kv_get_stats(s->c, st); }
