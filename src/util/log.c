/* util/log: leveled logging, the library's one way to say something: to the
 * callback kvlm_log_set installed, else to stderr; the level comes from
 * kvlm_log_set_level, else KVLM_LOG (default warn). */
#include "util/log.h"
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kvlm.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static kvlm_log_fn g_fn;
static void *g_user;
static int g_level = -1; /* -1: not set (KVLM_LOG, then warn) */

int kvlm_log_level_from_name(const char *s) {
    static const char *const names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; s && i < 5; i++)
        if (!strcmp(s, names[i])) return i;
    if (s && !strcmp(s, "warning")) return KVLM_LOG_WARN;
    return -1;
}

const char *kvlm_log_level_name(int level) {
    static const char *const names[] = {"debug", "info", "warn", "error", "off"};
    return level >= 0 && level <= KVLM_LOG_OFF ? names[level] : NULL;
}

int kvlm_log_get_level(void) {
    int level = __atomic_load_n(&g_level, __ATOMIC_RELAXED);
    if (level < 0) {
        level = kvlm_log_level_from_name(getenv("KVLM_LOG"));
        if (level < 0) level = KVLM_LOG_WARN;
        int unset = -1; /* the first reader settles it; kvlm_log_set_level may change it */
        __atomic_compare_exchange_n(&g_level, &unset, level, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        level = __atomic_load_n(&g_level, __ATOMIC_RELAXED);
    }
    return level;
}

void kvlm_log_set_level(int level) {
    if (level < KVLM_LOG_DEBUG) level = KVLM_LOG_DEBUG;
    if (level > KVLM_LOG_OFF) level = KVLM_LOG_OFF;
    __atomic_store_n(&g_level, level, __ATOMIC_RELAXED);
}

void kvlm_log_set(kvlm_log_fn fn, void *user) {
    pthread_mutex_lock(&g_mu);
    g_fn = fn;
    g_user = user;
    pthread_mutex_unlock(&g_mu);
}

static void vlog(int level, const char *fmt, va_list ap) {
    if (level < KVLM_LOG_DEBUG || level >= KVLM_LOG_OFF || level < kvlm_log_get_level()) return;
    char buf[2048];
    vsnprintf(buf, sizeof buf, fmt, ap);
    /* the callback is called under the lock: kvlm_log_set(NULL) returning means it is no longer running */
    pthread_mutex_lock(&g_mu);
    if (g_fn) g_fn(g_user, level, buf);
    else fprintf(stderr, "kvlm %s: %s\n", kvlm_log_level_name(level), buf);
    pthread_mutex_unlock(&g_mu);
}

void kvlm_log(int level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog(level, fmt, ap);
    va_end(ap);
}

void util_log(int level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog(level, fmt, ap);
    va_end(ap);
}
