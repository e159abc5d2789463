/* ops/backend: the table of entry points the CPU forward passes call their
 * kernels through, one instance per SIMD level (scalar, AVX2, AVX-512). The
 * GPU does not go through it: engine/forward_cuda runs the whole pass on the
 * device through ops/cuda. Every entry means what its op_ function in ops.h /
 * kvtype.h means. */
#ifndef KVLM_OPS_BACKEND_H
#define KVLM_OPS_BACKEND_H
#include <stddef.h>
#include <stdint.h>
#include "ops/ops.h"

typedef struct op_backend {
    const char *name; /* "cpu-scalar", "cpu-avx2", "cpu-avx512" */
    /* ---- matmul (op_matmul_work_size, op_matmul_n, op_matmul_prep) */
    size_t (*matmul_work_size)(int wtype, int T, int n_in);
    void (*matmul_n)(util_pool *pool, const float *X, int T, int n_in, const op_mm_out *outs, int n, void *work);
    void (*matmul_prep)(util_pool *pool, const float *X, int T, int n_in, const op_mm_out *outs, int n, void *work,
                        op_mm_prep_fn prep, void *user);
    /* ---- per token */
    void (*rmsnorm)(float *out, const float *x, const float *w, int n, float eps);
    void (*rope)(float *x, int n_heads, int head_dim, int rope_dim, int pos, float base, const float *ff, bool neox);
    void (*rope_cossin)(float *cs, float *sn, int rope_dim, int pos, float base, const float *ff);
    void (*rope_apply)(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, const float *sn,
                       bool neox);
    void (*swiglu)(float *gate, const float *up, int n);
    void (*add)(float *y, const float *x, int n);
    /* ---- attention */
    size_t (*attention_work_size)(int n_threads, int head_dim);
    void (*attention)(util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work);
    void (*attention_n)(util_pool *pool, int n, float *const *out, const float *const *q, const op_attn_args *a,
                        void *work);
    /* ---- KV rows into the cache's element type (ops/kvtype.h) */
    void (*kv_quantize_row)(int type, const float *x, void *dst, int hd);
    void (*kv_quantize_kc)(const uint16_t *rows, void *region, int hd, int bs, int n_tok);
} op_backend;

/* The CPU backend at the SIMD level the kernels use now (op_simd_level: the
 * CPU's best, capped by op_set_simd / op_set_simd_level). Cheap: a caller may
 * ask per call. */
const op_backend *op_backend_cpu(void);
#endif
