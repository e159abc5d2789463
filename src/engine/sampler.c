/* engine/sampler: choosing the next token from logits: logit biases, repetition, frequency
 * and presence penalties, the grammar's mask, then greedy, or top-k -> temperature ->
 * top-p -> min-p -> a seeded draw. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"
#include "engine/grammar.h"
#include "engine/sampler.h"
#include "ops/ops.h"
#include "util/error.h"

typedef struct { float logit; int32_t id; } cand;

struct kvlm_sampler {
    kvlm_sampler_params p;
    int vocab;
    uint64_t rng;
    cand *c;
    int32_t *recent;   /* ring of the last repeat_last_n tokens */
    int n_recent, recent_pos;
    int32_t *count;    /* times each token was picked (frequency/presence penalties) */
    int32_t *bias_ids; /* p.bias_ids / p.bias, copied (p's point here) */
    float *bias;
    gm *gm;            /* p.grammar: where the text is in it; this step's mask */
    const kvlm_model *gmodel;
    bool *allowed;
};

kvlm_sampler_params kvlm_sampler_default_params(void) {
    kvlm_sampler_params p = {0};
    p.temperature = 0.8f;
    p.top_k = 40;
    p.top_p = 0.95f;
    p.min_p = 0.05f;
    p.repeat_penalty = 1.0f;
    p.repeat_last_n = 64;
    p.seed = 0x5eed;
    return p;
}

/* A value within [lo, hi] (NaN is not); else err says so. */
static bool in_range(double x, double lo, double hi, kvlm_error *err) {
    if (x >= lo && x <= hi) return true;
    util_err_set(err, KVLM_ERANGE, "must be between %.10g and %.10g", lo, hi);
    return false;
}

int kvlm_sampler_params_check(const kvlm_sampler_params *p, int vocab_size, int *index, kvlm_error *err) {
    kvlm_error scratch;
    if (!err) err = &scratch;
    if (index) *index = -1;
    if (!in_range(p->temperature, 0, 2, err)) return KVLM_SAMPLER_TEMPERATURE;
    if (!in_range(p->top_k, -1, 1e9, err)) return KVLM_SAMPLER_TOP_K;
    if (!in_range(p->top_p, 0, 1, err)) return KVLM_SAMPLER_TOP_P;
    if (!in_range(p->min_p, 0, 1, err)) return KVLM_SAMPLER_MIN_P;
    if (!in_range(p->repeat_penalty, 0, 100, err)) return KVLM_SAMPLER_REPEAT_PENALTY;
    if (!in_range(p->repeat_last_n, 0, 65536, err)) return KVLM_SAMPLER_REPEAT_LAST_N;
    if (!in_range(p->frequency_penalty, -2, 2, err)) return KVLM_SAMPLER_FREQUENCY_PENALTY;
    if (!in_range(p->presence_penalty, -2, 2, err)) return KVLM_SAMPLER_PRESENCE_PENALTY;
    for (int i = 0; p->bias_ids && p->bias && i < p->n_bias; i++) {
        if (index) *index = i;
        if (p->bias_ids[i] < 0 || (vocab_size > 0 && p->bias_ids[i] >= vocab_size)) {
            if (vocab_size > 0) util_err_set(err, KVLM_ERANGE, "must be a token id below %d", vocab_size);
            else util_err_set(err, KVLM_ERANGE, "must be a token id (0 or more)");
            return KVLM_SAMPLER_BIAS_ID;
        }
        if (p->bias[i] != -INFINITY && !in_range(p->bias[i], -100, 100, err)) return KVLM_SAMPLER_BIAS;
    }
    if (index) *index = -1;
    return KVLM_SAMPLER_OK;
}

int kvlm_parse_token_id(const char *s, size_t n) {
    if (!s || !n || n > 10 || (s[0] == '0' && n > 1)) return -1;
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v <= INT32_MAX ? (int)v : -1;
}

kvlm_sampler *kvlm_sampler_create(const kvlm_sampler_params *p, int vocab) {
    if (vocab <= 0) return NULL;
    kvlm_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = p ? *p : kvlm_sampler_default_params();
    if (s->p.repeat_last_n < 0) s->p.repeat_last_n = 0;
    s->vocab = vocab;
    s->rng = s->p.seed ^ 0x9e3779b97f4a7c15ull;
    if (!s->rng) s->rng = 1;
    if (s->p.n_bias > 0 && s->p.bias_ids && s->p.bias) {
        s->bias_ids = malloc((size_t)s->p.n_bias * sizeof *s->bias_ids);
        s->bias = malloc((size_t)s->p.n_bias * sizeof *s->bias);
        if (!s->bias_ids || !s->bias) {
            kvlm_sampler_free(s);
            return NULL;
        }
        int k = 0;
        for (int i = 0; i < s->p.n_bias; i++)
            if (s->p.bias_ids[i] >= 0 && s->p.bias_ids[i] < vocab) {
                s->bias_ids[k] = s->p.bias_ids[i];
                s->bias[k++] = s->p.bias[i];
            }
        s->p.n_bias = k;
    } else s->p.n_bias = 0;
    s->p.bias_ids = s->bias_ids;
    s->p.bias = s->bias;
    if (s->p.grammar) {
        s->gmodel = gm_model(s->p.grammar);
        if (!s->gmodel || kvlm_vocab_size(s->gmodel) != vocab || !(s->gm = gm_new(s->p.grammar)) ||
            !(s->allowed = malloc((size_t)vocab * sizeof *s->allowed))) {
            kvlm_sampler_free(s);
            return NULL;
        }
    }
    s->p.grammar = NULL; /* the matcher holds the reference */
    s->c = malloc((size_t)vocab * sizeof *s->c);
    s->recent = malloc(((size_t)s->p.repeat_last_n + 1) * sizeof(int32_t));
    if (s->p.frequency_penalty != 0 || s->p.presence_penalty != 0) s->count = calloc((size_t)vocab, sizeof(int32_t));
    if (!s->c || !s->recent || ((s->p.frequency_penalty != 0 || s->p.presence_penalty != 0) && !s->count)) {
        kvlm_sampler_free(s);
        return NULL;
    }
    return s;
}

void kvlm_sampler_free(kvlm_sampler *s) {
    if (!s) return;
    free(s->c);
    free(s->recent);
    free(s->count);
    free(s->bias_ids);
    free(s->bias);
    free(s->allowed);
    gm_free(s->gm);
    free(s);
}

void kvlm_sampler_accept(kvlm_sampler *s, int32_t token) {
    if (s->p.repeat_last_n == 0) return;
    s->recent[s->recent_pos] = token;
    s->recent_pos = (s->recent_pos + 1) % s->p.repeat_last_n;
    if (s->n_recent < s->p.repeat_last_n) s->n_recent++;
}

static uint64_t next_u64(kvlm_sampler *s) { /* xorshift64* */
    s->rng ^= s->rng >> 12;
    s->rng ^= s->rng << 25;
    s->rng ^= s->rng >> 27;
    return s->rng * 2685821657736338717ull;
}

static int by_logit_desc(const void *a, const void *b) {
    float x = ((const cand *)a)->logit, y = ((const cand *)b)->logit;
    if (x != y) return x < y ? 1 : -1;
    return ((const cand *)a)->id - ((const cand *)b)->id;
}

/* Moves the k largest to the front, sorted (k small: selection by heap-free
 * partial quickselect then qsort of the head). */
static void top_k_sort(cand *c, int n, int k) {
    if (k >= n) { qsort(c, (size_t)n, sizeof *c, by_logit_desc); return; }
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        cand pivot = c[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (by_logit_desc(&c[i], &pivot) < 0) i++;
            while (by_logit_desc(&c[j], &pivot) > 0) j--;
            if (i <= j) { cand t = c[i]; c[i] = c[j]; c[j] = t; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    qsort(c, (size_t)k, sizeof *c, by_logit_desc);
}

/* The distribution the sampler draws from: s->c[0, n) holds the candidates
 * with their probabilities, largest first, after the penalties, top-k,
 * temperature, top-p and min-p (their sum, *total, is not renormalised after
 * the cuts); greedy: the one pick with probability 1. Returns n. */
static int build_dist(kvlm_sampler *s, const float *logits, float *total) {
    int n = s->vocab;
    bool penalty = s->p.repeat_penalty != 1.0f && s->p.repeat_penalty > 0;
    if (s->p.temperature <= 0 && !penalty && !s->count && !s->p.n_bias && !s->gm) { /* greedy: the first largest logit */
        s->c[0].id = op_argmax(logits, n);
        s->c[0].logit = *total = 1;
        return 1;
    }
    for (int i = 0; i < n; i++) { s->c[i].logit = logits[i]; s->c[i].id = i; }
    for (int i = 0; i < s->p.n_bias; i++) s->c[s->bias_ids[i]].logit += s->bias[i];
    if (penalty) {
        /* Penalise each distinct recent token once (as llama.cpp does). */
        for (int r = 0; r < s->n_recent; r++) {
            int32_t t = s->recent[r];
            if (t < 0 || t >= n) continue;
            bool seen = false;
            for (int q = 0; q < r && !seen; q++) seen = s->recent[q] == t;
            if (seen) continue;
            float *l = &s->c[t].logit;
            *l = *l > 0 ? *l / s->p.repeat_penalty : *l * s->p.repeat_penalty;
        }
    }
    if (s->count) /* as OpenAI defines them, over the tokens picked so far */
        for (int i = 0; i < n; i++)
            if (s->count[i])
                s->c[i].logit -= s->p.frequency_penalty * (float)s->count[i] + s->p.presence_penalty;
    if (s->gm) { /* only what the grammar allows (nothing: the end tokens, whatever the state) */
        bool any = gm_allowed(s->gm, s->allowed) > 0;
        int k = 0;
        for (int i = 0; i < n; i++)
            if (any ? s->allowed[i] : kvlm_token_is_eog(s->gmodel, i)) s->c[k++] = s->c[i];
        if (k) n = k; /* no end token either: left free */
    }
    if (s->p.temperature <= 0) {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (s->c[i].logit > s->c[best].logit) best = i;
        s->c[0].id = s->c[best].id;
        s->c[0].logit = *total = 1;
        return 1;
    }
    int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    top_k_sort(s->c, n, k);
    n = k;
    float maxl = s->c[0].logit, sum = 0;
    for (int i = 0; i < n; i++) {
        s->c[i].logit = expf((s->c[i].logit - maxl) / s->p.temperature);
        sum += s->c[i].logit;
    }
    for (int i = 0; i < n; i++) s->c[i].logit /= sum;   /* now probabilities, descending */
    if (s->p.top_p < 1.0f && s->p.top_p > 0) {
        float cum = 0;
        for (int i = 0; i < n; i++) {
            cum += s->c[i].logit;
            if (cum >= s->p.top_p) { n = i + 1; break; }
        }
    }
    if (s->p.min_p > 0) {
        float floor = s->p.min_p * s->c[0].logit;
        int keep = 1;
        while (keep < n && s->c[keep].logit >= floor) keep++;
        n = keep;
    }
    float t = 0;
    for (int i = 0; i < n; i++) t += s->c[i].logit;
    *total = t;
    return n;
}

double sampler_uniform(kvlm_sampler *s) { return (double)(next_u64(s) >> 11) * (1.0 / 9007199254740992.0); }

void sampler_picked(kvlm_sampler *s, int32_t token) {
    kvlm_sampler_accept(s, token);
    if (s->gm) gm_feed_token(s->gm, token); /* refused only when nothing was allowed: the text stays where it was */
    if (s->count && token >= 0 && token < s->vocab && s->count[token] < INT32_MAX) s->count[token]++;
}

int sampler_dist(kvlm_sampler *s, const float *logits, int32_t *ids, float *probs) {
    float total;
    int n = build_dist(s, logits, &total);
    for (int i = 0; i < n; i++) {
        ids[i] = s->c[i].id;
        probs[i] = s->c[i].logit / total;
    }
    return n;
}

bool sampler_greedy(const kvlm_sampler *s) { return s->p.temperature <= 0; }

int32_t kvlm_sampler_sample(kvlm_sampler *s, const float *logits) {
    float total;
    int n = build_dist(s, logits, &total);
    int32_t pick = s->c[0].id;
    if (s->p.temperature > 0) {
        double r = sampler_uniform(s) * total, cum = 0;
        pick = s->c[n - 1].id;
        for (int i = 0; i < n; i++) {
            cum += s->c[i].logit;
            if (r < cum) { pick = s->c[i].id; break; }
        }
    }
    sampler_picked(s, pick);
    return pick;
}
