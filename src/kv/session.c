/* kv/session: saving a sequence (tokens + full blocks in kv/blockfmt's form)
 * to a file and attaching it again to a prompt that starts with its tokens;
 * the file layout is in session.h. */
#include "kv/session.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "kvlm.h"
#include "ops/kvtype.h"
#include "util/error.h"
#include "util/log.h"

#define SES_VERSION 1
#define SES_HEADER 72
static const uint8_t k_magic[8] = {'K', 'V', 'L', 'M', 'S', 'E', 'S', '1'};

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }

/* Removes "<path>.tmp.<pid>" files of processes that are gone (a save
 * killed before its rename). */
static void clean_stale_tmp(const char *path) {
    char dir[4096];
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    if (!slash) strcpy(dir, ".");
    else if (slash == path) strcpy(dir, "/");
    else {
        size_t dl = (size_t)(slash - path);
        if (dl >= sizeof dir) return;
        memcpy(dir, path, dl);
        dir[dl] = 0;
    }
    size_t bl = strlen(base);
    if (!bl) return;
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        if (strncmp(n, base, bl) != 0 || strncmp(n + bl, ".tmp.", 5) != 0) continue;
        const char *digits = n + bl + 5;
        char *end;
        long pid = strtol(digits, &end, 10);
        struct stat st;
        if (end == digits || *end || pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        if (fstatat(dirfd(d), n, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
            unlinkat(dirfd(d), n, 0);
            LOG_INFO("session %s: removed %s, left by process %ld (gone) in the middle of a save", path, n, pid);
        }
    }
    closedir(d);
}

/* Opens path for reading as a regular file, never blocking (a FIFO) and never
 * through a symbolic link; NULL with errno set (ENOENT: absent) and *what a
 * description of anything else. */
static FILE *open_regular(const char *path, const char **what) {
    *what = NULL;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ELOOP) *what = "is a symbolic link (give the file itself)";
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        *what = S_ISFIFO(st.st_mode) ? "is a FIFO, not a session file" : S_ISDIR(st.st_mode) ? "is a directory"
                                                                                          : "is not a regular file";
        close(fd);
        errno = EINVAL;
        return NULL;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    FILE *fp = fdopen(fd, "rb");
    if (!fp) close(fd);
    return fp;
}

static const char *type_name(int t) {
    const char *n = op_kv_type_name(t);
    return n ? n : "?";
}

int kv_session_save(kv_store *s, int seq, const char *path, kvlm_error *err) {
    kv_cache *c = kv_store_pool(s);
    const kv_blockfmt *f = kv_get_blockfmt(c);
    int n = kv_seq_len(c, seq), bs = f->block_size, nb = n / bs, have;
    const int32_t *blocks = kv_seq_blocks(c, seq, &have);
    const int32_t *tokens = kv_seq_tokens(c, seq);
    size_t blob = kv_blockfmt_bytes(f);
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return util_err_set(err, KVLM_EINVAL, "session path too long");
    clean_stale_tmp(path);
    uint8_t head[SES_HEADER], *buf = malloc(blob > 1024 ? blob : 1024);
    /* O_EXCL: never write through whatever another process put at that name */
    int fd = -1;
    for (int tries = 0; buf && fd < 0 && tries < 2; tries++) {
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
        if (fd < 0 && errno == EEXIST && tries == 0) unlink(tmp); /* ours from a pid reused: stale */
    }
    FILE *fp = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!fp) {
        int e = errno;
        if (fd >= 0) close(fd);
        free(buf);
        return util_err_set(err, KVLM_EIO, "cannot write session %s: %s", tmp, buf ? strerror(e) : "out of memory");
    }
    memcpy(head, k_magic, 8);
    put32(head + 8, SES_VERSION);
    put32(head + 12, KV_BLOCKFMT_VERSION);
    memcpy(head + 16, f->model.b, 16);
    put32(head + 32, (uint32_t)f->k_type);
    put32(head + 36, (uint32_t)f->v_type);
    put32(head + 40, (uint32_t)bs);
    put32(head + 44, f->auth ? 1u : 0u);
    put64(head + 48, (uint64_t)n);
    put64(head + 56, (uint64_t)nb);
    put64(head + 64, (uint64_t)blob);
    bool ok = fwrite(head, 1, SES_HEADER, fp) == SES_HEADER;
    for (int i = 0; ok && i < n; i++) {
        uint8_t t[4];
        put32(t, (uint32_t)tokens[i]);
        ok = fwrite(t, 1, 4, fp) == 4;
    }
    kv_key key, parent;
    for (int i = 0; ok && i < nb && i < have; i++) {
        kv_block_key(f, i ? &parent : kv_seq_root(c, seq), tokens + (size_t)i * bs, &key);
        kv_blockfmt_begin(f, &key, tokens + (size_t)i * bs, buf);
        kv_block_read(c, blocks[i], buf + kv_blockfmt_payload_offset(f));
        kv_blockfmt_seal(f, buf);
        ok = fwrite(buf, 1, blob, fp) == blob;
        parent = key;
    }
    free(buf);
    if (fclose(fp) != 0) ok = false;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return util_err_set(err, KVLM_EIO, "cannot write session %s: %s", path, strerror(e));
    }
    return KVLM_OK;
}

int kv_session_load(kv_store *s, int seq, const int32_t *tokens, int n, const char *path, kvlm_error *err) {
    kv_cache *c = kv_store_pool(s);
    const kv_blockfmt *f = kv_get_blockfmt(c);
    clean_stale_tmp(path);
    const char *what;
    FILE *fp = open_regular(path, &what);
    if (!fp) {
        if (errno == ENOENT && !what) return 0;
        util_err_set(err, KVLM_EIO, "cannot open session %s: %s", path, what ? what : strerror(errno));
        return -KVLM_EIO;
    }
    uint8_t head[SES_HEADER];
    int rc = 0, code = KVLM_OK;
    uint8_t *buf = NULL;
    int32_t *saved = NULL;
    if (fread(head, 1, SES_HEADER, fp) != SES_HEADER || memcmp(head, k_magic, 8)) {
        code = util_err_set(err, KVLM_EFORMAT, "%s is not a kvlm session file", path);
        goto done;
    }
    if (get32(head + 8) != SES_VERSION || get32(head + 12) != KV_BLOCKFMT_VERSION) {
        code = util_err_set(err, KVLM_EFORMAT,
                            "session %s has format version %u (blocks %u); this kvlm reads version %d (blocks %d): "
                            "delete it to start a new one", path, get32(head + 8), get32(head + 12), SES_VERSION,
                            KV_BLOCKFMT_VERSION);
        goto done;
    }
    if (memcmp(head + 16, f->model.b, 16)) {
        code = util_err_set(err, KVLM_EINVAL, "session %s was saved with another model (its fingerprint differs): "
                            "use that model, or another session file", path);
        goto done;
    }
    if ((get32(head + 44) & 1u) != (f->auth ? 1u : 0u)) {
        code = util_err_set(err, KVLM_EINVAL, "session %s was saved %s a block-signing key (--kv-key) and this run "
                            "has %s: use the same key setting, or another session file", path,
                            get32(head + 44) & 1u ? "with" : "without", f->auth ? "one" : "none");
        goto done;
    }
    int kt = (int)get32(head + 32), vt = (int)get32(head + 36), bs = (int)get32(head + 40);
    if (kt != f->k_type || vt != f->v_type || bs != f->block_size) {
        code = util_err_set(err, KVLM_EINVAL, "session %s was saved with a %s/%s cache in blocks of %d tokens; this "
                            "run uses %s/%s in blocks of %d (--cache-type-k/-v, --block-size)", path, type_name(kt),
                            type_name(vt), bs, type_name(f->k_type), type_name(f->v_type), f->block_size);
        goto done;
    }
    uint64_t n_saved = get64(head + 48), nb = get64(head + 56), blob = get64(head + 64);
    if (blob != kv_blockfmt_bytes(f) || nb > n_saved / (uint64_t)bs || n_saved > (1u << 24)) {
        code = util_err_set(err, KVLM_EFORMAT, "session %s is damaged (sizes do not match)", path);
        goto done;
    }
    saved = malloc((n_saved ? n_saved : 1) * sizeof *saved);
    buf = malloc(blob);
    uint8_t *raw = malloc(n_saved * 4 + 1);
    if (!saved || !buf || !raw || fread(raw, 4, n_saved, fp) != n_saved) {
        free(raw);
        code = util_err_set(err, KVLM_EFORMAT, "session %s is truncated", path);
        goto done;
    }
    for (uint64_t i = 0; i < n_saved; i++) saved[i] = (int32_t)get32(raw + 4 * i);
    free(raw);
    /* the blocks whose tokens the prompt repeats, leaving one token to compute */
    int same = 0;
    while (same < n && (uint64_t)same < n_saved && saved[same] == tokens[same]) same++;
    int use = same / bs;
    if (use > (n - 1) / bs) use = (n - 1) / bs;
    if ((uint64_t)use > nb) use = (int)nb;
    if (kv_seq_len(c, seq) != 0) use = 0;
    kv_key key, parent;
    for (int i = 0; i < use; i++) {
        const char *why = NULL;
        const uint8_t *payload = NULL;
        kv_block_key(f, i ? &parent : kv_seq_root(c, seq), tokens + (size_t)i * bs, &key);
        if (fread(buf, 1, blob, fp) == blob)
            payload = kv_blockfmt_check(f, &key, tokens + (size_t)i * bs, buf, blob, &why);
        if (!payload) {
            LOG_WARN("session %s: block %d is damaged (%s); the rest is recomputed", path, i, why ? why : "truncated");
            break;
        }
        int32_t b = kv_seq_attach_block(c, seq, tokens + (size_t)i * bs, &key);
        if (b < 0) break; /* no room, or no prefix cache: computed instead */
        kv_block_write(c, b, payload);
        rc += bs;
        parent = key;
    }
done:
    fclose(fp);
    free(buf);
    free(saved);
    return code ? -code : rc;
}
