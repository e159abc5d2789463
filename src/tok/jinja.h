/* tok/jinja: the chat-template language (Hugging Face Jinja): a template
 * parsed once, rendered against a JSON object of variables, as Jinja2's
 * ImmutableSandboxedEnvironment renders it with transformers' settings
 * (docs/chat-templates.md). */
#ifndef KVLM_TOK_JINJA_H
#define KVLM_TOK_JINJA_H
#include <jansson.h>
#include <stddef.h>
#include "kvlm.h"

typedef struct jinja_template jinja_template;

/* Parses a template (UTF-8; src need not be NUL-terminated). NULL with err
 * (KVLM_EINVAL: "line N: ...") for a syntax error, a construct kvlm lacks,
 * or nesting past the parser's limit. */
jinja_template *jinja_parse(const char *src, size_t len, kvlm_error *err);
void jinja_free(jinja_template *t);

/* Limits of one render; 0 in a field takes its default (docs/chat-templates.md). */
typedef struct jinja_opts {
    size_t max_output; /* bytes of text any one buffer may hold (default 32 MiB) */
    long max_steps;    /* statements, loop iterations and calls (default 5,000,000) */
    int max_depth;     /* evaluator recursion: nested expressions, statements, macro calls (default 1000) */
    long now;          /* strftime_now's time, seconds since the epoch (0: time(NULL)) */
} jinja_opts;

/* vars: a JSON object whose members are the template's variables. Returns the
 * text (malloc'd, NUL-terminated, *len set) or NULL with err (KVLM_EINVAL for a
 * template error, its message saying what and where; raise_exception's message
 * as the template gave it). A template may be rendered from many threads at once. */
char *jinja_render(const jinja_template *t, const json_t *vars, const jinja_opts *o, size_t *len, kvlm_error *err);

#endif
