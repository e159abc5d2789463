/* util/error: filling a kvlm_error with a status and a message a person can act on. */
#ifndef KVLM_UTIL_ERROR_H
#define KVLM_UTIL_ERROR_H
#include "kvlm.h"

/* Sets err (if not NULL) to code + printf-style message; returns code so
 * callers can `return kvlm_err_set(...)`. */
int util_err_set(kvlm_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prefixes an already-set message with context ("loading x.gguf: ..."). */
void util_err_prefix(kvlm_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void util_err_clear(kvlm_error *err);

#endif
