/* engine/spec_draft: a draft model's proposals for many sequences at once,
 * for the scheduler (kvlm_sched with KVLM_SPEC_DRAFT): one draft kvlm_ctx
 * whose sequence ids mirror the target's, caught up and drafting in batches. */
#ifndef KVLM_ENGINE_SPEC_DRAFT_H
#define KVLM_ENGINE_SPEC_DRAFT_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"

#define SPEC_DRAFT_MAX 16 /* most drafts per sequence and step */

typedef struct spec_drafter spec_drafter;

/* One sequence to draft for: its text is hist[0, n_hist), whose last token
 * the target has chosen and not yet fed; at most k drafts go to out. */
typedef struct spec_draft_req {
    int seq;
    const int32_t *hist;
    int n_hist;
    int k;
    int32_t *out;
    int n_out;           /* set by spec_drafter_propose: drafts written (0: none this step) */
    /* Sampling (q non-NULL): drafts are drawn from smp's distribution for
     * the draft's logits, and q receives it, k rows of vocab floats, for the
     * check (spec_check_q); NULL: the draft's argmax. */
    kvlm_sampler *smp;
    float *q;
} spec_draft_req;

/* Checks that draft can draft for target: the same vocabulary (as
 * kvlm_spec_create), no eviction and no q4_kc keys in its cache (drafts are
 * taken back across blocks), and at least the target's sequences. p_min
 * (0: none): a sequence's drafts end before a token the draft gives less
 * than this probability (spec_draft_pick). */
spec_drafter *spec_drafter_create(kvlm_ctx *target, kvlm_ctx *draft, float p_min, kvlm_error *err);
void spec_drafter_free(spec_drafter *d);
/* Proposes drafts: first one batched kvlm_decode of the draft context
 * catches every sequence up on the tokens of its text it lacks (at most
 * max_catchup tokens in all; a sequence that needs more is fed a piece and
 * drafts a later step), then rounds of one batched decode over all drafting
 * sequences, each taking every sequence's argmax. A failure of the draft
 * context (its pool full, an error) never fails: the sequences it touches
 * get fewer or no drafts this step. The drafts stay in the draft context,
 * unverified, until spec_drafter_sync. In the target's pool
 * (kvlm_ctx_create_draft), a sequence drafts only when the blocks it will
 * then hold (its text and drafts, the ones it has included) fit in `spare`,
 * the pool's free and cached blocks less what the target's next step needs;
 * else it waits, keeping what it holds. So a draft never takes the room the
 * model grows into, and a sequence given back is rebuilt only when it fits. */
void spec_drafter_propose(spec_drafter *d, spec_draft_req *reqs, int n, int max_catchup, int spare);
/* After the target's check: the sequence's text is now hist[0, n_hist); the
 * draft context keeps the tokens that agree with it and takes back the rest. */
void spec_drafter_sync(spec_drafter *d, int seq, const int32_t *hist, int n_hist);
/* The target's sequence seq was freed (finished, cancelled, preempted):
 * so is the draft's (a later owner of the id is caught up from nothing). */
void spec_drafter_drop(spec_drafter *d, int seq);
/* The draft context's cache in the target's pool (kvlm_ctx_create_draft):
 * drops draft sequences, the one holding the most tokens first, until the
 * pool has `want` more blocks to hand out (free or cached; want <= 0: every
 * one holding tokens), before the target preempts any of its own. Full
 * blocks stay cached for a later catch-up; a dropped sequence drafts again
 * once it fits (spec_drafter_propose), the others keep drafting. Returns how
 * many (0: none, or a pool of its own). */
int spec_drafter_release(spec_drafter *d, int want);
/* Steps with proposals; draft-context failures that cost drafts; draft
 * sequences dropped by spec_drafter_release; sequences started afresh on a
 * window of the text (it outgrew the draft's context); sequence-steps that
 * waited for room in the target's pool. */
void spec_drafter_counts(const spec_drafter *d, uint64_t *steps, uint64_t *failures, uint64_t *released,
                         uint64_t *windows, uint64_t *waits);
#endif
