/* engine/forward_cuda: the forward pass on a CUDA GPU: the model's weights
 * uploaded once, the paged KV cache's blocks in GPU memory (kv/paged's
 * storage table), and a chunk of a mixed batch run layer by layer through
 * ops/cuda's kernels; the same block tables, prefix index and copy-on-write
 * as on the CPU. Without -DKVLM_CUDA=ON, creating one fails with a clear
 * message. */
#ifndef KVLM_ENGINE_FORWARD_CUDA_H
#define KVLM_ENGINE_FORWARD_CUDA_H
#include <stdint.h>
#include "kv/store.h"
#include "kvlm.h"

typedef struct engine_cuda engine_cuda;
struct kvlm_model;

/* n_batch: most tokens per chunk; max_blocks: most blocks a sequence holds. */
engine_cuda *engine_cuda_create(const struct kvlm_model *m, int n_batch, int max_blocks, int n_seq_max,
                                kvlm_error *err);
void engine_cuda_free(engine_cuda *e);
/* The storage for kv_params.storage: the pool's blocks in GPU memory. */
const kv_storage *engine_cuda_storage(engine_cuda *e);
/* Runs T tokens (reserved in kv; token t of sequence seq[t] at pos[t])
 * through the model, writing their keys and values into their blocks; the
 * logits of the tokens with want[t] go, in order, to logits (host). */
int engine_cuda_forward(engine_cuda *e, kv_store *kv, const int32_t *tokens, const int32_t *seq, const int32_t *pos,
                        int T, const int8_t *want, float *logits, kvlm_error *err);
/* "cuda: NVIDIA H100 80GB HBM3, 132 SMs, 79.1 GiB; weights 2.1 GiB" */
void engine_cuda_describe(engine_cuda *e, char *buf, size_t cap);
#endif
