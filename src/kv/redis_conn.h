/* kv/redis_conn: one connection to one Redis server, for the Redis tier:
 * TCP or TLS (OpenSSL, under our own I/O), AUTH, SELECT and PING at
 * connect, commands formatted by hiredis into a buffer of its own, and
 * replies parsed by hiredis's reader but refused when larger than what the
 * call can legitimately receive (before anything is allocated or buffered).
 *
 * Sockets are non-blocking; every call waits with poll(2) until an absolute
 * deadline (util_now_s clock) and fails with RCONN_HUNG when it passes.
 * Plain writes use MSG_NOSIGNAL; OpenSSL writes with write(2), so TLS I/O
 * can raise SIGPIPE: callers run it with SIGPIPE blocked (tier_redis.c's
 * pipe_guard, and its threads block every signal).
 *
 * Not thread-safe: one user of a connection at a time. */
#ifndef KVLM_KV_REDIS_CONN_H
#define KVLM_KV_REDIS_CONN_H
#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/uio.h>
#include "kvlm.h"

/* A TLS client configuration (an SSL_CTX): the CA to verify servers against
 * (NULL: the system's store), an optional client certificate and key (key
 * NULL: in the certificate's file). Shared by a tier's connections; freed
 * after them. NULL with err filled when a file cannot be used. */
typedef struct rconn_tls rconn_tls;
rconn_tls *rconn_tls_new(const char *ca, const char *cert, const char *key, kvlm_error *err);
void rconn_tls_free(rconn_tls *t);

/* Why a connection or a call failed. */
typedef enum {
    RCONN_OK = 0,
    RCONN_DOWN,     /* refused, reset, closed, unreachable */
    RCONN_HUNG,     /* the deadline passed */
    RCONN_AUTH,     /* AUTH refused, or the server wants one (NOAUTH) */
    RCONN_DB,       /* SELECT refused */
    RCONN_TLS,      /* TLS handshake or record failure */
    RCONN_PROTOCOL, /* not RESP, or a reply larger than the call allows */
    RCONN_REPLY,    /* the server answered the handshake with an error (LOADING, ...) */
    RCONN_NOMEM,
} rconn_status;

typedef struct {
    const char *host;
    int port;
    int db;               /* SELECT db when > 0 */
    const char *user;     /* AUTH user password; NULL: AUTH password */
    const char *password; /* NULL: no AUTH */
    rconn_tls *tls;       /* NULL: plain TCP */
    size_t read_chunk;    /* bytes asked of the socket at once; 0: 16 KiB */
} rconn_params;

/* What the next replies may hold. Arrays longer than allowed are refused
 * by the reply-object functions, which see the count before anything is
 * allocated; strings and lines longer than max_bulk are refused as soon as
 * their header (or more than max_bulk bytes of them) arrives, never
 * buffered. The zero-copy sinks (rconn_set_sink) check arrays themselves. */
typedef struct {
    size_t max_bulk; /* longest bulk string or status/error line */
    size_t skip_max; /* a bulk string longer than max_bulk, up to this, is read past and given as nil
                        (a block longer than the caller's buffer: a miss); 0: refused */
    int max_elems;   /* elements of a top-level array; 0: no arrays */
    int max_nested;  /* elements of a nested array */
    long max_total;  /* elements in all of one reply */
} rconn_limits;
/* PING, AUTH, SELECT, SET, DEL, EXISTS, DBSIZE, INFO: no arrays, 1 MiB. */
extern const rconn_limits rconn_small;
/* CLUSTER SLOTS: up to 16384 ranges, short strings. */
extern const rconn_limits rconn_slots;

typedef struct rconn rconn;
/* Connects (each address of host in turn), does the TLS handshake, then
 * AUTH / SELECT / PING in one round trip, all before deadline. NULL on
 * failure, with *st and msg (cap bytes, one line; never the password) saying
 * why. */
rconn *rconn_open(const rconn_params *p, double deadline, rconn_status *st, char *msg, size_t cap);
void rconn_free(rconn *c);
int rconn_fd(const rconn *c);
/* poll(2) events the connection waits for now: POLLIN, or POLLOUT while TLS
 * needs to write to read. */
short rconn_events(const rconn *c);
/* TLS holds decrypted bytes not yet read (poll would not see them). */
bool rconn_buffered(const rconn *c);

void rconn_set_limits(rconn *c, const rconn_limits *l);
/* Replies built by fns with priv as privdata instead of redisReply objects
 * (the tier's zero-copy sinks); rconn_clear_sink goes back to redisReply
 * (a half-built reply is the sink's: dropped, never freed by hiredis). */
void rconn_set_sink(rconn *c, redisReplyObjectFunctions *fns, void *priv);
void rconn_clear_sink(rconn *c);

/* Appends a command (hiredis's redisFormatCommandArgv) to the output buffer. */
bool rconn_append(rconn *c, int argc, const char **argv, const size_t *lens);
/* ... of NULL-terminated string arguments, ended by NULL. */
bool rconn_appendv(rconn *c, const char *arg, ...);
/* Writes the output buffer. */
bool rconn_send(rconn *c, double deadline);
/* Writes n buffers as they are (the writer's batch: no copy). */
bool rconn_writev(rconn *c, struct iovec *iov, int n, double deadline);
/* One whole reply (NULL: failed; rconn_error says why). A redisReply, to be
 * freed with freeReplyObject, or what the sink returned. */
void *rconn_recv(rconn *c, double deadline);
/* Without I/O: one reply from what has arrived. 1 *reply set, 0 not whole
 * yet, -1 failed (a protocol error, or a reply over the limits). */
int rconn_parse(rconn *c, void **reply);
/* One read without waiting: > 0 bytes taken in, 0 nothing there yet, -1
 * failed (closed, reset, TLS error). */
int rconn_read_some(rconn *c);
/* Why the last call failed, and a one-line message. */
rconn_status rconn_error(const rconn *c, const char **msg);
/* Marks the connection failed (a deadline its user watched passed), unless
 * it already is: later calls fail. */
void rconn_set_error(rconn *c, rconn_status st, const char *msg);

/* "redis://user:***@host:port/0": url with its password replaced (a
 * password alone, "redis://secret@host", too); url as it is without one. */
void rconn_redact(const char *url, char *out, size_t cap);
#endif
