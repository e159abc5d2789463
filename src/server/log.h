/* server/log: what the server says to its operator, through kvlm_log (text
 * lines or JSON objects, --log-format): one line per request, a throughput
 * line while busy; the request fields it ignored (each name once); and the
 * random public ids of requests (cmpl-..., chatcmpl-...) with the scheduler
 * ids they stand for. */
#ifndef KVLM_SERVER_LOG_H
#define KVLM_SERVER_LOG_H
#include "server/server.h"

/* One request's line. Figures < 0 (times) or -1 (counts) are left out. */
typedef struct srv_reqlog {
    const char *id;          /* the public id, or NULL (requests without one) */
    uint64_t sched_id;       /* 0: none */
    const char *method, *endpoint, *client;
    unsigned status;         /* 0: no answer was sent (the client went away) */
    int prompt_tokens, cached_tokens, generated_tokens, n;
    double ttft, tpot, e2e, queue; /* seconds */
    const char *finish;      /* the first choice's finish reason */
    const char *error;       /* the error message sent, if any */
} srv_reqlog;

srv_logs *srv_logs_new(void);
void srv_logs_free(srv_logs *l);
/* Logs r at info (at debug for /health and /metrics, polled by machines). */
void srv_log_request(kvlm_server *s, const srv_reqlog *r);
/* Watcher thread, 4 times a second: the throughput line every
 * p.log_interval_s while the engine has requests or made tokens since the last one. */
void srv_log_tick(kvlm_server *s);
/* The client's address as text ("127.0.0.1", "::1"; "?" if unknown). */
void srv_client_address(struct MHD_Connection *c, char *out, size_t cap);
/* A request field the server does not use was ignored: logged at warn the
 * first time its name is seen (up to 1,024 names). */
void srv_field_ignored(kvlm_server *s, const char *name);
/* prefix + 32 random hex digits (vLLM's shape: "cmpl-" + a UUID's hex). */
void srv_random_id(const char *prefix, char *out, size_t cap);
/* The public id of a scheduler request while it is live (for /kvlm/status). */
void srv_ids_put(kvlm_server *s, uint64_t sched_id, const char *pub);
void srv_ids_drop(kvlm_server *s, uint64_t sched_id);
bool srv_ids_get(kvlm_server *s, uint64_t sched_id, char *out, size_t cap);
#endif
