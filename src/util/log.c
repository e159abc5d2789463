/* util/log: leveled logging to stderr; the level comes from KVLM_LOG (default warn). */
#include "util/log.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int log_level(void) {
    static int level = -1;
    if (level < 0) {
        const char *s = getenv("KVLM_LOG");
        level = UTIL_LOG_WARN;
        if (s) {
            if (!strcmp(s, "debug")) level = UTIL_LOG_DEBUG;
            else if (!strcmp(s, "info")) level = UTIL_LOG_INFO;
            else if (!strcmp(s, "error")) level = UTIL_LOG_ERROR;
            else if (!strcmp(s, "off")) level = UTIL_LOG_OFF;
        }
    }
    return level;
}

void util_log(int level, const char *fmt, ...) {
    if (level < log_level()) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    fprintf(stderr, "kvlm %s: ", names[level]);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}
