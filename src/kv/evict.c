/* kv/evict: which tokens each eviction policy keeps (see evict.h). */
#include "kv/evict.h"
#include <math.h>
#include <stdlib.h>

typedef struct { float score; int32_t idx; } scored;

static int by_score_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

static int by_index(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int kv_evict_select(const kv_evict_params *p, int n, int n_keep, const float *scores, int32_t *keep) {
    if (n < 0 || n_keep < 0 || n_keep > n) return -1;
    int head = 0; /* tokens kept from the start (sinks) or by score (h2o) */
    switch (p->policy) {
    case KVLM_EVICT_WINDOW: break;
    case KVLM_EVICT_SINKS: head = p->sinks < n_keep ? p->sinks : n_keep; break;
    case KVLM_EVICT_H2O: {
        int recent = p->h2o_recent > 0 ? p->h2o_recent : n_keep - (int)lroundf(p->h2o_heavy * (float)n_keep);
        if (recent > n_keep) recent = n_keep;
        if (recent < 0) recent = 0;
        int heavy = n_keep - recent, n_old = n - recent;
        if (heavy > 0) {
            if (!scores) return -1;
            scored *s = malloc((size_t)n_old * sizeof *s);
            if (!s) return -1;
            for (int i = 0; i < n_old; i++) s[i] = (scored){scores[i], i};
            qsort(s, (size_t)n_old, sizeof *s, by_score_desc);
            for (int i = 0; i < heavy; i++) keep[i] = s[i].idx;
            free(s);
            qsort(keep, (size_t)heavy, sizeof *keep, by_index);
        }
        for (int i = 0; i < recent; i++) keep[heavy + i] = n - recent + i;
        return n_keep;
    }
    default: return -1;
    }
    if (head < 0) head = 0;
    for (int i = 0; i < head; i++) keep[i] = i;
    for (int i = head; i < n_keep; i++) keep[i] = n - n_keep + i;
    return n_keep;
}
