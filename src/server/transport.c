/* server/transport: the bytes of a request's answer on its socket: SSE
 * events queued for libmicrohttpd's reader, a stream's buffer counted
 * against the server's cap for unsent answers, the hang-up watcher (an epoll
 * set of suspended connections: probes, a half-closed client's answer
 * written raw), keep-alive bytes for silent requests, and the connection
 * resumed when there is something to send. The JSON comes from openai.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include "server/job.h"
#include "util/timing.h"

void srv_sse(srv_job *j, json_t *o) {
    char *s = j->cut ? NULL : json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return;
    srv_append(&j->out, &j->out_len, &j->out_cap, "data: ", 6);
    srv_append(&j->out, &j->out_len, &j->out_cap, s, strlen(s));
    srv_append(&j->out, &j->out_len, &j->out_cap, "\n\n", 2);
    free(s);
    j->t_out = util_now_s();
}

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
    srv_job_cancel(j); /* its choices end as cancelled at the next step */
}

/* After an engine event (engine thread, j->mu held): a stream's buffer
 * counted, a half-closed client's whole answer handed to the watcher, the
 * connection resumed when it has something to send. */
void srv_job_deliver(srv_job *j) {
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
}

bool srv_client_alive(int fd) {
    if (fd < 0) return true;
    char b;
    ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
}

/* The connection is suspended while its job waits for the engine, and MHD
 * does not watch a suspended socket: the server's watcher thread waits for
 * the client's hang-up on its own epoll set (srv_hangup). The list holds a
 * reference to each watched job. */
void srv_watch(kvlm_server *s, srv_conn *cn, srv_job *j) {
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
    if (epoll_ctl(s->watch_fd, EPOLL_CTL_ADD, j->fd, &ev))
        kvlm_log(KVLM_LOG_WARN, "cannot watch request %s for a hang-up: %s", j->idstr, strerror(errno));
}

void srv_unwatch(kvlm_server *s, srv_conn *cn) {
    srv_job *j = cn->watched;
    if (!j) return;
    cn->watched = NULL;
    pthread_mutex_lock(&s->watch_mu);
    epoll_ctl(s->watch_fd, EPOLL_CTL_DEL, j->fd, NULL);
    if (j->wprev) j->wprev->wnext = j->wnext;
    else s->watched = j->wnext;
    if (j->wnext) j->wnext->wprev = j->wprev;
    pthread_mutex_unlock(&s->watch_mu);
    srv_job_release(j);
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
/* The whole answer of a half-closed request as raw HTTP (under j->mu). */
static bool raw_answer(srv_job *j) {
    json_t *o = srv_job_answer(j);
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
            watch_on = j->stream ? srv_append(&j->out, &j->out_len, &j->out_cap, ":\n\n", 3)
                                 : srv_append(&j->out, &j->out_len, &j->out_cap, "\n", 1);
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
    j->refs++; /* held until its prompts are cancelled below: the list's may go once watch_mu is let go */
    pthread_mutex_unlock(&j->mu);
    if (watch_on) {
        struct epoll_event ev = {.events = rearm | EPOLLONESHOT, .data.u64 = id};
        if (epoll_ctl(s->watch_fd, EPOLL_CTL_MOD, j->fd, &ev)) gone = true;
    }
    pthread_mutex_unlock(&s->watch_mu);
    if (gone) srv_job_cancel(j); /* every prompt of it */
    srv_job_release(j);
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
            bool ok = j->stream ? srv_append(&j->out, &j->out_len, &j->out_cap, ": keep-alive\n\n", 14)
                                : srv_append(&j->out, &j->out_len, &j->out_cap, "\n", 1);
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
    srv_unwatch(s, cn);
    if (cn->job) { /* never answered (the daemon stopping) */
        pthread_mutex_lock(&cn->job->mu);
        cn->job->sock = NULL;
        pthread_mutex_unlock(&cn->job->mu);
        srv_job_cancel(cn->job);
        srv_job_release(cn->job);
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
                                         : srv_job_answer(j);
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
    srv_append(&j->out, &j->out_len, &j->out_cap, body, n);
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

ssize_t srv_stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
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

void srv_stream_done(void *cls) {
    srv_job *j = cls;
    pthread_mutex_lock(&j->mu);
    bool complete = j->complete;
    srv_unsent_add(j->srv, j->sock, -(long)j->counted, true);
    j->counted = 0;
    j->sock = NULL; /* the connection may take its next request */
    pthread_mutex_unlock(&j->mu);
    if (!complete) srv_job_cancel(j); /* the client went away: free its blocks */
    srv_job_release(j);
}
