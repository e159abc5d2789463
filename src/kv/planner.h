/* kv/planner: KV cache memory arithmetic: bytes per token, per sequence and
 * in total, and how many sequences fit a budget, contiguous against paged. */
#ifndef KVLM_KV_PLANNER_H
#define KVLM_KV_PLANNER_H
#include "kvlm.h"

void kv_plan(const kvlm_config *cfg, size_t weight_bytes, const kvlm_plan_params *p, kvlm_plan *out);
#endif
