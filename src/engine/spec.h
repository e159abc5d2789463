/* engine/spec: the parts of speculative decoding the scheduler shares with
 * kvlm_spec (engine/spec.c): prompt lookup, the acceptance rule, the
 * vocabulary check. */
#ifndef KVLM_ENGINE_SPEC_H
#define KVLM_ENGINE_SPEC_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"

/* Prompt lookup over the text h[0, m): continues the latest earlier
 * occurrence of its last n tokens, n from ng_max down to ng_min; writes at
 * most K drafts to out and returns how many. */
int spec_lookup(const int32_t *h, int m, int ng_max, int ng_min, int K, int32_t *out);
/* The rule that keeps the target's distribution for a draft d proposed with
 * certainty: true, d is kept (with probability p(d) under smp's
 * distribution for row; greedy: iff it is the pick); false, *next is drawn
 * from p without d, renormalised. Either way smp records the token. ids and
 * probs: vocabulary-sized scratch. */
bool spec_check(kvlm_sampler *smp, const float *row, int32_t d, int32_t *ids, float *probs, int32_t *next);
/* The standard rule for a draft d drawn from a distribution q (vocab floats,
 * q[d] > 0): d is kept with probability min(1, p(d) / q(d)), else *next is
 * drawn from norm(max(0, p - q)). The token given out has distribution p
 * whatever q is; acceptance is sum_t min(p(t), q(t)). */
bool spec_check_q(kvlm_sampler *smp, const float *row, int32_t d, const float *q, int32_t *ids, float *probs,
                  int32_t *next);
/* A draft model's next draft after its logits l: the argmax when q is NULL
 * (greedy), else a draw from smp's distribution for l (penalties and
 * truncation as of smp's history), which q (vocab floats) receives for
 * spec_check_q. ids, probs: vocabulary-sized scratch. p_min > 0: -1, with
 * nothing drawn, when the draft gives its likeliest token less than p_min
 * (greedy: under the softmax of l; sampling: under that distribution); the
 * draft then ends there (llama.cpp's --draft-p-min). The rule looks at the
 * draft alone, so the target's distribution is kept. */
int32_t spec_draft_pick(kvlm_sampler *smp, const float *l, int vocab, float *q, int32_t *ids, float *probs,
                        float p_min);
/* KVLM_EINVAL unless 0 <= p_min < 1 (kvlm_spec_params.p_min,
 * kvlm_sched_params.spec_p_min). */
int spec_check_p_min(float p_min, kvlm_error *err);
/* A draft context that does not evict holds at most limit tokens. Its
 * sequence holds the text from token off on; it is about to hold the n_hist
 * tokens of the text and extra more. The first token it should hold: off
 * while they fit, else the start of the text's last half context (its
 * sequence then starts afresh there, positions from 0: a window that moves
 * on each time it fills). */
int spec_window(int n_hist, int off, int extra, int limit);
/* KVLM_OK when the draft model b has model a's vocabulary (size, every
 * token's text, BOS/EOS), else KVLM_EINVAL naming the first difference. */
int spec_same_vocab(const kvlm_model *a, const kvlm_model *b, kvlm_error *err);
#endif
