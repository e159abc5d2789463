/* tok/tables: the tokenizers' shared machinery: token-text and merge-pair
 * hash tables (built once at tok_create), the pair priority queue and the
 * per-call scratch buffers. */
#include <stdlib.h>
#include <string.h>
#include "tok/tok_internal.h"

static uint32_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    return (uint32_t)(h ^ (h >> 32));
}

int tok_strmap_init(tok_strmap *m, const model_vocab *v) {
    uint32_t cap = 16;
    while (cap < (uint32_t)v->n_tokens * 2u) cap <<= 1; /* load <= 1/2 keeps probes short */
    m->slots = malloc((size_t)cap * sizeof *m->slots);
    if (!m->slots) return -1;
    for (uint32_t i = 0; i < cap; i++) m->slots[i].id = -1;
    m->mask = cap - 1;
    m->v = v;
    for (int32_t id = 0; id < v->n_tokens; id++) {
        const char *s = v->tokens[id];
        size_t n = v->lens[id];
        uint32_t h = hash_bytes(s, n);
        for (uint32_t i = h & m->mask;; i = (i + 1) & m->mask) {
            tok_strslot *sl = &m->slots[i];
            if (sl->id < 0) { sl->hash = h; sl->id = id; break; }
            /* A duplicate string maps to its last id, as llama.cpp's map does. */
            if (sl->hash == h && v->lens[sl->id] == n && memcmp(v->tokens[sl->id], s, n) == 0) {
                sl->id = id;
                break;
            }
        }
    }
    return 0;
}

void tok_strmap_free(tok_strmap *m) {
    free(m->slots);
    m->slots = NULL;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *s, size_t n) {
    uint32_t h = hash_bytes(s, n);
    for (uint32_t i = h & m->mask;; i = (i + 1) & m->mask) {
        const tok_strslot *sl = &m->slots[i];
        if (sl->id < 0) return -1;
        if (sl->hash == h && m->v->lens[sl->id] == n && memcmp(m->v->tokens[sl->id], s, n) == 0) return sl->id;
    }
}

static uint32_t hash_pair(uint64_t key) {
    key *= 0x9E3779B97F4A7C15ull;
    return (uint32_t)(key >> 32);
}

bool tok_pairmap_get(const tok_pairmap *m, int32_t a, int32_t b, int32_t *rank, int32_t *merged) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint32_t i = hash_pair(key) & m->mask;; i = (i + 1) & m->mask) {
        const tok_pairslot *sl = &m->slots[i];
        if (sl->key == UINT64_MAX) return false;
        if (sl->key == key) {
            *rank = sl->rank;
            *merged = sl->merged;
            return true;
        }
    }
}

/* Inserts unless present (the first, lowest rank wins). Capacity is sized by
 * the caller so the table never fills. */
void tok_pairmap_put(tok_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    for (uint32_t i = hash_pair(key) & m->mask;; i = (i + 1) & m->mask) {
        tok_pairslot *sl = &m->slots[i];
        if (sl->key == key) return;
        if (sl->key == UINT64_MAX) {
            sl->key = key;
            sl->rank = rank;
            sl->merged = merged;
            return;
        }
    }
}

void tok_scratch_free(tok_scratch *s) {
    free(s->sym);
    free(s->heap);
    free(s->buf);
    memset(s, 0, sizeof *s);
}

static bool grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return false;
    *p = q;
    *cap = n;
    return true;
}

bool tok_scratch_syms(tok_scratch *s, size_t n) { return grow((void **)&s->sym, &s->sym_cap, n, sizeof *s->sym); }
bool tok_scratch_buf(tok_scratch *s, size_t n) { return grow((void **)&s->buf, &s->buf_cap, n, 1); }

/* a before b: smaller prio, then the leftmost pair. */
static inline bool pair_before(const tok_pair *a, const tok_pair *b) {
    return a->prio < b->prio || (a->prio == b->prio && a->left < b->left);
}

bool tok_heap_push(tok_scratch *s, tok_pair p) {
    if (!grow((void **)&s->heap, &s->heap_cap, s->heap_n + 1, sizeof *s->heap)) return false;
    size_t i = s->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pair_before(&p, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = p;
    return true;
}

tok_pair tok_heap_pop(tok_scratch *s) {
    tok_pair top = s->heap[0];
    tok_pair last = s->heap[--s->heap_n];
    size_t n = s->heap_n, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!pair_before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n > 0) s->heap[i] = last;
    return top;
}
