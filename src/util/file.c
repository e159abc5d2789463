/* util/file: see file.h. */
#include "util/file.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util/error.h"

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
