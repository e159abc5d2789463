/* tests/test_tier_redis_trust: the Redis tier's trust boundary against real
 * servers started here on loopback ports. AUTH: an ACL user, the default
 * user's password, a password given apart from the URL; a wrong password, an
 * unknown user and a missing password are refused, said once (never the
 * password) and leave the tier down, every call bounded. TLS (a CA, server
 * and client certificates made here with the openssl command): blocks up to
 * 704 KiB round trip over rediss://; a wrong CA, no client certificate, an
 * address the certificate does not name, rediss:// at a plain port and
 * redis:// at a TLS port are each refused and said once. A Redis Cluster of
 * 3 masters over TLS with AUTH (rediss-cluster://). Hostile endpoints (one
 * that answers every command with an array of 2^31-1 elements, a string of
 * 2^31-1 bytes or endless garbage; one that answers PING but reads so): the
 * open takes no longer than a timeout, reads are refused at once (not after
 * the timeout), the tier is down, said once. Skips (77) without
 * redis-server, redis-cli or openssl, or a redis-server without TLS. */
#include <errno.h>
#include <fcntl.h>
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
#include <unistd.h>
#include "helpers/testutil.h"
#include "kv/tier.h"
#include "util/timing.h"

static const char *g_bin = "/usr/bin/redis-server", *g_cli = "/usr/bin/redis-cli", *g_openssl = "/usr/bin/openssl";
/* Not the default 200 ms: what is checked here is who is trusted, not how
 * fast (test_tier_redis checks that), and a TLS handshake on a loaded
 * 2-core machine can take a few hundred ms. The hostile endpoints get 5 s,
 * so that a refusal "at once" shows. */
#define TIMEOUT_MS 1000
#define HOSTILE_MS 5000
#define SLACK_S 0.50 /* the test machine is shared and slow */
#define NODES 3

static char g_dir[] = "/tmp/kvlm_rtrust_XXXXXX";
static char g_ca[128], g_ca2[128], g_cert[128], g_key[128];
static int g_port, g_tls_port;            /* one server: a plain port and a TLS port */
static int g_cport[NODES];                /* the TLS cluster's nodes */
static pid_t g_pid = -1, g_cpid[NODES] = {-1, -1, -1};

/* ---- processes and ports ---- */

/* A free loopback port p with p + 10000 free too (a cluster node's bus). */
static int free_port(void) {
    for (int tries = 0; tries < 50; tries++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {0};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t n = sizeof a;
        if (fd < 0) return -1;
        if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &n) != 0) {
            close(fd);
            return -1;
        }
        close(fd);
        int p = ntohs(a.sin_port);
        if (p + 10000 > 65535) continue;
        int fd2 = socket(AF_INET, SOCK_STREAM, 0);
        a.sin_port = htons((uint16_t)(p + 10000));
        bool ok = fd2 >= 0 && bind(fd2, (struct sockaddr *)&a, sizeof a) == 0;
        if (fd2 >= 0) close(fd2);
        if (ok) return p;
    }
    return -1;
}

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return system(cmd);
}

/* PING through the plain port with the default user's password. */
static bool ping_plain(int port) {
    struct timeval tv = {0, 200000};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    bool ok = false;
    if (c && !c->err) {
        redisSetTimeout(c, tv);
        redisReply *r = redisCommand(c, "AUTH defpass");
        if (r) freeReplyObject(r);
        r = redisCommand(c, "PING");
        ok = r && r->type == REDIS_REPLY_STATUS && !strcmp(r->str, "PONG");
        if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return ok;
}

/* A redis-server with the test's TLS files, ACL user alice (password
 * secret) and the default user's password defpass; extra: its own options
 * (NULL-terminated), the port options among them. */
static pid_t server_start(const char *dir, const char *const *extra) {
    char log[256];
    snprintf(log, sizeof log, "%s/log", dir);
    mkdir(dir, 0755);
    const char *argv[64];
    int n = 0;
    const char *base[] = {g_bin, "--bind", "127.0.0.1", "127.0.0.2", "--save", "", "--appendonly", "no", "--dir", dir,
                          "--daemonize", "no", "--loglevel", "warning", "--tls-cert-file", g_cert, "--tls-key-file", g_key,
                          "--tls-ca-cert-file", g_ca, "--user", "alice", "on", ">secret", "~*", "+@all",
                          "--requirepass", "defpass"};
    for (size_t i = 0; i < sizeof base / sizeof *base; i++) argv[n++] = base[i];
    for (int i = 0; extra[i]; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0) fail_msg("fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a crashed test */
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); close(fd); }
        execv(g_bin, (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static void server_kill(pid_t *pid) {
    if (*pid > 0) {
        kill(*pid, SIGKILL);
        waitpid(*pid, NULL, 0);
        *pid = -1;
    }
}

/* redis-cli over TLS as the default user: its exit status (output to out). */
static int cli_tls(int port, const char *args, const char *out) {
    return sh("timeout 30 %s --tls --cacert %s --cert %s --key %s -a defpass --no-auth-warning -h 127.0.0.1 -p %d %s >%s 2>&1",
              g_cli, g_ca, g_cert, g_key, port, args, out);
}

static bool file_has(const char *path, const char *what) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, what) != NULL;
}

/* ---- stderr, captured: the tier's log lines ---- */

static char g_cap_path[160];
static int g_saved_err = -1;
static char g_cap[65536];

static void cap_begin(void) {
    fflush(stderr);
    g_saved_err = dup(2);
    int fd = open(g_cap_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
}

/* Restores stderr; what was logged (also printed, indented). */
static const char *cap_end(void) {
    fflush(stderr);
    dup2(g_saved_err, 2);
    close(g_saved_err);
    g_saved_err = -1;
    FILE *f = fopen(g_cap_path, "r");
    size_t n = f ? fread(g_cap, 1, sizeof g_cap - 1, f) : 0;
    if (f) fclose(f);
    g_cap[n] = 0;
    for (char *l = g_cap, *e; *l; l = e + 1) {
        e = strchr(l, '\n');
        if (!e) e = l + strlen(l) - 1;
        printf("  | %.*s\n", (int)(e - l), l);
    }
    return g_cap;
}

/* While captured: how much has been logged so far, and what since then. */
static long cap_mark(void) {
    fflush(stderr);
    struct stat st;
    return stat(g_cap_path, &st) == 0 ? (long)st.st_size : 0;
}
static const char *cap_since(long off) {
    fflush(stderr);
    static char buf[16384];
    FILE *f = fopen(g_cap_path, "r");
    size_t n = 0;
    if (f && fseek(f, off, SEEK_SET) == 0) n = fread(buf, 1, sizeof buf - 1, f);
    if (f) fclose(f);
    buf[n] = 0;
    return buf;
}

/* After each test: stderr back if a failed check left it captured (what it
 * held is printed: the failure's message is there). */
static int restore_stderr(void **state) {
    (void)state;
    if (g_saved_err >= 0) cap_end();
    return 0;
}

static int count(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* ---- blocks ---- */

static uint64_t g_rng = 0x6a09e667f3bcc908ull;
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

#define BOUNDED(what, limit_s, expr)                                                                   \
    do {                                                                                               \
        double t0_ = util_now_s();                                                                     \
        expr;                                                                                          \
        double dt_ = util_now_s() - t0_;                                                               \
        if (dt_ > (limit_s)) fail_msg("%s took %.3f s (line %d)", what, dt_, __LINE__);                \
    } while (0)

static kv_tier *open_with(const char *url, const kv_redis_opts *o) {
    kvlm_error err = {0};
    kv_tier *t;
    int ms = o && o->timeout_ms ? o->timeout_ms : TIMEOUT_MS;
    BOUNDED("open", 2 * ms / 1000.0 + SLACK_S, t = kv_tier_redis_open(url, o, &err));
    if (!t) fail_msg("open %s: %s", url, err.msg);
    return t;
}

static kv_redis_opts tls_opts(const char *password) {
    kv_redis_opts o = {TIMEOUT_MS, password, g_ca, g_cert, g_key};
    return o;
}

/* Puts blocks of these sizes (the largest last), flushes, gets them back,
 * and again with a cap below the largest: it misses, read past, the others
 * still come. */
static void round_trip(kv_tier *t, int n, const size_t *sizes) {
    kv_key keys[8];
    unsigned char *blk[8], *out[8];
    void *bufs[8];
    size_t lens[8], max = 0;
    assert_true(n <= 8);
    for (int i = 0; i < n; i++)
        if (sizes[i] > max) max = sizes[i];
    for (int i = 0; i < n; i++) {
        keys[i] = rand_key();
        blk[i] = malloc(sizes[i]);
        bufs[i] = out[i] = malloc(max);
        for (size_t j = 0; j < sizes[i]; j++) blk[i][j] = (unsigned char)rnd();
        assert_true(kv_tier_put(t, &keys[i], blk[i], sizes[i]));
    }
    kv_tier_flush(t);
    int got;
    BOUNDED("get", TIMEOUT_MS / 1000.0 + SLACK_S, got = kv_tier_get(t, n, keys, bufs, max, lens));
    assert_int_equal(got, n);
    for (int i = 0; i < n; i++) {
        assert_int_equal(lens[i], sizes[i]);
        assert_memory_equal(out[i], blk[i], sizes[i]);
    }
    int c;
    BOUNDED("contains", TIMEOUT_MS / 1000.0 + SLACK_S, c = kv_tier_contains(t, n, keys));
    assert_int_equal(c, n);
    /* the largest with a cap below it: a miss read past, the rest still come */
    if (n > 1 && sizes[n - 1] == max && max > 4096) {
        BOUNDED("get", TIMEOUT_MS / 1000.0 + SLACK_S, got = kv_tier_get(t, n, keys, bufs, max - 1, lens));
        assert_int_equal(got, n - 1);
        assert_int_equal(lens[n - 1], 0);
        for (int i = 0; i < n - 1; i++) assert_memory_equal(out[i], blk[i], sizes[i]);
        BOUNDED("get", TIMEOUT_MS / 1000.0 + SLACK_S, got = kv_tier_get(t, n, keys, bufs, max, lens));
        assert_int_equal(got, n); /* the connection is clean after it */
    }
    for (int i = 0; i < n; i++) { free(blk[i]); free(out[i]); }
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_true(st.up);
}

/* A tier that must be down: bounded misses and drops, nothing hangs. */
static void expect_down(kv_tier *t) {
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_false(st.up);
    kv_key k = rand_key();
    unsigned char b[64] = {1}, o[64];
    void *bufs[1] = {o};
    size_t len = 9;
    int got;
    BOUNDED("get", 0.25, got = kv_tier_get(t, 1, &k, bufs, sizeof o, &len)); /* no I/O: at once */
    assert_int_equal(got, 0);
    assert_int_equal(len, 0);
    bool ok;
    BOUNDED("put", 0.25, ok = kv_tier_put(t, &k, b, sizeof b));
    assert_false(ok);
}

/* Tiers that must come up down, each saying why when it opens, then never
 * again while the writer (and the mapper) retry: opened one after the
 * other, each open's lines checked, then one wait for all, after which
 * every case's line is there as many times as after the opens. (A loaded
 * machine may add a line of another kind, a timeout: that is not a
 * repeat.) */
typedef struct {
    char url[200];
    kv_redis_opts o;
    const char *says; /* in the line its open logs */
    double open_s;    /* how long the open took */
} refused_case;

static void expect_refused(int n, refused_case *cs, double wait_s) {
    kv_tier *ts[16];
    int after_open[16];
    assert_true(n <= 16);
    cap_begin();
    long start = cap_mark();
    for (int i = 0; i < n; i++) {
        long mark = cap_mark();
        double t0 = util_now_s();
        ts[i] = open_with(cs[i].url, &cs[i].o);
        cs[i].open_s = util_now_s() - t0;
        expect_down(ts[i]);
        const char *log = cap_since(mark);
        if (count(log, cs[i].says) != 1) {
            char copy[4096];
            snprintf(copy, sizeof copy, "%s", log);
            cap_end();
            fail_msg("%s: its open logged '%s' %d times, not once:\n%s", cs[i].url, cs[i].says, count(copy, cs[i].says),
                     copy);
        }
    }
    for (int i = 0; i < n; i++) after_open[i] = count(cap_since(start), cs[i].says);
    usleep((useconds_t)(wait_s * 1e6)); /* the threads' next attempts */
    for (int i = 0; i < n; i++) {
        expect_down(ts[i]);
        kv_tier_close(ts[i]);
    }
    const char *all = cap_since(start);
    for (int i = 0; i < n; i++) {
        int now = count(all, cs[i].says);
        if (now != after_open[i]) {
            char copy[4096];
            snprintf(copy, sizeof copy, "%s", all);
            cap_end();
            fail_msg("%s: '%s' said again while the tier retried (%d, then %d times):\n%s", cs[i].url, cs[i].says,
                     after_open[i], now, copy);
        }
    }
    const char *log = cap_end();
    assert_null(strstr(log, "hunter2"));
}

/* ---- setup ---- */

static int setup(void **state) {
    (void)state;
    if (!mkdtemp(g_dir)) fail_msg("mkdtemp: %s", strerror(errno));
    snprintf(g_cap_path, sizeof g_cap_path, "%s/stderr", g_dir);
    snprintf(g_ca, sizeof g_ca, "%s/ca.crt", g_dir);
    snprintf(g_ca2, sizeof g_ca2, "%s/ca2.crt", g_dir);
    snprintf(g_cert, sizeof g_cert, "%s/cert.crt", g_dir);
    snprintf(g_key, sizeof g_key, "%s/cert.key", g_dir);
    /* a CA, another CA, and one certificate for servers and client alike
     * (127.0.0.1 and localhost; no key usage limits, so the cluster's nodes
     * present it to each other too) */
    const char *ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    if (sh("cd %s && %s req -x509 -new %s -keyout ca.key -out ca.crt -days 2 -subj /CN=kvlm-test-ca >ssl.log 2>&1 && "
           "%s req -x509 -new %s -keyout ca2.key -out ca2.crt -days 2 -subj /CN=kvlm-other-ca >>ssl.log 2>&1 && "
           "%s req -new %s -keyout cert.key -out cert.csr -subj /CN=localhost >>ssl.log 2>&1 && "
           "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' >san.ext && "
           "%s x509 -req -in cert.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out cert.crt -days 2 -extfile san.ext "
           ">>ssl.log 2>&1",
           g_dir, g_openssl, ec, g_openssl, ec, g_openssl, ec, g_openssl) != 0)
        fail_msg("openssl could not make the test's certificates; see %s/ssl.log", g_dir);

    char dir[160], port[16], tport[16];
    if ((g_port = free_port()) < 0 || (g_tls_port = free_port()) < 0) fail_msg("no free port");
    snprintf(dir, sizeof dir, "%s/single", g_dir);
    snprintf(port, sizeof port, "%d", g_port);
    snprintf(tport, sizeof tport, "%d", g_tls_port);
    const char *extra[] = {"--port", port, "--tls-port", tport, NULL};
    g_pid = server_start(dir, extra);
    double t0 = util_now_s();
    while (!ping_plain(g_port)) {
        if (waitpid(g_pid, NULL, WNOHANG) == g_pid) {
            g_pid = -1;
            fail_msg("redis-server exited at start (without TLS support?); see %s/log", dir);
        }
        if (util_now_s() - t0 > 10) fail_msg("redis-server did not answer within 10 s");
        usleep(20000);
    }

    /* the cluster: TLS only (port 0), its bus over TLS too */
    for (int i = 0; i < NODES; i++) {
        if ((g_cport[i] = free_port()) < 0) fail_msg("no free port");
        for (int j = 0; j < i; j++)
            if (g_cport[j] == g_cport[i] || abs(g_cport[j] - g_cport[i]) == 10000) { i--; break; }
    }
    for (int i = 0; i < NODES; i++) {
        snprintf(dir, sizeof dir, "%s/n%d", g_dir, i);
        snprintf(tport, sizeof tport, "%d", g_cport[i]);
        const char *cx[] = {"--port", "0", "--tls-port", tport, "--tls-cluster", "yes", "--cluster-enabled", "yes",
                            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                            "--cluster-require-full-coverage", "no", NULL};
        g_cpid[i] = server_start(dir, cx);
    }
    char out[200];
    snprintf(out, sizeof out, "%s/cli.out", g_dir);
    for (int i = 0; i < NODES; i++) {
        t0 = util_now_s();
        while (cli_tls(g_cport[i], "PING", out) != 0 || !file_has(out, "PONG")) {
            if (util_now_s() - t0 > 10) fail_msg("cluster node %d did not answer PING over TLS within 10 s", i);
            usleep(50000);
        }
    }
    char create[256];
    snprintf(create, sizeof create, "--cluster create 127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d --cluster-replicas 0 --cluster-yes",
             g_cport[0], g_cport[1], g_cport[2]);
    if (cli_tls(g_cport[0], create, out) != 0) fail_msg("redis-cli --cluster create failed; see %s", out);
    t0 = util_now_s();
    for (int i = 0; i < NODES; i++) {
        while (cli_tls(g_cport[i], "CLUSTER INFO", out) != 0 || !file_has(out, "cluster_state:ok")) {
            if (util_now_s() - t0 > 20) fail_msg("the TLS cluster was not ok within 20 s");
            usleep(50000);
        }
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    server_kill(&g_pid);
    for (int i = 0; i < NODES; i++) server_kill(&g_cpid[i]);
    if (sh("rm -rf '%s'", g_dir) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return 0;
}

/* ---- AUTH ---- */

static void test_auth(void **state) {
    (void)state;
    const size_t sizes[3] = {100, 4096, 45056};
    char url[160];
    /* an ACL user in the URL; the default user's password; a user with its
     * password given apart (it wins over the URL's) */
    snprintf(url, sizeof url, "redis://alice:secret@127.0.0.1:%d", g_port);
    kv_tier *t = open_with(url, &(kv_redis_opts){.timeout_ms = TIMEOUT_MS});
    round_trip(t, 3, sizes);
    kv_tier_close(t);
    snprintf(url, sizeof url, "redis://:defpass@127.0.0.1:%d/2", g_port);
    t = open_with(url, NULL);
    round_trip(t, 3, sizes);
    kv_tier_close(t);
    snprintf(url, sizeof url, "redis://alice@127.0.0.1:%d", g_port);
    t = open_with(url, &(kv_redis_opts){.timeout_ms = TIMEOUT_MS, .password = "secret"});
    round_trip(t, 3, sizes);
    kv_tier_close(t);
    snprintf(url, sizeof url, "redis://alice:wrong@127.0.0.1:%d", g_port);
    t = open_with(url, &(kv_redis_opts){.timeout_ms = TIMEOUT_MS, .password = "secret"});
    round_trip(t, 3, sizes);
    kv_tier_close(t);
    /* %-escapes: "s%65cret" is "secret" */
    snprintf(url, sizeof url, "redis://al%%69ce:s%%65cret@127.0.0.1:%d", g_port);
    t = open_with(url, NULL);
    round_trip(t, 3, sizes);
    kv_tier_close(t);
}

/* Refused: said once (over the retries), never the password, the tier down. */
static void test_auth_refused(void **state) {
    (void)state;
    refused_case cs[3] = {{.says = "AUTH failed: WRONGPASS"}, {.says = "AUTH failed: WRONGPASS"}, {.says = ": NOAUTH"}};
    snprintf(cs[0].url, sizeof cs[0].url, "redis://alice:hunter2@127.0.0.1:%d", g_port);
    snprintf(cs[1].url, sizeof cs[1].url, "redis://mallory@127.0.0.1:%d", g_port);
    cs[1].o.password = "hunter2";
    snprintf(cs[2].url, sizeof cs[2].url, "redis://127.0.0.1:%d", g_port);
    expect_refused(3, cs, 0.6); /* the writer retries every 500 ms */
}

/* ---- TLS ---- */

static void test_tls(void **state) {
    (void)state;
    const size_t sizes[5] = {1, 4096, 45056, 300000, 720896};
    char url[160];
    snprintf(url, sizeof url, "rediss://alice:secret@127.0.0.1:%d", g_tls_port);
    kv_redis_opts o = tls_opts(NULL);
    kv_tier *a = open_with(url, &o), *b = open_with(url, &o);
    round_trip(a, 5, sizes);
    /* another tier (another process) sees a's blocks */
    kv_key k = rand_key();
    static unsigned char blk[45056], out[45056];
    for (size_t i = 0; i < sizeof blk; i++) blk[i] = (unsigned char)(i * 7);
    assert_true(kv_tier_put(a, &k, blk, sizeof blk));
    kv_tier_flush(a);
    void *bufs[1] = {out};
    size_t len;
    assert_int_equal(kv_tier_get(b, 1, &k, bufs, sizeof out, &len), 1);
    assert_memory_equal(out, blk, sizeof blk);
    /* and a plain tier on the same server too (the bytes are the same) */
    char plain[160];
    snprintf(plain, sizeof plain, "redis://alice:secret@127.0.0.1:%d", g_port);
    kv_tier *c = open_with(plain, NULL);
    assert_int_equal(kv_tier_get(c, 1, &k, bufs, sizeof out, &len), 1);
    kv_tier_close(c);
    kv_tier_close(b);
    kv_tier_close(a);
}

/* Each refused, said once with why. */
static void test_tls_refused(void **state) {
    (void)state;
    refused_case cs[6] = {
        {.says = "TLS handshake failed: certificate verify failed"}, /* another CA */
        {.says = "TLS handshake failed: certificate verify failed"}, /* the system's store: not the test's CA */
        {.says = ": TLS "},                                          /* no client certificate */
        {.says = "certificate verify failed (IP address mismatch)"}, /* an address not in the certificate */
        {.says = "not a TLS port?"},                                 /* rediss:// at a plain port */
        {.says = "a TLS port? use rediss://"},                       /* redis:// at a TLS port */
    };
    for (int i = 0; i < 6; i++) {
        snprintf(cs[i].url, sizeof cs[i].url, "rediss://alice:secret@127.0.0.1:%d", g_tls_port);
        cs[i].o = tls_opts(NULL);
    }
    cs[0].o.tls_ca = g_ca2;
    cs[1].o.tls_ca = NULL;
    cs[2].o.tls_cert = cs[2].o.tls_key = NULL; /* the server closes (TLS 1.3: after the handshake) */
    snprintf(cs[3].url, sizeof cs[3].url, "rediss://alice:secret@127.0.0.2:%d", g_tls_port);
    snprintf(cs[4].url, sizeof cs[4].url, "rediss://alice:secret@127.0.0.1:%d", g_port);
    snprintf(cs[5].url, sizeof cs[5].url, "redis://alice:secret@127.0.0.1:%d", g_tls_port);
    cs[5].o = (kv_redis_opts){.timeout_ms = TIMEOUT_MS};
    expect_refused(6, cs, 1.2); /* retries every 500 ms, a timeout at a plain port lasts 1 s */
    kvlm_error err = {0};
    kv_redis_opts o;
    char url[160];
    /* files that cannot be used are an error of the open, by name */
    o = tls_opts(NULL);
    o.tls_ca = "/nonexistent/ca.pem";
    snprintf(url, sizeof url, "rediss://127.0.0.1:%d", g_tls_port);
    assert_null(kv_tier_redis_open(url, &o, &err));
    assert_non_null(strstr(err.msg, "/nonexistent/ca.pem"));
    o = tls_opts(NULL);
    o.tls_key = g_ca; /* a certificate, not its key */
    assert_null(kv_tier_redis_open(url, &o, &err));
    assert_non_null(strstr(err.msg, "key"));
    o = tls_opts(NULL); /* TLS files with a plain URL: a mistake, said */
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", g_port);
    assert_null(kv_tier_redis_open(url, &o, &err));
    assert_non_null(strstr(err.msg, "rediss://"));
}

/* ---- the cluster over TLS with AUTH ---- */

static void test_cluster_tls_auth(void **state) {
    (void)state;
    char url[200];
    snprintf(url, sizeof url, "rediss-cluster://alice@127.0.0.1:%d", g_cport[1]); /* one seed */
    kv_redis_opts o = tls_opts("secret");
    kv_tier *t = open_with(url, &o);
    enum { N = 48 };
    kv_key keys[N];
    static unsigned char blk[N][4096], out[N][4096];
    void *bufs[N];
    size_t lens[N];
    for (int i = 0; i < N; i++) {
        keys[i] = rand_key();
        memset(blk[i], i + 1, sizeof blk[i]);
        bufs[i] = out[i];
        assert_true(kv_tier_put(t, &keys[i], blk[i], sizeof blk[i]));
    }
    kv_tier_flush(t);
    int got;
    BOUNDED("get", TIMEOUT_MS / 1000.0 + SLACK_S, got = kv_tier_get(t, N, keys, bufs, sizeof out[0], lens));
    assert_int_equal(got, N);
    assert_memory_equal(out, blk, sizeof blk);
    int c;
    BOUNDED("contains", TIMEOUT_MS / 1000.0 + SLACK_S, c = kv_tier_contains(t, N, keys));
    assert_int_equal(c, N);
    /* spread over the three nodes */
    char out_path[200];
    snprintf(out_path, sizeof out_path, "%s/cli.out", g_dir);
    for (int i = 0; i < NODES; i++) {
        assert_int_equal(cli_tls(g_cport[i], "DBSIZE", out_path), 0);
        assert_false(file_has(out_path, "(integer) 0\n"));
    }
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_true(st.up);
    assert_int_equal(st.writes, N);
    kv_tier_close(t);

    /* a wrong password (both seeds: one line), and another CA: the map never
     * comes, said once */
    refused_case cs[2] = {{.says = "AUTH failed: WRONGPASS invalid username-password pair or user is disabled.; 127.0.0.1:"},
                          {.says = "certificate verify failed"}};
    snprintf(cs[0].url, sizeof cs[0].url, "rediss-cluster://alice:hunter2@127.0.0.1:%d,127.0.0.1:%d", g_cport[0],
             g_cport[2]);
    cs[0].o = tls_opts(NULL);
    snprintf(cs[1].url, sizeof cs[1].url, "rediss-cluster://alice:secret@127.0.0.1:%d", g_cport[0]);
    cs[1].o = tls_opts(NULL);
    cs[1].o.tls_ca = g_ca2;
    expect_refused(2, cs, 1.1); /* the mapper asks every second */
}

/* ---- hostile endpoints ---- */

enum { H_ARRAY, H_BULK, H_GARBAGE, H_READS_ARRAY, H_READS_BULK, H_CLUSTER_READS };
typedef struct {
    int fd, port, mode;
    atomic_bool stop;
    pthread_t th;
} hostile;
static char g_garbage[65536]; /* "+AAAA...": a status line that never ends */

static bool send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* One command of a RESP array of bulk strings at buf (n bytes): its length,
 * 0 if not whole yet, -1 if not RESP; argc and the first word (upper case). */
static long parse_cmd(const char *buf, size_t n, int *argc, char *word, size_t wcap) {
    const char *p = buf, *e = buf + n;
    const char *nl = memchr(p, '\n', (size_t)(e - p));
    if (!nl) return 0;
    if (*p != '*') return -1;
    *argc = atoi(p + 1);
    p = nl + 1;
    word[0] = 0;
    for (int i = 0; i < *argc; i++) {
        if (p >= e || !(nl = memchr(p, '\n', (size_t)(e - p)))) return 0;
        if (*p != '$') return -1;
        long len = atol(p + 1);
        p = nl + 1;
        if (e - p < len + 2) return 0;
        if (i == 0) {
            size_t m = (size_t)len < wcap - 1 ? (size_t)len : wcap - 1;
            for (size_t j = 0; j < m; j++) word[j] = (char)(p[j] >= 'a' && p[j] <= 'z' ? p[j] - 32 : p[j]);
            word[m] = 0;
        }
        p += len + 2;
    }
    return (long)(p - buf);
}

typedef struct {
    hostile *h;
    int fd;
} hconn;

static void *hostile_conn(void *arg) {
    hconn *hc = arg;
    hostile *h = hc->h;
    int fd = hc->fd;
    free(hc);
    char buf[65536];
    size_t have = 0;
    while (!atomic_load(&h->stop)) {
        ssize_t r = recv(fd, buf + have, sizeof buf - have, 0);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue; /* idle: check stop */
        if (r <= 0) break;
        have += (size_t)r;
        if (h->mode == H_ARRAY) { if (!send_all(fd, "*2147483647\r\n", 13)) break; have = 0; continue; }
        if (h->mode == H_BULK) { if (!send_all(fd, "$2147483647\r\n", 13)) break; have = 0; continue; }
        if (h->mode == H_GARBAGE) {
            while (!atomic_load(&h->stop) && send_all(fd, g_garbage, sizeof g_garbage)) {}
            break;
        }
        /* sane to PING and the rest, hostile to reads */
        for (;;) {
            int argc;
            char w[32], rep[256];
            long used = parse_cmd(buf, have, &argc, w, sizeof w);
            if (used <= 0) break;
            memmove(buf, buf + used, have - (size_t)used);
            have -= (size_t)used;
            const char *a = "-ERR unknown\r\n";
            if (!strcmp(w, "PING")) a = "+PONG\r\n";
            else if (!strcmp(w, "AUTH") || !strcmp(w, "SELECT") || !strcmp(w, "SET")) a = "+OK\r\n";
            else if (!strcmp(w, "DBSIZE") || !strcmp(w, "EXISTS") || !strcmp(w, "DEL")) a = ":0\r\n";
            else if (!strcmp(w, "INFO")) a = "$15\r\nused_memory:0\r\n\r\n";
            else if (!strcmp(w, "CLUSTER")) {
                snprintf(rep, sizeof rep, "*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n", h->port);
                a = rep;
            } else if (!strcmp(w, "MGET")) {
                if (h->mode == H_READS_ARRAY) a = "*2147483647\r\n";
                else { snprintf(rep, sizeof rep, "*%d\r\n$2147483647\r\n", argc - 1); a = rep; }
            } else if (!strcmp(w, "GET")) a = "$2147483647\r\n";
            if (!send_all(fd, a, strlen(a))) goto out;
        }
    }
out:
    close(fd);
    return NULL;
}

static void *hostile_main(void *arg) {
    hostile *h = arg;
    while (!atomic_load(&h->stop)) {
        int c = accept(h->fd, NULL, NULL);
        if (c < 0) continue;
        if (atomic_load(&h->stop)) { close(c); break; }
        struct timeval tv = {0, 200000};
        setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); /* to notice stop */
        hconn *hc = malloc(sizeof *hc);
        hc->h = h;
        hc->fd = c;
        pthread_t th;
        pthread_create(&th, NULL, hostile_conn, hc);
        pthread_detach(th);
    }
    return NULL;
}

/* Servers outlive their test by their connections' threads: never freed. */
static hostile g_hostile[16];
static int g_n_hostile;

static hostile *hostile_start(int mode) {
    assert_true(g_n_hostile < 16);
    hostile *h = &g_hostile[g_n_hostile++];
    memset(g_garbage, 'A', sizeof g_garbage);
    g_garbage[0] = '+';
    h->mode = mode;
    atomic_init(&h->stop, false);
    h->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    assert_int_equal(bind(h->fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(h->fd, 64), 0);
    assert_int_equal(getsockname(h->fd, (struct sockaddr *)&a, &n), 0);
    h->port = ntohs(a.sin_port);
    pthread_create(&h->th, NULL, hostile_main, h);
    return h;
}

static void hostile_stop(hostile *h) {
    atomic_store(&h->stop, true);
    shutdown(h->fd, SHUT_RDWR); /* wakes accept */
    pthread_join(h->th, NULL);
    close(h->fd);
}

/* Every command answered hostile: the open takes at most a timeout (here
 * 5 s, so "at once" shows), nothing is allocated for it, the tier is down,
 * said once. */
static void test_hostile_open(void **state) {
    (void)state;
    static const char *what[3] = {"reply refused: an array of 2147483647 elements",
                                  "reply refused: a string of 2147483647 bytes", "reply refused: a reply of more than 4160 bytes"};
    refused_case cs[6];
    hostile *hs[6];
    for (int i = 0; i < 6; i++) {
        hs[i] = hostile_start(H_ARRAY + i / 2);
        snprintf(cs[i].url, sizeof cs[i].url, "%s://127.0.0.1:%d", i % 2 ? "redis-cluster" : "redis", hs[i]->port);
        cs[i].o = (kv_redis_opts){.timeout_ms = HOSTILE_MS};
        cs[i].says = what[i / 2];
    }
    expect_refused(6, cs, 0.6);
    for (int i = 0; i < 6; i++) {
        printf("  %s, %s: open in %.3f s\n", cs[i].url, what[i / 2], cs[i].open_s);
        if (cs[i].open_s > 1.5) fail_msg("%s: the open took %.3f s (the refusal should be at once)", cs[i].url, cs[i].open_s);
        hostile_stop(hs[i]);
    }
}

/* A server that answers PING sanely but reads with 2^31-1: the reads are
 * refused at once (not at the timeout), miss, and are said once. */
static void test_hostile_reads(void **state) {
    (void)state;
    for (int mode = H_READS_ARRAY; mode <= H_CLUSTER_READS; mode++) {
        hostile *h = hostile_start(mode);
        char url[96];
        snprintf(url, sizeof url, "%s://127.0.0.1:%d", mode == H_CLUSTER_READS ? "redis-cluster" : "redis", h->port);
        cap_begin();
        kv_tier *t = open_with(url, &(kv_redis_opts){.timeout_ms = HOSTILE_MS});
        kv_tier_stats st;
        kv_tier_stats_get(t, &st);
        assert_true(st.up);
        kv_key k[4] = {rand_key(), rand_key(), rand_key(), rand_key()};
        static unsigned char o[4][4096];
        void *bufs[4] = {o[0], o[1], o[2], o[3]};
        size_t lens[4];
        double worst = 0;
        for (int round = 0; round < 8; round++) {
            double t0 = util_now_s();
            assert_int_equal(kv_tier_get(t, 4, k, bufs, sizeof o[0], lens), 0);
            double dt = util_now_s() - t0;
            if (dt > worst) worst = dt;
            usleep(100000); /* across reconnects */
        }
        kv_tier_close(t);
        const char *log = cap_end();
        printf("  %s, hostile reads: the slowest of 8 gets %.1f ms\n", url, worst * 1e3);
        if (worst > 1.5) fail_msg("a get took %.3f s: not refused at once", worst);
        assert_int_equal(count(log, "reply refused"), 1);
        hostile_stop(h);
    }
}

int main(void) {
    const char *b = getenv("KVLM_REDIS_SERVER");
    if (b) g_bin = b;
    if (access(g_bin, X_OK) != 0 || access(g_cli, X_OK) != 0 || access(g_openssl, X_OK) != 0) {
        fprintf(stderr, "\n*** SKIP test_tier_redis_trust: %s, %s or %s is missing (scripts/setup.sh installs "
                        "redis-server, redis-tools and openssl) ***\n\n", g_bin, g_cli, g_openssl);
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_auth, restore_stderr),
        cmocka_unit_test_teardown(test_auth_refused, restore_stderr),
        cmocka_unit_test_teardown(test_tls, restore_stderr),
        cmocka_unit_test_teardown(test_tls_refused, restore_stderr),
        cmocka_unit_test_teardown(test_cluster_tls_auth, restore_stderr),
        cmocka_unit_test_teardown(test_hostile_open, restore_stderr),
        cmocka_unit_test_teardown(test_hostile_reads, restore_stderr),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
