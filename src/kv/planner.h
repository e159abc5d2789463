/* kv/planner: KV cache memory arithmetic: bytes per token, per sequence and
 * in total, and how many sequences fit a budget, contiguous against paged. */
#ifndef KVLM_KV_PLANNER_H
#define KVLM_KV_PLANNER_H
#include "kvlm.h"

void kv_plan(const kvlm_config *cfg, size_t weight_bytes, const kvlm_plan_params *p, kvlm_plan *out);
/* The blocks of block_size tokens one sequence holds at most in a store whose
 * layers see only the last `window` keys, when one step adds at most `step`
 * tokens (the engine's n_batch, kv_store_params.window_slack): the largest
 * kv_store_blocks_held, (window + step + 2 x block_size - 3) / block_size (a
 * step reserves its slots before the blocks before its window drop), and
 * never more than a context of n_ctx tokens takes. The engine's windowed
 * pools are sized from it (one block more: a copy-on-write of a shared last
 * block), and kvlm plan's local_cap_tokens is it in tokens. */
int kv_plan_window_blocks(int window, int step, int block_size, int n_ctx);
/* The tokens one step adds at most: n_batch, or (0) a context's default, n_ctx up to 512. */
int kv_plan_step(int n_batch, int n_ctx);
#endif
