/* server/openai: POST /v1/completions and /v1/chat/completions (and the job
 * of /v1/embeddings): the request checked field by field (OpenAI-style 4xx
 * errors), prompt or chat template tokenized, submitted to the scheduler,
 * and the engine's events turned into the answer's JSON, whole or as
 * server-sent events' chunks: logprobs, usage, the chat reader's deltas.
 * What of the text may be sent (stop strings, holdback) is
 * server/completion_text's; the bytes on the socket (SSE, hang-ups,
 * keep-alive) server/transport's. One HTTP thread serves every connection:
 * a connection waiting for tokens is suspended and the engine resumes it
 * when there are some. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "server/job.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/server.h"
#include "util/utf8.h"
#include "util/timing.h"

enum { MAX_PROMPTS = 128 };

static void log_job(srv_job *j);

void srv_job_release(srv_job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    if (j->log_me) log_job(j);
    for (int i = 0; j->subs && i < j->n_subs; i++) json_decref(j->subs[i].plp), free(j->subs[i].echo);
    for (int i = 0; j->ch && i < j->n; i++) json_decref(j->ch[i].stop_reason);
    free(j->subs);
    free(j->stop_ids);
    free(j->stage_names);
    free(j->breakers);
    free(j->echo_text);
    for (int i = 0; j->ch && i < j->n; i++) {
        srv_ctext_free(&j->ch[i].t);
        free(j->ch[i].ids);
        json_decref(j->ch[i].lp);
        kvlm_chat_reader_free(j->ch[i].rd);
        json_decref(j->ch[i].message);
    }
    free(j->tools_json);
    free(j->choice_json);
    srv_stops_free(&j->stops);
    free(j->ch);
    free(j->out);
    free(j->raw);
    free(j->bias_ids);
    kvlm_grammar_free(j->grammar);
    free(j->bias);
    srv_embed_free(j->emb);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

/* Valid UTF-8 copy of bytes (invalid ones become U+FFFD), as a JSON string. */
static json_t *jstr(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    char *b = NULL;
    size_t len = 0, cap = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = util_utf8_decode((const uint8_t *)s + i, n - i, &cp);
        if (k > 0) srv_append(&b, &len, &cap, s + i, (size_t)k), i += (size_t)k;
        else srv_append(&b, &len, &cap, "\xEF\xBF\xBD", 3), i++;
    }
    j = json_stringn(b ? b : "", len);
    free(b);
    return j;
}

static bool utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = util_utf8_decode((const uint8_t *)s + i, n - i, &cp);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

static const char *finish_name(int f) {
    /* kv_cache_full: kvlm's own, the KV pool could not hold the completion */
    return f == KVLM_FINISH_LENGTH ? "length" : f == KVLM_FINISH_STOP ? "stop" : f == KVLM_FINISH_KV_FULL ? "kv_cache_full"
           : f                     ? "error"
                                   : NULL;
}

/* Completions-style logprobs from the chat-style entries [from, to). */
static json_t *lp_render(const srv_job *j, const srv_choice *c, size_t from, size_t to, size_t text_off) {
    if (j->logprobs < 0) return json_null();
    if (j->chat) {
        json_t *a = json_array();
        for (size_t i = from; i < to; i++) json_array_append(a, json_array_get(c->lp, i));
        return json_pack("{s:o}", "content", a);
    }
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (size_t i = from; i < to; i++) {
        json_t *e = json_array_get(c->lp, i), *top = json_object();
        json_array_append(toks, json_object_get(e, "token"));
        json_array_append(lps, json_object_get(e, "logprob"));
        json_t *alts = json_object_get(e, "top_logprobs");
        for (size_t k = 0; k < json_array_size(alts); k++) {
            json_t *a = json_array_get(alts, k);
            json_object_set(top, json_string_value(json_object_get(a, "token")), json_object_get(a, "logprob"));
        }
        if (json_is_null(alts)) { /* an echoed prompt's first token: nothing before it */
            json_decref(top);
            top = json_null();
        }
        json_array_append_new(tops, top);
        json_array_append_new(offs, json_integer((json_int_t)text_off));
        text_off += strlen(json_string_value(json_object_get(e, "token")));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}

static json_t *envelope(const srv_job *j, const char *object) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", j->idstr, "object", object, "created",
                          (json_int_t)j->created, "model", j->srv->model_id, "system_fingerprint", j->srv->fingerprint);
    if (j->chat) json_object_set_new(o, "chat_template", json_string(j->family));
    return o;
}

static json_t *usage(const srv_job *j) {
    int prompt = j->prompt_tokens, cached = j->cached_tokens;
    for (int i = 0; j->subs && i < j->n_subs; i++) { /* each prompt's, as OpenAI sums an array's */
        prompt = (i ? prompt : 0) + j->subs[i].prompt_tokens;
        cached = (i ? cached : 0) + j->subs[i].cached_tokens;
    }
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", prompt, "completion_tokens",
                     j->completion_tokens, "total_tokens", prompt + j->completion_tokens,
                     "prompt_tokens_details", "cached_tokens", cached);
}


static json_t *usage(const srv_job *j);

/* What a stream's chunk carries beyond OpenAI's: vLLM's stop_reason (at the
 * end), prompt_logprobs (completions: the first chunk of a choice) and
 * usage in every chunk (stream_options.continuous_usage_stats). */
static void stream_extras(const srv_job *j, const srv_choice *c, json_t *o, json_t *ch, bool final) {
    if (final) json_object_set(ch, "stop_reason", c->stop_reason ? c->stop_reason : json_null());
    if (!c->started && j->prompt_lp >= 0 && j->subs && j->subs[c->sub].plp) {
        json_t *plp = j->subs[c->sub].plp;
        if (j->chat) json_object_set(o, "prompt_logprobs", plp);
        else json_object_set(ch, "prompt_logprobs", plp);
    }
    if (j->continuous_usage) json_object_set_new(o, "usage", usage(j));
}

/* What the reader shows of c's text up to end, as a chunk's delta (an
 * object, maybe empty); at the end, its whole answer too (c->message). */
static json_t *read_answer(srv_job *j, srv_choice *c, size_t end, bool final) {
    char *d = NULL, *msg = NULL;
    kvlm_error err = {0};
    int rc = 0;
    if (final && !c->message) {
        rc = kvlm_chat_reader_end(c->rd, c->t.text + c->fed, end - c->fed, &d, &msg, &err);
        if (rc >= 0) {
            c->n_calls = rc;
            c->message = msg ? json_loads(msg, 0, NULL) : NULL;
        }
    } else if (!final && end > c->fed) rc = -kvlm_chat_reader_push(c->rd, c->t.text + c->fed, end - c->fed, &d, &err);
    if (rc < 0 && !j->error[0]) snprintf(j->error, sizeof j->error, "reading the answer: %.400s", err.msg);
    c->fed = end;
    json_t *delta = d ? json_loads(d, 0, NULL) : NULL;
    free(d);
    free(msg);
    return delta ? delta : json_object();
}

/* The finish_reason of an ended choice: "tool_calls" when it stopped after calls. */
static const char *choice_finish(const srv_choice *c) {
    return c->n_calls > 0 && c->finish == KVLM_FINISH_STOP ? "tool_calls" : finish_name(c->finish);
}

/* Streams what of choice c is safe to send (everything when it ended). */
static void emit(srv_job *j, srv_choice *c, bool final) {
    if (!j->stream) {
        if (final && c->rd) json_decref(read_answer(j, c, c->t.len, true));
        return;
    }
    size_t end = srv_ctext_ready(&c->t, &j->stops, final);
    size_t n_lp = j->logprobs >= 0 ? json_array_size(c->lp) : 0;
    json_t *rdelta = c->rd ? read_answer(j, c, end, final) : NULL;
    if (rdelta ? !json_object_size(rdelta) && n_lp == c->lp_sent && !final && c->started
               : end <= c->t.sent && n_lp == c->lp_sent && !final && c->started) {
        json_decref(rdelta);
        c->t.sent = end > c->t.sent ? end : c->t.sent;
        return;
    }
    int idx = (int)(c - j->ch);
    json_t *o = envelope(j, j->chat ? "chat.completion.chunk" : "text_completion"), *ch;
    json_t *text = jstr(c->t.text + c->t.sent, end > c->t.sent ? end - c->t.sent : 0);
    if (j->chat) {
        json_t *delta = json_object();
        if (!c->started) json_object_set_new(delta, "role", json_string("assistant"));
        if (rdelta) {
            json_decref(text);
            json_object_update(delta, rdelta);
            json_decref(rdelta);
        } else if (end > c->t.sent || !final) json_object_set_new(delta, "content", text);
        else json_decref(text);
        ch = json_pack("{s:i, s:o}", "index", idx, "delta", delta);
    } else ch = json_pack("{s:i, s:o}", "index", idx, "text", text);
    json_object_set_new(ch, "logprobs", lp_render(j, c, c->lp_sent, n_lp, c->t.off + c->t.sent));
    const char *fin = final ? choice_finish(c) : NULL;
    json_object_set_new(ch, "finish_reason", fin ? json_string(fin) : json_null());
    stream_extras(j, c, o, ch, final);
    json_object_set_new(o, "choices", json_pack("[o]", ch));
    srv_sse(j, o);
    c->started = true;
    c->t.sent = end > c->t.sent ? end : c->t.sent;
    c->lp_sent = n_lp;
    /* a stream keeps what is not sent and what a stop string may still begin
     * in, not the whole text: under eviction a stream has no end */
    if (c->lp_sent) {
        json_array_clear(c->lp);
        c->lp_sent = 0;
    }
    size_t drop = srv_ctext_compact(&c->t, &j->stops, c->rd ? c->fed : SIZE_MAX);
    if (c->rd) c->fed -= drop;
}


static json_t *lp_entry(const kvlm_model *m, const kvlm_sched_event *ev) {
    char buf[256];
    int n = kvlm_token_to_text(m, ev->token, buf, sizeof buf);
    json_t *bytes = json_array(), *top = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(bytes, json_integer((unsigned char)buf[i]));
    json_t *e = json_pack("{s:o, s:f, s:o}", "token", jstr(buf, n > 0 ? (size_t)n : 0), "logprob",
                          (double)ev->logprob, "bytes", bytes);
    for (int k = 0; k < ev->n_top; k++) {
        char tb[256];
        int tn = kvlm_token_to_text(m, ev->top_tokens[k], tb, sizeof tb);
        json_t *tbytes = json_array();
        for (int i = 0; i < tn; i++) json_array_append_new(tbytes, json_integer((unsigned char)tb[i]));
        json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token", jstr(tb, tn > 0 ? (size_t)tn : 0), "logprob",
                                             (double)ev->top_logprobs[k], "bytes", tbytes));
    }
    json_object_set_new(e, "top_logprobs", top);
    return e;
}

/* A chat answer's token, for s->answers. */
static bool keep_id(srv_choice *c, int32_t t) {
    if (c->n_ids >= SRV_ANSWER_MAX_IDS) return false;
    if (c->n_ids == c->cap_ids) {
        int cap = c->cap_ids ? 2 * c->cap_ids : 64;
        int32_t *ids = realloc(c->ids, (size_t)cap * sizeof *ids);
        if (!ids) return false;
        c->ids = ids;
        c->cap_ids = cap;
    }
    c->ids[c->n_ids++] = t;
    return true;
}
static void prompt_event(srv_job *j, srv_sub *sub, const kvlm_sched_event *ev);
static void request_done(srv_job *j);

/* The scheduler's callback (engine thread). */
static bool on_event(void *user, const kvlm_sched_event *ev) {
    srv_sub *sub = user;
    srv_job *j = sub->j;
    pthread_mutex_lock(&j->mu);
    srv_choice *c = &j->ch[sub->base + ev->index];
    char piece[256];
    bool go_on = true, last = false;
    sub->prompt_tokens = ev->prompt_tokens;
    sub->cached_tokens = ev->cached_tokens;
    sub->queue = ev->queue_time;
    if (ev->prompt_token) { /* prompt_logprobs, or echo with logprobs: before any token of the text */
        prompt_event(j, sub, ev);
        pthread_mutex_unlock(&j->mu);
        return true;
    }
    if (ev->finish) {
        int n = kvlm_detok_flush(&c->dt, piece, sizeof piece);
        srv_ctext_end(&c->t, piece, (size_t)n);
        c->finish = c->t.stopped ? KVLM_FINISH_STOP : ev->finish;
        if (ev->finish == KVLM_FINISH_STOP && !c->stop_reason && c->n_tokens) /* a stop token id (not an end token) */
            for (int i = 0; i < j->n_stop_ids; i++)
                if (j->stop_ids[i] == c->last_token) c->stop_reason = json_integer(c->last_token);
        if (j->record && !c->ids_off && c->finish != KVLM_FINISH_CANCELLED && c->finish != KVLM_FINISH_ERROR)
            srv_answers_record(j->srv->answers, j->prompt_key, j->prompt_last, c->dt.special, c->ids, c->n_ids,
                               c->t.text, c->t.len, c->t.off);
        free(c->ids);
        c->ids = NULL;
        if (j->emb) srv_embed_event(j->emb, ev); /* an input's vector (finished choices count completions only) */
        else if (c->finish > 0 && c->finish < 6) __atomic_fetch_add(&j->srv->finished[c->finish], 1, __ATOMIC_RELAXED);
        if (ev->finish == KVLM_FINISH_ERROR && !j->error[0])
            snprintf(j->error, sizeof j->error, "%s", ev->error ? ev->error : "the engine failed");
        if (ev->finish != KVLM_FINISH_CANCELLED) emit(j, c, true);
        last = ++j->n_ended == j->n;
        if (last) {
            bool cancelled = false; /* by a hang-up (no one reads this) or by the server stopping */
            for (int i = 0; i < j->n; i++) cancelled |= j->ch[i].finish == KVLM_FINISH_CANCELLED;
            if (j->stream && (j->error[0] || cancelled))
                srv_sse(j, json_pack("{s:{s:s, s:s}}", "error", "message",
                                 j->error[0] ? j->error : "the request was cancelled: the server is stopping", "type",
                                 "server_error"));
            if (j->stream && j->include_usage) {
                json_t *o = envelope(j, j->chat ? "chat.completion.chunk" : "text_completion");
                json_object_set_new(o, "choices", json_array());
                json_object_set_new(o, "usage", usage(j));
                srv_sse(j, o);
            }
            if (j->stream && !j->cut) srv_append(&j->out, &j->out_len, &j->out_cap, "data: [DONE]\n\n", 14);
            j->complete = true;
            if (j->sock) srv_sock_answer_due(j->sock);
            if (j->completion_tokens >= 2 && j->n == 1)
                srv_observe(j->srv, -1, (j->t_last - j->t_first) / (j->completion_tokens - 1));
            request_done(j);
        }
    } else {
        double now = util_now_s();
        if (j->t_first == 0) {
            j->t_first = now;
            srv_observe(j->srv, now - j->t_submit, -1);
        }
        if (c->n_tokens) srv_metrics_itl(j->srv, now - c->t_last);
        c->t_last = now;
        j->t_last = now;
        j->completion_tokens++;
        c->n_tokens++;
        c->last_token = ev->token;
        int n = kvlm_detok_push(&c->dt, ev->token, piece, sizeof piece);
        if (j->logprobs >= 0) json_array_append_new(c->lp, lp_entry(j->srv->model, ev));
        if (j->record && !c->ids_off && !keep_id(c, ev->token)) {
            free(c->ids);
            c->ids = NULL;
            c->n_ids = 0;
            c->ids_off = true;
        }
        /* vLLM: stop strings count from min_tokens on */
        int which = srv_ctext_push(&c->t, &j->stops, piece, (size_t)n, c->n_tokens <= j->min_tokens);
        if (which >= 0) {
            c->stop_reason = json_string(j->stops.s[which]);
            go_on = false;
        }
        emit(j, c, false);
    }
    srv_job_deliver(j);
    pthread_mutex_unlock(&j->mu);
    if (last) srv_job_release(j); /* the engine's reference */
    return go_on;
}

/* ---- request parsing ------------------------------------------------------------ */

typedef struct { unsigned status; const char *param, *code; char msg[512]; } perr;

static bool fail(perr *e, unsigned status, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static bool fail(perr *e, unsigned status, const char *param, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->status = status;
    e->param = param;
    e->code = code;
    return false;
}

/* Optional number field in [lo, hi]; false (e filled) on a wrong type or range. */
static bool get_num(json_t *body, const char *key, double lo, double hi, bool integer, double *out, perr *e) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return true;
    if (integer ? !json_is_integer(v) : !json_is_number(v))
        return fail(e, 400, key, "invalid_type", "'%s' must be %s", key, integer ? "an integer" : "a number");
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return fail(e, 400, key, "invalid_value", "'%s' must be between %g and %g", key, lo, hi);
    *out = x;
    return true;
}

/* A JSON number as a float, one past float's range as an infinity (which the range checks refuse). */
static float to_float(double x) { return x > FLT_MAX ? INFINITY : x < -FLT_MAX ? -INFINITY : (float)x; }

static bool get_bool(json_t *body, const char *key, bool *out, perr *e) {
    json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) return fail(e, 400, key, "invalid_type", "'%s' must be true or false", key);
    *out = json_is_true(v);
    return true;
}

/* The prompt's tokens (malloc'd) from "prompt" or "messages". */
static int32_t *prompt_tokens(kvlm_server *s, json_t *body, srv_job *j, int *n_out, perr *e) {
    const kvlm_model *m = s->model;
    char *text = NULL;
    kvlm_error err = {0};
    json_t *msgs = NULL;
    if (j->chat) {
        msgs = json_object_get(body, "messages");
        if (!msgs) { fail(e, 400, "messages", "missing_required_parameter", "'messages' is required"); return NULL; }
        if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
            fail(e, 400, "messages", "invalid_type", "'messages' must be a non-empty array");
            return NULL;
        }
        if (!s->chat) {
            fail(e, 400, NULL, "unsupported_chat_template", "%s", s->chat_error);
            return NULL;
        }
        /* what the template sees of the request (kvlm_chat_render) */
        static const char *const keys[] = {"messages", "tools", "documents", "add_generation_prompt",
                                           "continue_final_message", "chat_template_kwargs", NULL};
        json_t *req = json_object();
        for (const char *const *k = keys; req && *k; k++) {
            json_t *v = json_object_get(body, *k);
            if (v) json_object_set(req, *k, v);
        }
        char *rj = req ? json_dumps(req, JSON_COMPACT) : NULL;
        json_decref(req);
        if (!rj) { fail(e, 500, NULL, NULL, "out of memory"); return NULL; }
        int rc = kvlm_chat_render(s->chat, rj, &text, NULL, &err);
        free(rj);
        if (rc) {
            fail(e, rc == KVLM_ENOMEM ? 500 : 400, rc == KVLM_ENOMEM ? NULL : "messages",
                 rc == KVLM_ENOMEM ? NULL : "invalid_value", "%s", err.msg);
            return NULL;
        }
        j->family = kvlm_chat_family(s->chat);
        size_t tl = strlen(text), k = tl < sizeof j->ptail - 1 ? tl : sizeof j->ptail - 1;
        memcpy(j->ptail, text + tl - k, k);
        j->ptail[k] = 0;
    } else {
        json_t *p = json_object_get(body, "prompt");
        if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0))) p = json_array_get(p, 0);
        if (json_is_array(p) && json_array_size(p) > 0) { /* token ids */
            size_t n = json_array_size(p);
            int32_t *t = malloc(n * sizeof *t);
            for (size_t i = 0; t && i < n; i++) {
                json_t *v = json_array_get(p, i);
                if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= kvlm_vocab_size(m)) {
                    free(t);
                    fail(e, 400, "prompt", "invalid_value",
                         "'prompt' must be a string, or an array of one string or of token ids below %d",
                         kvlm_vocab_size(m));
                    return NULL;
                }
                t[i] = (int32_t)json_integer_value(v);
            }
            *n_out = (int)n;
            return t;
        }
        if (!p) { fail(e, 400, "prompt", "missing_required_parameter", "'prompt' is required"); return NULL; }
        if (!json_is_string(p)) {
            fail(e, 400, "prompt", "invalid_type", "'prompt' must be a string, or an array of one string or of token ids");
            return NULL;
        }
        text = strdup(json_string_value(p));
    }
    bool bos = kvlm_add_bos(m);
    int n = -1;
    int32_t *t = NULL;
    if (!text) err.code = KVLM_ENOMEM;
    else if (j->chat) /* the answers this server generated, taken as their ids (server/answers.c) */
        t = srv_answers_tokenize_json(s->answers, m, text, strlen(text), bos, msgs, &n, &j->reused, &j->reused_tokens,
                                      &err);
    else {
        n = kvlm_tokenize(m, text, strlen(text), bos, false, NULL, 0, &err);
        t = n > 0 ? malloc((size_t)n * sizeof *t) : NULL;
        if (t) kvlm_tokenize(m, text, strlen(text), bos, false, t, n, &err);
    }
    free(text);
    if (err.code == KVLM_ENOMEM) { free(t); fail(e, 500, NULL, NULL, "out of memory"); return NULL; }
    if (!t && j->chat) n = -1;
    if (n < 0) { fail(e, 400, j->chat ? "messages" : "prompt", "invalid_value", "%s", err.msg); return NULL; }
    if (n == 0) { fail(e, 400, "prompt", "invalid_value", "the prompt is empty and the model has no BOS token"); return NULL; }
    if (!t) { fail(e, 500, NULL, NULL, "out of memory"); return NULL; }
    *n_out = n;
    return t;
}

/* A field this server does not implement is refused unless it asks for
 * nothing (null, or the value that means "off"); a field it does not know is
 * refused too (as OpenAI does): nothing a client asks for is silently ignored. */
static bool is_off(const char *key, json_t *v) {
    if (!v || json_is_null(v)) return true;
    if (!strcmp(key, "tools") || !strcmp(key, "functions")) return json_is_array(v) && !json_array_size(v);
    if (!strcmp(key, "metadata")) return json_is_object(v) && !json_object_size(v);
    if (!strcmp(key, "tool_choice") || !strcmp(key, "function_call"))
        return json_is_string(v) && !strcmp(json_string_value(v), "none");
    if (!strcmp(key, "modalities"))
        return json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)) &&
               !strcmp(json_string_value(json_array_get(v, 0)), "text");
    if (!strcmp(key, "suffix")) return json_is_string(v) && !json_string_length(v);
    if (!strcmp(key, "parallel_tool_calls")) return json_is_boolean(v);
    if (!strcmp(key, "echo") || !strcmp(key, "store")) return json_is_false(v);
    if (!strcmp(key, "best_of")) return json_is_integer(v) && json_integer_value(v) == 1;
    if (!strcmp(key, "service_tier"))
        return json_is_string(v) && (!strcmp(json_string_value(v), "auto") || !strcmp(json_string_value(v), "default"));
    return false;
}

/* What vLLM's, llama-server's and OpenAI's clients send beyond the fields above (parse_compat). */
static const char *const k_compat_fields[] = {
    /* vLLM's */
    "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "prompt_logprobs",
    /* llama-server's */
    "n_predict", "cache_prompt", "repeat_penalty", "repeat_last_n", "typical_p", "dry_multiplier", "dry_base",
    "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability", "xtc_threshold",
    "samplers",
    /* OpenAI's */
    "max_completion_tokens", "echo", "suffix", "metadata", NULL};
static bool field_unknown(kvlm_server *s, const char *name, const char *param, perr *e);

static bool check_fields(kvlm_server *s, json_t *body, bool chat, perr *e) {
    static const char *both[] = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                                 "stream", "stream_options", "logprobs", "stop", "frequency_penalty",
                                 "presence_penalty", "user", "logit_bias", "response_format", "grammar", NULL};
    static const char *chat_only[] = {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                                      "add_generation_prompt", "continue_final_message", "documents", "tools",
                                      "tool_choice", "parallel_tool_calls", NULL};
    static const char *text_only[] = {"prompt", NULL};
    /* OpenAI's, not implemented here: accepted only when they ask for nothing */
    static const char *unsupported[] = {"tools", "tool_choice", "functions", "function_call", "best_of", "modalities", "audio",
                                        "prediction", "reasoning_effort", "web_search_options", "store",
                                        "parallel_tool_calls", "service_tier", NULL};
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v) {
        bool known = false;
        for (const char *const *k = both; *k && !known; k++) known = !strcmp(*k, key);
        for (const char *const *k = chat ? chat_only : text_only; *k && !known; k++) known = !strcmp(*k, key);
        for (const char *const *k = k_compat_fields; *k && !known; k++) known = !strcmp(*k, key);
        if (known) continue;
        for (const char *const *k = unsupported; *k && !known; k++) known = !strcmp(*k, key);
        if (!known) {
            if (!field_unknown(s, key, key, e)) return false;
            continue;
        }
        if (!is_off(key, v))
            return fail(e, 400, key, "unsupported_parameter", "'%s' is not supported by this server (only %s)", key,
                        !strcmp(key, "tools") || !strcmp(key, "functions")     ? "an empty list"
                        : !strcmp(key, "tool_choice") || !strcmp(key, "function_call") ? "\"none\""
                        : !strcmp(key, "response_format")                        ? "{\"type\": \"text\"}"
                        : !strcmp(key, "logit_bias") || !strcmp(key, "metadata") ? "an empty object"
                        : !strcmp(key, "suffix")                                 ? "an empty string"
                        : !strcmp(key, "echo") || !strcmp(key, "store")          ? "false"
                        : !strcmp(key, "best_of")                                ? "1"
                        : !strcmp(key, "modalities")                             ? "[\"text\"]"
                        : !strcmp(key, "service_tier")                           ? "\"auto\" or \"default\""
                        : !strcmp(key, "parallel_tool_calls")                    ? "true or false"
                                                                                 : "null");
    }
    return true;
}

static bool parse_compat(kvlm_server *s, json_t *body, srv_job *j, kvlm_request_params *rp, perr *e);

static bool parse(kvlm_server *s, json_t *body, srv_job *j, kvlm_request_params *rp, perr *e) {
    if (!check_fields(s, body, j->chat, e)) return false;
    json_t *model = json_object_get(body, "model");
    if (model && !json_is_null(model)) {
        if (!json_is_string(model)) return fail(e, 400, "model", "invalid_type", "'model' must be a string");
        if (strcmp(json_string_value(model), s->model_id))
            return fail(e, 404, "model", "model_not_found", "The model '%s' does not exist; this server serves '%s'",
                        json_string_value(model), s->model_id);
    }
    int n_ctx = kvlm_ctx_n_ctx(s->ctx);
    double max_tokens = j->chat ? n_ctx : 16, temp = 1, top_p = 1, top_k = 0, min_p = 0, n = 1, lp = -1, seed = -1, freq = 0,
           pres = 0;
    if (!get_num(body, "max_tokens", -1e18, 1e18, true, &max_tokens, e)) return false;
    if (j->chat && !get_num(body, "max_completion_tokens", -1e18, 1e18, true, &max_tokens, e)) return false;
    if (max_tokens <= 0) return fail(e, 400, "max_tokens", "invalid_value", "'max_tokens' must be at least 1");
    /* the sampling values: their types here, their ranges by kvlm_sampler_params_check (as kvlm run's) */
    if (!get_num(body, "temperature", -HUGE_VAL, HUGE_VAL, false, &temp, e) ||
        !get_num(body, "top_p", -HUGE_VAL, HUGE_VAL, false, &top_p, e) ||
        !get_num(body, "top_k", -HUGE_VAL, HUGE_VAL, true, &top_k, e) ||
        !get_num(body, "min_p", -HUGE_VAL, HUGE_VAL, false, &min_p, e) ||
        !get_num(body, "n", 1, 128, true, &n, e) || !get_num(body, "seed", -9.2e18, 9.2e18, true, &seed, e) ||
        !get_bool(body, "stream", &j->stream, e) ||
        !get_num(body, "frequency_penalty", -HUGE_VAL, HUGE_VAL, false, &freq, e) ||
        !get_num(body, "presence_penalty", -HUGE_VAL, HUGE_VAL, false, &pres, e))
        return false;
    json_t *user = json_object_get(body, "user");
    if (user && !json_is_null(user) && !json_is_string(user))
        return fail(e, 400, "user", "invalid_type", "'user' must be a string");
    if (j->chat) {
        bool want = false;
        double top = 0;
        if (!get_bool(body, "logprobs", &want, e) || !get_num(body, "top_logprobs", 0, KVLM_MAX_LOGPROBS, true, &top, e))
            return false;
        lp = want ? top : -1;
    } else if (!get_num(body, "logprobs", 0, KVLM_MAX_LOGPROBS, true, &lp, e)) return false;
    json_t *so = json_object_get(body, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return fail(e, 400, "stream_options", "invalid_type", "'stream_options' must be an object");
        if (!get_bool(so, "include_usage", &j->include_usage, e)) return false;
    }
    json_t *stop = json_object_get(body, "stop");
    if (stop && !json_is_null(stop)) {
        json_t *one = json_is_string(stop) ? json_pack("[O]", stop) : json_incref(stop);
        bool ok = json_is_array(one) && json_array_size(one) <= SRV_MAX_STOP, oom = false;
        for (size_t i = 0; ok && !oom && i < json_array_size(one); i++) {
            json_t *v = json_array_get(one, i);
            ok = json_is_string(v) && json_string_length(v) > 0 && json_string_length(v) < 256;
            oom = ok && !srv_stops_add(&j->stops, json_string_value(v), json_string_length(v));
        }
        json_decref(one);
        if (oom) return fail(e, 500, NULL, NULL, "out of memory");
        if (!ok)
            return fail(e, 400, "stop", "invalid_type", "'stop' must be a string or an array of up to %d non-empty strings",
                        SRV_MAX_STOP);
    }
    json_t *lb = json_object_get(body, "logit_bias");
    int n_bias = 0;
    if (lb && !json_is_null(lb)) {
        enum { MAX_BIAS = 1024 };
        if (!json_is_object(lb) || json_object_size(lb) > MAX_BIAS)
            return fail(e, 400, "logit_bias", "invalid_type", "'logit_bias' must be an object of at most %d token ids "
                        "(as strings) to biases", MAX_BIAS);
        size_t nb = json_object_size(lb);
        j->bias_ids = malloc((nb ? nb : 1) * sizeof *j->bias_ids);
        j->bias = malloc((nb ? nb : 1) * sizeof *j->bias);
        if (!j->bias_ids || !j->bias) return fail(e, 500, NULL, NULL, "out of memory");
        const char *key;
        json_t *v;
        int vocab = kvlm_vocab_size(s->model);
        json_object_foreach(lb, key, v) {
            /* a key is a token id as text, digits only (" 12", "+12", "1e1", "0x10" are not) */
            int id = kvlm_parse_token_id(key, strlen(key));
            if (id < 0 || id >= vocab)
                return fail(e, 400, "logit_bias", "invalid_value", "'logit_bias' key '%.32s' is not a token id below %d "
                            "(decimal digits)", key, vocab);
            if (!json_is_number(v))
                return fail(e, 400, "logit_bias", "invalid_type", "'logit_bias' value for token %d must be a number", id);
            j->bias_ids[n_bias] = id;
            j->bias[n_bias++] = to_float(json_number_value(v));
        }
    }
    rp->sampling = kvlm_sampler_default_params();
    rp->sampling.bias_ids = j->bias_ids;
    rp->sampling.bias = j->bias;
    rp->sampling.n_bias = n_bias;
    rp->sampling.temperature = to_float(temp);
    rp->sampling.top_p = to_float(top_p);
    rp->sampling.min_p = to_float(min_p);
    rp->sampling.frequency_penalty = to_float(freq);
    rp->sampling.presence_penalty = to_float(pres);
    rp->sampling.top_k = top_k < -2e9 ? INT32_MIN : top_k > 2e9 ? INT32_MAX : (int)top_k; /* out of range: still refused */
    kvlm_error se = {0};
    int which, f = kvlm_sampler_params_check(&rp->sampling, kvlm_vocab_size(s->model), &which, &se);
    if (f) {
        static const char *const names[] = {NULL, "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                            "repeat_last_n", "frequency_penalty", "presence_penalty"};
        if (f == KVLM_SAMPLER_BIAS_ID || f == KVLM_SAMPLER_BIAS)
            return fail(e, 400, "logit_bias", "invalid_value", "'logit_bias' %s for token %d %s",
                        f == KVLM_SAMPLER_BIAS ? "value" : "key", (int)rp->sampling.bias_ids[which], se.msg);
        return fail(e, 400, names[f], "invalid_value", "'%s' %s", names[f], se.msg);
    }
    /* structured output: OpenAI's response_format, or llama.cpp's grammar (GBNF) */
    json_t *rf = json_object_get(body, "response_format"), *gr = json_object_get(body, "grammar");
    char *schema = NULL;
    int kind = -1;
    const char *field = "response_format";
    if (rf && !json_is_null(rf)) {
        json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        const char *type = json_is_string(t) ? json_string_value(t) : "";
        json_t *sc = NULL;
        if (!strcmp(type, "json_schema")) {
            json_t *js = json_object_get(rf, "json_schema");
            if (!(sc = json_is_object(js) ? json_object_get(js, "schema") : NULL))
                return fail(e, 400, "response_format", "invalid_value", "'response_format' json_schema needs "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}");
        } else if (!strcmp(type, "json_object")) /* llama.cpp's extension: a schema beside it */
            sc = json_object_get(rf, "schema");
        else if (strcmp(type, "text"))
            return fail(e, 400, "response_format", "invalid_value", "'response_format' must be {\"type\": \"text\"}, "
                        "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}");
        if (sc) {
            kind = KVLM_GRAMMAR_JSON_SCHEMA;
            if (!(schema = json_dumps(sc, JSON_COMPACT | JSON_ENCODE_ANY))) return fail(e, 500, NULL, NULL, "out of memory");
        } else if (!strcmp(type, "json_object")) kind = KVLM_GRAMMAR_JSON_OBJECT;
    }
    if (gr && !json_is_null(gr)) {
        if (!json_is_string(gr)) {
            free(schema);
            return fail(e, 400, "grammar", "invalid_type", "'grammar' must be a string (GBNF)");
        }
        if (kind >= 0) {
            free(schema);
            return fail(e, 400, "grammar", "invalid_value", "give 'grammar' or 'response_format', not both");
        }
        field = "grammar";
        kind = KVLM_GRAMMAR_GBNF;
    }
    if (kind >= 0) { /* the one builder kvlm run and chat use too */
        kvlm_error ge = {0};
        j->grammar = kvlm_grammar_build(s->model, kind, schema ? schema : json_string_value(gr), &ge);
        free(schema);
        if (!j->grammar)
            return fail(e, ge.code == KVLM_ENOMEM ? 500 : 400, field, "invalid_value", "'%s': %s", field, ge.msg);
    }
    rp->sampling.grammar = j->grammar;
    if (j->chat) { /* tools: checked here; their grammar needs the rendered prompt (check_request) */
        json_t *tools = json_object_get(body, "tools"), *tc = json_object_get(body, "tool_choice");
        json_t *ptc = json_object_get(body, "parallel_tool_calls");
        if (ptc && !json_is_null(ptc) && !json_is_boolean(ptc))
            return fail(e, 400, "parallel_tool_calls", "invalid_type", "'parallel_tool_calls' must be true or false");
        j->parallel = !json_is_false(ptc);
        if (tools && !json_is_null(tools)) j->tools_json = json_dumps(tools, JSON_COMPACT | JSON_ENCODE_ANY);
        if (tc && !json_is_null(tc)) j->choice_json = json_dumps(tc, JSON_COMPACT | JSON_ENCODE_ANY);
        if ((tools && !json_is_null(tools) && !j->tools_json) || (tc && !json_is_null(tc) && !j->choice_json))
            return fail(e, 500, NULL, NULL, "out of memory");
        const char *which = "tools";
        kvlm_error te = {0};
        if (kvlm_chat_tools_check(j->tools_json, j->choice_json, &which, &te))
            return fail(e, 400, which, "invalid_value", "%s", te.msg);
        j->calls = json_array_size(tools) > 0 && !(json_is_string(tc) && !strcmp(json_string_value(tc), "none"));
        if (json_array_size(tools) && s->chat && strcmp(kvlm_chat_family(s->chat), "jinja"))
            return fail(e, 400, "tools", "unsupported_parameter", "'tools' needs a Jinja chat template (this server "
                        "renders chat with the built-in %s family): give --chat-template-file", kvlm_chat_family(s->chat));
    }
    static uint64_t counter;
    json_t *sv = json_object_get(body, "seed");
    rp->sampling.seed = sv && !json_is_null(sv) ? (uint64_t)(int64_t)seed
                        : (uint64_t)time(NULL) * 2654435761u + __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    j->id_seed = rp->sampling.seed * 0xbf58476d1ce4e5b9ull + (uint64_t)(uintptr_t)j;
    if (sv && !json_is_null(sv)) j->id_seed = rp->sampling.seed * 0xbf58476d1ce4e5b9ull; /* the same answer, the same ids */
    /* under eviction a completion may run past the context */
    int most = kvlm_ctx_kv_evict(s->ctx) ? 1 << 30 : n_ctx;
    rp->max_tokens = max_tokens > most ? most : (int)max_tokens;
    rp->n = (int)n;
    rp->logprobs = (int)lp;
    j->n = (int)n;
    j->logprobs = (int)lp;
    return parse_compat(s, body, j, rp, e);
}

static int32_t *completion_prompts(kvlm_server *s, json_t *body, srv_job *j, int *n_out, perr *e);

/* A parsed body (a JSON value) checked and turned into parameters and prompt
 * tokens (several prompts' one after another, their lengths in j->subs). */
static bool check_request(kvlm_server *s, json_t *body, srv_job *j, kvlm_request_params *rp, int32_t **toks,
                          int *n_toks, perr *e) {
    if (!json_is_object(body)) return fail(e, 400, NULL, "invalid_type", "the request body must be a JSON object");
    if (!parse(s, body, j, rp, e)) return false;
    if (j->chat) { /* one prompt */
        if (!(*toks = prompt_tokens(s, body, j, n_toks, e))) return false;
        if (j->calls && s->chat) { /* the calls' grammar (lazy for tool_choice auto) */
            kvlm_grammar *g = NULL;
            kvlm_error ge = {0};
            int rc = kvlm_chat_tool_grammar(s->chat, j->ptail, strlen(j->ptail), j->tools_json, j->choice_json,
                                            j->parallel, &g, &ge);
            if (rc)
                return fail(e, rc == KVLM_ENOMEM ? 500 : 400, rc == KVLM_EUNSUPPORTED ? "tool_choice" : "tools",
                            rc == KVLM_ENOMEM ? NULL : "invalid_value", "%s", ge.msg);
            if (g && j->grammar) { /* response_format (or grammar) holds the whole answer */
                bool lazy = kvlm_grammar_is_lazy(g);
                kvlm_grammar_free(g);
                if (!lazy)
                    return fail(e, 400, "tool_choice", "invalid_value", "a tool_choice that forces calls cannot be "
                                "given with 'response_format' or 'grammar'");
            } else if (g) rp->sampling.grammar = j->grammar = g;
        }
        if (!(j->subs = calloc(1, sizeof *j->subs))) return fail(e, 500, NULL, NULL, "out of memory");
        j->n_subs = 1;
        j->subs[0].n_prompt = *n_toks;
    } else if (!(*toks = completion_prompts(s, body, j, n_toks, e))) return false; /* one or several */
    int budget = kvlm_ctx_kv_budget(s->ctx); /* under eviction a longer prompt goes through in pieces */
    for (int i = 0; i < j->n_subs; i++)
        if (j->subs[i].n_prompt > budget && !kvlm_ctx_kv_evict(s->ctx))
            return fail(e, 400, j->chat ? "messages" : "prompt", "context_length_exceeded",
                        "the prompt%s is %d tokens; %s holds %d", j->n_subs > 1 ? " (one of them)" : "",
                        j->subs[i].n_prompt, budget < kvlm_ctx_n_ctx(s->ctx) ? "the KV budget" : "this model's context",
                        budget);
    return true;
}

int srv_parse_request(kvlm_server *s, const char *body, size_t len, bool chat, kvlm_request_params *rp,
                      int *n_tokens, char *msg, size_t cap, char **gbnf) {
    perr e = {0};
    *n_tokens = 0;
    if (gbnf) *gbnf = NULL;
    if (msg && cap) msg[0] = 0;
    if (!utf8_valid(body ? body : "", len)) {
        if (msg) snprintf(msg, cap, "the request body is not valid UTF-8");
        return 400;
    }
    json_error_t jerr;
    json_t *js = len ? json_loadb(body, len, 0, &jerr) : NULL;
    if (!js) {
        if (msg) snprintf(msg, cap, "the request body is not valid JSON");
        return 400;
    }
    srv_job *j = calloc(1, sizeof *j);
    if (!j) { json_decref(js); return 500; }
    pthread_mutex_init(&j->mu, NULL);
    j->refs = 1;
    j->srv = s;
    j->chat = chat;
    j->family = "plain";
    int32_t *toks = NULL;
    int status = check_request(s, js, j, rp, &toks, n_tokens, &e) ? 200 : (int)e.status;
    if (status != 200 && msg) snprintf(msg, cap, "%s", e.msg);
    if (gbnf && j->grammar) *gbnf = strdup(kvlm_grammar_gbnf(j->grammar));
    free(toks);
    json_decref(js);
    srv_job_release(j);
    return status;
}

/* ---- /tokenize and /detokenize ------------------------------------------------------- */

/* A request body as JSON, checked to be UTF-8 and JSON (every POST
 * endpoint). NULL after queueing the error in *ret. */
static json_t *load_body(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn, enum MHD_Result *ret) {
    if (!utf8_valid(cn->body ? cn->body : "", cn->len)) {
        *ret = srv_error(c, s, 400, NULL, "invalid_encoding", "the request body is not valid UTF-8");
        return NULL;
    }
    json_error_t jerr;
    json_t *body = cn->len ? json_loadb(cn->body, cn->len, 0, &jerr) : NULL;
    size_t len = cn->len;
    srv_body_release(s, cn); /* parsed: the text is not needed while the request runs */
    if (!body)
        *ret = srv_error(c, s, 400, NULL, "invalid_json", "the request body is not valid JSON: %s (line %d, column %d)",
                         len ? jerr.text : "empty body", len ? jerr.line : 0, len ? jerr.column : 0);
    return body;
}

/* A body's checks shared by both: load_body's, an object, known fields only,
 * the model's name. NULL after queueing the error. */
static json_t *small_body(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn, const char *const *fields,
                          enum MHD_Result *ret) {
    json_t *body = load_body(s, c, cn, ret);
    if (!body) return NULL;
    if (!json_is_object(body)) {
        *ret = srv_error(c, s, 400, NULL, "invalid_type", "the request body must be a JSON object");
        json_decref(body);
        return NULL;
    }
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v) {
        bool known = !strcmp(key, "model");
        for (const char *const *f = fields; *f && !known; f++) known = !strcmp(*f, key);
        perr e = {0};
        if (!known && !field_unknown(s, key, key, &e)) { /* ignored and logged once, or a 400 under --strict-params */
            *ret = srv_error(c, s, 400, key, e.code, "%s", e.msg);
            json_decref(body);
            return NULL;
        }
    }
    json_t *model = json_object_get(body, "model");
    if (model && !json_is_null(model) && (!json_is_string(model) || strcmp(json_string_value(model), s->model_id))) {
        *ret = srv_error(c, s, 404, "model", "model_not_found", "this server serves '%s'", s->model_id);
        json_decref(body);
        return NULL;
    }
    return body;
}

/* A token's text alone (as llama.cpp's pieces and vLLM's token_strs give it). */
static json_t *piece(const kvlm_model *m, int32_t t) {
    char buf[256];
    int n = kvlm_token_to_text(m, t, buf, sizeof buf);
    return jstr(buf, n > 0 ? (size_t)n : 0);
}

enum MHD_Result srv_tokenize(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn) {
    static const char *const fields[] = {"prompt", "content", "messages", "add_special_tokens", "add_special",
                                         "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                                         "tools", "documents", "with_pieces", "return_token_strs", NULL};
    enum MHD_Result ret = MHD_NO;
    json_t *body = small_body(s, c, cn, fields, &ret);
    if (!body) return ret;
    perr e = {0};
    srv_job j = {.srv = s, .family = "plain"};
    bool special = true, gen = true, pieces = false, strs = false;
    int32_t *toks = NULL;
    int n = 0;
    json_t *text = json_object_get(body, "prompt");
    if (!text) text = json_object_get(body, "content");
    j.chat = json_object_get(body, "messages") != NULL;
    if (!get_bool(body, "add_special_tokens", &special, &e) || !get_bool(body, "add_special", &special, &e) ||
        !get_bool(body, "add_generation_prompt", &gen, &e) || !get_bool(body, "with_pieces", &pieces, &e) ||
        !get_bool(body, "return_token_strs", &strs, &e))
        goto bad;
    if (j.chat == (text != NULL)) {
        fail(&e, 400, "prompt", "missing_required_parameter", "give 'prompt' (or 'content') or 'messages'");
        goto bad;
    }
    (void)gen; /* the chat template's (kvlm_chat_render) */
    if (!j.chat && !json_is_string(text)) {
        fail(&e, 400, "prompt", "invalid_type", "'prompt' must be a string");
        goto bad;
    }
    if (j.chat || special) { /* as /v1/completions and /v1/chat/completions count them */
        if (!j.chat) json_object_set(body, "prompt", text);
        if (!(toks = prompt_tokens(s, body, &j, &n, &e))) goto bad;
    } else { /* the text alone, no BOS */
        kvlm_error err = {0};
        const char *t = json_string_value(text);
        n = kvlm_tokenize(s->model, t, strlen(t), false, false, NULL, 0, &err);
        if (n < 0) { fail(&e, 400, "prompt", "invalid_value", "%s", err.msg); goto bad; }
        if (!(toks = malloc((size_t)(n ? n : 1) * sizeof *toks))) { fail(&e, 500, NULL, NULL, "out of memory"); goto bad; }
        kvlm_tokenize(s->model, t, strlen(t), false, false, toks, n, &err);
    }
    json_t *ids = json_array(), *tstrs = strs ? json_array() : NULL;
    for (int i = 0; i < n; i++) {
        json_array_append_new(ids, pieces ? json_pack("{s:i, s:o}", "id", toks[i], "piece", piece(s->model, toks[i]))
                                          : json_integer(toks[i]));
        if (tstrs) json_array_append_new(tstrs, piece(s->model, toks[i]));
    }
    json_t *o = json_pack("{s:i, s:i, s:o}", "count", n, "max_model_len", kvlm_ctx_n_ctx(s->ctx), "tokens", ids);
    if (tstrs) json_object_set_new(o, "token_strs", tstrs);
    free(toks);
    json_decref(body);
    return srv_json(c, 200, o);
bad:
    free(toks);
    ret = srv_error(c, s, e.status ? e.status : 400, e.param, e.code, "%s", e.msg);
    json_decref(body); /* e.param may name a key of the body */
    return ret;
}

enum MHD_Result srv_detokenize(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn) {
    static const char *const fields[] = {"tokens", NULL};
    enum MHD_Result ret = MHD_NO;
    json_t *body = small_body(s, c, cn, fields, &ret);
    if (!body) return ret;
    json_t *ids = json_object_get(body, "tokens");
    int vocab = kvlm_vocab_size(s->model);
    bool ok = json_is_array(ids);
    for (size_t i = 0; ok && i < json_array_size(ids); i++) {
        json_t *v = json_array_get(ids, i);
        ok = json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < vocab;
    }
    if (!ok) {
        ret = srv_error(c, s, 400, "tokens", "invalid_value", "'tokens' must be an array of token ids below %d", vocab);
        json_decref(body);
        return ret;
    }
    /* as a completion's text is made: byte pieces joined into whole characters */
    kvlm_detok dt;
    kvlm_detok_init(&dt, s->model);
    char *text = NULL, buf[256];
    size_t len = 0, cap = 0;
    srv_append(&text, &len, &cap, "", 0);
    for (size_t i = 0; i < json_array_size(ids); i++) {
        int k = kvlm_detok_push(&dt, (int32_t)json_integer_value(json_array_get(ids, i)), buf, sizeof buf);
        srv_append(&text, &len, &cap, buf, (size_t)(k > 0 ? k : 0));
    }
    int k = kvlm_detok_flush(&dt, buf, sizeof buf);
    srv_append(&text, &len, &cap, buf, (size_t)(k > 0 ? k : 0));
    json_decref(body);
    if (!text) return srv_error(c, s, 500, NULL, NULL, "out of memory");
    /* vLLM answers "prompt", llama.cpp "content" */
    json_t *o = json_pack("{s:o, s:o}", "prompt", jstr(text, len), "content", jstr(text, len));
    free(text);
    return srv_json(c, 200, o);
}

/* ---- answering --------------------------------------------------------------------- */

void srv_job_cancel(srv_job *j) {
    kvlm_server *s = j->srv;
    pthread_mutex_lock(&s->mu);
    if (s->sched && j->subs)
        for (int i = 0; i < j->n_subs; i++)
            if (j->subs[i].id) kvlm_sched_cancel(s->sched, j->subs[i].id);
    pthread_mutex_unlock(&s->mu);
}













/* A whole answer's choice beyond OpenAI's fields: vLLM's stop_reason and
 * prompt_logprobs (chat: once, beside the choices). */
static void answer_extras(const srv_job *j, const srv_choice *c, json_t *o, json_t *ch) {
    json_object_set(ch, "stop_reason", c->stop_reason ? c->stop_reason : json_null());
    if (j->prompt_lp >= 0 && j->subs && j->subs[c->sub].plp) {
        if (!j->chat) json_object_set(ch, "prompt_logprobs", j->subs[c->sub].plp);
        else if (!json_object_get(o, "prompt_logprobs")) json_object_set(o, "prompt_logprobs", j->subs[c->sub].plp);
    }
}

json_t *srv_job_answer(srv_job *j) {
    if (j->emb) return srv_embed_answer(j->emb, j->srv->model_id);
    json_t *o = envelope(j, j->chat ? "chat.completion" : "text_completion"), *choices = json_array();
    for (int i = 0; i < j->n; i++) {
        srv_choice *c = &j->ch[i];
        json_t *ch = c->message ? json_pack("{s:i, s:O}", "index", i, "message", c->message)
                     : j->chat  ? json_pack("{s:i, s:{s:s, s:o}}", "index", i, "message", "role", "assistant", "content",
                                           jstr(c->t.text, c->t.len))
                                : json_pack("{s:i, s:o}", "index", i, "text", jstr(c->t.text, c->t.len));
        json_object_set_new(ch, "logprobs", lp_render(j, c, 0, json_array_size(c->lp), 0));
        json_object_set_new(ch, "finish_reason", json_string(choice_finish(c)));
        answer_extras(j, c, o, ch);
        json_array_append_new(choices, ch);
    }
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage(j));
    return o;
}

/* ---- vLLM's, llama-server's and OpenAI's other fields; array prompts; the request's log line ---- */

/* A field this server does not use: a 400 under --strict-params, else ignored (logged once per name). */
static bool field_unknown(kvlm_server *s, const char *name, const char *param, perr *e) {
    if (s->p.strict_params)
        return fail(e, 400, param, "unknown_parameter", "Unrecognized request argument supplied: '%s'", name);
    srv_field_ignored(s, name);
    return true;
}

/* An optional integer field within [lo, hi]; *set: whether it was given. */
static bool get_int(json_t *body, const char *key, double lo, double hi, int *out, bool *set, perr *e) {
    double v = 0;
    json_t *x = json_object_get(body, key);
    if (set) *set = x && !json_is_null(x);
    if (!get_num(body, key, -9e18, 9e18, true, &v, e)) return false;
    if (!x || json_is_null(x)) return true;
    if (!(v >= lo && v <= hi)) return fail(e, 400, key, "invalid_value", "'%s' must be between %.0f and %.0f", key, lo, hi);
    *out = (int)v;
    return true;
}

static bool get_float(json_t *body, const char *key, float *out, perr *e) {
    double v = *out;
    if (!get_num(body, key, -HUGE_VAL, HUGE_VAL, false, &v, e)) return false;
    *out = to_float(v);
    return true;
}

static bool parse_compat(kvlm_server *s, json_t *body, srv_job *j, kvlm_request_params *rp, perr *e) {
    kvlm_sampler_params *sp = &rp->sampling;
    int n_ctx = kvlm_ctx_n_ctx(s->ctx), most = kvlm_ctx_kv_evict(s->ctx) ? 1 << 30 : n_ctx;
    rp->prompt_logprobs = rp->no_prefix_reuse = false; /* the caller's rp may be uninitialised */
    rp->prompt_top_logprobs = 0;
    json_t *so = json_object_get(body, "stream_options");
    if (json_is_object(so)) { /* nested keys: vLLM's continuous_usage_stats; others as unknown fields */
        const char *key;
        json_t *v;
        json_object_foreach(so, key, v) {
            if (!strcmp(key, "include_usage")) continue;
            if (!strcmp(key, "continuous_usage_stats")) {
                if (!get_bool(so, key, &j->continuous_usage, e)) return false;
                continue;
            }
            char name[160];
            snprintf(name, sizeof name, "stream_options.%.128s", key);
            if (!field_unknown(s, name, "stream_options", e)) return false;
        }
    }
    /* max_tokens by other names: OpenAI's max_completion_tokens (completions too, as vLLM), llama-server's n_predict */
    bool set;
    int v = 0;
    if (!j->chat) {
        if (!get_int(body, "max_completion_tokens", 1, 1e18, &v, &set, e)) return false;
        if (set) rp->max_tokens = v > most ? most : v;
    }
    if (!get_int(body, "n_predict", -1, 1e18, &v, &set, e)) return false;
    if (set) { /* llama-server's: over max_tokens when both are given */
        if (v == 0) return fail(e, 400, "n_predict", "invalid_value", "'n_predict' must be -1 (to the end of the text) or at least 1");
        rp->max_tokens = v < 0 || v > most ? most : v;
    }
    j->max_tokens = rp->max_tokens;
    /* llama-server's seed -1: a random one */
    json_t *seed = json_object_get(body, "seed");
    if (json_is_integer(seed) && json_integer_value(seed) == -1) {
        static uint64_t counter;
        sp->seed = (uint64_t)time(NULL) * 2654435761u + __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    }
    /* sampling: llama-server's and vLLM's fields; ranges by kvlm_sampler_params_check below */
    sp->repeat_penalty = 1.0f;
    if (!get_float(body, "repetition_penalty", &sp->repetition_penalty, e) ||
        !get_float(body, "repeat_penalty", &sp->repeat_penalty, e) || !get_float(body, "typical_p", &sp->typical_p, e) ||
        !get_float(body, "dry_multiplier", &sp->dry_multiplier, e) || !get_float(body, "dry_base", &sp->dry_base, e) ||
        !get_float(body, "xtc_probability", &sp->xtc_probability, e) ||
        !get_float(body, "xtc_threshold", &sp->xtc_threshold, e))
        return false;
    if (sp->dry_base < 1.0f) sp->dry_base = 1.75f; /* llama-server's: below 1, its default */
    int rln = sp->repeat_last_n, dpl = sp->dry_penalty_last_n, dal = sp->dry_allowed_length;
    if (!get_int(body, "repeat_last_n", -1, 1e9, &rln, NULL, e) ||
        !get_int(body, "dry_penalty_last_n", -1, 1e9, &dpl, NULL, e) ||
        !get_int(body, "dry_allowed_length", 0, 65536, &dal, NULL, e) ||
        !get_int(body, "min_tokens", 0, 1e9, &j->min_tokens, NULL, e))
        return false;
    sp->repeat_last_n = rln < 0 ? (n_ctx < 65536 ? n_ctx : 65536) : rln; /* -1: the context */
    sp->dry_penalty_last_n = dpl < 0 ? n_ctx : dpl;
    sp->dry_allowed_length = dal;
    if (j->min_tokens > rp->max_tokens)
        return fail(e, 400, "min_tokens", "invalid_value", "'min_tokens' (%d) must be at most max_tokens (%d)",
                    j->min_tokens, rp->max_tokens);
    sp->min_tokens = j->min_tokens;
    bool cache_prompt = true;
    j->skip_special = true;
    if (!get_bool(body, "ignore_eos", &sp->ignore_eos, e) || !get_bool(body, "cache_prompt", &cache_prompt, e) ||
        !get_bool(body, "skip_special_tokens", &j->skip_special, e) ||
        !get_bool(body, "include_stop_str_in_output", &j->stops.include, e) || !get_bool(body, "echo", &j->echo, e))
        return false;
    rp->no_prefix_reuse = !cache_prompt;
    json_t *ids = json_object_get(body, "stop_token_ids");
    if (ids && !json_is_null(ids)) {
        enum { MAX_STOP_IDS = 256 };
        if (!json_is_array(ids) || json_array_size(ids) > MAX_STOP_IDS)
            return fail(e, 400, "stop_token_ids", "invalid_type", "'stop_token_ids' must be an array of at most %d token ids",
                        MAX_STOP_IDS);
        if (!(j->stop_ids = malloc((json_array_size(ids) + 1) * sizeof *j->stop_ids)))
            return fail(e, 500, NULL, NULL, "out of memory");
        for (size_t i = 0; i < json_array_size(ids); i++) {
            json_t *x = json_array_get(ids, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= kvlm_vocab_size(s->model))
                return fail(e, 400, "stop_token_ids", "invalid_value", "'stop_token_ids' must hold token ids below %d",
                            kvlm_vocab_size(s->model));
            j->stop_ids[j->n_stop_ids++] = (int32_t)json_integer_value(x);
        }
        sp->stop_ids = j->stop_ids;
        sp->n_stop_ids = j->n_stop_ids;
    }
    j->prompt_lp = -1;
    if (!get_int(body, "prompt_logprobs", 0, KVLM_MAX_LOGPROBS, &j->prompt_lp, NULL, e)) return false;
    if (j->prompt_lp >= 0 || (j->echo && !j->chat && j->logprobs >= 0)) { /* echo shows the prompt's logprobs too */
        rp->prompt_logprobs = true;
        rp->prompt_top_logprobs = j->prompt_lp > j->logprobs ? j->prompt_lp : j->logprobs > 0 ? j->logprobs : 0;
    }
    json_t *br = json_object_get(body, "dry_sequence_breakers");
    if (br && !json_is_null(br)) {
        enum { MAX_BREAKERS = 64 };
        bool ok = json_is_array(br) && json_array_size(br) > 0 && json_array_size(br) <= MAX_BREAKERS;
        for (size_t i = 0; ok && i < json_array_size(br); i++) ok = json_is_string(json_array_get(br, i));
        if (!ok)
            return fail(e, 400, "dry_sequence_breakers", "invalid_type",
                        "'dry_sequence_breakers' must be a non-empty array of at most %d strings", MAX_BREAKERS);
        if (!(j->breakers = malloc(json_array_size(br) * sizeof *j->breakers))) return fail(e, 500, NULL, NULL, "out of memory");
        for (size_t i = 0; i < json_array_size(br); i++) j->breakers[i] = json_string_value(json_array_get(br, i));
        j->n_breakers = (int)json_array_size(br); /* they point into the body, which outlives the submission */
        sp->dry_sequence_breakers = j->breakers;
        sp->n_dry_sequence_breakers = j->n_breakers;
    }
    json_t *smp = json_object_get(body, "samplers"); /* llama-server's: names, or letters in one string */
    if (smp && !json_is_null(smp)) {
        bool ok = json_is_string(smp) || json_is_array(smp);
        int n = json_is_string(smp) ? (int)json_string_length(smp) : (int)json_array_size(smp);
        if (ok && n > KVLM_MAX_STAGES)
            return fail(e, 400, "samplers", "invalid_value", "'samplers' names at most %d stages", KVLM_MAX_STAGES);
        for (int i = 0; ok && i < n; i++) {
            json_t *x = json_is_array(smp) ? json_array_get(smp, (size_t)i) : NULL;
            int st = x ? (json_is_string(x) ? kvlm_sampler_stage_from_name(json_string_value(x)) : 0)
                       : kvlm_sampler_stage_from_char(json_string_value(smp)[i]);
            if (!st)
                return fail(e, 400, "samplers", "invalid_value", "'samplers' entry %d is not a stage (penalties, dry, top_k, "
                            "typ_p, top_p, min_p, xtc, temperature; or their letters e d k y p m x t)", i);
            sp->stages[sp->n_stages++] = st;
        }
        if (!ok) return fail(e, 400, "samplers", "invalid_type", "'samplers' must be an array of names or a string of letters");
    }
    kvlm_error se = {0};
    int which, f = kvlm_sampler_params_check(sp, kvlm_vocab_size(s->model), &which, &se);
    if (f) {
        static const char *const names[] = {
            [KVLM_SAMPLER_REPEAT_PENALTY] = "repeat_penalty", [KVLM_SAMPLER_REPEAT_LAST_N] = "repeat_last_n",
            [KVLM_SAMPLER_REPETITION_PENALTY] = "repetition_penalty", [KVLM_SAMPLER_TYPICAL_P] = "typical_p",
            [KVLM_SAMPLER_DRY_MULTIPLIER] = "dry_multiplier", [KVLM_SAMPLER_DRY_BASE] = "dry_base",
            [KVLM_SAMPLER_DRY_ALLOWED_LENGTH] = "dry_allowed_length", [KVLM_SAMPLER_DRY_PENALTY_LAST_N] = "dry_penalty_last_n",
            [KVLM_SAMPLER_XTC_PROBABILITY] = "xtc_probability", [KVLM_SAMPLER_XTC_THRESHOLD] = "xtc_threshold",
            [KVLM_SAMPLER_MIN_TOKENS] = "min_tokens", [KVLM_SAMPLER_STAGES] = "samplers",
            [KVLM_SAMPLER_STOP_ID] = "stop_token_ids"};
        const char *name = f < (int)(sizeof names / sizeof names[0]) && names[f] ? names[f] : "sampling";
        return fail(e, 400, name, "invalid_value", "'%s' %s", name, se.msg);
    }
    json_t *md = json_object_get(body, "metadata"); /* OpenAI's: kept by nothing here, checked for shape */
    if (md && !json_is_null(md) && !json_is_object(md))
        return fail(e, 400, "metadata", "invalid_type", "'metadata' must be an object");
    json_t *sfx = json_object_get(body, "suffix");
    if (sfx && !json_is_null(sfx)) {
        if (!json_is_string(sfx)) return fail(e, 400, "suffix", "invalid_type", "'suffix' must be a string");
        if (json_string_length(sfx)) {
            if (j->chat) return fail(e, 400, "suffix", "invalid_value", "'suffix' is for /v1/completions");
            for (int k = KVLM_FIM_PRE; k <= KVLM_FIM_MID; k++)
                if (kvlm_token_fim(s->model, k) < 0)
                    return fail(e, 400, "suffix", "unsupported_value", "'suffix' needs a model with fill-in-the-middle "
                                "tokens (GGUF tokenizer.ggml.fim_pre_token_id, fim_suf_token_id, fim_mid_token_id, or "
                                "tokens such as <|fim_prefix|>); %s has none", s->model_id);
            j->fim = true;
        }
    }
    if (j->echo && j->chat) { /* vLLM's: the last message, when it is the assistant's, begins the answer */
        json_t *msgs = json_object_get(body, "messages"), *last = json_array_get(msgs, json_array_size(msgs) - 1);
        json_t *role = json_object_get(last, "role"), *content = json_object_get(last, "content");
        if (json_is_string(role) && !strcmp(json_string_value(role), "assistant") && json_is_string(content) &&
            !(j->echo_text = strdup(json_string_value(content))))
            return fail(e, 500, NULL, NULL, "out of memory");
    }
    return true;
}

/* Text as a prompt's tokens (BOS where the model adds one; special: special tokens recognised), or NULL (e filled). */
static int32_t *tokenize_text(kvlm_server *s, const char *text, size_t len, bool bos, bool special, int *n_out, perr *e) {
    kvlm_error err = {0};
    int n = kvlm_tokenize(s->model, text, len, bos, special, NULL, 0, &err);
    if (n < 0) { fail(e, 400, "prompt", "invalid_value", "%s", err.msg); return NULL; }
    int32_t *t = malloc((size_t)(n ? n : 1) * sizeof *t);
    if (!t) { fail(e, 500, NULL, NULL, "out of memory"); return NULL; }
    kvlm_tokenize(s->model, text, len, bos, special, t, n, &err);
    *n_out = n;
    return t;
}

/* One completions prompt: text, or token ids; with a suffix, the
 * fill-in-the-middle prompt [BOS] PRE text SUF suffix MID (llama.cpp's
 * order). Appended to *all; its echo text kept in sb. */
static bool one_prompt(kvlm_server *s, json_t *p, json_t *sfx, srv_job *j, srv_sub *sb, int32_t **all, int *n_all,
                       int *cap, perr *e) {
    const kvlm_model *m = s->model;
    int32_t *t = NULL;
    int n = 0;
    if (json_is_string(p) && j->fim) {
        int np = 0, ns = 0;
        int32_t *pre = tokenize_text(s, json_string_value(p), json_string_length(p), false, false, &np, e);
        int32_t *suf = pre ? tokenize_text(s, json_string_value(sfx), json_string_length(sfx), false, false, &ns, e) : NULL;
        if (suf && (t = malloc((size_t)(np + ns + 4) * sizeof *t))) {
            if (kvlm_add_bos(m) && kvlm_token_bos(m) >= 0) t[n++] = kvlm_token_bos(m);
            t[n++] = kvlm_token_fim(m, KVLM_FIM_PRE);
            memcpy(t + n, pre, (size_t)np * sizeof *t), n += np;
            t[n++] = kvlm_token_fim(m, KVLM_FIM_SUF);
            memcpy(t + n, suf, (size_t)ns * sizeof *t), n += ns;
            t[n++] = kvlm_token_fim(m, KVLM_FIM_MID);
        } else if (suf) fail(e, 500, NULL, NULL, "out of memory");
        free(pre);
        free(suf);
        if (!t) return false;
    } else if (json_is_string(p)) {
        if (!(t = tokenize_text(s, json_string_value(p), json_string_length(p), kvlm_add_bos(m), false, &n, e))) return false;
        if (!n) {
            free(t);
            return fail(e, 400, "prompt", "invalid_value", "the prompt is empty and the model has no BOS token");
        }
    } else if (json_is_array(p) && json_array_size(p) > 0 && !j->fim) {
        n = (int)json_array_size(p);
        if (!(t = malloc((size_t)n * sizeof *t))) return fail(e, 500, NULL, NULL, "out of memory");
        for (int i = 0; i < n; i++) {
            json_t *x = json_array_get(p, (size_t)i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= kvlm_vocab_size(m)) {
                free(t);
                return fail(e, 400, "prompt", "invalid_value", "'prompt' token ids must be below %d", kvlm_vocab_size(m));
            }
            t[i] = (int32_t)json_integer_value(x);
        }
    } else {
        return fail(e, 400, "prompt", "invalid_type", j->fim ? "with 'suffix', 'prompt' must be a string or an array of strings"
                    : "'prompt' must be a string, token ids, or an array of strings or of token id arrays");
    }
    if (j->echo) { /* the prompt's text, as the answer begins with it */
        if (json_is_string(p) && !j->fim) sb->echo = strdup(json_string_value(p));
        else if (json_is_string(p)) sb->echo = strdup(json_string_value(p));
        else {
            kvlm_detok dt;
            kvlm_detok_init(&dt, m);
            char *b = NULL, piece[256];
            size_t len = 0, bcap = 0;
            srv_append(&b, &len, &bcap, "", 0);
            for (int i = 0; i < n; i++) {
                int k = kvlm_detok_push(&dt, t[i], piece, sizeof piece);
                srv_append(&b, &len, &bcap, piece, (size_t)(k > 0 ? k : 0));
            }
            sb->echo = b;
        }
    }
    if (*n_all + n > *cap) {
        int nc = (*n_all + n) * 2;
        int32_t *a = realloc(*all, (size_t)nc * sizeof *a);
        if (!a) { free(t); return fail(e, 500, NULL, NULL, "out of memory"); }
        *all = a;
        *cap = nc;
    }
    memcpy(*all + *n_all, t, (size_t)n * sizeof *t);
    *n_all += n;
    sb->n_prompt = n;
    free(t);
    return true;
}

/* Completions' prompt: a string, token ids, or an array of strings or of
 * token id arrays (up to MAX_PROMPTS: each gets n choices). */
static int32_t *completion_prompts(kvlm_server *s, json_t *body, srv_job *j, int *n_out, perr *e) {
    json_t *p = json_object_get(body, "prompt"), *sfx = json_object_get(body, "suffix");
    if (!p) { fail(e, 400, "prompt", "missing_required_parameter", "'prompt' is required"); return NULL; }
    size_t n = 1;
    bool list = json_is_array(p) && json_array_size(p) > 0 && !json_is_integer(json_array_get(p, 0));
    if (list) {
        n = json_array_size(p);
        if (n > MAX_PROMPTS) {
            fail(e, 400, "prompt", "invalid_value", "'prompt' holds %zu prompts; at most %d are taken", n, MAX_PROMPTS);
            return NULL;
        }
    }
    if (!(j->subs = calloc(n, sizeof *j->subs))) { fail(e, 500, NULL, NULL, "out of memory"); return NULL; }
    j->n_subs = (int)n;
    int32_t *all = NULL;
    int n_all = 0, cap = 0;
    for (size_t i = 0; i < n; i++)
        if (!one_prompt(s, list ? json_array_get(p, i) : p, sfx, j, &j->subs[i], &all, &n_all, &cap, e)) {
            free(all);
            return NULL;
        }
    *n_out = n_all;
    return all;
}

/* A choice before its first token: its prompt's last token (the text
 * continues it), what it echoes, and with echo and logprobs the prompt's
 * first token's entry (it has no logprob). */
static void choice_init(kvlm_server *s, srv_job *j, srv_choice *c, int sub, const int32_t *toks, int n) {
    kvlm_detok_init(&c->dt, s->model);
    c->dt.prev = toks[n - 1];
    c->dt.special = !j->skip_special;
    if (j->chat && s->chat && !strcmp(j->family, "jinja") && !j->echo) {
        /* the answer read as the template's family writes it: reasoning, content, calls
         * (special tokens' texts are part of what is read) */
        kvlm_error err = {0};
        uint64_t seed = j->id_seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(c - j->ch + 1));
        c->rd = kvlm_chat_reader_new(s->chat, j->ptail, strlen(j->ptail), j->calls ? j->tools_json : NULL, seed, &err);
        if (c->rd) c->dt.special = true;
    }
    c->lp = json_array();
    c->sub = sub;
    const char *echo = j->echo ? (j->chat ? j->echo_text : j->subs[sub].echo) : NULL;
    srv_ctext_start(&c->t, echo, echo ? strlen(echo) : 0);
    if (j->echo && !j->chat && j->logprobs >= 0) {
        kvlm_sched_event ev = {.token = toks[0]};
        json_t *e = lp_entry(s->model, &ev);
        json_object_set_new(e, "logprob", json_null());
        json_object_set_new(e, "top_logprobs", json_null());
        json_array_append_new(c->lp, e);
    }
}

/* Submits each prompt, holding the job's lock (their events wait until the
 * ids are set); returns how many were. */
static int submit_prompts(kvlm_server *s, srv_job *j, kvlm_request_params *rp, const int32_t *toks, kvlm_error *err) {
    int done = 0;
    pthread_mutex_lock(&j->mu);
    rp->n = j->n_per;
    for (int i = 0, off = 0; i < j->n_subs; off += j->subs[i++].n_prompt) {
        pthread_mutex_lock(&s->mu);
        uint64_t id = s->sched ? kvlm_sched_submit(s->sched, toks + off, j->subs[i].n_prompt, rp, on_event, &j->subs[i], err)
                               : 0;
        if (!s->sched) snprintf(err->msg, sizeof err->msg, "the server is shutting down");
        pthread_mutex_unlock(&s->mu);
        if (!id) break;
        j->subs[i].id = id;
        srv_ids_put(s, id, j->idstr);
        if (!done++) {
            j->id = id;
            j->refs++; /* the engine's, until every choice has ended */
        }
    }
    if (done && done < j->n_subs) j->n_ended += (j->n_subs - done) * j->n_per; /* never to end: counted now */
    j->log_me = done > 0;
    pthread_mutex_unlock(&j->mu);
    return done;
}

/* A prompt token's log-probability (under j->mu): vLLM's prompt_logprobs
 * entry, and with echo and logprobs an entry of each of the prompt's choices. */
static void prompt_event(srv_job *j, srv_sub *sub, const kvlm_sched_event *ev) {
    const kvlm_model *m = j->srv->model;
    if (j->prompt_lp >= 0 && sub->plp) {
        json_t *o = json_object();
        char key[16], text[256];
        int tn = kvlm_token_to_text(m, ev->token, text, sizeof text);
        snprintf(key, sizeof key, "%d", ev->token);
        json_object_set_new(o, key, json_pack("{s:f, s:i, s:o}", "logprob", (double)ev->logprob, "rank", ev->rank,
                                              "decoded_token", jstr(text, tn > 0 ? (size_t)tn : 0)));
        for (int k = 0; k < ev->n_top && k < j->prompt_lp; k++) {
            snprintf(key, sizeof key, "%d", ev->top_tokens[k]);
            if (json_object_get(o, key)) continue;
            tn = kvlm_token_to_text(m, ev->top_tokens[k], text, sizeof text);
            json_object_set_new(o, key, json_pack("{s:f, s:i, s:o}", "logprob", (double)ev->top_logprobs[k], "rank", k + 1,
                                                  "decoded_token", jstr(text, tn > 0 ? (size_t)tn : 0)));
        }
        json_array_append_new(sub->plp, o);
    }
    if (j->echo && !j->chat && j->logprobs >= 0) {
        kvlm_sched_event e = *ev;
        if (e.n_top > j->logprobs) e.n_top = j->logprobs;
        for (int k = sub->base; k < sub->base + j->n_per; k++) json_array_append_new(j->ch[k].lp, lp_entry(m, &e));
    }
}

/* The request's last choice ended (engine thread, under j->mu): its figures for /metrics. */
static void request_done(srv_job *j) {
    kvlm_server *s = j->srv;
    double now = util_now_s(), queue = j->subs ? j->subs[0].queue : 0, admit = j->t_submit + queue;
    int prompt = 0, most = 0;
    for (int i = 0; i < j->n_subs; i++) prompt += j->subs[i].prompt_tokens;
    for (int i = 0; i < j->n; i++) most = j->ch[i].n_tokens > most ? j->ch[i].n_tokens : most;
    srv_req_obs o = {.e2e = now - j->t_submit, .queue = queue, .ttft = j->t_first > 0 ? j->t_first - j->t_submit : -1,
                     .prefill = j->t_first > 0 ? j->t_first - admit : -1,
                     .decode = j->t_first > 0 ? j->t_last - j->t_first : -1,
                     .inference = (j->t_first > 0 ? j->t_last : now) - admit,
                     .tpot = most >= 2 ? (j->t_last - j->t_first) / (most - 1) : -1, .prompt_tokens = prompt,
                     .generation_tokens = j->completion_tokens, .max_generation_tokens = most, .n = j->n_per,
                     .max_tokens = j->max_tokens};
    if (queue <= 0 && j->t_first <= 0) o.queue = o.inference = o.prefill = -1; /* never admitted */
    srv_metrics_request(s, &o);
    j->t_end = now;
    for (int i = 0; i < j->n_subs; i++)
        if (j->subs[i].id) srv_ids_drop(s, j->subs[i].id);
}

/* The request's line in the log, when the job goes (its answer sent). */
static void log_job(srv_job *j) {
    int prompt = 0, cached = 0;
    for (int i = 0; i < j->n_subs; i++) prompt += j->subs[i].prompt_tokens, cached += j->subs[i].cached_tokens;
    int f = j->n ? j->ch[0].finish : 0, most = 0;
    for (int i = 0; i < j->n; i++) most = j->ch[i].n_tokens > most ? j->ch[i].n_tokens : most;
    double end = j->t_end > 0 ? j->t_end : util_now_s();
    srv_reqlog r = {.id = j->idstr, .sched_id = j->id, .method = "POST",
                    .endpoint = j->chat ? "/v1/chat/completions" : "/v1/completions", .client = j->client,
                    .status = j->status, .prompt_tokens = prompt, .cached_tokens = cached,
                    .generated_tokens = j->completion_tokens, .n = j->n, .e2e = end - j->t_submit,
                    .ttft = j->t_first > 0 ? j->t_first - j->t_submit : -1,
                    .tpot = most >= 2 ? (j->t_last - j->t_first) / (most - 1) : -1, /* the longest choice's pace */
                    .queue = j->subs && j->subs[0].queue > 0 ? j->subs[0].queue : -1,
                    .finish = f == KVLM_FINISH_CANCELLED ? "cancelled" : finish_name(f),
                    .error = j->error[0] ? j->error : NULL};
    srv_log_request(j->srv, &r);
}

enum MHD_Result srv_completions(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn, bool chat) {
    enum MHD_Result ret;
    json_t *body = load_body(s, c, cn, &ret);
    if (!body) return ret;
    srv_job *j = calloc(1, sizeof *j);
    perr e = {0};
    int32_t *toks = NULL;
    int n_toks = 0;
    if (!j) { json_decref(body); return MHD_NO; }
    pthread_mutex_init(&j->mu, NULL);
    j->refs = 1;
    j->srv = s;
    j->conn = c;
    j->chat = chat;
    j->created = (long)time(NULL);
    j->t_submit = j->t_out = util_now_s();
    j->family = "plain";
    kvlm_request_params rp;
    if (!check_request(s, body, j, &rp, &toks, &n_toks, &e)) goto bad;
    j->n_per = j->n;
    j->n = j->n_subs * j->n_per; /* prompt i's choice k is choice i * n + k, as OpenAI numbers them */
    if (!(j->ch = calloc((size_t)j->n, sizeof *j->ch))) { fail(&e, 500, NULL, NULL, "out of memory"); goto bad; }
    if (chat && s->answers && j->n_subs == 1 && !j->echo) { /* its answers are kept with the prompt they follow
                                                            * (server/answers.c) */
        j->record = true;
        j->prompt_key = srv_answers_prompt_key(s->answers, toks, n_toks);
        j->prompt_last = toks[n_toks - 1];
    }
    for (int i = 0, off = 0; i < j->n_subs; off += j->subs[i++].n_prompt) {
        srv_sub *sb = &j->subs[i];
        sb->j = j;
        sb->base = i * j->n_per;
        if (j->prompt_lp >= 0) sb->plp = json_pack("[n]"); /* the first token has no logprob */
        for (int k = sb->base; k < sb->base + j->n_per; k++)
            choice_init(s, j, &j->ch[k], i, toks + off, sb->n_prompt);
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->fd = ci ? ci->connect_fd : -1;
    j->sock = srv_conn_sock(c);
    j->http11 = cn->http11;
    snprintf(j->client, sizeof j->client, "%s", cn->client);
    srv_random_id(chat ? "chatcmpl-" : "cmpl-", j->idstr, sizeof j->idstr);
    /* Submit holding the job's lock: its events wait until the ids are set. */
    kvlm_error err = {0};
    int submitted = submit_prompts(s, j, &rp, toks, &err);
    if (submitted < j->n_subs) {
        fail(&e, err.code == KVLM_EINVAL || err.code == KVLM_ERANGE ? 400 : 503,
             err.code == KVLM_EINVAL ? "n" : "prompt", err.code == KVLM_ERANGE ? "context_length_exceeded" : NULL, "%s",
             err.msg);
        if (submitted) { /* the others' choices end as cancelled; the job answers nothing */
            srv_job_cancel(j);
            j->log_me = false;
        }
        goto bad;
    }
    cn->job_logs = true;
    free(toks);
    json_decref(body);
    srv_answers_count(s->answers, j->reused, j->reused_tokens);
    srv_watch(s, cn, j);
    if (j->stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, srv_stream_reader, j, srv_stream_done);
        if (!r) { srv_job_cancel(j); srv_job_release(j); return MHD_NO; }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        srv_cors(c, r);
        j->status = 200;
        ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    cn->job = j;
    pthread_mutex_lock(&j->mu);
    bool complete = j->complete;
    if (!complete) { /* answered when the engine resumes the connection (srv_answer) */
        j->suspended = true;
        MHD_suspend_connection(c);
    }
    pthread_mutex_unlock(&j->mu);
    return complete ? srv_answer(s, c, cn) : MHD_YES;
bad:
    free(toks);
    /* e.param may name a key of the body: answer before freeing it */
    ret = srv_error(c, s, e.status, e.param, e.code, "%s", e.msg);
    json_decref(body);
    srv_job_release(j);
    return ret;
}

enum MHD_Result srv_answer(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn) {
    srv_job *j = cn->job;
    cn->job = NULL;
    cn->answered = true;
    enum MHD_Result ret;
    pthread_mutex_lock(&j->mu);
    bool ka = j->ka_body;
    pthread_mutex_unlock(&j->mu);
    if (ka) { /* silent past the keep-alive interval: a chunked 200 whose body begins with whitespace, still
               * watched (hang-ups, more keep-alive bytes) as a stream is; the job's reference goes to it */
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, srv_stream_reader, j, srv_stream_done);
        if (!r) { srv_job_cancel(j); srv_job_release(j); return MHD_NO; }
        MHD_add_response_header(r, "Content-Type", "application/json");
        srv_cors(c, r);
        j->status = 200;
        ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    srv_unwatch(s, cn); /* no probe may be written from here on */
    bool cancelled = false; /* by a hang-up (no one to answer) or by the server stopping */
    for (int i = 0; i < j->n; i++) cancelled |= j->ch[i].finish == KVLM_FINISH_CANCELLED;
    if (j->raw) ret = MHD_NO, j->status = 200; /* answered by the watcher (a half-closed client) */
    else if (cancelled && !srv_client_alive(j->fd)) ret = MHD_NO;
    else if (j->error[0]) ret = srv_error(c, s, 500, NULL, NULL, "%s", j->error), j->status = 500;
    else if (cancelled) ret = srv_error(c, s, 503, NULL, NULL, "the server is shutting down"), j->status = 503;
    else ret = srv_json(c, 200, srv_job_answer(j)), j->status = 200;
    srv_job_release(j);
    return ret;
}

/* ---- POST /v1/embeddings: a job as a completion's whole answer is (server/embeddings.c's request and answer) */

enum MHD_Result srv_embeddings(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn) {
    if (!s->p.embeddings) { /* llama-server's rule and status */
        srv_body_release(s, cn);
        return srv_error(c, s, 501, NULL, "not_supported",
                         "This server does not support embeddings. Start it with `--embeddings`");
    }
    enum MHD_Result ret;
    json_t *body = load_body(s, c, cn, &ret);
    if (!body) return ret;
    srv_embed_err x;
    srv_embed *emb = srv_embed_parse(s, body, &x);
    if (!emb) {
        ret = srv_error(c, s, x.status, x.param, x.code, "%s", x.msg);
        json_decref(body);
        return ret;
    }
    json_decref(body);
    srv_job *j = calloc(1, sizeof *j);
    if (j) j->ch = calloc((size_t)srv_embed_n(emb), sizeof *j->ch);
    if (j) j->subs = calloc(1, sizeof *j->subs); /* one submission: every input is a choice of it */
    if (!j || !j->ch || !j->subs) {
        if (j) free(j->ch), free(j->subs), free(j);
        srv_embed_free(emb);
        return srv_error(c, s, 500, NULL, NULL, "out of memory");
    }
    pthread_mutex_init(&j->mu, NULL);
    j->refs = 1;
    j->srv = s;
    j->conn = c;
    j->emb = emb;
    j->n = j->n_per = srv_embed_n(emb);
    j->n_subs = 1;
    j->subs[0].j = j;
    j->logprobs = -1;
    j->created = (long)time(NULL);
    j->t_submit = j->t_out = util_now_s();
    j->family = "plain";
    for (int i = 0; i < j->n; i++) { /* the finish path flushes each choice's (empty) text */
        kvlm_detok_init(&j->ch[i].dt, s->model);
        srv_ctext_start(&j->ch[i].t, NULL, 0);
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->fd = ci ? ci->connect_fd : -1;
    j->sock = srv_conn_sock(c);
    j->http11 = cn->http11;
    kvlm_error err = {0};
    pthread_mutex_lock(&j->mu); /* its events wait until the id is set */
    pthread_mutex_lock(&s->mu);
    j->id = s->sched ? kvlm_sched_submit_embed(s->sched, srv_embed_tokens(emb), srv_embed_lens(emb), j->n,
                                               srv_embed_params(emb), on_event, &j->subs[0], &err)
                     : 0;
    if (!s->sched) snprintf(err.msg, sizeof err.msg, "the server is shutting down");
    pthread_mutex_unlock(&s->mu);
    j->subs[0].id = j->id;
    if (j->id) j->refs++;
    snprintf(j->idstr, sizeof j->idstr, "embd-%llu", (unsigned long long)j->id);
    pthread_mutex_unlock(&j->mu);
    if (!j->id) {
        ret = srv_error(c, s, err.code == KVLM_EINVAL || err.code == KVLM_ERANGE ? 400 : 503, "input",
                        err.code == KVLM_ERANGE ? "context_length_exceeded" : NULL, "%s", err.msg);
        srv_job_release(j);
        return ret;
    }
    srv_watch(s, cn, j);
    cn->job = j;
    pthread_mutex_lock(&j->mu);
    bool complete = j->complete;
    if (!complete) { /* answered when the engine resumes the connection (srv_answer) */
        j->suspended = true;
        MHD_suspend_connection(c);
    }
    pthread_mutex_unlock(&j->mu);
    return complete ? srv_answer(s, c, cn) : MHD_YES;
}
