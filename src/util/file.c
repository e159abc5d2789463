/* util/file: see file.h. */
#include "util/file.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "util/error.h"
#include "util/log.h"

char *util_read_file(const char *path, size_t max, size_t *len, kvlm_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        util_err_set(err, KVLM_EIO, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    int rc = buf ? KVLM_OK : util_err_set(err, KVLM_ENOMEM, "%s: out of memory", path);
    while (!rc) {
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break; /* the end, or an error (below) */
        if (n > max) { rc = util_err_set(err, KVLM_EINVAL, "%s: larger than %zu bytes", path, max); break; }
        if (n + 1 < cap) continue;
        char *nb = realloc(buf, cap * 2);
        if (!nb) { rc = util_err_set(err, KVLM_ENOMEM, "%s: out of memory", path); break; }
        buf = nb;
        cap *= 2;
    }
    if (!rc && ferror(f)) rc = util_err_set(err, KVLM_EIO, "%s: read error: %s", path, strerror(errno));
    fclose(f);
    if (rc) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

void *util_map_file(int fd, size_t size, int flags, const char *path) {
    void *p;
    if (flags & UTIL_MAP_READ) {
        /* anonymous pages filled by read(): they do not change or go with the file */
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return p;
        size_t done = 0;
        while (done < size) {
            ssize_t got = pread(fd, (char *)p + done, size - done, (off_t)done);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) {
                int e = got < 0 ? errno : EIO; /* 0: the file shrank under us */
                munmap(p, size);
                errno = e;
                return MAP_FAILED;
            }
            done += (size_t)got;
        }
        mprotect(p, size, PROT_READ);
    } else {
        p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) return p;
    }
    if ((flags & UTIL_MAP_LOCK) && mlock(p, size) != 0)
        LOG_WARN("%s: cannot lock its %zu bytes in memory (%s): raise the limit with ulimit -l (RLIMIT_MEMLOCK); "
                 "going on unlocked", path, size, strerror(errno));
    return p;
}
