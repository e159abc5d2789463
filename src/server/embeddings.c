/* server/embeddings: POST /v1/embeddings (OpenAI's): the request checked
 * field by field and its inputs tokenized, each input's vector taken from
 * its scheduler event, and the answer ({object: "list", data: [{object:
 * "embedding", index, embedding}], model, usage}) with the vectors as JSON
 * numbers or base64 (little-endian float32, as OpenAI's). The job that runs
 * it (submit, wait, answer, hang-ups) is openai.c's, as for completions. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "server/server.h"

/* OpenAI's most inputs per request */
#define MAX_INPUTS 2048

struct srv_embed {
    int n;
    int32_t **toks;
    int *lens;
    kvlm_embed_params ep;
    bool b64;
    float **vec;
    int *n_vec;
    long prompt_tokens;
};

void srv_embed_free(srv_embed *e) {
    if (!e) return;
    for (int i = 0; i < e->n; i++) {
        if (e->toks) free(e->toks[i]);
        if (e->vec) free(e->vec[i]);
    }
    free(e->toks);
    free(e->lens);
    free(e->vec);
    free(e->n_vec);
    free(e);
}

int srv_embed_n(const srv_embed *e) { return e->n; }
const int32_t *const *srv_embed_tokens(const srv_embed *e) { return (const int32_t *const *)e->toks; }
const int *srv_embed_lens(const srv_embed *e) { return e->lens; }
const kvlm_embed_params *srv_embed_params(const srv_embed *e) { return &e->ep; }

static bool bad(srv_embed_err *x, unsigned status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static bool bad(srv_embed_err *x, unsigned status, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->msg, sizeof x->msg, fmt, ap);
    va_end(ap);
    x->status = status;
    x->param = param;
    x->code = code;
    return false;
}

/* Input i: a JSON string (tokenized as embedding models take text) or an array of token ids. */
static bool take_input(kvlm_server *s, srv_embed *e, int i, json_t *v, srv_embed_err *x) {
    const kvlm_model *m = s->model;
    int vocab = kvlm_vocab_size(m), n;
    int32_t *t = NULL;
    if (json_is_string(v)) {
        kvlm_error err = {0};
        const char *text = json_string_value(v);
        size_t len = json_string_length(v);
        if (len == 0) return bad(x, 400, "input", "invalid_value", "input %d is an empty string", i);
        if ((n = kvlm_embed_tokenize(m, text, len, NULL, 0, &err)) < 0)
            return bad(x, 400, "input", "invalid_value", "input %d: %s", i, err.msg);
        if (!(t = malloc(((size_t)n + 1) * sizeof *t))) return bad(x, 500, NULL, NULL, "out of memory");
        kvlm_embed_tokenize(m, text, len, t, n, &err);
    } else if (json_is_array(v)) {
        n = (int)json_array_size(v);
        if (n == 0) return bad(x, 400, "input", "invalid_value", "input %d is an empty array of token ids", i);
        if (!(t = malloc((size_t)n * sizeof *t))) return bad(x, 500, NULL, NULL, "out of memory");
        for (int k = 0; k < n; k++) {
            json_t *id = json_array_get(v, (size_t)k);
            if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= vocab) {
                free(t);
                return bad(x, 400, "input", "invalid_value", "input %d: token %d must be a token id below %d", i, k, vocab);
            }
            t[k] = (int32_t)json_integer_value(id);
        }
    } else
        return bad(x, 400, "input", "invalid_type", "'input' must be a string, an array of strings, an array of token "
                   "ids or an array of arrays of token ids");
    if (n == 0) { /* a text of nothing but what the tokenizer drops, and no BOS */
        free(t);
        return bad(x, 400, "input", "invalid_value", "input %d has no tokens", i);
    }
    int most = kvlm_ctx_kv_budget(s->ctx);
    if (n > most) {
        free(t);
        return bad(x, 400, "input", "context_length_exceeded", "input %d is %d tokens; this model's context holds %d",
                   i, n, most);
    }
    e->toks[i] = t;
    e->lens[i] = n;
    return true;
}

srv_embed *srv_embed_parse(kvlm_server *s, json_t *body, srv_embed_err *x) {
    static const char *const known[] = {"input", "model", "encoding_format", "dimensions", "user", NULL};
    memset(x, 0, sizeof *x);
    if (!json_is_object(body)) return bad(x, 400, NULL, "invalid_type", "the request body must be a JSON object"), NULL;
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v) {
        bool ok = false;
        for (const char *const *k = known; *k && !ok; k++) ok = !strcmp(*k, key);
        if (!ok)
            return bad(x, 400, key, "unknown_parameter", "Unrecognized request argument supplied: '%s'", key), NULL;
    }
    json_t *model = json_object_get(body, "model");
    if (model && !json_is_null(model)) {
        if (!json_is_string(model)) return bad(x, 400, "model", "invalid_type", "'model' must be a string"), NULL;
        if (strcmp(json_string_value(model), s->model_id))
            return bad(x, 404, "model", "model_not_found", "The model '%s' does not exist; this server serves '%s'",
                       json_string_value(model), s->model_id), NULL;
    }
    json_t *user = json_object_get(body, "user");
    if (user && !json_is_null(user) && !json_is_string(user))
        return bad(x, 400, "user", "invalid_type", "'user' must be a string"), NULL;
    bool b64 = false;
    json_t *fmt = json_object_get(body, "encoding_format");
    if (fmt && !json_is_null(fmt)) {
        const char *f = json_is_string(fmt) ? json_string_value(fmt) : "";
        if (!strcmp(f, "base64")) b64 = true;
        else if (strcmp(f, "float"))
            return bad(x, 400, "encoding_format", "invalid_value", "'encoding_format' must be \"float\" or \"base64\""),
                   NULL;
    }
    kvlm_embed_params ep = kvlm_embed_default_params();
    int width = kvlm_model_config(s->model)->dim;
    json_t *dims = json_object_get(body, "dimensions");
    if (dims && !json_is_null(dims)) {
        if (!json_is_integer(dims) || json_integer_value(dims) < 1 || json_integer_value(dims) > width)
            return bad(x, 400, "dimensions", "invalid_value", "'dimensions' must be an integer from 1 to %d (this "
                       "model's vectors; fewer keeps their first values, normalised again)", width), NULL;
        ep.dims = (int)json_integer_value(dims);
    }
    if (kvlm_model_pooling(s->model) == KVLM_POOLING_NONE) /* llama-server's answer too */
        return bad(x, 400, NULL, "invalid_value", "this model pools by none ({arch}.pooling_type 0: a vector per token), "
                   "which OpenAI's answer has no place for"), NULL;
    kvlm_error err = {0};
    if (kvlm_embed_dims(s->model, &ep, &err) < 0)
        return bad(x, err.code == KVLM_EUNSUPPORTED ? 501 : 400, NULL, "invalid_value", "%s", err.msg), NULL;
    json_t *in = json_object_get(body, "input");
    if (!in || json_is_null(in)) return bad(x, 400, "input", "missing_required_parameter", "'input' is required"), NULL;
    /* one input: a string, or an array of token ids; several: an array of those */
    bool many = json_is_array(in) && json_array_size(in) > 0 && !json_is_integer(json_array_get(in, 0));
    if (json_is_array(in) && json_array_size(in) == 0)
        return bad(x, 400, "input", "invalid_value", "'input' must not be empty"), NULL;
    int n = many ? (int)json_array_size(in) : 1;
    if (n > MAX_INPUTS)
        return bad(x, 400, "input", "invalid_value", "'input' has %d inputs; at most %d are taken", n, MAX_INPUTS), NULL;
    srv_embed *e = calloc(1, sizeof *e);
    if (!e || !(e->toks = calloc((size_t)n, sizeof *e->toks)) || !(e->lens = calloc((size_t)n, sizeof *e->lens)) ||
        !(e->vec = calloc((size_t)n, sizeof *e->vec)) || !(e->n_vec = calloc((size_t)n, sizeof *e->n_vec))) {
        srv_embed_free(e);
        return bad(x, 500, NULL, NULL, "out of memory"), NULL;
    }
    e->n = n;
    e->ep = ep;
    e->b64 = b64;
    for (int i = 0; i < n; i++)
        if (!take_input(s, e, i, many ? json_array_get(in, (size_t)i) : in, x)) {
            srv_embed_free(e);
            return NULL;
        }
    return e;
}

void srv_embed_event(srv_embed *e, const kvlm_sched_event *ev) {
    if (ev->index < 0 || ev->index >= e->n) return;
    e->prompt_tokens += ev->prompt_tokens;
    if (!ev->embedding || ev->n_embd <= 0 || e->vec[ev->index]) return;
    if ((e->vec[ev->index] = malloc((size_t)ev->n_embd * sizeof(float)))) {
        memcpy(e->vec[ev->index], ev->embedding, (size_t)ev->n_embd * sizeof(float));
        e->n_vec[ev->index] = ev->n_embd;
    }
}

/* The vector's bytes, little-endian float32, in base64 (RFC 4648, padded). */
static json_t *base64_vec(const float *v, int n) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t nb = (size_t)n * 4, o = 0;
    unsigned char *b = malloc(nb);
    char *out = malloc((nb + 2) / 3 * 4 + 1);
    json_t *j = NULL;
    if (b && out) {
        for (int i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &v[i], 4);
            for (int k = 0; k < 4; k++) b[4 * i + k] = (unsigned char)(u >> (8 * k));
        }
        for (size_t i = 0; i < nb; i += 3) {
            uint32_t w = (uint32_t)b[i] << 16 | (i + 1 < nb ? (uint32_t)b[i + 1] << 8 : 0) | (i + 2 < nb ? b[i + 2] : 0);
            out[o++] = tab[w >> 18 & 63];
            out[o++] = tab[w >> 12 & 63];
            out[o++] = i + 1 < nb ? tab[w >> 6 & 63] : '=';
            out[o++] = i + 2 < nb ? tab[w & 63] : '=';
        }
        out[o] = 0;
        j = json_stringn(out, o);
    }
    free(b);
    free(out);
    return j;
}

json_t *srv_embed_answer(const srv_embed *e, const char *model_id) {
    json_t *data = json_array();
    for (int i = 0; i < e->n; i++) {
        json_t *vec;
        if (e->b64) vec = base64_vec(e->vec[i], e->n_vec[i]);
        else {
            vec = json_array();
            for (int k = 0; vec && k < e->n_vec[i]; k++) json_array_append_new(vec, json_real((double)e->vec[i][k]));
        }
        json_array_append_new(data, json_pack("{s:s, s:i, s:o}", "object", "embedding", "index", i, "embedding",
                                              vec ? vec : json_null()));
    }
    return json_pack("{s:s, s:o, s:s, s:{s:I, s:I}}", "object", "list", "data", data, "model", model_id, "usage",
                     "prompt_tokens", (json_int_t)e->prompt_tokens, "total_tokens", (json_int_t)e->prompt_tokens);
}
