/* engine/decode: kvlm_decode: a batch checked and split by sequence, room made
 * by eviction, speculative tokens taken and rolled back, then the forward pass. */
#include <stdlib.h>
#include <string.h>
#include "kv/evict.h"
#include "kv/store.h"
#include "model/model.h"
#include "ops/backend.h"
#include "util/error.h"
#include "util/timing.h"
#include "engine/ctx.h"
#include "engine/engine.h"
#include "engine/forward.h"
#include "engine/forward_enc.h"

/* Room for n_emb more hidden states after the n_embd held. */
static int grow_embd(kvlm_ctx *ctx, int n_emb) {
    if (ctx->rs.n_embd + n_emb <= ctx->rs.embd_cap) return 0;
    float *e = realloc(ctx->rs.embd, (size_t)(ctx->rs.n_embd + n_emb) * ctx->model->cfg.dim * sizeof(float));
    if (!e) return -1;
    ctx->rs.embd = e;
    ctx->rs.embd_cap = ctx->rs.n_embd + n_emb;
    return 0;
}

static int grow_batch_arrays(kvlm_ctx *ctx, int n, int n_want) {
    if (n_want > ctx->rs.logits_cap) {
        float *nl = realloc(ctx->rs.logits, (size_t)n_want * ctx->model->cfg.vocab_size * sizeof(float));
        if (!nl) return -1;
        ctx->rs.logits = nl;
        ctx->rs.logits_cap = n_want;
    }
    int32_t *a = realloc(ctx->rs.tok_seq, (size_t)n * sizeof(int32_t));
    if (!a) return -1;
    ctx->rs.tok_seq = a;
    int32_t *b = realloc(ctx->rs.tok_pos, (size_t)n * sizeof(int32_t));
    if (!b) return -1;
    ctx->rs.tok_pos = b;
    return 0;
}

/* RoPE composes: rotating a key of position p by -shift gives position p - shift. */
static void rekey(void *user, float *keys, int n_rows, int shift) {
    const kvlm_ctx *ctx = user;
    const kvlm_config *c = &ctx->model->cfg;
    if (c->arch == KVLM_ARCH_DEEPSEEK2) { /* latent rows: only the shared key part at their end turns */
        int W = kv_store_params_of(ctx->kv)->head_dim;
        op_backend_cpu()->rope(keys + c->kv_lora_rank, n_rows, W, c->rope_dim, -shift, c->rope_base, NULL, false);
        return;
    }
    /* rows: layer after layer, n_kv_heads each; smollm3's NoPE layers' keys hold no position */
    for (int l = 0, H = c->n_kv_heads; l * H < n_rows; l++)
        if (model_layer_rope(c, l))
            op_backend_cpu()->rope(keys + (size_t)l * H * c->head_dim, H, c->head_dim, c->rope_dim, -shift, c->rope_base,
                                   ctx->rope_freqs, c->rope_neox);
}

/* Makes room for n_new tokens of sequence s within the budget: evicts by the
 * context's policy down to budget - max(n_new, block_size) tokens (amortised:
 * a compaction every block_size tokens), or fails under none. */
static int evict_for(kvlm_ctx *ctx, int s, int n_new, kvlm_error *err) {
    int len = kv_store_seq_len(ctx->kv, s), budget = ctx->evict.budget, bs = kv_store_params_of(ctx->kv)->block_size;
    if (len + n_new <= budget) return KVLM_OK;
    if (ctx->spec.seq && ctx->spec.seq[s].on && ctx->spec.seq[s].from >= 0 && len > ctx->spec.seq[s].from)
        return util_err_set(err, KVLM_ERANGE, "sequence %d: %d unverified tokens and %d more exceed the KV budget of %d; "
                            "trim (kvlm_seq_trim) before it evicts", s, len - ctx->spec.seq[s].from, n_new, budget);
    if (ctx->evict.ev.policy == KVLM_EVICT_NONE)
        return util_err_set(err, KVLM_ERANGE, "sequence %d: %d more tokens exceed the KV budget of %d tokens (%d held; "
                            "eviction policy none stops there: window, sinks or h2o evict instead)", s, n_new, budget, len);
    int min_keep = ctx->evict.ev.policy == KVLM_EVICT_SINKS ? ctx->evict.ev.sinks : 0;
    if (n_new > budget - min_keep)
        return util_err_set(err, KVLM_ERANGE, "sequence %d: a batch of %d tokens cannot fit a KV budget of %d under "
                            "eviction policy %s (feed at most %d at a time)", s, n_new, budget,
                            kvlm_evict_name(ctx->evict.ev.policy), budget - min_keep);
    int target = budget - (n_new > bs ? n_new : bs);
    if (target < min_keep) target = budget - n_new;
    double t_start = util_now_s();
    float *sc = h2o_scores(ctx, s);
    if (kv_evict_select(&ctx->evict.ev, len, target, sc, ctx->evict.keep) != target)
        return util_err_set(err, KVLM_ENOMEM, "out of memory choosing tokens to evict");
    int rc = kv_store_compact(ctx->kv, s, ctx->evict.keep, target, rekey, ctx, err);
    if (rc) return rc;
    if (sc) {
        for (int i = 0; i < target; i++) sc[i] = sc[ctx->evict.keep[i]];
        memset(sc + target, 0, (size_t)(len - target) * sizeof(float));
    }
    ctx->evict.n_evicted[s] += len - target;
    ctx->stats.evict_seconds += util_now_s() - t_start;
    return KVLM_OK;
}

/* What token i of b asks for (kvlm_batch.logits): its logits, its hidden state. */
static bool wants_logits(const kvlm_batch *b, int i) {
    return b->logits ? b->logits[i] != 0 && b->logits[i] != KVLM_OUTPUT_EMBD : i == b->n_tokens - 1;
}
static bool wants_embd(const kvlm_batch *b, int i) {
    return b->logits && (b->logits[i] == KVLM_OUTPUT_EMBD || b->logits[i] == KVLM_OUTPUT_BOTH);
}

/* --no-kv-cache: forget the sequence's keys and values and recompute the
 * whole sequence from its first token. */
static int decode_recompute(kvlm_ctx *ctx, const kvlm_batch *b, int seq, kvlm_error *err) {
    int past = kv_store_seq_len(ctx->kv, seq), n = past + b->n_tokens;
    int32_t *all = malloc((size_t)n * sizeof(int32_t));
    int8_t *want = calloc((size_t)n * 2, 1), *emb = want ? want + n : NULL;
    int rc = KVLM_OK;
    if (!all || !want || grow_batch_arrays(ctx, n, ctx->rs.n_logits + n) || grow_embd(ctx, b->n_tokens)) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    if (past) memcpy(all, kv_store_seq_tokens(ctx->kv, seq), (size_t)past * sizeof(int32_t));
    memcpy(all + past, b->tokens, (size_t)b->n_tokens * sizeof(int32_t));
    bool any_emb = false;
    for (int i = 0; i < b->n_tokens; i++) {
        want[past + i] = wants_logits(b, i);
        any_emb |= emb[past + i] = wants_embd(b, i);
    }
    kv_store_release(ctx->kv, seq);
    if ((rc = kv_store_reserve(ctx->kv, seq, n, err))) goto done;
    for (int i = 0; i < n; i++) { ctx->rs.tok_seq[i] = seq; ctx->rs.tok_pos[i] = i; }
    if ((rc = eng_forward(ctx, all, ctx->rs.tok_seq, ctx->rs.tok_pos, n, want, any_emb ? emb : NULL, err))) {
        kv_store_release(ctx->kv, seq);
        goto done;
    }
    kv_store_commit(ctx->kv, seq, all, n);
done:
    free(all);
    free(want);
    return rc;
}

static int decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err);
/* A speculating sequence about to take n more tokens (after any eviction):
 * its first unverified position, the blocks held from it, and h2o rows. */
static int spec_prepare(kvlm_ctx *ctx, int s, int n, kvlm_error *err) {
    if (!ctx->spec.seq || !ctx->spec.seq[s].on) return KVLM_OK;
    spec_seq *sp = &ctx->spec.seq[s];
    int len = kv_store_seq_len(ctx->kv, s);
    if (sp->from < 0) {
        sp->from = len;
        kv_store_hold(ctx->kv, s, len);
    }
    if (!ctx->evict.h2o) return KVLM_OK;
    int need = len + n - sp->from;
    if (need > sp->rows_cap) {
        float *r = realloc(sp->rows, (size_t)need * ctx->evict.budget * sizeof(float));
        if (!r) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        sp->rows = r;
        sp->rows_cap = need;
    }
    memset(sp->rows + (size_t)(len - sp->from) * ctx->evict.budget, 0, (size_t)n * ctx->evict.budget * sizeof(float));
    return KVLM_OK;
}

int kvlm_decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    ctx->rs.n_logits = 0;
    ctx->rs.n_embd = 0;
    return decode(ctx, b, err);
}

/* A sliding-window cache holds a sequence's window and one step of at most
 * n_batch tokens (its pools are sized so): a longer batch goes through in
 * slices of n_batch, each committed before the next (so a failure leaves
 * the slices before it appended). */
static int decode_sliced(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    int n = b->n_tokens, rc = KVLM_OK;
    int8_t *want = malloc((size_t)n);
    if (!want) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) want[i] = (int8_t)(wants_logits(b, i) | wants_embd(b, i) << 1);
    for (int i0 = 0; i0 < n && !rc; i0 += ctx->n_batch) {
        kvlm_batch sb = {n - i0 < ctx->n_batch ? n - i0 : ctx->n_batch, b->tokens + i0, b->pos ? b->pos + i0 : NULL,
                         want + i0, b->seq ? b->seq + i0 : NULL};
        rc = decode(ctx, &sb, err);
    }
    free(want);
    return rc;
}

/* An encoder's batch (bert, nomic-bert), checked by decode: each sequence's
 * tokens, adjacent in the batch, are a whole input at positions 0, 1, ...
 * (decode has checked them against an empty cache); chunks of at most
 * n_batch tokens take whole sequences (n_batch >= n_ctx >= any of them).
 * The hidden states asked for go to ctx->rs.embd; nothing is kept. */
static int decode_encoder(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    int n = b->n_tokens, rc = KVLM_OK;
    int8_t *emb = malloc((size_t)n);
    if (!emb) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) emb[i] = wants_embd(b, i);
    for (int i = 0; i < n && !rc; i++) /* logits NULL asks for the last token's */
        if (wants_logits(b, i))
            rc = util_err_set(err, KVLM_EINVAL, "%s is an encoder: it gives no logits (ask for its hidden states: "
                              "KVLM_OUTPUT_EMBD)", model_arch_name(ctx->model->cfg.arch));
    if (!rc && grow_batch_arrays(ctx, n, 0)) rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
    int set = 0;
    for (int i = 0; i < n && !rc; i++, set++) {
        int s = b->seq ? b->seq[i] : ctx->seq_lo;
        bool starts = i == 0 || ctx->rs.tok_seq[i - 1] != s;
        if (starts && ctx->rs.seq_at[s] >= 0)
            rc = util_err_set(err, KVLM_EINVAL, "batch index %d: an encoder takes each sequence's tokens together "
                              "(sequence %d came before)", i, s);
        ctx->rs.seq_at[s] = 0;
        ctx->rs.tok_seq[i] = s;
        ctx->rs.tok_pos[i] = starts ? 0 : ctx->rs.tok_pos[i - 1] + 1;
    }
    for (int i = 0; i < set; i++) ctx->rs.seq_at[ctx->rs.tok_seq[i]] = -1;
    if (rc) { free(emb); return rc; }
    double t0 = util_now_s();
    for (int i0 = 0; i0 < n;) {
        int T = 0;
        while (i0 + T < n) { /* the next whole sequence, if it fits */
            int k = i0 + T + 1;
            while (k < n && ctx->rs.tok_seq[k] == ctx->rs.tok_seq[i0 + T]) k++;
            if (T && k - i0 > ctx->n_batch) break;
            T = k - i0;
        }
        ctx->rs.n_embd += engine_enc_forward(ctx->be.enc, ctx->pool, b->tokens + i0, ctx->rs.tok_seq + i0, ctx->rs.tok_pos + i0, T,
                                          emb + i0,
                                          ctx->rs.embd + (size_t)ctx->rs.n_embd * ctx->model->cfg.dim, &ctx->stats.attn_seconds);
        ctx->stats.tokens_computed += (uint64_t)T;
        i0 += T;
    }
    ctx->stats.compute_seconds += util_now_s() - t0;
    free(emb);
    return KVLM_OK;
}

static int decode(kvlm_ctx *ctx, const kvlm_batch *b, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    if (!b || b->n_tokens <= 0 || !b->tokens) return util_err_set(err, KVLM_EINVAL, "empty batch");
    int n = b->n_tokens, n_seq = ctx->seq_end;
    int *count = calloc((size_t)n_seq, sizeof(int));
    int *order = malloc((size_t)n_seq * sizeof(int)); /* sequences in order of first appearance */
    int n_order = 0, rc = KVLM_OK, n_want = 0, n_emb = 0;
    if (!count || !order) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    for (int i = 0; i < n; i++) {
        int s = b->seq ? b->seq[i] : ctx->seq_lo;
        if (!seq_ok(ctx, s)) {
            rc = util_err_set(err, KVLM_EINVAL, "batch index %d: sequence %d is outside %d..%d", i, s, ctx->seq_lo,
                              n_seq - 1);
            goto done;
        }
        if (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size) {
            rc = util_err_set(err, KVLM_EINVAL, "token %d at batch index %d is outside the vocabulary (0..%d)",
                              b->tokens[i], i, c->vocab_size - 1);
            goto done;
        }
        int expect = kv_store_seq_len(ctx->kv, s) + count[s];
        if (b->pos && ctx->evict.ev.policy != KVLM_EVICT_NONE) {
            rc = util_err_set(err, KVLM_EINVAL, "under an eviction policy the cache assigns positions: pass pos NULL");
            goto done;
        }
        if (b->pos && b->pos[i] != expect) {
            rc = util_err_set(err, KVLM_EINVAL, "batch index %d: position %d, expected %d for sequence %d", i,
                              b->pos[i], expect, s);
            goto done;
        }
        if (count[s]++ == 0) order[n_order++] = s;
        n_want += wants_logits(b, i);
        n_emb += wants_embd(b, i);
    }
    if (n_emb && (ctx->be.cuda || ctx->be.mla)) {
        rc = util_err_set(err, KVLM_EUNSUPPORTED, "embeddings (hidden states) are computed on the CPU and not for "
                          "deepseek2's latent attention");
        goto done;
    }
    if (grow_embd(ctx, n_emb)) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    for (int k = 0; k < n_order; k++) {
        int s = order[k];
        if ((ctx->evict.ev.policy != KVLM_EVICT_NONE || ctx->evict.budget < ctx->p.n_ctx) && (rc = evict_for(ctx, s, count[s], err)))
            goto done;
        if (kv_store_seq_len(ctx->kv, s) + count[s] > ctx->p.n_ctx) {
            rc = util_err_set(err, KVLM_ERANGE, "sequence %d: %d tokens do not fit in the context of %d (%d already used)",
                              s, count[s], ctx->p.n_ctx, kv_store_seq_len(ctx->kv, s));
            goto done;
        }
        if ((rc = spec_prepare(ctx, s, count[s], err))) goto done;
    }
    if (c->encoder) { /* no cache: the whole of each sequence now, nothing kept */
        rc = decode_encoder(ctx, b, err);
        goto done;
    }
    if (ctx->p.no_kv_cache) {
        if (n_order != 1) { rc = util_err_set(err, KVLM_EINVAL, "--no-kv-cache runs one sequence per batch"); goto done; }
        rc = decode_recompute(ctx, b, order[0], err);
        goto done;
    }
    if (n > ctx->n_batch && c->sliding_window > 0 && c->n_local_layers > 0) {
        rc = decode_sliced(ctx, b, err);
        goto done;
    }
    if (grow_batch_arrays(ctx, n, ctx->rs.n_logits + n_want)) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    /* Reserve every sequence's slots first: all or nothing. */
    for (int k = 0; k < n_order; k++) {
        if ((rc = kv_store_reserve(ctx->kv, order[k], count[order[k]], err))) {
            for (int j = 0; j < k; j++) kv_store_trim(ctx->kv, order[j], kv_store_seq_len(ctx->kv, order[j]));
            goto done;
        }
    }
    memset(count, 0, (size_t)n_seq * sizeof(int));
    int8_t *want = malloc((size_t)n * 2), *emb = want ? want + n : NULL;
    if (!want) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    for (int i = 0; i < n; i++) {
        int s = b->seq ? b->seq[i] : ctx->seq_lo;
        ctx->rs.tok_seq[i] = s;
        ctx->rs.tok_pos[i] = kv_store_seq_len(ctx->kv, s) + count[s]++;
        want[i] = wants_logits(b, i);
        emb[i] = wants_embd(b, i);
    }
    rc = eng_forward(ctx, b->tokens, ctx->rs.tok_seq, ctx->rs.tok_pos, n, want, n_emb ? emb : NULL, err);
    free(want);
    if (rc) { /* a device error: nothing is appended */
        for (int k = 0; k < n_order; k++) kv_store_trim(ctx->kv, order[k], kv_store_seq_len(ctx->kv, order[k]));
        goto done;
    }
    /* Commit each sequence's tokens in order (indexes blocks that filled). */
    for (int k = 0; k < n_order; k++) {
        int s = order[k], m = 0;
        int32_t *toks = ctx->rs.tok_pos; /* reuse as scratch: positions are no longer needed */
        for (int i = 0; i < n; i++)
            if (ctx->rs.tok_seq[i] == s) toks[m++] = b->tokens[i];
        kv_store_commit(ctx->kv, s, toks, m);
    }
done:
    free(count);
    free(order);
    return rc;
}

/* ---- speculative decoding: unverified tokens and rollback ---- */

int kvlm_seq_spec_begin(kvlm_ctx *ctx, int seq, kvlm_error *err) {
    if (!seq_ok(ctx, seq)) return bad_seq(ctx, err);
    if (ctx->p.no_kv_cache)
        return util_err_set(err, KVLM_EUNSUPPORTED, "speculative decoding needs the KV cache (not --no-kv-cache)");
    /* rollback of GPU-resident blocks has not run on a GPU yet (docs/cuda.md) */
    if (ctx->be.cuda)
        return util_err_set(err, KVLM_EUNSUPPORTED, "speculative decoding runs on the CPU only (not --device cuda yet)");
    if (!ctx->spec.seq) {
        ctx->spec.seq = calloc((size_t)ctx->seq_end, sizeof *ctx->spec.seq);
        if (!ctx->spec.seq) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        for (int s = 0; s < ctx->seq_end; s++) ctx->spec.seq[s].from = -1;
    }
    if (!ctx->spec.seq[seq].on) {
        ctx->spec.seq[seq].on = true;
        ctx->spec.seq[seq].from = -1;
    }
    return KVLM_OK;
}

int kvlm_seq_trim(kvlm_ctx *ctx, int seq, int n_keep, kvlm_error *err) {
    if (!seq_ok(ctx, seq)) return bad_seq(ctx, err);
    int len = kv_store_seq_len(ctx->kv, seq);
    spec_seq *sp = ctx->spec.seq && ctx->spec.seq[seq].on ? &ctx->spec.seq[seq] : NULL;
    int from = sp && sp->from >= 0 ? sp->from : len;
    if (n_keep < 0 || n_keep > len)
        return util_err_set(err, KVLM_EINVAL, "sequence %d holds %d tokens: cannot keep %d", seq, len, n_keep);
    if (sp && n_keep < from)
        return util_err_set(err, KVLM_EINVAL, "sequence %d: cannot keep %d tokens, fewer than the %d verified ones",
                            seq, n_keep, from);
    if (!sp && ctx->evict.h2o && n_keep < len)
        return util_err_set(err, KVLM_EINVAL, "sequence %d: under h2o the scores hold what the tokens to drop attended; "
                            "mark them unverified first (kvlm_seq_spec_begin)", seq);
    if (ctx->p.no_kv_cache && n_keep < len)
        return util_err_set(err, KVLM_EUNSUPPORTED, "--no-kv-cache keeps no cache to take back");
    int rc = kv_store_rollback(ctx->kv, seq, n_keep, err);
    if (rc) return rc;
    if (sp) {
        float *sc = h2o_scores(ctx, seq);
        /* the kept tokens' attention, in their order, as if fed one by one */
        for (int r = 0; sc && !ctx->spec.h2o_direct && r < n_keep - from; r++) {
            const float *row = sp->rows + (size_t)r * ctx->evict.budget;
            for (int i = 0; i <= from + r; i++) sc[i] += row[i];
        }
        sp->on = false;
        sp->from = -1;
    }
    return KVLM_OK;
}

const float *kvlm_get_embeddings(kvlm_ctx *ctx, int i) {
    if (i < 0) i = ctx->rs.n_embd - 1;
    if (i < 0 || i >= ctx->rs.n_embd) return NULL;
    return ctx->rs.embd + (size_t)i * ctx->model->cfg.dim;
}

const float *kvlm_get_logits(kvlm_ctx *ctx, int i) {
    if (i < 0) i = ctx->rs.n_logits - 1;
    if (i < 0 || i >= ctx->rs.n_logits) return NULL;
    return ctx->rs.logits + (size_t)i * ctx->model->cfg.vocab_size;
}

const float *engine_h2o_scores(const kvlm_ctx *ctx, int seq) {
    return seq_ok(ctx, seq) ? h2o_scores(ctx, seq) : NULL;
}

int engine_seq_fill_synthetic(kvlm_ctx *ctx, int seq, int n, uint64_t seed, kvlm_error *err) {
    const kvlm_config *c = &ctx->model->cfg;
    if (!seq_ok(ctx, seq) || n < 0) return util_err_set(err, KVLM_EINVAL, "bad sequence or count");
    if (ctx->be.cuda) return util_err_set(err, KVLM_EUNSUPPORTED, "synthetic fill writes the cache from the CPU");
    if (ctx->host && !same_cache_shape(c, &ctx->host->model->cfg))
        return util_err_set(err, KVLM_EUNSUPPORTED, "synthetic fill writes rows of the pool's own layout");
    if (grow_batch_arrays(ctx, ctx->n_batch, 0)) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    int rc;
    const kv_params *kp = kv_store_params_of(ctx->kv); /* a latent cache: one row of its own width */
    int n_kv_heads = kp->n_kv_heads, head_dim = kp->head_dim;
    size_t kv_dim = (size_t)n_kv_heads * head_dim;
    uint64_t s = seed * 2654435761u + 1;
    for (int done = 0; done < n;) {
        int T = n - done < ctx->n_batch ? n - done : ctx->n_batch, past = kv_store_seq_len(ctx->kv, seq);
        /* a chunk at a time: a sliding-window cache releases blocks at each commit */
        if ((rc = kv_store_reserve(ctx->kv, seq, T, err))) return rc;
        for (int t = 0; t < T; t++) {
            ctx->rs.tok_seq[t] = seq;
            ctx->rs.tok_pos[t] = past + t;
        }
        for (int l = 0; l < c->n_layers; l++) {
            for (size_t i = 0; i < (size_t)T * kv_dim; i++) {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                ctx->rs.k[i] = (float)((s >> 40) * (2.0 / 16777216.0)) - 1.0f;
                ctx->rs.v[i] = (float)(((s >> 16) & 0xffffff) * (2.0 / 16777216.0)) - 1.0f;
            }
            for (int t = 0; t < T; t++)
                for (int h = 0; h < n_kv_heads; h++) {
                    size_t row = ((size_t)t * n_kv_heads + h) * head_dim;
                    kv_store_write_row(ctx->kv, l, seq, past + t, h, ctx->rs.k + row, ctx->rs.v + row);
                }
        }
        kv_store_rows_written(ctx->kv, ctx->rs.tok_seq, ctx->rs.tok_pos, T);
        for (int t = 0; t < T; t++) ctx->rs.tok_pos[t] = 3 + (past + t) % (c->vocab_size - 3);
        kv_store_commit(ctx->kv, seq, ctx->rs.tok_pos, T);
        done += T;
    }
    return KVLM_OK;
}
