/* server/answers: the token ids of the chat answers this server generated
 * (an LRU bounded in bytes, one lock: the engine thread records, the HTTP
 * thread looks up), and the tokenization of a chat prompt that takes them
 * where an earlier answer comes back at its place (the rule: answers.h and
 * docs/serving.md). */
#include "server/answers.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* XXH3_state_t on the stack: its layout is that of the installed libxxhash */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

typedef XXH128_hash_t h128;

/* ---- the map ---------------------------------------------------------------------- */

typedef struct entry {
    struct entry *hnext;       /* its bucket's chain (by text hash) */
    struct entry *prev, *next; /* the LRU list, most recent first */
    srv_prompt_key prompt;
    h128 text;
    size_t text_len;
    uint64_t stamp;            /* when last recorded or used */
    int n;
    int32_t ids[];
} entry;

struct srv_answers {
    pthread_mutex_t mu;
    const kvlm_model *model;
    char seed[300];            /* the model's id and vocabulary size, hashed first: keys of another model differ */
    size_t seed_len;
    entry **buckets;
    size_t n_buckets;          /* a power of two */
    entry *head, *tail;
    uint64_t clock;
    srv_answers_stats st;
};

static size_t entry_bytes(int n) { return sizeof(entry) + (size_t)n * sizeof(int32_t); }

srv_answers *srv_answers_create(size_t cap, const kvlm_model *m, const char *model_id) {
    srv_answers *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->n_buckets = 256;
    if (!(a->buckets = calloc(a->n_buckets, sizeof *a->buckets))) {
        free(a);
        return NULL;
    }
    pthread_mutex_init(&a->mu, NULL);
    a->model = m;
    a->st.cap = cap;
    /* the id, its NUL, the vocabulary size (an id is at most 255 bytes: kvlm_server's) */
    int k = snprintf(a->seed, sizeof a->seed - sizeof(int32_t), "kvlm-answers-v1 %s", model_id);
    a->seed_len = k < 0 ? 1 : strlen(a->seed) + 1;
    int32_t vocab = kvlm_vocab_size(m);
    memcpy(a->seed + a->seed_len, &vocab, sizeof vocab);
    a->seed_len += sizeof vocab;
    return a;
}

void srv_answers_free(srv_answers *a) {
    if (!a) return;
    for (entry *e = a->head, *next; e; e = next) {
        next = e->next;
        free(e);
    }
    free(a->buckets);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

/* Keys: XXH3-128, of the text's bytes; of the model's seed then the prompt's
 * ids (in this process's byte order: keys never leave it). */
static h128 text_hash(const char *s, size_t n) { return XXH3_128bits(s, n); }

static void prompt_begin(const srv_answers *a, XXH3_state_t *st) {
    XXH3_128bits_reset(st);
    XXH3_128bits_update(st, a->seed, a->seed_len);
}

static srv_prompt_key prompt_digest(const XXH3_state_t *st) {
    h128 h = XXH3_128bits_digest(st);
    return (srv_prompt_key){h.low64, h.high64};
}

srv_prompt_key srv_answers_prompt_key(const srv_answers *a, const int32_t *ids, int n) {
    XXH3_state_t st;
    prompt_begin(a, &st);
    XXH3_128bits_update(&st, ids, (size_t)n * sizeof *ids);
    return prompt_digest(&st);
}

static entry **bucket(srv_answers *a, h128 text) { return &a->buckets[text.low64 & (a->n_buckets - 1)]; }

static void lru_unlink(srv_answers *a, entry *e) {
    if (e->prev) e->prev->next = e->next;
    else a->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else a->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_front(srv_answers *a, entry *e) {
    e->prev = NULL;
    e->next = a->head;
    if (a->head) a->head->prev = e;
    a->head = e;
    if (!a->tail) a->tail = e;
    e->stamp = ++a->clock;
}

static void remove_entry(srv_answers *a, entry *e) {
    for (entry **p = bucket(a, e->text); *p; p = &(*p)->hnext)
        if (*p == e) {
            *p = e->hnext;
            break;
        }
    lru_unlink(a, e);
    a->st.entries--;
    a->st.bytes -= entry_bytes(e->n);
    free(e);
}

/* More buckets as the entries grow past them (never fewer): chains stay short. */
static void maybe_grow(srv_answers *a) {
    if (a->st.entries <= a->n_buckets || a->n_buckets > ((size_t)1 << 24)) return;
    size_t nb = a->n_buckets * 2;
    entry **b = calloc(nb, sizeof *b);
    if (!b) return;
    for (size_t i = 0; i < a->n_buckets; i++)
        for (entry *e = a->buckets[i], *next; e; e = next) {
            next = e->hnext;
            e->hnext = b[e->text.low64 & (nb - 1)];
            b[e->text.low64 & (nb - 1)] = e;
        }
    free(a->buckets);
    a->buckets = b;
    a->n_buckets = nb;
}

static bool same_text(const entry *e, h128 text, size_t len) {
    return XXH128_isEqual(e->text, text) && e->text_len == len;
}

/* The answer to that prompt with that text (under a->mu). */
static entry *find(srv_answers *a, srv_prompt_key prompt, h128 text, size_t len) {
    for (entry *e = *bucket(a, text); e; e = e->hnext)
        if (same_text(e, text, len) && e->prompt.a == prompt.a && e->prompt.b == prompt.b) return e;
    return NULL;
}

/* The most recent answer with that text, to whatever prompt (under a->mu). */
static entry *find_text(srv_answers *a, h128 text, size_t len) {
    entry *best = NULL;
    for (entry *e = *bucket(a, text); e; e = e->hnext)
        if (same_text(e, text, len) && (!best || e->stamp > best->stamp)) best = e;
    return best;
}

static void put(srv_answers *a, srv_prompt_key prompt, h128 text, size_t len, const int32_t *ids, int n) {
    size_t bytes = entry_bytes(n);
    pthread_mutex_lock(&a->mu);
    entry *old = find(a, prompt, text, len);
    if (old && old->n == n && !memcmp(old->ids, ids, (size_t)n * sizeof *ids)) { /* the same again */
        lru_unlink(a, old);
        lru_front(a, old);
        pthread_mutex_unlock(&a->mu);
        return;
    }
    if (old) remove_entry(a, old); /* other ids for the same text after the same prompt: the newest */
    entry *e = bytes <= a->st.cap ? malloc(bytes) : NULL;
    if (e) {
        e->prompt = prompt;
        e->text = text;
        e->text_len = len;
        e->n = n;
        memcpy(e->ids, ids, (size_t)n * sizeof *ids);
        entry **b = bucket(a, text);
        e->hnext = *b;
        *b = e;
        lru_front(a, e);
        a->st.entries++;
        a->st.bytes += bytes;
        a->st.recorded++;
        while (a->st.bytes > a->st.cap && a->tail != e) {
            remove_entry(a, a->tail);
            a->st.evicted++;
        }
        maybe_grow(a);
    }
    pthread_mutex_unlock(&a->mu);
}

/* ---- recording ------------------------------------------------------------------- */

/* The answer's bytes as its ids give them, checked against the text: those
 * before off are not kept by a stream (they were made by the same
 * detokenizer from the same ids); the rest must be equal. */
typedef struct {
    const char *text;
    size_t len, off, at;
    XXH3_state_t h;
} walk;

static bool walk_bytes(walk *w, const char *s, size_t n) {
    size_t total = w->off + w->len;
    if (n > total - w->at) return false;
    for (size_t i = 0; i < n; i++)
        if (w->at + i >= w->off && s[i] != w->text[w->at + i - w->off]) return false;
    XXH3_128bits_update(&w->h, s, n);
    w->at += n;
    return true;
}

void srv_answers_record(srv_answers *a, srv_prompt_key prompt, int32_t prev, bool special, const int32_t *ids, int n,
                        const char *text, size_t len, size_t text_off) {
    if (!a || n <= 0 || n > SRV_ANSWER_MAX_IDS || !len) return; /* an empty answer leaves nothing to take */
    kvlm_detok d;
    kvlm_detok_init(&d, a->model);
    d.prev = prev;
    d.special = special;
    walk *w = malloc(sizeof *w); /* the hash state is large */
    if (!w) return;
    *w = (walk){.text = text, .len = len, .off = text_off};
    XXH3_128bits_reset(&w->h);
    char piece[sizeof d.pending + 256 * 3 + 1];
    int k = -1;
    h128 hk = {0, 0};
    for (int i = 0; i < n; i++) {
        int m = kvlm_detok_push(&d, ids[i], piece, sizeof piece);
        if (m < 0 || !walk_bytes(w, piece, (size_t)m)) break;
        /* ids[0, i] spell the text when it is all out, with what a flush adds */
        size_t flush = d.n_pending ? 3 : 0; /* U+FFFD */
        if (w->at + flush != text_off + len) continue;
        kvlm_detok df = d;
        int f = kvlm_detok_flush(&df, piece, sizeof piece);
        XXH3_state_t hf;
        XXH3_copyState(&hf, &w->h);
        bool ok = true;
        for (int q = 0; q < f; q++)
            if (w->at + (size_t)q >= text_off) ok &= piece[q] == text[w->at + (size_t)q - text_off];
        if (ok && (size_t)f == flush) {
            XXH3_128bits_update(&hf, piece, (size_t)f);
            k = i + 1;
            hk = XXH3_128bits_digest(&hf);
        }
    }
    free(w);
    if (k < 0) {
        pthread_mutex_lock(&a->mu);
        a->st.unmatched++;
        pthread_mutex_unlock(&a->mu);
        return;
    }
    put(a, prompt, hk, text_off + len, ids, k);
}

/* ---- a prompt's tokens ------------------------------------------------------------ */

typedef struct {
    size_t off, len;
    h128 text;
    int32_t *ids;              /* a copy of the entry's */
    int n;
    bool on;                   /* still offered to the tokenizer */
} cand;

/* The ids of the newest answer with that text (malloc'd), or NULL. */
static int32_t *ids_for_text(srv_answers *a, h128 text, size_t len, int *n) {
    pthread_mutex_lock(&a->mu);
    entry *e = find_text(a, text, len);
    int32_t *ids = e ? malloc((size_t)e->n * sizeof *ids) : NULL;
    if (ids) {
        memcpy(ids, e->ids, (size_t)e->n * sizeof *ids);
        *n = e->n;
    }
    pthread_mutex_unlock(&a->mu);
    return ids;
}

/* Whether c (taken after the tokens keyed prompt) is the answer generated
 * after that prompt: 1 yes; 0 no (dropped); -1 another answer with its text
 * followed that prompt (c now holds its ids, to be tried again). */
static int confirm(srv_answers *a, srv_prompt_key prompt, cand *c) {
    pthread_mutex_lock(&a->mu);
    entry *e = find(a, prompt, c->text, c->len);
    int r = 0;
    if (e && e->n == c->n && !memcmp(e->ids, c->ids, (size_t)c->n * sizeof *c->ids)) {
        lru_unlink(a, e);
        lru_front(a, e);
        r = 1;
    } else if (e) {
        int32_t *ids = malloc((size_t)e->n * sizeof *ids);
        if (ids) {
            memcpy(ids, e->ids, (size_t)e->n * sizeof *ids);
            free(c->ids);
            c->ids = ids;
            c->n = e->n;
            r = -1;
        }
    }
    pthread_mutex_unlock(&a->mu);
    if (!r) c->on = false;
    return r;
}

/* Tokenizes text with the candidates still on; *n_out tokens (malloc'd). */
static int32_t *tokenize(const kvlm_model *m, const char *text, size_t len, bool bos, cand *c, int nc,
                         kvlm_token_span *sp, int *n_sp, int *n_out, kvlm_error *err) {
    int k = 0;
    size_t guess = len + 2;
    for (int i = 0; i < nc; i++)
        if (c[i].on) {
            sp[k++] = (kvlm_token_span){.offset = c[i].off, .len = c[i].len, .ids = c[i].ids, .n_ids = c[i].n};
            guess += (size_t)c[i].n;
        }
    *n_sp = k;
    for (;;) { /* most texts take fewer tokens than bytes: one pass, rarely two */
        if (guess > INT32_MAX) guess = INT32_MAX;
        int32_t *t = malloc(guess * sizeof *t);
        if (!t) {
            err->code = KVLM_ENOMEM;
            snprintf(err->msg, sizeof err->msg, "out of memory");
            return NULL;
        }
        int n = kvlm_tokenize_spans(m, text, len, bos, true, sp, k, t, (int)guess, err);
        if (n >= 0 && (size_t)n <= guess) {
            *n_out = n;
            return t;
        }
        free(t);
        if (n < 0 || guess == INT32_MAX) return NULL;
        guess = (size_t)n;
    }
}

/* Rounds of tokenization before the candidates not yet confirmed are given up. */
enum { MAX_ROUNDS = 8 };

int32_t *srv_answers_tokenize(srv_answers *a, const kvlm_model *m, const char *text, size_t len, bool add_bos,
                              const char *const *roles, const char *const *contents, int n_msgs, int *n_out,
                              int *reused, int *reused_tokens, kvlm_error *err) {
    *reused = *reused_tokens = 0;
    cand *c = a && n_msgs > 0 ? calloc((size_t)n_msgs, sizeof *c) : NULL;
    kvlm_token_span *sp = c ? calloc((size_t)n_msgs, sizeof *sp) : NULL;
    XXH3_state_t *st = sp ? malloc(sizeof *st) : NULL; /* the hash state is large */
    if (!st) { /* none kept, or no memory for the lookups: tokenized as text */
        free(c);
        free(sp);
        c = NULL;
        sp = NULL;
    }
    int nc = 0;
    /* Each message's text at its place: the first time it appears after the
     * previous message's. A message the template changed is not found (and
     * the one after it is looked for from the same place); the assistant
     * messages found are candidates if this server generated such a text. */
    size_t cur = 0;
    for (int i = 0; sp && i < n_msgs; i++) {
        size_t cl = strlen(contents[i]);
        const char *f = cl ? memmem(text + cur, len - cur, contents[i], cl) : NULL;
        if (!f) continue;
        size_t off = (size_t)(f - text);
        cur = off + cl;
        if (strcmp(roles[i], "assistant")) continue;
        cand *x = &c[nc];
        x->off = off;
        x->len = cl;
        x->text = text_hash(contents[i], cl);
        if ((x->ids = ids_for_text(a, x->text, cl, &x->n))) {
            x->on = true;
            nc++;
        }
    }
    int32_t *t = NULL;
    int n = 0, n_sp = 0;
    for (int round = 0;; round++) {
        free(t);
        if (!(t = tokenize(m, text, len, add_bos, c, nc, sp, &n_sp, &n, err))) break;
        /* each span taken must follow exactly the prompt its ids were
         * generated after: walked in order, up to the first that does not */
        int pos = 0, k = 0, failed = -1, taken = 0, taken_ids = 0;
        if (a) prompt_begin(a, st);
        for (int i = 0; i < nc && failed < 0; i++) {
            if (!c[i].on) continue;
            kvlm_token_span *s = &sp[k++];
            if (s->at < 0) { /* its ids do not spell it (and it changed nothing) */
                c[i].on = false;
                continue;
            }
            XXH3_128bits_update(st, t + pos, (size_t)(s->at - pos) * sizeof *t);
            pos = s->at;
            if (confirm(a, prompt_digest(st), &c[i]) != 1) failed = i;
            else taken++, taken_ids += s->n_ids;
        }
        if (failed < 0) {
            *reused = taken;
            *reused_tokens = taken_ids;
            *n_out = n;
            break;
        }
        if (round + 1 >= MAX_ROUNDS) /* the ones before the failure stand; the rest go */
            for (int i = failed; i < nc; i++) c[i].on = false;
    }
    for (int i = 0; i < nc; i++) free(c[i].ids);
    free(c);
    free(sp);
    free(st);
    return t;
}

int32_t *srv_answers_tokenize_json(srv_answers *a, const kvlm_model *m, const char *text, size_t len, bool add_bos,
                                   json_t *messages, int *n_out, int *reused, int *reused_tokens, kvlm_error *err) {
    size_t n = a && json_is_array(messages) ? json_array_size(messages) : 0;
    const char **roles = n ? calloc(n, sizeof *roles) : NULL;
    char **contents = n ? calloc(n, sizeof *contents) : NULL;
    if (!roles || !contents) n = 0; /* none kept, or no memory: tokenized as text */
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(messages, i), *role = json_object_get(msg, "role"), *ct = json_object_get(msg, "content");
        roles[i] = json_is_string(role) ? json_string_value(role) : "";
        if (json_is_string(ct)) contents[i] = strdup(json_string_value(ct));
        else if (json_is_array(ct)) { /* text parts, joined with newlines */
            size_t total = 1;
            bool text_only = true;
            for (size_t k = 0; k < json_array_size(ct); k++) {
                json_t *t = json_object_get(json_array_get(ct, k), "text");
                text_only &= json_is_string(t);
                total += json_is_string(t) ? json_string_length(t) + 1 : 0;
            }
            if (text_only && (contents[i] = malloc(total))) {
                size_t at = 0;
                for (size_t k = 0; k < json_array_size(ct); k++) {
                    json_t *t = json_object_get(json_array_get(ct, k), "text");
                    if (k) contents[i][at++] = '\n';
                    memcpy(contents[i] + at, json_string_value(t), json_string_length(t));
                    at += json_string_length(t);
                }
                contents[i][at] = 0;
            }
        }
        if (!contents[i] && !json_is_string(ct)) { /* another shape: never a candidate */
            contents[i] = strdup("");
            roles[i] = "";
        }
        if (!contents[i]) { /* no memory: the messages before it only */
            n = i;
            break;
        }
    }
    int32_t *t = srv_answers_tokenize(n ? a : NULL, m, text, len, add_bos, roles, (const char *const *)contents, (int)n,
                                      n_out, reused, reused_tokens, err);
    for (size_t i = 0; contents && i < n; i++) free(contents[i]);
    free(roles);
    free(contents);
    return t;
}

void srv_answers_count(srv_answers *a, int reused, int reused_tokens) {
    if (!a || !reused) return;
    pthread_mutex_lock(&a->mu);
    a->st.reused += (uint64_t)reused;
    a->st.reused_tokens += (uint64_t)reused_tokens;
    pthread_mutex_unlock(&a->mu);
}

void srv_answers_stats_get(srv_answers *a, srv_answers_stats *st) {
    memset(st, 0, sizeof *st);
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    *st = a->st;
    pthread_mutex_unlock(&a->mu);
}
