/* engine/spec_draft: a draft model proposing for every running sequence of
 * the scheduler together: one draft kvlm_ctx, its sequence ids the target's,
 * one batched catch-up then one batched decode per draft round. */
#include "engine/spec_draft.h"
#include <stdlib.h>
#include <string.h>
#include "engine/engine.h"
#include "engine/spec.h"
#include "ops/kvtype.h"
#include "util/error.h"
#include "util/log.h"

struct spec_drafter {
    kvlm_ctx *target, *draft;
    int n_seq, vocab, limit;        /* limit: tokens a draft sequence may hold (its budget) */
    int lo;                         /* the draft context's id of the target's sequence 0 (kvlm_ctx_seq_first) */
    float p_min;                    /* a sequence's drafts end before a token the draft is less sure of */
    bool shared;                    /* the draft context's cache is the target's pool (kvlm_ctx_create_draft) */
    int *base;                      /* per sequence: its length at spec_begin; -1: holds no drafts */
    int *off;                       /* per sequence: the text's token at its position 0 (a window past its
                                       context: the text outgrew the draft's, which does not evict) */
    int *n_fed;                     /* drafts fed since base */
    int32_t (*fed)[SPEC_DRAFT_MAX]; /* ... and which */
    int32_t *tok, *bseq;            /* batch scratch, grown as needed */
    int8_t *want;
    int cap;
    int32_t *ids;                   /* vocabulary-sized scratch for sampled drafts */
    float *probs;
    int *pre;                       /* per request: its draft length before the batch; -1: not in it */
    int n_pre;
    bool *live;                     /* per request: drafting this step */
    bool *cand;                     /* per request: may take part in the catch-up */
    uint64_t steps, failures, released, windows, waits;
};

/* Request r's draft number k after the draft's logits l (spec_draft_pick);
 * -1: the draft is less sure of it than p_min, its drafts end there. */
static int32_t pick(spec_drafter *d, spec_draft_req *r, int k, const float *l) {
    return spec_draft_pick(r->smp, l, d->vocab, r->q ? r->q + (size_t)k * (size_t)d->vocab : NULL, d->ids, d->probs,
                           d->p_min);
}

spec_drafter *spec_drafter_create(kvlm_ctx *target, kvlm_ctx *draft, float p_min, kvlm_error *err) {
    if (!target || !draft || target == draft) {
        util_err_set(err, KVLM_EINVAL, "draft speculation needs the draft model's own context");
        return NULL;
    }
    if (spec_same_vocab(kvlm_ctx_model(target), kvlm_ctx_model(draft), err)) return NULL;
    if (spec_check_p_min(p_min, err)) return NULL;
    if (kvlm_ctx_kv_evict(draft) != KVLM_EVICT_NONE) {
        util_err_set(err, KVLM_EINVAL, "the draft model's context must not evict (its drafts are taken back)");
        return NULL;
    }
    kvlm_kv_stats ds;
    kvlm_kv_stats_get(draft, &ds);
    if (op_kv_in_order(ds.type_k)) {
        util_err_set(err, KVLM_EUNSUPPORTED, "the draft model's cache cannot have %s keys (its drafts are taken "
                     "back across blocks)", op_kv_type_name(ds.type_k));
        return NULL;
    }
    if (kvlm_ctx_n_seq_max(draft) < kvlm_ctx_n_seq_max(target)) {
        util_err_set(err, KVLM_EINVAL, "the draft context holds %d sequences, the model's %d: it needs as many",
                     kvlm_ctx_n_seq_max(draft), kvlm_ctx_n_seq_max(target));
        return NULL;
    }
    spec_drafter *d = calloc(1, sizeof *d);
    if (!d) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    d->target = target;
    d->draft = draft;
    d->p_min = p_min;
    d->lo = kvlm_ctx_seq_first(draft);
    d->shared = engine_ctx_host(draft) == target;
    d->n_seq = kvlm_ctx_n_seq_max(target);
    d->vocab = kvlm_vocab_size(kvlm_ctx_model(draft));
    d->limit = kvlm_ctx_kv_budget(draft);
    d->base = malloc((size_t)d->n_seq * sizeof *d->base);
    d->off = calloc((size_t)d->n_seq, sizeof *d->off);
    d->n_fed = calloc((size_t)d->n_seq, sizeof *d->n_fed);
    d->fed = calloc((size_t)d->n_seq, sizeof *d->fed);
    d->ids = malloc((size_t)d->vocab * sizeof *d->ids);
    d->probs = malloc((size_t)d->vocab * sizeof *d->probs);
    if (!d->base || !d->off || !d->n_fed || !d->fed || !d->ids || !d->probs) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        spec_drafter_free(d);
        return NULL;
    }
    for (int i = 0; i < d->n_seq; i++) {
        d->base[i] = -1;
        kvlm_seq_free(draft, d->lo + i); /* the ids are the target's from now on */
    }
    return d;
}

void spec_drafter_free(spec_drafter *d) {
    if (!d) return;
    free(d->base); free(d->off); free(d->n_fed); free(d->fed); free(d->ids); free(d->probs);
    free(d->tok); free(d->bseq); free(d->want);
    free(d->pre); free(d->live); free(d->cand);
    free(d);
}

/* Blocks the pool could hand out now: free, or cached for prefix reuse (of
 * the store the sequences' admission counts: gemma's global layers'). */
static int room(const spec_drafter *d) {
    kvlm_prefix_probe pr;
    kvlm_seq_probe_prefix(d->target, NULL, 0, 0, &pr);
    return pr.blocks_available;
}

int spec_drafter_release(spec_drafter *d, int want) {
    if (!d || !d->shared) return 0;
    int n = 0, before = room(d);
    for (;;) { /* the sequence holding the most tokens first: the fewest drop out */
        int pick = -1, most = 0;
        for (int i = 0; i < d->n_seq; i++) {
            int np = kvlm_seq_n_past(d->draft, d->lo + i);
            if (np > most) { most = np; pick = i; }
        }
        if (pick < 0) break;
        spec_drafter_drop(d, pick);
        n++;
        if (want > 0 && room(d) - before >= want) break;
    }
    d->released += (uint64_t)n;
    return n;
}

void spec_drafter_counts(const spec_drafter *d, uint64_t *steps, uint64_t *failures, uint64_t *released,
                         uint64_t *windows, uint64_t *waits) {
    *steps = d->steps;
    *failures = d->failures;
    *released = d->released;
    *windows = d->windows;
    *waits = d->waits;
}

/* Frees draft sequence seq, to be rebuilt from the text's token off on. */
static void restart(spec_drafter *d, int seq, int off) {
    kvlm_seq_free(d->draft, d->lo + seq);
    d->base[seq] = -1;
    d->off[seq] = off;
    d->n_fed[seq] = 0;
}

void spec_drafter_drop(spec_drafter *d, int seq) {
    if (d && seq >= 0 && seq < d->n_seq) restart(d, seq, 0);
}

void spec_drafter_sync(spec_drafter *d, int seq, const int32_t *hist, int n_hist) {
    if (!d || seq < 0 || seq >= d->n_seq || d->base[seq] < 0) return;
    int b = d->base[seq], m = d->n_fed[seq], j = 0, o = d->off[seq];
    while (j < m && o + b + j < n_hist && (hist[o + b + j] == d->fed[seq][j])) j++;
    kvlm_error err;
    d->base[seq] = -1;
    d->n_fed[seq] = 0;
    if (kvlm_seq_trim(d->draft, d->lo + seq, b + j, &err)) { /* cannot happen without eviction: start it afresh */
        LOG_WARN("draft model: sequence %d: %s (rebuilt from its tokens)", seq, err.msg);
        restart(d, seq, o);
    }
}

static int grow(spec_drafter *d, int n_tok, int n_req) {
    if (n_tok > d->cap) {
        int cap = n_tok * 2;
        int32_t *t = realloc(d->tok, (size_t)cap * sizeof *t);
        if (t) d->tok = t;
        int32_t *s = realloc(d->bseq, (size_t)cap * sizeof *s);
        if (s) d->bseq = s;
        int8_t *w = realloc(d->want, (size_t)cap);
        if (w) d->want = w;
        if (!t || !s || !w) return -1;
        d->cap = cap;
    }
    if (n_req > d->n_pre) {
        int *p = realloc(d->pre, (size_t)n_req * sizeof *p);
        if (p) d->pre = p;
        bool *l = realloc(d->live, (size_t)n_req * sizeof *l);
        if (l) d->live = l;
        bool *c = realloc(d->cand, (size_t)n_req * sizeof *c);
        if (c) d->cand = c;
        if (!p || !l || !c) return -1;
        d->n_pre = n_req;
    }
    return 0;
}

/* After a failed decode: a sequence the decode changed (a sliced batch
 * commits slice by slice) is dropped, to be rebuilt from its tokens. */
static void undo_failed(spec_drafter *d, spec_draft_req *reqs, int n) {
    for (int i = 0; i < n; i++)
        if (d->pre[i] >= 0 && kvlm_seq_n_past(d->draft, d->lo + reqs[i].seq) != d->pre[i]) {
            spec_drafter_drop(d, reqs[i].seq);
            d->live[i] = d->cand[i] = false;
        }
}

/* The catch-up: every request's missing tokens in one decode, the last one
 * wanting logits (its first draft). Under a full pool the newest requests
 * drop out (their draft sequences freed) until it fits. Returns the number
 * of logits rows, -1 on an error that is not about room. */
static int catch_up(spec_drafter *d, spec_draft_req *reqs, int n, int max_catchup) {
    for (int i = 0; i < n; i++) d->cand[i] = d->live[i];
    for (;;) {
        int nt = 0, left = max_catchup, rows = 0;
        for (int i = 0; i < n; i++) {
            d->pre[i] = -1;
            d->live[i] = false;
            if (!d->cand[i]) continue;
            spec_draft_req *r = &reqs[i];
            int o = d->off[r->seq], dn = kvlm_seq_n_past(d->draft, d->lo + r->seq), pend = r->n_hist - o - dn;
            int take = pend <= left ? pend : left;
            if (take <= 0) continue;
            d->pre[i] = dn;
            for (int t = 0; t < take; t++) {
                d->tok[nt] = r->hist[o + dn + t];
                d->bseq[nt] = d->lo + r->seq;
                d->want[nt] = take == pend && t == take - 1;
                nt++;
            }
            d->live[i] = take == pend; /* else a piece now, the rest in later steps */
            rows += take == pend;
            left -= take;
        }
        if (nt == 0) return 0;
        kvlm_batch b = {nt, d->tok, NULL, d->want, d->bseq};
        kvlm_error err = {0};
        int rc = kvlm_decode(d->draft, &b, &err);
        if (rc == KVLM_OK) return rows;
        d->failures++;
        undo_failed(d, reqs, n);
        int last = -1;
        for (int i = 0; i < n; i++)
            if (d->pre[i] >= 0 && d->cand[i]) last = i;
        if (rc != KVLM_EFULL || last < 0) {
            LOG_DEBUG("draft model: catch-up of %d tokens failed (%s): no drafts this step", nt, err.msg);
            for (int i = 0; i < n; i++) d->live[i] = false;
            return -1;
        }
        /* no room: the newest taking part gives its blocks back and drafts later */
        spec_drafter_drop(d, reqs[last].seq);
        for (int i = last; i < n; i++) d->cand[i] = false;
    }
}

void spec_drafter_propose(spec_drafter *d, spec_draft_req *reqs, int n, int max_catchup, int spare) {
    if (!d || n <= 0) return;
    if (max_catchup < 1) max_catchup = 1;
    if (grow(d, max_catchup > n ? max_catchup : n, n)) {
        for (int i = 0; i < n; i++) reqs[i].n_out = 0;
        return;
    }
    kvlm_error err;
    for (int i = 0; i < n; i++) {
        spec_draft_req *r = &reqs[i];
        r->n_out = 0;
        d->live[i] = false;
        if (r->seq < 0 || r->seq >= d->n_seq || r->n_hist < 1 || r->k <= 0) continue;
        spec_drafter_sync(d, r->seq, r->hist, r->n_hist); /* drafts left from a step that did not check them */
        if (r->k > SPEC_DRAFT_MAX) r->k = SPEC_DRAFT_MAX;
        /* the text and k - 1 drafts past the draft's context (it does not evict): a window of the text */
        int o = spec_window(r->n_hist, d->off[r->seq], r->k - 1, d->limit);
        if (o != d->off[r->seq]) {
            restart(d, r->seq, o);
            d->windows++;
        }
        int room = d->limit - (r->n_hist - o) + 1; /* it will hold the text and k - 1 drafts */
        if (r->k > room) r->k = room;
        if (r->k <= 0) continue;
        int dn = kvlm_seq_n_past(d->draft, d->lo + r->seq);
        /* it holds at most the text before its last token, whose logits give the first draft */
        if (dn >= r->n_hist - o && kvlm_seq_trim(d->draft, d->lo + r->seq, r->n_hist - o - 1, &err)) {
            restart(d, r->seq, o);
            dn = 0;
        }
        if (d->shared) { /* the blocks it will hold, from those the model's next step leaves */
            int cost = kvlm_seq_blocks_needed(d->draft, d->lo + r->seq, r->n_hist - o + r->k - 1);
            if (cost > spare) {
                d->waits++;
                continue;
            }
            spare -= cost;
        }
        if (dn == 0 && o == 0) kvlm_seq_reuse_prefix(d->draft, d->lo + r->seq, r->hist, r->n_hist);
        d->live[i] = true;
    }
    if (catch_up(d, reqs, n, max_catchup) <= 0) return;
    /* round 0: the first drafts, from the catch-up's rows; then one decode a round */
    int row = 0, kmax = 0;
    for (int i = 0; i < n; i++) {
        if (!d->live[i]) continue;
        spec_draft_req *r = &reqs[i];
        int32_t t = pick(d, r, 0, kvlm_get_logits(d->draft, row++));
        if (t < 0) { /* unsure of the first: no drafts this step */
            d->live[i] = false;
            continue;
        }
        r->out[0] = t;
        r->n_out = 1;
        if (r->k > 1 && kvlm_seq_spec_begin(d->draft, d->lo + r->seq, &err) == KVLM_OK) {
            d->base[r->seq] = kvlm_seq_n_past(d->draft, d->lo + r->seq);
            d->n_fed[r->seq] = 0;
            if (r->k > kmax) kmax = r->k;
        } else {
            d->live[i] = false; /* one draft is all it gets */
        }
    }
    d->steps++;
    for (int round = 1; round < kmax; round++) {
        int nt = 0;
        for (int i = 0; i < n; i++) {
            d->pre[i] = -1;
            if (!d->live[i]) continue;
            spec_draft_req *r = &reqs[i];
            if (r->n_out != round || r->k <= round) { d->live[i] = false; continue; }
            d->pre[i] = kvlm_seq_n_past(d->draft, d->lo + r->seq);
            d->tok[nt] = r->out[round - 1];
            d->bseq[nt] = d->lo + r->seq;
            d->want[nt] = 1;
            nt++;
        }
        if (nt == 0) break;
        kvlm_batch b = {nt, d->tok, NULL, d->want, d->bseq};
        kvlm_error e2 = {0};
        if (kvlm_decode(d->draft, &b, &e2)) { /* no room for more drafts: those so far are proposed */
            d->failures++;
            undo_failed(d, reqs, n);
            break;
        }
        row = 0;
        for (int i = 0; i < n; i++) {
            if (d->pre[i] < 0) continue;
            spec_draft_req *r = &reqs[i];
            d->fed[r->seq][d->n_fed[r->seq]++] = r->out[round - 1];
            int32_t t = pick(d, r, r->n_out, kvlm_get_logits(d->draft, row++));
            if (t >= 0) r->out[r->n_out++] = t; /* else its drafts end here (it drops out next round) */
        }
    }
}
