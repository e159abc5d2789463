/* cli/progress: a progress line on stderr for long work (loading a model,
 * convert, synth, perplexity): shown only when stderr is a terminal, so
 * piped or redirected output stays exactly as it was. */
#ifndef KVLM_CLI_PROGRESS_H
#define KVLM_CLI_PROGRESS_H
#include <stdbool.h>
#include "kvlm.h"

typedef struct cli_progress {
    char what[96];      /* "loading model.gguf" */
    bool on;            /* stderr is a terminal (or KVLM_PROGRESS=1); KVLM_PROGRESS=0: never */
    bool drawn;         /* a line is on the screen */
    double t0, last;    /* start, last redraw (seconds, monotonic) */
    float frac;
} cli_progress;

/* Starts one (what: printf-style). Nothing shows for work done within
 * 0.3 s, nor more often than 10 times a second. */
void cli_progress_begin(cli_progress *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* frac 0..1 done; the line says the percentage and, once it can tell, the
 * time left. */
void cli_progress_update(cli_progress *p, float frac);
/* A kvlm_progress_callback over a cli_progress (user); always true. */
bool cli_progress_callback(float frac, void *user);
/* Clears the line (the next output starts on a clean line). */
void cli_progress_end(cli_progress *p);
/* Seconds on the monotonic clock. */
double cli_now(void);
/* kvlm_model_load with a progress line "loading PATH" (mp's callback set,
 * then cleared). */
kvlm_model *cli_model_load(const char *path, kvlm_model_params *mp, kvlm_error *err);
#endif
