/* tests/test_tier_disk: the disk tier: round trips, leading counts, drop,
 * restart, the LRU cap, queue overflow, damaged files, I/O errors, threads,
 * kill -9 in the middle of writes, and two processes sharing one folder.
 * Every blob's bytes are derived from its key, so any file can be checked. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "helpers/testutil.h"
#include "kv/tier.h"
#include "kv/tier_disk.h"
#include "util/timing.h"

/* ---- keys and blobs derived from them ----------------------------------- */

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static kv_key key_of(uint32_t a, uint32_t b) {
    kv_key k;
    uint64_t x = mix64((uint64_t)a << 32 | b), y = mix64(x ^ 0x5555);
    memcpy(k.b, &x, 8);
    memcpy(k.b + 8, &y, 8);
    return k;
}

static size_t blob_len(const kv_key *k, size_t max) {
    uint32_t v;
    memcpy(&v, k->b + 4, 4);
    return 1 + v % max;
}

static void fill_blob(const kv_key *k, unsigned char *buf, size_t len) {
    uint64_t s;
    memcpy(&s, k->b, 8);
    for (size_t i = 0; i < len; i += 8) {
        uint64_t r = mix64(s + i);
        memcpy(buf + i, &r, len - i < 8 ? len - i : 8);
    }
}

static bool blob_ok(const kv_key *k, const unsigned char *buf, size_t len, size_t want_len) {
    if (len != want_len) return false;
    unsigned char *ref = malloc(len);
    fill_blob(k, ref, len);
    bool ok = memcmp(ref, buf, len) == 0;
    free(ref);
    return ok;
}

static bool put_blob(kv_tier *t, const kv_key *k, size_t len) {
    unsigned char *buf = malloc(len);
    fill_blob(k, buf, len);
    bool ok = kv_tier_put(t, k, buf, len);
    free(buf);
    return ok;
}

/* ---- folders ------------------------------------------------------------ */

/* the current test's folder, removed by the teardown if the test failed */
static char *cur_dir;

static char *fresh_dir(void) {
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char *d = malloc(strlen(base) + 32);
    sprintf(d, "%s/kvlm-tier-XXXXXX", base);
    assert_non_null(mkdtemp(d));
    cur_dir = d;
    return d;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)st, (void)flag, (void)f;
    return remove(p);
}

static void remove_dir(char *d) {
    nftw(d, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    if (d == cur_dir) cur_dir = NULL;
    free(d);
}

static int teardown_dir(void **state) {
    (void)state;
    if (cur_dir) remove_dir(cur_dir);
    return 0;
}

static kv_tier *open_ok(const char *dir, uint64_t max) {
    kvlm_error err = {0};
    kv_tier *t = kv_tier_disk_open(dir, max, &err);
    if (!t) fail_msg("kv_tier_disk_open(%s): %s", dir, err.msg);
    return t;
}

static kv_tier_stats stats_of(kv_tier *t) {
    kv_tier_stats s;
    kv_tier_stats_get(t, &s);
    return s;
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (de->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* Checks every final file under dir against its key (blobs of blob_len(key,
 * max_len) bytes); returns how many. */
static int verify_all_files(const char *dir, size_t max_len) {
    int n = 0;
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (strlen(de->d_name) != 2 || !strcmp(de->d_name, "..")) continue;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", dir, de->d_name);
        DIR *s = opendir(sub);
        struct dirent *fe;
        while (s && (fe = readdir(s))) {
            if (fe->d_name[0] == '.') continue;
            char path[4400], hex[33];
            snprintf(path, sizeof path, "%s/%s", sub, fe->d_name);
            if (strlen(fe->d_name) != 36 || strcmp(fe->d_name + 32, ".kvb")) fail_msg("stray file %s", path);
            memcpy(hex, fe->d_name, 32);
            hex[32] = 0;
            kv_key k;
            assert_true(kv_key_parse(hex, &k));
            size_t len = 0;
            char *data = tu_read_file(path, &len);
            assert_non_null(data);
            if (!blob_ok(&k, (unsigned char *)data, len, blob_len(&k, max_len)))
                fail_msg("%s: %zu bytes, not the %zu that were put, or other bytes", path, len, blob_len(&k, max_len));
            free(data);
            n++;
        }
        if (s) closedir(s);
    }
    closedir(d);
    return n;
}

/* ---- tests --------------------------------------------------------------- */

static void test_round_trip(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0);
    assert_string_equal(t->ops->name, "disk");
    size_t sizes[] = {1, 100, 4096, 65537, 720896};
    kv_key keys[5];
    uint64_t total = 0;
    for (int i = 0; i < 5; i++) {
        keys[i] = key_of(1, (uint32_t)i);
        assert_true(put_blob(t, &keys[i], sizes[i]));
        total += sizes[i];
    }
    kv_tier_flush(t);
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.writes, 5);
    assert_int_equal(s.write_bytes, total);
    assert_int_equal(s.blocks, 5);
    assert_int_equal(s.bytes, total);
    assert_int_equal(s.dropped_writes, 0);
    assert_int_equal(s.errors, 0);
    assert_true(s.up);

    void *bufs[5];
    size_t lens[5];
    for (int i = 0; i < 5; i++) bufs[i] = malloc(720896);
    assert_int_equal(kv_tier_get(t, 5, keys, bufs, 720896, lens), 5);
    for (int i = 0; i < 5; i++) assert_true(blob_ok(&keys[i], bufs[i], lens[i], sizes[i]));
    s = stats_of(t);
    assert_int_equal(s.hits, 5);
    assert_int_equal(s.misses, 0);
    assert_int_equal(s.reads, 1);
    assert_true(s.read_seconds > 0);

    /* the layout: DIR/<hh>/<32 hex>.kvb, holding exactly the bytes */
    char hex[KV_KEY_HEX], path[4096];
    kv_key_hex(&keys[2], hex);
    snprintf(path, sizeof path, "%s/%.2s/%s.kvb", dir, hex, hex);
    size_t flen = 0;
    char *data = tu_read_file(path, &flen);
    assert_non_null(data);
    assert_true(blob_ok(&keys[2], (unsigned char *)data, flen, sizes[2]));
    free(data);
    char p2[4096];
    assert_true(kv_tier_disk_path(dir, &keys[2], p2, sizeof p2));
    assert_string_equal(p2, path);
    snprintf(path, sizeof path, "%s/FORMAT", dir);
    assert_int_equal(access(path, R_OK), 0);

    /* a key put again is replaced */
    assert_true(put_blob(t, &keys[0], 3000));
    kv_tier_flush(t);
    assert_int_equal(kv_tier_get(t, 1, keys, bufs, 720896, lens), 1);
    assert_true(blob_ok(&keys[0], bufs[0], lens[0], 3000));
    s = stats_of(t);
    assert_int_equal(s.blocks, 5);
    assert_int_equal(s.bytes, total - 1 + 3000);

    for (int i = 0; i < 5; i++) free(bufs[i]);
    kv_tier_close(t);
    remove_dir(dir);
}

static void test_leading_contains_drop(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0);
    kv_key keys[5];
    for (int i = 0; i < 5; i++) {
        keys[i] = key_of(2, (uint32_t)i);
        if (i != 2) assert_true(put_blob(t, &keys[i], 500 + 100 * (size_t)i));
    }
    kv_tier_flush(t);
    unsigned char b[5][1000];
    void *bufs[5] = {b[0], b[1], b[2], b[3], b[4]};
    size_t lens[5];
    memset(lens, 0xff, sizeof lens);
    /* 0, 1 found, 2 missing, 3, 4 found: two leading, the rest still filled */
    assert_int_equal(kv_tier_get(t, 5, keys, bufs, 1000, lens), 2);
    assert_int_equal(lens[2], 0);
    for (int i = 0; i < 5; i++)
        if (i != 2) assert_true(blob_ok(&keys[i], bufs[i], lens[i], 500 + 100 * (size_t)i));
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.hits, 4);
    assert_int_equal(s.misses, 1);
    assert_int_equal(s.reads, 1);

    assert_int_equal(kv_tier_contains(t, 5, keys), 2);
    assert_int_equal(kv_tier_contains(t, 1, keys + 2), 0);
    assert_int_equal(kv_tier_contains(t, 2, keys + 3), 2);
    assert_int_equal(kv_tier_contains(t, 0, keys), 0);

    /* a file longer than cap (the reader's largest block) is no block:
     * a miss, counted as corrupt and removed, so it is written again */
    assert_int_equal(kv_tier_get(t, 5, keys, bufs, 750, lens), 2);
    assert_int_equal(lens[3], 0);
    assert_int_equal(lens[4], 0);
    assert_int_equal(lens[1], 600);
    assert_int_equal(kv_tier_contains(t, 2, keys + 3), 0);
    kv_tier_stats s2 = stats_of(t); /* the second get: 2 hits, 3 misses; contains counts nothing */
    assert_int_equal(s2.hits, s.hits + 2);
    assert_int_equal(s2.misses, s.misses + 3);
    assert_int_equal(s2.reads, 2);
    assert_int_equal(s2.corrupt, 2);
    assert_int_equal(s2.blocks, 2);
    assert_true(put_blob(t, &keys[3], 800));
    kv_tier_flush(t);
    assert_int_equal(kv_tier_contains(t, 1, keys + 3), 1);
    s = stats_of(t);

    /* drop goes through the writer's queue: done once flushed */
    kv_tier_drop(t, &keys[1]);
    kv_tier_drop(t, &keys[2]); /* absent: nothing happens */
    kv_tier_flush(t);
    assert_int_equal(kv_tier_contains(t, 5, keys), 1);
    assert_int_equal(kv_tier_get(t, 2, keys, bufs, 1000, lens), 1);
    assert_int_equal(lens[1], 0);
    char path[4096];
    kv_tier_disk_path(dir, &keys[1], path, sizeof path);
    assert_int_not_equal(access(path, F_OK), 0);
    s = stats_of(t);
    assert_int_equal(s.blocks, 2);
    assert_int_equal(s.bytes, 500 + 800);
    assert_int_equal(s.errors, 0);
    kv_tier_close(t);
    remove_dir(dir);
}

/* Puts n blobs in bursts the queue holds; returns their bytes. */
static uint64_t put_many(kv_tier *t, uint32_t space, int n, size_t max_len) {
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        kv_key k = key_of(space, (uint32_t)i);
        assert_true(put_blob(t, &k, blob_len(&k, max_len)));
        total += blob_len(&k, max_len);
        if (i % 512 == 511) kv_tier_flush(t);
    }
    kv_tier_flush(t);
    return total;
}

static void test_restart(void **state) {
    (void)state;
    char *dir = fresh_dir();
    const int n = 2000;
    kv_tier *t = open_ok(dir, 0);
    uint64_t total = put_many(t, 3, n, 2000);
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.blocks, n);
    assert_int_equal(s.bytes, total);
    kv_tier_close(t);

    double t0 = util_now_s();
    t = open_ok(dir, 0);
    printf("reopening %d blocks took %.1f ms\n", n, (util_now_s() - t0) * 1e3);
    s = stats_of(t);
    assert_int_equal(s.blocks, n);
    assert_int_equal(s.bytes, total);
    assert_int_equal(s.writes, 0);
    unsigned char *mem = malloc(16 * 2000);
    void *bufs[16];
    size_t lens[16];
    for (int i = 0; i < 16; i++) bufs[i] = mem + i * 2000;
    for (int i = 0; i < n; i += 16) {
        kv_key keys[16];
        int m = n - i < 16 ? n - i : 16;
        for (int j = 0; j < m; j++) keys[j] = key_of(3, (uint32_t)(i + j));
        assert_int_equal(kv_tier_get(t, m, keys, bufs, 2000, lens), m);
        for (int j = 0; j < m; j++) assert_true(blob_ok(&keys[j], bufs[j], lens[j], blob_len(&keys[j], 2000)));
    }
    free(mem);
    kv_tier_close(t);

    /* the LRU order survives as mtimes: make block i i seconds old... younger,
     * then reopen with a cap that holds exactly the younger half */
    time_t base = time(NULL) - 10000;
    uint64_t young = 0;
    for (int i = 0; i < n; i++) {
        kv_key k = key_of(3, (uint32_t)i);
        char path[4096];
        kv_tier_disk_path(dir, &k, path, sizeof path);
        struct timespec ts[2] = {{base + i, 0}, {base + i, 0}};
        assert_int_equal(utimensat(AT_FDCWD, path, ts, 0), 0);
        if (i >= n / 2) young += blob_len(&k, 2000);
    }
    t = open_ok(dir, young);
    s = stats_of(t);
    assert_int_equal(s.evicted, n / 2);
    assert_int_equal(s.blocks, n - n / 2);
    assert_int_equal(s.bytes, young);
    kv_key k0 = key_of(3, n / 2 - 1), k1 = key_of(3, n / 2), k2 = key_of(3, n - 1);
    assert_int_equal(kv_tier_contains(t, 1, &k0), 0);
    assert_int_equal(kv_tier_contains(t, 1, &k1), 1);
    assert_int_equal(kv_tier_contains(t, 1, &k2), 1);
    kv_tier_close(t);
    remove_dir(dir);
}

static void test_cap_lru(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 10000);
    kv_key k[14];
    for (int i = 0; i < 14; i++) k[i] = key_of(4, (uint32_t)i);
    for (int i = 0; i < 10; i++) assert_true(put_blob(t, &k[i], 1000));
    kv_tier_flush(t);
    assert_int_equal(stats_of(t).evicted, 0);
    /* touch 0..3: now 4..9 are the least recently used */
    unsigned char b[4][1000];
    void *bufs[4] = {b[0], b[1], b[2], b[3]};
    size_t lens[4];
    assert_int_equal(kv_tier_get(t, 4, k, bufs, 1000, lens), 4);
    for (int i = 10; i < 14; i++) assert_true(put_blob(t, &k[i], 1000));
    kv_tier_flush(t);
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.evicted, 4);
    assert_int_equal(s.blocks, 10);
    assert_int_equal(s.bytes, 10000);
    for (int i = 0; i < 14; i++) {
        bool gone = i >= 4 && i < 8;
        if (kv_tier_contains(t, 1, &k[i]) != !gone) fail_msg("block %d: %s", i, gone ? "kept, should be evicted" : "evicted");
    }
    /* a block bigger than the whole cap is dropped at put */
    assert_false(put_blob(t, &k[4], 10001));
    assert_int_equal(stats_of(t).dropped_writes, 1);
    kv_tier_close(t);
    remove_dir(dir);
}

/* The filesystem fills up before the cap (a 256 KiB tmpfs, where this test
 * may mount one: root with CAP_SYS_ADMIN; skipped otherwise): every write
 * that meets ENOSPC evicts the least recently used blocks and is retried, so
 * the tier goes on as an LRU over the space there is: the newest blocks are
 * there and intact, errors are counted, the tier is up. */
static void test_filesystem_full(void **state) {
    (void)state;
    char *dir = fresh_dir();
    if (geteuid() != 0 || mount("tmpfs", dir, "tmpfs", 0, "size=256k") != 0) {
        print_message("    SKIP: cannot mount a tmpfs here (%s): the full-filesystem case is not run\n",
                      geteuid() ? "not root" : strerror(errno));
        remove_dir(dir);
        skip();
    }
    kv_tier *t = open_ok(dir, 64u << 20);
    enum { N = 200, LEN = 10000 };
    kv_key k[N];
    for (int i = 0; i < N; i++) {
        k[i] = key_of(9, (uint32_t)i);
        put_blob(t, &k[i], LEN);
        if (i % 8 == 7) kv_tier_flush(t);
    }
    kv_tier_flush(t);
    kv_tier_stats s = stats_of(t);
    print_message("    256 KiB filesystem, %d blocks of %d bytes: %llu written, %llu errors, %llu evicted, %llu dropped, "
                  "%llu held\n", N, LEN, (unsigned long long)s.writes, (unsigned long long)s.errors,
                  (unsigned long long)s.evicted, (unsigned long long)s.dropped_writes, (unsigned long long)s.blocks);
    assert_true(s.errors > 0);             /* it did meet ENOSPC */
    assert_true(s.writes >= N - 4);        /* and went on writing */
    assert_true(s.blocks >= 8 && s.blocks < N);
    assert_true(s.up);
    unsigned char *buf = malloc(LEN);
    size_t len;
    void *bufs[1] = {buf};
    for (int i = N - 4; i < N; i++) { /* the newest are there and intact */
        assert_int_equal(kv_tier_get(t, 1, &k[i], bufs, LEN, &len), 1);
        assert_true(blob_ok(&k[i], buf, len, LEN));
    }
    free(buf);
    kv_tier_close(t);
    umount(dir);
    remove_dir(dir);
}

static void test_queue_overflow(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0);
    kv_tier_disk_set_queue_limits(t, 4, 1 << 20);
    kv_tier_disk_pause_writer(t, true);
    int ok = 0;
    for (int i = 0; i < 10; i++) {
        kv_key k = key_of(5, (uint32_t)i);
        ok += put_blob(t, &k, 100);
    }
    assert_int_equal(ok, 4); /* the count bound */
    assert_int_equal(stats_of(t).dropped_writes, 6);
    kv_tier_flush(t); /* resumes the writer */
    assert_int_equal(stats_of(t).writes, 4);

    kv_tier_disk_set_queue_limits(t, 100, 3000);
    kv_tier_disk_pause_writer(t, true);
    ok = 0;
    for (int i = 10; i < 15; i++) {
        kv_key k = key_of(5, (uint32_t)i);
        ok += put_blob(t, &k, 1000);
    }
    assert_int_equal(ok, 3); /* the bytes bound */
    kv_tier_close(t);        /* flushes */

    t = open_ok(dir, 0);
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.blocks, 7);
    assert_int_equal(s.bytes, 4 * 100 + 3 * 1000);
    /* an empty put is refused */
    kv_key k = key_of(5, 99);
    assert_false(kv_tier_put(t, &k, "", 0));
    assert_int_equal(stats_of(t).dropped_writes, 1);

    /* flooding with the default bounds: every put is written or counted */
    kv_tier_disk_set_queue_limits(t, 8, 1 << 20);
    int accepted = 0;
    for (int i = 0; i < 2000; i++) {
        kv_key kk = key_of(6, (uint32_t)i);
        accepted += put_blob(t, &kk, 2000);
    }
    kv_tier_flush(t);
    s = stats_of(t);
    printf("flooding 2000 puts into an 8-block queue: %d accepted, %llu dropped\n", accepted,
           (unsigned long long)s.dropped_writes - 1);
    assert_int_equal(s.writes, accepted);
    assert_int_equal(s.writes + s.dropped_writes, 2000 + 1);
    kv_tier_close(t);
    remove_dir(dir);
}

static void test_damaged_files(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0);
    kv_key k[3] = {key_of(7, 0), key_of(7, 1), key_of(7, 2)};
    for (int i = 0; i < 3; i++) assert_true(put_blob(t, &k[i], 5000));
    kv_tier_flush(t);
    char path[3][4096];
    for (int i = 0; i < 3; i++) kv_tier_disk_path(dir, &k[i], path[i], sizeof path[i]);
    unsigned char buf[5000], ref[5000];
    void *bufs[1] = {buf};
    size_t len;
    fill_blob(&k[0], ref, 5000);

    /* truncated: returned as it is (the reader's checksum judges it) */
    assert_int_equal(truncate(path[0], 1234), 0);
    assert_int_equal(kv_tier_get(t, 1, &k[0], bufs, 5000, &len), 1);
    assert_int_equal(len, 1234);
    assert_memory_equal(buf, ref, 1234);
    /* a changed byte: returned as it is */
    assert_int_equal(truncate(path[0], 0), 0);
    ref[10] ^= 0x5a;
    assert_int_equal(tu_write_file(path[0], ref, 5000), 0);
    assert_int_equal(kv_tier_get(t, 1, &k[0], bufs, 5000, &len), 1);
    assert_int_equal(len, 5000);
    assert_memory_equal(buf, ref, 5000);
    /* empty: a miss, and removed */
    assert_int_equal(truncate(path[1], 0), 0);
    assert_int_equal(kv_tier_contains(t, 1, &k[1]), 0);
    assert_int_equal(kv_tier_get(t, 1, &k[1], bufs, 5000, &len), 0);
    assert_int_equal(len, 0);
    assert_int_not_equal(access(path[1], F_OK), 0);
    /* deleted by someone else: a miss, and forgotten */
    assert_int_equal(unlink(path[2]), 0);
    assert_int_equal(kv_tier_get(t, 1, &k[2], bufs, 5000, &len), 0);
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.blocks, 1);
    assert_int_equal(s.bytes, 5000);
    assert_int_equal(s.errors, 0);
    kv_tier_close(t);

    /* an empty final file left by a power loss is removed at open too; a
     * stray file is left alone */
    assert_int_equal(truncate(path[0], 0), 0);
    char stray[4200];
    snprintf(stray, sizeof stray, "%s/00", dir);
    mkdir(stray, 0755);
    snprintf(stray, sizeof stray, "%s/00/notes.txt", dir);
    assert_int_equal(tu_write_file(stray, "x", 1), 0);
    t = open_ok(dir, 0);
    assert_int_equal(stats_of(t).blocks, 0);
    assert_int_not_equal(access(path[0], F_OK), 0);
    assert_int_equal(access(stray, F_OK), 0);
    kv_tier_close(t);
    remove_dir(dir);
}

/* What someone else put at a block's name is never waited on or read as a
 * block: a FIFO (open would block forever without O_NONBLOCK), a symbolic
 * link (to anything: a FIFO, /dev/zero, another block) and a directory are
 * misses at once, counted as corrupt and removed, so the block can be written
 * again; a FIFO as the folder's FORMAT file is an error at open, not a hang. */
static void test_not_blocks(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0);
    kv_key k[4] = {key_of(9, 0), key_of(9, 1), key_of(9, 2), key_of(9, 3)};
    for (int i = 0; i < 4; i++) assert_true(put_blob(t, &k[i], 3000));
    kv_tier_flush(t);
    char path[4][4096], other[4200];
    for (int i = 0; i < 4; i++) kv_tier_disk_path(dir, &k[i], path[i], sizeof path[i]);
    snprintf(other, sizeof other, "%s.real", path[3]);
    assert_int_equal(unlink(path[0]), 0);
    assert_int_equal(mkfifo(path[0], 0644), 0);
    assert_int_equal(unlink(path[1]), 0);
    assert_int_equal(symlink("/dev/zero", path[1]), 0);
    assert_int_equal(unlink(path[2]), 0);
    assert_int_equal(mkdir(path[2], 0755), 0);
    assert_int_equal(rename(path[3], other), 0); /* a link to a real block's bytes */
    assert_int_equal(symlink(other, path[3]), 0);

    unsigned char b[4][3000];
    void *bufs[4] = {b[0], b[1], b[2], b[3]};
    size_t lens[4];
    assert_int_equal(kv_tier_contains(t, 4, k), 0);
    double t0 = util_now_s();
    assert_int_equal(kv_tier_get(t, 4, k, bufs, 3000, lens), 0);
    double took = util_now_s() - t0;
    for (int i = 0; i < 4; i++) assert_int_equal(lens[i], 0);
    kv_tier_stats st = stats_of(t);
    print_message("    a FIFO, two symbolic links and a directory at block names: %.1f ms, %llu corrupt\n", took * 1e3,
                  (unsigned long long)st.corrupt);
    assert_true(took < 1.0);
    assert_int_equal(st.corrupt, 4);
    struct stat sb;
    for (int i = 0; i < 4; i++) assert_int_not_equal(lstat(path[i], &sb), 0);
    assert_int_equal(stat(other, &sb), 0); /* what a link pointed at is left alone */
    /* written again: a real block over the planted names */
    for (int i = 0; i < 4; i++) assert_true(put_blob(t, &k[i], 3000));
    kv_tier_flush(t);
    assert_int_equal(kv_tier_get(t, 4, k, bufs, 3000, lens), 4);
    for (int i = 0; i < 4; i++) assert_true(blob_ok(&k[i], bufs[i], lens[i], 3000));
    kv_tier_close(t);

    char fmt[4200];
    snprintf(fmt, sizeof fmt, "%s/FORMAT", dir);
    assert_int_equal(unlink(fmt), 0);
    assert_int_equal(mkfifo(fmt, 0644), 0);
    kvlm_error err = {0};
    t0 = util_now_s();
    assert_null(kv_tier_disk_open(dir, 0, &err));
    assert_true(util_now_s() - t0 < 1.0);
    assert_non_null(strstr(err.msg, "not a regular file"));
    unlink(fmt);
    remove_dir(dir);
}

/* A disk that hangs costs one caller the read deadline, then misses at once
 * until the reader thread comes back; the caller's buffers are never written
 * after it gave up; close is bounded whatever the reader is doing. */
static void test_hung_reader(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0);
    kv_key k[3] = {key_of(10, 0), key_of(10, 1), key_of(10, 2)};
    for (int i = 0; i < 3; i++) assert_true(put_blob(t, &k[i], 2000));
    kv_tier_flush(t);
    kv_tier_disk_set_read_deadline(t, 200);
    unsigned char b[3][2000];
    void *bufs[3] = {b[0], b[1], b[2]};
    size_t lens[3];

    kv_tier_disk_stall_reader(t, 1200);
    memset(b, 0xee, sizeof b);
    double t0 = util_now_s();
    assert_int_equal(kv_tier_get(t, 3, k, bufs, 2000, lens), 0);
    double first = util_now_s() - t0;
    t0 = util_now_s();
    assert_int_equal(kv_tier_get(t, 3, k, bufs, 2000, lens), 0); /* hung: at once */
    assert_int_equal(kv_tier_contains(t, 3, k), 0);
    double second = util_now_s() - t0;
    print_message("    reader stalled 1.2 s, deadline 0.2 s: first get %.0f ms, the next get and contains %.1f ms\n",
                  first * 1e3, second * 1e3);
    assert_true(first >= 0.19 && first < 0.8);
    assert_true(second < 0.05);
    usleep(1300 * 1000); /* the reader comes back, finishes the abandoned job without touching b */
    for (size_t i = 0; i < sizeof b; i++) assert_int_equal(((unsigned char *)b)[i], 0xee);
    assert_int_equal(kv_tier_get(t, 3, k, bufs, 2000, lens), 3);
    for (int i = 0; i < 3; i++) assert_true(blob_ok(&k[i], bufs[i], lens[i], 2000));
    assert_true(stats_of(t).errors >= 1);

    /* closing while the reader is stuck takes about the join wait, not the stall */
    kv_tier_disk_stall_reader(t, 4000);
    assert_int_equal(kv_tier_get(t, 1, k, bufs, 2000, lens), 0);
    t0 = util_now_s();
    kv_tier_close(t);
    double closing = util_now_s() - t0;
    print_message("    close with the reader stuck for 4 s: %.2f s\n", closing);
    assert_true(closing < 2.5);
    usleep(4200 * 1000); /* let the left-behind thread end before the folder goes */
    remove_dir(dir);
}

static void test_errors(void **state) {
    (void)state;
    char *dir = fresh_dir();
    char path[4096];
    kvlm_error err = {0};
    /* a folder that cannot be made */
    snprintf(path, sizeof path, "%s/file", dir);
    assert_int_equal(tu_write_file(path, "x", 1), 0);
    snprintf(path, sizeof path, "%s/file/tier", dir);
    assert_null(kv_tier_disk_open(path, 0, &err));
    assert_int_equal(err.code, KVLM_EIO);
    assert_non_null(strstr(err.msg, "file/tier"));
    assert_null(kv_tier_disk_open("", 0, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
    /* a folder of another format */
    snprintf(path, sizeof path, "%s/other", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/other/FORMAT", dir);
    assert_int_equal(tu_write_file(path, "kvlm disk tier 2\n", 17), 0);
    snprintf(path, sizeof path, "%s/other", dir);
    assert_null(kv_tier_disk_open(path, 0, &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);

    /* writes that fail (tmp/ turned into a file: ENOTDIR, as root cannot be
     * refused by permissions) are counted, dropped, and make the tier down;
     * once the folder works again, so does the tier */
    snprintf(path, sizeof path, "%s/t", dir);
    kv_tier *t = open_ok(path, 0);
    snprintf(path, sizeof path, "%s/t/tmp", dir);
    assert_int_equal(rmdir(path), 0);
    assert_int_equal(tu_write_file(path, "x", 1), 0);
    kv_key k = key_of(8, 0);
    for (int i = 0; i < 3; i++) assert_true(put_blob(t, &k, 100));
    kv_tier_flush(t);
    kv_tier_stats s = stats_of(t);
    assert_int_equal(s.errors, 3);
    assert_int_equal(s.dropped_writes, 3);
    assert_int_equal(s.writes, 0);
    assert_false(s.up);
    unsigned char buf[100];
    void *bufs[1] = {buf};
    size_t len;
    assert_int_equal(kv_tier_get(t, 1, &k, bufs, 100, &len), 0);
    assert_int_equal(unlink(path), 0);
    /* tmp/ missing altogether: the writer makes it again */
    assert_true(put_blob(t, &k, 100));
    kv_tier_flush(t);
    s = stats_of(t);
    assert_int_equal(s.writes, 1);
    assert_true(s.up);
    assert_int_equal(kv_tier_get(t, 1, &k, bufs, 100, &len), 1);
    kv_tier_close(t);
    remove_dir(dir);
}

typedef struct {
    kv_tier *t;
    int id;
    int bad;
} thr_arg;

static void *thr_main(void *p) {
    thr_arg *a = p;
    unsigned char *mem = malloc(4 * 4096);
    void *bufs[4] = {mem, mem + 4096, mem + 8192, mem + 12288};
    size_t lens[4];
    for (int i = 0; i < 1000; i++) {
        kv_key k = key_of(9, (uint32_t)(i % 300)); /* all threads share keys */
        put_blob(a->t, &k, blob_len(&k, 4096));
        kv_key ks[4];
        for (int j = 0; j < 4; j++) ks[j] = key_of(9, (uint32_t)((i * 7 + j) % 300));
        kv_tier_get(a->t, 4, ks, bufs, 4096, lens);
        for (int j = 0; j < 4; j++)
            if (lens[j] && !blob_ok(&ks[j], bufs[j], lens[j], blob_len(&ks[j], 4096))) a->bad++;
        kv_tier_contains(a->t, 4, ks);
        if (i % 10 == a->id) kv_tier_drop(a->t, &ks[0]);
        if (i % 100 == 0) {
            kv_tier_stats s;
            kv_tier_stats_get(a->t, &s);
        }
    }
    free(mem);
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 200 * 1000); /* small: eviction runs too */
    pthread_t th[4];
    thr_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thr_arg){t, i, 0};
        pthread_create(&th[i], NULL, thr_main, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].bad, 0);
    }
    kv_tier_flush(t);
    kv_tier_stats s = stats_of(t);
    printf("4 threads: %llu writes, %llu dropped, %llu hits, %llu misses, %llu evicted, %llu blocks\n",
           (unsigned long long)s.writes, (unsigned long long)s.dropped_writes, (unsigned long long)s.hits,
           (unsigned long long)s.misses, (unsigned long long)s.evicted, (unsigned long long)s.blocks);
    assert_int_equal(s.writes + s.dropped_writes, 4 * 1000);
    assert_int_equal(s.errors, 0);
    assert_true(s.bytes <= 200 * 1000);
    kv_tier_close(t);
    /* the index this process kept matches the folder */
    t = open_ok(dir, 0);
    kv_tier_stats s2 = stats_of(t);
    assert_int_equal(s2.blocks, s.blocks);
    assert_int_equal(s2.bytes, s.bytes);
    assert_int_equal(verify_all_files(dir, 4096), (int)s.blocks);
    kv_tier_close(t);
    remove_dir(dir);
}

/* A child that puts blobs as fast as it can until it is killed; big blobs,
 * so the kill often lands in the middle of a write. */
#define KILL_MAX_BLOB (512 << 10)
#define KILL_ROUNDS 8
static void child_writer(const char *dir, uint32_t round) {
    kvlm_error err = {0};
    kv_tier *t = kv_tier_disk_open(dir, 32u << 20, &err);
    if (!t) _exit(3);
    unsigned char *buf = malloc(KILL_MAX_BLOB);
    for (uint32_t i = 0;; i++) {
        kv_key k = key_of(100 + round, i);
        size_t len = blob_len(&k, KILL_MAX_BLOB);
        fill_blob(&k, buf, len);
        kv_tier_put(t, &k, buf, len); /* a full queue drops: fine */
    }
}

static void test_kill9(void **state) {
    (void)state;
    char *dir = fresh_dir();
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    pid_t last = 0;
    for (int round = 0; round < KILL_ROUNDS; round++) {
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) child_writer(dir, (uint32_t)round);
        usleep(30000 + (useconds_t)(rand() % 120000)); /* open + 0..120 ms of writing */
        assert_int_equal(kill(pid, SIGKILL), 0);
        int st;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
        last = pid;
    }
    char tmpd[4096], p[4200];
    snprintf(tmpd, sizeof tmpd, "%s/tmp", dir);
    int left = count_files(tmpd);
    /* besides what the children left: one of a dead pid, one of ours (alive,
     * young: kept), one of ours a few minutes old (stale: removed) */
    snprintf(p, sizeof p, "%s/%ld.999.tmp", tmpd, (long)last);
    assert_int_equal(tu_write_file(p, "dead", 4), 0);
    snprintf(p, sizeof p, "%s/%ld.998.tmp", tmpd, (long)getpid());
    assert_int_equal(tu_write_file(p, "old", 3), 0);
    struct timespec old[2] = {{time(NULL) - 300, 0}, {time(NULL) - 300, 0}};
    assert_int_equal(utimensat(AT_FDCWD, p, old, 0), 0);
    char live[4200];
    snprintf(live, sizeof live, "%s/%ld.997.tmp", tmpd, (long)getpid());
    assert_int_equal(tu_write_file(live, "live", 4), 0);

    kv_tier *t = open_ok(dir, 0);
    kv_tier_stats s = stats_of(t);
    int files = verify_all_files(dir, KILL_MAX_BLOB);
    printf("kill -9 x%d: %d blocks on disk, all intact; %d temporary files were left, cleaned at open\n", KILL_ROUNDS, files, left);
    assert_true(files > 0);
    assert_int_equal((int)s.blocks, files);
    assert_int_equal(count_files(tmpd), 1); /* only the live one */
    assert_int_equal(access(live, F_OK), 0);
    kv_tier_close(t);
    remove_dir(dir);
}

/* One of two processes sharing dir: writes its own keys and shared ones,
 * reads the other's (which vanish under it: the caps are small), drops some
 * shared ones. Exit 0 when every block it read was intact and it read some
 * of the other's. */
/* each sharer's loop count, in memory both children share: a process looks
 * for the other's blocks near where the other is (a loaded machine can run
 * one far ahead of the other) */
/* shared by the two processes: [0..1] each one's latest put, [2..3] its
 * latest put known to be on disk, [4..5] started, [6..7] has seen the
 * other's blocks */
static volatile uint32_t *g_progress;

static double wait_for_other(int id, double limit_s) {
    g_progress[4 + id] = 1;
    double t0 = util_now_s();
    while (!g_progress[4 + (1 - id)] && util_now_s() < t0 + limit_s) usleep(1000);
    return util_now_s();
}

static void child_sharer(const char *dir, int id, double seconds) {
    kvlm_error err = {0};
    kv_tier *t = kv_tier_disk_open(dir, 512u << 10, &err); /* small: evictions too */
    if (!t) _exit(3);
    unsigned char *mem = malloc(8 * 16384);
    void *bufs[8];
    size_t lens[8];
    for (int j = 0; j < 8; j++) bufs[j] = mem + j * 16384;
    long other_hits = 0, bad = 0;
    /* Both race for `seconds` from the moment both have started (a loaded
     * machine can start one long after the other). Then, until both have
     * seen the other's blocks (20 s at most), each waits for its writes to
     * be on disk before it says how far it got, so that a writer thread
     * starved of CPU (its queue dropping most puts) cannot hide every
     * block from the other. */
    double end = wait_for_other(id, 20) + seconds;
    for (uint32_t i = 0;; i++) {
        double now = util_now_s();
        bool both_hit = g_progress[6] && g_progress[7];
        if (now >= end && (both_hit || now >= end + 20)) break;
        bool settle = now >= end;
        kv_key k = key_of(200 + (uint32_t)id, i), sh = key_of(300, i % 64);
        put_blob(t, &k, blob_len(&k, 16384));
        put_blob(t, &sh, blob_len(&sh, 16384));
        kv_key ks[8];
        g_progress[id] = i;
        if (settle) {
            kv_tier_flush(t);
            g_progress[2 + id] = i;
        }
        uint32_t other = g_progress[settle ? 3 - id : 1 - id];
        uint32_t from = settle ? (other > 5 ? other - 5 : 0)
                        : other > 100 ? other - 100 + (uint32_t)(rand() % 100)
                        : other > 8   ? (uint32_t)rand() % (other - 7)
                                      : 0;
        for (int j = 0; j < 8; j++) ks[j] = j < 6 ? key_of(200 + (uint32_t)(1 - id), from + (uint32_t)j) : key_of(300, (i + (uint32_t)j) % 64);
        kv_tier_get(t, 8, ks, bufs, 16384, lens);
        for (int j = 0; j < 8; j++) {
            if (!lens[j]) continue;
            if (!blob_ok(&ks[j], bufs[j], lens[j], blob_len(&ks[j], 16384))) bad++;
            if (j < 6) other_hits++;
        }
        if (other_hits) g_progress[6 + id] = 1;
        if (i % 16 == 0) kv_tier_drop(t, &ks[7]);
        if (i % 64 == 0) usleep(1000); /* let the writer keep up now and then */
    }
    kv_tier_stats s;
    kv_tier_stats_get(t, &s);
    kv_tier_close(t);
    fprintf(stderr, "  process %d: %llu writes, %llu dropped, %ld hits on the other's blocks, %llu misses, %llu evicted, %ld bad\n", id,
            (unsigned long long)s.writes, (unsigned long long)s.dropped_writes, other_hits, (unsigned long long)s.misses, (unsigned long long)s.evicted, bad);
    _exit(bad ? 1 : other_hits == 0 ? 2 : s.errors ? 4 : 0);
}

static void test_two_processes(void **state) {
    (void)state;
    char *dir = fresh_dir();
    kv_tier *t = open_ok(dir, 0); /* made before the children race to make it */
    kv_tier_close(t);
    g_progress = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(g_progress != MAP_FAILED);
    pid_t pid[2];
    for (int id = 0; id < 2; id++) {
        fflush(NULL);
        pid[id] = fork();
        assert_true(pid[id] >= 0);
        if (pid[id] == 0) {
            srand((unsigned)getpid());
            child_sharer(dir, id, 1.0);
        }
    }
    for (int id = 0; id < 2; id++) {
        int st;
        assert_int_equal(waitpid(pid[id], &st, 0), pid[id]);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            fail_msg("process %d: %s %d (1: bad block, 2: never saw the other's blocks, 3: open failed, 4: I/O errors)", id,
                     WIFEXITED(st) ? "exit" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    }
    munmap((void *)g_progress, 4096);
    t = open_ok(dir, 0);
    int files = verify_all_files(dir, 16384);
    assert_int_equal((int)stats_of(t).blocks, files);
    char tmpd[4096];
    snprintf(tmpd, sizeof tmpd, "%s/tmp", dir);
    assert_int_equal(count_files(tmpd), 0);
    kv_tier_close(t);
    remove_dir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_round_trip, teardown_dir),
        cmocka_unit_test_teardown(test_leading_contains_drop, teardown_dir),
        cmocka_unit_test_teardown(test_restart, teardown_dir),
        cmocka_unit_test_teardown(test_filesystem_full, teardown_dir),
        cmocka_unit_test_teardown(test_cap_lru, teardown_dir),
        cmocka_unit_test_teardown(test_queue_overflow, teardown_dir),
        cmocka_unit_test_teardown(test_damaged_files, teardown_dir),
        cmocka_unit_test_teardown(test_not_blocks, teardown_dir),
        cmocka_unit_test_teardown(test_hung_reader, teardown_dir),
        cmocka_unit_test_teardown(test_errors, teardown_dir),
        cmocka_unit_test_teardown(test_threads, teardown_dir),
        cmocka_unit_test_teardown(test_kill9, teardown_dir),
        cmocka_unit_test_teardown(test_two_processes, teardown_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
