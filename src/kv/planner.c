/* kv/planner: KV cache memory arithmetic for `kvlm plan` and the library.
 * Contiguous caches reserve the whole context per sequence; paged caches
 * take blocks as tokens arrive, so their cost follows the tokens held. */
#include "kv/planner.h"
#include "kv/blockfmt.h"

int kv_plan_window_blocks(int window, int step, int block_size, int n_ctx) {
    int held = (window + step + 2 * block_size - 3) / block_size, all = (n_ctx + block_size - 1) / block_size;
    return held < all ? held : all;
}

int kv_plan_step(int n_batch, int n_ctx) { return n_batch > 0 ? n_batch : n_ctx < 512 ? n_ctx : 512; }

void kv_plan(const kvlm_config *c, size_t weight_bytes, const kvlm_plan_params *p, kvlm_plan *o) {
    int bs = p->block_size > 0 ? p->block_size : 16;
    int n_ctx = p->n_ctx > 0 ? p->n_ctx : c->n_ctx_train;
    int n_seq = p->n_seq > 0 ? p->n_seq : 1;
    int avg = p->avg_tokens > 0 ? p->avg_tokens : (n_ctx + 1) / 2;
    if (avg > n_ctx) avg = n_ctx;
    double elem = p->elem_bytes > 0 ? p->elem_bytes : 4.0;
    o->n_ctx = n_ctx;
    o->n_seq = n_seq;
    o->block_size = bs;
    o->avg_tokens = avg;
    o->weight_bytes = weight_bytes;
    o->bytes_per_token = (size_t)(2.0 * c->n_layers * c->n_kv_heads * c->head_dim * elem + 0.5);
    o->mha_bytes_per_token = 0;
    if (c->arch == KVLM_ARCH_DEEPSEEK2) { /* one latent row, values inside it (docs/mla.md) */
        o->bytes_per_token = (size_t)((double)c->n_layers * (c->kv_lora_rank + c->rope_dim) * elem + 0.5);
        o->mha_bytes_per_token =
            (size_t)((double)c->n_layers * c->n_heads * (c->head_dim + c->v_head_dim) * elem + 0.5);
    }
    o->bytes_per_seq = o->bytes_per_token * (size_t)n_ctx;
    o->bytes_total = o->bytes_per_seq * (size_t)n_seq;
    o->block_bytes = o->bytes_per_token * (size_t)bs;
    o->blocks_per_seq = (n_ctx + bs - 1) / bs;
    o->kv_mem = p->kv_mem > 0 ? p->kv_mem : o->bytes_total;
    o->fit_contiguous = (long)(o->kv_mem / o->bytes_per_seq);
    size_t n_blocks = o->kv_mem / o->block_bytes;
    o->fit_paged_full = (long)(n_blocks / (size_t)o->blocks_per_seq);
    /* A sequence holding avg tokens needs ceil(avg / bs) blocks. */
    o->fit_paged_avg = (long)(n_blocks / (size_t)((avg + bs - 1) / bs));
    o->fit_contiguous_avg = o->fit_contiguous;
    /* the tiers hold blocks in kv/blockfmt's form: the block plus its header,
     * token ids and checksum */
    kv_blockfmt f = {.block_size = bs, .payload_bytes = o->block_bytes};
    o->stored_block_bytes = kv_blockfmt_bytes(&f);
    o->tokens_ram = (uint64_t)n_blocks * (uint64_t)bs;
    o->tokens_host = p->host_bytes / o->stored_block_bytes * (uint64_t)bs;
    o->tokens_disk = p->disk_bytes / o->stored_block_bytes * (uint64_t)bs;
    o->tokens_redis = p->redis_bytes / o->stored_block_bytes * (uint64_t)bs;
    /* sliding window: the local layers' part stops growing at the window */
    int n_local = c->sliding_window > 0 ? c->n_local_layers : 0;
    o->window = n_local ? c->sliding_window : 0;
    o->n_local_layers = n_local;
    o->bytes_per_token_local = (size_t)(2.0 * n_local * c->n_kv_heads * c->head_dim * elem + 0.5);
    o->bytes_per_token_global = o->bytes_per_token - o->bytes_per_token_local;
    /* the engine's pool: the window and one step of n_batch tokens */
    int step = kv_plan_step(p->n_batch, n_ctx);
    o->n_batch = step;
    int cap = n_local ? kv_plan_window_blocks(c->sliding_window, step, bs, n_ctx) * bs : n_ctx;
    o->local_cap_tokens = cap < n_ctx ? cap : n_ctx;
    o->bytes_per_seq_window = o->bytes_per_token_global * (size_t)n_ctx +
                              o->bytes_per_token_local * (size_t)o->local_cap_tokens;
    o->fit_window_full = o->bytes_per_seq_window ? (long)(o->kv_mem / o->bytes_per_seq_window) : 0;
}
