/* server/openai: POST /v1/completions and /v1/chat/completions: the request
 * checked field by field (OpenAI-style 4xx errors), prompt or chat template
 * tokenized, submitted to the scheduler, and the answer returned whole or
 * streamed as server-sent events; stop strings are found in the text (what
 * could begin one is held back), logprobs, usage, cancel on hang-up, and
 * keep-alive bytes for silent requests (srv_keepalive).
 * One HTTP thread serves every connection: a connection waiting for tokens
 * is suspended and the engine resumes it when there are some. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include "server/server.h"
#include "tok/utf8.h"
#include "util/timing.h"

enum { MAX_STOP = 4 };

typedef struct {
    kvlm_detok dt;
    char *text;
    size_t len, cap, sent; /* the text (a stream's from off on); the part already streamed */
    size_t off;            /* a stream's text before this was sent and dropped */
    int finish, n_tokens;
    bool stopped, started;
    json_t *lp;            /* chat-style logprob entries of every token */
    size_t lp_sent;
} choice;

typedef struct srv_job {
    pthread_mutex_t mu;
    int refs;              /* the connection's (or its streamed response's) and the engine's */
    kvlm_server *srv;
    struct MHD_Connection *conn;
    srv_sock *sock;        /* conn's entry in the server's list, while conn is this job's (under mu) */
    bool suspended;        /* conn waits for the engine (under mu) */
    uint64_t id;
    char idstr[48];
    long created;
    bool chat, stream, include_usage, complete;
    const char *family;
    int n, n_ended, logprobs, fd;
    choice *ch;
    char *stop[MAX_STOP];
    int n_stop;
    size_t max_stop;
    char error[512];
    int prompt_tokens, cached_tokens, completion_tokens;
    double t_submit, t_first, t_last;
    int32_t *bias_ids;     /* logit_bias, for rp->sampling until submitted */
    kvlm_grammar *grammar; /* response_format json_object or json_schema, or grammar (GBNF) */
    float *bias;
    char *out;             /* SSE bytes not yet written */
    size_t out_len, out_cap, out_off;
    size_t counted;        /* out's bytes counted as the connection's unsent answer (srv_unsent_add) */
    bool cut;              /* the stream was reset for that cap: nothing more is written */
    bool http11;           /* an interim 1xx response may be sent */
    bool half_closed;      /* whole answer, the client's sending side ended: the watcher writes it */
    char *raw;             /* ... the answer it writes (HTTP head and JSON body), raw_off sent */
    size_t raw_len, raw_off;
    double t_out;          /* when bytes for the client were last queued (the keep-alive clock) */
    bool ka_body;          /* a whole answer kept alive: its 200 is chunked, whitespace before the JSON */
    bool body_out;         /* ... and the JSON (or the error) is queued after it */
    struct srv_job *wprev, *wnext; /* in the server's watched list (under srv->watch_mu) */
} srv_job;

static void job_release(srv_job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    for (int i = 0; j->ch && i < j->n; i++) {
        free(j->ch[i].text);
        json_decref(j->ch[i].lp);
    }
    for (int i = 0; i < j->n_stop; i++) free(j->stop[i]);
    free(j->ch);
    free(j->out);
    free(j->raw);
    free(j->bias_ids);
    kvlm_grammar_free(j->grammar);
    free(j->bias);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static bool append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
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

/* Valid UTF-8 copy of bytes (invalid ones become U+FFFD), as a JSON string. */
static json_t *jstr(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    char *b = NULL;
    size_t len = 0, cap = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = tok_utf8_decode((const uint8_t *)s + i, n - i, &cp);
        if (k > 0) append(&b, &len, &cap, s + i, (size_t)k), i += (size_t)k;
        else append(&b, &len, &cap, "\xEF\xBF\xBD", 3), i++;
    }
    j = json_stringn(b ? b : "", len);
    free(b);
    return j;
}

static bool utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = tok_utf8_decode((const uint8_t *)s + i, n - i, &cp);
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
static json_t *lp_render(const srv_job *j, const choice *c, size_t from, size_t to, size_t text_off) {
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
        json_array_append_new(tops, top);
        json_array_append_new(offs, json_integer((json_int_t)text_off));
        text_off += strlen(json_string_value(json_object_get(e, "token")));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}

static json_t *envelope(const srv_job *j, const char *object) {
    json_t *o = json_pack("{s:s, s:s, s:I, s:s}", "id", j->idstr, "object", object, "created", (json_int_t)j->created,
                          "model", j->srv->model_id);
    if (j->chat) json_object_set_new(o, "chat_template", json_string(j->family));
    return o;
}

static json_t *usage(const srv_job *j) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", j->prompt_tokens, "completion_tokens",
                     j->completion_tokens, "total_tokens", j->prompt_tokens + j->completion_tokens,
                     "prompt_tokens_details", "cached_tokens", j->cached_tokens);
}

static void sse(srv_job *j, json_t *o) {
    char *s = j->cut ? NULL : json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return;
    append(&j->out, &j->out_len, &j->out_cap, "data: ", 6);
    append(&j->out, &j->out_len, &j->out_cap, s, strlen(s));
    append(&j->out, &j->out_len, &j->out_cap, "\n\n", 2);
    free(s);
    j->t_out = util_now_s();
}

/* Bytes at the end of the text that could begin a stop string. */
static size_t holdback(const srv_job *j, const choice *c) {
    for (size_t k = j->max_stop > 1 ? j->max_stop - 1 : 0; k > 0; k--) {
        if (k > c->len) continue;
        for (int s = 0; s < j->n_stop; s++)
            if (strlen(j->stop[s]) > k && !memcmp(c->text + c->len - k, j->stop[s], k)) return k;
    }
    return 0;
}

/* Streams what of choice c is safe to send (everything when it ended). */
static void emit(srv_job *j, choice *c, bool final) {
    if (!j->stream) return;
    size_t end = final || c->stopped ? c->len : c->len - holdback(j, c);
    size_t n_lp = j->logprobs >= 0 ? json_array_size(c->lp) : 0;
    if (end <= c->sent && n_lp == c->lp_sent && !final && c->started) return;
    int idx = (int)(c - j->ch);
    json_t *o = envelope(j, j->chat ? "chat.completion.chunk" : "text_completion"), *ch;
    json_t *text = jstr(c->text + c->sent, end > c->sent ? end - c->sent : 0);
    if (j->chat) {
        json_t *delta = json_object();
        if (!c->started) json_object_set_new(delta, "role", json_string("assistant"));
        if (end > c->sent || !final) json_object_set_new(delta, "content", text);
        else json_decref(text);
        ch = json_pack("{s:i, s:o}", "index", idx, "delta", delta);
    } else ch = json_pack("{s:i, s:o}", "index", idx, "text", text);
    json_object_set_new(ch, "logprobs", lp_render(j, c, c->lp_sent, n_lp, c->off + c->sent));
    const char *fin = final ? finish_name(c->finish) : NULL;
    json_object_set_new(ch, "finish_reason", fin ? json_string(fin) : json_null());
    json_object_set_new(o, "choices", json_pack("[o]", ch));
    sse(j, o);
    c->started = true;
    c->sent = end > c->sent ? end : c->sent;
    c->lp_sent = n_lp;
    /* a stream keeps what is not sent and what a stop string may still begin
     * in, not the whole text: under eviction a stream has no end */
    if (c->lp_sent) {
        json_array_clear(c->lp);
        c->lp_sent = 0;
    }
    size_t tail = c->len > j->max_stop ? c->len - j->max_stop : 0, drop = c->sent < tail ? c->sent : tail;
    if (drop >= 4096) {
        memmove(c->text, c->text + drop, c->len - drop + 1);
        c->len -= drop;
        c->sent -= drop;
        c->off += drop;
    }
}

static void cancel(srv_job *j);

/* A stream's buffer counted as its connection's unsent answer; one reset
 * for the server's cap (it held the most, or its own cap) is dropped and
 * its request cancelled. Engine thread, j->mu held. */
static void stream_account(srv_job *j) {
    if (j->cut || j->out_cap == j->counted) return;
    long delta = (long)j->out_cap - (long)j->counted;
    j->counted = j->out_cap;
    if (srv_unsent_add(j->srv, j->sock, delta, true)) return;
    srv_unsent_add(j->srv, j->sock, -(long)j->counted, true);
    j->counted = 0;
    j->cut = true;
    free(j->out);
    j->out = NULL;
    j->out_len = j->out_off = j->out_cap = 0;
    cancel(j); /* its choices end as cancelled at the next step */
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

/* The scheduler's callback (engine thread). */
static bool on_event(void *user, const kvlm_sched_event *ev) {
    srv_job *j = user;
    pthread_mutex_lock(&j->mu);
    choice *c = &j->ch[ev->index];
    char piece[256];
    bool go_on = true, last = false;
    j->prompt_tokens = ev->prompt_tokens;
    j->cached_tokens = ev->cached_tokens;
    if (ev->finish) {
        int n = kvlm_detok_flush(&c->dt, piece, sizeof piece);
        if (!c->stopped) append(&c->text, &c->len, &c->cap, piece, (size_t)n);
        c->finish = c->stopped ? KVLM_FINISH_STOP : ev->finish;
        if (c->finish > 0 && c->finish < 6) __atomic_fetch_add(&j->srv->finished[c->finish], 1, __ATOMIC_RELAXED);
        if (ev->finish == KVLM_FINISH_ERROR && !j->error[0])
            snprintf(j->error, sizeof j->error, "%s", ev->error ? ev->error : "the engine failed");
        if (ev->finish != KVLM_FINISH_CANCELLED) emit(j, c, true);
        last = ++j->n_ended == j->n;
        if (last) {
            bool cancelled = false; /* by a hang-up (no one reads this) or by the server stopping */
            for (int i = 0; i < j->n; i++) cancelled |= j->ch[i].finish == KVLM_FINISH_CANCELLED;
            if (j->stream && (j->error[0] || cancelled))
                sse(j, json_pack("{s:{s:s, s:s}}", "error", "message",
                                 j->error[0] ? j->error : "the request was cancelled: the server is stopping", "type",
                                 "server_error"));
            if (j->stream && j->include_usage) {
                json_t *o = envelope(j, j->chat ? "chat.completion.chunk" : "text_completion");
                json_object_set_new(o, "choices", json_array());
                json_object_set_new(o, "usage", usage(j));
                sse(j, o);
            }
            if (j->stream && !j->cut) append(&j->out, &j->out_len, &j->out_cap, "data: [DONE]\n\n", 14);
            j->complete = true;
            if (j->sock) srv_sock_answer_due(j->sock);
            if (j->completion_tokens >= 2 && j->n == 1)
                srv_observe(j->srv, -1, (j->t_last - j->t_first) / (j->completion_tokens - 1));
        }
    } else {
        double now = util_now_s();
        if (j->t_first == 0) {
            j->t_first = now;
            srv_observe(j->srv, now - j->t_submit, -1);
        }
        j->t_last = now;
        j->completion_tokens++;
        c->n_tokens++;
        int n = kvlm_detok_push(&c->dt, ev->token, piece, sizeof piece);
        if (j->logprobs >= 0) json_array_append_new(c->lp, lp_entry(j->srv->model, ev));
        if (!c->stopped) {
            size_t from = c->len > j->max_stop ? c->len - j->max_stop : 0;
            append(&c->text, &c->len, &c->cap, piece, (size_t)n);
            size_t best = c->len;
            for (int s = 0; s < j->n_stop; s++) {
                char *p = memmem(c->text + from, c->len - from, j->stop[s], strlen(j->stop[s]));
                if (p && (size_t)(p - c->text) < best) best = (size_t)(p - c->text);
            }
            if (best < c->len) {
                c->len = best;
                c->text[best] = 0;
                c->stopped = true;
                go_on = false;
            }
        }
        emit(j, c, false);
    }
    if (j->stream) stream_account(j);
    if (j->complete && !j->stream && !j->ka_body && !j->half_closed && !j->srv->tls_key && j->fd >= 0 &&
        !j->error[0]) {
        /* the client may have half-closed since: its hang-up event may not have been handled yet */
        char b;
        if (recv(j->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0) j->half_closed = true;
    }
    if (j->complete && j->half_closed) {
        /* libmicrohttpd would read the end of the client's stream on resuming and close
         * the connection unanswered: the watcher writes the answer, then resumes */
        struct epoll_event we = {.events = EPOLLOUT | EPOLLONESHOT, .data.u64 = j->id};
        if (epoll_ctl(j->srv->watch_fd, EPOLL_CTL_MOD, j->fd, &we)) j->half_closed = false;
    }
    if (j->suspended && !j->half_closed && (j->complete || (j->stream && j->out_len > j->out_off))) {
        j->suspended = false;
        MHD_resume_connection(j->conn);
    }
    pthread_mutex_unlock(&j->mu);
    if (last) job_release(j); /* the engine's reference */
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
    if (j->chat) {
        json_t *msgs = json_object_get(body, "messages");
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
    if (!text) { fail(e, 500, NULL, NULL, "out of memory"); return NULL; }
    bool bos = kvlm_add_bos(m);
    int n = kvlm_tokenize(m, text, strlen(text), bos, j->chat, NULL, 0, &err);
    int32_t *t = n > 0 ? malloc((size_t)n * sizeof *t) : NULL;
    if (t) kvlm_tokenize(m, text, strlen(text), bos, j->chat, t, n, &err);
    free(text);
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

static bool check_fields(json_t *body, bool chat, perr *e) {
    static const char *both[] = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                                 "stream", "stream_options", "logprobs", "stop", "frequency_penalty",
                                 "presence_penalty", "user", "logit_bias", "response_format", "grammar", NULL};
    static const char *chat_only[] = {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                                      "add_generation_prompt", "continue_final_message", "documents", NULL};
    static const char *text_only[] = {"prompt", NULL};
    /* OpenAI's, not implemented here: accepted only when they ask for nothing */
    static const char *unsupported[] = {"tools", "tool_choice", "functions", "function_call", "suffix", "echo", "best_of", "modalities", "audio",
                                        "prediction", "reasoning_effort", "web_search_options", "store",
                                        "metadata", "parallel_tool_calls", "service_tier", NULL};
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v) {
        bool known = false;
        for (const char *const *k = both; *k && !known; k++) known = !strcmp(*k, key);
        for (const char *const *k = chat ? chat_only : text_only; *k && !known; k++) known = !strcmp(*k, key);
        if (known) continue;
        for (const char *const *k = unsupported; *k && !known; k++) known = !strcmp(*k, key);
        if (!known)
            return fail(e, 400, key, "unknown_parameter", "Unrecognized request argument supplied: '%s'", key);
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

static bool parse(kvlm_server *s, json_t *body, srv_job *j, kvlm_request_params *rp, perr *e) {
    if (!check_fields(body, j->chat, e)) return false;
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
        bool ok = json_is_array(one) && json_array_size(one) <= MAX_STOP;
        for (size_t i = 0; ok && i < json_array_size(one); i++) {
            json_t *v = json_array_get(one, i);
            ok = json_is_string(v) && json_string_length(v) > 0 && json_string_length(v) < 256;
            if (ok) {
                j->stop[j->n_stop++] = strdup(json_string_value(v));
                if (json_string_length(v) > j->max_stop) j->max_stop = json_string_length(v);
            }
        }
        json_decref(one);
        if (!ok)
            return fail(e, 400, "stop", "invalid_type", "'stop' must be a string or an array of up to %d non-empty strings",
                        MAX_STOP);
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
    static uint64_t counter;
    json_t *sv = json_object_get(body, "seed");
    rp->sampling.seed = sv && !json_is_null(sv) ? (uint64_t)(int64_t)seed
                        : (uint64_t)time(NULL) * 2654435761u + __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    /* under eviction a completion may run past the context */
    int most = kvlm_ctx_kv_evict(s->ctx) ? 1 << 30 : n_ctx;
    rp->max_tokens = max_tokens > most ? most : (int)max_tokens;
    rp->n = (int)n;
    rp->logprobs = (int)lp;
    j->n = (int)n;
    j->logprobs = (int)lp;
    return true;
}

/* A parsed body (a JSON value) checked and turned into parameters and prompt tokens. */
static bool check_request(kvlm_server *s, json_t *body, srv_job *j, kvlm_request_params *rp, int32_t **toks,
                          int *n_toks, perr *e) {
    if (!json_is_object(body)) return fail(e, 400, NULL, "invalid_type", "the request body must be a JSON object");
    if (!parse(s, body, j, rp, e) || !(*toks = prompt_tokens(s, body, j, n_toks, e))) return false;
    int budget = kvlm_ctx_kv_budget(s->ctx); /* under eviction a longer prompt goes through in pieces */
    if (*n_toks > budget && !kvlm_ctx_kv_evict(s->ctx))
        return fail(e, 400, j->chat ? "messages" : "prompt", "context_length_exceeded",
                    "the prompt is %d tokens; %s holds %d", *n_toks,
                    budget < kvlm_ctx_n_ctx(s->ctx) ? "the KV budget" : "this model's context", budget);
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
    job_release(j);
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
        if (!known) {
            *ret = srv_error(c, s, 400, key, "unknown_parameter", "unknown parameter '%s'", key);
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
    append(&text, &len, &cap, "", 0);
    for (size_t i = 0; i < json_array_size(ids); i++) {
        int k = kvlm_detok_push(&dt, (int32_t)json_integer_value(json_array_get(ids, i)), buf, sizeof buf);
        append(&text, &len, &cap, buf, (size_t)(k > 0 ? k : 0));
    }
    int k = kvlm_detok_flush(&dt, buf, sizeof buf);
    append(&text, &len, &cap, buf, (size_t)(k > 0 ? k : 0));
    json_decref(body);
    if (!text) return srv_error(c, s, 500, NULL, NULL, "out of memory");
    /* vLLM answers "prompt", llama.cpp "content" */
    json_t *o = json_pack("{s:o, s:o}", "prompt", jstr(text, len), "content", jstr(text, len));
    free(text);
    return srv_json(c, 200, o);
}

/* ---- answering --------------------------------------------------------------------- */

static bool client_alive(int fd) {
    if (fd < 0) return true;
    char b;
    ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
}

static void cancel(srv_job *j) {
    kvlm_server *s = j->srv;
    pthread_mutex_lock(&s->mu);
    if (s->sched) kvlm_sched_cancel(s->sched, j->id);
    pthread_mutex_unlock(&s->mu);
}

/* The connection is suspended while its job waits for the engine, and MHD
 * does not watch a suspended socket: the server's watcher thread waits for
 * the client's hang-up on its own epoll set (srv_hangup). The list holds a
 * reference to each watched job. */
static void watch(kvlm_server *s, srv_conn *cn, srv_job *j) {
    if (j->fd < 0) return;
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
    pthread_mutex_lock(&s->watch_mu);
    j->wprev = NULL;
    j->wnext = s->watched;
    if (s->watched) s->watched->wprev = j;
    s->watched = j;
    pthread_mutex_unlock(&s->watch_mu);
    cn->watched = j;
    struct epoll_event ev = {.events = EPOLLRDHUP | EPOLLONESHOT, .data.u64 = j->id};
    if (epoll_ctl(s->watch_fd, EPOLL_CTL_ADD, j->fd, &ev)) fprintf(stderr, "kvlm serve: cannot watch request %llu for a hang-up: %s\n", (unsigned long long)j->id, strerror(errno));
}

static void unwatch(kvlm_server *s, srv_conn *cn) {
    srv_job *j = cn->watched;
    if (!j) return;
    cn->watched = NULL;
    pthread_mutex_lock(&s->watch_mu);
    epoll_ctl(s->watch_fd, EPOLL_CTL_DEL, j->fd, NULL);
    if (j->wprev) j->wprev->wnext = j->wnext;
    else s->watched = j->wnext;
    if (j->wnext) j->wnext->wprev = j->wprev;
    pthread_mutex_unlock(&s->watch_mu);
    job_release(j);
}

/* The end of a client's sending side is not the end of the client: one may
 * shut down its writing half after a whole request and still read the answer
 * (nc -N, scripts using shutdown(SHUT_WR)). The socket cannot tell that from
 * a close without sending something, so the client is probed with bytes that
 * change nothing for a reader: an interim "102 Processing" before a whole
 * answer (HTTP/1.1 allows any number of 1xx responses before the final one),
 * an SSE comment line in a stream. A closed socket answers the probe with a
 * reset (EPOLLHUP / EPOLLERR, or a failed send): the request is cancelled. A
 * half-closed one reads on and gets its answer. An HTTP/1.0 client may not
 * be sent a 1xx: its request runs on (bounded by max_tokens) and is answered;
 * a hang-up shows only when the answer cannot be written. Over TLS nothing
 * can be slipped into the stream, and the end of the sending side counts as
 * a hang-up (TLS clients close, they do not half-close). */
static json_t *whole_answer(srv_job *j);

/* The whole answer of a half-closed request as raw HTTP (under j->mu). */
static bool raw_answer(srv_job *j) {
    json_t *o = whole_answer(j);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!body) return false;
    size_t n = strlen(body);
    char head[192];
    int h = snprintf(head, sizeof head,
                     "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n", n);
    j->raw = malloc((size_t)h + n);
    if (j->raw) {
        memcpy(j->raw, head, (size_t)h);
        memcpy(j->raw + h, body, n);
        j->raw_len = (size_t)h + n;
    }
    free(body);
    return j->raw != NULL;
}

void srv_hangup(kvlm_server *s, uint64_t id, uint32_t events) {
    static const char probe[] = "HTTP/1.1 102 Processing\r\n\r\n";
    bool gone = events & (EPOLLHUP | EPOLLERR), resume = false;
    uint32_t rearm = 0; /* events to watch next (EPOLLHUP and EPOLLERR always are) */
    bool watch_on = false;
    pthread_mutex_lock(&s->watch_mu);
    srv_job *j = s->watched;
    while (j && j->id != id) j = j->wnext;
    if (!j) { /* unwatched since (answered) */
        pthread_mutex_unlock(&s->watch_mu);
        return;
    }
    pthread_mutex_lock(&j->mu);
    if (j->complete && j->half_closed) {
        /* a half-closed client's whole answer: written here, then the connection resumes
         * (libmicrohttpd reads the end of the stream and closes it) */
        bool cancelled = j->error[0] != '\0';
        for (int i = 0; i < j->n; i++) cancelled |= j->ch[i].finish == KVLM_FINISH_CANCELLED;
        resume = true;
        if (!gone && !cancelled && (j->raw || raw_answer(j))) {
            ssize_t w = send(j->fd, j->raw + j->raw_off, j->raw_len - j->raw_off, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (w > 0) j->raw_off += (size_t)w;
            if (j->raw_off < j->raw_len && (w > 0 || errno == EAGAIN || errno == EWOULDBLOCK)) {
                resume = false;
                watch_on = true;
                rearm = EPOLLOUT;
            }
        }
        gone = false; /* complete: nothing left to cancel */
    } else if (!gone && !j->complete) {
        if (j->stream || j->ka_body) { /* a comment line (whitespace before a kept-alive JSON): MHD writes it */
            watch_on = j->stream ? append(&j->out, &j->out_len, &j->out_cap, ":\n\n", 3)
                                 : append(&j->out, &j->out_len, &j->out_cap, "\n", 1);
            if (watch_on && j->suspended) {
                j->suspended = false;
                MHD_resume_connection(j->conn);
            }
        } else if (!s->tls_key) {
            /* listed, so srv_answer has not begun: nothing of the answer is written */
            watch_on = !j->http11 ||
                       send(j->fd, probe, sizeof probe - 1, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)(sizeof probe - 1);
            j->half_closed = watch_on;
        }
        gone = !watch_on;
    }
    if (resume && j->suspended) {
        j->suspended = false;
        MHD_resume_connection(j->conn);
    }
    pthread_mutex_unlock(&j->mu);
    if (watch_on) {
        struct epoll_event ev = {.events = rearm | EPOLLONESHOT, .data.u64 = id};
        if (epoll_ctl(s->watch_fd, EPOLL_CTL_MOD, j->fd, &ev)) gone = true;
    }
    pthread_mutex_unlock(&s->watch_mu);
    if (gone) {
        pthread_mutex_lock(&s->mu);
        if (s->sched) kvlm_sched_cancel(s->sched, id);
        pthread_mutex_unlock(&s->mu);
    }
}

/* Keep-alive bytes, so that a balancer in front (HAProxy's "timeout server")
 * can tell a hung server from a request that is slow to answer: a request
 * silent for keepalive_s seconds (queued, in prefill, between tokens, held
 * back by a stop string) gets, in a stream, an SSE comment line (which the
 * OpenAI SDKs and EventSource skip); before a whole answer, a newline: its 200
 * is then begun as a chunked response whose JSON follows the whitespace
 * (JSON parsers skip leading whitespace). A whole answer ready within the
 * interval is sent as before, with a Content-Length, and a balancer may still
 * send it again elsewhere while nothing of it has been received. The bytes
 * come from this thread, not the engine's, so a long engine step does not
 * hold them back. A half-closed client's whole answer is written by the
 * watcher (srv_hangup) and is not kept alive. */
void srv_keepalive(kvlm_server *s) {
    double k = s->p.keepalive_s, now = util_now_s();
    if (k <= 0) return;
    pthread_mutex_lock(&s->watch_mu);
    for (srv_job *j = s->watched; j; j = j->wnext) {
        pthread_mutex_lock(&j->mu);
        if (!j->complete && !j->half_closed && !j->cut && j->out_len == j->out_off && now - j->t_out >= k) {
            bool ok = j->stream ? append(&j->out, &j->out_len, &j->out_cap, ": keep-alive\n\n", 14)
                                : append(&j->out, &j->out_len, &j->out_cap, "\n", 1);
            if (ok) {
                j->ka_body |= !j->stream;
                j->t_out = now;
                if (j->suspended) { /* the stream's reader, or srv_answer to begin the chunked 200 */
                    j->suspended = false;
                    MHD_resume_connection(j->conn);
                }
            }
        }
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&s->watch_mu);
}

void srv_conn_done(kvlm_server *s, srv_conn *cn) {
    unwatch(s, cn);
    if (cn->job) { /* never answered (the daemon stopping) */
        pthread_mutex_lock(&cn->job->mu);
        cn->job->sock = NULL;
        pthread_mutex_unlock(&cn->job->mu);
        cancel(cn->job);
        job_release(cn->job);
        cn->job = NULL;
    }
}

static json_t *ka_error(kvlm_server *s, const char *code, const char *msg) {
    pthread_mutex_lock(&s->mu);
    s->http_errors++;
    pthread_mutex_unlock(&s->mu);
    return json_pack("{s:{s:s, s:s, s:n, s:o}}", "error", "message", msg, "type", "server_error", "param", "code",
                     code ? json_string(code) : json_null());
}

/* A kept-alive whole answer's last bytes (under j->mu, once complete): its
 * JSON, or, since its 200 has gone out, the error that srv_answer would have
 * sent with a 500 or 503, in the same shape. Counted as the connection's
 * unsent answer, as a whole answer is (send_text_mode); false: the
 * connection was reset for the server's cap. */
static bool ka_body_out(srv_job *j) {
    kvlm_server *s = j->srv;
    bool cancelled = false;
    for (int i = 0; i < j->n; i++) cancelled |= j->ch[i].finish == KVLM_FINISH_CANCELLED;
    json_t *o = j->error[0] || cancelled ? ka_error(s, NULL, j->error[0] ? j->error : "the server is shutting down")
                                         : whole_answer(j);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    size_t n = body ? strlen(body) : 0;
    if (n > s->p.max_unsent) {
        char msg[160];
        snprintf(msg, sizeof msg, "the answer is %zu bytes, more than the server holds for unsent answers (%zu)", n,
                 s->p.max_unsent);
        free(body);
        o = ka_error(s, "answer_too_large", msg);
        body = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        n = body ? strlen(body) : 0;
    }
    j->body_out = true;
    if (!body) return true;
    append(&j->out, &j->out_len, &j->out_cap, body, n);
    free(body);
    long delta = (long)j->out_cap - (long)j->counted; /* as stream_account counts a stream's buffer */
    j->counted = j->out_cap;
    if (srv_unsent_add(s, j->sock, delta, false)) return true;
    srv_unsent_add(s, j->sock, -(long)j->counted, false); /* reset: it held the most */
    j->counted = 0;
    free(j->out);
    j->out = NULL;
    j->out_len = j->out_off = j->out_cap = 0;
    return false;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    srv_job *j = cls;
    pthread_mutex_lock(&j->mu);
    ssize_t n = 0; /* nothing yet: suspended until the engine has some */
    if (j->complete && j->ka_body && !j->body_out && j->out_len == j->out_off && !ka_body_out(j))
        n = MHD_CONTENT_READER_END_WITH_ERROR;
    else if (j->out_len > j->out_off) {
        size_t k = j->out_len - j->out_off < max ? j->out_len - j->out_off : max;
        memcpy(buf, j->out + j->out_off, k);
        j->out_off += k;
        if (j->out_off == j->out_len) { /* drained: the buffer goes, and its count */
            free(j->out);
            j->out = NULL;
            j->out_off = j->out_len = j->out_cap = 0;
            srv_unsent_add(j->srv, j->sock, -(long)j->counted, true);
            j->counted = 0;
        }
        n = (ssize_t)k;
    } else if (j->complete) {
        n = MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        j->suspended = true;
        MHD_suspend_connection(j->conn);
    }
    pthread_mutex_unlock(&j->mu);
    return n;
}

static void stream_done(void *cls) {
    srv_job *j = cls;
    pthread_mutex_lock(&j->mu);
    bool complete = j->complete;
    srv_unsent_add(j->srv, j->sock, -(long)j->counted, true);
    j->counted = 0;
    j->sock = NULL; /* the connection may take its next request */
    pthread_mutex_unlock(&j->mu);
    if (!complete) cancel(j); /* the client went away: free its blocks */
    job_release(j);
}

static json_t *whole_answer(srv_job *j) {
    json_t *o = envelope(j, j->chat ? "chat.completion" : "text_completion"), *choices = json_array();
    for (int i = 0; i < j->n; i++) {
        choice *c = &j->ch[i];
        json_t *ch = j->chat ? json_pack("{s:i, s:{s:s, s:o}}", "index", i, "message", "role", "assistant", "content",
                                         jstr(c->text, c->len))
                             : json_pack("{s:i, s:o}", "index", i, "text", jstr(c->text, c->len));
        json_object_set_new(ch, "logprobs", lp_render(j, c, 0, json_array_size(c->lp), 0));
        json_object_set_new(ch, "finish_reason", json_string(finish_name(c->finish)));
        json_array_append_new(choices, ch);
    }
    json_object_set_new(o, "choices", choices);
    json_object_set_new(o, "usage", usage(j));
    return o;
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
    if (!(j->ch = calloc((size_t)j->n, sizeof *j->ch))) { fail(&e, 500, NULL, NULL, "out of memory"); goto bad; }
    for (int i = 0; i < j->n; i++) {
        kvlm_detok_init(&j->ch[i].dt, s->model);
        j->ch[i].dt.prev = toks[n_toks - 1]; /* the text continues the prompt's */
        j->ch[i].lp = json_array();
        append(&j->ch[i].text, &j->ch[i].len, &j->ch[i].cap, "", 0);
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    j->fd = ci ? ci->connect_fd : -1;
    j->sock = srv_conn_sock(c);
    j->http11 = cn->http11;
    /* Submit holding the job's lock: its events wait until the id is set. */
    kvlm_error err = {0};
    pthread_mutex_lock(&j->mu);
    pthread_mutex_lock(&s->mu);
    j->id = s->sched ? kvlm_sched_submit(s->sched, toks, n_toks, &rp, on_event, j, &err) : 0;
    if (!s->sched) snprintf(err.msg, sizeof err.msg, "the server is shutting down");
    pthread_mutex_unlock(&s->mu);
    if (j->id) j->refs++;
    snprintf(j->idstr, sizeof j->idstr, "%s-%llu", chat ? "chatcmpl" : "cmpl", (unsigned long long)j->id);
    pthread_mutex_unlock(&j->mu);
    if (!j->id) {
        fail(&e, err.code == KVLM_EINVAL || err.code == KVLM_ERANGE ? 400 : 503,
             err.code == KVLM_EINVAL ? "n" : "prompt", err.code == KVLM_ERANGE ? "context_length_exceeded" : NULL, "%s",
             err.msg);
        goto bad;
    }
    free(toks);
    json_decref(body);
    watch(s, cn, j);
    if (j->stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, j, stream_done);
        if (!r) { cancel(j); job_release(j); return MHD_NO; }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        srv_cors(c, r);
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
    job_release(j);
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
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, j, stream_done);
        if (!r) { cancel(j); job_release(j); return MHD_NO; }
        MHD_add_response_header(r, "Content-Type", "application/json");
        srv_cors(c, r);
        ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    unwatch(s, cn); /* no probe may be written from here on */
    bool cancelled = false; /* by a hang-up (no one to answer) or by the server stopping */
    for (int i = 0; i < j->n; i++) cancelled |= j->ch[i].finish == KVLM_FINISH_CANCELLED;
    if (j->raw) ret = MHD_NO; /* answered by the watcher (a half-closed client) */
    else if (cancelled && !client_alive(j->fd)) ret = MHD_NO;
    else if (j->error[0]) ret = srv_error(c, s, 500, NULL, NULL, "%s", j->error);
    else if (cancelled) ret = srv_error(c, s, 503, NULL, NULL, "the server is shutting down");
    else ret = srv_json(c, 200, whole_answer(j));
    job_release(j);
    return ret;
}
