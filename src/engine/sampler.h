/* engine/sampler: the sampler's internals that speculative decoding
 * (engine/spec) needs: its distribution, its random numbers, its record of picks. */
#ifndef KVLM_ENGINE_SAMPLER_H
#define KVLM_ENGINE_SAMPLER_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"

/* The distribution kvlm_sampler_sample would draw from for these logits
 * (penalties, top-k, temperature, top-p, min-p; greedy: one token, 1):
 * candidates in ids[0, n), their probabilities summing to 1 in probs (both
 * vocab-sized); returns n. Records nothing. */
int sampler_dist(kvlm_sampler *s, const float *logits, int32_t *ids, float *probs);
/* The next number of the sampler's stream, uniform in [0, 1). */
double sampler_uniform(kvlm_sampler *s);
/* Records a token as picked (repetition, frequency and presence penalties). */
void sampler_picked(kvlm_sampler *s, int32_t token);
bool sampler_greedy(const kvlm_sampler *s);
#endif
