/* server/completion_text: a completion's generated text as it grows, and what
 * of it may be sent (stop strings, holdback, a stream's dropped part). */
#include "server/completion_text.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

bool srv_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t c = (*len + n + 1) * 2;
        char *b = realloc(*buf, c);
        if (!b) return false;
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

bool srv_stops_add(srv_stops *st, const char *s, size_t n) {
    if (st->n >= SRV_MAX_STOP) return false;
    char *c = strndup(s, n); /* a C string: an embedded NUL ends it (n still counts in max) */
    if (!c) return false;
    st->s[st->n++] = c;
    if (n > st->max) st->max = n;
    return true;
}

void srv_stops_free(srv_stops *st) {
    for (int i = 0; i < st->n; i++) free(st->s[i]);
    st->n = 0;
    st->max = 0;
}

void srv_ctext_start(srv_ctext *t, const char *prefix, size_t n) {
    srv_append(&t->text, &t->len, &t->cap, "", 0);
    if (prefix) srv_append(&t->text, &t->len, &t->cap, prefix, n);
    t->search_from = t->len;
}

int srv_ctext_push(srv_ctext *t, const srv_stops *st, const char *piece, size_t n, bool before_min) {
    if (t->stopped) return -1;
    /* a stop string may have begun in the last max bytes before the piece */
    size_t from = t->len > st->max ? t->len - st->max : 0;
    srv_append(&t->text, &t->len, &t->cap, piece, n);
    if (before_min) t->search_from = t->len;
    if (from < t->search_from) from = t->search_from;
    size_t best = t->len;
    int which = -1;
    for (int s = 0; s < st->n && t->len > from; s++) {
        char *p = memmem(t->text + from, t->len - from, st->s[s], strlen(st->s[s]));
        if (p && (size_t)(p - t->text) < best) best = (size_t)(p - t->text), which = s;
    }
    if (best >= t->len) return -1;
    if (st->include) best += strlen(st->s[which]);
    t->len = best;
    t->text[best] = 0;
    t->stopped = true;
    return which;
}

void srv_ctext_end(srv_ctext *t, const char *piece, size_t n) {
    if (!t->stopped) srv_append(&t->text, &t->len, &t->cap, piece, n);
}

size_t srv_ctext_holdback(const srv_ctext *t, const srv_stops *st) {
    for (size_t k = st->max > 1 ? st->max - 1 : 0; k > 0; k--) {
        if (k > t->len - t->search_from) continue;
        for (int s = 0; s < st->n; s++)
            if (strlen(st->s[s]) > k && !memcmp(t->text + t->len - k, st->s[s], k)) return k;
    }
    return 0;
}

size_t srv_ctext_ready(const srv_ctext *t, const srv_stops *st, bool final) {
    return final || t->stopped ? t->len : t->len - srv_ctext_holdback(t, st);
}

size_t srv_ctext_compact(srv_ctext *t, const srv_stops *st, size_t keep) {
    size_t tail = t->len > st->max ? t->len - st->max : 0, drop = t->sent < tail ? t->sent : tail;
    if (drop > keep) drop = keep;
    if (drop < 4096) return 0;
    memmove(t->text, t->text + drop, t->len - drop + 1);
    t->len -= drop;
    t->sent -= drop;
    t->off += drop;
    return drop;
}

void srv_ctext_free(srv_ctext *t) {
    free(t->text);
    t->text = NULL;
    t->len = t->cap = 0;
}
