/* bench/bench_tier_disk: the disk tier's write and read throughput on real
 * block sizes (default TinyLlama-1.1B, 16 tokens, f16: 22 layers x 4 KV heads
 * x 64 dims x 2 (K, V) x 2 bytes x 16 = 720,896 bytes), reads with the page
 * cache dropped per file (posix_fadvise DONTNEED), and the time to rebuild
 * the index of a folder of 100,000 blocks at open.
 * bench/bench_tier_disk.sh runs it beside dd on the same filesystem and
 * prints the ratios; "RESULT name value" lines are for that script. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kv/tier.h"
#include "kv/tier_disk.h"
#include "util/timing.h"

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static kv_key key_of(uint64_t i) {
    kv_key k;
    uint64_t a = mix64(i), b = mix64(a);
    memcpy(k.b, &a, 8);
    memcpy(k.b + 8, &b, 8);
    return k;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)st, (void)flag, (void)f;
    return remove(p);
}
static void rm_rf(const char *d) { nftw(d, rm_one, 16, FTW_DEPTH | FTW_PHYS); }

/* Share of the file's pages in the page cache (mincore). */
static double resident(const char *path) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size == 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return -1;
    long pg = sysconf(_SC_PAGESIZE);
    size_t np = ((size_t)st.st_size + (size_t)pg - 1) / (size_t)pg, in = 0;
    unsigned char *vec = malloc(np);
    if (mincore(m, (size_t)st.st_size, vec) == 0)
        for (size_t i = 0; i < np; i++) in += vec[i] & 1;
    free(vec);
    munmap(m, (size_t)st.st_size);
    return (double)in / (double)np;
}

static kv_tier *open_or_die(const char *dir, uint64_t cap) {
    kvlm_error err = {0};
    kv_tier *t = kv_tier_disk_open(dir, cap, &err);
    if (!t) {
        fprintf(stderr, "bench_tier_disk: %s\n", err.msg);
        exit(1);
    }
    return t;
}

static void usage(void) {
    fprintf(stderr, "usage: bench_tier_disk [--dir DIR] [--block-bytes N] [--total-mib N] [--batch N]\n"
                    "                       [--index-blocks N] [--index-dir DIR] [--skip-throughput] [--skip-index]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *base = getenv("KVLM_BENCH_DIR") ? getenv("KVLM_BENCH_DIR") : "/tmp/kvlm-bench";
    char dir[4096], idir[4096];
    snprintf(dir, sizeof dir, "%s/tier-disk", base);
    snprintf(idir, sizeof idir, "%s/tier-disk-index", base);
    size_t block = 720896;
    long total_mib = 1024, index_blocks = 100000;
    int batch = 16;
    int skip_tp = 0, skip_ix = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--skip-throughput")) skip_tp = 1;
        else if (!strcmp(a, "--skip-index")) skip_ix = 1;
        else if (!v) usage();
        else if (!strcmp(a, "--dir")) snprintf(dir, sizeof dir, "%s", v), i++;
        else if (!strcmp(a, "--index-dir")) snprintf(idir, sizeof idir, "%s", v), i++;
        else if (!strcmp(a, "--block-bytes")) block = (size_t)atol(v), i++;
        else if (!strcmp(a, "--total-mib")) total_mib = atol(v), i++;
        else if (!strcmp(a, "--batch")) batch = atoi(v), i++;
        else if (!strcmp(a, "--index-blocks")) index_blocks = atol(v), i++;
        else usage();
    }
    if (block < 16 || total_mib < 1 || batch < 1 || index_blocks < 1) usage();
    mkdir(base, 0755);

    if (!skip_tp) {
        long n = (long)(((uint64_t)total_mib << 20) / block);
        if (n < 1) n = 1;
        double mb = (double)n * (double)block / 1e6;
        printf("disk tier: %ld blocks of %zu bytes (%.0f MB) in %s\n", n, block, mb, dir);
        rm_rf(dir);
        kv_tier *t = open_or_die(dir, 0);
        unsigned char *buf = malloc(block);
        for (size_t i = 0; i < block; i += 8) {
            uint64_t r = mix64(i);
            memcpy(buf + i, &r, block - i < 8 ? block - i : 8);
        }
        long retries = 0;
        double t0 = util_now_s();
        for (long i = 0; i < n; i++) {
            kv_key k = key_of((uint64_t)i);
            memcpy(buf, &i, sizeof i); /* each block its own bytes */
            /* the bench wants the writer's speed, so it waits where the
             * engine would drop (every refusal is counted in dropped_writes) */
            while (!kv_tier_put(t, &k, buf, block)) {
                retries++;
                usleep(200);
            }
        }
        kv_tier_flush(t);
        double t1 = util_now_s();
        int dfd = open(dir, O_RDONLY | O_DIRECTORY);
        if (dfd < 0 || syncfs(dfd) != 0) perror("syncfs");
        if (dfd >= 0) close(dfd);
        double t2 = util_now_s();
        printf("  write (put .. flush, into the page cache): %8.1f MB/s  %.2f s  (queue full %ld times, retried)\n",
               mb / (t1 - t0), t1 - t0, retries);
        printf("  write + syncfs (on disk):                  %8.1f MB/s  %.2f s\n", mb / (t2 - t0), t2 - t0);
        printf("RESULT tier_write_cache_Bps %.0f\nRESULT tier_write_sync_Bps %.0f\n", mb * 1e6 / (t1 - t0),
               mb * 1e6 / (t2 - t0));

        /* the files are clean after syncfs, so DONTNEED really drops them */
        char path[4200];
        for (long i = 0; i < n; i++) {
            kv_key k = key_of((uint64_t)i);
            kv_tier_disk_path(dir, &k, path, sizeof path);
            int fd = open(path, O_RDONLY);
            if (fd < 0) continue;
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            close(fd);
        }
        kv_key k0 = key_of(0);
        kv_tier_disk_path(dir, &k0, path, sizeof path);
        printf("  page cache after fadvise(DONTNEED): %.0f%% of block 0 resident\n", 100 * resident(path));

        void **bufs = malloc((size_t)batch * sizeof *bufs);
        size_t *lens = malloc((size_t)batch * sizeof *lens);
        kv_key *keys = malloc((size_t)batch * sizeof *keys);
        for (int j = 0; j < batch; j++) bufs[j] = malloc(block);
        long bad = 0;
        t0 = util_now_s();
        for (long i = 0; i < n; i += batch) {
            int m = n - i < batch ? (int)(n - i) : batch;
            for (int j = 0; j < m; j++) keys[j] = key_of((uint64_t)(i + j));
            if (kv_tier_get(t, m, keys, bufs, block, lens) != m) bad++;
            for (int j = 0; j < m; j++) {
                long id;
                memcpy(&id, bufs[j], sizeof id);
                if (lens[j] != block || id != i + j) bad++;
            }
        }
        t1 = util_now_s();
        kv_tier_stats s;
        kv_tier_stats_get(t, &s);
        printf("  read (get of %d blocks, cold cache):      %8.1f MB/s  %.2f s  (%.2f ms per get)%s\n", batch,
               mb / (t1 - t0), t1 - t0, 1e3 * s.read_seconds / (double)s.reads, bad ? "  WRONG BLOCKS" : "");
        printf("RESULT tier_read_Bps %.0f\n", mb * 1e6 / (t1 - t0));
        printf("  stats: writes %llu, write_bytes %llu, dropped %llu, hits %llu, misses %llu, errors %llu\n",
               (unsigned long long)s.writes, (unsigned long long)s.write_bytes, (unsigned long long)s.dropped_writes,
               (unsigned long long)s.hits, (unsigned long long)s.misses, (unsigned long long)s.errors);
        for (int j = 0; j < batch; j++) free(bufs[j]);
        free(bufs);
        free(lens);
        free(keys);
        free(buf);
        kv_tier_close(t);
        rm_rf(dir);
        if (bad) return 1;
    }

    if (!skip_ix) {
        /* a folder of index_blocks small files in the tier's layout, made
         * directly (faster than through the queue), then timed opens */
        printf("index rebuild: %ld blocks of 256 bytes in %s\n", index_blocks, idir);
        rm_rf(idir);
        kv_tier_close(open_or_die(idir, 0)); /* FORMAT and tmp/ */
        unsigned char small[256] = {0};
        char path[4200], sub[4200];
        double t0 = util_now_s();
        for (long i = 0; i < index_blocks; i++) {
            kv_key k = key_of((uint64_t)i);
            kv_tier_disk_path(idir, &k, path, sizeof path);
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd < 0 && errno == ENOENT) {
                snprintf(sub, sizeof sub, "%.*s", (int)(strrchr(path, '/') - path), path);
                mkdir(sub, 0755);
                fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            }
            if (fd < 0 || write(fd, small, sizeof small) != (ssize_t)sizeof small) {
                perror(path);
                return 1;
            }
            close(fd);
        }
        printf("  making the files: %.1f s (%.0f us per file)\n", util_now_s() - t0,
               1e6 * (util_now_s() - t0) / (double)index_blocks);
        for (int round = 0; round < 2; round++) {
            t0 = util_now_s();
            kv_tier *t = open_or_die(idir, 0);
            double dt = util_now_s() - t0;
            kv_tier_stats s;
            kv_tier_stats_get(t, &s);
            printf("  open (scan + sort + index), %s: %.0f ms for %llu blocks (%.2f us per block)\n",
                   round ? "again" : "first", dt * 1e3, (unsigned long long)s.blocks, dt * 1e6 / (double)s.blocks);
            if (round == 0) printf("RESULT index_open_s %.4f\n", dt);
            if ((long)s.blocks != index_blocks) {
                fprintf(stderr, "found %llu blocks, made %ld\n", (unsigned long long)s.blocks, index_blocks);
                return 1;
            }
            kv_tier_close(t);
        }
        rm_rf(idir);
    }
    return 0;
}
