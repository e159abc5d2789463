/* engine/spec: speculative decoding over a kvlm_ctx: drafts from prompt
 * lookup (n-grams of the text so far) or a draft model, checked by the
 * target in one batch, kept by the rule that keeps its distribution, the
 * rest taken back from the cache (kvlm_seq_trim). */
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include "engine/sampler.h"
#include "engine/spec.h"
#include "kvlm.h"
#include "ops/kvtype.h"
#include "util/error.h"

struct kvlm_spec {
    kvlm_ctx *ctx, *draft;
    int seq, mode, K, ng_max, ng_min, vocab, block_size;
    int dseq;                  /* the draft context's id of seq (kvlm_ctx_seq_first: after the target's in a shared pool) */
    int k_cur;                 /* drafts this step: halved after a step that kept none, doubled after one that kept all */
    int n_min;                 /* fewer drafts are not checked; k_cur stays at or above it */
    float p_min;               /* draft model: its drafts end before a token it is less sure of */
    bool q4kc;                 /* q4_kc keys: drafts stay short of the filling block's last slot */
    int32_t *hist;             /* the text so far: prompt and tokens given out */
    int n_hist, cap_hist;
    int draft_len;             /* tokens of hist the draft context has been fed */
    int draft_base;            /* the first of them its sequence holds (draft_model: a window past its context) */
    bool have_next;            /* next: chosen, not yet given out or fed */
    int32_t next;
    float *logits;             /* the target's logits after its last fed token */
    int32_t *batch, *bseq, *ids;
    int8_t *want;
    float *probs;
    /* draft model under sampling: the draft's distribution for each draft,
     * dense rows of vocab floats (K of them, allocated at the first use) */
    float *q;
    kvlm_spec_stats st;
};

int kvlm_spec_mode_from_name(const char *name) {
    if (!name) return -1;
    if (!strcmp(name, "none")) return KVLM_SPEC_NONE;
    if (!strcmp(name, "lookup")) return KVLM_SPEC_LOOKUP;
    if (!strcmp(name, "draft")) return KVLM_SPEC_DRAFT;
    return -1;
}

static int hist_push(kvlm_spec *sp, const int32_t *t, int n) {
    if (sp->n_hist + n > sp->cap_hist) {
        int cap = (sp->n_hist + n) * 2 + 64;
        int32_t *h = realloc(sp->hist, (size_t)cap * sizeof *h);
        if (!h) return -1;
        sp->hist = h;
        sp->cap_hist = cap;
    }
    memcpy(sp->hist + sp->n_hist, t, (size_t)n * sizeof *t);
    sp->n_hist += n;
    return 0;
}

/* Same tokens, same texts: a draft of another vocabulary would be
 * checked token by token against ids that mean something else. */
int spec_same_vocab(const kvlm_model *a, const kvlm_model *b, kvlm_error *err) {
    int n = kvlm_vocab_size(a);
    if (n != kvlm_vocab_size(b))
        return util_err_set(err, KVLM_EINVAL, "the draft model's vocabulary has %d tokens, the model's %d: they must "
                            "be the same", kvlm_vocab_size(b), n);
    char x[256], y[256];
    for (int i = 0; i < n; i++) {
        int lx = kvlm_token_to_text(a, i, x, sizeof x), ly = kvlm_token_to_text(b, i, y, sizeof y);
        if (lx != ly || (lx > 0 && memcmp(x, y, (size_t)lx)))
            return util_err_set(err, KVLM_EINVAL, "the draft model's token %d is \"%.*s\", the model's \"%.*s\": the "
                                "vocabularies differ", i, ly > 0 ? ly : 0, y, lx > 0 ? lx : 0, x);
    }
    if (kvlm_token_bos(a) != kvlm_token_bos(b) || kvlm_token_eos(a) != kvlm_token_eos(b))
        return util_err_set(err, KVLM_EINVAL, "the draft model's BOS/EOS tokens (%d/%d) differ from the model's (%d/%d)",
                            kvlm_token_bos(b), kvlm_token_eos(b), kvlm_token_bos(a), kvlm_token_eos(a));
    return KVLM_OK;
}

void kvlm_spec_free(kvlm_spec *sp) {
    if (!sp) return;
    free(sp->hist); free(sp->logits); free(sp->batch); free(sp->bseq); free(sp->want); free(sp->ids);
    free(sp->probs); free(sp->q);
    free(sp);
}

kvlm_spec *kvlm_spec_create(kvlm_ctx *ctx, int seq, const int32_t *prompt, int n, const kvlm_spec_params *p,
                            kvlm_error *err) {
    if (!ctx || !p || !prompt || n <= 0 || seq < 0 || seq >= kvlm_ctx_n_seq_max(ctx)) {
        util_err_set(err, KVLM_EINVAL, "speculation needs a context, a sequence and its prompt");
        return NULL;
    }
    if (p->mode != KVLM_SPEC_LOOKUP && p->mode != KVLM_SPEC_DRAFT) {
        util_err_set(err, KVLM_EINVAL, "unknown speculation mode %d (lookup, draft)", p->mode);
        return NULL;
    }
    if (spec_check_p_min(p->p_min, err)) return NULL;
    if (p->n_draft < 0 || p->n_draft > 64 || p->n_min < 0 || p->ngram_max < 0 || p->ngram_min < 0 ||
        (p->ngram_max && p->ngram_min > p->ngram_max)) {
        util_err_set(err, KVLM_EINVAL, "draft tokens must be in 1..64 (at least n_min >= 0) and the n-gram sizes "
                     "1 <= min <= max (n_draft %d, n_min %d, ngram %d..%d)", p->n_draft, p->n_min, p->ngram_min,
                     p->ngram_max);
        return NULL;
    }
    if (p->mode == KVLM_SPEC_DRAFT) {
        if (!p->draft_ctx || p->draft_ctx == ctx) {
            util_err_set(err, KVLM_EINVAL, "draft speculation needs the draft model's own context");
            return NULL;
        }
        if (seq >= kvlm_ctx_n_seq_max(p->draft_ctx)) {
            util_err_set(err, KVLM_EINVAL, "the draft context holds sequences 0..%d, not %d",
                         kvlm_ctx_n_seq_max(p->draft_ctx) - 1, seq);
            return NULL;
        }
        if (spec_same_vocab(kvlm_ctx_model(ctx), kvlm_ctx_model(p->draft_ctx), err)) return NULL;
    }
    kvlm_spec *sp = calloc(1, sizeof *sp);
    if (!sp) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    sp->ctx = ctx;
    sp->draft = p->mode == KVLM_SPEC_DRAFT ? p->draft_ctx : NULL;
    sp->seq = seq;
    sp->dseq = sp->draft ? kvlm_ctx_seq_first(sp->draft) + seq : seq;
    sp->mode = p->mode;
    sp->K = p->n_draft ? p->n_draft : p->mode == KVLM_SPEC_LOOKUP ? 8 : 4;
    sp->p_min = p->p_min;
    sp->k_cur = sp->K;
    sp->n_min = p->n_min < sp->K ? p->n_min : sp->K;
    sp->ng_max = p->ngram_max ? p->ngram_max : 3;
    sp->ng_min = p->ngram_min ? p->ngram_min : 1;
    if (sp->ng_min > sp->ng_max) sp->ng_min = sp->ng_max;
    sp->vocab = kvlm_vocab_size(kvlm_ctx_model(ctx));
    kvlm_kv_stats ks;
    kvlm_kv_stats_get(ctx, &ks);
    sp->block_size = ks.block_size > 0 ? ks.block_size : 1;
    sp->q4kc = op_kv_in_order(ks.type_k);
    const float *l = kvlm_get_logits(ctx, -1);
    sp->logits = malloc((size_t)sp->vocab * sizeof(float));
    sp->batch = malloc((size_t)(sp->K + 1) * sizeof(int32_t));
    sp->bseq = malloc((size_t)(sp->K + 1) * sizeof(int32_t));
    sp->want = malloc((size_t)(sp->K + 1));
    sp->ids = malloc((size_t)sp->vocab * sizeof(int32_t));
    sp->probs = malloc((size_t)sp->vocab * sizeof(float));
    if (!sp->logits || !sp->batch || !sp->bseq || !sp->want || !sp->ids || !sp->probs || hist_push(sp, prompt, n)) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto fail;
    }
    if (!l) { util_err_set(err, KVLM_EINVAL, "feed the prompt first: the context has no logits"); goto fail; }
    memcpy(sp->logits, l, (size_t)sp->vocab * sizeof(float));
    for (int i = 0; i <= sp->K; i++) { sp->bseq[i] = seq; sp->want[i] = 1; }
    if (sp->draft) { /* the draft model reads the prompt (what its cache reuses of it first) */
        kvlm_kv_stats ds;
        kvlm_kv_stats_get(sp->draft, &ds);
        if (op_kv_in_order(ds.type_k)) {
            util_err_set(err, KVLM_EUNSUPPORTED, "the draft model's cache cannot have %s keys (its drafts are taken "
                         "back across blocks)", op_kv_type_name(ds.type_k));
            goto fail;
        }
        kvlm_seq_free(sp->draft, sp->dseq);
        /* a draft that does not evict (one in the model's pool) takes a
         * prompt it holds whole; a longer one, the window draft_model starts */
        bool evicts = kvlm_ctx_kv_evict(sp->draft);
        int fed = evicts || n < kvlm_ctx_kv_budget(sp->draft) ? n : 0;
        int cached = evicts || !fed ? 0 : kvlm_seq_reuse_prefix(sp->draft, sp->dseq, prompt, n);
        int piece = kvlm_ctx_kv_max_feed(sp->draft) / 2 > 0 ? kvlm_ctx_kv_max_feed(sp->draft) / 2 : 1;
        int32_t *ps = malloc((size_t)piece * sizeof(int32_t));
        if (!ps) { util_err_set(err, KVLM_ENOMEM, "out of memory"); goto fail; }
        for (int i = 0; i < piece; i++) ps[i] = sp->dseq;
        for (int i = cached; i < fed; i += piece) {
            kvlm_batch b = {fed - i < piece ? fed - i : piece, prompt + i, NULL, NULL, ps};
            if (kvlm_decode(sp->draft, &b, err)) { free(ps); goto fail; }
        }
        free(ps);
        sp->draft_len = fed;
    }
    return sp;
fail:
    kvlm_spec_free(sp);
    return NULL;
}

void kvlm_spec_stats_get(const kvlm_spec *sp, kvlm_spec_stats *st) { *st = sp->st; }

int spec_lookup(const int32_t *h, int m, int ng_max, int ng_min, int K, int32_t *out) {
    for (int n = ng_max; n >= ng_min; n--) {
        if (m < n + 1) continue;
        const int32_t *tail = h + m - n;
        for (int i = m - n - 1; i >= 0; i--) {
            if (memcmp(h + i, tail, (size_t)n * sizeof *h)) continue;
            int k = 0;
            while (k < K && i + n + k < m) { out[k] = h[i + n + k]; k++; }
            if (k) return k;
        }
    }
    return 0;
}

static int draft_lookup(const kvlm_spec *sp, int K, int32_t *out) {
    return spec_lookup(sp->hist, sp->n_hist, sp->ng_max, sp->ng_min, K, out);
}

bool spec_check(kvlm_sampler *smp, const float *row, int32_t d, int32_t *ids, float *probs, int32_t *next) {
    int nc = sampler_dist(smp, row, ids, probs);
    double pd = 0;
    for (int i = 0; i < nc; i++)
        if (ids[i] == d) pd = probs[i];
    if (pd >= 1.0 || (pd > 0 && sampler_uniform(smp) < pd)) {
        sampler_picked(smp, d);
        return true;
    }
    /* rejected: draw from the residual norm(max(0, p - q)), q = the point mass at d */
    double rest = 1.0 - pd, r = nc > 1 ? sampler_uniform(smp) * rest : 0, cum = 0;
    int32_t pick = -1;
    for (int i = 0; i < nc; i++) {
        if (ids[i] == d) continue;
        pick = ids[i];
        cum += probs[i];
        if (r < cum) break;
    }
    sampler_picked(smp, pick);
    *next = pick;
    return false;
}

bool spec_check_q(kvlm_sampler *smp, const float *row, int32_t d, const float *q, int32_t *ids, float *probs,
                  int32_t *next) {
    int nc = sampler_dist(smp, row, ids, probs);
    double pd = 0, qd = q[d];
    for (int i = 0; i < nc; i++)
        if (ids[i] == d) pd = probs[i];
    /* kept with probability min(1, p(d) / q(d)) */
    if (pd >= qd || sampler_uniform(smp) * qd < pd) {
        sampler_picked(smp, d);
        return true;
    }
    /* rejected: draw from norm(max(0, p - q)); p(d) < q(d) leaves d out */
    double rest = 0;
    for (int i = 0; i < nc; i++) rest += probs[i] > q[ids[i]] ? probs[i] - q[ids[i]] : 0;
    double r = sampler_uniform(smp) * rest, cum = 0;
    int32_t pick = -1;
    for (int i = 0; i < nc; i++) {
        double w = probs[i] > q[ids[i]] ? probs[i] - q[ids[i]] : 0;
        if (w <= 0) continue;
        pick = ids[i];
        cum += w;
        if (r < cum) break;
    }
    if (pick < 0) pick = ids[0]; /* p == q up to rounding: rejection had probability ~0 */
    sampler_picked(smp, pick);
    *next = pick;
    return false;
}

/* Tokens the draft context has been fed (its cache holds fewer after eviction
 * or in a window), as an index into hist. */
static int draft_fed(const kvlm_spec *sp) {
    return sp->draft_base + kvlm_seq_n_past(sp->draft, sp->dseq) + (int)kvlm_seq_n_evicted(sp->draft, sp->dseq);
}

int spec_window(int n_hist, int off, int extra, int limit) {
    if (n_hist - off + extra <= limit) return off;
    return n_hist - limit / 2 > 0 ? n_hist - limit / 2 : 0;
}

int spec_check_p_min(float p_min, kvlm_error *err) {
    if (p_min >= 0 && p_min < 1) return KVLM_OK;
    return util_err_set(err, KVLM_EINVAL, "the draft's least probability must be in [0, 1) (%g)", (double)p_min);
}

int32_t spec_draft_pick(kvlm_sampler *smp, const float *l, int vocab, float *q, int32_t *ids, float *probs,
                        float p_min) {
    if (!q) {
        int best = 0;
        for (int i = 1; i < vocab; i++)
            if (l[i] > l[best]) best = i;
        if (p_min > 0) { /* softmax of the best: 1 / sum exp(l_i - l_best) */
            double z = 0;
            for (int i = 0; i < vocab; i++) z += exp((double)l[i] - (double)l[best]);
            if (1.0 / z < p_min) return -1;
        }
        return best;
    }
    int nc = sampler_dist(smp, l, ids, probs);
    if (p_min > 0) {
        float top = 0;
        for (int i = 0; i < nc; i++) top = probs[i] > top ? probs[i] : top;
        if (top < p_min) return -1;
    }
    memset(q, 0, (size_t)vocab * sizeof *q);
    double r = sampler_uniform(smp), cum = 0;
    int32_t pick = ids[nc - 1];
    for (int i = 0; i < nc; i++) q[ids[i]] = probs[i];
    for (int i = 0; i < nc; i++) {
        cum += probs[i];
        if (r < cum) { pick = ids[i]; break; }
    }
    return pick;
}

static int draft_model(kvlm_spec *sp, kvlm_sampler *smp, int K, int32_t *out, kvlm_error *err) {
    kvlm_ctx *d = sp->draft;
    /* catch up with the text (all verified), in pieces its budget takes */
    int piece = kvlm_ctx_kv_max_feed(d) / 2 > 0 ? kvlm_ctx_kv_max_feed(d) / 2 : 1;
    if (piece > 64) piece = 64;
    int32_t bs[64];
    for (int i = 0; i < piece; i++) bs[i] = sp->dseq;
    /* a draft context that does not evict (its cache in the model's pool,
     * kvlm_ctx_create_draft), past its context: a window of the text */
    int base = kvlm_ctx_kv_evict(d) ? sp->draft_base : spec_window(sp->n_hist, sp->draft_base, K, kvlm_ctx_kv_budget(d));
    if (base != sp->draft_base) {
        kvlm_seq_free(d, sp->dseq);
        sp->draft_base = sp->draft_len = base;
        sp->st.draft_windows++;
    }
    while (sp->draft_len < sp->n_hist) {
        int m = sp->n_hist - sp->draft_len < piece ? sp->n_hist - sp->draft_len : piece;
        kvlm_batch b = {m, sp->hist + sp->draft_len, NULL, NULL, bs};
        if (kvlm_decode(d, &b, err)) return -1;
        sp->draft_len += m;
    }
    /* no eviction among its drafts: at most what its budget holds */
    int room = kvlm_ctx_kv_budget(d) - kvlm_seq_n_past(d, sp->dseq);
    if (room < K) K = room;
    if (K <= 0) return 0;
    bool soft = !sampler_greedy(smp);
    if (soft && !sp->q && !(sp->q = malloc((size_t)sp->K * (size_t)sp->vocab * sizeof(float))))
        return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
    if (kvlm_seq_spec_begin(d, sp->dseq, err)) return -1;
    int k = 0;
    kvlm_error e2;
    while (k < K) {
        int32_t t = spec_draft_pick(smp, kvlm_get_logits(d, -1), sp->vocab,
                                    soft ? sp->q + (size_t)k * (size_t)sp->vocab : NULL, sp->ids, sp->probs, sp->p_min);
        if (t < 0) break; /* the draft is unsure of the next: its drafts end here */
        out[k++] = t;
        if (k == K) break;
        kvlm_batch b = {1, &out[k - 1], NULL, NULL, &sp->dseq};
        if (kvlm_decode(d, &b, &e2)) break; /* no room in the draft's cache: fewer drafts */
    }
    return k;
}

/* After the target kept its tokens (hist holds them), the draft context
 * keeps what it was fed of them: its drafts past the kept ones go. */
static int draft_rollback(kvlm_spec *sp, kvlm_error *err) {
    if (!sp->draft) return KVLM_OK;
    int fed = draft_fed(sp), keep = fed < sp->n_hist ? fed : sp->n_hist;
    if (kvlm_seq_trim(sp->draft, sp->dseq, kvlm_seq_n_past(sp->draft, sp->dseq) - (fed - keep), err)) return -1;
    sp->draft_len = keep;
    return KVLM_OK;
}

int kvlm_spec_next(kvlm_spec *sp, kvlm_sampler *smp, int32_t *out, int cap, kvlm_error *err) {
    kvlm_ctx *ctx = sp->ctx;
    const kvlm_model *m = kvlm_ctx_model(ctx);
    if (!smp || !out || cap < 1) return util_err_set(err, KVLM_EINVAL, "bad arguments"), -1;
    if (!sp->have_next) sp->next = kvlm_sampler_sample(smp, sp->logits);
    sp->have_next = false;
    int32_t x = sp->next;
    if (kvlm_token_is_eog(m, x)) { /* the end: given out, not fed */
        out[0] = x;
        sp->st.emitted++;
        return hist_push(sp, &x, 1) ? (util_err_set(err, KVLM_ENOMEM, "out of memory"), -1) : 1;
    }
    /* drafts only where they fit without evicting (and for q4_kc keys
     * without leaving the block being filled): the cache then evolves as
     * without speculation */
    int len = kvlm_seq_n_past(ctx, sp->seq), room = kvlm_ctx_kv_budget(ctx) - len - 1;
    if (room > kvlm_ctx_n_ctx(ctx) - len - 1) room = kvlm_ctx_n_ctx(ctx) - len - 1;
    if (sp->q4kc) {
        /* q4_kc keys: a block is quantized per channel when its last slot is
         * written, and the batch's queries would then see keys quantized with
         * the drafts among them; so drafts never reach the block's last slot
         * (and a rollback never crosses a block) */
        int end = (len / sp->block_size + 1) * sp->block_size;
        if (room > end - len - 2) room = end - len - 2 > 0 ? end - len - 2 : 0;
    }
    if (room < 0 && !kvlm_ctx_kv_evict(ctx)) { /* the cache is full: given out, not fed, as a plain loop would */
        out[0] = x;
        sp->st.emitted++;
        return hist_push(sp, &x, 1) ? (util_err_set(err, KVLM_ENOMEM, "out of memory"), -1) : 1;
    }
    int K = sp->k_cur < room ? sp->k_cur : room, nd = 0;
    if (K > cap - 1) K = cap - 1;
    if (hist_push(sp, &x, 1)) return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
    if (K > 0 && K >= sp->n_min) {
        nd = sp->mode == KVLM_SPEC_LOOKUP ? draft_lookup(sp, K, sp->batch + 1) : draft_model(sp, smp, K, sp->batch + 1, err);
        if (nd < 0) { sp->n_hist--; return -1; }
        if (nd < sp->n_min) nd = 0; /* too few to be worth a check (llama.cpp's --draft-min) */
    }
    sp->batch[0] = x;
    sp->st.steps++;
    if (nd == 0) { /* nothing to check: a plain step */
        kvlm_batch b = {1, &x, NULL, NULL, &sp->seq};
        if (kvlm_decode(ctx, &b, err)) { sp->n_hist--; return -1; }
        memcpy(sp->logits, kvlm_get_logits(ctx, -1), (size_t)sp->vocab * sizeof(float));
        out[0] = x;
        sp->st.emitted++;
        if (sp->draft && draft_rollback(sp, err)) return -1;
        return 1;
    }
    if (kvlm_seq_spec_begin(ctx, sp->seq, err)) { sp->n_hist--; return -1; }
    kvlm_batch b = {nd + 1, sp->batch, NULL, sp->want, sp->bseq};
    if (kvlm_decode(ctx, &b, err)) {
        kvlm_error e2;
        kvlm_seq_trim(ctx, sp->seq, len, &e2);
        sp->n_hist--;
        return -1;
    }
    /* row j holds the target's logits after batch[j]; draft batch[j + 1] is
     * kept with probability p(d) (1 or 0 when greedy), else the next token
     * comes from p without d; a draft model's sampled draft d ~ q is kept
     * with probability min(1, p(d) / q(d)), else the next token comes from
     * norm(max(0, p - q)) */
    int j = 0;
    out[0] = x;
    bool soft = sp->draft && !sampler_greedy(smp);
    for (; j < nd; j++) {
        const float *row = kvlm_get_logits(ctx, j);
        int32_t d = sp->batch[j + 1];
        if (soft ? spec_check_q(smp, row, d, sp->q + (size_t)j * (size_t)sp->vocab, sp->ids, sp->probs, &sp->next)
                 : spec_check(smp, row, d, sp->ids, sp->probs, &sp->next)) {
            out[j + 1] = d;
            continue;
        }
        sp->have_next = true;
        break;
    }
    if (kvlm_seq_trim(ctx, sp->seq, len + 1 + j, err)) return -1;
    if (!sp->have_next) { /* all kept: the target's own next token comes from the last row */
        sp->next = kvlm_sampler_sample(smp, kvlm_get_logits(ctx, nd));
        sp->have_next = true;
    }
    /* the logits after the last kept token, for a caller that goes on plainly */
    memcpy(sp->logits, kvlm_get_logits(ctx, j), (size_t)sp->vocab * sizeof(float));
    if (hist_push(sp, sp->batch + 1, j)) return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
    if (j == 0) sp->k_cur = sp->k_cur / 2 > sp->n_min ? sp->k_cur / 2 : sp->n_min > 1 ? sp->n_min : 1;
    else if (j == nd && nd == sp->k_cur) sp->k_cur = sp->k_cur * 2 < sp->K ? sp->k_cur * 2 : sp->K;
    sp->st.drafted += (uint64_t)nd;
    sp->st.accepted += (uint64_t)j;
    sp->st.emitted += (uint64_t)j + 1;
    if (sp->draft && draft_rollback(sp, err)) return -1;
    return j + 1;
}
