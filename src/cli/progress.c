/* cli/progress: the progress line on stderr (see progress.h). */
#include "cli/progress.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double cli_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void cli_progress_begin(cli_progress *p, const char *fmt, ...) {
    memset(p, 0, sizeof *p);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->what, sizeof p->what, fmt, ap);
    va_end(ap);
    const char *env = getenv("KVLM_PROGRESS");
    p->on = env && *env ? strcmp(env, "0") != 0 : isatty(STDERR_FILENO);
    p->t0 = p->last = cli_now();
}

void cli_progress_update(cli_progress *p, float frac) {
    if (!p->on) return;
    if (frac < 0) frac = 0;
    if (frac > 1) frac = 1;
    p->frac = frac;
    double now = cli_now(), el = now - p->t0;
    const char *env = getenv("KVLM_PROGRESS");
    bool forced = env && !strcmp(env, "1");
    if ((!forced && el < 0.3) || (p->drawn && now - p->last < 0.1 && frac < 1)) return;
    p->last = now;
    char eta[48] = "";
    if (frac >= 0.02f && frac < 1 && el >= 1) {
        long left = (long)(el * (1 - frac) / frac + 0.5);
        if (left >= 3600) snprintf(eta, sizeof eta, ", %ld h %02ld min left", left / 3600, left % 3600 / 60);
        else if (left >= 60) snprintf(eta, sizeof eta, ", %ld min %02ld s left", left / 60, left % 60);
        else snprintf(eta, sizeof eta, ", %ld s left", left);
    }
    /* \r and a clear to the end of the line: the line is redrawn in place */
    fprintf(stderr, "\r\033[K%s: %3.0f%%%s", p->what, 100.0 * frac, eta);
    fflush(stderr);
    p->drawn = true;
}

bool cli_progress_callback(float frac, void *user) {
    cli_progress_update(user, frac);
    return true;
}

void cli_progress_end(cli_progress *p) {
    if (p->drawn) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
    }
    p->drawn = false;
}

kvlm_model *cli_model_load(const char *path, kvlm_model_params *mp, kvlm_error *err) {
    cli_progress pr;
    const char *base = path ? strrchr(path, '/') : NULL;
    cli_progress_begin(&pr, "loading %s", base && base[1] ? base + 1 : path ? path : "");
    kvlm_progress_callback cb = mp->progress_callback;
    void *user = mp->progress_callback_user_data;
    if (pr.on && !cb) {
        mp->progress_callback = cli_progress_callback;
        mp->progress_callback_user_data = &pr;
    }
    kvlm_model *m = kvlm_model_load(path, mp, err);
    cli_progress_end(&pr);
    mp->progress_callback = cb;
    mp->progress_callback_user_data = user;
    return m;
}
