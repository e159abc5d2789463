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
    char pre[256], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    snprintf(err->msg, sizeof err->msg, "%s: %s", pre, old);
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
    default: return "unknown error";
    }
}
