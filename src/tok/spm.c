/* tok/spm: SentencePiece-style BPE ("llama" vocabularies), as llama.cpp's SPM
 * tokenizer does it: spaces become U+2581, the text splits into characters,
 * and the adjacent pair whose concatenation is the highest-scoring token
 * merges first (leftmost on ties) until none is left; a character that is
 * not a token falls back to its <0xHH> byte tokens. */
#include <string.h>
#include "tok/tok_internal.h"
#include "util/utf8.h"
#include "util/error.h"

/* Queues sym[l] + sym[r] if their text is a token. */
static bool try_pair(const struct tok_tokenizer *t, tok_scratch *s, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return true;
    const tok_sym *a = &s->sym[l], *b = &s->sym[r];
    uint32_t size = a->n + b->n;
    int32_t id = tok_strmap_get(&t->map, s->buf + a->start, size);
    if (id < 0) return true;
    tok_pair p = {.prio = t->v->scores ? -t->v->scores[id] : 0.0f, .left = l, .right = r, .size = size, .id = id};
    return tok_heap_push(s, p);
}

/* Merges the symbols sym[0..ns) (linked in order) and writes their tokens. */
static int merge_segment(const struct tok_tokenizer *t, tok_scratch *s, int32_t ns, tok_out *o) {
    s->sym[ns - 1].next = -1;
    s->heap_n = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (!try_pair(t, s, i, i + 1)) return -1;
    while (s->heap_n > 0) {
        tok_pair p = tok_heap_pop(s);
        tok_sym *l = &s->sym[p.left], *r = &s->sym[p.right];
        /* Stale: one side was merged away or grew since this pair was queued. */
        if (l->n == 0 || r->n == 0 || l->n + r->n != p.size) continue;
        l->n += r->n;
        l->id = p.id;
        l->next = r->next;
        if (r->next >= 0) s->sym[r->next].prev = p.left;
        r->n = 0;
        if (!try_pair(t, s, l->prev, p.left) || !try_pair(t, s, p.left, l->next)) return -1;
    }
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        const tok_sym *y = &s->sym[i];
        int32_t id = y->id >= 0 ? y->id : tok_strmap_get(&t->map, s->buf + y->start, y->n);
        if (id >= 0) { tok_out_push(o, id); continue; }
        for (uint32_t j = 0; j < y->n; j++) {
            int32_t byte = t->byte_tok[(uint8_t)s->buf[y->start + j]];
            /* No byte token: unknown (llama.cpp would throw here). */
            if (byte < 0) byte = t->v->unk;
            if (byte >= 0) tok_out_push(o, byte);
        }
    }
    return 0;
}

int tok_spm_encode(const struct tok_tokenizer *t, const char *text, size_t len, bool space_prefix,
                   tok_scratch *s, tok_out *o, kvlm_error *err) {
    static const char SPACE[3] = {(char)0xE2, (char)0x96, (char)0x81}; /* U+2581 */
    if (len == 0) return 0;
    /* Escaped text: at most 3 bytes per input byte, plus the prefix. */
    if (len > (UINT32_MAX - 3) / 3 || !tok_scratch_buf(s, 3 * len + 3)) goto nomem;
    size_t n = 0;
    if (space_prefix) { memcpy(s->buf, SPACE, 3); n = 3; }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') { memcpy(s->buf + n, SPACE, 3); n += 3; }
        else s->buf[n++] = text[i];
    }

    /* One symbol per character; a byte that is not part of valid UTF-8
     * stands alone (it can only come out as a byte token). No token spans a
     * U+2581 that follows another character (when spm_split), so the text
     * merges in segments cut there: the same result as merging it whole, as
     * llama.cpp does, with a word-sized queue instead of a text-sized one. */
    int32_t ns = 0;
    bool prev_space = false;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = util_utf8_decode((const uint8_t *)s->buf + i, n - i, &cp);
        if (l == 0) l = 1;
        bool space = l == 3 && memcmp(s->buf + i, SPACE, 3) == 0;
        if (ns > 0 && t->spm_split && space && !prev_space) {
            if (merge_segment(t, s, ns, o)) goto nomem;
            ns = 0;
        }
        if (!tok_scratch_syms(s, (size_t)ns + 1)) goto nomem;
        s->sym[ns] = (tok_sym){.start = (uint32_t)i, .n = (uint32_t)l, .prev = ns - 1, .next = ns + 1, .id = -1};
        ns++;
        prev_space = space;
        i += (size_t)l;
    }
    if (ns > 0 && merge_segment(t, s, ns, o)) goto nomem;
    return 0;
nomem:
    util_err_set(err, KVLM_ENOMEM, "out of memory tokenizing %zu bytes", len);
    return -1;
}
