/* engine/sched: the scheduler (continuous batching, chunked prefill,
 * admission by free blocks, preemption by recompute). Its API is public:
 * kvlm_sched_* in kvlm.h; nothing internal is shared. */
#ifndef KVLM_ENGINE_SCHED_H
#define KVLM_ENGINE_SCHED_H
#include "kvlm.h"
#endif
