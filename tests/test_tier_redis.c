/* tests/test_tier_redis: the Redis tier against a real redis-server started
 * here on a free loopback port: round trips, MGET's leading count, contains,
 * drop, two tiers sharing a server, stats, and failures (server killed,
 * restarted empty, stopped mid-call, a socket that never answers, bad URLs),
 * with every call timed. Skips (77) without /usr/bin/redis-server. */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>
#include "helpers/testutil.h"
#include "kv/tier.h"
#include "util/timing.h"

/* $KVLM_REDIS_SERVER overrides it (a missing path shows the skip) */
static const char *g_bin = "/usr/bin/redis-server";
#define TIMEOUT_MS 200
/* A call may take its timeout plus this (the test machine is shared and slow). */
#define SLACK_S 0.30

static char g_dir[] = "/tmp/kvlm_redis_XXXXXX";
static int g_port;
static pid_t g_pid = -1;
static char g_url[64];

/* ---- a redis-server of our own ---- */

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &n) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static bool ping_ok(int port) {
    struct timeval tv = {0, 200000};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    bool ok = false;
    if (c && !c->err) {
        redisSetTimeout(c, tv);
        redisReply *r = redisCommand(c, "PING");
        ok = r && r->type == REDIS_REPLY_STATUS && strcmp(r->str, "PONG") == 0;
        if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return ok;
}

static void redis_kill(void) {
    if (g_pid > 0) {
        kill(g_pid, SIGCONT); /* in case a test left it stopped */
        kill(g_pid, SIGKILL);
        waitpid(g_pid, NULL, 0);
        g_pid = -1;
    }
}

/* Starts redis-server on g_port, empty, and waits (at most 10 s) for PONG. */
static void redis_start(void) {
    char port[16], log[sizeof g_dir + 16];
    snprintf(port, sizeof port, "%d", g_port);
    snprintf(log, sizeof log, "%s/redis.log", g_dir);
    pid_t pid = fork();
    if (pid < 0) fail_msg("fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a crashed test */
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); close(fd); }
        execl(g_bin, g_bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
              "--dir", g_dir, "--daemonize", "no", "--loglevel", "warning", (char *)NULL);
        _exit(127);
    }
    g_pid = pid;
    double t0 = util_now_s();
    while (!ping_ok(g_port)) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            g_pid = -1;
            fail_msg("redis-server exited at start (status %d); see %s", st, log);
        }
        if (util_now_s() - t0 > 10) fail_msg("redis-server on port %d did not answer PING within 10 s", g_port);
        usleep(20000);
    }
}

static void cleanup(void) {
    redis_kill();
    char cmd[sizeof g_dir + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
}

static long long redis_int(const char *cmd) {
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", g_port, tv);
    long long v = -1;
    if (c && !c->err) {
        redisReply *r = redisCommand(c, cmd);
        if (r && r->type == REDIS_REPLY_INTEGER) v = r->integer;
        if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return v;
}

/* ---- blocks ---- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static kv_key rand_key(void) {
    kv_key k;
    for (int i = 0; i < 16; i++) k.b[i] = (uint8_t)rnd();
    return k;
}
static unsigned char *rand_block(size_t n) {
    unsigned char *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)rnd();
    return p;
}

static kv_tier *open_ok(const char *url) {
    kvlm_error err = {0};
    double t0 = util_now_s();
    kv_tier *t = kv_tier_redis_open(url, &(kv_redis_opts){.timeout_ms = TIMEOUT_MS}, &err);
    if (!t) fail_msg("open %s: %s", url, err.msg);
    double dt = util_now_s() - t0;
    if (dt > TIMEOUT_MS / 1000.0 + SLACK_S) fail_msg("open %s took %.3f s", url, dt);
    return t;
}

/* Timed calls: each must end within the timeout plus slack. */
#define BOUNDED(what, expr)                                                                    \
    do {                                                                                       \
        double t0_ = util_now_s();                                                             \
        expr;                                                                                  \
        double dt_ = util_now_s() - t0_;                                                       \
        if (dt_ > TIMEOUT_MS / 1000.0 + SLACK_S) fail_msg("%s took %.3f s (line %d)", what, dt_, __LINE__); \
    } while (0)

static int get1(kv_tier *t, const kv_key *k, void *buf, size_t cap, size_t *len) {
    void *bufs[1] = {buf};
    int n;
    BOUNDED("get", n = kv_tier_get(t, 1, k, bufs, cap, len));
    return n;
}

/* ---- tests ---- */

static void test_bad_url(void **state) {
    (void)state;
    const char *bad[] = {NULL, "", "redis://", "http://127.0.0.1:6379", "redis:/127.0.0.1:6379", "redis://127.0.0.1",
                         "redis://127.0.0.1:", "redis://127.0.0.1:0", "redis://127.0.0.1:65536", "redis://127.0.0.1:63a9",
                         "redis://127.0.0.1:-1", "redis://127.0.0.1:+80", "redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/x",
                         "redis://127.0.0.1:6379/0/1", "redis://ho st:6379",
                         "redis://[::1:6379", "redis://[]:6379", "redis://127.0.0.1:6379?db=1", "redis://127.0.0.1:6379 ",
                         /* user and password: empty, badly escaped, a user without one, one without a port */
                         "redis://alice:@127.0.0.1:6379", "redis://@127.0.0.1:6379", "redis://:@127.0.0.1:6379",
                         "redis://al%zzce:pw@127.0.0.1:6379", "redis://alice:p%0@127.0.0.1:6379", "redis://a:%00@127.0.0.1:1",
                         "redis://alice@127.0.0.1:6379", "redis://alice:hunter2@127.0.0.1", "rediss://:hunter2@127.0.0.1:99999",
                         "redis-cluster://:hunter2@127.0.0.1:1,x"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kvlm_error err = {0};
        kv_tier *t = kv_tier_redis_open(bad[i], &(kv_redis_opts){.timeout_ms = TIMEOUT_MS}, &err);
        if (t) {
            kv_tier_close(t);
            fail_msg("bad URL '%s' opened", bad[i] ? bad[i] : "(null)");
        }
        assert_int_equal(err.code, KVLM_EINVAL);
        assert_non_null(strstr(err.msg, "redis"));
        if (strstr(err.msg, "hunter2")) fail_msg("the password shows in '%s'", err.msg);
    }
    kvlm_error err = {0};
    assert_null(kv_tier_redis_open("redis://127.0.0.1:6379", &(kv_redis_opts){.timeout_ms = -5}, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
}

/* Nothing listening: opens "down"; puts drop, gets miss, all at once. */
static void test_down_at_open(void **state) {
    (void)state;
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", free_port());
    kv_tier *t = open_ok(url);
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_false(st.up);
    kv_key k = rand_key();
    unsigned char blk[64] = {1}, out[64];
    size_t len = 7;
    bool put_ok;
    BOUNDED("put", put_ok = kv_tier_put(t, &k, blk, sizeof blk));
    assert_false(put_ok);
    assert_int_equal(get1(t, &k, out, sizeof out, &len), 0);
    assert_int_equal(len, 0);
    int c;
    BOUNDED("contains", c = kv_tier_contains(t, 1, &k));
    assert_int_equal(c, 0);
    BOUNDED("flush", kv_tier_flush(t));
    kv_tier_stats_get(t, &st);
    assert_int_equal(st.dropped_writes, 1);
    assert_int_equal(st.misses, 1);
    assert_int_equal(st.hits, 0);
    assert_true(st.errors >= 1);
    BOUNDED("close", kv_tier_close(t));
}

static void test_round_trip(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    enum { N = 6 };
    const size_t sizes[N] = {1, 100, 4096, 45056, 720896, 3};
    kv_key keys[N];
    unsigned char *blk[N], *out[N];
    void *bufs[N];
    size_t lens[N], total = 0;
    for (int i = 0; i < N; i++) {
        keys[i] = rand_key();
        blk[i] = rand_block(sizes[i]);
        out[i] = malloc(720896);
        bufs[i] = out[i];
        total += sizes[i];
        assert_true(kv_tier_put(t, &keys[i], blk[i], sizes[i]));
    }
    kv_tier_flush(t);
    int n;
    BOUNDED("get", n = kv_tier_get(t, N, keys, bufs, 720896, lens));
    assert_int_equal(n, N);
    for (int i = 0; i < N; i++) {
        assert_int_equal(lens[i], sizes[i]);
        assert_memory_equal(out[i], blk[i], sizes[i]);
    }
    /* a block longer than cap is a miss; the leading ones still come */
    BOUNDED("get", n = kv_tier_get(t, N, keys, bufs, 50000, lens));
    assert_int_equal(n, 4);
    assert_int_equal(lens[4], 0);
    assert_int_equal(lens[5], 3);
    /* the key really is kvlm:blk:<hex> */
    char hex[KV_KEY_HEX], cmd[80];
    kv_key_hex(&keys[2], hex);
    snprintf(cmd, sizeof cmd, "STRLEN kvlm:blk:%s", hex);
    assert_int_equal(redis_int(cmd), 4096);
    snprintf(cmd, sizeof cmd, "TTL kvlm:blk:%s", hex);
    assert_int_equal(redis_int(cmd), -1); /* no expiry */

    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_int_equal(st.writes, N);
    assert_int_equal(st.write_bytes, total);
    assert_int_equal(st.dropped_writes, 0);
    assert_int_equal(st.hits, N + 5);
    assert_int_equal(st.misses, 1);
    assert_int_equal(st.reads, 2);
    assert_true(st.read_seconds > 0);
    assert_true(st.up);
    assert_int_equal(st.errors, 0);
    for (int i = 0; i < N; i++) { free(blk[i]); free(out[i]); }
    kv_tier_close(t);
}

/* MGET with a hole: the leading count stops there; blocks after it still come. */
static void test_leading_and_contains(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    kv_key k[5];
    unsigned char *blk[5], out[5][256];
    void *bufs[5];
    size_t lens[5];
    for (int i = 0; i < 5; i++) {
        k[i] = rand_key();
        blk[i] = rand_block(200 + (size_t)i);
        bufs[i] = out[i];
        if (i != 2) assert_true(kv_tier_put(t, &k[i], blk[i], 200 + (size_t)i));
    }
    kv_tier_flush(t);
    int n;
    BOUNDED("get", n = kv_tier_get(t, 5, k, bufs, sizeof out[0], lens));
    assert_int_equal(n, 2);
    assert_int_equal(lens[0], 200);
    assert_int_equal(lens[1], 201);
    assert_int_equal(lens[2], 0);
    assert_int_equal(lens[3], 203);
    assert_int_equal(lens[4], 204);
    assert_memory_equal(out[3], blk[3], 203);
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_int_equal(st.hits, 4);
    assert_int_equal(st.misses, 1);

    BOUNDED("contains", n = kv_tier_contains(t, 5, k));
    assert_int_equal(n, 2);
    BOUNDED("contains", n = kv_tier_contains(t, 2, &k[2]));
    assert_int_equal(n, 0);
    BOUNDED("contains", n = kv_tier_contains(t, 2, &k[3]));
    assert_int_equal(n, 2);
    assert_int_equal(kv_tier_contains(t, 0, k), 0);
    kv_tier_stats st2;
    kv_tier_stats_get(t, &st2);
    assert_int_equal(st2.hits, st.hits); /* contains keeps no stats */
    assert_int_equal(st2.reads, st.reads);

    /* drop */
    kv_tier_drop(t, &k[1]);
    kv_tier_flush(t);
    assert_int_equal(kv_tier_contains(t, 5, k), 1);
    BOUNDED("get", n = kv_tier_get(t, 2, k, bufs, sizeof out[0], lens));
    assert_int_equal(n, 1);
    assert_int_equal(lens[1], 0);
    for (int i = 0; i < 5; i++) free(blk[i]);
    kv_tier_close(t);
}

/* Two tiers (as two processes): each sees the other's puts within a second
 * (no flush); a tier on another database sees neither. */
static void test_two_tiers(void **state) {
    (void)state;
    char url1[80];
    snprintf(url1, sizeof url1, "%s/1", g_url);
    kv_tier *a = open_ok(g_url), *b = open_ok(g_url), *other = open_ok(url1);
    for (int round = 0; round < 4; round++) {
        kv_tier *from = round % 2 ? b : a, *to = round % 2 ? a : b;
        kv_key k = rand_key();
        unsigned char *blk = rand_block(45056), *out = malloc(45056);
        size_t len = 0;
        double t0 = util_now_s();
        assert_true(kv_tier_put(from, &k, blk, 45056));
        while (get1(to, &k, out, 45056, &len) == 0) {
            if (util_now_s() - t0 > 1.0) fail_msg("round %d: a put not visible to the other tier after 1 s", round);
            usleep(5000);
        }
        printf("  round %d: visible to the other tier after %.1f ms\n", round, (util_now_s() - t0) * 1e3);
        assert_int_equal(len, 45056);
        assert_memory_equal(out, blk, 45056);
        assert_int_equal(kv_tier_contains(other, 1, &k), 0);
        free(blk);
        free(out);
    }
    /* and the other database holds its own */
    kv_key k = rand_key();
    unsigned char x[10] = "0123456789", y[10];
    size_t len;
    assert_true(kv_tier_put(other, &k, x, 10));
    kv_tier_flush(other);
    assert_int_equal(get1(other, &k, y, 10, &len), 1);
    assert_int_equal(kv_tier_contains(a, 1, &k), 0);
    kv_tier_close(a);
    kv_tier_close(b);
    kv_tier_close(other);
}

/* blocks and bytes come from DBSIZE and INFO memory, polled once a second. */
static void test_stats_poll(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    unsigned char blk[1000] = {0};
    for (int i = 0; i < 10; i++) {
        kv_key k = rand_key();
        assert_true(kv_tier_put(t, &k, blk, sizeof blk));
    }
    kv_tier_flush(t);
    long long want = redis_int("DBSIZE");
    assert_true(want >= 10);
    kv_tier_stats st;
    double t0 = util_now_s();
    for (;;) {
        kv_tier_stats_get(t, &st);
        if (st.blocks == (uint64_t)want) break;
        if (util_now_s() - t0 > 2.5) fail_msg("stats.blocks %llu, DBSIZE %lld after 2.5 s", (unsigned long long)st.blocks, want);
        usleep(50000);
    }
    assert_true(st.bytes > 10 * 1000);
    kv_tier_close(t);
}

/* Killed mid-test: misses and dropped writes, nothing hangs; restarted on the
 * same port (empty): the old blocks miss, new ones hit after the reconnect. */
static void test_kill_restart(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    enum { N = 4 };
    kv_key k[N];
    unsigned char *blk[N], *out = malloc(45056);
    void *bufs[N];
    size_t lens[N];
    for (int i = 0; i < N; i++) {
        k[i] = rand_key();
        blk[i] = rand_block(45056);
        bufs[i] = malloc(45056);
        assert_true(kv_tier_put(t, &k[i], blk[i], 45056));
    }
    kv_tier_flush(t);
    int n;
    BOUNDED("get", n = kv_tier_get(t, N, k, bufs, 45056, lens));
    assert_int_equal(n, N);

    redis_kill();
    kv_tier_stats st0, st;
    kv_tier_stats_get(t, &st0);
    for (int i = 0; i < 3; i++) {
        BOUNDED("get", n = kv_tier_get(t, N, k, bufs, 45056, lens));
        assert_int_equal(n, 0);
        for (int j = 0; j < N; j++) assert_int_equal(lens[j], 0);
        BOUNDED("contains", n = kv_tier_contains(t, N, k));
        assert_int_equal(n, 0);
    }
    int puts = 20;
    for (int i = 0; i < puts; i++) {
        kv_key kk = rand_key();
        BOUNDED("put", kv_tier_put(t, &kk, blk[0], 45056));
    }
    BOUNDED("flush", kv_tier_flush(t));
    kv_tier_stats_get(t, &st);
    assert_int_equal(st.writes, st0.writes);
    assert_int_equal(st.dropped_writes, st0.dropped_writes + (uint64_t)puts);
    assert_int_equal(st.hits, st0.hits);
    assert_int_equal(st.misses, st0.misses + 3 * N);
    assert_true(st.errors > st0.errors);
    /* the writer notices within its poll period */
    double t0 = util_now_s();
    do {
        usleep(50000);
        kv_tier_stats_get(t, &st);
    } while (st.up && util_now_s() - t0 < 2.5);
    assert_false(st.up);

    redis_start();
    t0 = util_now_s();
    kv_key fresh = rand_key();
    bool hit = false;
    while (util_now_s() - t0 < 5.0) {
        BOUNDED("get", n = kv_tier_get(t, N, k, bufs, 45056, lens));
        assert_int_equal(n, 0); /* an empty server: the old blocks are gone */
        kv_tier_put(t, &fresh, blk[1], 45056);
        size_t len = 0;
        if (get1(t, &fresh, out, 45056, &len) == 1) {
            assert_int_equal(len, 45056);
            assert_memory_equal(out, blk[1], 45056);
            hit = true;
            break;
        }
        usleep(20000);
    }
    if (!hit) fail_msg("no hit within 5 s of the restart");
    printf("  hits again %.2f s after the restart\n", util_now_s() - t0);
    kv_tier_stats_get(t, &st);
    assert_true(st.up);
    for (int i = 0; i < N; i++) { free(blk[i]); free(bufs[i]); }
    free(out);
    BOUNDED("close", kv_tier_close(t));
}

/* A server that hangs with connections open (SIGSTOP): calls in flight give
 * up at the timeout, and only the first pays it; flush and close return;
 * after SIGCONT hits resume. */
static void test_stopped_server(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    kv_key k = rand_key();
    unsigned char *blk = rand_block(720896), *out = malloc(720896);
    size_t len;
    assert_true(kv_tier_put(t, &k, blk, 720896));
    kv_tier_flush(t);
    assert_int_equal(get1(t, &k, out, 720896, &len), 1);
    kill(g_pid, SIGSTOP);
    double t0 = util_now_s();
    assert_int_equal(get1(t, &k, out, 720896, &len), 0);
    double dt = util_now_s() - t0;
    printf("  get against a stopped server: miss after %.3f s (timeout %d ms)\n", dt, TIMEOUT_MS);
    int c;
    t0 = util_now_s();
    BOUNDED("contains", c = kv_tier_contains(t, 1, &k));
    assert_int_equal(c, 0);
    /* the get's broken connection took the idle ones with it: no second timeout */
    dt = util_now_s() - t0;
    printf("  then contains: miss after %.3f s\n", dt);
    if (dt > TIMEOUT_MS / 2 / 1000.0) fail_msg("contains waited on the stopped server: %.3f s", dt);
    /* 200 blocks, 144 MB: more than the queue holds (128 MiB), so some are
     * refused at once; none is written while the server is stopped */
    kv_tier_stats st0, st;
    kv_tier_stats_get(t, &st0);
    int refused = 0, puts = 200;
    for (int i = 0; i < puts; i++) {
        kv_key kk = rand_key();
        bool ok;
        BOUNDED("put", ok = kv_tier_put(t, &kk, blk, 720896));
        refused += !ok;
    }
    printf("  %d of %d puts refused at once (queue full or tier down)\n", refused, puts);
    assert_true(refused >= puts - (int)((128u << 20) / 720896));
    t0 = util_now_s();
    kv_tier_flush(t);
    dt = util_now_s() - t0;
    printf("  flush against a stopped server: %.3f s\n", dt);
    if (dt > 3.0) fail_msg("flush took %.3f s against a stopped server", dt);
    kv_tier_stats_get(t, &st);
    assert_int_equal(st.writes, st0.writes);
    assert_int_equal(st.dropped_writes, st0.dropped_writes + (uint64_t)puts);
    kill(g_pid, SIGCONT);
    t0 = util_now_s();
    while (get1(t, &k, out, 720896, &len) != 1) {
        if (util_now_s() - t0 > 5) fail_msg("no hit within 5 s of SIGCONT");
        usleep(20000);
    }
    assert_memory_equal(out, blk, 720896);
    printf("  hits again %.2f s after SIGCONT\n", util_now_s() - t0);
    free(blk);
    free(out);
    t0 = util_now_s();
    kv_tier_close(t);
    if (util_now_s() - t0 > 3.0) fail_msg("close took %.3f s", util_now_s() - t0);
}

/* A socket that accepts connections (the kernel's backlog) and never answers. */
static void test_silent_socket(void **state) {
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 64), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", ntohs(a.sin_port));
    kv_tier *t = open_ok(url);
    kv_key k = rand_key();
    unsigned char blk[4096] = {7}, out[4096];
    size_t len;
    double t0 = util_now_s();
    int gets = 0;
    while (util_now_s() - t0 < 1.5) { /* across the writer's reconnect attempts */
        assert_int_equal(get1(t, &k, out, sizeof out, &len), 0);
        int c;
        BOUNDED("contains", c = kv_tier_contains(t, 1, &k));
        assert_int_equal(c, 0);
        BOUNDED("put", kv_tier_put(t, &k, blk, sizeof blk));
        gets++;
        usleep(10000);
    }
    BOUNDED("flush", kv_tier_flush(t));
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_false(st.up);
    assert_int_equal(st.hits, 0);
    assert_int_equal(st.misses, (uint64_t)gets);
    assert_int_equal(st.writes, 0);
    assert_int_equal(st.dropped_writes, (uint64_t)gets);
    printf("  %d gets against a silent socket, %llu connection errors\n", gets, (unsigned long long)st.errors);
    BOUNDED("close", kv_tier_close(t));
    close(fd);
}

/* Several threads on one tier while the server dies and comes back: no
 * crash, every call bounded. */
typedef struct {
    kv_tier *t;
    atomic_int *phase; /* 0 before the kill, 1 down and restarting, 2 back, 3 stop */
    double worst;
    int calls, late_hits;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    unsigned char blk[8192], out[4][8192];
    void *bufs[4] = {out[0], out[1], out[2], out[3]};
    size_t lens[4];
    kv_key keys[4];
    memset(blk, 0x5a, sizeof blk);
    uint64_t s = (uint64_t)(uintptr_t)w * 2654435761u + 1;
    int ph;
    while ((ph = atomic_load(w->phase)) != 3) {
        for (int i = 0; i < 4; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            memset(&keys[i], 0, sizeof keys[i]);
            keys[i].b[0] = (uint8_t)(s >> 60); /* 16 keys: collisions between threads on purpose */
        }
        double t0 = util_now_s();
        kv_tier_put(w->t, &keys[0], blk, sizeof blk);
        int got = kv_tier_get(w->t, 4, keys, bufs, sizeof out[0], lens);
        if (ph == 2) w->late_hits += got;
        kv_tier_contains(w->t, 4, keys);
        if ((s >> 20) % 7 == 0) kv_tier_drop(w->t, &keys[1]);
        double dt = util_now_s() - t0;
        if (dt > w->worst) w->worst = dt;
        w->calls++;
        usleep(500); /* the machine is shared */
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    atomic_int phase = 0;
    enum { W = 4 };
    worker w[W];
    pthread_t th[W];
    for (int i = 0; i < W; i++) {
        w[i] = (worker){t, &phase, 0, 0, 0};
        pthread_create(&th[i], NULL, work, &w[i]);
    }
    usleep(400000);
    atomic_store(&phase, 1);
    redis_kill();
    usleep(700000);
    redis_start();
    usleep(700000); /* the reconnect: at most one attempt per 500 ms */
    atomic_store(&phase, 2);
    usleep(500000);
    atomic_store(&phase, 3);
    double worst = 0;
    int calls = 0, hits = 0;
    for (int i = 0; i < W; i++) {
        pthread_join(th[i], NULL);
        if (w[i].worst > worst) worst = w[i].worst;
        calls += w[i].calls;
        hits += w[i].late_hits;
    }
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    printf("  %d rounds in 4 threads, worst round %.3f s, %d hits after the restart, %llu errors, %llu dropped\n",
           calls, worst, hits, (unsigned long long)st.errors, (unsigned long long)st.dropped_writes);
    /* one round is a put, a get and a contains: at most two timeouts */
    if (worst > 2 * TIMEOUT_MS / 1000.0 + SLACK_S) fail_msg("a round took %.3f s", worst);
    assert_true(hits > 0);
    assert_true(st.up);
    BOUNDED("close", kv_tier_close(t));
}

/* Tests that need the server start one if an earlier test left none (or
 * left it stopped). */
static int need_server(void **state) {
    (void)state;
    if (g_pid > 0) kill(g_pid, SIGCONT);
    else redis_start();
    return 0;
}
#define WITH_SERVER(f) cmocka_unit_test_setup(f, need_server)

int main(void) {
    if (getenv("KVLM_REDIS_SERVER")) g_bin = getenv("KVLM_REDIS_SERVER");
    if (access(g_bin, X_OK) != 0) {
        fprintf(stderr, "\n*** SKIP test_tier_redis: %s is missing (apt-get install redis-server; scripts/setup.sh) ***\n\n",
                g_bin);
        return 77;
    }
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    g_port = free_port();
    snprintf(g_url, sizeof g_url, "redis://127.0.0.1:%d", g_port);
    atexit(cleanup);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_url),
        cmocka_unit_test(test_down_at_open),
        WITH_SERVER(test_round_trip),
        WITH_SERVER(test_leading_and_contains),
        WITH_SERVER(test_two_tiers),
        WITH_SERVER(test_stats_poll),
        WITH_SERVER(test_kill_restart),
        WITH_SERVER(test_stopped_server),
        cmocka_unit_test(test_silent_socket),
        WITH_SERVER(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
