/* tok/bpe: byte-level BPE ("gpt2" vocabularies): each pre-tokenizer chunk's
 * bytes become GPT-2's printable characters, then the adjacent pair with the
 * lowest merge rank (tokenizer.ggml.merges order) merges first, leftmost on
 * ties, until no listed merge applies. */
#include <stdlib.h>
#include <string.h>
#include "tok/tok_internal.h"
#include "util/utf8.h"
#include "util/error.h"
#include "util/log.h"

/* GPT-2 shows the printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) as
 * themselves and the other 68 as U+0100 onwards, in byte order. */
static bool byte_printable(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

uint32_t tok_bpe_byte_cp(uint8_t b) {
    if (byte_printable(b)) return b;
    uint32_t k = 0;
    for (unsigned i = 0; i < b; i++) k += !byte_printable(i);
    return 0x100 + k;
}

int tok_bpe_cp_byte(uint32_t cp) {
    if (cp < 0x100) return byte_printable(cp) ? (int)cp : -1;
    if (cp >= 0x100 + 68) return -1;
    uint32_t k = cp - 0x100;
    for (unsigned i = 0; i < 256; i++)
        if (!byte_printable(i) && k-- == 0) return (int)i;
    return -1;
}

int tok_bpe_init(struct tok_tokenizer *t, kvlm_error *err) {
    const model_vocab *v = t->v;
    for (unsigned b = 0; b < 256; b++) {
        char u[4];
        int n = util_utf8_encode(tok_bpe_byte_cp((uint8_t)b), u);
        memcpy(t->byte_utf8[b], u, 2); /* every such code point is < U+0800 */
        t->byte_utf8_len[b] = (uint8_t)n;
        t->byte_sym[b] = tok_strmap_get(&t->map, u, (size_t)n);
    }
    int n_merges = v->merges && v->n_merges > 0 ? v->n_merges : 0;
    uint32_t cap = 16;
    while (cap < (uint32_t)n_merges * 2u) cap <<= 1;
    t->merges.slots = malloc((size_t)cap * sizeof *t->merges.slots);
    if (!t->merges.slots) return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1;
    for (uint32_t i = 0; i < cap; i++) t->merges.slots[i].key = UINT64_MAX;
    t->merges.mask = cap - 1;
    char *tmp = NULL;
    size_t tmp_cap = 0;
    int skipped = 0;
    for (int r = 0; r < n_merges; r++) {
        const char *m = v->merges[r];
        if (!m || !m[0]) { skipped++; continue; }
        /* "a b": the separator is the first space after the first byte. */
        const char *sp = strchr(m + 1, ' ');
        if (!sp) { skipped++; continue; }
        size_t la = (size_t)(sp - m), lb = strlen(sp + 1);
        if (la + lb > tmp_cap) {
            char *q = realloc(tmp, la + lb);
            if (!q) { free(tmp); return util_err_set(err, KVLM_ENOMEM, "out of memory"), -1; }
            tmp = q;
            tmp_cap = la + lb;
        }
        memcpy(tmp, m, la);
        memcpy(tmp + la, sp + 1, lb);
        int32_t a = tok_strmap_get(&t->map, m, la), b = tok_strmap_get(&t->map, sp + 1, lb);
        int32_t ab = tok_strmap_get(&t->map, tmp, la + lb);
        /* A merge whose parts or result are not tokens can never apply to
         * symbols that are tokens: leave it out. */
        if (a < 0 || b < 0 || ab < 0) { skipped++; continue; }
        tok_pairmap_put(&t->merges, a, b, r, ab);
    }
    free(tmp);
    if (skipped) LOG_DEBUG("tokenizer: %d of %d merges name non-tokens, ignored", skipped, n_merges);
    return 0;
}

void tok_bpe_free(struct tok_tokenizer *t) {
    free(t->merges.slots);
    t->merges.slots = NULL;
}

static bool try_pair(const struct tok_tokenizer *t, tok_scratch *s, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return true;
    const tok_sym *a = &s->sym[l], *b = &s->sym[r];
    int32_t rank, merged;
    if (a->id < 0 || b->id < 0 || !tok_pairmap_get(&t->merges, a->id, b->id, &rank, &merged)) return true;
    tok_pair p = {.prio = (float)rank, .left = l, .right = r, .size = a->n + b->n, .id = merged};
    return tok_heap_push(s, p);
}

/* Merges the symbols s->sym[0..ns) (ns > 0) by rank until none applies. */
static bool merge_syms(const struct tok_tokenizer *t, tok_scratch *s, int32_t ns) {
    s->heap_n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (!try_pair(t, s, i, i + 1)) return false;
    while (s->heap_n > 0) {
        tok_pair p = tok_heap_pop(s);
        tok_sym *a = &s->sym[p.left], *b = &s->sym[p.right];
        if (a->n == 0 || b->n == 0 || a->n + b->n != p.size) continue; /* stale */
        a->n += b->n;
        a->id = p.id;
        a->next = b->next;
        if (b->next >= 0) s->sym[b->next].prev = p.left;
        b->n = 0;
        if (!try_pair(t, s, a->prev, p.left) || !try_pair(t, s, p.left, a->next)) return false;
    }
    return true;
}

/* Raw (non-byte-level) BPE, as llama.cpp does it for Gemma 4: the chunk
 * (spaces as U+2581 when escape) splits into UTF-8 characters, which merge
 * by rank; a final symbol that is no token becomes the <0xHH> tokens of its
 * bytes (bytes without one are dropped, as there). */
static int raw_encode(const struct tok_tokenizer *t, const char *text, size_t len, tok_scratch *s, tok_out *o,
                      kvlm_error *err) {
    size_t n = 0;
    if (!tok_scratch_buf(s, 3 * len)) goto nomem;
    for (size_t i = 0; i < len; i++) {
        if (t->escape && text[i] == ' ') { memcpy(s->buf + n, "\xE2\x96\x81", 3); n += 3; }
        else s->buf[n++] = text[i];
    }
    const char *b = s->buf;
    /* Gemma 4: a run of newlines that is a token is taken whole. */
    size_t nl = 0;
    while (nl < n && b[nl] == '\n') nl++;
    if (t->escape && nl == n) {
        int32_t id = tok_strmap_get(&t->map, b, n);
        if (id >= 0) { tok_out_push(o, id); return 0; }
    }
    if (!tok_scratch_syms(s, n)) goto nomem;
    int32_t ns = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = util_utf8_decode((const uint8_t *)b + i, n - i, &cp);
        if (l <= 0) l = 1; /* a stray byte is a symbol of its own */
        s->sym[ns] = (tok_sym){.start = (uint32_t)i, .n = (uint32_t)l, .prev = ns - 1, .next = ns + 1,
                               .id = tok_strmap_get(&t->map, b + i, (size_t)l)};
        ns++;
        i += (size_t)l;
    }
    s->sym[ns - 1].next = -1;
    if (!merge_syms(t, s, ns)) goto nomem;
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        const tok_sym *y = &s->sym[i];
        if (y->id >= 0) { tok_out_push(o, y->id); continue; }
        for (uint32_t j = 0; j < y->n; j++) {
            int32_t id = t->byte_tok[(uint8_t)b[y->start + j]];
            if (id >= 0) tok_out_push(o, id);
        }
    }
    return 0;
nomem:
    util_err_set(err, KVLM_ENOMEM, "out of memory tokenizing %zu bytes", len);
    return -1;
}

int tok_bpe_encode(const struct tok_tokenizer *t, const char *text, size_t len, tok_scratch *s,
                   tok_out *o, kvlm_error *err) {
    if (len == 0) return 0;
    if (t->raw) return raw_encode(t, text, len, s, o, err);
    if (t->ignore_merges) {
        /* Llama 3 (ignore_merges): a chunk that is itself a token is that
         * token, whatever the merges would make of it. */
        if (len <= t->max_len && tok_scratch_buf(s, 2 * len)) {
            size_t n = 0;
            for (size_t i = 0; i < len; i++) {
                uint8_t b = (uint8_t)text[i];
                memcpy(s->buf + n, t->byte_utf8[b], t->byte_utf8_len[b]);
                n += t->byte_utf8_len[b];
            }
            int32_t id = tok_strmap_get(&t->map, s->buf, n);
            if (id >= 0) { tok_out_push(o, id); return 0; }
        }
    }
    /* One symbol per byte; spans count input bytes (only lengths matter). */
    if (!tok_scratch_syms(s, len)) goto nomem;
    int32_t ns = (int32_t)len;
    for (int32_t i = 0; i < ns; i++)
        s->sym[i] = (tok_sym){.start = (uint32_t)i, .n = 1, .prev = i - 1, .next = i + 1,
                              .id = t->byte_sym[(uint8_t)text[i]]};
    s->sym[ns - 1].next = -1;
    if (!merge_syms(t, s, ns)) goto nomem;
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        /* A byte whose character is not in the vocabulary: unknown, if any. */
        int32_t id = s->sym[i].id >= 0 ? s->sym[i].id : t->v->unk;
        if (id >= 0) tok_out_push(o, id);
    }
    return 0;
nomem:
    util_err_set(err, KVLM_ENOMEM, "out of memory tokenizing %zu bytes", len);
    return -1;
}
