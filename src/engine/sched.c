/* engine/sched: the scheduler: continuous batching over one kvlm_ctx (one
 * kvlm_decode per step mixing decode tokens and prefill chunks under a token
 * budget), FCFS admission by asking the KV cache what a prompt finds cached
 * and needs (kvlm_seq_probe_prefix, no side effects), preemption of
 * the newest sequence when the pool runs out, by swap (its blocks moved to
 * the context's swap space and back) or recompute, n > 1 by forking
 * the prompt's blocks, cancellation; under an eviction policy, sequences that
 * run past the context within their KV budget; embedding requests (prompts
 * whose result is a pooled vector) in the same steps. */
#include "engine/sched.h"
#include "engine/embed.h"
#include "engine/spec.h"
#include "engine/sampler.h"
#include "engine/spec_draft.h"
#include "ops/kvtype.h"
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"
#include "util/log.h"
#include "util/timing.h"

typedef struct req req;

#define SCHED_MAX_DRAFT 16

/* One completion: a sequence whose history is the prompt then what it generated. */
typedef struct {
    req *r;
    int index;
    int seq;           /* -1: holds no sequence (waiting, or done) */
    int32_t *hist;     /* every token: under eviction it outgrows the cache */
    int n_hist, cap, n_gen;
    kvlm_sampler *smp;
    kvlm_swap *swap;   /* preempted by swap: its cache, waiting to come back */
    bool done;
    int n_draft;       /* speculation: drafts after its token in this step's batch */
    int32_t draft[SCHED_MAX_DRAFT];
    int k_cur;         /* drafts per step now (0: spec_k): halved after none kept, doubled after all */
    int n_prop;        /* draft model: drafts it proposed this step (in draft[]) */
    float *q;          /* draft model, sampling: the draft's distribution for each draft (spec_k rows of vocab) */
    bool soft;         /* this step's drafts were drawn from q (spec_check_q), not the draft's argmax */
    /* an embedding request's input (hist, n_hist: its tokens): its states pooled as they come */
    embed_pool pool;
    bool admitted, enc_done; /* enc_done: an encoder's input has been through the model */
    int cached;
} unit;

struct req {
    uint64_t id;
    kvlm_request_params p;
    int n_prompt, cached;
    double t_submit, queue_time; /* queue_time: submission to first admission */
    int plp_next;                /* prompt_logprobs: the next prompt position to report (from 1) */
    bool admitted, forked, cancel, kill; /* kill: the engine thread's copy of cancel */
    unit *u;
    int n, n_live;
    kvlm_sched_cb cb;
    void *user;
    req *next;
    /* an embedding request (kvlm_sched_submit_embed): its units are its inputs */
    bool embed;
    kvlm_embed_params ep;
    int pooling, dims;
};

struct kvlm_sched {
    kvlm_ctx *ctx;
    const kvlm_model *model;
    int batch_tokens, max_seqs, n_ctx, block_size, n_blocks, vocab;
    size_t block_bytes;
    int budget, max_feed; /* kvlm_ctx_kv_budget, kvlm_ctx_kv_max_feed */
    bool evicts;          /* a policy other than none: sequences are not bounded by the context */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    uint64_t next_id;
    req *incoming, *incoming_tail;   /* submitted, not yet seen by the engine thread (under mu) */
    req *live, *live_tail;           /* seen by the engine thread, in id order */
    bool *slot_used;
    /* step scratch */
    int32_t *tok, *seqv, *plp_pos; /* plp_pos[i] > 0: token i's logits give prompt position plp_pos[i]'s logprob */
    int8_t *want;
    unit **who;
    int32_t *hpos;        /* an embedding input's token: its place in the input */
    float *lp;
    /* counters (engine thread) and the published snapshot (under mu) */
    uint64_t preemptions, swaps_out, swaps_in, recomputes, swap_bytes, swaps_evicted, steps, done, prompt_tokens, cached_tokens, generated;
    double mark_t, mark_gen, tps, last_step_t;
    kvlm_sched_stats snap;
    kvlm_sched_req_info *snap_req, *work_req; /* published, and being filled */
    int n_snap_req, cap_snap_req, cap_work_req;
    /* kvlm_sched_kv_blocks: once asked for (want_blocks, under mu), the
     * prefix index's keys are taken after every step; published (-1: not yet) and being filled */
    bool want_blocks;
    uint8_t (*blk_snap)[16], (*blk_work)[16];
    int n_blk_snap;
    uint8_t (*host_snap)[16], (*host_work)[16]; /* the same for the host tier's (cap_* each) */
    int n_host_snap, cap_host_snap, cap_host_work;
    /* speculative decoding (prompt lookup): drafts per decode token; 0: off */
    int spec_k;
    int spec_n_min;    /* fewer drafts are not checked; k_cur stays at or above it */
    bool spec_q4kc;        /* q4_kc keys: drafts stop short of the filling block's last slot */
    bool spec_skip;        /* this step: no drafts (the pool had no room for them) */
    int32_t *spec_ids;
    float *spec_probs;
    uint64_t spec_drafted, spec_accepted;
    /* speculation by a draft model (KVLM_SPEC_DRAFT): its context drafts for
     * the step's decoding units together (engine/spec_draft) */
    spec_drafter *drafter;
    spec_draft_req *dreq;
    unit **dunit;
    int n_dreq;
    bool encoder;         /* an encoder's context: embedding requests only, no blocks held */
    uint64_t embeddings, embedding_tokens;
};

/* Tokens a sequence of n tokens holds in the cache once settled: the budget caps it. */
static int hold(const kvlm_sched *s, int n) { return n < s->budget ? n : s->budget; }
/* Blocks the prompt alone fills (a request the pool can never hold is refused at submission). */
static int prompt_blocks(const kvlm_sched *s, int n) { return (hold(s, n) + s->block_size - 1) / s->block_size; }

kvlm_sched *kvlm_sched_create(kvlm_ctx *ctx, const kvlm_sched_params *params, kvlm_error *err) {
    kvlm_sched *s = calloc(1, sizeof *s);
    if (!s) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    pthread_mutex_init(&s->mu, NULL); /* first: kvlm_sched_free takes it on the error paths below */
    pthread_cond_init(&s->cv, NULL);
    s->ctx = ctx;
    s->model = kvlm_ctx_model(ctx);
    s->batch_tokens = params && params->batch_tokens > 0 ? params->batch_tokens : 512;
    s->max_seqs = kvlm_ctx_n_seq_max(ctx);
    if (params && params->max_seqs > 0 && params->max_seqs < s->max_seqs) s->max_seqs = params->max_seqs;
    s->n_ctx = kvlm_ctx_n_ctx(ctx);
    s->budget = kvlm_ctx_kv_budget(ctx);
    s->max_feed = kvlm_ctx_kv_max_feed(ctx);
    s->evicts = kvlm_ctx_kv_evict(ctx) != KVLM_EVICT_NONE;
    s->vocab = kvlm_vocab_size(s->model);
    /* an encoder takes each input whole in one step: a step's arrays hold the
     * longest (one past the token budget goes alone) */
    s->encoder = kvlm_model_is_encoder(s->model);
    kvlm_kv_stats st;
    kvlm_kv_stats_get(ctx, &st);
    s->block_size = st.block_size;
    s->n_blocks = st.n_blocks;
    s->block_bytes = st.block_bytes;
    s->next_id = 1;
    s->n_blk_snap = -1;
    s->snap.kv = st;
    s->snap.n_tiers = kvlm_kv_tier_stats_get(ctx, s->snap.tiers, KVLM_MAX_KV_TIERS);
    int cap = (s->encoder && s->n_ctx > s->batch_tokens ? s->n_ctx : s->batch_tokens) + s->max_seqs;
    s->slot_used = calloc((size_t)kvlm_ctx_n_seq_max(ctx), sizeof(bool));
    s->tok = malloc((size_t)cap * sizeof(int32_t));
    s->seqv = malloc((size_t)cap * sizeof(int32_t));
    s->plp_pos = malloc((size_t)cap * sizeof(int32_t));
    s->want = malloc((size_t)cap);
    s->who = malloc((size_t)cap * sizeof(unit *));
    s->hpos = malloc((size_t)cap * sizeof(int32_t));
    s->lp = malloc((size_t)s->vocab * sizeof(float));
    if (params && (params->spec_mode == KVLM_SPEC_LOOKUP || params->spec_mode == KVLM_SPEC_DRAFT)) {
        bool draft = params->spec_mode == KVLM_SPEC_DRAFT;
        if (draft) {
            int n = kvlm_ctx_n_seq_max(ctx);
            if (!(s->drafter = spec_drafter_create(ctx, params->draft_ctx, params->spec_p_min, err))) {
                kvlm_sched_free(s);
                return NULL;
            }
            s->dreq = calloc((size_t)n, sizeof *s->dreq);
            s->dunit = calloc((size_t)n, sizeof *s->dunit);
        }
        s->spec_k = params->spec_n_draft > 0 ? params->spec_n_draft : draft ? 4 : 8;
        if (s->spec_k > SCHED_MAX_DRAFT) s->spec_k = SCHED_MAX_DRAFT;
        s->spec_n_min = params->spec_n_min < 0 ? 0 : params->spec_n_min < s->spec_k ? params->spec_n_min : s->spec_k;
        s->spec_q4kc = op_kv_in_order(st.type_k);
        s->spec_ids = malloc((size_t)s->vocab * sizeof(int32_t));
        s->spec_probs = malloc((size_t)s->vocab * sizeof(float));
        if (!s->spec_ids || !s->spec_probs || (draft && (!s->dreq || !s->dunit))) {
            util_err_set(err, KVLM_ENOMEM, "out of memory");
            kvlm_sched_free(s);
            return NULL;
        }
    } else if (params && params->spec_mode != KVLM_SPEC_NONE) {
        util_err_set(err, KVLM_EUNSUPPORTED, "unknown speculation mode %d (lookup, draft)", params->spec_mode);
        kvlm_sched_free(s);
        return NULL;
    }
    if (!s->slot_used || !s->tok || !s->seqv || !s->plp_pos || !s->want || !s->who || !s->hpos || !s->lp) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        kvlm_sched_free(s);
        return NULL;
    }
    return s;
}

static void req_free(req *r) {
    for (int i = 0; r->u && i < r->n; i++) {
        free(r->u[i].hist);
        free(r->u[i].q);
        kvlm_sampler_free(r->u[i].smp);
        embed_pool_free(&r->u[i].pool);
    }
    free(r->u);
    free(r);
}

static kvlm_sched_event event_for(const unit *u) {
    kvlm_sched_event ev;
    memset(&ev, 0, sizeof ev);
    ev.id = u->r->id;
    ev.index = u->index;
    ev.token = -1;
    ev.prompt_tokens = u->r->embed ? u->n_hist : u->r->n_prompt;
    ev.cached_tokens = u->r->embed ? u->cached : u->r->cached;
    ev.queue_time = u->r->queue_time;
    return ev;
}

static void release(kvlm_sched *s, unit *u) {
    if (u->seq < 0) return;
    kvlm_seq_free(s->ctx, u->seq);
    spec_drafter_drop(s->drafter, u->seq);
    s->slot_used[u->seq] = false;
    u->seq = -1;
}

/* Ends a completion: frees its sequence, sends its final event (with an
 * embedding input's vector, when given). */
static void finish_with(kvlm_sched *s, unit *u, int reason, const char *error, const float *vec, int n_vec) {
    if (u->done) return;
    release(s, u);
    kvlm_swap_free(s->ctx, u->swap);
    u->swap = NULL;
    u->done = true;
    u->r->n_live--;
    kvlm_sched_event ev = event_for(u);
    ev.finish = reason;
    ev.error = error;
    ev.embedding = vec;
    ev.n_embd = vec ? n_vec : 0;
    u->r->cb(u->r->user, &ev);
}

static void finish(kvlm_sched *s, unit *u, int reason, const char *error) { finish_with(s, u, reason, error, NULL, 0); }

/* An embedding input whose every state is in: its vector out, its sequence freed. */
static void finish_embed(kvlm_sched *s, unit *u) {
    req *r = u->r;
    size_t n = r->pooling == KVLM_POOLING_NONE ? (size_t)u->n_hist * r->dims : (size_t)r->dims;
    float *v = malloc(n * sizeof(float));
    if (!v) { finish(s, u, KVLM_FINISH_ERROR, "out of memory"); return; }
    embed_pool_finish(&u->pool, r->dims, r->ep.no_normalize, v, n);
    s->embeddings++;
    s->embedding_tokens += (uint64_t)u->n_hist;
    finish_with(s, u, KVLM_FINISH_STOP, NULL, v, (int)n);
    free(v);
}

/* Drops requests whose completions have all ended from the live list. */
static void reap(kvlm_sched *s) {
    pthread_mutex_lock(&s->mu);
    req **pp = &s->live;
    s->live_tail = NULL;
    while (*pp) {
        req *r = *pp;
        if (r->n_live == 0) {
            *pp = r->next;
            s->done++;
            req_free(r);
        } else {
            s->live_tail = r;
            pp = &r->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
}

void kvlm_sched_free(kvlm_sched *s) {
    if (!s) return;
    if (s->tok) {
        pthread_mutex_lock(&s->mu);
        if (s->live_tail) s->live_tail->next = s->incoming;
        else s->live = s->incoming;
        s->incoming = s->incoming_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        for (req *r = s->live; r; r = r->next)
            for (int i = 0; i < r->n; i++) finish(s, &r->u[i], KVLM_FINISH_CANCELLED, NULL);
        reap(s);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
    }
    free(s->slot_used); free(s->tok); free(s->seqv); free(s->plp_pos); free(s->want); free(s->who); free(s->hpos); free(s->lp);
    free(s->spec_ids); free(s->spec_probs);
    spec_drafter_free(s->drafter);
    free(s->dreq); free(s->dunit);
    free(s->snap_req);
    free(s->work_req);
    free(s->blk_snap);
    free(s->blk_work);
    free(s->host_snap);
    free(s->host_work);
    free(s);
}

/* Queues a request that the engine thread takes at its next step. */
static uint64_t enqueue(kvlm_sched *s, req *r) {
    pthread_mutex_lock(&s->mu);
    r->id = s->next_id++;
    if (s->incoming_tail) s->incoming_tail->next = r;
    else s->incoming = r;
    s->incoming_tail = r;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return r->id;
}

uint64_t kvlm_sched_submit(kvlm_sched *s, const int32_t *prompt, int n_prompt, const kvlm_request_params *p,
                           kvlm_sched_cb cb, void *user, kvlm_error *err) {
    int n = p->n > 0 ? p->n : 1;
    if (!cb || !prompt || n_prompt <= 0) { util_err_set(err, KVLM_EINVAL, "empty prompt"); return 0; }
    if (s->encoder) {
        util_err_set(err, KVLM_EUNSUPPORTED, "the model is an encoder (bert, nomic-bert): it gives embeddings only "
                     "(kvlm_sched_submit_embed), no text");
        return 0;
    }
    if (p->max_tokens <= 0) { util_err_set(err, KVLM_EINVAL, "max_tokens must be at least 1"); return 0; }
    if (p->logprobs > KVLM_MAX_LOGPROBS || (p->prompt_logprobs && (p->prompt_top_logprobs < 0 ||
                                                                   p->prompt_top_logprobs > KVLM_MAX_LOGPROBS))) {
        util_err_set(err, KVLM_EINVAL, "logprobs must be at most %d", KVLM_MAX_LOGPROBS);
        return 0;
    }
    if (n > s->max_seqs) {
        util_err_set(err, KVLM_EINVAL, "n = %d is more than the %d sequences the server runs at once", n, s->max_seqs);
        return 0;
    }
    if (n_prompt > s->budget && !s->evicts) { /* under eviction a long prompt goes in pieces */
        util_err_set(err, KVLM_ERANGE, "the prompt is %d tokens, longer than the %s of %d", n_prompt,
                     s->budget < s->n_ctx ? "KV budget" : "context", s->budget);
        return 0;
    }
    if (prompt_blocks(s, n_prompt) > s->n_blocks) {
        util_err_set(err, KVLM_ERANGE, "the prompt of %d tokens needs %d KV blocks; the cache holds only %d",
                     n_prompt, prompt_blocks(s, n_prompt), s->n_blocks);
        return 0;
    }
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= s->vocab) {
            util_err_set(err, KVLM_EINVAL, "prompt token %d is outside the vocabulary", prompt[i]);
            return 0;
        }
    req *r = calloc(1, sizeof *r);
    if (!r || !(r->u = calloc((size_t)n, sizeof *r->u))) { free(r); util_err_set(err, KVLM_ENOMEM, "out of memory"); return 0; }
    r->p = *p;
    r->p.sampling.bias_ids = NULL; /* the samplers keep copies; the caller's may go */
    r->p.sampling.bias = NULL;
    r->p.sampling.n_bias = 0;
    r->p.sampling.grammar = NULL; /* each sampler holds its own reference */
    r->p.sampling.stop_ids = NULL; /* ... and its own copy of these */
    r->p.sampling.n_stop_ids = 0;
    r->p.sampling.dry_sequence_breakers = NULL; /* read at the samplers' creation */
    r->n = r->n_live = n;
    r->n_prompt = n_prompt;
    r->t_submit = util_now_s();
    r->plp_next = 1;
    r->cb = cb;
    r->user = user;
    /* the history grows in sample(); start with room for a short answer */
    int cap = n_prompt + 1 + (p->max_tokens < 256 ? p->max_tokens : 256);
    for (int i = 0; i < n; i++) {
        unit *u = &r->u[i];
        u->r = r;
        u->index = i;
        u->seq = -1;
        kvlm_sampler_params sp = p->sampling;
        sp.seed += (uint64_t)i;
        if (!sp.model) sp.model = s->model; /* its end tokens (ignore_eos, min_tokens) and texts (DRY) */
        u->smp = kvlm_sampler_create(&sp, s->vocab);
        u->hist = malloc((size_t)cap * sizeof(int32_t));
        u->cap = cap;
        if (!u->smp || !u->hist) { req_free(r); util_err_set(err, KVLM_ENOMEM, "out of memory"); return 0; }
        memcpy(u->hist, prompt, (size_t)n_prompt * sizeof(int32_t));
        u->n_hist = n_prompt;
        for (int t = 0; t < n_prompt; t++) kvlm_sampler_accept(u->smp, prompt[t]);
    }
    return enqueue(s, r);
}

uint64_t kvlm_sched_submit_embed(kvlm_sched *s, const int32_t *const *prompts, const int *n_prompts, int n,
                                 const kvlm_embed_params *p, kvlm_sched_cb cb, void *user, kvlm_error *err) {
    kvlm_embed_params d = kvlm_embed_default_params();
    if (!p) p = &d;
    if (!cb || !prompts || !n_prompts || n <= 0) { util_err_set(err, KVLM_EINVAL, "no input to embed"); return 0; }
    int dims, pooling = embed_resolve(s->model, p, &dims, err);
    if (pooling < 0) return 0;
    for (int i = 0; i < n; i++) {
        int np = n_prompts[i];
        if (!prompts[i] || np <= 0) { util_err_set(err, KVLM_EINVAL, "input %d is empty", i); return 0; }
        /* states of a sequence that evicted would not be its input's: the budget bounds an input */
        if (np > s->budget) {
            util_err_set(err, KVLM_ERANGE, "input %d is %d tokens, longer than the %s of %d", i, np,
                         s->budget < s->n_ctx ? "KV budget" : "context", s->budget);
            return 0;
        }
        if (!s->encoder && prompt_blocks(s, np) > s->n_blocks) {
            util_err_set(err, KVLM_ERANGE, "input %d of %d tokens needs %d KV blocks; the cache holds only %d", i, np,
                         prompt_blocks(s, np), s->n_blocks);
            return 0;
        }
        for (int t = 0; t < np; t++)
            if (prompts[i][t] < 0 || prompts[i][t] >= s->vocab) {
                util_err_set(err, KVLM_EINVAL, "input %d: token %d is outside the vocabulary", i, prompts[i][t]);
                return 0;
            }
    }
    req *r = calloc(1, sizeof *r);
    if (!r || !(r->u = calloc((size_t)n, sizeof *r->u))) { free(r); util_err_set(err, KVLM_ENOMEM, "out of memory"); return 0; }
    r->embed = true;
    r->forked = true; /* each unit its own input: none waits for another */
    r->ep = *p;
    r->pooling = pooling;
    r->dims = dims;
    r->p.n = n;
    r->p.logprobs = -1;
    r->n = r->n_live = n;
    r->cb = cb;
    r->user = user;
    for (int i = 0; i < n; i++) {
        unit *u = &r->u[i];
        u->r = r;
        u->index = i;
        u->seq = -1;
        u->n_hist = u->cap = n_prompts[i];
        r->n_prompt += n_prompts[i];
        if (!(u->hist = malloc((size_t)u->cap * sizeof(int32_t)))) {
            req_free(r);
            util_err_set(err, KVLM_ENOMEM, "out of memory");
            return 0;
        }
        memcpy(u->hist, prompts[i], (size_t)u->n_hist * sizeof(int32_t));
    }
    return enqueue(s, r);
}

void kvlm_sched_cancel(kvlm_sched *s, uint64_t id) {
    pthread_mutex_lock(&s->mu);
    for (req *r = s->live; r; r = r->next)
        if (r->id == id) r->cancel = true;
    for (req *r = s->incoming; r; r = r->next)
        if (r->id == id) r->cancel = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Completions 1..n-1 of a request wait for completion 0's prompt, then fork it. */
static bool follower(const unit *u) { return u->index > 0 && !u->r->forked; }

/* Tokens of the history already in the sequence's cache or evicted from it. */
static int fed(const kvlm_sched *s, const unit *u) {
    if (s->encoder) return u->enc_done ? u->n_hist : 0; /* nothing is cached: an input is through or not */
    return kvlm_seq_n_past(s->ctx, u->seq) + (int)kvlm_seq_n_evicted(s->ctx, u->seq);
}

/* Preemption by recompute frees the blocks and recomputes the history
 * later, which only rebuilds the same cache when the recompute evicts nothing. */
static bool recomputable(const kvlm_sched *s, const unit *u) { return u->n_hist <= s->budget; }
/* Preemption by swap keeps the cache's bytes as they are: any sequence, the
 * ones that evicted too, when the swap space has room for it. */
static bool swappable(const kvlm_sched *s, const unit *u) { return kvlm_seq_swap_fits(s->ctx, u->seq); }
static bool preemptable(const kvlm_sched *s, const unit *u) { return recomputable(s, u) || swappable(s, u); }

/* Preemption: swap or recompute. Swapping moves the victim's blocks to the
 * swap space and back: bytes / copy_rate seconds, copy_rate being a measured
 * round trip of block bytes through the pool's storage (kv_block_read then
 * kv_block_write, so a GPU pool's PCIe transfers count). Recomputing runs the
 * tokens it holds through the model again: tokens / prefill_rate seconds,
 * prefill_rate being the tokens the engine computed over its forward-pass
 * time so far; blocks it shares with other sequences stay in the prefix
 * index and cost nothing to get back, so they are not counted. The rule:
 *     swap  when  bytes / copy_rate < tokens / prefill_rate
 * (and always when the victim evicted: a recompute cannot rebuild its cache);
 * recompute when the swap space is off or full. On this machine a round trip
 * is some GB/s against at most 1e5 tokens/s for the smallest model, so swap
 * wins by two orders of magnitude or more (docs/kv-tiers.md, "Preemption:
 * swap or recompute", has the figures). */
static bool choose_swap(kvlm_sched *s, const unit *u) {
    if (!swappable(s, u)) return false;
    if (!recomputable(s, u) || kvlm_seq_n_evicted(s->ctx, u->seq) > 0) return true;
    double copy_rate, prefill_rate;
    kvlm_ctx_preempt_rates(s->ctx, &copy_rate, &prefill_rate);
    int n_blocks, n_shared;
    kvlm_seq_kv_info(s->ctx, u->seq, &n_blocks, &n_shared);
    double tokens = kvlm_seq_n_past(s->ctx, u->seq) - (double)n_shared * s->block_size;
    if (tokens <= 0) return false;
    if (prefill_rate <= 0) return true; /* nothing measured yet: keep what was computed */
    if (copy_rate <= 0) return false;
    return (double)kvlm_seq_swap_bytes(s->ctx, u->seq) / copy_rate < tokens / prefill_rate;
}

static void preempt(kvlm_sched *s, unit *u) {
    bool unforked = u->index == 0 && !u->r->forked;
    int held = u->seq >= 0 ? kvlm_seq_n_past(s->ctx, u->seq) : 0;
    bool swapped = false;
    if (choose_swap(s, u)) {
        kvlm_error err = {0};
        int seq = u->seq;
        size_t bytes = kvlm_seq_swap_bytes(s->ctx, seq);
        bool evicted = kvlm_seq_n_evicted(s->ctx, seq) > 0;
        int rc = kvlm_seq_swap_out(s->ctx, seq, &u->swap, &err);
        if (rc == KVLM_OK) {
            swapped = true;
            s->swaps_evicted += evicted;
            spec_drafter_drop(s->drafter, seq);
            s->slot_used[seq] = false;
            u->seq = -1;
            s->swaps_out++;
            s->swap_bytes += bytes;
        } else if (!recomputable(s, u)) { /* as before swap: end it where it is */
            finish(s, u, rc == KVLM_EFULL ? KVLM_FINISH_LENGTH : KVLM_FINISH_ERROR, rc == KVLM_EFULL ? NULL : err.msg);
            return;
        }
    }
    if (u->seq >= 0) {
        release(s, u);
        s->recomputes++;
    }
    if (unforked) /* its followers wait for its prompt: they hold slots only */
        for (int i = 1; i < u->r->n; i++) release(s, &u->r->u[i]);
    s->preemptions++;
    LOG_INFO("request %llu: completion %d preempted by %s (%d tokens held, %d generated): the KV pool is full",
             (unsigned long long)u->r->id, u->index, swapped ? "swap" : "recompute", held, u->n_gen);
}

static int free_slot(kvlm_sched *s) {
    for (int i = 0; i < kvlm_ctx_n_seq_max(s->ctx); i++)
        if (!s->slot_used[i] && i < s->max_seqs) return i;
    return -1;
}

/* A completion preempted by swap comes back once the pool has its blocks
 * (and those it will grow into); false when it must wait. */
static bool swap_in(kvlm_sched *s, unit *u, bool any_active, int promised) {
    kvlm_prefix_probe pr;
    kvlm_seq_probe_prefix(s->ctx, u->hist, 0, hold(s, u->n_hist), &pr);
    int need = pr.blocks_needed > kvlm_swap_blocks(u->swap) ? pr.blocks_needed : kvlm_swap_blocks(u->swap);
    if (any_active && need > pr.blocks_available - promised) return false;
    int seq = free_slot(s);
    kvlm_error err = {0};
    int blocks = kvlm_swap_blocks(u->swap);
    int rc = kvlm_seq_swap_in(s->ctx, seq, u->swap, &err);
    if (rc == KVLM_EFULL) return false;
    if (rc == KVLM_EIO) { /* lost in the disk tier (and freed): recompute, when that rebuilds it */
        u->swap = NULL;
        if (!recomputable(s, u)) finish(s, u, KVLM_FINISH_LENGTH, NULL);
        else s->recomputes++;
        return false;
    }
    if (rc) { finish(s, u, KVLM_FINISH_ERROR, err.msg); return true; }
    u->swap = NULL;
    u->seq = seq;
    s->slot_used[seq] = true;
    s->swaps_in++;
    s->swap_bytes += (uint64_t)blocks * s->block_bytes;
    return true;
}

/* A draft model's cache in the pool (kvlm_ctx_create_draft) gives back
 * `want` blocks for the model's sequences (its longest sequences first; each
 * dropped one drafts again some steps later, rebuilt from the prefix index,
 * the others go on drafting); true when it held any. */
static bool release_drafts(kvlm_sched *s, int want) {
    return s->drafter && spec_drafter_release(s->drafter, want > 0 ? want : 1) > 0;
}

/* The pool's free and cached blocks, of the store admission counts (gemma:
 * the global layers' one). */
static int pool_room(const kvlm_sched *s) {
    kvlm_prefix_probe pr;
    kvlm_seq_probe_prefix(s->ctx, NULL, 0, 0, &pr);
    return pr.blocks_available;
}

/* Blocks the batch's n tokens need beyond the pool's free and cached ones
 * (its sequences' tokens are adjacent). */
static int batch_shortfall(kvlm_sched *s, int n) {
    int need = 0;
    for (int i = 0, k; i < n; i = k) {
        for (k = i; k < n && s->seqv[k] == s->seqv[i]; k++) {}
        need += kvlm_seq_blocks_needed(s->ctx, s->seqv[i], kvlm_seq_n_past(s->ctx, s->seqv[i]) + k - i);
    }
    return need - pool_room(s);
}

/* A request whose prompt is computed afresh, not taken from the prefix
 * cache: cache_prompt false (at its first admission), or prompt logprobs
 * still to report (the cache gives no logits). */
static bool fresh(const req *r) {
    return (r->p.no_prefix_reuse && !r->admitted) || (r->p.prompt_logprobs && r->plp_next < r->n_prompt);
}

/* An embedding input, fresh or recomputed after preemption: a slot, and
 * (a decoder's) the blocks of its whole input; a LAST-pooled one reuses
 * cached blocks of its prefix (only its last token's state is needed), the
 * others compute every token (each one's state is pooled). Its pooling
 * starts over. False when it must wait. */
static bool admit_embed(kvlm_sched *s, unit *u, bool any_active, int promised) {
    int n = u->n_hist, lookup = u->r->pooling == KVLM_POOLING_LAST ? n : 0;
    if (!s->encoder) {
        kvlm_prefix_probe pr;
        kvlm_seq_probe_prefix(s->ctx, u->hist, lookup, n, &pr);
        if (any_active && pr.blocks_needed > pr.blocks_available - promised) {
            if (!release_drafts(s, pr.blocks_needed - (pr.blocks_available - promised))) return false;
            kvlm_seq_probe_prefix(s->ctx, u->hist, lookup, n, &pr);
            if (pr.blocks_needed > pr.blocks_available - promised) return false;
        }
    }
    if (u->pool.dim == 0 && embed_pool_init(&u->pool, u->r->pooling, kvlm_model_config(s->model)->dim, n)) {
        finish(s, u, KVLM_FINISH_ERROR, "out of memory");
        return true;
    }
    embed_pool_reset(&u->pool);
    u->enc_done = false;
    u->seq = free_slot(s);
    s->slot_used[u->seq] = true;
    int matched = s->encoder ? 0 : kvlm_seq_reuse_prefix(s->ctx, u->seq, u->hist, lookup);
    if (!u->admitted) {
        u->admitted = true;
        u->cached = matched;
        s->prompt_tokens += (uint64_t)n;
        s->cached_tokens += (uint64_t)matched;
    }
    return true;
}

/* FCFS admission of waiting completions while slots and blocks last. */
static void admit(kvlm_sched *s) {
    int n_free = 0, promised = 0;
    bool any_active = false;
    for (int i = 0; i < s->max_seqs; i++) n_free += !s->slot_used[i];
    for (req *r = s->live; r; r = r->next)
        for (int i = 0; i < r->n; i++) {
            unit *u = &r->u[i];
            if (u->seq < 0 || follower(u)) continue;
            any_active = true;
            if (!s->encoder) promised += kvlm_seq_blocks_needed(s->ctx, u->seq, hold(s, u->n_hist));
        }
    for (req *r = s->live; r; r = r->next)
        for (int i = 0; i < r->n; i++) {
            unit *u = &r->u[i];
            if (u->done || u->seq >= 0 || follower(u)) continue;
            int need_slots = r->forked ? 1 : r->n_live;
            if (n_free < need_slots) return;
            if (u->swap) {
                if (!swap_in(s, u, any_active, promised)) return;
                if (u->done) continue;
            } else if (r->embed) {
                if (!admit_embed(s, u, any_active, promised)) return;
                if (u->done) continue;
            } else {
                /* ask first (no side effects), attach only what is admitted */
                int lookup = fresh(r) ? 0 : hold(s, u->n_hist);
                kvlm_prefix_probe pr;
                kvlm_seq_probe_prefix(s->ctx, u->hist, lookup, hold(s, u->n_hist), &pr);
                if (any_active && pr.blocks_needed > pr.blocks_available - promised) {
                    if (!release_drafts(s, pr.blocks_needed - (pr.blocks_available - promised))) return;
                    kvlm_seq_probe_prefix(s->ctx, u->hist, lookup, hold(s, u->n_hist), &pr);
                    if (pr.blocks_needed > pr.blocks_available - promised) return;
                }
                u->seq = free_slot(s);
                s->slot_used[u->seq] = true;
                int matched = lookup ? kvlm_seq_reuse_prefix(s->ctx, u->seq, u->hist, lookup) : 0;
                if (!r->admitted) {
                    r->admitted = true;
                    r->queue_time = util_now_s() - r->t_submit;
                    r->cached = matched;
                    s->prompt_tokens += (uint64_t)r->n_prompt;
                    s->cached_tokens += (uint64_t)matched;
                }
            }
            any_active = true;
            if (!s->encoder) promised += kvlm_seq_blocks_needed(s->ctx, u->seq, hold(s, u->n_hist));
            n_free -= need_slots;
            if (!r->forked)
                for (int k = 1; k < r->n; k++)
                    if (!r->u[k].done) {
                        r->u[k].seq = free_slot(s);
                        s->slot_used[r->u[k].seq] = true;
                    }
        }
}

/* The newest completion holding a sequence (followers go with their leader),
 * or the newest that can be preempted; *n_active: how many hold one. */
static unit *newest_active(kvlm_sched *s, bool only_preemptable, int *n_active) {
    unit *best = NULL;
    int n = 0;
    for (req *r = s->live; r; r = r->next)
        for (int i = 0; i < r->n; i++)
            if (r->u[i].seq >= 0 && !follower(&r->u[i])) {
                n++;
                if (!only_preemptable || preemptable(s, &r->u[i])) best = &r->u[i];
            }
    if (n_active) *n_active = n;
    return best;
}

/* Speculation: drafts by prompt lookup after the unit's token (the last of
 * its history), as many as fit the batch's tokens left and the cache
 * without evicting (the cache then evolves as without speculation). */
static int spec_room(const kvlm_sched *s, const unit *u) {
    /* a leader's first token forks its followers (in the plain path): a
     * prompt found whole in the prefix index decodes its last token alone */
    if (u->index == 0 && !u->r->forked) return 0;
    int len = kvlm_seq_n_past(s->ctx, u->seq), K = u->k_cur ? u->k_cur : s->spec_k;
    int room = (s->budget < s->n_ctx ? s->budget : s->n_ctx) - len - 1;
    if (s->spec_q4kc) {
        int end = (len / s->block_size + 1) * s->block_size;
        if (room > end - len - 2) room = end - len - 2;
    }
    if (K > room) K = room;
    if (K > s->max_feed - 1) K = s->max_feed - 1;
    return K;
}

static int spec_drafts(kvlm_sched *s, unit *u, int budget_left) {
    if (!s->spec_k || s->spec_skip) return 0;
    int K = spec_room(s, u);
    if (K > budget_left) K = budget_left;
    if (K <= 0 || K < s->spec_n_min) return 0;
    int nd = s->drafter ? (u->n_prop < K ? u->n_prop : K) : spec_lookup(u->hist, u->n_hist, 3, 1, K, u->draft);
    if (nd < s->spec_n_min) return 0; /* too few to be worth a check (llama.cpp's --draft-min) */
    kvlm_error err;
    if (nd && kvlm_seq_spec_begin(s->ctx, u->seq, &err)) nd = 0;
    return nd;
}

/* The pool's blocks a draft model's cache in it may take this step: its
 * free and cached ones less what every running sequence needs to hold its
 * text and this step's drafts. */
static int draft_spare(kvlm_sched *s) {
    int need = 0;
    for (req *r = s->live; r; r = r->next)
        for (int i = 0; i < r->n; i++) {
            unit *u = &r->u[i];
            if (!u->done && u->seq >= 0 && !follower(u))
                need += kvlm_seq_blocks_needed(s->ctx, u->seq, hold(s, u->n_hist + (u->r->embed ? 0 : s->spec_k)));
        }
    return pool_room(s) - need;
}

/* Speculation by a draft model: before the step's batch is built, the
 * draft context proposes for every unit that decodes in it, all together
 * (engine/spec_draft); build_batch then takes the drafts that fit. */
static void draft_propose(kvlm_sched *s) {
    s->n_dreq = 0;
    for (req *r = s->live; r; r = r->next)
        for (int i = 0; i < r->n; i++) {
            unit *u = &r->u[i];
            u->n_prop = 0;
            if (u->done || u->seq < 0 || follower(u) || u->r->embed || u->n_hist - fed(s, u) != 1) continue;
            int K = spec_room(s, u);
            if (K <= 0 || K < s->spec_n_min) continue;
            /* sampling: drafts drawn from the draft's distribution, kept with min(1, p/q) */
            u->soft = !sampler_greedy(u->smp) &&
                      (u->q || (u->q = malloc((size_t)s->spec_k * (size_t)s->vocab * sizeof(float))));
            if (K > s->spec_k) K = s->spec_k;
            s->dunit[s->n_dreq] = u;
            s->dreq[s->n_dreq++] =
                (spec_draft_req){u->seq, u->hist, u->n_hist, K, u->draft, 0, u->soft ? u->smp : NULL, u->soft ? u->q : NULL};
        }
    spec_drafter_propose(s->drafter, s->dreq, s->n_dreq, s->batch_tokens, draft_spare(s));
    for (int i = 0; i < s->n_dreq; i++) s->dunit[i]->n_prop = s->dreq[i].n_out;
}

/* After the check: the draft context keeps what the target kept. */
static void draft_sync(kvlm_sched *s) {
    for (int i = 0; i < s->n_dreq; i++) {
        unit *u = s->dunit[i];
        u->n_prop = 0;
        if (!u->done && u->seq >= 0) spec_drafter_sync(s->drafter, u->seq, u->hist, u->n_hist);
    }
    s->n_dreq = 0;
}

static int build_batch(kvlm_sched *s) {
    int n = 0, budget = s->batch_tokens;
    for (int pass = 0; pass < 2; pass++) /* decode tokens first, then prefill chunks */
        for (req *r = s->live; r; r = r->next)
            for (int i = 0; i < r->n; i++) {
                unit *u = &r->u[i];
                if (u->seq < 0 || follower(u)) continue;
                int past = fed(s, u), left = u->n_hist - past;
                if (left <= 0 || (pass == 0) != (left == 1)) continue;
                /* an encoder's input goes whole or waits: alone when it is longer than the step's budget */
                if (s->encoder && left > budget && n > 0) continue;
                int take = left < budget || s->encoder ? left : budget;
                if (take > s->max_feed) take = s->max_feed; /* a batch may not outgrow the KV budget */
                /* prompt logprobs: logits for the prompt's tokens too, in chunks that bound their rows */
                bool plp = u->index == 0 && u->r->p.prompt_logprobs && u->r->plp_next < u->r->n_prompt;
                if (plp && take > 64 && take < left) take = 64;
                bool emb = r->embed;
                for (int t = 0; t < take; t++) {
                    int next = past + t + 1; /* the position this token's logits predict */
                    s->tok[n] = u->hist[past + t];
                    s->seqv[n] = u->seq;
                    s->plp_pos[n] = plp && next < u->r->n_prompt && next >= u->r->plp_next ? next : 0;
                    /* an embedding input: the states its pooling takes, never logits */
                    s->want[n] = emb ? (embed_pool_wants(&u->pool, past + t) ? KVLM_OUTPUT_EMBD : 0)
                                     : t == left - 1 || s->plp_pos[n];
                    s->hpos[n] = past + t;
                    s->who[n] = u;
                    n++;
                }
                budget -= take;
                u->n_draft = pass == 0 && !emb ? spec_drafts(s, u, budget) : 0;
                for (int t = 0; t < u->n_draft; t++) {
                    s->tok[n] = u->draft[t];
                    s->seqv[n] = u->seq;
                    s->plp_pos[n] = 0;
                    s->want[n] = 1;
                    s->who[n] = u;
                    n++;
                }
                budget -= u->n_draft;
                if (budget <= 0) return n;
            }
    return n;
}

/* log-softmax of logits: the chosen token's and the top-k alternatives. */
static void logprobs(kvlm_sched *s, const float *logits, kvlm_sched_event *ev, int k) {
    float mx = logits[0];
    for (int v = 1; v < s->vocab; v++) mx = fmaxf(mx, logits[v]);
    double sum = 0;
    for (int v = 0; v < s->vocab; v++) sum += exp((double)(logits[v] - mx));
    float lse = mx + (float)log(sum);
    ev->logprob = logits[ev->token] - lse;
    ev->rank = 1;
    for (int v = 0; v < s->vocab; v++) ev->rank += logits[v] > logits[ev->token];
    ev->n_top = 0;
    for (int v = 0; v < s->vocab; v++) {
        float l = logits[v] - lse;
        int j = ev->n_top < k ? ev->n_top++ : k;
        if (j == k && (k == 0 || l <= ev->top_logprobs[k - 1])) continue;
        if (j == k) j = k - 1;
        while (j > 0 && ev->top_logprobs[j - 1] < l) {
            ev->top_logprobs[j] = ev->top_logprobs[j - 1];
            ev->top_tokens[j] = ev->top_tokens[j - 1];
            j--;
        }
        ev->top_logprobs[j] = l;
        ev->top_tokens[j] = v;
    }
}

/* Gives out a token the sampler picked from logits (recorded there). */
static void emit(kvlm_sched *s, unit *u, int32_t token, const float *logits) {
    kvlm_sched_event ev = event_for(u);
    ev.token = token;
    if (kvlm_token_is_eog(s->model, ev.token)) { finish(s, u, KVLM_FINISH_STOP, NULL); return; }
    if (u->r->p.logprobs >= 0) logprobs(s, logits, &ev, u->r->p.logprobs);
    if (u->n_hist == u->cap) {
        int32_t *h = u->cap < INT32_MAX / 2 ? realloc(u->hist, (size_t)u->cap * 2 * sizeof *h) : NULL;
        if (!h) { finish(s, u, KVLM_FINISH_ERROR, "out of memory"); return; }
        u->hist = h;
        u->cap *= 2;
    }
    u->hist[u->n_hist++] = ev.token;
    u->n_gen++;
    s->generated++;
    if (!u->r->cb(u->r->user, &ev) || kvlm_sampler_is_stop(u->smp, ev.token)) finish(s, u, KVLM_FINISH_STOP, NULL);
    else if (u->n_gen >= u->r->p.max_tokens || (!s->evicts && u->n_hist > s->budget))
        finish(s, u, KVLM_FINISH_LENGTH, NULL);
}

static void sample(kvlm_sched *s, unit *u, const float *logits) { emit(s, u, kvlm_sampler_sample(u->smp, logits), logits); }

/* prompt_logprobs: prompt position pos's log-probability from the logits after the token before it. */
static void prompt_logprob(kvlm_sched *s, unit *u, int pos, const float *logits) {
    kvlm_sched_event ev = event_for(u);
    ev.prompt_token = true;
    ev.pos = pos;
    ev.token = u->hist[pos];
    logprobs(s, logits, &ev, u->r->p.prompt_top_logprobs);
    u->r->plp_next = pos + 1;
    u->r->cb(u->r->user, &ev);
}

/* A unit whose token came with drafts: rows li .. li + n_draft hold the
 * target's logits after each; the drafts it agrees with are kept (the rule
 * of engine/spec.h), the rest taken back from the cache, then the kept ones
 * and the next token are given out. */
static void verify(kvlm_sched *s, unit *u, int li) {
    int nd = u->n_draft, j = 0;
    int32_t next = -1;
    u->n_draft = 0;
    for (; j < nd; j++) {
        const float *row = kvlm_get_logits(s->ctx, li + j);
        if (!(s->drafter && u->soft
                  ? spec_check_q(u->smp, row, u->draft[j], u->q + (size_t)j * (size_t)s->vocab, s->spec_ids,
                                 s->spec_probs, &next)
                  : spec_check(u->smp, row, u->draft[j], s->spec_ids, s->spec_probs, &next)))
            break;
    }
    s->spec_drafted += (uint64_t)nd;
    s->spec_accepted += (uint64_t)j;
    int k = u->k_cur ? u->k_cur : s->spec_k;
    if (j == 0) u->k_cur = k / 2 > s->spec_n_min ? k / 2 : s->spec_n_min > 1 ? s->spec_n_min : 1;
    else if (j == nd && nd == k) u->k_cur = k * 2 < s->spec_k ? k * 2 : s->spec_k;
    kvlm_error err = {0};
    int keep = kvlm_seq_n_past(s->ctx, u->seq) - (nd - j);
    if (kvlm_seq_trim(s->ctx, u->seq, keep, &err)) { finish(s, u, KVLM_FINISH_ERROR, err.msg); return; }
    for (int k = 0; k < j && !u->done; k++) emit(s, u, u->draft[k], kvlm_get_logits(s->ctx, li + k));
    if (u->done) return;
    if (j < nd) emit(s, u, next, kvlm_get_logits(s->ctx, li + j));
    else sample(s, u, kvlm_get_logits(s->ctx, li + nd));
}

/* The live requests and the running and waiting counts, published (at
 * admission, before the step's forward pass, and after it). */
static void publish_requests(kvlm_sched *s) {
    int running = 0, waiting = 0, n = 0;
    for (req *r = s->live; r; r = r->next) n++;
    if (n > s->cap_work_req) {
        kvlm_sched_req_info *w = realloc(s->work_req, (size_t)n * 2 * sizeof *w);
        if (w) { s->work_req = w; s->cap_work_req = n * 2; }
        else n = s->cap_work_req;
    }
    kvlm_sched_req_info *info = s->work_req;
    int k = 0;
    for (req *r = s->live; r && k < n; r = r->next, k++) {
        kvlm_sched_req_info *q = &info[k];
        memset(q, 0, sizeof *q);
        q->id = r->id;
        q->prompt_tokens = r->n_prompt;
        q->cached_tokens = r->cached;
        for (int i = 0; i < r->n; i++) {
            unit *u = &r->u[i];
            q->generated += u->n_gen;
            if (u->seq < 0 || follower(u)) continue;
            int b, sh;
            kvlm_seq_kv_info(s->ctx, u->seq, &b, &sh);
            q->blocks += b;
            q->shared_blocks += sh;
            int done = fed(s, u), st = u->n_hist - done <= 1 ? 2 : 1;
            if (st == 1 && u->n_hist - done > q->prefill_total - q->prefill_done) { /* the one furthest from done */
                q->prefill_done = done;
                q->prefill_total = u->n_hist;
            }
            if (st > q->state) q->state = st;
        }
        if (q->state != 1) q->prefill_done = q->prefill_total = 0;
        if (q->state) running++;
        else waiting++;
    }
    pthread_mutex_lock(&s->mu);
    s->work_req = s->snap_req;
    s->snap_req = info;
    int cap = s->cap_work_req;
    s->cap_work_req = s->cap_snap_req;
    s->cap_snap_req = cap;
    s->n_snap_req = k;
    s->snap.running = running;
    s->snap.waiting = waiting;
    pthread_mutex_unlock(&s->mu);
}

static void publish(kvlm_sched *s) {
    publish_requests(s);
    double now = util_now_s();
    if (now - s->mark_t >= 1.0) {
        s->tps = s->mark_t > 0 ? ((double)s->generated - s->mark_gen) / (now - s->mark_t) : 0;
        s->mark_t = now;
        s->mark_gen = (double)s->generated;
    }
    s->last_step_t = now;
    pthread_mutex_lock(&s->mu);
    s->snap.preemptions = s->preemptions;
    s->snap.swaps_out = s->swaps_out;
    s->snap.swaps_in = s->swaps_in;
    s->snap.recomputes = s->recomputes;
    s->snap.swap_bytes = s->swap_bytes;
    s->snap.swaps_evicted = s->swaps_evicted;
    s->snap.steps = s->steps;
    s->snap.requests_done = s->done;
    s->snap.prompt_tokens = s->prompt_tokens;
    s->snap.cached_tokens = s->cached_tokens;
    s->snap.generated_tokens = s->generated;
    s->snap.spec_drafted = s->spec_drafted;
    s->snap.embeddings = s->embeddings;
    s->snap.embedding_tokens = s->embedding_tokens;
    s->snap.spec_accepted = s->spec_accepted;
    if (s->drafter)
        spec_drafter_counts(s->drafter, &s->snap.spec_draft_steps, &s->snap.spec_draft_failures,
                            &s->snap.spec_draft_released, &s->snap.spec_draft_windows, &s->snap.spec_draft_waits);
    s->snap.tokens_per_second = s->tps;
    kvlm_kv_stats_get(s->ctx, &s->snap.kv);
    s->snap.n_tiers = kvlm_kv_tier_stats_get(s->ctx, s->snap.tiers, KVLM_MAX_KV_TIERS);
    pthread_mutex_unlock(&s->mu);
}

/* Engine thread, between steps: the prefix index's keys, if anyone asked. */
static void take_blocks(kvlm_sched *s) {
    pthread_mutex_lock(&s->mu);
    bool want = s->want_blocks;
    pthread_mutex_unlock(&s->mu);
    if (!want) return;
    int n = -1, nh = kvlm_kv_host_blocks(s->ctx, NULL, 0);
    if (s->blk_work || (s->blk_work = malloc((size_t)s->n_blocks * 16)))
        n = kvlm_kv_cached_blocks(s->ctx, s->blk_work, s->n_blocks);
    if (nh > s->cap_host_work) {
        void *w = realloc(s->host_work, (size_t)nh * 16);
        if (w) {
            s->host_work = w;
            s->cap_host_work = nh;
        } else n = -1;
    }
    if (n >= 0 && nh > 0) nh = kvlm_kv_host_blocks(s->ctx, s->host_work, nh);
    pthread_mutex_lock(&s->mu);
    if (n < 0 || nh < 0) { /* out of memory: until asked again */
        s->want_blocks = false;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    uint8_t (*t)[16] = s->blk_snap;
    s->blk_snap = s->blk_work;
    s->blk_work = t;
    s->n_blk_snap = n < s->n_blocks ? n : s->n_blocks;
    t = s->host_snap;
    s->host_snap = s->host_work;
    s->host_work = t;
    int c = s->cap_host_snap;
    s->cap_host_snap = s->cap_host_work;
    s->cap_host_work = c;
    s->n_host_snap = nh;
    pthread_mutex_unlock(&s->mu);
}

int kvlm_sched_kv_host_blocks(kvlm_sched *s, uint8_t (*keys)[16], int cap) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_blk_snap < 0 ? -1 : s->n_host_snap; /* taken with the pool's */
    if (n > 0 && cap > 0) memcpy(keys, s->host_snap, (size_t)(n < cap ? n : cap) * 16);
    pthread_mutex_unlock(&s->mu);
    return n;
}

int kvlm_sched_kv_blocks(kvlm_sched *s, uint8_t (*keys)[16], int cap) {
    pthread_mutex_lock(&s->mu);
    if (!s->want_blocks) {
        s->want_blocks = true;
        pthread_cond_signal(&s->cv); /* an idle engine thread takes them now */
    }
    int n = s->n_blk_snap;
    if (n > 0) memcpy(keys, s->blk_snap, (size_t)(n < cap ? n : cap) * 16);
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* After a failed decode: ends the speculation of the batch's units; true
 * when there was any (the step is then tried again without drafts). */
static bool spec_undo(kvlm_sched *s, int n) {
    bool any = false;
    kvlm_error err;
    for (int i = 0; i < n; i++) {
        unit *u = s->who[i];
        if (!u->n_draft) continue;
        u->n_draft = 0;
        kvlm_seq_trim(s->ctx, u->seq, kvlm_seq_n_past(s->ctx, u->seq), &err);
        any = true;
    }
    if (any) s->spec_skip = true;
    return any;
}

int kvlm_sched_step(kvlm_sched *s) {
    pthread_mutex_lock(&s->mu);
    if (s->incoming) {
        /* counted waiting at once (they leave the incoming list, which kvlm_sched_stats_get counts) */
        for (req *r = s->incoming; r; r = r->next) s->snap.waiting++;
        if (s->live_tail) s->live_tail->next = s->incoming;
        else s->live = s->incoming;
        s->live_tail = s->incoming_tail;
        s->incoming = s->incoming_tail = NULL;
    }
    for (req *r = s->live; r; r = r->next) r->kill = r->cancel;
    pthread_mutex_unlock(&s->mu);
    for (req *r = s->live; r; r = r->next) /* callbacks run outside the lock */
        if (r->kill)
            for (int i = 0; i < r->n; i++) finish(s, &r->u[i], KVLM_FINISH_CANCELLED, NULL);
    reap(s);
    admit(s);
    publish_requests(s); /* requests admitted now count as running during their prefill */
    s->spec_skip = false;
    if (s->drafter) draft_propose(s);
    int n = 0;
    kvlm_error err = {0};
    for (;;) {
        n = build_batch(s);
        if (n == 0) break;
        kvlm_batch b = {n, s->tok, NULL, s->want, s->seqv};
        int rc = kvlm_decode(s->ctx, &b, &err);
        if (rc == KVLM_OK) break;
        if (spec_undo(s, n)) continue; /* no room for the drafts: first try without them */
        /* a draft model's cache in the pool gives its blocks back before any sequence is preempted */
        if (rc == KVLM_EFULL && s->drafter && release_drafts(s, batch_shortfall(s, n))) continue;
        int n_active;
        unit *victim = newest_active(s, true, &n_active), *newest = newest_active(s, false, NULL);
        if (rc == KVLM_EFULL && newest) {
            if (victim && n_active > 1) { preempt(s, victim); continue; }
            /* one sequence alone outgrows the pool, or only ones that evicted (their
             * cache cannot be recomputed) and do not fit the swap space are left:
             * end the newest where it is */
            if (newest->n_gen > 0) {
                kvlm_kv_stats kv;
                kvlm_kv_stats_get(s->ctx, &kv);
                LOG_WARN("request %llu: completion %d ended after %d tokens (%d held): the KV pool of %d blocks of %d "
                         "tokens cannot hold it and no other sequence is left to preempt (finish kv_cache_full)",
                         (unsigned long long)newest->r->id, newest->index, newest->n_gen, newest->n_hist, kv.n_blocks,
                         kv.block_size);
                finish(s, newest, KVLM_FINISH_KV_FULL, NULL);
                continue;
            }
        }
        for (int i = 0; i < n; i++) /* an error that is not about room: end what was in the batch */
            if (!s->who[i]->done) {
                unit *u = s->who[i];
                if (!u->r->forked)
                    for (int k = 1; k < u->r->n; k++) finish(s, &u->r->u[k], KVLM_FINISH_ERROR, err.msg);
                finish(s, u, KVLM_FINISH_ERROR, err.msg);
            }
        n = 0;
        break;
    }
    if (n > 0) s->steps++;
    bool any_embed = false;
    for (int i = 0, li = 0, ei = 0; i < n; i++) {
        unit *u = s->who[i];
        if (u->r->embed) { /* a state its pooling takes; the input ends below once all are in */
            if (s->want[i] == KVLM_OUTPUT_EMBD && !u->done) embed_pool_add(&u->pool, s->hpos[i], kvlm_get_embeddings(s->ctx, ei));
            ei += s->want[i] == KVLM_OUTPUT_EMBD;
            if (s->encoder) u->enc_done = true;
            any_embed = true;
            continue;
        }
        if (!s->want[i]) continue;
        if (s->plp_pos[i]) {
            const float *row = kvlm_get_logits(s->ctx, li++);
            if (!u->done) prompt_logprob(s, u, s->plp_pos[i], row);
            continue;
        }
        if (u->n_draft) { /* its token and drafts: rows li .. li + n_draft */
            verify(s, u, li);
            int k = i + 1;
            while (k < n && s->who[k] == u) k++;
            li += k - i;
            i = k - 1;
            continue;
        }
        const float *logits = kvlm_get_logits(s->ctx, li++);
        req *r = u->r;
        if (u->index == 0 && !r->forked) {
            r->forked = true;
            for (int k = 1; k < r->n; k++) {
                unit *f = &r->u[k];
                if (f->done) continue;
                if (kvlm_seq_fork(s->ctx, u->seq, f->seq, &err)) { finish(s, f, KVLM_FINISH_ERROR, err.msg); continue; }
                memcpy(f->hist, u->hist, (size_t)u->n_hist * sizeof(int32_t));
                f->n_hist = u->n_hist;
            }
            for (int k = 1; k < r->n; k++)
                if (!r->u[k].done) sample(s, &r->u[k], logits);
        }
        sample(s, u, logits);
    }
    if (s->drafter) draft_sync(s);
    for (int i = 0; any_embed && i < n; i++) { /* the inputs that are through: their vectors */
        unit *u = s->who[i];
        if (u->r->embed && !u->done && u->seq >= 0 && fed(s, u) >= u->n_hist && embed_pool_done(&u->pool))
            finish_embed(s, u);
    }
    reap(s);
    kvlm_ctx_kv_events_flush(s->ctx); /* this step's KV events form one batch */
    take_blocks(s);
    publish(s);
    pthread_mutex_lock(&s->mu);
    int left = 0;
    for (req *r = s->live; r; r = r->next) left++;
    for (req *r = s->incoming; r; r = r->next) left++;
    pthread_mutex_unlock(&s->mu);
    return left;
}

void kvlm_sched_run(kvlm_sched *s) {
    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        bool work = s->incoming != NULL;
        for (req *r = s->live; r && !work; r = r->next) work = true;
        if (!work && s->want_blocks && s->n_blk_snap < 0) { /* the first kvlm_sched_kv_blocks, while idle */
            pthread_mutex_unlock(&s->mu);
            take_blocks(s);
            pthread_mutex_lock(&s->mu);
            continue;
        }
        if (!work) { pthread_cond_wait(&s->cv, &s->mu); continue; }
        pthread_mutex_unlock(&s->mu);
        kvlm_sched_step(s);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

void kvlm_sched_stop(kvlm_sched *s) {
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void kvlm_sched_stats_get(kvlm_sched *s, kvlm_sched_stats *st) {
    pthread_mutex_lock(&s->mu);
    *st = s->snap;
    for (req *r = s->incoming; r; r = r->next) st->waiting++;
    if (util_now_s() - s->last_step_t > 2.0) st->tokens_per_second = 0;
    pthread_mutex_unlock(&s->mu);
}

int kvlm_sched_requests(kvlm_sched *s, kvlm_sched_req_info *out, int cap) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_snap_req;
    for (int i = 0; i < n && i < cap; i++) out[i] = s->snap_req[i];
    int k = n;
    for (req *r = s->incoming; r; r = r->next, k++)
        if (k < cap) {
            memset(&out[k], 0, sizeof out[k]);
            out[k].id = r->id;
            out[k].prompt_tokens = r->n_prompt;
        }
    pthread_mutex_unlock(&s->mu);
    return k;
}
