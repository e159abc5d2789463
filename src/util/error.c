/* util/error: status codes and messages for kvlm_error. */
#include "util/error.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int util_err_set(kvlm_error *err, int code, const char *fmt, ...) {
    if (!err) return code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return code;
}

void util_err_prefix(kvlm_error *err, const char *fmt, ...) {
    if (!err) return;
    char buf[sizeof err->msg * 2];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof err->msg, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof err->msg) n = (int)sizeof err->msg - 1;
    /* Prefix, ": ", old message; the result is cut to fit msg. */
    size_t len = (size_t)n;
    memcpy(buf + len, ": ", 2);
    len += 2;
    size_t old = strnlen(err->msg, sizeof err->msg - 1);
    memcpy(buf + len, err->msg, old);
    len += old;
    if (len >= sizeof err->msg) len = sizeof err->msg - 1;
    memcpy(err->msg, buf, len);
    err->msg[len] = 0;
}

void util_err_clear(kvlm_error *err) {
    if (!err) return;
    err->code = KVLM_OK;
    err->msg[0] = 0;
}

const char *kvlm_status_name(int code) {
    switch (code) {
    case KVLM_OK: return "ok";
    case KVLM_EIO: return "i/o error";
    case KVLM_EFORMAT: return "bad format";
    case KVLM_EINVAL: return "invalid argument";
    case KVLM_ENOMEM: return "out of memory";
    case KVLM_ERANGE: return "out of range";
    case KVLM_EUNSUPPORTED: return "unsupported";
    case KVLM_EFULL: return "cache full";
    case KVLM_ECANCELED: return "canceled";
    default: return "unknown error";
    }
}
