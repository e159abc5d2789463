/* server/server: what the HTTP side (server.c) and the OpenAI endpoints
 * (openai.c) share: the server, per-connection state, error replies. */
#ifndef KVLM_SERVER_SERVER_H
#define KVLM_SERVER_SERVER_H
#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdbool.h>
#include "kvlm.h"
#include "server/answers.h"

typedef struct srv_metrics srv_metrics; /* metrics.c */
typedef struct srv_logs srv_logs;       /* log.c */
/* The stack of the HTTP thread, which parses every request: sized for the
 * parsers' nesting limits (tests/test_limits measures them at their limits). */
enum { SRV_HTTP_STACK = 8 << 20 };

/* A closed connection whose answer was still in the kernel's send queue: the
 * socket kept open (a dup of MHD's descriptor) until it drains or send_due
 * passes, when it is reset. Closing it would leave the kernel to deliver the
 * rest for as long as the client keeps reading, however slowly. */
typedef struct { int fd; double due; } srv_drain;

struct kvlm_server {
    kvlm_ctx *ctx;
    const kvlm_model *model;
    kvlm_sched *sched;          /* NULL once stopping (under mu) */
    pthread_t engine;
    struct MHD_Daemon *daemon;
    kvlm_server_params p;
    char model_id[256];
    int port;
    double started;
    pthread_mutex_t mu;         /* guards sched's lifetime and the figures below */
    uint64_t http_errors;
    srv_metrics *metrics;       /* histograms of requests (metrics.c) */
    srv_logs *logs;             /* request logs, ignored fields, public ids (log.c) */
    char fingerprint[32];       /* system_fingerprint: this model and configuration */
    uint64_t finished[6];       /* choices ended, by KVLM_FINISH_* (atomic adds) */
    int active;                 /* requests between their first byte and their answer's last (under mu) */
    int watch_fd;               /* epoll set of the sockets whose requests a hang-up cancels */
    int stop_fd;                /* eventfd in that set: the watcher ends */
    pthread_mutex_t watch_mu;   /* guards the list of watched jobs */
    struct srv_job *watched;    /* the jobs in watch_fd, each holding a reference */
    pthread_t watcher;
    /* every open connection, for the header/body deadlines the watcher enforces */
    pthread_mutex_t socks_mu;
    struct srv_sock *socks;
    int n_socks;
    srv_drain *drain;           /* closed connections still delivering (under socks_mu) */
    int n_drain, cap_drain;
    size_t unsent, unsent_cut;  /* answer bytes held unsent, all connections; of them, connections reset (socks_mu) */
    uint64_t answers_cut;       /* connections reset for the cap on unsent answers (socks_mu) */
    size_t body_bytes;          /* request bodies reserved, all connections (under mu) */
    uint64_t bodies_refused;    /* 503s for the cap on them (under mu) */
    size_t trim_held, trim_freed; /* the watcher's: what they held at its last look, freed since its last trim */
    int trim_socks;
    double trim_at;
    char *api_key;              /* NULL: none */
    size_t api_key_len;
    char *tls_key, *tls_cert;   /* PEM text read from the files (NULL: plain HTTP) */
    char **cors;                /* copies of p.cors_origins (p.cors_origins points here) */
    struct srv_kv_events *events; /* --kv-events publisher (NULL: none) */
    const kvlm_chat *chat;      /* renders chat requests (NULL: none could be made: chat_error says why) */
    kvlm_chat *own_chat;        /* the one the server made (freed with it) */
    char chat_error[512];
    srv_answers *answers;       /* the ids of recent chat answers (NULL: not kept) */
};

/* One TCP connection (MHD's socket context), from accept to close: whether it
 * owes a deadline. The watcher shuts down the socket of one that misses it. */
typedef struct srv_sock {
    kvlm_server *srv;
    struct srv_sock *prev, *next; /* s->socks (under socks_mu) */
    int fd;
    double deadline;            /* monotonic seconds; 0: none (a request is being answered) */
    double send_due;            /* its answer, once made, must be delivered by then (bytes in the
                                   kernel's send queue included); 0: no answer pending */
    bool writing;               /* an answer is made and MHD has not handed all of it to the kernel */
    bool kicked;                /* its socket was shut down */
    /* answer bytes it holds unsent (its stream's backlog, or its whole answer), counted in srv->unsent */
    size_t held, whole;
    bool cutoff;                /* reset for the server's cap on them: its bytes are written off */
    unsigned status;            /* the HTTP status of the answer last queued (the request log) */
    char error[200];            /* ... and its error message, if it was one */
} srv_sock;

/* One HTTP request as it arrives. */
typedef struct srv_conn {
    char *body;
    size_t len, cap;
    size_t reserved;          /* of s->body_bytes, for this body (its buffer's size) */
    size_t expect;            /* its Content-Length + 1 (0: none given) */
    bool answered;            /* a response has been queued (e.g. 413 during upload) */
    struct srv_job *job;      /* a whole answer the engine is making (the connection suspended) */
    struct srv_job *watched;  /* its job in the server's hang-up watch (NULL: none) */
    bool http11;              /* the request is HTTP/1.1 (an interim 1xx response may be sent) */
    /* the request log: what the line says; a completion's job writes its own (job_logs) */
    char client[64], method[8], url[160];
    double t_start;
    bool job_logs;
} srv_conn;

/* c's entry in the list (NULL: untracked). */
srv_sock *srv_conn_sock(struct MHD_Connection *c);
/* k's answer is made: it must be delivered within send_timeout_s, or the
 * connection is reset. This stops a client that reads its answer a trickle at
 * a time, which MHD's idle timeout (reset by every write) and the kernel
 * (which delivers a closed socket's queue for as long as the client reads) do not. */
void srv_sock_answer_due(srv_sock *k);

/* One stream may hold a sixteenth of max_unsent (4 MiB by default) unsent:
 * its backlog behind a client that reads slower than the engine writes; past
 * it the stream is reset. */
#define SRV_STREAM_UNSENT_SHARE 16
/* libmicrohttpd's memory per connection (its default): headers, the read buffer */
#define SRV_CONN_MEMORY ((size_t)32 << 10)
/* delta more (or fewer) answer bytes that connection k (NULL: none) holds
 * unsent; stream: a stream's backlog, held to its share. Past the
 * server's max_unsent, the connections holding most are reset (their bytes
 * written off). False when k itself is reset: the caller drops its bytes. */
bool srv_unsent_add(kvlm_server *s, srv_sock *k, long delta, bool stream);
/* The request body is parsed: its buffer and its part of max_body_total go. */
void srv_body_release(kvlm_server *s, srv_conn *cn);

/* Queues an OpenAI-style error: {"error":{"message","type","param","code"}}. */
enum MHD_Result srv_error(struct MHD_Connection *c, kvlm_server *s, unsigned status, const char *param,
                          const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
enum MHD_Result srv_json(struct MHD_Connection *c, unsigned status, json_t *j); /* steals j */
/* An answer of len bytes (copied), counted as the connection's unsent answer until handed over. */
enum MHD_Result srv_text(struct MHD_Connection *c, unsigned status, const char *type, const char *data, size_t len);
/* Adds the CORS headers the request's Origin earns (none unless it is allowed). */
void srv_cors(struct MHD_Connection *c, struct MHD_Response *r);
void srv_observe(kvlm_server *s, double ttft, double tpot); /* < 0: not observed */

/* POST /v1/completions (chat false) and /v1/chat/completions, body complete. */
enum MHD_Result srv_completions(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn, bool chat);
/* POST /tokenize: {"prompt" (or llama.cpp's "content"): TEXT} or {"messages": [...]}
 * tokenized as the completion endpoints would (BOS, the chat template;
 * "add_special_tokens"/"add_special": false gives the text's tokens alone) ->
 * {"count", "max_model_len", "tokens"} (vLLM's; "with_pieces": llama.cpp's
 * [{"id", "piece"}], "return_token_strs": vLLM's "token_strs"). POST
 * /detokenize: {"tokens": [...]} -> {"prompt": TEXT, "content": TEXT}. */
enum MHD_Result srv_tokenize(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn);
enum MHD_Result srv_detokenize(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn);
/* POST /v1/embeddings (docs/embeddings.md), body complete: a job of openai.c
 * (submitted, waited for and answered as a completion's whole answer) whose
 * request and answer are server/embeddings.c's. 501 unless started with
 * embeddings. */
enum MHD_Result srv_embeddings(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn);
/* server/embeddings.c: one request's inputs (tokenized), parameters and vectors. */
typedef struct srv_embed srv_embed;
typedef struct { unsigned status; const char *param, *code; char msg[512]; } srv_embed_err;
/* The body checked (known fields, model, input shapes, encoding_format,
 * dimensions) and its inputs tokenized; NULL with x filled (param may name a
 * key of body: answer before freeing it). */
srv_embed *srv_embed_parse(kvlm_server *s, json_t *body, srv_embed_err *x);
int srv_embed_n(const srv_embed *e);
const int32_t *const *srv_embed_tokens(const srv_embed *e);
const int *srv_embed_lens(const srv_embed *e);
const kvlm_embed_params *srv_embed_params(const srv_embed *e);
/* An input's final event (engine thread, under its job's lock): its vector and tokens kept. */
void srv_embed_event(srv_embed *e, const kvlm_sched_event *ev);
/* OpenAI's answer: {object: "list", data: [...], model, usage}. */
json_t *srv_embed_answer(const srv_embed *e, const char *model_id);
void srv_embed_free(srv_embed *e);
/* The whole answer of cn->job, once the engine has resumed the connection. */
enum MHD_Result srv_answer(kvlm_server *s, struct MHD_Connection *c, srv_conn *cn);
/* For the fuzzing harness (fuzz/fuzz_openai.c): a request body through
 * srv_completions' checks (UTF-8, JSON, parameters, prompt or chat template
 * rendered and tokenized, context) without submitting it. Returns the HTTP
 * status it would get (200: it would be submitted), msg the error; gbnf (if
 * given): the GBNF text of its grammar, malloc'd (NULL: none), as
 * kvlm_grammar_build made it for the request (tests compare kvlm grammar's). */
int srv_parse_request(kvlm_server *s, const char *body, size_t len, bool chat, kvlm_request_params *rp,
                      int *n_tokens, char *msg, size_t cap, char **gbnf);
/* The connection ends: its hold on its job ends. */
void srv_conn_done(kvlm_server *s, srv_conn *cn);
/* The watcher saw events (EPOLLRDHUP, EPOLLHUP, EPOLLERR) on the socket of
 * request id: a full hang-up cancels the request; a read side that ended may
 * be a half-close, so the client is probed first (see openai.c). */
void srv_hangup(kvlm_server *s, uint64_t id, uint32_t events);
/* Watcher thread, 4 times a second: every request silent for p.keepalive_s
 * gets bytes that change nothing (see openai.c), so a balancer's inactivity
 * timeout tells a hung server from a slow answer. */
void srv_keepalive(kvlm_server *s);

#endif
