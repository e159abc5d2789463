/* tests/helpers/testutil: finding shared models and corpora, temp files, and
 * loud skips, for every test binary (cmocka). */
#ifndef KVLM_TESTUTIL_H
#define KVLM_TESTUTIL_H
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdbool.h>
#include "kvlm.h"

/* Path of a file in the models folder ($KVLM_MODELS, else the build's
 * default ../shared/models). Returns NULL (and prints a loud SKIP line) if the
 * file is absent. The string is static: copy it if you need two. */
const char *tu_model_path(const char *name);
const char *tu_corpus_path(const char *name);
/* Skips the current cmocka test with a message naming what is missing. */
#define TU_REQUIRE(path) do { if (!(path)) { skip(); } } while (0)
/* A fresh temporary file path (unique per call, removed at exit). */
const char *tu_tmp_path(const char *suffix);
/* Reads a whole file; NULL if unreadable. *len gets the size. Caller frees. */
char *tu_read_file(const char *path, size_t *len);
/* Writes bytes to path; returns 0 on success. */
int tu_write_file(const char *path, const void *data, size_t len);
/* True when KVLM_TEST_QUICK is set (sanitizer builds): tests shrink loops. */
bool tu_quick(void);
/* max(worst, e) where a NaN e is the worst error, not none (fmax drops NaNs). */
static inline double tu_worse(double worst, double e) { return e <= worst ? worst : e != e ? 1.0 / 0.0 : e; }
/* Max relative difference |a-b| / max(|b|, floor) over n floats (NaN: infinite). */
double tu_max_rel_diff(const float *a, const float *b, int n, double floor);
/* Deterministic random floats in [-scale, scale]. */
void tu_fill_random(float *x, size_t n, uint64_t *state, float scale);
/* Greedy decoding of the prompt alone in ctx (sequence 0, which must be
 * empty; the prompt fed in pieces of at most kvlm_ctx_kv_max_feed tokens):
 * the tokens before an end token, at most max_tokens, into out;
 * returns their count. The reference scheduler outputs are checked
 * against. */
int tu_greedy_alone(kvlm_ctx *ctx, const int32_t *prompt, int n, int max_tokens, int32_t *out);
/* What a scheduler request gave, collected by tu_sched_collect (the
 * callback of kvlm_sched_submit): each choice's tokens and finish reason,
 * how many choices finished. stop_after > 0 ends a choice after that many
 * tokens; logprobs_ok (set it true first) stays true while every event with
 * top logprobs has the chosen token first and the list in order. */
enum { TU_SCHED_MAXN = 4, TU_SCHED_MAXGEN = 64 };
typedef struct {
    int32_t out[TU_SCHED_MAXN][TU_SCHED_MAXGEN];
    int n_out[TU_SCHED_MAXN], finish[TU_SCHED_MAXN], n_final, stop_after;
    bool logprobs_ok;
} tu_sched_result;
bool tu_sched_collect(void *user, const kvlm_sched_event *ev);
/* Each of r's n choices is what greedy decoding alone gave (want, n_want
 * tokens): the same tokens, ended by an end token if there were fewer than
 * max_tokens, else by the length; and n choices finished. */
void tu_sched_expect_alone(const tu_sched_result *r, int n, const int32_t *want, int n_want, int max_tokens);
/* Request parameters: greedy, max_tokens, n = 1, no logprobs. */
kvlm_request_params tu_greedy_params(int max_tokens);
/* Runs fn(arg) on a thread of its own whose stack is size bytes (a guard page
 * below it: an overflow is a SIGSEGV, not a silent overwrite), painted
 * first; returns the most of it the thread used (its thread block and TLS,
 * which glibc puts at the top, included). */
size_t tu_stack_peak(void (*fn)(void *), void *arg, size_t size);
#endif
