/* ops/cuda/cuda: the CUDA backend's kernels behind a C interface: device and
 * memory, weights uploaded once in their GGUF types, and the kernels of the
 * forward pass over device buffers (embedding, rmsnorm, matmul, RoPE, the
 * paged KV cache's writes and its flash-decoding attention, SwiGLU). Built
 * only with -DKVLM_CUDA=ON (KVLM_HAVE_CUDA); engine/forward_cuda.c drives it.
 * Every kernel is enqueued on the device's one stream; errors surface at
 * cu_sync. */
#ifndef KVLM_OPS_CUDA_CUDA_H
#define KVLM_OPS_CUDA_CUDA_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cu_dev cu_dev;

/* Why the module (libkvlm-cuda.so, ops/cuda_load.c) cannot be loaded, or
 * NULL when it is: host side only. */
const char *cu_unavailable(void);
/* GPUs the driver sees (0: none, no driver, or no module). */
int cu_device_count(void);
cu_dev *cu_open(int device, kvlm_error *err);
void cu_close(cu_dev *d);
/* "NVIDIA H100 80GB HBM3, 132 SMs, 79.1 GiB" */
void cu_describe(cu_dev *d, char *buf, size_t cap);
size_t cu_mem_free(cu_dev *d);

/* Zeroed device memory, or NULL. */
void *cu_alloc(cu_dev *d, size_t bytes);
void cu_free(cu_dev *d, void *p);
/* Copies. h2d and d2h are synchronous for the host buffer; d2d is queued. */
int cu_h2d(cu_dev *d, void *dst, const void *src, size_t n);
int cu_d2h(cu_dev *d, void *dst, const void *src, size_t n);
void cu_d2d(cu_dev *d, void *dst, const void *src, size_t n);
/* Queued upload of a small host buffer (copied into pinned staging first, so
 * src may be reused at once). */
int cu_h2d_async(cu_dev *d, void *dst, const void *src, size_t n);
/* The KV cache's block copies to and from the tiers (the pool's storage),
 * on a copy stream of their own through pinned staging: a write returns once
 * its bytes are staged (the host goes on fetching the next block while the
 * copy runs), a read once its bytes are back; both come after the compute
 * stream's work queued so far. Kernels see the writes after cu_tier_join,
 * which makes the compute stream wait for them (cu_d2d joins by itself). */
int cu_tier_write(cu_dev *d, void *dst, const void *src, size_t n);
int cu_tier_read(cu_dev *d, void *dst, const void *src, size_t n);
void cu_tier_join(cu_dev *d);
/* Waits for the stream; returns KVLM_OK or the first error with err filled. */
int cu_sync(cu_dev *d, kvlm_error *err);

/* A weight matrix on the device: n_out rows of n_in. type is what the
 * kernels read: F32, F16, BF16, Q4_K, Q6_K as in the file; Q8_0 and Q4_0
 * split into quants and f16 scales (so each lane loads 16 bytes at a time);
 * any other type is converted to F16 at upload. */
typedef struct {
    int type, n_in, n_out;
    void *q;   /* elements, or quants */
    void *d;   /* Q8_0 / Q4_0: f16 scales [n_out][n_in / 32] */
    size_t bytes;
} cu_weight;
int cu_weight_upload(cu_dev *d, cu_weight *w, const void *host, int type, int64_t n_in, int64_t n_out,
                     kvlm_error *err);
void cu_weight_free(cu_dev *d, cu_weight *w);
/* Bytes a weight of this type and shape takes on the device. */
size_t cu_weight_bytes(int type, int64_t n_in, int64_t n_out);

/* ---- kernels (device pointers; queued on the stream) ---- */
/* x[t] = row tokens[t] of the embedding table (dequantized). */
void cu_embed(cu_dev *d, float *x, const cu_weight *emb, const int32_t *tokens, int T);
/* For each of n rows: if add, x[r] += add[r] (kept); out[i] = rmsnorm(x[r]) * w,
 * r = rows ? rows[i] : i. next: the weight the next cu_matmul of out
 * multiplies (or NULL); when that product takes 8-bit activations, the rows
 * are quantized here too, and the product skips its own quantizing pass. */
void cu_rmsnorm(cu_dev *d, float *out, float *x, const float *add, const float *w, const int32_t *rows, int n,
                int dim, float eps, const cu_weight *next);
/* Y[T][n_out] = X[T][n_in] W^T. Few rows: one pass over W in its own type
 * (matrix-vector kernels); many: W dequantized to f16 and cuBLAS's GEMM
 * (F32 weights: SGEMM on the f32 activations). */
void cu_matmul(cu_dev *d, float *y, const float *x, const cu_weight *w, int T);
/* Several matrices of one input (Q, K, V; gate, up: n <= 3, same type and
 * n_in) in one launch of the matrix-vector kernels: Y_i = X W_i^T. */
void cu_matmul_n(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T);
/* The row count from which cu_matmul takes the GEMM path (1..9; default 9:
 * the matrix-vector kernels take up to 8 rows). Tests lower it to check the
 * GEMM path at small sizes. */
int cu_matmul_gemm_min_rows(cu_dev *d);
void cu_set_matmul_gemm_min_rows(cu_dev *d, int t);
/* gate[i] = silu(gate[i]) * up[i] over T rows of n; next as for cu_rmsnorm. */
void cu_swiglu(cu_dev *d, float *gate, const float *up, int T, int n, const cu_weight *next);

/* The paged KV cache in device memory, laid out as kv/paged lays it out on
 * the host: block b's (layer, KV head) K region at
 *   base + b * block_bytes + (layer * n_kv_heads + h) * head_bytes,
 * its V region v_offset after it; slot i's row i * row bytes into a region.
 * Element types: f32, f16, bf16, q8_0, q4_0 (KVLM_CACHE_*). */
typedef struct {
    uint8_t *base;
    size_t block_bytes, head_bytes, v_offset;
    int k_type, v_type, block_size, head_dim, n_kv_heads;
} cu_kv;
/* Where the tokens of a batch sit: token t of the chunk is at position
 * pos[t] of the sequence whose block table starts at tables[table_at[t]]. */
typedef struct {
    const int32_t *pos, *table_at, *tables;
    int T;
    int max_pos; /* the largest pos[t] */
    int run;     /* every aligned group of this many tokens (a power of two; 0: 1) is of one sequence */
} cu_kv_batch;
/* Per token of the batch: the biases of q, k, v (each may be NULL), RoPE of
 * q and k at its position (angles in double, as ops/rope.c), then its key and
 * value rows into its slot of the layer, converted to the cache's types. */
void cu_qkv_rope_store(cu_dev *d, float *q, float *k, float *v, const float *bq, const float *bk, const float *bv,
                       int n_heads, int rope_dim, float rope_base, bool neox, const cu_kv *kv, int layer,
                       const cu_kv_batch *b);
/* Causal attention of every token of the batch over its sequence's cached
 * keys and values up to its position (flash-decoding: each token's keys
 * split across thread blocks, partial softmaxes merged by their
 * log-sum-exp). q, out: [T][n_heads][head_dim]. work: cu_attention_work_bytes. */
size_t cu_attention_work_bytes(int max_T, int n_heads, int n_kv_heads, int head_dim);
void cu_attention(cu_dev *d, float *out, const float *q, const cu_kv *kv, int layer, const cu_kv_batch *b,
                  int n_heads, float scale, void *work);
/* f16 caches of head_dim 64 or 128 take a tensor-core kernel (a warp: 16
 * keys by the G query heads of up to 16 / G tokens of a run); off, the
 * vector kernel (for comparison; KVLM_CUDA_MMA_ATTN=0 sets it off at open). */
void cu_set_attention_mma(cu_dev *d, bool on);

/* ---- CUDA graphs: a recorded sequence of kernels replayed in one launch ---- */
typedef struct cu_graph cu_graph;
/* Starts recording the stream's work instead of running it. */
int cu_graph_begin(cu_dev *d);
/* Ends the recording; NULL if it failed (the work then never ran). */
cu_graph *cu_graph_end(cu_dev *d);
void cu_graph_launch(cu_dev *d, cu_graph *g);
void cu_graph_free(cu_graph *g);

/* ---- measurement ---- */
/* Device-to-device copy rate (bytes read + written per second) over a
 * buffer of `bytes`, median of several; 0 on failure. */
double cu_measure_copy_bandwidth(cu_dev *d, size_t bytes);
/* cuBLAS f16 GEMM rate (FLOP/s) for an m x n x k product, median of several. */
double cu_measure_gemm_flops(cu_dev *d, int m, int n, int k);
/* Seconds between two points on the stream (events). */
typedef struct cu_timer cu_timer;
cu_timer *cu_timer_start(cu_dev *d);
double cu_timer_stop(cu_dev *d, cu_timer *t); /* waits; frees t */

#ifdef __cplusplus
}
#endif
#endif
