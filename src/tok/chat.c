/* tok/chat: chat templates: a conversation rendered as a prompt in the
 * format of a model family (ChatML, Llama 2, Llama 3, Zephyr, Phi-3, Phi-4,
 * Gemma, Granite, Mistral v7 and v7-tekken, gpt-oss's harmony, plain), as llama.cpp's
 * llm_chat_apply_template renders them, detected by the substrings it looks
 * for (and, for Mistral's two, by whether the template puts a space after
 * [INST]). */
#include "tok/chat.h"
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include "model/model.h"
#include "tok/chat_parse.h"
#include "tok/jinja.h"
#include "util/error.h"
#include "util/log.h"

static const char *const k_families[] = {"chatml", "llama2", "llama3",  "zephyr",     "phi3",
                                         "phi4",   "gemma",  "granite", "mistral-v7", "mistral-v7-tekken",
                                         "gpt-oss", "plain"};

static char g_names[256];
static pthread_once_t g_names_once = PTHREAD_ONCE_INIT;
static void make_names(void) {
    const size_t k = sizeof k_families / sizeof k_families[0];
    for (size_t i = 0, n = 0; i < k; i++)
        n += (size_t)snprintf(g_names + n, sizeof g_names - n, "%s%s", !i ? "" : i + 1 < k ? ", " : " or ", k_families[i]);
}
const char *tok_chat_names(void) {
    pthread_once(&g_names_once, make_names);
    return g_names;
}

const char *tok_chat_family(const char *t) {
    if (!t) return "plain";
    for (size_t i = 0; i < sizeof k_families / sizeof k_families[0]; i++)
        if (!strcmp(t, k_families[i])) return k_families[i];
    if (strstr(t, "<|im_sep|>")) return "phi4"; /* ChatML's markers with <|im_sep|> after the role */
    if (strstr(t, "<|channel|>")) return "gpt-oss"; /* OpenAI's harmony format */
    if (strstr(t, "<|im_start|>")) return "chatml";
    if (strstr(t, "<start_of_turn>")) return "gemma";
    if (strstr(t, "<|start_of_role|>")) return "granite";
    if (strstr(t, "<|assistant|>") && strstr(t, "<|end|>")) return "phi3";
    /* Mistral v7 (Large 2411: "[INST] ", a space after the markers) and
     * v7-tekken (Small 3.1 / 3.2: none); llama.cpp detects both as v7 */
    if (strstr(t, "[SYSTEM_PROMPT]"))
        return strstr(t, "[INST] ") || strstr(t, "[SYSTEM_PROMPT] ") ? "mistral-v7" : "mistral-v7-tekken";
    if (strstr(t, "[INST]")) return "llama2";
    if (strstr(t, "<|start_header_id|>") && strstr(t, "<|end_header_id|>")) return "llama3";
    if (strstr(t, "<|user|>")) return "zephyr";
    return NULL;
}

typedef struct { char *s; size_t len, cap; bool oom; } sbuf;

static void put(sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (b->oom || n < 0) { b->oom = true; return; }
    if (b->len + (size_t)n + 1 > b->cap) {
        size_t cap = (b->len + (size_t)n + 1) * 2;
        char *s = realloc(b->s, cap);
        if (!s) { b->oom = true; return; }
        b->s = s;
        b->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

char *tok_chat_render(const char *f, const char *const *roles, const char *const *contents, int n) {
    sbuf b = {0};
    put(&b, "%s", "");
    if (!strcmp(f, "chatml")) {
        for (int i = 0; i < n; i++) put(&b, "<|im_start|>%s\n%s<|im_end|>\n", roles[i], contents[i]);
        put(&b, "<|im_start|>assistant\n");
    } else if (!strcmp(f, "llama2")) {
        /* As llama.cpp renders it: BOS comes from the tokenizer; a system
         * message goes inside the first [INST] between <<SYS>> markers. */
        bool inside = true;
        put(&b, "[INST] ");
        for (int i = 0; i < n; i++) {
            if (!inside) { put(&b, "[INST] "); inside = true; }
            if (!strcmp(roles[i], "system")) put(&b, "<<SYS>>\n%s\n<</SYS>>\n\n", contents[i]);
            else if (!strcmp(roles[i], "user")) put(&b, "%s [/INST]", contents[i]);
            else { put(&b, "%s</s>", contents[i]); inside = false; }
        }
    } else if (!strcmp(f, "llama3")) {
        for (int i = 0; i < n; i++)
            put(&b, "<|start_header_id|>%s<|end_header_id|>\n\n%s<|eot_id|>", roles[i], contents[i]);
        put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    } else if (!strcmp(f, "phi3")) {
        for (int i = 0; i < n; i++) put(&b, "<|%s|>\n%s<|end|>\n", roles[i], contents[i]);
        put(&b, "<|assistant|>\n");
    } else if (!strcmp(f, "gpt-oss")) {
        /* harmony, as llama.cpp's built-in renders it (no system preamble,
         * channels or tools): an assistant turn ends with <|return|> */
        for (int i = 0; i < n; i++)
            put(&b, "<|start|>%s<|message|>%s%s", roles[i], contents[i],
                !strcmp(roles[i], "assistant") ? "<|return|>" : "<|end|>");
        put(&b, "<|start|>assistant");
    } else if (!strcmp(f, "phi4")) {
        for (int i = 0; i < n; i++) put(&b, "<|im_start|>%s<|im_sep|>%s<|im_end|>", roles[i], contents[i]);
        put(&b, "<|im_start|>assistant<|im_sep|>");
    } else if (!strcmp(f, "gemma")) {
        /* no system role: system messages go, trimmed, before the next user
         * message's text; the assistant is "model"; each text trimmed */
        sbuf sys = {0};
        put(&sys, "%s", "");
        for (int i = 0; i < n; i++) {
            const char *c = contents[i], *e = c + strlen(c);
            while (*c == ' ' || *c == '\n' || *c == '\t' || *c == '\r') c++;
            while (e > c && (e[-1] == ' ' || e[-1] == '\n' || e[-1] == '\t' || e[-1] == '\r')) e--;
            if (!strcmp(roles[i], "system")) {
                put(&sys, "%.*s", (int)(e - c), c);
                continue;
            }
            bool model = !strcmp(roles[i], "assistant");
            put(&b, "<start_of_turn>%s\n", model ? "model" : roles[i]);
            if (!model && sys.len) {
                put(&b, "%s\n\n", sys.s);
                sys.len = 0;
                sys.s[0] = 0;
            }
            put(&b, "%.*s<end_of_turn>\n", (int)(e - c), c);
        }
        b.oom |= sys.oom;
        free(sys.s);
        put(&b, "<start_of_turn>model\n");
    } else if (!strcmp(f, "granite")) {
        for (int i = 0; i < n; i++)
            put(&b, "<|start_of_role|>%s<|end_of_role|>%s<|end_of_text|>\n", roles[i], contents[i]);
        put(&b, "<|start_of_role|>assistant<|end_of_role|>");
    } else if (!strncmp(f, "mistral-v7", 10)) {
        /* as llama.cpp renders them; the answer follows [/INST] with no marker */
        const char *sp = strcmp(f, "mistral-v7") ? "" : " ";
        for (int i = 0; i < n; i++) {
            if (!strcmp(roles[i], "system")) put(&b, "[SYSTEM_PROMPT]%s%s[/SYSTEM_PROMPT]", sp, contents[i]);
            else if (!strcmp(roles[i], "user")) put(&b, "[INST]%s%s[/INST]", sp, contents[i]);
            else put(&b, "%s%s</s>", sp, contents[i]);
        }
    } else if (!strcmp(f, "zephyr")) {
        for (int i = 0; i < n; i++) put(&b, "<|%s|>\n%s<|endoftext|>\n", roles[i], contents[i]);
        put(&b, "<|assistant|>\n");
    } else { /* plain */
        for (int i = 0; i < n; i++) {
            const char *r = !strcmp(roles[i], "system") ? "System" : !strcmp(roles[i], "user") ? "User" : "Assistant";
            put(&b, "%s: %s\n", r, contents[i]);
        }
        put(&b, "Assistant:");
    }
    if (b.oom) { free(b.s); return NULL; }
    return b.s;
}

/* ---- kvlm_chat: the model's own Jinja template, or a family ---------------- */

struct kvlm_chat {
    const kvlm_model *model;
    const char *family;      /* a built-in family renders (no Jinja) */
    jinja_template *tmpl;    /* else the template */
    jinja_template *tool_use; /* the model's "tool_use" template, for requests with tools */
    char *source, *tool_use_source; /* their texts (for the tool-call parsers) */
    char desc[160];
    char *bos, *eos;         /* token texts given to the template */
    bool parts;              /* the template reads a message's content as a list of parts */
    bool developer;          /* the template names the developer role */
    tok_chat_syntax *syntax; /* how answers are read: tool calls, reasoning (tok/chat_parse) */
};

const tok_chat_syntax *tok_chat_syntax_of(const kvlm_chat *c) { return c->syntax; }
const kvlm_model *tok_chat_model(const kvlm_chat *c) { return c->model; }

static const char *named_template(const kvlm_model *m, const char *name) {
    for (int i = 0; i < m->vocab.n_named_templates; i++)
        if (!strcmp(m->vocab.named_template_names[i], name)) return m->vocab.named_templates[i];
    return NULL;
}

/* Whether a template reads message content as a list of parts, as vLLM
 * decides it ("openai" content format): a for loop over a message's content. */
static bool reads_parts(const char *src) {
    for (const char *p = src; (p = strstr(p, "for ")); p += 4) {
        const char *in = strstr(p, " in ");
        const char *end = strstr(p, "%}");
        if (!in || !end || in > end) continue;
        const char *c = strstr(in, "content");
        if (c && c < end) return true;
    }
    return false;
}

static char *token_text(const kvlm_model *m, int32_t id) {
    if (id < 0 || id >= m->vocab.n_tokens) return strdup("");
    return strdup(m->vocab.tokens[id]);
}

static int chat_set_template(kvlm_chat *c, const char *src, const char *desc, kvlm_error *err) {
    if (!(c->source = strdup(src))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    if (!(c->tmpl = jinja_parse(c->source, strlen(c->source), err))) { /* parsed from our copy: it may point into it */
        util_err_prefix(err, "%s", desc);
        return err ? err->code : KVLM_EINVAL;
    }
    snprintf(c->desc, sizeof c->desc, "%s", desc);
    c->parts = reads_parts(src);
    c->developer = strstr(src, "developer") != NULL;
    return KVLM_OK;
}

kvlm_chat *kvlm_chat_create(const kvlm_model *m, const kvlm_chat_params *p, kvlm_error *err) {
    static const kvlm_chat_params none = {0};
    if (!p) p = &none;
    kvlm_chat *c = calloc(1, sizeof *c);
    if (!c) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    c->model = m;
    if (!(c->bos = token_text(m, m->vocab.bos)) || !(c->eos = token_text(m, m->vocab.eos))) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto fail;
    }
    const char *named = p->template_name ? named_template(m, p->template_name) : NULL;
    if (p->template_text) {
        if (chat_set_template(c, p->template_text, p->template_origin ? p->template_origin : "the chat template", err))
            goto fail;
    } else if (p->template_name && !named) {
        const char *f = tok_chat_family(p->template_name);
        if (!f || strcmp(f, p->template_name)) {
            char names[512] = "";
            size_t n = 0;
            for (int i = 0; i < m->vocab.n_named_templates && n < sizeof names; i++)
                n += (size_t)snprintf(names + n, sizeof names - n, ", %s", m->vocab.named_template_names[i]);
            util_err_set(err, KVLM_EINVAL, "unknown chat template '%s' (the built-in families: %s%s%s)",
                         p->template_name, tok_chat_names(), n ? "; the model's named templates" : "",
                         n ? names + 1 : "");
            goto fail;
        }
        c->family = f;
        snprintf(c->desc, sizeof c->desc, "%s", f);
    } else if (named) {
        char desc[96];
        snprintf(desc, sizeof desc, "the model's %s template", p->template_name);
        if (chat_set_template(c, named, desc, err)) goto fail;
    } else if (m->vocab.chat_template) {
        kvlm_error jerr = {0};
        if (chat_set_template(c, m->vocab.chat_template, "the model's template", &jerr)) {
            const char *f = tok_chat_family(m->vocab.chat_template);
            if (!f) {
                util_err_set(err, jerr.code, "%s (give --chat-template NAME or --chat-template-file FILE)", jerr.msg);
                goto fail;
            }
            LOG_WARN("%s; rendering as the built-in %s family instead", jerr.msg, f);
            free(c->source);
            c->source = NULL;
            c->family = f;
            snprintf(c->desc, sizeof c->desc, "%s", f);
        }
        const char *tu = named_template(m, "tool_use");
        if (c->tmpl && tu) {
            kvlm_error terr = {0};
            if (!(c->tool_use_source = strdup(tu))) {
                util_err_set(err, KVLM_ENOMEM, "out of memory");
                goto fail;
            }
            if (!(c->tool_use = jinja_parse(c->tool_use_source, strlen(tu), &terr)))
                LOG_WARN("the model's tool_use template: %s; requests with tools use its default template", terr.msg);
        }
    } else {
        c->family = "plain";
        snprintf(c->desc, sizeof c->desc, "plain");
    }
    /* calls come in answers to requests with tools: read as the template that renders those writes them */
    const char *src = c->tool_use ? c->tool_use_source : c->source;
    if (!(c->syntax = tok_chat_syntax_new(src, p->tool_parser, p->reasoning_format, err))) goto fail;
    return c;
fail:
    kvlm_chat_free(c);
    return NULL;
}

void kvlm_chat_free(kvlm_chat *c) {
    if (!c) return;
    jinja_free(c->tmpl);
    jinja_free(c->tool_use);
    free(c->source);
    free(c->tool_use_source);
    free(c->bos);
    free(c->eos);
    tok_chat_syntax_free(c->syntax);
    free(c);
}

const char *kvlm_chat_describe(const kvlm_chat *c) { return c->desc; }
const char *kvlm_chat_family(const kvlm_chat *c) { return c->family ? c->family : "jinja"; }
const char *kvlm_chat_family_names(void) { return tok_chat_names(); }

static int bad(kvlm_error *err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char msg[sizeof err->msg];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return util_err_set(err, KVLM_EINVAL, "%s", msg);
}

/* A message's content as text: a string, null (""), or text parts joined
 * with newlines (vLLM's "string" content format). NULL: not text. */
static char *parts_text(json_t *ct, int i, kvlm_error *err) {
    if (!ct || json_is_null(ct)) return strdup("");
    if (json_is_string(ct)) return strdup(json_string_value(ct));
    if (!json_is_array(ct)) { bad(err, "messages[%d].content must be a string, null or an array of text parts", i); return NULL; }
    sbuf b = {0};
    put(&b, "%s", "");
    for (size_t k = 0; k < json_array_size(ct); k++) {
        json_t *part = json_array_get(ct, k), *t = json_object_get(part, "text");
        const char *type = json_string_value(json_object_get(part, "type"));
        if (!json_is_string(t) || (type && strcmp(type, "text"))) {
            free(b.s);
            bad(err, "messages[%d].content[%zu] must be a text part ({\"type\": \"text\", \"text\": ...})", i, k);
            return NULL;
        }
        if (k) put(&b, "\n");
        /* put's format is a string: the text may hold any bytes but NUL */
        put(&b, "%s", json_string_value(t));
    }
    if (b.oom) { free(b.s); return NULL; }
    return b.s;
}

/* The messages as the template is given them (a new array). */
static json_t *template_messages(const kvlm_chat *c, json_t *msgs, kvlm_error *err) {
    if (!json_is_array(msgs) || !json_array_size(msgs)) {
        bad(err, "'messages' must be a non-empty array");
        return NULL;
    }
    json_t *out = json_array();
    for (size_t i = 0; out && i < json_array_size(msgs); i++) {
        json_t *m = json_array_get(msgs, i), *role = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(role)) {
            bad(err, "messages[%zu] must be an object with a string 'role'", i);
            goto fail;
        }
        json_t *o = json_deep_copy(m);
        if (!o || json_array_append_new(out, o)) goto oom;
        if (!c->developer && !strcmp(json_string_value(role), "developer"))
            json_object_set_new(o, "role", json_string("system"));
        json_t *ct = json_object_get(m, "content");
        if (ct && !json_is_null(ct) && !json_is_string(ct)) {
            if (!json_is_array(ct)) {
                bad(err, "messages[%zu].content must be a string, null or an array of text parts", i);
                goto fail;
            }
            if (!c->parts) {
                char *t = parts_text(ct, (int)i, err);
                if (!t) goto fail;
                json_object_set_new(o, "content", json_string(t));
                free(t);
            }
        }
        json_t *calls = json_object_get(o, "tool_calls");
        if (calls && !json_is_null(calls) && !json_is_array(calls)) {
            bad(err, "messages[%zu].tool_calls must be an array", i);
            goto fail;
        }
        for (size_t k = 0; k < json_array_size(calls); k++) {
            json_t *fn = json_object_get(json_array_get(calls, k), "function");
            json_t *args = json_object_get(fn, "arguments");
            if (!json_is_string(args)) continue;
            /* as vLLM: a template formats the arguments object itself */
            json_t *obj = json_loads(json_string_value(args), JSON_DECODE_ANY, NULL);
            if (json_is_object(obj)) json_object_set_new(fn, "arguments", obj);
            else json_decref(obj);
        }
    }
    if (!out) goto oom;
    return out;
oom:
    util_err_set(err, KVLM_ENOMEM, "out of memory");
fail:
    json_decref(out);
    return NULL;
}

static bool opt_bool(json_t *req, const char *key, bool def, bool *out, kvlm_error *err) {
    json_t *v = json_object_get(req, key);
    if (!v || json_is_null(v)) { *out = def; return true; }
    if (!json_is_boolean(v)) { bad(err, "'%s' must be true or false", key); return false; }
    *out = json_is_true(v);
    return true;
}

/* The text of the last message's content, as continue_final_message cuts after it. */
static const char *final_text(json_t *msgs) {
    json_t *ct = json_object_get(json_array_get(msgs, json_array_size(msgs) - 1), "content");
    if (json_is_array(ct)) ct = json_object_get(json_array_get(ct, json_array_size(ct) - 1), "text");
    return json_string_value(ct);
}

static const char *rfind(const char *hay, size_t n, const char *needle, size_t k) {
    if (k > n) return NULL;
    for (size_t i = n - k + 1; i-- > 0;)
        if (!memcmp(hay + i, needle, k)) return hay + i;
    return NULL;
}

int kvlm_chat_render(const kvlm_chat *c, const char *request_json, char **prompt, size_t *len, kvlm_error *err) {
    *prompt = NULL;
    if (len) *len = 0;
    json_error_t je;
    json_t *req = json_loads(request_json ? request_json : "", 0, &je);
    if (!json_is_object(req)) {
        json_decref(req);
        return bad(err, "the chat request is not a JSON object: %s", je.text);
    }
    int rc = KVLM_EINVAL;
    json_t *vars = NULL, *msgs = NULL;
    bool gen, cont;
    if (!opt_bool(req, "add_generation_prompt", true, &gen, err) ||
        !opt_bool(req, "continue_final_message", false, &cont, err))
        goto done;
    if (gen && cont && json_is_true(json_object_get(req, "add_generation_prompt"))) {
        bad(err, "continue_final_message and add_generation_prompt cannot both be true");
        goto done;
    }
    if (cont) gen = false;
    if (!(msgs = template_messages(c, json_object_get(req, "messages"), err))) goto done;
    json_t *tools = json_object_get(req, "tools");
    if (tools && !json_is_null(tools) && !json_is_array(tools)) { bad(err, "'tools' must be an array"); goto done; }
    if (json_is_array(tools) && !json_array_size(tools)) tools = NULL;
    if (c->family) {
        /* a built-in family: roles and text only */
        size_t n = json_array_size(msgs);
        const char **roles = calloc(n ? n : 1, sizeof *roles), **texts = calloc(n ? n : 1, sizeof *texts);
        char **owned = calloc(n ? n : 1, sizeof *owned);
        bool ok = roles && texts && owned;
        for (size_t i = 0; ok && i < n; i++) {
            json_t *m = json_array_get(msgs, i);
            roles[i] = json_string_value(json_object_get(m, "role"));
            if (strcmp(roles[i], "system") && strcmp(roles[i], "user") && strcmp(roles[i], "assistant")) {
                ok = false;
                bad(err, "messages[%zu]: role '%s' needs a Jinja chat template (the built-in %s family has system, "
                         "user and assistant)", i, roles[i], c->family);
                break;
            }
            if (json_array_size(json_object_get(m, "tool_calls"))) {
                ok = false;
                bad(err, "messages[%zu]: tool calls need a Jinja chat template (the built-in %s family has none)", i,
                    c->family);
                break;
            }
            if (!(owned[i] = parts_text(json_object_get(m, "content"), (int)i, err))) ok = false;
            texts[i] = owned[i];
        }
        if (ok && tools) {
            ok = false;
            bad(err, "'tools' needs a Jinja chat template (the built-in %s family has none)", c->family);
        }
        if (ok && !(*prompt = tok_chat_render(c->family, roles, texts, (int)n))) {
            ok = false;
            util_err_set(err, KVLM_ENOMEM, "out of memory");
        }
        for (size_t i = 0; owned && i < n; i++) free(owned[i]);
        free(owned);
        free(roles);
        free(texts);
        if (!ok) goto done;
        if (len) *len = strlen(*prompt);
        rc = KVLM_OK;
        goto done;
    }
    if (!(vars = json_object())) goto oom;
    json_t *kw = json_object_get(req, "chat_template_kwargs");
    if (kw && !json_is_null(kw)) {
        if (!json_is_object(kw)) { bad(err, "'chat_template_kwargs' must be an object"); goto done; }
        const char *k;
        json_t *v;
        json_object_foreach(kw, k, v) {
            if (!strcmp(k, "messages") || !strcmp(k, "tools") || !strcmp(k, "documents") ||
                !strcmp(k, "add_generation_prompt")) {
                bad(err, "chat_template_kwargs cannot set '%s' (it is a member of the request)", k);
                goto done;
            }
            json_object_set(vars, k, v);
        }
    }
    json_t *docs = json_object_get(req, "documents");
    if (json_object_set_new(vars, "messages", msgs)) { msgs = NULL; goto oom; }
    msgs = NULL;
    json_object_set_new(vars, "tools", tools ? json_incref(tools) : json_null());
    json_object_set_new(vars, "documents", docs ? json_incref(docs) : json_null());
    json_object_set_new(vars, "add_generation_prompt", json_boolean(gen));
    if (!json_object_get(vars, "bos_token")) json_object_set_new(vars, "bos_token", json_string(c->bos));
    if (!json_object_get(vars, "eos_token")) json_object_set_new(vars, "eos_token", json_string(c->eos));
    const jinja_template *t = tools && c->tool_use ? c->tool_use : c->tmpl;
    size_t n = 0;
    char *text = jinja_render(t, vars, NULL, &n, err);
    if (!text) { rc = err ? err->code : KVLM_EINVAL; goto done; }
    if (cont) {
        const char *fin = final_text(json_object_get(vars, "messages"));
        const char *at = fin ? rfind(text, n, fin, strlen(fin)) : NULL;
        size_t k = fin ? strlen(fin) : 0;
        if (fin && !at) { /* as transformers: then the text stripped */
            while (k && strchr(" \t\n\r", *fin)) fin++, k--;
            while (k && strchr(" \t\n\r", fin[k - 1])) k--;
            at = rfind(text, n, fin, k);
        }
        if (!at) {
            free(text);
            bad(err, "continue_final_message: the last message's content is not in the rendered prompt");
            goto done;
        }
        n = (size_t)(at - text) + k;
        text[n] = 0;
    }
    size_t bl = strlen(c->bos);
    if (bl && c->model->vocab.add_bos && n >= bl && !memcmp(text, c->bos, bl)) {
        memmove(text, text + bl, n - bl + 1);
        n -= bl;
    }
    *prompt = text;
    if (len) *len = n;
    rc = KVLM_OK;
    goto done;
oom:
    rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
done:
    json_decref(msgs);
    json_decref(vars);
    json_decref(req);
    return rc;
}
