/* tests/test_tier_redis_cluster: the Redis tier over a Redis Cluster of 3
 * masters started here on free loopback ports (redis-cli --cluster create):
 * blocks spread over the nodes, a tier that knows one seed finds them all,
 * two tiers see each other's blocks, a slot migrated under the tier (ASK,
 * then MOVED) is followed, a node killed costs only its blocks (misses at
 * once, the others hit; puts to it drop), a node stopped (SIGSTOP) costs at
 * most the timeout and only its blocks, and a node restarted serves again.
 * Every call is timed. Skips (77) without redis-server or redis-cli. */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
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

static const char *g_bin = "/usr/bin/redis-server", *g_cli = "/usr/bin/redis-cli";
#define NODES 3
#define TIMEOUT_MS 200
#define SLACK_S 0.30 /* the test machine is shared and slow */

static char g_dir[] = "/tmp/kvlm_rcluster_XXXXXX";
static int g_port[NODES];
static pid_t g_pid[NODES] = {-1, -1, -1};
static char g_url[128];

/* ---- the cluster ---- */

/* A port p free with p + 10000 (its cluster bus) free too. */
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

static redisReply *cmd_at(int port, const char *fmt, ...) {
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    redisReply *r = NULL;
    if (c && !c->err) {
        redisSetTimeout(c, tv);
        va_list ap;
        va_start(ap, fmt);
        r = redisvCommand(c, fmt, ap);
        va_end(ap);
    }
    if (c) redisFree(c);
    return r;
}

static long long int_at(int port, const char *cmd) {
    redisReply *r = cmd_at(port, cmd);
    long long v = r && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r) freeReplyObject(r);
    return v;
}

static bool info_has(int port, const char *what) {
    redisReply *r = cmd_at(port, "CLUSTER INFO");
    bool ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, what);
    if (r) freeReplyObject(r);
    return ok;
}

static void node_start(int i) {
    char port[16], dir[sizeof g_dir + 16], log[sizeof dir + 8];
    snprintf(port, sizeof port, "%d", g_port[i]);
    snprintf(dir, sizeof dir, "%s/n%d", g_dir, i);
    mkdir(dir, 0755);
    snprintf(log, sizeof log, "%s/log", dir);
    pid_t pid = fork();
    if (pid < 0) fail_msg("fork: %s", strerror(errno));
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a crashed test */
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); close(fd); }
        execl(g_bin, g_bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir,
              "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
              "--cluster-require-full-coverage", "no", "--daemonize", "no", "--loglevel", "warning", (char *)NULL);
        _exit(127);
    }
    g_pid[i] = pid;
    double t0 = util_now_s();
    for (;;) {
        redisReply *r = cmd_at(g_port[i], "PING");
        bool ok = r && r->type == REDIS_REPLY_STATUS;
        if (r) freeReplyObject(r);
        if (ok) break;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) { g_pid[i] = -1; fail_msg("redis-server exited at start; see %s", log); }
        if (util_now_s() - t0 > 10) fail_msg("redis-server on %d did not answer within 10 s", g_port[i]);
        usleep(20000);
    }
}

static void node_kill(int i) {
    if (g_pid[i] > 0) {
        kill(g_pid[i], SIGCONT);
        kill(g_pid[i], SIGKILL);
        waitpid(g_pid[i], NULL, 0);
        g_pid[i] = -1;
    }
}

/* Every live node reports the cluster ok with all slots assigned (20 s). */
static void wait_ok(void) {
    double t0 = util_now_s();
    for (;;) {
        bool ok = true;
        for (int i = 0; i < NODES && ok; i++)
            ok = g_pid[i] < 0 || (info_has(g_port[i], "cluster_state:ok") && info_has(g_port[i], "cluster_slots_assigned:16384"));
        if (ok) return;
        if (util_now_s() - t0 > 20) fail_msg("the cluster did not report cluster_state:ok within 20 s");
        usleep(50000);
    }
}

static int setup(void **state) {
    (void)state;
    if (!mkdtemp(g_dir)) fail_msg("mkdtemp: %s", strerror(errno));
    for (int i = 0; i < NODES; i++) {
        if ((g_port[i] = free_port()) < 0) fail_msg("no free port");
        for (int j = 0; j < i; j++)
            if (g_port[j] == g_port[i] || abs(g_port[j] - g_port[i]) == 10000) { i--; break; }
    }
    for (int i = 0; i < NODES; i++) node_start(i);
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "timeout 30 %s --cluster create 127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d --cluster-replicas 0 --cluster-yes "
             ">%s/create.log 2>&1",
             g_cli, g_port[0], g_port[1], g_port[2], g_dir);
    if (system(cmd) != 0) fail_msg("redis-cli --cluster create failed; see %s/create.log", g_dir);
    wait_ok();
    /* one seed: the tier finds the other nodes itself */
    snprintf(g_url, sizeof g_url, "redis-cluster://127.0.0.1:%d", g_port[1]);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    for (int i = 0; i < NODES; i++) node_kill(i);
    char cmd[sizeof g_dir + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return 0;
}

/* ---- blocks ---- */

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
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
static void fill(unsigned char *p, size_t n, int tag) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31 + (size_t)tag * 7);
}

/* The node index holding a key's slot, by asking the nodes (EXISTS on a
 * node that does not serve the slot answers MOVED). */
static int owner(const kv_key *k) {
    char hex[KV_KEY_HEX];
    kv_key_hex(k, hex);
    for (int i = 0; i < NODES; i++) {
        if (g_pid[i] < 0) continue;
        redisReply *r = cmd_at(g_port[i], "EXISTS kvlm:blk:%s", hex);
        bool mine = r && r->type == REDIS_REPLY_INTEGER;
        if (r) freeReplyObject(r);
        if (mine) return i;
    }
    return -1;
}

/* Redis Cluster's slot of a block's key (CRC16-XMODEM of the name). */
static long long slot_of(const kv_key *k) {
    char name[64] = "kvlm:blk:";
    kv_key_hex(k, name + 9);
    uint16_t crc = 0;
    for (const char *p = name; *p; p++) {
        crc ^= (uint16_t)((unsigned char)*p << 8);
        for (int i = 0; i < 8; i++) crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc & 16383;
}

static kv_tier *open_ok(const char *url) {
    kvlm_error err = {0};
    double t0 = util_now_s();
    kv_tier *t = kv_tier_redis_open(url, &(kv_redis_opts){.timeout_ms = TIMEOUT_MS}, &err);
    if (!t) fail_msg("open %s: %s", url, err.msg);
    double dt = util_now_s() - t0;
    /* at most one timeout per seed and node (a dead node: refused at once) */
    if (dt > 2 * TIMEOUT_MS / 1000.0 + SLACK_S) fail_msg("open %s took %.3f s", url, dt);
    return t;
}

#define BOUNDED(what, expr)                                                                              \
    do {                                                                                                 \
        double t0_ = util_now_s();                                                                       \
        expr;                                                                                            \
        double dt_ = util_now_s() - t0_;                                                                 \
        if (dt_ > TIMEOUT_MS / 1000.0 + SLACK_S) fail_msg("%s took %.3f s (line %d)", what, dt_, __LINE__); \
    } while (0)

enum { BS = 4096 };

/* Gets n blocks in batches of 16; counts those that came back right. */
static int get_all(kv_tier *t, int n, const kv_key *keys, const int *tags, bool *found) {
    static unsigned char out[16][BS], want[BS];
    void *bufs[16];
    size_t lens[16];
    for (int i = 0; i < 16; i++) bufs[i] = out[i];
    int good = 0;
    for (int i = 0; i < n; i += 16) {
        int m = n - i < 16 ? n - i : 16;
        BOUNDED("get", kv_tier_get(t, m, keys + i, bufs, BS, lens));
        for (int j = 0; j < m; j++) {
            fill(want, BS, tags[i + j]);
            bool ok = lens[j] == BS && !memcmp(out[j], want, BS);
            if (lens[j] && !ok) fail_msg("block %d came back wrong (%zu bytes)", i + j, lens[j]);
            if (found) found[i + j] = ok;
            good += ok;
        }
    }
    return good;
}

static void put_all(kv_tier *t, int n, const kv_key *keys, const int *tags, int *dropped) {
    static unsigned char blk[BS];
    *dropped = 0;
    for (int i = 0; i < n; i++) {
        fill(blk, BS, tags[i]);
        bool ok;
        BOUNDED("put", ok = kv_tier_put(t, &keys[i], blk, BS));
        *dropped += !ok;
    }
    BOUNDED("flush", kv_tier_flush(t));
}

/* ---- tests ---- */

static void test_bad_urls(void **state) {
    (void)state;
    const char *bad[] = {"redis-cluster://", "redis-cluster://127.0.0.1", "redis-cluster://127.0.0.1:1,",
                         "redis-cluster://127.0.0.1:1,,127.0.0.1:2", "redis-cluster://127.0.0.1:1/0",
                         "redis-cluster://a:@127.0.0.1:1", "redis-cluster://127.0.0.1:70000", "redis://127.0.0.1:1?proxy=2",
                         "redis://127.0.0.1:1/2?proxy=1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kvlm_error err = {0};
        kv_tier *t = kv_tier_redis_open(bad[i], &(kv_redis_opts){.timeout_ms = TIMEOUT_MS}, &err);
        if (t) { kv_tier_close(t); fail_msg("bad URL '%s' opened", bad[i]); }
        assert_int_equal(err.code, KVLM_EINVAL);
    }
    /* nothing listening: opens down; puts drop, gets miss, at once */
    kv_tier *t = open_ok("redis-cluster://127.0.0.1:1,127.0.0.1:2");
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_false(st.up);
    kv_key k = rand_key();
    int tag = 1, dropped;
    put_all(t, 1, &k, &tag, &dropped);
    assert_int_equal(dropped, 1);
    assert_int_equal(get_all(t, 1, &k, &tag, NULL), 0);
    BOUNDED("close", kv_tier_close(t));
}

/* Blocks spread over the three nodes; one seed is enough; round trip,
 * contains, drop; a second tier (another process) sees them. */
static void test_spread_and_share(void **state) {
    (void)state;
    enum { N = 90 };
    kv_key keys[N];
    int tags[N], per_node[NODES] = {0}, dropped;
    long long before[NODES];
    for (int i = 0; i < NODES; i++) before[i] = int_at(g_port[i], "DBSIZE");
    for (int i = 0; i < N; i++) { keys[i] = rand_key(); tags[i] = i; }
    kv_tier *a = open_ok(g_url);
    put_all(a, N, keys, tags, &dropped);
    assert_int_equal(dropped, 0);
    for (int i = 0; i < N; i++) {
        int o = owner(&keys[i]);
        assert_true(o >= 0);
        per_node[o]++;
    }
    long long total = 0;
    for (int i = 0; i < NODES; i++) {
        long long d = int_at(g_port[i], "DBSIZE") - before[i];
        printf("node %d (port %d): %lld blocks (%d by slot)\n", i, g_port[i], d, per_node[i]);
        assert_int_equal(d, per_node[i]);
        assert_true(per_node[i] >= N / 6); /* ~N/3 each */
        total += d;
    }
    assert_int_equal(total, N);
    assert_int_equal(get_all(a, N, keys, tags, NULL), N);
    int c;
    BOUNDED("contains", c = kv_tier_contains(a, N, keys));
    assert_int_equal(c, N);
    kv_tier_stats st;
    kv_tier_stats_get(a, &st);
    assert_true(st.up);
    assert_int_equal(st.writes, N);
    assert_int_equal(st.write_bytes, (uint64_t)N * BS);
    assert_int_equal(st.hits, N);
    assert_int_equal(st.misses, 0);
    assert_int_equal(st.errors, 0);

    /* a second tier, seeded elsewhere, sees them; its puts are a's hits */
    char url2[128];
    snprintf(url2, sizeof url2, "redis-cluster://127.0.0.1:%d,127.0.0.1:%d", g_port[2], g_port[0]);
    kv_tier *b = open_ok(url2);
    assert_int_equal(get_all(b, N, keys, tags, NULL), N);
    kv_key k2[8];
    int t2[8];
    for (int i = 0; i < 8; i++) { k2[i] = rand_key(); t2[i] = 1000 + i; }
    put_all(b, 8, k2, t2, &dropped);
    assert_int_equal(dropped, 0);
    assert_int_equal(get_all(a, 8, k2, t2, NULL), 8);

    /* a hole: the leading count stops there, the blocks after it still come */
    kv_key mixed[4] = {keys[0], keys[1], rand_key(), keys[2]};
    static unsigned char out[4][BS];
    void *bufs[4] = {out[0], out[1], out[2], out[3]};
    size_t lens[4];
    int lead;
    BOUNDED("get", lead = kv_tier_get(a, 4, mixed, bufs, BS, lens));
    assert_int_equal(lead, 2);
    assert_int_equal(lens[2], 0);
    assert_int_equal(lens[3], BS);
    BOUNDED("contains", c = kv_tier_contains(a, 4, mixed));
    assert_int_equal(c, 2);
    /* drop */
    kv_tier_drop(b, &keys[0]);
    kv_tier_flush(b);
    BOUNDED("contains", c = kv_tier_contains(a, 2, keys));
    assert_int_equal(c, 0);
    kv_tier_close(b);
    kv_tier_close(a);
}

/* A slot migrated under the tier: ASK while migrating, MOVED after. */
static void test_migration(void **state) {
    (void)state;
    kv_tier *t = open_ok(g_url);
    kv_key k = rand_key();
    int tag = 77, dropped;
    put_all(t, 1, &k, &tag, &dropped);
    assert_int_equal(dropped, 0);
    char hex[KV_KEY_HEX];
    kv_key_hex(&k, hex);
    int src = owner(&k), dst = (src + 1) % NODES;
    redisReply *r = cmd_at(g_port[src], "CLUSTER KEYSLOT kvlm:blk:%s", hex);
    assert_non_null(r);
    long long slot = r->integer;
    freeReplyObject(r);
    assert_int_equal(slot, slot_of(&k)); /* the tier's hash is the server's */
    char id[NODES][64];
    for (int i = 0; i < NODES; i++) {
        r = cmd_at(g_port[i], "CLUSTER MYID");
        assert_true(r && r->type == REDIS_REPLY_STRING);
        snprintf(id[i], sizeof id[i], "%s", r->str);
        freeReplyObject(r);
    }
    r = cmd_at(g_port[dst], "CLUSTER SETSLOT %lld IMPORTING %s", slot, id[src]);
    assert_true(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    r = cmd_at(g_port[src], "CLUSTER SETSLOT %lld MIGRATING %s", slot, id[dst]);
    assert_true(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    r = cmd_at(g_port[src], "MIGRATE 127.0.0.1 %d kvlm:blk:%s 0 5000", g_port[dst], hex);
    assert_true(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    /* the key is on dst now, its slot still src's: src answers ASK */
    r = cmd_at(g_port[src], "GET kvlm:blk:%s", hex);
    assert_true(r && r->type == REDIS_REPLY_ERROR && !strncmp(r->str, "ASK ", 4));
    freeReplyObject(r);
    assert_int_equal(get_all(t, 1, &k, &tag, NULL), 1);
    int c;
    BOUNDED("contains", c = kv_tier_contains(t, 1, &k));
    assert_int_equal(c, 1);
    /* the migration ends: every node is told dst owns the slot; src answers MOVED */
    for (int i = 0; i < NODES; i++) {
        r = cmd_at(g_port[i], "CLUSTER SETSLOT %lld NODE %s", slot, id[dst]);
        assert_true(r && r->type == REDIS_REPLY_STATUS);
        freeReplyObject(r);
    }
    r = cmd_at(g_port[src], "GET kvlm:blk:%s", hex);
    assert_true(r && r->type == REDIS_REPLY_ERROR && !strncmp(r->str, "MOVED ", 6));
    freeReplyObject(r);
    assert_int_equal(get_all(t, 1, &k, &tag, NULL), 1);
    /* a new block of that slot goes to dst once the map is re-read (a put
     * answered MOVED is dropped and asks for the map) */
    kv_key k2;
    do k2 = rand_key();
    while (slot_of(&k2) != slot);
    double t0 = util_now_s();
    int tag2 = 78;
    bool on_dst = false;
    while (!on_dst && util_now_s() - t0 < 5) {
        put_all(t, 1, &k2, &tag2, &dropped);
        on_dst = get_all(t, 1, &k2, &tag2, NULL) == 1;
        if (!on_dst) usleep(100000);
    }
    printf("slot %lld moved from node %d to %d: new blocks land there after %.2f s\n", slot, src, dst, util_now_s() - t0);
    assert_int_equal(owner(&k2), dst);
    assert_true(on_dst);
    kv_tier_close(t);
}

/* A node killed: its blocks miss at once, the others hit; puts to its
 * slots drop; a tier opened meanwhile works for the rest. Restarted (same
 * nodes.conf, empty): it serves again. */
static void test_node_dies(void **state) {
    (void)state;
    enum { N = 96 };
    kv_key keys[N];
    int tags[N], own[N], dropped, on_dead = 0;
    bool found[N];
    for (int i = 0; i < N; i++) { keys[i] = rand_key(); tags[i] = 2000 + i; }
    kv_tier *t = open_ok(g_url);
    put_all(t, N, keys, tags, &dropped);
    assert_int_equal(dropped, 0);
    const int dead = 0;
    for (int i = 0; i < N; i++) on_dead += (own[i] = owner(&keys[i])) == dead;
    assert_true(on_dead > 0 && on_dead < N);
    node_kill(dead);
    double t0 = util_now_s();
    int got = get_all(t, N, keys, tags, found);
    printf("node %d killed: %d of %d blocks found (%d were on it) in %.1f ms\n", dead, got, N, on_dead,
           (util_now_s() - t0) * 1e3);
    assert_int_equal(got, N - on_dead);
    for (int i = 0; i < N; i++) assert_int_equal(found[i], own[i] != dead);
    /* again: no connection now, misses at once */
    t0 = util_now_s();
    assert_int_equal(get_all(t, N, keys, tags, NULL), N - on_dead);
    double dt = util_now_s() - t0;
    printf("again: %.1f ms for %d batches\n", dt * 1e3, (N + 15) / 16);
    assert_true(dt < 6 * 0.05 + SLACK_S);
    /* new blocks: those of live nodes stored, the dead node's dropped */
    kv_key nk[N];
    int ntag[N], n_dead = 0;
    for (int i = 0; i < N; i++) { nk[i] = keys[i]; ntag[i] = 3000 + i; n_dead += own[i] == dead; }
    for (int i = 0; i < N; i++) kv_tier_drop(t, &nk[i]);
    kv_tier_flush(t);
    put_all(t, N, nk, ntag, &dropped);
    assert_int_equal(dropped, n_dead);
    assert_int_equal(get_all(t, N, nk, ntag, NULL), N - n_dead);
    /* a tier opened now (its seed list names the dead node first) */
    char url2[128];
    snprintf(url2, sizeof url2, "redis-cluster://127.0.0.1:%d,127.0.0.1:%d", g_port[dead], g_port[2]);
    kv_tier *u = open_ok(url2);
    assert_int_equal(get_all(u, N, nk, ntag, NULL), N - n_dead);
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    assert_true(st.up); /* the other nodes are */

    /* restarted: empty (no persistence), back in the cluster, serving */
    node_start(dead);
    wait_ok();
    double r0 = util_now_s();
    int back = 0;
    while (util_now_s() - r0 < 10) {
        put_all(t, N, nk, ntag, &dropped);
        if ((back = get_all(t, N, nk, ntag, NULL)) == N) break;
        usleep(200000);
    }
    printf("restarted node serves again after %.1f s\n", util_now_s() - r0);
    assert_int_equal(back, N);
    assert_int_equal(get_all(u, N, nk, ntag, NULL), N);
    kv_tier_close(u);
    kv_tier_close(t);
}

/* A node that stops answering (SIGSTOP): a get costs at most the timeout,
 * the other nodes' blocks in the same batch still hit, and only the first
 * batch pays the timeout: its broken connection takes the node's idle ones
 * with it, so later batches miss its blocks at once (with 4 readers a node,
 * 4 batches paid it before). */
static void test_node_hangs(void **state) {
    (void)state;
    enum { N = 48 };
    kv_key keys[N];
    int tags[N], own[N], dropped, on_hung = 0;
    bool found[N];
    for (int i = 0; i < N; i++) { keys[i] = rand_key(); tags[i] = 4000 + i; }
    kv_tier *t = open_ok(g_url);
    put_all(t, N, keys, tags, &dropped);
    assert_int_equal(dropped, 0);
    const int hung = 2;
    for (int i = 0; i < N; i++) on_hung += (own[i] = owner(&keys[i])) == hung;
    kill(g_pid[hung], SIGSTOP);
    double t0 = util_now_s();
    int got = get_all(t, N, keys, tags, found); /* BOUNDED per batch inside */
    printf("node %d stopped: %d of %d found (%d on it) in %.1f ms\n", hung, got, N, on_hung, (util_now_s() - t0) * 1e3);
    double later = 0;
    for (int k = 0; k < 6; k++) { /* 18 batches of 16 */
        double a = util_now_s();
        assert_int_equal(get_all(t, N, keys, tags, NULL), N - on_hung);
        later = util_now_s() - a > later ? util_now_s() - a : later;
    }
    printf("  then 6 x %d blocks: the slowest in %.1f ms\n", N, later * 1e3);
    if (later > TIMEOUT_MS / 2 / 1000.0) fail_msg("a later get waited on the hung node: %.3f s", later);
    if (util_now_s() - t0 > 2 * TIMEOUT_MS / 1000.0 + SLACK_S) fail_msg("more than one batch paid the timeout");
    assert_int_equal(got, N - on_hung);
    for (int i = 0; i < N; i++) assert_int_equal(found[i], own[i] != hung);
    kill(g_pid[hung], SIGCONT);
    /* it answers again: back within its reconnect period */
    double r0 = util_now_s();
    while (get_all(t, N, keys, tags, NULL) != N && util_now_s() - r0 < 10) usleep(100000);
    assert_int_equal(get_all(t, N, keys, tags, NULL), N);
    kv_tier_close(t);
}

int main(void) {
    const char *b = getenv("KVLM_REDIS_SERVER");
    if (b) g_bin = b;
    if (access(g_bin, X_OK) != 0 || access(g_cli, X_OK) != 0) {
        printf("SKIP: %s or %s not found (scripts/setup.sh installs redis-server and redis-tools)\n", g_bin, g_cli);
        return 77;
    }
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_urls),
        cmocka_unit_test(test_spread_and_share),
        cmocka_unit_test(test_migration),
        cmocka_unit_test(test_node_hangs),
        cmocka_unit_test(test_node_dies),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
