/* kv/redis_conn: one connection to one Redis server (TCP or TLS, AUTH,
 * SELECT, PING, bounded replies) for the Redis tier; see redis_conn.h.
 *
 * hiredis 0.14 has no TLS and its blocking context cannot bound a reply, so
 * the socket is ours: non-blocking, every wait a poll(2) against the
 * caller's deadline, bytes through send/recv or OpenSSL's SSL_write /
 * SSL_read, commands formatted by redisFormatCommandArgv, replies parsed by
 * hiredis's redisReader. Its reply-object functions are hiredis's own
 * (taken once from a reader redisReaderCreate makes) wrapped with the
 * bounds: they see an array's element count and a string's length before
 * anything is allocated. What they cannot see, a bulk string whose bytes
 * are still arriving, is checked here between reads: its header is read as
 * soon as it is buffered, and no more than the bound is ever buffered. */
#include "kv/redis_conn.h"
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "util/error.h"
#include "util/timing.h"

#define RCONN_CHUNK ((size_t)16 << 10)
/* What a bulk string's header and CRLFs add to its bytes, at most. */
#define RCONN_SLACK 64

const rconn_limits rconn_small = {(size_t)1 << 20, 0, 0, 0, 0};
/* AUTH, SELECT and PING answer a status or a short error. */
static const rconn_limits k_handshake = {4096, 0, 0, 0, 0};
/* 16384 ranges at most (one per slot); a range is [lo, hi, master, replicas...]
 * and a node [ip, port, id, metadata]. */
const rconn_limits rconn_slots = {4096, 0, 16384, 256, 1L << 18};

struct rconn_tls {
    SSL_CTX *ctx;
};

struct rconn {
    int fd;
    SSL *ssl;
    bool want_write; /* TLS: the last read needs the socket writable first */
    redisReader *rd;
    rconn_limits lim;
    long total;  /* array elements of the reply being read */
    size_t skip; /* bytes of a bulk string read past (skip_max) still to drop */
    char *obuf;
    size_t olen, ocap;
    unsigned char *chunk;
    size_t chunk_len;
    rconn_status st;
    char msg[256];
    char refused[160]; /* what a reply-object function refused */
};

/* ---- hiredis's reply-object functions, bounded ---- */

static redisReplyObjectFunctions g_default, g_bounded;
static bool g_fns_ok;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void *bounded_string(const redisReadTask *task, char *str, size_t len) {
    rconn *c = task->privdata;
    if (len > c->lim.max_bulk) {
        snprintf(c->refused, sizeof c->refused, "a string of %zu bytes (at most %zu expected)", len, c->lim.max_bulk);
        return NULL;
    }
    return g_default.createString(task, str, len);
}

static void *bounded_array(const redisReadTask *task, int elements) {
    rconn *c = task->privdata;
    int max = task->parent ? c->lim.max_nested : c->lim.max_elems;
    c->total += elements;
    if (elements > max || c->total > c->lim.max_total) {
        snprintf(c->refused, sizeof c->refused, "an array of %d elements (at most %d expected)", elements, max);
        return NULL;
    }
    return g_default.createArray(task, elements);
}

static void fns_init(void) {
    redisReader *r = redisReaderCreate();
    if (!r) return;
    g_default = *r->fn;
    redisReaderFree(r);
    g_bounded = g_default;
    g_bounded.createString = bounded_string;
    g_bounded.createArray = bounded_array;
    g_fns_ok = g_default.createString && g_default.createArray;
}

/* ---- errors ---- */

static bool fail(rconn *c, rconn_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(rconn *c, rconn_status st, const char *fmt, ...) {
    if (c->st) return false; /* the first cause is the one to tell */
    c->st = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg, sizeof c->msg, fmt, ap);
    va_end(ap);
    return false;
}

void rconn_set_error(rconn *c, rconn_status st, const char *msg) { fail(c, st, "%s", msg); }

rconn_status rconn_error(const rconn *c, const char **msg) {
    if (msg) *msg = c->st ? c->msg : "no error";
    return c->st;
}

/* OpenSSL's reason for the last failure in this thread ("certificate verify
 * failed", "tlsv13 alert certificate required"). */
static void ssl_reason(char *out, size_t cap) {
    unsigned long e = ERR_peek_last_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    if (r) snprintf(out, cap, "%s", r);
    else if (e) ERR_error_string_n(e, out, cap);
    else snprintf(out, cap, "no reason given");
    ERR_clear_error();
}

/* A failed SSL_read / SSL_write / SSL_connect (e: SSL_get_error). */
static bool ssl_fail(rconn *c, int e, const char *what) {
    if (e == SSL_ERROR_ZERO_RETURN) return fail(c, RCONN_DOWN, "connection closed by the server (TLS close)");
    if (e == SSL_ERROR_SYSCALL && !ERR_peek_error()) {
        int en = errno;
        ERR_clear_error();
        if (!en) return fail(c, RCONN_DOWN, "connection closed by the server");
        return fail(c, RCONN_DOWN, "%s: %s", what, strerror(en));
    }
    char why[200];
    ssl_reason(why, sizeof why);
    return fail(c, RCONN_TLS, "TLS %s failed: %s", what, why);
}

/* ---- TLS configuration ---- */

rconn_tls *rconn_tls_new(const char *ca, const char *cert, const char *key, kvlm_error *err) {
    rconn_tls *t = calloc(1, sizeof *t);
    if (!t || !(t->ctx = SSL_CTX_new(TLS_client_method()))) {
        free(t);
        util_err_set(err, KVLM_ENOMEM, "redis tier: cannot make a TLS context");
        return NULL;
    }
    char why[200];
    SSL_CTX_set_min_proto_version(t->ctx, TLS1_2_VERSION);
    SSL_CTX_set_verify(t->ctx, SSL_VERIFY_PEER, NULL);
    if (ca ? SSL_CTX_load_verify_locations(t->ctx, ca, NULL) != 1 : SSL_CTX_set_default_verify_paths(t->ctx) != 1) {
        ssl_reason(why, sizeof why);
        util_err_set(err, KVLM_EINVAL, "redis tier: TLS CA %s: %s", ca ? ca : "(the system's store)", why);
        goto fail;
    }
    if (cert) {
        if (SSL_CTX_use_certificate_chain_file(t->ctx, cert) != 1) {
            ssl_reason(why, sizeof why);
            util_err_set(err, KVLM_EINVAL, "redis tier: TLS client certificate %s: %s", cert, why);
            goto fail;
        }
        if (SSL_CTX_use_PrivateKey_file(t->ctx, key ? key : cert, SSL_FILETYPE_PEM) != 1 ||
            SSL_CTX_check_private_key(t->ctx) != 1) {
            ssl_reason(why, sizeof why);
            util_err_set(err, KVLM_EINVAL, "redis tier: TLS client key %s: %s", key ? key : cert, why);
            goto fail;
        }
    } else if (key) {
        util_err_set(err, KVLM_EINVAL, "redis tier: a TLS client key (%s) without its certificate", key);
        goto fail;
    }
    return t;
fail:
    rconn_tls_free(t);
    return NULL;
}

void rconn_tls_free(rconn_tls *t) {
    if (!t) return;
    SSL_CTX_free(t->ctx);
    free(t);
}

/* ---- waiting ---- */

/* Waits for ev on the socket until deadline; false (RCONN_HUNG) when it passes. */
static bool wait_io(rconn *c, short ev, double deadline, const char *what) {
    for (;;) {
        double left = deadline - util_now_s();
        if (left <= 0) return fail(c, RCONN_HUNG, "%s timed out", what);
        struct pollfd p = {c->fd, ev, 0};
        int r = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (r > 0) return true; /* readable, writable, or an error the next call reports */
        if (r < 0 && errno != EINTR) return fail(c, RCONN_DOWN, "poll: %s", strerror(errno));
    }
}

short rconn_events(const rconn *c) { return c->want_write ? POLLOUT : POLLIN; }
bool rconn_buffered(const rconn *c) { return c->ssl && SSL_pending(c->ssl) > 0; }
int rconn_fd(const rconn *c) { return c->fd; }

/* ---- writing ---- */

/* Writes some of p: bytes written, 0 would block (*ev: what to wait for), -1 failed. */
static ssize_t write_some(rconn *c, const void *p, size_t n, short *ev) {
    if (c->ssl) {
        ERR_clear_error();
        int w = SSL_write(c->ssl, p, n > INT_MAX ? INT_MAX : (int)n);
        if (w > 0) return w;
        int e = SSL_get_error(c->ssl, w);
        if (e == SSL_ERROR_WANT_WRITE) { *ev = POLLOUT; return 0; }
        if (e == SSL_ERROR_WANT_READ) { *ev = POLLIN; return 0; }
        ssl_fail(c, e, "write");
        return -1;
    }
    ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
    if (w >= 0) return w;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) { *ev = POLLOUT; return 0; }
    fail(c, RCONN_DOWN, "write: %s", strerror(errno));
    return -1;
}

static bool write_all(rconn *c, const char *p, size_t n, double deadline) {
    while (n > 0) {
        if (util_now_s() > deadline) return fail(c, RCONN_HUNG, "sending timed out");
        short ev = POLLOUT;
        ssize_t w = write_some(c, p, n, &ev);
        if (w < 0) return false;
        if (w == 0 && !wait_io(c, ev, deadline, "sending")) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

bool rconn_append(rconn *c, int argc, const char **argv, const size_t *lens) {
    char *cmd;
    int n = redisFormatCommandArgv(&cmd, argc, argv, lens);
    if (n < 0) return fail(c, RCONN_NOMEM, "out of memory");
    if (c->olen + (size_t)n > c->ocap) {
        size_t cap = c->ocap ? c->ocap : 4096;
        while (cap < c->olen + (size_t)n) cap *= 2;
        char *b = realloc(c->obuf, cap);
        if (!b) {
            redisFreeCommand(cmd);
            return fail(c, RCONN_NOMEM, "out of memory");
        }
        c->obuf = b;
        c->ocap = cap;
    }
    memcpy(c->obuf + c->olen, cmd, (size_t)n);
    c->olen += (size_t)n;
    redisFreeCommand(cmd);
    return true;
}

bool rconn_appendv(rconn *c, const char *arg, ...) {
    const char *argv[8];
    size_t lens[8];
    int n = 0;
    va_list ap;
    va_start(ap, arg);
    for (const char *a = arg; a && n < 8; a = va_arg(ap, const char *)) {
        argv[n] = a;
        lens[n++] = strlen(a);
    }
    va_end(ap);
    return rconn_append(c, n, argv, lens);
}

bool rconn_send(rconn *c, double deadline) {
    bool ok = write_all(c, c->obuf, c->olen, deadline);
    c->olen = 0;
    return ok;
}

bool rconn_writev(rconn *c, struct iovec *iov, int n, double deadline) {
    if (c->ssl) { /* one buffer after another: TLS cuts them into records anyway */
        for (int i = 0; i < n; i++)
            if (!write_all(c, iov[i].iov_base, iov[i].iov_len, deadline)) return false;
        return true;
    }
    while (n > 0) {
        if (util_now_s() > deadline) return fail(c, RCONN_HUNG, "sending timed out");
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)n;
        ssize_t w = sendmsg(c->fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                if (!wait_io(c, POLLOUT, deadline, "sending")) return false;
                continue;
            }
            return fail(c, RCONN_DOWN, "write: %s", strerror(errno));
        }
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return true;
}

/* ---- reading ---- */

void rconn_set_limits(rconn *c, const rconn_limits *l) { c->lim = *l; }

void rconn_set_sink(rconn *c, redisReplyObjectFunctions *fns, void *priv) {
    c->rd->fn = fns;
    c->rd->privdata = priv;
}

void rconn_clear_sink(rconn *c) {
    c->rd->reply = NULL; /* a half-built reply is the sink's */
    c->rd->fn = &g_bounded;
    c->rd->privdata = c;
}

static bool feed(rconn *c, const unsigned char *p, size_t n) {
    if (c->skip) { /* the rest of a bulk string read past */
        size_t d = n < c->skip ? n : c->skip;
        p += d;
        n -= d;
        c->skip -= d;
    }
    if (n && redisReaderFeed(c->rd, (const char *)p, n) != REDIS_OK) return fail(c, RCONN_NOMEM, "out of memory");
    return true;
}

int rconn_read_some(rconn *c) {
    if (c->st) return -1;
    if (c->ssl) { /* records (16 KiB at most each) until the chunk is full or none is there */
        c->want_write = false;
        size_t got = 0;
        while (got < c->chunk_len) {
            ERR_clear_error();
            size_t want = c->chunk_len - got;
            int n = SSL_read(c->ssl, c->chunk + got, want > INT_MAX ? INT_MAX : (int)want);
            if (n > 0) {
                got += (size_t)n;
                continue;
            }
            int e = SSL_get_error(c->ssl, n);
            if (e == SSL_ERROR_WANT_READ) break;
            if (e == SSL_ERROR_WANT_WRITE) { c->want_write = true; break; }
            if (got) break; /* what came before it first; the failure comes again at the next read */
            ssl_fail(c, e, "read");
            return -1;
        }
        return !got ? 0 : feed(c, c->chunk, got) ? (int)got : -1;
    }
    ssize_t n = recv(c->fd, c->chunk, c->chunk_len, 0);
    if (n > 0) return feed(c, c->chunk, (size_t)n) ? (int)n : -1;
    if (n == 0) return fail(c, RCONN_DOWN, "connection closed by the server"), -1;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    return fail(c, RCONN_DOWN, "read: %s", strerror(errno)), -1;
}

/* The declared length of a bulk string at p (n bytes up to its CR), or -1
 * for nil and anything hiredis will refuse itself. */
static long long bulk_len(const char *p, size_t n) {
    if (n == 0 || n > 19 || p[0] == '-') return n > 19 ? (long long)1 << 62 : -1;
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return -1;
        v = v * 10 + (p[i] - '0');
    }
    return v;
}

/* What the reader holds of a reply not yet whole, against the limits:
 * 1 within them, 2 a bulk string read past (parse again), 0 refused. */
static int check_pending(rconn *c) {
    redisReader *rd = c->rd;
    size_t have = rd->len - rd->pos;
    if (rd->ridx >= 0 && rd->rstack[rd->ridx].type == REDIS_REPLY_STRING && have >= 2) {
        /* the type byte is read; what follows is "<len>\r\n<bytes>" */
        const char *p = rd->buf + rd->pos, *cr = memchr(p, '\r', have < 24 ? have : 24);
        if (!cr && have >= 24) { /* no length is that long: endless digits */
            snprintf(c->refused, sizeof c->refused, "a string length of more than 22 characters");
            return 0;
        }
        long long len = cr ? bulk_len(p, (size_t)(cr - p)) : -1;
        if (cr && len > (long long)c->lim.max_bulk) {
            size_t hdr = (size_t)(cr - p) + 2;
            if (len > (long long)c->lim.skip_max) {
                snprintf(c->refused, sizeof c->refused, "a string of %lld bytes (at most %zu expected)", len,
                         c->lim.max_bulk);
                return 0;
            }
            if (hdr <= have && have >= 4) {
                /* read past it: the reader sees a nil where it ends ("-1\r\n"
                 * in the last 4 bytes buffered, the cursor on it), the bytes
                 * still to come are dropped as they arrive */
                c->skip = (size_t)len + 2 - (have - hdr);
                memcpy(rd->buf + rd->len - 4, "-1\r\n", 4);
                rd->pos = rd->len - 4;
                return 2;
            }
        }
    }
    if (have > c->lim.max_bulk + RCONN_SLACK) {
        snprintf(c->refused, sizeof c->refused, "a reply of more than %zu bytes", c->lim.max_bulk + RCONN_SLACK);
        return 0;
    }
    return 1;
}

int rconn_parse(rconn *c, void **reply) {
    *reply = NULL;
    if (c->st) return -1;
    for (;;) {
        redisReader *rd = c->rd;
        if (rd->ridx == -1) c->total = 0; /* a new reply */
        c->refused[0] = 0;
        void *r = NULL;
        if (redisReaderGetReply(rd, &r) != REDIS_OK) {
            if (c->refused[0]) fail(c, RCONN_PROTOCOL, "reply refused: %s", c->refused);
            else if (rd->err == REDIS_ERR_OOM) fail(c, RCONN_PROTOCOL, "reply refused (not the shape asked for)");
            else fail(c, RCONN_PROTOCOL, "not a Redis reply: %s", rd->errstr);
            return -1;
        }
        if (r) {
            *reply = r;
            return 1;
        }
        int k = check_pending(c);
        if (k == 0) {
            fail(c, RCONN_PROTOCOL, "reply refused: %s", c->refused);
            return -1;
        }
        if (k == 1) return 0;
    }
}

void *rconn_recv(rconn *c, double deadline) {
    bool drained = false; /* the last read took all there was: wait before the next */
    for (;;) {
        void *r;
        int st = rconn_parse(c, &r);
        if (st) return st > 0 ? r : NULL;
        /* a server dripping bytes must not hold a caller past its deadline */
        if (util_now_s() > deadline) return fail(c, RCONN_HUNG, "waiting for a reply timed out"), NULL;
        if (drained && !wait_io(c, rconn_events(c), deadline, "waiting for a reply")) return NULL;
        int n = rconn_read_some(c);
        if (n < 0) return NULL;
        if (n == 0 && !wait_io(c, rconn_events(c), deadline, "waiting for a reply")) return NULL;
        /* a plain read short of the chunk emptied the socket (saves a read
         * that would say EAGAIN); TLS reads a record at a time, so read on */
        drained = n > 0 && !c->ssl && (size_t)n < c->chunk_len;
    }
}

/* ---- connecting ---- */

static bool tcp_connect(rconn *c, const rconn_params *p, double deadline) {
    char port[8];
    snprintf(port, sizeof port, "%d", p->port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    /* (a name is resolved by the system's resolver, which the deadline does
     * not bound; numeric addresses and /etc/hosts cost nothing) */
    int g = getaddrinfo(p->host, port, &hints, &res);
    if (g) return fail(c, RCONN_DOWN, "cannot resolve %s: %s", p->host, gai_strerror(g));
    int why = 0;
    bool timed_out = false;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) { why = errno; continue; }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int r = connect(fd, a->ai_addr, a->ai_addrlen);
        if (r != 0 && errno == EINPROGRESS) {
            c->fd = fd;
            if (wait_io(c, POLLOUT, deadline, "connect")) {
                int e = 0;
                socklen_t el = sizeof e;
                r = getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) == 0 && e == 0 ? 0 : -1;
                errno = e;
            } else {
                timed_out = true;
                c->st = RCONN_OK; /* told below, once every address is tried */
                errno = ETIMEDOUT;
            }
            c->fd = -1;
        }
        if (r == 0) {
            c->fd = fd;
            freeaddrinfo(res);
            return true;
        }
        why = errno;
        close(fd);
        if (timed_out) break; /* the deadline is spent */
    }
    freeaddrinfo(res);
    if (timed_out) return fail(c, RCONN_HUNG, "connect timed out");
    return fail(c, RCONN_DOWN, "connect: %s", strerror(why ? why : ECONNREFUSED));
}

static bool is_ip(const char *h) {
    unsigned char buf[sizeof(struct in6_addr)];
    return inet_pton(AF_INET, h, buf) == 1 || inet_pton(AF_INET6, h, buf) == 1;
}

static bool tls_connect(rconn *c, const rconn_params *p, double deadline) {
    if (!(c->ssl = SSL_new(p->tls->ctx))) return fail(c, RCONN_NOMEM, "out of memory (TLS)");
    SSL_set_mode(c->ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (SSL_set_fd(c->ssl, c->fd) != 1) return fail(c, RCONN_NOMEM, "out of memory (TLS)");
    /* the name the certificate must carry: an address (IP SAN), or a host
     * name (DNS SAN or CN), which is also sent as SNI */
    bool ok = is_ip(p->host) ? X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(c->ssl), p->host) == 1
                             : SSL_set_tlsext_host_name(c->ssl, p->host) == 1 && SSL_set1_host(c->ssl, p->host) == 1;
    if (!ok) return fail(c, RCONN_TLS, "TLS: cannot check the certificate against '%s'", p->host);
    for (;;) {
        ERR_clear_error();
        int r = SSL_connect(c->ssl);
        if (r == 1) return true;
        int e = SSL_get_error(c->ssl, r);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
            if (!wait_io(c, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline, "TLS handshake")) {
                /* a plain Redis port reads a ClientHello as a command line and
                 * waits for its end, or answers it (garbage to TLS) when its
                 * random bytes hold a newline: one failure, told as TLS */
                size_t l = strlen(c->msg);
                snprintf(c->msg + l, sizeof c->msg - l, " (a hung server, or not a TLS port?)");
                if (c->st == RCONN_HUNG) c->st = RCONN_TLS;
                return false;
            }
            continue;
        }
        long v = SSL_get_verify_result(c->ssl);
        if (v != X509_V_OK) {
            ERR_clear_error();
            return fail(c, RCONN_TLS, "TLS handshake failed: certificate verify failed (%s)", X509_verify_cert_error_string(v));
        }
        X509 *peer = SSL_get1_peer_certificate(c->ssl);
        bool had_cert = peer != NULL;
        X509_free(peer);
        ssl_fail(c, e, "handshake");
        if (!had_cert && c->st == RCONN_TLS) { /* nothing TLS came back */
            size_t l = strlen(c->msg);
            snprintf(c->msg + l, sizeof c->msg - l, " (no certificate came: not a TLS port?)");
        }
        if (c->st == RCONN_DOWN) c->st = RCONN_TLS; /* closed during the handshake: a TLS failure to tell as one */
        return false;
    }
}

/* Copies a server's error into out, printable bytes only. */
static void err_text(const redisReply *r, char *out, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; r->str && i < r->len && n + 1 < cap; i++)
        out[n++] = r->str[i] >= 32 && r->str[i] < 127 ? r->str[i] : '?';
    out[n] = 0;
}

/* A TLS server closes right after the handshake when it does not take the
 * client's certificate (TLS 1.3 checks it then): its alert, or a reset if
 * that came first. Either is a TLS failure, told as one (always false). */
static bool tls_closed(rconn *c, const rconn_params *p) {
    if (p->tls && c->st == RCONN_DOWN) {
        char m[sizeof c->msg];
        snprintf(m, sizeof m, "%s", c->msg);
        snprintf(c->msg, sizeof c->msg, "TLS session closed by the server: %.150s (a client certificate missing or "
                 "not accepted?)", m);
        c->st = RCONN_TLS;
    }
    return false;
}

/* AUTH, SELECT and PING in one round trip; the first refusal is the one told. */
static bool handshake(rconn *c, const rconn_params *p, double deadline) {
    bool ok = true;
    int n = 0;
    char db[16];
    if (p->password) {
        ok = p->user ? rconn_appendv(c, "AUTH", p->user, p->password, (char *)NULL)
                     : rconn_appendv(c, "AUTH", p->password, (char *)NULL);
        n++;
    }
    if (ok && p->db > 0) {
        snprintf(db, sizeof db, "%d", p->db);
        ok = rconn_appendv(c, "SELECT", db, (char *)NULL);
        n++;
    }
    ok = ok && rconn_appendv(c, "PING", (char *)NULL) && rconn_send(c, deadline);
    n++;
    if (!ok) return tls_closed(c, p);
    rconn_set_limits(c, &k_handshake);
    for (int i = 0; ok && i < n; i++) {
        bool is_auth = p->password && i == 0, is_select = !is_auth && p->db > 0 && i == n - 2;
        redisReply *r = rconn_recv(c, deadline);
        if (!r) {
            if (c->st == RCONN_DOWN && !p->tls) { /* a TLS port closes on plain text */
                size_t l = strlen(c->msg);
                snprintf(c->msg + l, sizeof c->msg - l, " before it answered (a TLS port? use rediss://)");
            }
            return tls_closed(c, p);
        }
        char e[160];
        if (r->type == REDIS_REPLY_ERROR) {
            err_text(r, e, sizeof e);
            if (is_auth) ok = fail(c, RCONN_AUTH, "AUTH failed: %s", e);
            else if (is_select) ok = fail(c, RCONN_DB, "SELECT %d refused: %s", p->db, e);
            else if (!strncmp(e, "NOAUTH", 6))
                ok = fail(c, RCONN_AUTH, "%s (give a password: --kv-redis-password-file, KVLM_REDIS_PASSWORD)", e);
            else ok = fail(c, RCONN_REPLY, "PING answered: %s", e);
        } else if (r->type != REDIS_REPLY_STATUS) {
            ok = fail(c, RCONN_PROTOCOL, "%s answered with a reply of type %d, not a status",
                      is_auth ? "AUTH" : is_select ? "SELECT" : "PING", r->type);
        }
        freeReplyObject(r);
    }
    return ok;
}

rconn *rconn_open(const rconn_params *p, double deadline, rconn_status *st, char *msg, size_t cap) {
    pthread_once(&g_once, fns_init);
    rconn *c = calloc(1, sizeof *c);
    if (!c || !g_fns_ok) {
        free(c);
        *st = RCONN_NOMEM;
        snprintf(msg, cap, "out of memory");
        return NULL;
    }
    c->fd = -1;
    c->lim = rconn_small;
    c->chunk_len = p->read_chunk ? p->read_chunk : RCONN_CHUNK;
    if (!(c->rd = redisReaderCreateWithFunctions(&g_bounded)) || !(c->chunk = malloc(c->chunk_len))) {
        fail(c, RCONN_NOMEM, "out of memory");
        goto fail;
    }
    c->rd->privdata = c;
    /* keep the read buffer between replies (hiredis frees it past 16 KiB
     * and regrows it for every block); the bounds cap what it holds */
    c->rd->maxbuf = 0;
    if (!tcp_connect(c, p, deadline) || (p->tls && !tls_connect(c, p, deadline)) || !handshake(c, p, deadline)) goto fail;
    rconn_set_limits(c, &rconn_small);
    return c;
fail:
    *st = c->st ? c->st : RCONN_NOMEM;
    snprintf(msg, cap, "%s", c->msg);
    rconn_free(c);
    return NULL;
}

void rconn_free(rconn *c) {
    if (!c) return;
    if (c->ssl) SSL_free(c->ssl); /* no close_notify: the socket may be hung or gone */
    if (c->fd >= 0) close(c->fd);
    if (c->rd) {
        if (c->rd->fn != &g_bounded) rconn_clear_sink(c); /* else a half-built redisReply is freed with the reader */
        redisReaderFree(c->rd);
    }
    free(c->obuf);
    free(c->chunk);
    free(c);
}

void rconn_redact(const char *url, char *out, size_t cap) {
    if (!cap) return;
    if (!url) { snprintf(out, cap, "(null)"); return; }
    const char *s = strstr(url, "://");
    s = s ? s + 3 : url;
    const char *at = strrchr(s, '@');
    if (!at) { snprintf(out, cap, "%s", url); return; }
    const char *colon = memchr(s, ':', (size_t)(at - s));
    int keep = (int)((colon ? colon + 1 : s) - url);
    snprintf(out, cap, "%.*s***%s", keep, url, at);
}
