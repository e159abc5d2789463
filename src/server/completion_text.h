/* server/completion_text: a completion's generated text as it grows, and what
 * of it may be sent: stop strings found across token boundaries (the text
 * cut at the first), the end that could still begin one held back, a
 * stream's sent part dropped. Pure: bytes in, bytes out (the tokens' texts
 * come whole from kvlm_detok, which holds back a partial UTF-8 sequence). */
#ifndef KVLM_SERVER_COMPLETION_TEXT_H
#define KVLM_SERVER_COMPLETION_TEXT_H
#include <stdbool.h>
#include <stddef.h>

enum { SRV_MAX_STOP = 4 };

/* A request's stop strings (each non-empty; the caller bounds their length). */
typedef struct srv_stops {
    char *s[SRV_MAX_STOP];
    int n;
    size_t max;   /* the longest's length */
    bool include; /* vLLM's include_stop_str_in_output: the stop string stays in the text */
} srv_stops;

/* One choice's text (NUL-terminated). A stream's text from off on: what was
 * sent and can no longer begin a stop string is dropped (srv_ctext_compact). */
typedef struct srv_ctext {
    char *text;
    size_t len, cap;
    size_t sent;        /* the part already streamed */
    size_t off;         /* text before this was sent and dropped */
    size_t search_from; /* stop strings are looked for from here on (after an echoed prompt, or min_tokens) */
    bool stopped;       /* cut at a stop string: nothing more is added */
} srv_ctext;

/* Appends s[0, n) to a growing NUL-terminated buffer; false: out of memory. */
bool srv_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n);

/* Adds a copy of s[0, n) to the stops (at most SRV_MAX_STOP); false: full or out of memory. */
bool srv_stops_add(srv_stops *st, const char *s, size_t n);
void srv_stops_free(srv_stops *st);

/* The text before the first token: prefix (an echoed prompt, or NULL),
 * never searched for stop strings. */
void srv_ctext_start(srv_ctext *t, const char *prefix, size_t n);
/* A token's text. before_min: the token is within min_tokens (vLLM: stop
 * strings count from after it). Unless stopped before, looks for the stop
 * strings in what is new and what a stop could have begun in before; the
 * earliest match (the first listed at a tie) cuts the text there (after it
 * with include) and stops it. Returns that stop's index, or -1. */
int srv_ctext_push(srv_ctext *t, const srv_stops *st, const char *piece, size_t n, bool before_min);
/* The last bytes (kvlm_detok_flush's) when the completion ends: added unless stopped. */
void srv_ctext_end(srv_ctext *t, const char *piece, size_t n);
/* Bytes at the end of the text that could begin a stop string. */
size_t srv_ctext_holdback(const srv_ctext *t, const srv_stops *st);
/* Where what may be sent ends: all of it once ended or stopped, else all but the holdback. */
size_t srv_ctext_ready(const srv_ctext *t, const srv_stops *st, bool final);
/* Drops the sent text that no stop string can begin in any more (only in
 * runs of 4 KiB, and none at or after keep: a reader still to be given it;
 * SIZE_MAX for none). Returns the bytes dropped (off grew by as many). */
size_t srv_ctext_compact(srv_ctext *t, const srv_stops *st, size_t keep);
void srv_ctext_free(srv_ctext *t);
#endif
