/* engine/sampler: choosing the next token from logits: logit biases, bans (ignore_eos,
 * min_tokens), the repetition penalties (llama.cpp's over the last n tokens, vLLM's over
 * prompt and output, OpenAI's frequency and presence), DRY, the grammar's mask, then greedy,
 * or top-k -> (typical) -> temperature -> top-p -> min-p -> (XTC) -> a seeded draw, in that
 * order or the one params.stages gives. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"
#include "engine/grammar.h"
#include "engine/sampler.h"
#include "ops/ops.h"
#include "util/error.h"

typedef struct { float logit; int32_t id; } cand;

enum { DRY_MAX_HISTORY = 65536, DRY_MAX_BREAKER_LEN = 40 };

struct kvlm_sampler {
    kvlm_sampler_params p;
    int vocab;
    uint64_t rng;
    cand *c;
    int32_t *recent;   /* ring of the last repeat_last_n tokens */
    int n_recent, recent_pos;
    uint32_t *stamp;   /* per token: the call that marked it (dedupes the recent ring) */
    uint32_t stamp_now;
    int32_t *count;    /* times each token was picked (frequency/presence penalties) */
    uint8_t *seen;     /* tokens of the prompt or the output (repetition_penalty) */
    int32_t *bias_ids; /* p.bias_ids / p.bias, copied (p's point here) */
    float *bias;
    int32_t *stop_ids; /* p.stop_ids, copied */
    bool *eog;         /* the model's end-of-generation tokens (bans), or NULL */
    int n_picked;      /* tokens picked (min_tokens) */
    gm *gm;            /* p.grammar: where the text is in it; this step's mask */
    const kvlm_model *gmodel;
    bool *allowed;
    /* DRY: the history it looks at (a ring), breaker tokens, scratch */
    int32_t *dry_hist;
    int dry_cap, n_dry, dry_pos;
    bool *breaker;
    int32_t *dry_win, *dry_z, *dry_max, *dry_touched;
    float *probs;      /* scratch: the candidates' probabilities (the general chain) */
    bool chain;        /* stages other than kvlm's default order's top-k/temperature/top-p/min-p run */
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
    p.repetition_penalty = 1.0f;
    p.typical_p = 1.0f;
    p.dry_base = 1.75f;
    p.dry_allowed_length = 2;
    p.dry_penalty_last_n = -1;
    p.xtc_threshold = 0.1f;
    return p;
}

/* ---- stage names ---------------------------------------------------------------- */

static const struct { const char *name; int stage; } k_stage_names[] = {
    {"penalties", KVLM_STAGE_PENALTIES}, {"dry", KVLM_STAGE_DRY}, {"top_k", KVLM_STAGE_TOP_K},
    {"typ_p", KVLM_STAGE_TYPICAL_P}, {"top_p", KVLM_STAGE_TOP_P}, {"min_p", KVLM_STAGE_MIN_P},
    {"xtc", KVLM_STAGE_XTC}, {"temperature", KVLM_STAGE_TEMPERATURE},
    /* llama.cpp's other spellings */
    {"top-k", KVLM_STAGE_TOP_K}, {"top-p", KVLM_STAGE_TOP_P}, {"nucleus", KVLM_STAGE_TOP_P},
    {"typical-p", KVLM_STAGE_TYPICAL_P}, {"typical", KVLM_STAGE_TYPICAL_P}, {"typ-p", KVLM_STAGE_TYPICAL_P},
    {"typ", KVLM_STAGE_TYPICAL_P}, {"typical_p", KVLM_STAGE_TYPICAL_P}, {"min-p", KVLM_STAGE_MIN_P},
    {"temp", KVLM_STAGE_TEMPERATURE},
};

int kvlm_sampler_stage_from_name(const char *name) {
    for (size_t i = 0; name && i < sizeof k_stage_names / sizeof k_stage_names[0]; i++)
        if (!strcmp(k_stage_names[i].name, name)) return k_stage_names[i].stage;
    return 0;
}

const char *kvlm_sampler_stage_name(int stage) {
    for (size_t i = 0; i < sizeof k_stage_names / sizeof k_stage_names[0]; i++)
        if (k_stage_names[i].stage == stage) return k_stage_names[i].name;
    return NULL;
}

int kvlm_sampler_stage_from_char(char c) {
    switch (c) {
    case 'e': return KVLM_STAGE_PENALTIES;
    case 'd': return KVLM_STAGE_DRY;
    case 'k': return KVLM_STAGE_TOP_K;
    case 'y': return KVLM_STAGE_TYPICAL_P;
    case 'p': return KVLM_STAGE_TOP_P;
    case 'm': return KVLM_STAGE_MIN_P;
    case 'x': return KVLM_STAGE_XTC;
    case 't': return KVLM_STAGE_TEMPERATURE;
    default: return 0;
    }
}

/* ---- checks ---------------------------------------------------------------------- */

/* A value within [lo, hi] (NaN is not); else err says so. */
static bool in_range(double x, double lo, double hi, kvlm_error *err) {
    if (x >= lo && x <= hi) return true;
    util_err_set(err, KVLM_ERANGE, "must be between %.10g and %.10g", lo, hi);
    return false;
}

static int check_token_ids(const int32_t *ids, int n, int vocab_size, int *index, kvlm_error *err) {
    for (int i = 0; ids && i < n; i++) {
        if (index) *index = i;
        if (ids[i] < 0 || (vocab_size > 0 && ids[i] >= vocab_size)) {
            if (vocab_size > 0) util_err_set(err, KVLM_ERANGE, "must be a token id below %d", vocab_size);
            else util_err_set(err, KVLM_ERANGE, "must be a token id (0 or more)");
            return -1;
        }
    }
    return 0;
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
        if (check_token_ids(&p->bias_ids[i], 1, vocab_size, NULL, err)) {
            if (index) *index = i;
            return KVLM_SAMPLER_BIAS_ID;
        }
        if (index) *index = i;
        if (p->bias[i] != -INFINITY && !in_range(p->bias[i], -100, 100, err)) return KVLM_SAMPLER_BIAS;
    }
    if (index) *index = -1;
    if (!in_range(p->repetition_penalty, 0, 100, err)) return KVLM_SAMPLER_REPETITION_PENALTY;
    if (!in_range(p->typical_p, 0, 1, err)) return KVLM_SAMPLER_TYPICAL_P;
    if (!in_range(p->dry_multiplier, 0, 100, err)) return KVLM_SAMPLER_DRY_MULTIPLIER;
    if (!in_range(p->dry_base, 0, 100, err)) return KVLM_SAMPLER_DRY_BASE;
    if (!in_range(p->dry_allowed_length, 0, 65536, err)) return KVLM_SAMPLER_DRY_ALLOWED_LENGTH;
    if (!in_range(p->dry_penalty_last_n, -1, 1e9, err)) return KVLM_SAMPLER_DRY_PENALTY_LAST_N;
    if (!in_range(p->xtc_probability, 0, 1, err)) return KVLM_SAMPLER_XTC_PROBABILITY;
    if (!in_range(p->xtc_threshold, 0, 1, err)) return KVLM_SAMPLER_XTC_THRESHOLD;
    if (!in_range(p->min_tokens, 0, 1e9, err)) return KVLM_SAMPLER_MIN_TOKENS;
    if (p->n_stages < 0 || p->n_stages > KVLM_MAX_STAGES) {
        util_err_set(err, KVLM_ERANGE, "must name at most %d stages", KVLM_MAX_STAGES);
        return KVLM_SAMPLER_STAGES;
    }
    for (int i = 0; i < p->n_stages; i++)
        if (!kvlm_sampler_stage_name(p->stages[i])) {
            if (index) *index = i;
            util_err_set(err, KVLM_ERANGE, "must be one of penalties, dry, top_k, typ_p, top_p, min_p, xtc, temperature");
            return KVLM_SAMPLER_STAGES;
        }
    if (p->n_stop_ids > 0 && check_token_ids(p->stop_ids, p->n_stop_ids, vocab_size, index, err))
        return KVLM_SAMPLER_STOP_ID;
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

/* ---- creation ---------------------------------------------------------------------- */

static bool rep_on(const kvlm_sampler *s) { return s->p.repetition_penalty > 0 && s->p.repetition_penalty != 1.0f; }
static bool dry_on(const kvlm_sampler *s) {
    return s->p.dry_multiplier > 0 && s->p.dry_base >= 1.0f && s->p.dry_penalty_last_n != 0;
}
static bool typical_on(const kvlm_sampler *s) { return s->p.typical_p > 0 && s->p.typical_p < 1.0f; }
static bool xtc_on(const kvlm_sampler *s) { return s->p.xtc_probability > 0 && s->p.xtc_threshold <= 0.5f; }

/* Tokens whose text contains a breaker string (llama.cpp also matches a
 * breaker spread over several tokens; one within a token is what its defaults
 * need). */
static bool make_breakers(kvlm_sampler *s) {
    static const char *const defaults[] = {"\n", ":", "\"", "*"};
    const char *const *br = s->p.dry_sequence_breakers ? s->p.dry_sequence_breakers : defaults;
    int nb = s->p.dry_sequence_breakers ? s->p.n_dry_sequence_breakers : 4;
    if (!(s->breaker = calloc((size_t)s->vocab, sizeof *s->breaker))) return false;
    if (!s->p.model || nb <= 0) return true;
    for (int t = 0; t < s->vocab && t < kvlm_vocab_size(s->p.model); t++) {
        char text[256];
        int n = kvlm_token_to_text(s->p.model, t, text, sizeof text - 1);
        if (n <= 0) continue;
        text[n < (int)sizeof text - 1 ? n : (int)sizeof text - 1] = 0;
        for (int b = 0; b < nb && !s->breaker[t]; b++) {
            char one[DRY_MAX_BREAKER_LEN + 1];
            if (!br[b] || !*br[b]) continue;
            snprintf(one, sizeof one, "%s", br[b]);
            s->breaker[t] = strstr(text, one) != NULL;
        }
    }
    return true;
}

kvlm_sampler *kvlm_sampler_create(const kvlm_sampler_params *p, int vocab) {
    if (vocab <= 0) return NULL;
    kvlm_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->p = p ? *p : kvlm_sampler_default_params();
    if (s->p.repeat_last_n < 0) s->p.repeat_last_n = 0;
    if (s->p.n_stages < 0 || s->p.n_stages > KVLM_MAX_STAGES) s->p.n_stages = 0;
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
    if (s->p.n_stop_ids > 0 && s->p.stop_ids) {
        if (!(s->stop_ids = malloc((size_t)s->p.n_stop_ids * sizeof *s->stop_ids))) {
            kvlm_sampler_free(s);
            return NULL;
        }
        int k = 0;
        for (int i = 0; i < s->p.n_stop_ids; i++)
            if (s->p.stop_ids[i] >= 0 && s->p.stop_ids[i] < vocab) s->stop_ids[k++] = s->p.stop_ids[i];
        s->p.n_stop_ids = k;
    } else s->p.n_stop_ids = 0;
    s->p.stop_ids = s->stop_ids;
    if (s->p.model && (s->p.ignore_eos || s->p.min_tokens > 0)) {
        if (!(s->eog = calloc((size_t)vocab, sizeof *s->eog))) {
            kvlm_sampler_free(s);
            return NULL;
        }
        for (int t = 0; t < vocab && t < kvlm_vocab_size(s->p.model); t++) s->eog[t] = kvlm_token_is_eog(s->p.model, t);
    }
    if (s->p.grammar) {
        s->gmodel = gm_model(s->p.grammar);
        if (!s->gmodel || kvlm_vocab_size(s->gmodel) != vocab || !(s->gm = gm_new(s->p.grammar)) ||
            !(s->allowed = malloc((size_t)vocab * sizeof *s->allowed))) {
            kvlm_sampler_free(s);
            return NULL;
        }
    }
    s->p.grammar = NULL; /* the matcher holds the reference */
    s->p.dry_sequence_breakers = NULL; /* made into s->breaker below; the caller's may go */
    s->c = malloc((size_t)vocab * sizeof *s->c);
    s->recent = malloc(((size_t)s->p.repeat_last_n + 1) * sizeof(int32_t));
    s->stamp = calloc((size_t)vocab, sizeof *s->stamp);
    bool ok = s->c && s->recent && s->stamp;
    if (s->p.frequency_penalty != 0 || s->p.presence_penalty != 0)
        ok = ok && (s->count = calloc((size_t)vocab, sizeof(int32_t)));
    if (rep_on(s)) ok = ok && (s->seen = calloc((size_t)vocab, 1));
    if (ok && dry_on(s)) {
        s->dry_cap = s->p.dry_penalty_last_n > 0 && s->p.dry_penalty_last_n < DRY_MAX_HISTORY ? s->p.dry_penalty_last_n
                                                                                              : DRY_MAX_HISTORY;
        ok = (s->dry_hist = malloc((size_t)s->dry_cap * sizeof(int32_t))) &&
             (s->dry_win = malloc((size_t)s->dry_cap * sizeof(int32_t))) &&
             (s->dry_z = malloc((size_t)s->dry_cap * sizeof(int32_t))) &&
             (s->dry_max = calloc((size_t)vocab, sizeof(int32_t))) &&
             (s->dry_touched = malloc((size_t)s->dry_cap * sizeof(int32_t))) && make_breakers(s);
    }
    s->chain = s->p.n_stages > 0 || typical_on(s) || xtc_on(s);
    if (ok && s->chain) ok = (s->probs = malloc((size_t)vocab * sizeof *s->probs)) != NULL;
    if (!ok) {
        kvlm_sampler_free(s);
        return NULL;
    }
    return s;
}

void kvlm_sampler_free(kvlm_sampler *s) {
    if (!s) return;
    free(s->c);
    free(s->recent);
    free(s->stamp);
    free(s->count);
    free(s->seen);
    free(s->bias_ids);
    free(s->bias);
    free(s->stop_ids);
    free(s->eog);
    free(s->allowed);
    free(s->dry_hist);
    free(s->dry_win);
    free(s->dry_z);
    free(s->dry_max);
    free(s->dry_touched);
    free(s->breaker);
    free(s->probs);
    gm_free(s->gm);
    free(s);
}

void kvlm_sampler_accept(kvlm_sampler *s, int32_t token) {
    if (s->seen && token >= 0 && token < s->vocab) s->seen[token] = 1;
    if (s->dry_hist) {
        s->dry_hist[s->dry_pos] = token;
        s->dry_pos = (s->dry_pos + 1) % s->dry_cap;
        if (s->n_dry < s->dry_cap) s->n_dry++;
    }
    if (s->p.repeat_last_n == 0) return;
    s->recent[s->recent_pos] = token;
    s->recent_pos = (s->recent_pos + 1) % s->p.repeat_last_n;
    if (s->n_recent < s->p.repeat_last_n) s->n_recent++;
}

bool kvlm_sampler_is_stop(const kvlm_sampler *s, int32_t token) {
    for (int i = 0; i < s->p.n_stop_ids; i++)
        if (s->stop_ids[i] == token) return true;
    return false;
}

static uint64_t next_u64(kvlm_sampler *s) { /* xorshift64* */
    s->rng ^= s->rng >> 12;
    s->rng ^= s->rng << 25;
    s->rng ^= s->rng >> 27;
    return s->rng * 2685821657736338717ull;
}

double sampler_uniform(kvlm_sampler *s) { return (double)(next_u64(s) >> 11) * (1.0 / 9007199254740992.0); }

/* ---- the stages ------------------------------------------------------------------- */

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

/* The repetition penalties over candidates c[0, n): llama.cpp's repeat_penalty
 * (each distinct token of the last repeat_last_n once), vLLM's
 * repetition_penalty (tokens of the prompt and output), then OpenAI's
 * frequency and presence penalties (tokens picked). */
static void st_penalties(kvlm_sampler *s, cand *c, int n) {
    bool repeat = s->p.repeat_penalty != 1.0f && s->p.repeat_penalty > 0 && s->n_recent > 0;
    if (!repeat && !s->seen && !s->count) return;
    if (repeat) {
        if (++s->stamp_now == 0) { /* wrapped: no token may look marked */
            memset(s->stamp, 0, (size_t)s->vocab * sizeof *s->stamp);
            s->stamp_now = 1;
        }
        for (int r = 0; r < s->n_recent; r++) {
            int32_t t = s->recent[r];
            if (t >= 0 && t < s->vocab) s->stamp[t] = s->stamp_now;
        }
    }
    for (int i = 0; i < n; i++) {
        int32_t t = c[i].id;
        float *l = &c[i].logit;
        if (repeat && s->stamp[t] == s->stamp_now) *l = *l > 0 ? *l / s->p.repeat_penalty : *l * s->p.repeat_penalty;
        if (s->seen && s->seen[t])
            *l = *l > 0 ? *l / s->p.repetition_penalty : *l * s->p.repetition_penalty;
        if (s->count && s->count[t]) *l -= s->p.frequency_penalty * (float)s->count[t] + s->p.presence_penalty;
    }
}

/* DRY over candidates c[0, n). The window w is the last tokens given or
 * picked; z[k] is the length of the longest common suffix of w and w[0, W-k)
 * (the Z-function of w reversed), so the token w[W-k] would extend a repeat
 * of min(z[k], limit) tokens, where limit is the distance back to the latest
 * breaker. */
static void st_dry(kvlm_sampler *s, cand *c, int n) {
    int W = s->n_dry, allowed = s->p.dry_allowed_length;
    if (W <= allowed) return;
    int32_t *w = s->dry_win, *z = s->dry_z;
    for (int i = 0; i < W; i++) w[i] = s->dry_hist[(s->dry_pos - W + i + s->dry_cap) % s->dry_cap];
    int limit = W;
    for (int i = 0; i < W; i++) {
        int32_t t = w[W - 1 - i];
        if (t >= 0 && t < s->vocab && s->breaker[t]) { limit = i; break; }
    }
    if (limit < allowed) return;
    /* Z-function of r, r[i] = w[W - 1 - i] */
    z[0] = W;
    for (int i = 1, l = 0, r = 0; i < W; i++) {
        int k = i < r ? (r - i < z[i - l] ? r - i : z[i - l]) : 0;
        while (i + k < W && w[W - 1 - k] == w[W - 1 - i - k]) k++;
        z[i] = k;
        if (i + k > r) { l = i; r = i + k; }
    }
    int n_touched = 0;
    for (int k = 1; k < W; k++) {
        int len = z[k] < limit ? z[k] : limit;
        int32_t next = w[W - k];
        if (len < allowed || next < 0 || next >= s->vocab) continue;
        if (!s->dry_max[next]) s->dry_touched[n_touched++] = next;
        if (len + 1 > s->dry_max[next]) s->dry_max[next] = len + 1; /* stored + 1: 0 means none */
    }
    if (!n_touched) return;
    int max_exp = s->p.dry_base > 1.000001f ? (int)(88.7228391f / logf(s->p.dry_base)) : 0;
    for (int i = 0; i < n; i++) {
        int32_t t = c[i].id;
        if (!s->dry_max[t] || s->breaker[t]) continue;
        int e = s->dry_max[t] - 1 - allowed;
        if (max_exp > 0 && e > max_exp) e = max_exp;
        c[i].logit -= s->p.dry_multiplier * powf(s->p.dry_base, (float)e);
    }
    for (int i = 0; i < n_touched; i++) s->dry_max[s->dry_touched[i]] = 0;
}

/* Sorts c[0, n) by logit, largest first, and puts their softmax in s->probs. */
static void softmax_sorted(kvlm_sampler *s, cand *c, int n) {
    qsort(c, (size_t)n, sizeof *c, by_logit_desc);
    float mx = c[0].logit > -INFINITY ? c[0].logit : 0;
    double sum = 0;
    for (int i = 0; i < n; i++) sum += s->probs[i] = expf(c[i].logit - mx);
    for (int i = 0; i < n; i++) s->probs[i] = sum > 0 ? (float)(s->probs[i] / sum) : 1.0f / (float)n;
}

static int st_top_k(kvlm_sampler *s, cand *c, int n) {
    int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    top_k_sort(c, n, k);
    return k;
}

static int st_top_p(kvlm_sampler *s, cand *c, int n) {
    if (!(s->p.top_p < 1.0f && s->p.top_p > 0)) return n;
    softmax_sorted(s, c, n);
    float cum = 0;
    for (int i = 0; i < n; i++) {
        cum += s->probs[i];
        if (cum >= s->p.top_p) return i + 1;
    }
    return n;
}

static int st_min_p(kvlm_sampler *s, cand *c, int n) {
    if (!(s->p.min_p > 0)) return n;
    softmax_sorted(s, c, n);
    float floor = s->p.min_p * s->probs[0];
    int keep = 1;
    while (keep < n && s->probs[keep] >= floor) keep++;
    return keep;
}

typedef struct { float score; int idx; } scored;
static int by_score(const void *a, const void *b) {
    float x = ((const scored *)a)->score, y = ((const scored *)b)->score;
    if (x != y) return x < y ? -1 : 1;
    return ((const scored *)a)->idx - ((const scored *)b)->idx;
}

/* Locally typical sampling (Meister et al.): by |-log p - H| ascending, until the mass passes typical_p. */
static int st_typical(kvlm_sampler *s, cand *c, int n) {
    if (!typical_on(s) || n < 2) return n;
    softmax_sorted(s, c, n);
    double h = 0;
    for (int i = 0; i < n; i++)
        if (s->probs[i] > 0) h -= s->probs[i] * log(s->probs[i]);
    scored *o = malloc((size_t)n * sizeof *o);
    cand *keep = malloc((size_t)n * sizeof *keep);
    if (!o || !keep) { free(o); free(keep); return n; } /* out of memory: the stage does nothing */
    for (int i = 0; i < n; i++) o[i] = (scored){(float)fabs(-log(s->probs[i]) - h), i};
    qsort(o, (size_t)n, sizeof *o, by_score);
    double cum = 0;
    int m = n;
    for (int i = 0; i < n; i++) {
        cum += s->probs[o[i].idx];
        if (cum > s->p.typical_p) { m = i + 1; break; }
    }
    for (int i = 0; i < m; i++) keep[i] = c[o[i].idx];
    memcpy(c, keep, (size_t)m * sizeof *c);
    free(o);
    free(keep);
    return m;
}

static int st_xtc(kvlm_sampler *s, cand *c, int n) {
    if (!xtc_on(s) || n < 2) return n;
    if (sampler_uniform(s) > s->p.xtc_probability) return n;
    softmax_sorted(s, c, n);
    int last = 0; /* the least likely of those at or above the threshold */
    while (last + 1 < n && s->probs[last + 1] >= s->p.xtc_threshold) last++;
    if (last == 0 || s->probs[0] < s->p.xtc_threshold) return n;
    memmove(c, c + last, (size_t)(n - last) * sizeof *c);
    return n - last;
}

static void st_temperature(kvlm_sampler *s, cand *c, int n) {
    for (int i = 0; i < n; i++) c[i].logit /= s->p.temperature;
}

/* kvlm's order, when params.stages names none */
static const int k_default_stages[] = {KVLM_STAGE_PENALTIES, KVLM_STAGE_DRY, KVLM_STAGE_TOP_K, KVLM_STAGE_TYPICAL_P,
                                       KVLM_STAGE_TEMPERATURE, KVLM_STAGE_TOP_P, KVLM_STAGE_MIN_P, KVLM_STAGE_XTC};

static bool banned(const kvlm_sampler *s, int32_t t) {
    if (s->eog && s->eog[t] && (s->p.ignore_eos || s->n_picked < s->p.min_tokens)) return true;
    return s->n_picked < s->p.min_tokens && kvlm_sampler_is_stop(s, t);
}

/* The distribution the sampler draws from: s->c[0, n) holds the candidates
 * with their probabilities, largest first, after the bans, the penalties,
 * DRY, the grammar and the cutting stages (their sum, *total, is not
 * renormalised after the cuts); greedy: the one pick with probability 1.
 * Returns n. */
static int build_dist(kvlm_sampler *s, const float *logits, float *total) {
    int n = s->vocab;
    bool penalty = s->p.repeat_penalty != 1.0f && s->p.repeat_penalty > 0;
    bool bans = s->eog || (s->p.n_stop_ids && s->n_picked < s->p.min_tokens);
    if (s->p.temperature <= 0 && !penalty && !s->count && !s->seen && !s->dry_hist && !bans && !s->p.n_bias &&
        !s->gm) { /* greedy: the first largest logit */
        s->c[0].id = op_argmax(logits, n);
        s->c[0].logit = *total = 1;
        return 1;
    }
    for (int i = 0; i < n; i++) { s->c[i].logit = logits[i]; s->c[i].id = i; }
    for (int i = 0; i < s->p.n_bias; i++) s->c[s->bias_ids[i]].logit += s->bias[i];
    if (bans)
        for (int i = 0; i < n; i++)
            if (banned(s, i)) s->c[i].logit = -INFINITY;
    const int *stages = s->p.n_stages ? s->p.stages : k_default_stages;
    int n_stages = s->p.n_stages ? s->p.n_stages : (int)(sizeof k_default_stages / sizeof k_default_stages[0]);
    int first_cut = 0; /* the penalties and DRY ahead of any cutting stage run on the whole vocabulary */
    for (; first_cut < n_stages; first_cut++) {
        if (stages[first_cut] == KVLM_STAGE_PENALTIES) st_penalties(s, s->c, n);
        else if (stages[first_cut] == KVLM_STAGE_DRY) { if (s->dry_hist) st_dry(s, s->c, n); }
        else break;
    }
    if (s->gm) { /* only what the grammar allows (nothing: the end tokens, whatever the state) */
        bool any = gm_allowed(s->gm, s->allowed) > 0;
        int k = 0;
        for (int i = 0; i < n; i++)
            if (any ? s->allowed[i] : kvlm_token_is_eog(s->gmodel, i)) s->c[k++] = s->c[i];
        if (k) n = k; /* no end token either: left free */
    }
    if (s->p.temperature <= 0) {
        for (int i = first_cut; i < n_stages; i++) /* greedy: the penalties wherever they are, no cuts */
            if (stages[i] == KVLM_STAGE_PENALTIES) st_penalties(s, s->c, n);
            else if (stages[i] == KVLM_STAGE_DRY && s->dry_hist) st_dry(s, s->c, n);
        int best = 0;
        for (int i = 1; i < n; i++)
            if (s->c[i].logit > s->c[best].logit) best = i;
        s->c[0].id = s->c[best].id;
        s->c[0].logit = *total = 1;
        return 1;
    }
    if (!s->chain) { /* kvlm's order without typical_p or XTC: top-k, then the tempered softmax, top-p, min-p */
        int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
        top_k_sort(s->c, n, k);
        n = k;
        float maxl = s->c[0].logit, sum = 0;
        if (!(maxl > -INFINITY)) { *total = s->c[0].logit = 1; return 1; } /* everything banned: the first */
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
    for (int i = first_cut; i < n_stages && n > 0; i++) {
        switch (stages[i]) {
        case KVLM_STAGE_PENALTIES: st_penalties(s, s->c, n); break;
        case KVLM_STAGE_DRY: if (s->dry_hist) st_dry(s, s->c, n); break;
        case KVLM_STAGE_TOP_K: n = st_top_k(s, s->c, n); break;
        case KVLM_STAGE_TYPICAL_P: n = st_typical(s, s->c, n); break;
        case KVLM_STAGE_TOP_P: n = st_top_p(s, s->c, n); break;
        case KVLM_STAGE_MIN_P: n = st_min_p(s, s->c, n); break;
        case KVLM_STAGE_XTC: n = st_xtc(s, s->c, n); break;
        case KVLM_STAGE_TEMPERATURE: st_temperature(s, s->c, n); break;
        default: break;
        }
    }
    qsort(s->c, (size_t)n, sizeof *s->c, by_logit_desc);
    float maxl = s->c[0].logit, t = 0;
    if (!(maxl > -INFINITY)) { *total = s->c[0].logit = 1; return 1; } /* everything banned: the first */
    for (int i = 0; i < n; i++) {
        s->c[i].logit = expf(s->c[i].logit - maxl);
        t += s->c[i].logit;
    }
    *total = t;
    return n;
}

void sampler_picked(kvlm_sampler *s, int32_t token) {
    kvlm_sampler_accept(s, token);
    if (s->gm) gm_feed_token(s->gm, token); /* refused only when nothing was allowed: the text stays where it was */
    if (s->count && token >= 0 && token < s->vocab && s->count[token] < INT32_MAX) s->count[token]++;
    if (s->n_picked < INT32_MAX) s->n_picked++;
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
