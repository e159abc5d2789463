/* bench/bench_tier_redis: the Redis tier's put and get speed (MB/s) against a
 * running server, a Redis Cluster (redis-cluster://...) or a twemproxy
 * (redis://...?proxy=1) (bench/bench_tier_redis.sh starts them and compares
 * with redis-benchmark in the same run). -x CMD runs a shell command between
 * the puts and the gets (the script kills a node with it) and reports the
 * hits and the slowest get.
 *
 * Block sizes (default): 720,896 bytes, a TinyLlama-1.1B block of 16 tokens
 * (22 layers x K,V x 4 KV heads x 64 x 16 tokens at 4 bytes: f32, or f16 at
 * 32 tokens); and 45,056 bytes, a small block standing for a q8_0 block of
 * a small model (stories15M's q8_0 16-token block is 58,752 bytes: 6 layers
 * x K,V x 288 / 32 x 34 bytes x 16 tokens) — what matters is ~45 KB against
 * ~700 KB: per-command cost against bandwidth.
 *
 * put: N puts, then flush; MB/s over the whole (a full queue: flush, put
 * again, counted). get: the same blocks back in MGETs of `batch` keys. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kv/redis_conn.h"
#include "kv/tier.h"
#include "util/timing.h"

static void usage(void) {
    fprintf(stderr,
            "usage: bench_tier_redis URL [-n blocks] [-s size,size,...] [-b batch] [-t timeout_ms] [-x command]\n"
            "                        [--tls-ca FILE] [--tls-cert FILE] [--tls-key FILE]\n"
            "  URL: redis[s]://[USER:PASSWORD@]HOST:PORT[/DB][?proxy=1] or redis[s]-cluster://HOST:PORT[,HOST:PORT...]\n"
            "  the password may come from $KVLM_REDIS_PASSWORD\n"
            "  defaults: -n 200 -s 720896,45056 -b 8 -t 2000\n");
    exit(2);
}

static const char *g_between; /* -x */
static const char *g_password, *g_ca, *g_cert, *g_key;

static void bench_size(kv_tier *t, size_t size, int n, int batch, uint64_t seed) {
    unsigned char *blk = malloc(size);
    kv_key *keys = malloc(sizeof *keys * (size_t)n);
    void **bufs = malloc(sizeof *bufs * (size_t)batch);
    size_t *lens = malloc(sizeof *lens * (size_t)batch);
    if (!blk || !keys || !bufs || !lens) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (int i = 0; i < batch; i++)
        if (!(bufs[i] = malloc(size))) { fprintf(stderr, "out of memory\n"); exit(1); }
    uint64_t s = seed;
    for (size_t i = 0; i < size; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        blk[i] = (unsigned char)(s >> 56);
    }
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < 16; j++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            keys[i].b[j] = (unsigned char)(s >> 56);
        }
    }
    kv_tier_stats st0, st;
    kv_tier_stats_get(t, &st0);
    int retries = 0;
    double t0 = util_now_s();
    for (int i = 0; i < n; i++) {
        blk[0] = (unsigned char)i; /* each block its own bytes */
        if (!kv_tier_put(t, &keys[i], blk, size)) { /* queue full: let it drain, once */
            kv_tier_flush(t);
            retries++;
            if (!kv_tier_put(t, &keys[i], blk, size)) { /* down (a dead node's slots): counted below */
                if (!g_between) { fprintf(stderr, "put %d failed twice (is the server up?)\n", i); exit(1); }
            }
        }
    }
    kv_tier_flush(t);
    double put_s = util_now_s() - t0;
    kv_tier_stats_get(t, &st);
    uint64_t written = st.writes - st0.writes;
    if (written != (uint64_t)n) fprintf(stderr, "warning: %llu of %d blocks written\n", (unsigned long long)written, n);

    if (g_between) {
        if (system(g_between) != 0) fprintf(stderr, "warning: -x command failed\n");
        nanosleep(&(struct timespec){0, 500000000}, NULL);
    }
    int hits = 0, found = 0;
    double slowest = 0;
    t0 = util_now_s();
    for (int i = 0; i < n; i += batch) {
        int m = n - i < batch ? n - i : batch;
        double c0 = util_now_s();
        hits += kv_tier_get(t, m, keys + i, bufs, size, lens);
        double dt = util_now_s() - c0;
        if (dt > slowest) slowest = dt;
        for (int j = 0; j < m; j++) found += lens[j] == size;
    }
    double get_s = util_now_s() - t0;
    /* check the last batch's bytes (outside the timing) */
    int last = (n - 1) / batch * batch;
    for (int i = last; i < n && !g_between; i++) {
        blk[0] = (unsigned char)i;
        if (lens[i - last] != size || memcmp(bufs[i - last], blk, size) != 0) {
            fprintf(stderr, "block %d came back wrong\n", i);
            exit(1);
        }
    }
    double mb = (double)size * n / 1e6;
    printf("size %zu: put %.1f MB/s (%d blocks, %.3f s, %d queue-full retries), get %.1f MB/s (batches of %d, %d/%d found, "
           "%d in leading runs, %.3f s, slowest batch %.1f ms)\n",
           size, mb / put_s, n, put_s, retries, mb / get_s, batch, found, n, hits, get_s, slowest * 1e3);
    printf("TIER %zu %.1f %.1f\n", size, mb / put_s, mb / get_s);
    printf("FOUND %zu %d %d %.1f\n", size, found, n, slowest * 1e3);
    for (int i = 0; i < batch; i++) free(bufs[i]);
    free(bufs);
    free(lens);
    free(keys);
    free(blk);
}

int main(int argc, char **argv) {
    if (argc < 2 || argv[1][0] == '-') usage();
    const char *url = argv[1], *sizes = "720896,45056";
    int n = 200, batch = 8, timeout = 2000;
    for (int i = 2; i < argc; i++) {
        if (i + 1 >= argc) usage();
        if (!strcmp(argv[i], "-n")) n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-s")) sizes = argv[++i];
        else if (!strcmp(argv[i], "-b")) batch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-t")) timeout = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-x")) g_between = argv[++i];
        else if (!strcmp(argv[i], "--tls-ca")) g_ca = argv[++i];
        else if (!strcmp(argv[i], "--tls-cert")) g_cert = argv[++i];
        else if (!strcmp(argv[i], "--tls-key")) g_key = argv[++i];
        else usage();
    }
    if (n < 1 || batch < 1 || batch > 1024) usage();
    g_password = getenv("KVLM_REDIS_PASSWORD");
    if (g_password && !*g_password) g_password = NULL;
    kvlm_error err = {0};
    /* a generous timeout: an MGET of 8 large blocks on a shared machine */
    kv_tier *t = kv_tier_redis_open(url, &(kv_redis_opts){timeout, g_password, g_ca, g_cert, g_key}, &err);
    if (!t) { fprintf(stderr, "%s\n", err.msg); return 1; }
    kv_tier_stats st;
    kv_tier_stats_get(t, &st);
    if (!st.up) { fprintf(stderr, "no Redis answering (see the tier's warning)\n"); kv_tier_close(t); return 1; }
    char shown[512];
    rconn_redact(url, shown, sizeof shown); /* never the password */
    printf("redis tier at %s: %d blocks per size, gets in MGETs of %d\n", shown, n, batch);
    uint64_t seed = (uint64_t)time(NULL) * 2654435761u;
    for (const char *p = sizes; *p;) {
        char *end;
        unsigned long long size = strtoull(p, &end, 10);
        if (end == p || size == 0 || size > ((size_t)64 << 20)) usage();
        bench_size(t, (size_t)size, n, batch, seed++);
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') usage();
    }
    nanosleep(&(struct timespec){1, 100000000}, NULL); /* one more stats poll: the server's count */
    kv_tier_stats_get(t, &st);
    printf("tier stats: writes %llu, dropped %llu, errors %llu, hits %llu, misses %llu, server keys %llu, used_memory %llu\n",
           (unsigned long long)st.writes, (unsigned long long)st.dropped_writes, (unsigned long long)st.errors,
           (unsigned long long)st.hits, (unsigned long long)st.misses, (unsigned long long)st.blocks,
           (unsigned long long)st.bytes);
    kv_tier_close(t);
    return 0;
}
