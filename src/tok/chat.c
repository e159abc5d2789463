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
#include "model/model.h"
#include "util/error.h"

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

int kvlm_chat_apply(const kvlm_model *m, const char *name, const char *const *roles, const char *const *contents,
                    int n, char **out, const char **family, kvlm_error *err) {
    *out = NULL;
    const char *tmpl = name ? name : m->vocab.chat_template;
    const char *f = tok_chat_family(tmpl);
    if (!f) {
        if (name)
            return util_err_set(err, KVLM_EINVAL, "unknown chat template '%s' (use %s)", name, tok_chat_names());
        return util_err_set(err, KVLM_EUNSUPPORTED,
                            "the model's chat template is not one kvlm supports (%s); "
                            "choose one with --chat-template NAME or use /v1/completions", tok_chat_names());
    }
    for (int i = 0; i < n; i++)
        if (strcmp(roles[i], "system") && strcmp(roles[i], "user") && strcmp(roles[i], "assistant"))
            return util_err_set(err, KVLM_EINVAL, "message %d: role '%s' is not system, user or assistant", i, roles[i]);
    if (!(*out = tok_chat_render(f, roles, contents, n))) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    if (family) *family = f;
    return KVLM_OK;
}
