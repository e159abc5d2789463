/* kv/prefix: the prefix index (buckets on a key's first 8 bytes, chained
 * through the blocks, full key, parent key and tokens compared) and the LRU
 * list of cached blocks, both over block numbers. */
#include "kv/prefix.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    bool indexed, on_lru;
    kv_key key, parent;         /* chained key of this block and of its parent */
    int32_t lru_prev, lru_next; /* LRU links while cached */
    int32_t hnext;              /* next block in the same bucket */
} entry;

struct kv_prefix {
    int n_blocks, block_size;
    entry *e;
    int32_t *tokens;            /* block_size tokens per indexed block */
    int32_t *buckets;
    uint32_t n_buckets;         /* a power of two, at least twice the blocks */
    int32_t lru_head, lru_tail;
    int n_cached;
};

static uint32_t bucket_of(const kv_prefix *x, const kv_key *k) {
    uint64_t h;
    memcpy(&h, k->b, 8);
    return (uint32_t)(h & (x->n_buckets - 1));
}

static bool key_eq(const kv_key *a, const kv_key *b) { return !memcmp(a->b, b->b, 16); }

kv_prefix *kv_prefix_create(int n_blocks, int block_size) {
    kv_prefix *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->n_blocks = n_blocks;
    x->block_size = block_size;
    x->n_buckets = 1;
    while (x->n_buckets < 2u * (uint32_t)n_blocks) x->n_buckets <<= 1;
    x->e = calloc((size_t)n_blocks, sizeof *x->e);
    x->tokens = malloc((size_t)n_blocks * (size_t)block_size * sizeof(int32_t));
    x->buckets = malloc(x->n_buckets * sizeof(int32_t));
    if (!x->e || !x->tokens || !x->buckets) {
        kv_prefix_free(x);
        return NULL;
    }
    for (uint32_t i = 0; i < x->n_buckets; i++) x->buckets[i] = -1;
    for (int b = 0; b < n_blocks; b++) x->e[b].lru_prev = x->e[b].lru_next = x->e[b].hnext = -1;
    x->lru_head = x->lru_tail = -1;
    return x;
}

void kv_prefix_free(kv_prefix *x) {
    if (!x) return;
    free(x->e);
    free(x->tokens);
    free(x->buckets);
    free(x);
}

int32_t kv_prefix_find(const kv_prefix *x, const kv_key *key, const kv_key *parent, const int32_t *tokens) {
    for (int32_t b = x->buckets[bucket_of(x, key)]; b >= 0; b = x->e[b].hnext)
        if (key_eq(&x->e[b].key, key) && key_eq(&x->e[b].parent, parent) &&
            !memcmp(x->tokens + (size_t)b * x->block_size, tokens, (size_t)x->block_size * sizeof(int32_t)))
            return b;
    return -1;
}

void kv_prefix_insert(kv_prefix *x, int32_t b, const kv_key *key, const kv_key *parent, const int32_t *tokens) {
    entry *m = &x->e[b];
    m->key = *key;
    m->parent = *parent;
    m->indexed = true;
    memcpy(x->tokens + (size_t)b * x->block_size, tokens, (size_t)x->block_size * sizeof(int32_t));
    uint32_t slot = bucket_of(x, key);
    m->hnext = x->buckets[slot];
    x->buckets[slot] = b;
}

void kv_prefix_remove(kv_prefix *x, int32_t b) {
    if (x->e[b].on_lru) kv_prefix_lru_remove(x, b);
    if (!x->e[b].indexed) return;
    int32_t *pp = &x->buckets[bucket_of(x, &x->e[b].key)];
    while (*pp >= 0 && *pp != b) pp = &x->e[*pp].hnext;
    if (*pp == b) *pp = x->e[b].hnext;
    x->e[b].indexed = false;
    x->e[b].hnext = -1;
}

bool kv_prefix_indexed(const kv_prefix *x, int32_t b) { return x->e[b].indexed; }
const kv_key *kv_prefix_key(const kv_prefix *x, int32_t b) { return &x->e[b].key; }
const kv_key *kv_prefix_parent(const kv_prefix *x, int32_t b) { return &x->e[b].parent; }
const int32_t *kv_prefix_tokens(const kv_prefix *x, int32_t b) { return x->tokens + (size_t)b * x->block_size; }

void kv_prefix_lru_push(kv_prefix *x, int32_t b) {
    entry *m = &x->e[b];
    m->lru_prev = x->lru_tail;
    m->lru_next = -1;
    if (x->lru_tail >= 0) x->e[x->lru_tail].lru_next = b; else x->lru_head = b;
    x->lru_tail = b;
    m->on_lru = true;
    x->n_cached++;
}

void kv_prefix_lru_remove(kv_prefix *x, int32_t b) {
    entry *m = &x->e[b];
    if (!m->on_lru) return;
    if (m->lru_prev >= 0) x->e[m->lru_prev].lru_next = m->lru_next; else x->lru_head = m->lru_next;
    if (m->lru_next >= 0) x->e[m->lru_next].lru_prev = m->lru_prev; else x->lru_tail = m->lru_prev;
    m->lru_prev = m->lru_next = -1;
    m->on_lru = false;
    x->n_cached--;
}

int32_t kv_prefix_lru_head(const kv_prefix *x) { return x->lru_head; }
int32_t kv_prefix_lru_next(const kv_prefix *x, int32_t b) { return x->e[b].lru_next; }
int kv_prefix_cached(const kv_prefix *x) { return x->n_cached; }

const char *kv_prefix_check(const kv_prefix *x, char *msg, size_t cap) {
    int n_lru = 0, n_indexed = 0, n_in_buckets = 0;
    for (int32_t b = x->lru_head; b >= 0; b = x->e[b].lru_next)
        if (++n_lru > x->n_blocks || !x->e[b].indexed || !x->e[b].on_lru) {
            snprintf(msg, cap, "LRU block %d is unindexed, unmarked or listed twice", b);
            return msg;
        }
    if (n_lru != x->n_cached) { snprintf(msg, cap, "LRU holds %d blocks, counted %d", n_lru, x->n_cached); return msg; }
    for (int b = 0; b < x->n_blocks; b++) n_indexed += x->e[b].indexed;
    for (uint32_t i = 0; i < x->n_buckets; i++)
        for (int32_t b = x->buckets[i]; b >= 0; b = x->e[b].hnext)
            if (!x->e[b].indexed || bucket_of(x, &x->e[b].key) != i || ++n_in_buckets > x->n_blocks) {
                snprintf(msg, cap, "index bucket %u holds block %d wrongly", i, b);
                return msg;
            }
    if (n_in_buckets != n_indexed) {
        snprintf(msg, cap, "index holds %d blocks, %d are marked indexed", n_in_buckets, n_indexed);
        return msg;
    }
    return NULL;
}
