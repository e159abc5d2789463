/* bench/bench_tiers: time to first token of a request whose 2,048-token
 * prefix is cached, against recomputing it, on random-weight models of the
 * TinyLlama-1.1B shape and the stories110M shape (Q8_0 weights, f16 cache):
 *   recompute  the whole prompt through the model (no cache);
 *   RAM hit    the prefix's blocks still in the pool;
 *   disk hit   a fresh context, the blocks on the disk tier, the page cache of
 *              its files dropped first (fdatasync + posix_fadvise DONTNEED);
 *   redis hit  a fresh context, the blocks in Redis (written through by the
 *              first context) - only with a URL (bench_tiers.sh starts a
 *              redis-server).
 * Each hit is printed as a ratio to recompute, with its spread over the runs,
 * the bytes per second the promotion reached, and whether the last token's
 * logits equal the recompute's. Then the same with signed blocks (--kv-key:
 * HMAC-SHA-256 over every block written and read), and signed against
 * unsigned for each tier. Usage:
 *   bench_tiers [THREADS] [SHAPE: tinyllama|stories110m|both] [DISK DIR] [REDIS URL] [RUNS] */
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "bench_common.h"
#include "kv/blockfmt.h"
#include "kvlm.h"
#include "util/timing.h"

#define PREFIX 2048
#define SUFFIX 16

static int threads = 2, runs = 3;
static const char *disk_dir = "/tmp/kvlm-bench-tiers", *redis_url = NULL;
static const char *mac_key; /* the signed pass's key (NULL: unsigned) */

static int drop_one(const char *path, const struct stat *st, int type, struct FTW *f) {
    (void)st, (void)f;
    if (type != FTW_F) return 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
    return 0;
}

static int rm_one(const char *path, const struct stat *st, int type, struct FTW *f) {
    (void)st, (void)type, (void)f;
    remove(path);
    return 0;
}

static kvlm_ctx *make_ctx(kvlm_model *m, const char *disk, const char *redis) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = threads;
    cp.n_ctx = PREFIX + SUFFIX + 16;
    cp.kv_disk = disk;
    cp.kv_disk_size = (uint64_t)4 << 30;
    cp.kv_redis = redis;
    cp.kv_mac_key = mac_key;
    cp.kv_mac_key_len = mac_key ? strlen(mac_key) : 0;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) { fprintf(stderr, "context: %s\n", err.msg); exit(1); }
    return ctx;
}

/* Seconds from the lookup to the last token's logits; copies them to out. */
static double ttft(kvlm_ctx *ctx, const int32_t *ids, int n, float *out, int V, int *reused) {
    kvlm_seq_free(ctx, 0);
    double t0 = util_now_s();
    *reused = kvlm_seq_reuse_prefix(ctx, 0, ids, n);
    kvlm_batch b = {n - *reused, ids + *reused, NULL, NULL, NULL};
    kvlm_error err = {0};
    if (kvlm_decode(ctx, &b, &err)) { fprintf(stderr, "decode: %s\n", err.msg); exit(1); }
    double dt = util_now_s() - t0;
    memcpy(out, kvlm_get_logits(ctx, -1), (size_t)V * sizeof(float));
    return dt;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double max_diff(const float *a, const float *b, int n) {
    double d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

/* One tier's hits: runs fresh contexts (page cache dropped for disk); the median. */
static double tier_hits(kvlm_model *m, const char *name, const char *disk, const char *redis, const int32_t *ids,
                      int V, const float *want, double t_re) {
    double t[16];
    float *got = calloc((size_t)V, sizeof(float));
    int reused = 0;
    double bytes = 0, read_s = 0;
    for (int r = 0; r < runs; r++) {
        if (disk) nftw(disk, drop_one, 16, FTW_PHYS);
        kvlm_ctx *ctx = make_ctx(m, disk, redis);
        t[r] = ttft(ctx, ids, PREFIX + SUFFIX, got, V, &reused);
        kvlm_kv_tier_stats ts;
        if (kvlm_kv_tier_stats_get(ctx, &ts, 1) == 1) {
            kvlm_kv_stats kst;
            kvlm_kv_stats_get(ctx, &kst);
            bytes = (double)ts.promoted * (double)kst.block_bytes;
            read_s = ts.read_seconds;
        }
        kvlm_ctx_free(ctx);
    }
    qsort(t, (size_t)runs, sizeof t[0], cmp_d);
    printf("  %-10s %8.1f ms  (%.1f..%.1f)  %7.1fx faster than recompute  reused %d  tier reads %.0f MB/s  "
           "logits vs recompute %.2g, vs RAM hit identical: ",
           name, 1e3 * t[runs / 2], 1e3 * t[0], 1e3 * t[runs - 1], t_re / t[runs / 2], reused,
           read_s > 0 ? bytes / read_s / 1e6 : 0.0, max_diff(got, want, V));
    free(got);
    return t[runs / 2];
}

/* One pass (unsigned, or signed with mac_key): medians of the disk and redis hits. */
static void run_pass(const bench_shape *s, kvlm_model *m, double *t_disk, double *t_redis) {
    int V = s->vocab;
    int32_t *ids = malloc((PREFIX + SUFFIX) * sizeof(int32_t));
    uint64_t r = 12345;
    for (int i = 0; i < PREFIX + SUFFIX; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        ids[i] = 3 + (int32_t)((r >> 33) % (uint64_t)(V - 3));
    }
    ids[0] = 1;
    nftw(disk_dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    float *want = malloc((size_t)V * sizeof(float)), *ram = malloc((size_t)V * sizeof(float));
    /* the first context: recompute (writing through to redis), then RAM hits;
     * freeing it writes its blocks to disk */
    kvlm_ctx *ctx = make_ctx(m, disk_dir, redis_url);
    int reused;
    double t_re = ttft(ctx, ids, PREFIX + SUFFIX, want, V, &reused);
    kvlm_kv_stats kst;
    kvlm_kv_stats_get(ctx, &kst);
    printf("%s shape (dim %d, %d layers, %d/%d heads), Q8_0 weights, f16 cache, %d threads: %d-token prefix "
           "(%d blocks of %zu bytes = %.1f MB) + %d new tokens%s\n",
           s->name, s->dim, s->layers, s->heads, s->kv, threads, PREFIX, PREFIX / kst.block_size, kst.block_bytes,
           (double)PREFIX / kst.block_size * (double)kst.block_bytes / 1e6, SUFFIX,
           mac_key ? ", blocks signed (HMAC-SHA-256)" : "");
    printf("  %-10s %8.1f ms  (one run)\n", "recompute", 1e3 * t_re);
    double t[16];
    for (int k = 0; k < runs; k++) t[k] = ttft(ctx, ids, PREFIX + SUFFIX, ram, V, &reused);
    qsort(t, (size_t)runs, sizeof t[0], cmp_d);
    printf("  %-10s %8.1f ms  (%.1f..%.1f)  %7.1fx faster than recompute  reused %d  logits vs recompute %.2g\n",
           "RAM hit", 1e3 * t[runs / 2], 1e3 * t[0], 1e3 * t[runs - 1], t_re / t[runs / 2], reused,
           max_diff(ram, want, V));
    kvlm_seq_free(ctx, 0);
    kvlm_ctx_kv_persist(ctx);
    kvlm_kv_tier_stats ts[KVLM_MAX_KV_TIERS];
    int nt = kvlm_kv_tier_stats_get(ctx, ts, KVLM_MAX_KV_TIERS);
    for (int i = 0; i < nt; i++)
        printf("  (%s tier after the first context: %llu blocks written, %llu dropped)\n", ts[i].name,
               (unsigned long long)ts[i].writes, (unsigned long long)ts[i].dropped_writes);
    kvlm_ctx_free(ctx);

    float *got = malloc((size_t)V * sizeof(float));
    *t_disk = tier_hits(m, "disk hit", disk_dir, NULL, ids, V, want, t_re);
    { /* the logits of one more disk hit against the RAM hit's: the same bytes came back */
        kvlm_ctx *c2 = make_ctx(m, disk_dir, NULL);
        ttft(c2, ids, PREFIX + SUFFIX, got, V, &reused);
        printf("%s\n", memcmp(got, ram, (size_t)V * sizeof(float)) ? "NO" : "yes");
        kvlm_ctx_free(c2);
    }
    if (redis_url) {
        *t_redis = tier_hits(m, "redis hit", NULL, redis_url, ids, V, want, t_re);
        kvlm_ctx *c3 = make_ctx(m, NULL, redis_url);
        ttft(c3, ids, PREFIX + SUFFIX, got, V, &reused);
        printf("%s\n", memcmp(got, ram, (size_t)V * sizeof(float)) ? "NO" : "yes");
        kvlm_ctx_free(c3);
    } else printf("  redis hit  (no URL given: bench_tiers.sh starts a redis-server)\n");
    free(got);
    free(want);
    free(ram);
    free(ids);
}

/* What signing costs one block of `bytes` payload: seal + check, checksum against HMAC-SHA-256. */
static void seal_cost(size_t bytes) {
    kv_blockfmt f = {{{0}}, KVLM_CACHE_F16, KVLM_CACHE_F16, 16, 1, 1, 64, bytes, false, NULL, 0};
    int32_t toks[16] = {0};
    kv_key key;
    const char *secret = "bench_tiers: a per-deployment secret";
    kv_blockauth *a = kv_blockauth_create(secret, strlen(secret), NULL);
    double us[2];
    for (int signed_ = 0; signed_ < 2; signed_++) {
        f.auth = signed_ ? a : NULL;
        kv_block_key(&f, NULL, toks, &key);
        size_t n = kv_blockfmt_bytes(&f);
        uint8_t *b = calloc(1, n);
        double best = 1e9;
        for (int r = 0; r < 20; r++) {
            double t0 = util_now_s();
            kv_blockfmt_begin(&f, &key, toks, b);
            kv_blockfmt_seal(&f, b);
            if (!kv_blockfmt_check(&f, &key, toks, b, n, NULL)) { fprintf(stderr, "seal_cost: check failed\n"); exit(1); }
            double dt = util_now_s() - t0;
            if (dt < best) best = dt;
        }
        us[signed_] = best * 1e6;
        free(b);
    }
    kv_blockauth_free(a);
    printf("  one block of %zu bytes sealed and checked: XXH3-64 %.0f us, HMAC-SHA-256 %.0f us (%.2f GB/s each way); "
           "2,048 tokens' blocks: +%.1f ms signed\n", bytes, us[0], us[1], 2 * bytes / us[1] / 1e3,
           (us[1] - us[0]) * (PREFIX / 16) / 1e3);
}

static void run_shape(const bench_shape *s) {
    char path[1024];
    kvlm_model *m = bench_load(bench_model_path(s, "q8_0", path, sizeof path));
    double disk[2] = {0}, redis[2] = {0};
    for (int pass = 0; pass < 2; pass++) {
        mac_key = pass ? "bench_tiers: a per-deployment secret" : NULL;
        run_pass(s, m, &disk[pass], &redis[pass]);
    }
    mac_key = NULL;
    seal_cost((size_t)s->layers * s->kv * (s->dim / s->heads) * 16 * 2 * 2); /* K + V, f16, 16 tokens */
    printf("  signed against unsigned (time to first token, medians): disk hit %.2fx", disk[1] / disk[0]);
    if (redis_url) printf(", redis hit %.2fx", redis[1] / redis[0]);
    printf("\n\n");
    kvlm_model_free(m);
}

int main(int argc, char **argv) {
    if (argc > 1) threads = atoi(argv[1]);
    const char *which = argc > 2 ? argv[2] : "both";
    if (argc > 3 && *argv[3]) disk_dir = argv[3];
    if (argc > 4 && *argv[4]) redis_url = argv[4];
    if (argc > 5) runs = atoi(argv[5]);
    if (threads <= 0 || runs <= 0 || runs > 16 || (strcmp(which, "tinyllama") && strcmp(which, "stories110m") &&
                                                   strcmp(which, "both"))) {
        fprintf(stderr, "usage: bench_tiers [THREADS] [tinyllama|stories110m|both] [DISK DIR] [REDIS URL] [RUNS <= 16]\n");
        return 2;
    }
    static const bench_shape tiny = {"tinyllama1.1B", 2048, 5632, 22, 32, 4, 32000, 4096};
    static const bench_shape s110 = {"stories110M", 768, 2048, 12, 12, 12, 32000, 4096};
    if (strcmp(which, "tinyllama")) run_shape(&s110);
    if (strcmp(which, "stories110m")) run_shape(&tiny);
    return 0;
}
