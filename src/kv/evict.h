/* kv/evict: eviction policies for bounded caches: which of a sequence's
 * cached tokens to keep (sliding window, attention sinks, heavy hitters).
 * Pure logic over token indices; kv/paged's kv_seq_compact applies it. */
#ifndef KVLM_KV_EVICT_H
#define KVLM_KV_EVICT_H
#include <stdint.h>
#include "kvlm.h"

typedef struct {
    int policy;        /* KVLM_EVICT_* */
    int sinks;         /* sinks: the first tokens always kept */
    int h2o_recent;    /* h2o: most recent tokens kept; 0: n_keep minus the heavy hitters */
    float h2o_heavy;   /* h2o: share of n_keep for heavy hitters when h2o_recent is 0 */
} kv_evict_params;

/* Chooses n_keep (0 <= n_keep <= n) of the n cached tokens 0..n-1, written to
 * keep in increasing order:
 *   window: the last n_keep;
 *   sinks:  the first min(sinks, n_keep) and the last n_keep - that (StreamingLLM);
 *   h2o:    the most recent r and, of the others, the n_keep - r with the
 *           largest scores[i] (accumulated attention; ties go to the earlier token).
 * Returns n_keep, or -1 for a bad policy / n_keep or out of memory. */
int kv_evict_select(const kv_evict_params *p, int n, int n_keep, const float *scores, int32_t *keep);
#endif
