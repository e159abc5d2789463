/* kv/tier_disk: the local-disk tier: one file per block under a folder,
 * written by a writer thread from a bounded queue, capped in size by an LRU.
 *
 * Layout of DIR (kv_tier_disk_open creates what is missing):
 *   DIR/FORMAT                  "kvlm disk tier 1" and a line on the layout;
 *                               open refuses a folder with another version
 *   DIR/<hh>/<32 hex>.kvb       one block: exactly the bytes given to put; hh
 *                               is the key's first two hex digits (256
 *                               subfolders keep each folder small)
 *   DIR/tmp/<pid>.<seq>.tmp     a block being written by process pid
 *
 * Crash safety: a block is written whole under DIR/tmp, then rename(2)d to
 * its final name, so a final name only ever shows a complete file (rename is
 * atomic, and tmp/ is on the same filesystem). There is no fsync: once
 * write(2) returns, the bytes are in the kernel's page cache and survive the
 * process being killed (kill -9, a crash), which is the failure this tier
 * must survive. Only a power loss or kernel crash can leave a final name with
 * short, empty or stale contents; the reader's checksum (kv/blockfmt) catches
 * that and it costs a recompute, whereas an fsync per block would cost a
 * disk flush per put for a cache that can always be rebuilt. Empty final
 * files (the usual shape of that damage) are misses and are removed.
 * At open, temporary files of processes that are gone (or older than a
 * minute: a pid may be reused or live in another pid namespace) are removed;
 * younger ones of live processes are left alone.
 *
 * Index: a hash map key -> bytes with an LRU list, of the blocks this process
 * knows: those found at open (LRU order = file mtime; gets bump the mtime so
 * the order survives restarts, to the filesystem's timestamp granularity),
 * those it wrote, and those it read that another process wrote. After each
 * write the writer unlinks least recently used files until the total is
 * under max_bytes (0: no cap).
 *
 * Sharing: several processes may use one DIR at once (on one machine's local
 * filesystem). Writes are atomic renames; reads open by name and treat a file
 * that vanished as a miss (and forget it). Each process enforces its cap on
 * what it knows, so N processes with cap C can hold up to about N*C between
 * them, and a block another process wrote and this one never saw does not
 * count here until the next open. Evicting may remove a block another
 * process still lists; its next get misses and forgets it.
 *
 * Accounting: every put ends as exactly one of writes or dropped_writes
 * (queue full, over the cap, or an I/O error, which also counts in errors).
 * I/O errors are logged once per errno and never stop the tier.
 *
 * Never blocking the caller on a file: every file is opened with O_NONBLOCK
 * and O_NOFOLLOW and checked with fstat to be a regular file no longer than
 * the caller's largest block; a FIFO, a device, a symbolic link or an
 * oversized file at a block's name is no block: counted as corrupt, removed
 * and logged once. get and contains run on the tier's reader thread, and the
 * caller waits for them at most DISK_READ_MS: a disk or filesystem that hangs
 * (a dead NFS server, a stuck FUSE daemon) costs one caller that long and
 * returns the blocks read by then; until the reader comes back, gets and
 * contains miss at once (logged when it starts and when it ends). The reader
 * reads each block into a buffer of its own and copies it to the caller's
 * only while the caller still waits, so a caller that gave up never has its
 * buffers written later. drop goes through the writer's queue (a put of the
 * same key queued after it writes the block again); flush and close give up
 * after DISK_FLUSH_MS, dropping (and counting) what is still queued, and a
 * thread stuck in the kernel is left behind rather than waited for, so
 * closing (a server's stop) is bounded in time whatever the disk does. */
#include "kv/tier_disk.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "util/error.h"
#include "util/log.h"
#include "util/timing.h"

/* The put queue's bounds: the bytes bound is what bites for real blocks
 * (TinyLlama-1.1B's 16-token f16 block is 704 KiB, so 256 MiB is ~370 of
 * them, a fraction of a second of disk writes); the count bounds the queue
 * for small blocks. Past either, put drops instead of waiting. */
#define DISK_QUEUE_BLOCKS 1024
#define DISK_QUEUE_BYTES ((size_t)256 << 20)
/* A temporary file this old is stale even if its pid is alive. */
#define DISK_STALE_TMP_S 60
/* The longest a get or contains waits for the reader thread: far above a
 * cold read of a batch from a slow disk (32 blocks of 700 KiB at 100 MB/s:
 * 0.23 s), so only a disk that hangs reaches it. */
#define DISK_READ_MS 2000
/* flush (and close) give up when the writer makes no progress for
 * DISK_FLUSH_STALL_MS, or after DISK_FLUSH_MS in all; close waits
 * DISK_JOIN_MS more for each thread to end. */
#define DISK_FLUSH_STALL_MS 3000
#define DISK_FLUSH_MS 10000
#define DISK_JOIN_MS 1000
#define DISK_FORMAT "kvlm disk tier 1\nlayout: <hh>/<32 hex digits of the key>.kvb, one block per file; tmp/: files being written\n"

typedef struct disk_ent {
    kv_key key;
    uint64_t bytes;
    struct disk_ent *hnext;       /* hash chain */
    struct disk_ent *prev, *next; /* LRU list: lru.next is the least recently used */
} disk_ent;

typedef struct disk_item {
    struct disk_item *next;
    kv_key key;
    bool drop;   /* remove the block's file (no data) */
    size_t len;
    unsigned char data[];
} disk_item;

/* A get or contains handed to the reader thread. The caller's bufs and lens
 * are written only under jmu and only while !abandoned. */
enum { JOB_GET, JOB_CONTAINS };
typedef struct {
    int kind, n;
    kv_key *keys;       /* the job's copy */
    void *const *bufs;  /* JOB_GET: the caller's */
    size_t cap, *lens;
    int done;           /* blocks finished, in order */
    int present;        /* JOB_CONTAINS: leading keys present */
    bool taken, finished, abandoned;
} disk_job;

typedef struct {
    kv_tier base;
    char *dir;
    uint64_t max_bytes;

    /* put queue and writer, under qmu */
    pthread_mutex_t qmu;
    pthread_cond_t work, idle;
    disk_item *qhead, *qtail;
    int qn, qmax;
    size_t qbytes, qmax_bytes;
    bool busy, stop, paused;
    pthread_t writer;

    /* index, under imu */
    pthread_mutex_t imu;
    disk_ent **buckets;
    size_t nbuckets, nents;
    uint64_t total;
    disk_ent lru; /* sentinel of the LRU list */

    _Atomic uint64_t logged[4]; /* errnos already logged (bit per errno < 256) */
    _Atomic bool logged_bad;    /* a file at a block's name that is no block */
    _Atomic uint64_t n_blocks, n_bytes; /* nents, total: for stats without imu */

    /* the reader thread and its one job, under jmu */
    pthread_mutex_t jmu;
    pthread_cond_t jcv;
    disk_job *job;
    bool rstop;
    pthread_t reader;
    unsigned char *bounce; /* the reader's: one block */
    size_t bounce_cap;
    double hung_since;     /* > 0: a caller gave up on the reader at this time */
    uint64_t hung_missed;  /* gets and contains answered "miss" since */
    int read_ms;
    int stall_ms;          /* test hook: the reader's next job first sleeps this long (a hung disk) */
    /* the owner's reference and one per running thread: whoever drops the
     * last frees t (close leaves a thread stuck in the kernel behind) */
    _Atomic int refs;
} disk_tier;

static const kv_tier_ops disk_ops;
/* numbers temporary names: one counter per process, as two tiers of one
 * process may share a folder */
static _Atomic uint64_t tmp_seq;

/* ---- paths --------------------------------------------------------------- */

bool kv_tier_disk_path(const char *dir, const kv_key *key, char *out, size_t cap) {
    char hex[KV_KEY_HEX];
    kv_key_hex(key, hex);
    int n = snprintf(out, cap, "%s/%.2s/%s.kvb", dir, hex, hex);
    return n > 0 && (size_t)n < cap;
}

static void sub_path(const disk_tier *t, const kv_key *key, char *out, size_t cap) {
    char hex[KV_KEY_HEX];
    kv_key_hex(key, hex);
    snprintf(out, cap, "%s/%.2s", t->dir, hex);
}

/* Counts an I/O error, logs the first of each errno, and marks the tier down
 * when it is one that makes the folder unusable. */
static void note_error(disk_tier *t, int e, const char *what, const char *path) {
    atomic_fetch_add(&t->base.n.errors, 1);
    if (e == ENOSPC || e == EACCES || e == EROFS || e == EIO || e == EDQUOT || e == ENOTDIR || e == EPERM)
        atomic_store(&t->base.n.up, false);
    int b = e >= 0 && e < 256 ? e : 255;
    uint64_t bit = 1ull << (b & 63);
    if (atomic_fetch_or(&t->logged[b >> 6], bit) & bit) return;
    LOG_WARN("disk tier %s: %s %s: %s (further errors like this are only counted)", t->dir, what, path,
             strerror(e));
}

/* mkdir -p; 0 or an errno. */
static int mkdir_p(const char *path) {
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != 0) continue;
        char c = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return errno;
        buf[i] = c;
    }
    struct stat st;
    if (stat(path, &st) != 0) return errno;
    return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

/* ---- index (callers hold imu) ------------------------------------------- */

static size_t key_slot(const disk_tier *t, const kv_key *k) {
    /* keys are already hashes (kv/blockfmt); this only folds them to a slot */
    uint64_t a, b;
    memcpy(&a, k->b, 8);
    memcpy(&b, k->b + 8, 8);
    return (size_t)(((a ^ b) * 0x9E3779B97F4A7C15ull) >> 32) & (t->nbuckets - 1);
}

static disk_ent **ix_find(disk_tier *t, const kv_key *k) {
    disk_ent **pp = &t->buckets[key_slot(t, k)];
    while (*pp && memcmp((*pp)->key.b, k->b, 16) != 0) pp = &(*pp)->hnext;
    return pp;
}

static void lru_unlink(disk_ent *e) {
    e->prev->next = e->next;
    e->next->prev = e->prev;
}

static void lru_push_recent(disk_tier *t, disk_ent *e) {
    e->prev = t->lru.prev;
    e->next = &t->lru;
    t->lru.prev->next = e;
    t->lru.prev = e;
}

static bool ix_grow(disk_tier *t, size_t want) {
    size_t nb = t->nbuckets ? t->nbuckets : 1024;
    while (nb < want) nb *= 2;
    if (nb == t->nbuckets) return true;
    disk_ent **nbk = calloc(nb, sizeof *nbk);
    if (!nbk) return false;
    disk_ent **old = t->buckets;
    size_t on = t->nbuckets;
    t->buckets = nbk;
    t->nbuckets = nb;
    for (size_t i = 0; i < on; i++)
        for (disk_ent *e = old[i], *nx; e; e = nx) {
            nx = e->hnext;
            size_t s = key_slot(t, &e->key);
            e->hnext = nbk[s];
            nbk[s] = e;
        }
    free(old);
    return true;
}

/* Adds or updates key as the most recently used; false only without memory
 * (the block is then simply not capped by this process). */
static bool ix_put(disk_tier *t, const kv_key *k, uint64_t bytes) {
    disk_ent **pp = ix_find(t, k);
    if (*pp) {
        disk_ent *e = *pp;
        t->total += bytes - e->bytes;
        e->bytes = bytes;
        atomic_store(&t->n_bytes, t->total);
        lru_unlink(e);
        lru_push_recent(t, e);
        return true;
    }
    if (t->nents + 1 > t->nbuckets) {
        if (!ix_grow(t, 2 * (t->nents + 1))) return false;
        pp = ix_find(t, k);
    }
    disk_ent *e = malloc(sizeof *e);
    if (!e) return false;
    e->key = *k;
    e->bytes = bytes;
    e->hnext = NULL;
    *pp = e;
    lru_push_recent(t, e);
    t->nents++;
    t->total += bytes;
    atomic_store(&t->n_blocks, t->nents);
    atomic_store(&t->n_bytes, t->total);
    return true;
}

static void ix_remove(disk_tier *t, const kv_key *k) {
    disk_ent **pp = ix_find(t, k);
    disk_ent *e = *pp;
    if (!e) return;
    *pp = e->hnext;
    lru_unlink(e);
    t->nents--;
    t->total -= e->bytes;
    atomic_store(&t->n_blocks, t->nents);
    atomic_store(&t->n_bytes, t->total);
    free(e);
}

/* Unlinks least recently used files until the total fits the cap, sparing
 * keep (the block just written). */
static void ix_enforce_cap(disk_tier *t, const kv_key *keep) {
    char path[PATH_MAX];
    while (t->max_bytes && t->total > t->max_bytes && t->lru.next != &t->lru) {
        disk_ent *e = t->lru.next;
        if (keep && !memcmp(e->key.b, keep->b, 16)) break;
        kv_tier_disk_path(t->dir, &e->key, path, sizeof path);
        if (unlink(path) != 0 && errno != ENOENT) note_error(t, errno, "evicting", path);
        atomic_fetch_add(&t->base.n.evicted, 1);
        kv_key k = e->key;
        ix_remove(t, &k);
    }
}

/* The filesystem is full (ENOSPC, EDQUOT) before the cap: unlinks least
 * recently used files worth at least twice the block, or a sixteenth of
 * what the tier holds, so the writes go on as an LRU over the space there
 * is. Returns whether anything was freed. */
static bool make_room(disk_tier *t, size_t len) {
    char path[PATH_MAX];
    pthread_mutex_lock(&t->imu);
    uint64_t want = 2 * (uint64_t)len > t->total / 16 ? 2 * (uint64_t)len : t->total / 16, freed = 0;
    while (freed < want && t->lru.next != &t->lru) {
        disk_ent *e = t->lru.next;
        kv_tier_disk_path(t->dir, &e->key, path, sizeof path);
        if (unlink(path) != 0 && errno != ENOENT) note_error(t, errno, "evicting", path);
        atomic_fetch_add(&t->base.n.evicted, 1);
        freed += e->bytes;
        kv_key k = e->key;
        ix_remove(t, &k);
    }
    pthread_mutex_unlock(&t->imu);
    return freed > 0;
}

/* ---- writer -------------------------------------------------------------- */

static void disk_free(disk_tier *t);
/* Drops a reference (a thread's, at its end, or the owner's at close). */
static void release(disk_tier *t) {
    if (atomic_fetch_sub(&t->refs, 1) == 1) disk_free(t);
}

static int write_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (w == 0) return EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Writes one block to a temporary file and renames it into place; 0 or an
 * errno (already noted). */
static int write_block(disk_tier *t, const disk_item *it) {
    char tmp[PATH_MAX], path[PATH_MAX], sub[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/tmp/%ld.%llu.tmp", t->dir, (long)getpid(), (unsigned long long)atomic_fetch_add(&tmp_seq, 1));
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    int fd = open(tmp, flags, 0644);
    if (fd < 0 && errno == ENOENT) { /* someone removed the folder: make it again */
        snprintf(sub, sizeof sub, "%s/tmp", t->dir);
        if (mkdir_p(sub) == 0) fd = open(tmp, flags, 0644);
    }
    if (fd < 0) {
        int e = errno;
        note_error(t, e, "creating", tmp);
        return e;
    }
    int e = write_all(fd, it->data, it->len);
    if (close(fd) != 0 && !e) e = errno;
    if (e) {
        note_error(t, e, "writing", tmp);
        unlink(tmp);
        return e;
    }
    kv_tier_disk_path(t->dir, &it->key, path, sizeof path);
    /* rename and index change together, so a concurrent drop or get of this
     * key sees the file and the index agree */
    pthread_mutex_lock(&t->imu);
    int r = rename(tmp, path);
    if (r != 0 && errno == ENOENT) {
        sub_path(t, &it->key, sub, sizeof sub);
        if (mkdir(sub, 0755) == 0 || errno == EEXIST) r = rename(tmp, path);
    }
    if (r != 0) {
        e = errno;
        pthread_mutex_unlock(&t->imu);
        note_error(t, e, "renaming into", path);
        unlink(tmp);
        return e;
    }
    ix_put(t, &it->key, it->len);
    ix_enforce_cap(t, &it->key);
    pthread_mutex_unlock(&t->imu);
    return 0;
}

static void *writer_main(void *arg) {
    disk_tier *t = arg;
    pthread_mutex_lock(&t->qmu);
    for (;;) {
        while (!t->stop && (t->paused || !t->qhead)) pthread_cond_wait(&t->work, &t->qmu);
        if (t->stop) break;
        disk_item *it = t->qhead;
        t->qhead = it->next;
        if (!t->qhead) t->qtail = NULL;
        t->qn--;
        t->qbytes -= it->len;
        t->busy = true;
        pthread_mutex_unlock(&t->qmu);

        if (it->drop) {
            char path[PATH_MAX];
            kv_tier_disk_path(t->dir, &it->key, path, sizeof path);
            pthread_mutex_lock(&t->imu);
            if (unlink(path) != 0 && errno != ENOENT) note_error(t, errno, "removing", path);
            ix_remove(t, &it->key);
            pthread_mutex_unlock(&t->imu);
            free(it);
            pthread_mutex_lock(&t->qmu);
            t->busy = false;
            if (!t->qhead) pthread_cond_broadcast(&t->idle);
            continue;
        }
        int e = write_block(t, it);
        if ((e == ENOSPC || e == EDQUOT) && make_room(t, it->len)) e = write_block(t, it);
        if (e == 0) {
            atomic_fetch_add(&t->base.n.writes, 1);
            atomic_fetch_add(&t->base.n.write_bytes, it->len);
            atomic_store(&t->base.n.up, true);
        } else {
            atomic_fetch_add(&t->base.n.dropped, 1);
        }
        free(it);

        pthread_mutex_lock(&t->qmu);
        t->busy = false;
        if (!t->qhead) pthread_cond_broadcast(&t->idle);
    }
    pthread_mutex_unlock(&t->qmu);
    release(t);
    return NULL;
}

/* ---- the ops ------------------------------------------------------------- */

/* Queues a put (data) or a drop (NULL); false: the queue is full. */
static bool enqueue(disk_tier *t, const kv_key *key, const void *data, size_t len) {
    /* a cheap look first, so a full queue costs no copy */
    pthread_mutex_lock(&t->qmu);
    bool full = t->qn >= t->qmax || t->qbytes + len > t->qmax_bytes;
    pthread_mutex_unlock(&t->qmu);
    disk_item *it = full ? NULL : malloc(sizeof *it + len);
    if (!it) return false;
    it->next = NULL;
    it->key = *key;
    it->drop = !data;
    it->len = len;
    if (len) memcpy(it->data, data, len); /* outside the lock: a big copy stalls no other caller */
    pthread_mutex_lock(&t->qmu);
    if (t->qn >= t->qmax || t->qbytes + len > t->qmax_bytes) {
        pthread_mutex_unlock(&t->qmu);
        free(it);
        return false;
    }
    if (t->qtail) t->qtail->next = it;
    else t->qhead = it;
    t->qtail = it;
    t->qn++;
    t->qbytes += len;
    pthread_cond_signal(&t->work);
    pthread_mutex_unlock(&t->qmu);
    return true;
}

static bool disk_put(kv_tier *tt, const kv_key *key, const void *data, size_t len) {
    disk_tier *t = (disk_tier *)tt;
    if (!key || !data || len == 0 || (t->max_bytes && len > t->max_bytes) || !enqueue(t, key, data, len)) {
        atomic_fetch_add(&t->base.n.dropped, 1);
        return false;
    }
    return true;
}

enum { R_HIT, R_ABSENT, R_BAD, R_ERROR };
/* get opens this many files at once and asks the kernel to read them ahead
 * together (WILLNEED), so a cold batch costs about one disk latency, not one
 * per block */
#define DISK_GET_WINDOW 32

/* A file at a block's name that is no block of this tier's (what, e.g. "a
 * FIFO"): removed, counted as corrupt, the first one logged. */
static void bad_file(disk_tier *t, const char *path, const char *what) {
    if (unlink(path) != 0 && errno != ENOENT && !(errno == EISDIR && rmdir(path) == 0))
        note_error(t, errno, "removing", path);
    kv_tier_note_corrupt(&t->base);
    if (!atomic_exchange(&t->logged_bad, true))
        LOG_WARN("disk tier %s: %s is %s, not a block: removed (further ones are only counted)", t->dir, path, what);
}

/* Opens one block's file without blocking or following a link; R_HIT
 * leaves it open in *fd with its size in *size and its read-ahead started. */
static int open_block(disk_tier *t, const char *path, size_t cap, int *fd_out, size_t *size) {
    *fd_out = -1;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return R_ABSENT;
        if (errno == ELOOP) { bad_file(t, path, "a symbolic link"); return R_BAD; }
        note_error(t, errno, "opening", path);
        return R_ERROR;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        note_error(t, errno, "reading", path);
        close(fd);
        return R_ERROR;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        bad_file(t, path, S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISDIR(st.st_mode) ? "a directory" : "a device or socket");
        return R_BAD;
    }
    if (st.st_size == 0) {
        /* only a power loss makes an empty final file: it is no block */
        close(fd);
        unlink(path);
        return R_ABSENT;
    }
    if ((uint64_t)st.st_size > cap) {
        close(fd);
        char what[64];
        snprintf(what, sizeof what, "%llu bytes, longer than any block", (unsigned long long)st.st_size);
        bad_file(t, path, what);
        return R_BAD;
    }
    posix_fadvise(fd, 0, st.st_size, POSIX_FADV_WILLNEED);
    *fd_out = fd;
    *size = (size_t)st.st_size;
    return R_HIT;
}

/* Reads an opened block into buf; on anything but R_HIT the file is closed. */
static int read_block(disk_tier *t, const char *path, int fd, size_t size, void *buf, size_t *len) {
    size_t got = 0;
    *len = 0;
    while (got < size) {
        ssize_t r = read(fd, (unsigned char *)buf + got, size - got);
        if (r < 0) {
            if (errno == EINTR) continue;
            note_error(t, errno, "reading", path);
            close(fd);
            return R_ERROR;
        }
        if (r == 0) break; /* shorter than its size said: return what is there */
        got += (size_t)r;
    }
    if (got == 0) {
        close(fd);
        return R_ABSENT;
    }
    /* mtime is the LRU order the next open rebuilds */
    futimens(fd, (const struct timespec[2]){{0, UTIME_OMIT}, {0, UTIME_NOW}});
    *len = got;
    return R_HIT;
}

/* The reader's half of a get: each block read into the bounce buffer, then
 * copied out under jmu unless the caller gave up. */
static void run_get(disk_tier *t, disk_job *j) {
    char path[PATH_MAX];
    if (t->bounce_cap < j->cap) {
        unsigned char *b = realloc(t->bounce, j->cap);
        if (!b) return;
        t->bounce = b;
        t->bounce_cap = j->cap;
    }
    for (int i0 = 0; i0 < j->n; i0 += DISK_GET_WINDOW) {
        int m = j->n - i0 < DISK_GET_WINDOW ? j->n - i0 : DISK_GET_WINDOW;
        int fds[DISK_GET_WINDOW], res[DISK_GET_WINDOW];
        size_t sizes[DISK_GET_WINDOW];
        for (int k = 0; k < m; k++) {
            kv_tier_disk_path(t->dir, &j->keys[i0 + k], path, sizeof path);
            res[k] = open_block(t, path, j->cap, &fds[k], &sizes[k]);
        }
        bool gone = false;
        for (int k = 0; k < m; k++) {
            int i = i0 + k, fd = fds[k];
            size_t len = 0;
            kv_tier_disk_path(t->dir, &j->keys[i], path, sizeof path);
            if (res[k] == R_HIT && !gone) res[k] = read_block(t, path, fd, sizes[k], t->bounce, &len);
            else if (res[k] == R_HIT) {
                close(fd);
                continue;
            }
            if (gone) continue;
            pthread_mutex_lock(&t->imu);
            if (res[k] == R_HIT) {
                struct stat st;
                disk_ent *e = *ix_find(t, &j->keys[i]);
                if (e) { /* most recently used now */
                    lru_unlink(e);
                    lru_push_recent(t, e);
                } else if (fstat(fd, &st) == 0 && st.st_nlink > 0) {
                    /* a block another process wrote joins the index, unless
                     * it was unlinked (evicted, dropped) while we read it */
                    ix_put(t, &j->keys[i], (uint64_t)st.st_size);
                }
            } else if ((res[k] == R_ABSENT || res[k] == R_BAD) && *ix_find(t, &j->keys[i])) {
                /* deleted by another process; check again under the lock, in
                 * case our writer renamed it in just after the open */
                struct stat st;
                if (fstatat(AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) != 0) ix_remove(t, &j->keys[i]);
            }
            pthread_mutex_unlock(&t->imu);
            if (res[k] == R_HIT) close(fd);
            pthread_mutex_lock(&t->jmu);
            if (j->abandoned) gone = true;
            else {
                if (res[k] == R_HIT) memcpy(j->bufs[i], t->bounce, len);
                j->lens[i] = res[k] == R_HIT ? len : 0;
                j->done = i + 1;
            }
            pthread_mutex_unlock(&t->jmu);
        }
        if (gone) break;
    }
}

static void run_contains(disk_tier *t, disk_job *j) {
    char path[PATH_MAX];
    int i = 0;
    for (; i < j->n; i++) {
        struct stat st;
        kv_tier_disk_path(t->dir, &j->keys[i], path, sizeof path);
        if (fstatat(AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) break;
    }
    j->present = i;
}

static void *reader_main(void *arg) {
    disk_tier *t = arg;
    pthread_mutex_lock(&t->jmu);
    for (;;) {
        while (!t->rstop && !(t->job && !t->job->taken)) pthread_cond_wait(&t->jcv, &t->jmu);
        if (t->rstop) break;
        disk_job *j = t->job;
        j->taken = true;
        int stall = t->stall_ms;
        t->stall_ms = 0;
        pthread_mutex_unlock(&t->jmu);
        if (stall) usleep((useconds_t)stall * 1000);
        if (j->kind == JOB_GET) run_get(t, j);
        else run_contains(t, j);
        pthread_mutex_lock(&t->jmu);
        j->finished = true;
        if (j->abandoned) { /* its caller is gone: the job is ours to free, and the tier reads again */
            t->job = NULL;
            free(j->keys);
            free(j);
            if (t->hung_since > 0)
                LOG_WARN("disk tier %s: reads answer again after %.1f s (%llu reads missed meanwhile)", t->dir,
                         util_now_s() - t->hung_since, (unsigned long long)t->hung_missed);
            t->hung_since = 0;
            t->hung_missed = 0;
        }
        pthread_cond_broadcast(&t->jcv);
    }
    pthread_mutex_unlock(&t->jmu);
    release(t);
    return NULL;
}

static void abs_time(struct timespec *ts, double t) {
    ts->tv_sec = (time_t)t;
    ts->tv_nsec = (long)((t - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* Runs a job on the reader thread, waiting at most read_ms (jmu held by
 * the caller; the job is the caller's unless this returns false: then the
 * reader still has it and frees it). */
static bool run_job(disk_tier *t, disk_job *j) {
    double deadline = util_now_s() + t->read_ms / 1000.0;
    struct timespec ts;
    abs_time(&ts, deadline);
    /* another caller's job first (one at a time); an abandoned one means the reader is stuck */
    while (t->job && !t->job->abandoned && !t->rstop)
        if (pthread_cond_timedwait(&t->jcv, &t->jmu, &ts) == ETIMEDOUT) break;
    if (t->job || t->rstop) {
        t->hung_missed += t->hung_since > 0;
        return true; /* not run: every block missed */
    }
    t->job = j;
    pthread_cond_broadcast(&t->jcv);
    while (!j->finished)
        if (pthread_cond_timedwait(&t->jcv, &t->jmu, &ts) == ETIMEDOUT) break;
    if (j->finished) {
        t->job = NULL;
        pthread_cond_broadcast(&t->jcv);
        return true;
    }
    j->abandoned = true; /* the reader frees it when (if) it comes back */
    atomic_fetch_add(&t->base.n.errors, 1);
    if (t->hung_since <= 0) {
        t->hung_since = util_now_s();
        LOG_WARN("disk tier %s: a read has not finished after %.1f s (is the disk or filesystem hung?); reads miss "
                 "until it does", t->dir, t->read_ms / 1000.0);
    }
    t->hung_missed++;
    return false;
}

static disk_job *job_new(int kind, int n, const kv_key *keys) {
    disk_job *j = calloc(1, sizeof *j);
    if (!j || !(j->keys = malloc((size_t)n * sizeof *keys))) {
        free(j);
        return NULL;
    }
    memcpy(j->keys, keys, (size_t)n * sizeof *keys);
    j->kind = kind;
    j->n = n;
    return j;
}

static int disk_get(kv_tier *tt, int n, const kv_key *keys, void *const *bufs, size_t cap, size_t *lens) {
    disk_tier *t = (disk_tier *)tt;
    double t0 = util_now_s();
    for (int i = 0; i < n; i++) lens[i] = 0;
    disk_job *j = n > 0 ? job_new(JOB_GET, n, keys) : NULL;
    if (j) {
        j->bufs = bufs;
        j->cap = cap;
        j->lens = lens;
        pthread_mutex_lock(&t->jmu);
        bool ours = run_job(t, j);
        pthread_mutex_unlock(&t->jmu);
        if (ours) {
            free(j->keys);
            free(j);
        }
    }
    int lead = 0, found = 0;
    bool gap = false;
    for (int i = 0; i < n; i++) {
        if (lens[i]) {
            found++;
            if (!gap) lead++;
        } else gap = true;
    }
    kv_tier_note_read(tt, found, n, t0);
    return lead;
}

static int disk_contains(kv_tier *tt, int n, const kv_key *keys) {
    disk_tier *t = (disk_tier *)tt;
    disk_job *j = n > 0 ? job_new(JOB_CONTAINS, n, keys) : NULL;
    if (!j) return 0;
    pthread_mutex_lock(&t->jmu);
    bool ours = run_job(t, j);
    int present = ours && j->finished ? j->present : 0;
    pthread_mutex_unlock(&t->jmu);
    if (ours) {
        free(j->keys);
        free(j);
    }
    return present;
}

static void disk_drop(kv_tier *tt, const kv_key *key) {
    /* on the writer (a full queue loses it: a reader's check still guards the block) */
    enqueue((disk_tier *)tt, key, NULL, 0);
}

/* Drops what the writer has not taken (qmu held), counting the puts. */
static void drop_queued(disk_tier *t) {
    for (disk_item *it = t->qhead, *nx; it; it = nx) {
        nx = it->next;
        if (!it->drop) atomic_fetch_add(&t->base.n.dropped, 1);
        free(it);
    }
    t->qhead = t->qtail = NULL;
    t->qn = 0;
    t->qbytes = 0;
}

static void disk_flush(kv_tier *tt) {
    disk_tier *t = (disk_tier *)tt;
    pthread_mutex_lock(&t->qmu);
    if (t->paused) {
        t->paused = false;
        pthread_cond_signal(&t->work);
    }
    double start = util_now_s(), progress = start;
    int last_n = t->qn;
    while (t->qhead || t->busy) {
        double now = util_now_s();
        if (t->qn != last_n) { last_n = t->qn; progress = now; }
        if (now - progress > DISK_FLUSH_STALL_MS / 1000.0 || now - start > DISK_FLUSH_MS / 1000.0) {
            int n = t->qn;
            drop_queued(t);
            LOG_WARN("disk tier %s: the writer made no progress for %.1f s (is the disk hung?); %d queued blocks "
                     "dropped", t->dir, now - progress, n);
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&t->idle, &t->qmu, &ts);
    }
    pthread_mutex_unlock(&t->qmu);
}

static void disk_stats(kv_tier *tt, kv_tier_stats *out) {
    disk_tier *t = (disk_tier *)tt;
    out->blocks = atomic_load(&t->n_blocks);
    out->bytes = atomic_load(&t->n_bytes);
}

static void disk_free(disk_tier *t) {
    for (disk_ent *e = t->lru.next, *nx; e && e != &t->lru; e = nx) {
        nx = e->next;
        free(e);
    }
    for (disk_item *it = t->qhead, *nx; it; it = nx) {
        nx = it->next;
        free(it);
    }
    free(t->buckets);
    free(t->bounce);
    pthread_mutex_destroy(&t->qmu);
    pthread_mutex_destroy(&t->imu);
    pthread_mutex_destroy(&t->jmu);
    pthread_cond_destroy(&t->work);
    pthread_cond_destroy(&t->idle);
    pthread_cond_destroy(&t->jcv);
    free(t->dir);
    free(t);
}

/* Joins th within DISK_JOIN_MS; false: it is stuck (detached instead). */
static bool join_within(pthread_t th) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += DISK_JOIN_MS / 1000;
    ts.tv_nsec += (long)(DISK_JOIN_MS % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    if (pthread_timedjoin_np(th, NULL, &ts) == 0) return true;
    pthread_detach(th);
    return false;
}

static void disk_close(kv_tier *tt) {
    disk_tier *t = (disk_tier *)tt;
    disk_flush(tt);
    pthread_mutex_lock(&t->qmu);
    t->stop = true;
    pthread_cond_signal(&t->work);
    pthread_mutex_unlock(&t->qmu);
    pthread_mutex_lock(&t->jmu);
    t->rstop = true;
    pthread_cond_broadcast(&t->jcv);
    pthread_mutex_unlock(&t->jmu);
    bool w = join_within(t->writer), r = join_within(t->reader);
    if (!w || !r) /* it frees t when (if) it comes back */
        LOG_WARN("disk tier %s: its %s thread is stuck in a system call (is the disk hung?); left behind", t->dir,
                 !w ? "writer" : "reader");
    release(t);
}

static const kv_tier_ops disk_ops = {
    .name = "disk",
    .put = disk_put,
    .get = disk_get,
    .contains = disk_contains,
    .drop = disk_drop,
    .flush = disk_flush,
    .stats = disk_stats,
    .close = disk_close,
};

/* ---- open: format marker, stale temporaries, the index from the folder --- */

static bool is_hex2(const char *s) {
    return strlen(s) == 2 && strchr("0123456789abcdef", s[0]) && strchr("0123456789abcdef", s[1]) && s[0] && s[1];
}

/* Checks DIR/FORMAT, writing it (atomically) when absent. */
static int check_format(const char *dir, kvlm_error *err) {
    char path[PATH_MAX], tmp[PATH_MAX], buf[256];
    snprintf(path, sizeof path, "%s/FORMAT", dir);
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
        close(fd);
        return util_err_set(err, KVLM_EINVAL, "disk tier %s: %s is not a regular file", dir, path);
    }
    if (fd >= 0) {
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        buf[n > 0 ? n : 0] = 0;
        if (strncmp(buf, DISK_FORMAT, 17) != 0) /* "kvlm disk tier 1\n" */
            return util_err_set(err, KVLM_EUNSUPPORTED, "disk tier %s: FORMAT says \"%.*s\", expected \"kvlm disk tier 1\"",
                                dir, (int)strcspn(buf, "\n"), buf);
        return 0;
    }
    if (errno != ENOENT) return util_err_set(err, KVLM_EIO, "disk tier: opening %s: %s", path, strerror(errno));
    snprintf(tmp, sizeof tmp, "%s/tmp/%ld.format.tmp", dir, (long)getpid());
    unlink(tmp);
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    int e = fd < 0 ? errno : write_all(fd, (const unsigned char *)DISK_FORMAT, strlen(DISK_FORMAT));
    if (fd >= 0 && close(fd) != 0 && !e) e = errno;
    if (!e && rename(tmp, path) != 0) e = errno;
    if (e) {
        unlink(tmp);
        return util_err_set(err, KVLM_EIO, "disk tier: writing %s: %s", path, strerror(e));
    }
    return 0;
}

/* Removes temporary files whose writer is gone or that are stale. */
static void clean_tmp(disk_tier *t) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/tmp", t->dir);
    DIR *d = opendir(path);
    if (!d) return;
    time_t now = time(NULL);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
        char *end;
        long pid = strtol(de->d_name, &end, 10);
        bool dead = end != de->d_name && *end == '.' && pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
        if (dead || now - st.st_mtime > DISK_STALE_TMP_S) unlinkat(dirfd(d), de->d_name, 0);
    }
    closedir(d);
}

typedef struct {
    kv_key key;
    uint64_t bytes;
    int64_t mtime_ns;
} scan_ent;

static int scan_cmp(const void *a, const void *b) {
    const scan_ent *x = a, *y = b;
    if (x->mtime_ns != y->mtime_ns) return x->mtime_ns < y->mtime_ns ? -1 : 1;
    return memcmp(x->key.b, y->key.b, 16);
}

/* Rebuilds the index from DIR/<hh>/<hex>.kvb, oldest mtime least recently used. */
static int scan_dir(disk_tier *t, kvlm_error *err) {
    DIR *d = opendir(t->dir);
    if (!d) return util_err_set(err, KVLM_EIO, "disk tier: reading %s: %s", t->dir, strerror(errno));
    scan_ent *v = NULL;
    size_t n = 0, capn = 0;
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        if (!is_hex2(de->d_name)) continue;
        int sfd = openat(dirfd(d), de->d_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        DIR *s = sfd >= 0 ? fdopendir(sfd) : NULL;
        if (!s) {
            if (sfd >= 0) close(sfd);
            continue;
        }
        struct dirent *fe;
        while ((fe = readdir(s))) {
            /* <32 hex>.kvb, in the subfolder of its first two digits */
            char hex[KV_KEY_HEX];
            if (strlen(fe->d_name) != 36 || strcmp(fe->d_name + 32, ".kvb") != 0) continue;
            memcpy(hex, fe->d_name, 32);
            hex[32] = 0;
            kv_key k;
            if (!kv_key_parse(hex, &k) || memcmp(hex, de->d_name, 2) != 0) continue;
            struct stat st;
            if (fstatat(dirfd(s), fe->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
            if (st.st_size == 0) { /* a power loss's leftover: no block */
                unlinkat(dirfd(s), fe->d_name, 0);
                continue;
            }
            if (n == capn) {
                size_t nc = capn ? 2 * capn : 4096;
                scan_ent *nv = realloc(v, nc * sizeof *nv);
                if (!nv) {
                    rc = util_err_set(err, KVLM_ENOMEM, "disk tier %s: no memory for the index", t->dir);
                    break;
                }
                v = nv;
                capn = nc;
            }
            v[n++] = (scan_ent){k, (uint64_t)st.st_size, (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec};
        }
        closedir(s);
    }
    closedir(d);
    if (!rc) {
        if (n) qsort(v, n, sizeof *v, scan_cmp);
        if (!ix_grow(t, 2 * n + 1)) rc = util_err_set(err, KVLM_ENOMEM, "disk tier %s: no memory for the index", t->dir);
        for (size_t i = 0; !rc && i < n; i++)
            if (!ix_put(t, &v[i].key, v[i].bytes))
                rc = util_err_set(err, KVLM_ENOMEM, "disk tier %s: no memory for the index", t->dir);
    }
    free(v);
    if (!rc) ix_enforce_cap(t, NULL); /* the cap may be smaller than last time */
    return rc;
}

kv_tier *kv_tier_disk_open(const char *dir, uint64_t max_bytes, kvlm_error *err) {
    if (!dir || !*dir) {
        util_err_set(err, KVLM_EINVAL, "disk tier: no folder given");
        return NULL;
    }
    if (strlen(dir) > PATH_MAX - 64) {
        util_err_set(err, KVLM_EINVAL, "disk tier: folder name too long (%zu bytes)", strlen(dir));
        return NULL;
    }
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s/tmp", dir);
    int e = mkdir_p(tmp);
    if (e) {
        util_err_set(err, KVLM_EIO, "disk tier: creating %s: %s", tmp, strerror(e));
        return NULL;
    }
    if (access(tmp, W_OK | X_OK) != 0) {
        util_err_set(err, KVLM_EIO, "disk tier: %s is not writable: %s", tmp, strerror(errno));
        return NULL;
    }
    if (check_format(dir, err)) return NULL;

    disk_tier *t = calloc(1, sizeof *t);
    if (!t || !(t->dir = strdup(dir))) {
        free(t);
        util_err_set(err, KVLM_ENOMEM, "disk tier: out of memory");
        return NULL;
    }
    size_t dl = strlen(t->dir);
    while (dl > 1 && t->dir[dl - 1] == '/') t->dir[--dl] = 0;
    t->base.ops = &disk_ops;
    t->max_bytes = max_bytes;
    t->qmax = DISK_QUEUE_BLOCKS;
    t->qmax_bytes = DISK_QUEUE_BYTES;
    t->lru.prev = t->lru.next = &t->lru;
    atomic_store(&t->base.n.up, true);
    pthread_mutex_init(&t->qmu, NULL);
    pthread_mutex_init(&t->imu, NULL);
    pthread_cond_init(&t->work, NULL);
    pthread_cond_init(&t->idle, NULL);
    pthread_mutex_init(&t->jmu, NULL);
    pthread_condattr_t ca; /* the reader's waits are on util_now_s's clock */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&t->jcv, &ca);
    pthread_condattr_destroy(&ca);
    t->read_ms = DISK_READ_MS;

    clean_tmp(t);
    if (!ix_grow(t, 1024) || scan_dir(t, err)) {
        if (err && !err->code) util_err_set(err, KVLM_ENOMEM, "disk tier: out of memory");
        disk_free(t);
        return NULL;
    }
    atomic_init(&t->refs, 2);
    if (pthread_create(&t->reader, NULL, reader_main, t) != 0) {
        util_err_set(err, KVLM_ENOMEM, "disk tier %s: cannot start the reader thread", dir);
        disk_free(t);
        return NULL;
    }
    atomic_fetch_add(&t->refs, 1);
    if (pthread_create(&t->writer, NULL, writer_main, t) != 0) {
        atomic_fetch_sub(&t->refs, 1);
        util_err_set(err, KVLM_ENOMEM, "disk tier %s: cannot start the writer thread", dir);
        pthread_mutex_lock(&t->jmu);
        t->rstop = true;
        pthread_cond_broadcast(&t->jcv);
        pthread_mutex_unlock(&t->jmu);
        pthread_join(t->reader, NULL);
        disk_free(t);
        return NULL;
    }
    return &t->base;
}

/* ---- hooks for tests and benchmarks -------------------------------------- */

void kv_tier_disk_set_queue_limits(kv_tier *tt, int max_blocks, size_t max_bytes) {
    if (!tt || tt->ops != &disk_ops) return;
    disk_tier *t = (disk_tier *)tt;
    pthread_mutex_lock(&t->qmu);
    t->qmax = max_blocks;
    t->qmax_bytes = max_bytes;
    pthread_mutex_unlock(&t->qmu);
}

void kv_tier_disk_set_read_deadline(kv_tier *tt, int ms) {
    if (!tt || tt->ops != &disk_ops) return;
    disk_tier *t = (disk_tier *)tt;
    pthread_mutex_lock(&t->jmu);
    t->read_ms = ms > 0 ? ms : DISK_READ_MS;
    pthread_mutex_unlock(&t->jmu);
}

void kv_tier_disk_stall_reader(kv_tier *tt, int ms) {
    if (!tt || tt->ops != &disk_ops) return;
    disk_tier *t = (disk_tier *)tt;
    pthread_mutex_lock(&t->jmu);
    t->stall_ms = ms;
    pthread_mutex_unlock(&t->jmu);
}

void kv_tier_disk_pause_writer(kv_tier *tt, bool paused) {
    if (!tt || tt->ops != &disk_ops) return;
    disk_tier *t = (disk_tier *)tt;
    pthread_mutex_lock(&t->qmu);
    t->paused = paused;
    pthread_cond_signal(&t->work);
    pthread_mutex_unlock(&t->qmu);
}
