/* tok/chat_reader: kvlm_chat_reader (an answer read as it grows: each
 * push's text parsed again as a partial text, what is new given as a
 * chunk's delta), tool_choice's forms, and the checks of a request's tools. */
#include <stdlib.h>
#include <string.h>
#include "tok/chat.h"
#include "tok/chat_parse.h"
#include "util/error.h"

enum { TAIL = 256 };

struct kvlm_chat_reader {
    const tok_chat_syntax *s;
    char tail[TAIL + 1];
    json_t *tools;
    bool no_calls;
    uint64_t seed;
    char *text;
    size_t len, cap;
    json_t *prev;      /* the last parse (what was shown) */
    bool ended;
};

const char *kvlm_chat_tool_parser(const kvlm_chat *chat) { return tok_chat_syntax_name(tok_chat_syntax_of(chat)); }
const char *kvlm_chat_tool_parsers(void) { return tok_chat_parser_names(); }

int tok_chat_tool_choice(const json_t *tools, const json_t *choice, const char **name, const char **which,
                         kvlm_error *err) {
    *name = NULL;
    if (which) *which = "tool_choice";
    bool have = json_array_size(tools) > 0;
    if (!choice || json_is_null(choice)) return have ? TOK_CHOICE_AUTO : TOK_CHOICE_NONE;
    if (json_is_string(choice) && !strcmp(json_string_value(choice), "none")) return TOK_CHOICE_NONE;
    if (!have) /* as OpenAI answers it */
        return util_err_set(err, KVLM_EINVAL, "'tool_choice' is only allowed when 'tools' are specified"), -1;
    if (json_is_string(choice)) {
        const char *c = json_string_value(choice);
        if (!strcmp(c, "auto")) return TOK_CHOICE_AUTO;
        if (!strcmp(c, "required")) return TOK_CHOICE_REQUIRED;
        return util_err_set(err, KVLM_EINVAL, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}"), -1;
    }
    const json_t *fn = json_object_get(choice, "function");
    const char *type = json_string_value(json_object_get(choice, "type"));
    const char *n = json_string_value(json_object_get(fn, "name"));
    if (!json_is_object(choice) || !type || strcmp(type, "function") || !n)
        return util_err_set(err, KVLM_EINVAL, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}"), -1;
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        const char *tn = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (tn && !strcmp(tn, n)) {
            *name = tn;
            return TOK_CHOICE_NAMED;
        }
    }
    return util_err_set(err, KVLM_EINVAL, "'tool_choice' names the function '%.64s', which is not one of 'tools'", n), -1;
}

int kvlm_chat_tools_check(const char *tools_json, const char *choice_json, const char **which, kvlm_error *err) {
    json_t *tools = tools_json ? json_loads(tools_json, 0, NULL) : NULL;
    json_t *choice = choice_json ? json_loads(choice_json, JSON_DECODE_ANY, NULL) : NULL;
    int rc = KVLM_OK;
    const char *name;
    if (which) *which = "tools";
    if (tools_json && !tools) rc = util_err_set(err, KVLM_EINVAL, "'tools' is not JSON");
    else if (choice_json && !choice) rc = util_err_set(err, KVLM_EINVAL, "'tool_choice' is not JSON");
    else if (tools && !json_is_null(tools) && tok_chat_tools_check(tools, err)) rc = KVLM_EINVAL;
    else if (tok_chat_tool_choice(json_is_array(tools) ? tools : NULL, choice, &name, which, err) < 0) rc = KVLM_EINVAL;
    json_decref(tools);
    json_decref(choice);
    return rc;
}

kvlm_chat_reader *kvlm_chat_reader_new(const kvlm_chat *chat, const char *prompt, size_t prompt_len,
                                       const char *tools_json, uint64_t id_seed, kvlm_error *err) {
    kvlm_chat_reader *r = calloc(1, sizeof *r);
    if (!r) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        return NULL;
    }
    r->s = tok_chat_syntax_of(chat);
    size_t k = prompt_len > TAIL ? TAIL : prompt_len;
    if (prompt && k) memcpy(r->tail, prompt + prompt_len - k, k);
    r->tail[k] = 0;
    if (tools_json && !(r->tools = json_loads(tools_json, 0, NULL))) {
        util_err_set(err, KVLM_EINVAL, "'tools' is not JSON");
        free(r);
        return NULL;
    }
    r->no_calls = !json_array_size(r->tools);
    r->seed = id_seed;
    return r;
}

void kvlm_chat_reader_free(kvlm_chat_reader *r) {
    if (!r) return;
    json_decref(r->tools);
    json_decref(r->prev);
    free(r->text);
    free(r);
}

/* The text parsed (partial or whole), and what is new since the last. */
static int step(kvlm_chat_reader *r, bool partial, char **delta, kvlm_error *err) {
    *delta = NULL;
    tok_chat_parse_opts o = {.prompt_tail = r->tail, .tools = r->tools, .id_seed = r->seed, .partial = partial,
                             .no_calls = r->no_calls};
    json_t *m = tok_chat_parse(r->s, &o, r->text ? r->text : "", r->len, err);
    if (!m) return KVLM_ENOMEM;
    json_t *d = tok_chat_delta(r->prev, m);
    json_decref(r->prev);
    r->prev = m;
    if (d) {
        *delta = json_dumps(d, JSON_COMPACT);
        json_decref(d);
        if (!*delta) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    }
    return KVLM_OK;
}

static int add(kvlm_chat_reader *r, const char *text, size_t len, kvlm_error *err) {
    if (!len) return KVLM_OK;
    if (r->len + len + 1 > r->cap) {
        size_t c = r->cap ? r->cap : 256;
        while (c < r->len + len + 1) c *= 2;
        char *x = realloc(r->text, c);
        if (!x) return util_err_set(err, KVLM_ENOMEM, "out of memory");
        r->text = x;
        r->cap = c;
    }
    memcpy(r->text + r->len, text, len);
    r->len += len;
    r->text[r->len] = 0;
    return KVLM_OK;
}

int kvlm_chat_reader_push(kvlm_chat_reader *r, const char *text, size_t len, char **delta, kvlm_error *err) {
    *delta = NULL;
    if (r->ended) return util_err_set(err, KVLM_EINVAL, "kvlm_chat_reader_push after its end");
    if (!len) return KVLM_OK;
    int rc = add(r, text, len, err);
    return rc ? rc : step(r, true, delta, err);
}

int kvlm_chat_reader_end(kvlm_chat_reader *r, const char *text, size_t len, char **delta, char **message,
                         kvlm_error *err) {
    char *d = NULL;
    if (message) *message = NULL;
    if (delta) *delta = NULL;
    int rc = r->ended ? KVLM_OK : add(r, text, len, err);
    if (!rc && !r->ended) rc = step(r, false, &d, err);
    r->ended = true;
    if (rc) return -rc;
    if (delta) *delta = d;
    else free(d);
    if (message && !(*message = json_dumps(r->prev, JSON_COMPACT))) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        return -KVLM_ENOMEM;
    }
    return (int)json_array_size(json_object_get(r->prev, "tool_calls"));
}
