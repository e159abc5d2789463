/* tok/chat_delta: the streaming delta between two parses of a growing text
 * (OpenAI's chat.completion.chunk: content, reasoning_content and tool_calls
 * pieces, a call's id and name in its first piece, its arguments appended
 * after). */
#include <string.h>
#include "tok/chat_parse.h"

static const char *str(const json_t *m, const char *k) {
    const char *s = json_string_value(json_object_get(m, k));
    return s ? s : "";
}

/* What b adds to a (b starting with a), or NULL. */
static json_t *grown(const json_t *x, const json_t *y, const char *k) {
    const char *a = str(x, k), *b = str(y, k);
    size_t la = strlen(a), lb = strlen(b);
    if (lb <= la || memcmp(a, b, la)) return NULL;
    return json_stringn(b + la, lb - la);
}

json_t *tok_chat_delta(const json_t *prev, const json_t *cur) {
    json_t *d = json_object();
    if (!d) return NULL;
    json_t *c = grown(prev, cur, "content"), *r = grown(prev, cur, "reasoning_content");
    if (r) json_object_set_new(d, "reasoning_content", r);
    if (c) json_object_set_new(d, "content", c);
    const json_t *pa = json_object_get(prev, "tool_calls"), *ca = json_object_get(cur, "tool_calls");
    size_t np = json_array_size(pa), nc = json_array_size(ca);
    json_t *calls = NULL;
    for (size_t i = 0; i < nc; i++) {
        const json_t *tc = json_array_get(ca, i), *fn = json_object_get(tc, "function");
        json_t *piece = NULL;
        if (i >= np) {
            json_t *f = json_pack("{s:s, s:s}", "name", str(fn, "name"), "arguments", str(fn, "arguments"));
            piece = json_pack("{s:I, s:s, s:s, s:o}", "index", (json_int_t)i, "id", str(tc, "id"), "type", "function",
                              "function", f);
        } else {
            json_t *more = grown(json_object_get(json_array_get(pa, i), "function"), fn, "arguments");
            if (more) piece = json_pack("{s:I, s:{s:o}}", "index", (json_int_t)i, "function", "arguments", more);
        }
        if (!piece) continue;
        if (!calls && !(calls = json_array())) {
            json_decref(piece);
            break;
        }
        json_array_append_new(calls, piece);
    }
    if (calls) json_object_set_new(d, "tool_calls", calls);
    if (!json_object_size(d)) {
        json_decref(d);
        return NULL;
    }
    return d;
}
