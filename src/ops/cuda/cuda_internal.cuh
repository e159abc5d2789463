/* ops/cuda/cuda_internal: what the backend's .cu files share: the device
 * struct, error recording, the GGUF type ids the kernels know, and the
 * dequantizers of one 32-element group of a weight row. */
#ifndef KVLM_OPS_CUDA_INTERNAL_CUH
#define KVLM_OPS_CUDA_INTERNAL_CUH
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <utility>
#include "ops/cuda/cuda.h"

/* GGUF type ids (dtype/dtype.h, whose C11 header C++ cannot include) */
enum { CT_F32 = 0, CT_F16 = 1, CT_Q4_0 = 2, CT_Q8_0 = 8, CT_Q4_K = 12, CT_Q6_K = 14, CT_BF16 = 30 };

#define TC_SLOTS 16
struct cu_dev {
    int id;
    cudaStream_t stream;
    cublasHandle_t blas;
    cudaDeviceProp prop;
    cudaError_t first_err;        /* first launch or copy error, reported by cu_sync */
    char err_where[96];
    uint8_t *pinned;              /* staging of cu_h2d_async */
    size_t pinned_cap, pinned_off;
    __half *wscratch, *xscratch;  /* the GEMM path's f16 weights and activations */
    size_t wscratch_cap, xscratch_cap;
    int gemm_min;
    int8_t *xq;                   /* matvec of Q8_0/Q4_0 weights: activations quantized to 8 bits */
    float *xqd;                   /* ... one scale per 32 (allocated at open: graph capture cannot) */
    float *xqs;                   /* ... and each group's sum of its dequantized elements (K-quants' mins) */
    const float *xq_of;           /* the float rows whose 8-bit version xq holds now (fused into a norm or SwiGLU), */
    int xq_rows;                  /* ... and how many, until a product uses them */
    int xq_disabled;              /* KVLM_CUDA_DP4A=0: the float kernels instead (for comparison) */
    bool att_mma;                 /* attention on tensor cores where it fits (KVLM_CUDA_MMA_ATTN=0: off) */
    /* the KV cache's tier copies (cu_tier_read / cu_tier_write): a stream of
     * their own, pinned staging slots each with its copy's event, and the
     * events that order the two streams; copy == NULL (KVLM_CUDA_TIER_ASYNC=0):
     * synchronous copies on the compute stream */
    cudaStream_t copy;
    cudaEvent_t copy_done, compute_done;
    uint8_t *tc_pin[TC_SLOTS];
    cudaEvent_t tc_ev[TC_SLOTS];
    size_t tc_cap;
    int tc_n, tc_next;
    bool copies_pending;          /* tier writes compute has not waited for yet */
    int *att_count;               /* attention: per (token, KV head), the splits done (zero between launches) */
    /* programmatic dependent launch (cu_launch): pdl, whether the forward
     * pass's kernels may start while the kernel before them finishes
     * (KVLM_CUDA_PDL=0: never); pdl_prev, whether the stream's last work is
     * such a kernel (anything else that goes through cu_note clears it) */
    bool pdl, pdl_prev;
};
/* The attention counters' room: tokens x KV heads of one launch. */
#define ATT_COUNT_MAX (1 << 16)
/* The 8-bit activations' room: up to 8 rows of up to XQ_MAX_IN elements. */
#define XQ_MAX_IN 65536

/* Records the first error (a launch's, a copy's); cu_sync reports it. */
void cu_note(cu_dev *d, cudaError_t e, const char *where);
#define CU_LAUNCHED(d, what) cu_note((d), cudaGetLastError(), (what))

/* Programmatic dependent launch (sm_90). A kernel launched by cu_launch may
 * start while the kernel before it on the stream still runs; pdl_wait, the
 * first thing it does with memory another kernel touches, waits until that
 * kernel is complete and its writes are visible (a no-op when not so
 * launched). Every such kernel calls pdl_wait in every block, so the waits
 * chain: a kernel's wait also covers the kernels before the one it follows.
 * pdl_launch then lets the next kernel's blocks be placed while this one
 * runs, so its launch and its blocks' start overlap this kernel's work and
 * tail instead of following them. */
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/* Launches kernel k on the compute stream, as a programmatic dependent
 * launch when d->pdl and the stream's last work is a kernel launched here
 * (never after a copy, an event wait or cuBLAS: those keep full order).
 * Every kernel launched here calls pdl_wait before it touches memory that
 * another kernel reads or writes. */
template <typename... P, typename... A>
void cu_launch(cu_dev *d, const char *what, void (*k)(P...), dim3 grid, dim3 block, size_t smem, A &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = d->stream;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    if (d->pdl && d->pdl_prev) cfg.attrs = at, cfg.numAttrs = 1;
    cu_note(d, cudaLaunchKernelEx(&cfg, k, std::forward<A>(args)...), what);
    d->pdl_prev = true;
}

/* Device-side view of a weight. */
struct cu_wview {
    const uint8_t *q;
    const __half *d;
    int n_in;
    size_t row_bytes; /* Q4_K: bytes per row */
    /* Q6_K, split at upload into planes so every part loads 16 bytes at a
     * time (its 210-byte super-blocks are only 2-byte aligned): q holds the
     * low 4 bits (128 bytes a super-block), qh the high 2 bits (64), sc the
     * 16 scales, d the super-block scales; super-block i = row * (n_in / 256)
     * + s of each at i times its size. */
    const uint8_t *qh;
    const int8_t *sc;
};

__device__ __forceinline__ void q4k_scale_min(const uint8_t *s, int j, int &sc, int &m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The 32 elements [32 g, 32 g + 32) of row r, dequantized. */
template <int TYPE>
__device__ __forceinline__ void load_group(const cu_wview &w, int r, int g, float *v) {
    if (TYPE == CT_Q8_0) {
        const int4 *p = (const int4 *)(w.q + (size_t)r * w.n_in + (size_t)g * 32);
        float s = __half2float(w.d[(size_t)r * (w.n_in / 32) + g]);
        int4 a = __ldg(p), b = __ldg(p + 1);
        int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int k = 0; k < 4; k++) v[4 * i + k] = s * (float)(int8_t)(words[i] >> (8 * k));
    } else if (TYPE == CT_Q4_0) {
        const int4 *p = (const int4 *)(w.q + (size_t)r * (w.n_in / 2) + (size_t)g * 16);
        float s = __half2float(w.d[(size_t)r * (w.n_in / 32) + g]);
        int4 a = __ldg(p);
        int words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int byte = (words[i] >> (8 * k)) & 0xff;
                v[4 * i + k] = s * (float)((byte & 15) - 8);
                v[16 + 4 * i + k] = s * (float)((byte >> 4) - 8);
            }
    } else if (TYPE == CT_Q4_K) {
        const uint8_t *sb = w.q + (size_t)r * w.row_bytes + (size_t)(g >> 3) * 144;
        int j = g & 7, sc, m;
        float dd = __half2float(*(const __half *)sb), dmin = __half2float(*(const __half *)(sb + 2));
        q4k_scale_min(sb + 4, j, sc, m);
        float d1 = dd * sc, m1 = dmin * m;
        const int4 *p = (const int4 *)(sb + 16 + (j >> 1) * 32);
        int4 a = __ldg(p), b = __ldg(p + 1);
        int words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        int shift = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int k = 0; k < 4; k++) v[4 * i + k] = d1 * (float)((words[i] >> (8 * k + shift)) & 15) - m1;
    } else if (TYPE == CT_Q6_K) {
        size_t i = (size_t)r * (w.n_in / 256) + (g >> 3);
        int j = g & 7, n = j >> 2, sub = j & 3;
        const int4 *lp = (const int4 *)(w.q + i * 128 + n * 64 + (sub & 1) * 32);
        const int4 *hp = (const int4 *)(w.qh + i * 64 + n * 32);
        int4 l0 = __ldg(lp), l1 = __ldg(lp + 1), h0 = __ldg(hp), h1 = __ldg(hp + 1);
        int lw[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w}, hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        const int8_t *sc = w.sc + i * 16 + n * 8 + sub * 2;
        float dd = __half2float(w.d[i]);
        float s0 = dd * sc[0], s1 = dd * sc[1];
        int lshift = (sub >> 1) * 4, hshift = 2 * sub;
#pragma unroll
        for (int k = 0; k < 8; k++)
#pragma unroll
            for (int b = 0; b < 4; b++) {
                int l = 4 * k + b;
                int q = ((lw[k] >> (8 * b + lshift)) & 15) | (((hw[k] >> (8 * b + hshift)) & 3) << 4);
                v[l] = (l < 16 ? s0 : s1) * (float)(q - 32);
            }
    }
}
#endif
