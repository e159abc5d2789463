/* ops/cuda/kernels: the forward pass's kernels other than attention:
 * embedding, rmsnorm (with the residual add), matmul (matrix-vector kernels
 * that read each weight once for up to 8 rows; above that the weight
 * dequantized to f16 and cuBLAS's GEMM), SwiGLU. (Bias + RoPE go with the
 * cache writes, in attention.cu.) */
#include <math.h>
#include <string.h>
#include "ops/cuda/cuda_internal.cuh"

static cu_wview view_of(const cu_weight *w) {
    cu_wview v;
    v.q = (const uint8_t *)w->q;
    v.d = (const __half *)w->d;
    v.n_in = w->n_in;
    v.row_bytes = w->type == CT_Q4_K ? (size_t)w->n_in / 256 * 144 : 0;
    v.qh = NULL;
    v.sc = NULL;
    if (w->type == CT_Q6_K) {
        v.qh = v.q + (size_t)w->n_out * w->n_in / 2;
        v.sc = (const int8_t *)(v.qh + (size_t)w->n_out * w->n_in / 4);
    }
    return v;
}

__device__ __forceinline__ float elem_float(int type, const void *p, size_t i) {
    if (type == CT_F32) return ((const float *)p)[i];
    if (type == CT_F16) return __half2float(((const __half *)p)[i]);
    return __uint_as_float((uint32_t)((const uint16_t *)p)[i] << 16); /* bf16 */
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ---- embedding ---- */

template <int TYPE>
__global__ void k_embed_grouped(float *x, cu_wview w, const int32_t *tokens) {
    pdl_wait();
    pdl_launch();
    int t = blockIdx.x, ng = w.n_in / 32;
    int32_t tok = tokens[t];
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        float v[32];
        load_group<TYPE>(w, tok, g, v);
        for (int i = 0; i < 32; i++) x[(size_t)t * w.n_in + g * 32 + i] = v[i];
    }
}

__global__ void k_embed_float(float *x, const void *W, int type, int n_in, const int32_t *tokens) {
    pdl_wait();
    pdl_launch();
    int t = blockIdx.x;
    size_t r = (size_t)tokens[t] * n_in;
    for (int i = threadIdx.x; i < n_in; i += blockDim.x) x[(size_t)t * n_in + i] = elem_float(type, W, r + i);
}

void cu_embed(cu_dev *d, float *x, const cu_weight *emb, const int32_t *tokens, int T) {
    cu_wview v = view_of(emb);
    const char *what = "embedding";
    switch (emb->type) {
    case CT_Q8_0: cu_launch(d, what, k_embed_grouped<CT_Q8_0>, T, 64, 0, x, v, tokens); break;
    case CT_Q4_0: cu_launch(d, what, k_embed_grouped<CT_Q4_0>, T, 64, 0, x, v, tokens); break;
    case CT_Q4_K: cu_launch(d, what, k_embed_grouped<CT_Q4_K>, T, 64, 0, x, v, tokens); break;
    case CT_Q6_K: cu_launch(d, what, k_embed_grouped<CT_Q6_K>, T, 64, 0, x, v, tokens); break;
    default: cu_launch(d, what, k_embed_float, T, 256, 0, x, (const void *)emb->q, emb->type, emb->n_in, tokens);
    }
}

/* ---- 8-bit activations (Q8_0, Q4_0 and Q4_K products with dp4a) ---- */

/* Whether cu_matmul of w over T rows takes a dp4a kernel, whose input is x
 * quantized in groups of 32 (one scale each, and each group's sum). */
static bool dp4a_for(const cu_dev *d, const cu_weight *w, int T) {
    bool k = w->type == CT_Q4_K || w->type == CT_Q6_K;
    return T < d->gemm_min && T <= 8 && (w->type == CT_Q8_0 || w->type == CT_Q4_0 || k) && d->xq && !d->xq_disabled &&
           w->n_in <= XQ_MAX_IN && w->n_in % (k ? 256 : 32) == 0;
}

/* Group of 32 quantized as k_quant_x does, from the 4 values each of 8
 * consecutive lanes hold (lane & 7 == 0 the first): the packed bytes, and
 * the group's scale and sum of its dequantized elements. */
__device__ __forceinline__ int quant4_of8(float4 o, float &d, float &sum) {
    float a = fmaxf(fmaxf(fabsf(o.x), fabsf(o.y)), fmaxf(fabsf(o.z), fabsf(o.w)));
#pragma unroll
    for (int k = 1; k < 8; k <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, k));
    d = a / 127.0f;
    float id = a > 0 ? 127.0f / a : 0.0f;
    int q0 = __float2int_rn(o.x * id), q1 = __float2int_rn(o.y * id), q2 = __float2int_rn(o.z * id),
        q3 = __float2int_rn(o.w * id), s = q0 + q1 + q2 + q3;
#pragma unroll
    for (int k = 1; k < 8; k <<= 1) s += __shfl_xor_sync(0xffffffffu, s, k);
    sum = d * (float)s;
    return (q0 & 0xff) | ((q1 & 0xff) << 8) | ((q2 & 0xff) << 16) | ((int)(unsigned)q3 << 24);
}

/* ---- rmsnorm ---- */

/* One block per row. Every load is issued before the first store (the
 * residual's add writes x back), four floats at a time: a row's loads in
 * flight together instead of one round trip per pass of the loop. V: the
 * float4s each thread holds (dim <= 4 * V * RN_THREADS); V = 0 for rows
 * that are not whole float4s or longer, element by element. */
#define RN_THREADS 256

__device__ __forceinline__ float block_sum(float v, float *part) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float u = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0;
        u = warp_sum(u);
        if (threadIdx.x == 0) part[0] = u;
    }
    __syncthreads();
    return part[0];
}

template <int V, bool QX>
__global__ void __launch_bounds__(RN_THREADS) k_rmsnorm(float *out, float *x, const float *add, const float *w,
                                                        const int32_t *rows, int dim, float eps, int8_t *xq, float *xd,
                                                        float *xs) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch();
    int i = blockIdx.x, r = rows ? rows[i] : i;
    float *xr = x + (size_t)r * dim;
    const float *ar = add ? add + (size_t)r * dim : NULL;
    float ss = 0;
    if (V > 0) {
        int n4 = dim / 4;
        float4 v[V > 0 ? V : 1], a[V > 0 ? V : 1];
#pragma unroll
        for (int j = 0; j < V; j++) {
            int k = threadIdx.x + j * RN_THREADS;
            v[j] = k < n4 ? ((const float4 *)xr)[k] : make_float4(0, 0, 0, 0);
            a[j] = ar && k < n4 ? ((const float4 *)ar)[k] : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < V; j++) {
            int k = threadIdx.x + j * RN_THREADS;
            if (ar) {
                v[j].x += a[j].x, v[j].y += a[j].y, v[j].z += a[j].z, v[j].w += a[j].w;
                if (k < n4) ((float4 *)xr)[k] = v[j];
            }
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
        float inv = 1.0f / sqrtf(block_sum(ss, part) / dim + eps);
#pragma unroll
        for (int j = 0; j < V; j++) {
            int k = threadIdx.x + j * RN_THREADS;
            float4 o = make_float4(0, 0, 0, 0);
            if (k < n4) {
                float4 wv = ((const float4 *)w)[k];
                o.x = v[j].x * inv * wv.x, o.y = v[j].y * inv * wv.y, o.z = v[j].z * inv * wv.z, o.w = v[j].w * inv * wv.w;
                ((float4 *)(out + (size_t)i * dim))[k] = o;
            }
            if (QX) { /* dim is whole groups: a group's 8 lanes are all in or all out */
                float gd, gs;
                int packed = quant4_of8(o, gd, gs);
                if (k < n4) {
                    ((int *)(xq + (size_t)i * dim))[k] = packed;
                    if ((threadIdx.x & 7) == 0) {
                        size_t g = (size_t)i * (dim / 32) + k / 8;
                        xd[g] = gd, xs[g] = gs;
                    }
                }
            }
        }
    } else {
        for (int k = threadIdx.x; k < dim; k += blockDim.x) {
            float v = xr[k];
            if (ar) xr[k] = v = v + ar[k];
            ss += v * v;
        }
        float inv = 1.0f / sqrtf(block_sum(ss, part) / dim + eps);
        for (int k = threadIdx.x; k < dim; k += blockDim.x) out[(size_t)i * dim + k] = xr[k] * inv * w[k];
    }
}

void cu_rmsnorm(cu_dev *d, float *out, float *x, const float *add, const float *w, const int32_t *rows, int n,
                int dim, float eps, const cu_weight *next) {
    d->xq_of = NULL;
    if (n <= 0) return;
    int n4 = dim % 4 == 0 ? dim / 4 : 1 << 30;
    bool qx = next && dim % 32 == 0 && n4 <= 8 * RN_THREADS && next->n_in == dim && dp4a_for(d, next, n);
#define RN(V, Q) cu_launch(d, "rmsnorm", k_rmsnorm<V, Q>, n, RN_THREADS, 0, out, x, add, w, rows, dim, eps, d->xq, d->xqd, d->xqs)
#define RNV(Q)                                       \
    if (n4 <= RN_THREADS) RN(1, Q);                  \
    else if (n4 <= 2 * RN_THREADS) RN(2, Q);         \
    else if (n4 <= 4 * RN_THREADS) RN(4, Q);         \
    else if (n4 <= 8 * RN_THREADS) RN(8, Q);         \
    else RN(0, false);
    if (qx) { RNV(true) }
    else { RNV(false) }
#undef RNV
#undef RN
    if (qx) d->xq_of = out, d->xq_rows = n;
}

/* ---- matmul: matrix-vector kernels (T <= 8) ----
 * One launch serves up to three matrices of one input (Q, K, V; gate, up).
 * Each warp takes R rows (R > 1 for one or two tokens: the activations it
 * loads serve R rows, which is what keeps quantized rows, a quarter of the
 * bytes of f32 activations, from being bound by those loads), and S warps
 * share a row (more for matrices of few rows, so every SM has warps enough to
 * keep its loads in flight); lanes take 32-element groups of the row (or
 * 8-element pieces of float rows) in turn, so a warp reads whole stretches of
 * it; the S warps of a row add their sums through shared memory. Every
 * weight is read once for all T rows of X. */
#define MV_THREADS 256
#define MV_WARPS (MV_THREADS / 32)
#define MV_JOBS 3

struct mv_jobs {
    cu_wview w[MV_JOBS];
    float *y[MV_JOBS];
    int n_out[MV_JOBS];
    int first_block[MV_JOBS + 1];
};

/* This block's job, and the first of the R rows of this warp's row group;
 * then the wait for the kernel before (programmatic launch). Prefetching
 * the block's rows into L2 before the wait (they depend on no kernel) was
 * measured on an H200 and dropped: decode was slower with it, or no faster. */
__device__ __forceinline__ int mv_job(const mv_jobs &J, int S, int R, int &row0, int &part) {
    int j = 0;
    while (j + 1 < MV_JOBS && (int)blockIdx.x >= J.first_block[j + 1]) j++;
    pdl_wait();
    pdl_launch();
    int warp = threadIdx.x >> 5;
    part = warp % S;
    row0 = (((int)blockIdx.x - J.first_block[j]) * (MV_WARPS / S) + warp / S) * R;
    return j;
}

template <int NT, int R>
__device__ __forceinline__ void mv_finish(float (*acc)[NT], float *y, int n_out, int row0, int part, int S, int T) {
    __shared__ float red[MV_WARPS][R][NT];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = warp_sum(acc[r][t]);
            if (lane == 0) red[warp][r][t] = s;
        }
    __syncthreads();
    if (part == 0 && lane < NT * R) {
        int r = lane / NT, t = lane % NT, row = row0 + r;
        if (t < T && row < n_out) {
            float s = 0;
            for (int k = 0; k < S; k++) s += red[warp + k][r][t];
            y[(size_t)t * n_out + row] = s;
        }
    }
}

template <int NT>
__device__ __forceinline__ void mv_group_dot(const float *v, const float *x, size_t n_in, int g, int T, float *acc) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= T) break;
        const float4 *xp = (const float4 *)(x + (size_t)t * n_in + (size_t)g * 32);
        float s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 xv = __ldg(xp + i);
            s += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
        }
        acc[t] += s;
    }
}

template <int TYPE, int NT, int R>
__global__ void __launch_bounds__(MV_THREADS) k_matvec_grouped(mv_jobs J, const float *x, int T, int S) {
    int row0, part, lane = threadIdx.x & 31;
    int j = mv_job(J, S, R, row0, part);
    const cu_wview &w = J.w[j];
    int n_out = J.n_out[j], ng = w.n_in / 32, step = 32 * S;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0;
    if (R == 1) {
        if (row0 < n_out) {
            int g = part * 32 + lane;
            for (; g + step < ng; g += 2 * step) {
                float v0[32], v1[32];
                load_group<TYPE>(w, row0, g, v0);
                load_group<TYPE>(w, row0, g + step, v1);
                mv_group_dot<NT>(v0, x, w.n_in, g, T, acc[0]);
                mv_group_dot<NT>(v1, x, w.n_in, g + step, T, acc[0]);
            }
            if (g < ng) {
                float v0[32];
                load_group<TYPE>(w, row0, g, v0);
                mv_group_dot<NT>(v0, x, w.n_in, g, T, acc[0]);
            }
        }
    } else {
        for (int g = part * 32 + lane; g < ng; g += step) {
            float xs[NT][32];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float4 *xp = (const float4 *)(x + (size_t)(t < T ? t : 0) * w.n_in + (size_t)g * 32);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float4 xv = __ldg(xp + i);
                    xs[t][4 * i] = xv.x, xs[t][4 * i + 1] = xv.y, xs[t][4 * i + 2] = xv.z, xs[t][4 * i + 3] = xv.w;
                }
            }
            float v[R][32];
#pragma unroll
            for (int r = 0; r < R; r++)
                if (row0 + r < n_out) load_group<TYPE>(w, row0 + r, g, v[r]);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float s = 0;
#pragma unroll
                    for (int i = 0; i < 32; i++) s += v[r][i] * xs[t][i];
                    acc[r][t] += row0 + r < n_out ? s : 0.0f;
                }
        }
    }
    mv_finish<NT, R>(acc, J.y[j], n_out, row0, part, S, T);
}

/* 8 elements of a float row, as floats */
template <int TYPE>
__device__ __forceinline__ void load8_float(const void *W, size_t at, float *v) {
    if (TYPE == CT_F32) {
        float4 a = __ldg((const float4 *)((const float *)W + at)), b = __ldg((const float4 *)((const float *)W + at) + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        int4 a = __ldg((const int4 *)((const uint16_t *)W + at));
        uint32_t u[4] = {(uint32_t)a.x, (uint32_t)a.y, (uint32_t)a.z, (uint32_t)a.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (TYPE == CT_F16) {
                __half2 h = *(__half2 *)&u[k];
                float2 f = __half22float2(h);
                v[2 * k] = f.x, v[2 * k + 1] = f.y;
            } else {
                v[2 * k] = __uint_as_float(u[k] << 16);
                v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
            }
        }
    }
}

/* Float rows: R rows of 8 elements per lane per step when rows are whole
 * 16-byte pieces (VEC), else one element at a time. */
template <int TYPE, int NT, int R, bool VEC>
__global__ void __launch_bounds__(MV_THREADS) k_matvec_float(mv_jobs J, const float *x, int T, int S) {
    int row0, part, lane = threadIdx.x & 31;
    int j = mv_job(J, S, R, row0, part);
    const void *W = J.w[j].q;
    int n_in = J.w[j].n_in, n_out = J.n_out[j];
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0;
    if (VEC) {
        for (int i = (part * 32 + lane) * 8; i < n_in; i += 256 * S) {
            float xs[NT][8];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float4 *xp = (const float4 *)(x + (size_t)(t < T ? t : 0) * n_in + i);
                float4 a = __ldg(xp), b = __ldg(xp + 1);
                xs[t][0] = a.x, xs[t][1] = a.y, xs[t][2] = a.z, xs[t][3] = a.w;
                xs[t][4] = b.x, xs[t][5] = b.y, xs[t][6] = b.z, xs[t][7] = b.w;
            }
            float v[R][8];
#pragma unroll
            for (int r = 0; r < R; r++)
                if (row0 + r < n_out) load8_float<TYPE>(W, (size_t)(row0 + r) * n_in + i, v[r]);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float s = 0;
#pragma unroll
                    for (int e = 0; e < 8; e++) s += v[r][e] * xs[t][e];
                    acc[r][t] += row0 + r < n_out ? s : 0.0f;
                }
        }
    } else {
        for (int r = 0; r < R; r++) {
            if (row0 + r >= n_out) break;
            const size_t base = (size_t)(row0 + r) * n_in;
            for (int i = part * 32 + lane; i < n_in; i += 32 * S) {
                float wv = elem_float(TYPE, W, base + i);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t >= T) break;
                    acc[r][t] += wv * x[(size_t)t * n_in + i];
                }
            }
        }
    }
    mv_finish<NT, R>(acc, J.y[j], n_out, row0, part, S, T);
}

/* Q8_0 and Q4_0 weights with 8-bit activations (as the CPU kernels do):
 * the rows of x quantized in groups of 32 (one scale each), then each group's
 * dot product in integers with dp4a, scaled once. A lane reads a group's 32
 * weights (8 words) and the T rows' 32 activations (8 words each): a quarter
 * of the float activations' bytes. */
__global__ void k_quant_x(int8_t *xq, float *xd, float *xs, const float *x, int n_groups) {
    pdl_wait();
    pdl_launch();
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    float v = x[(size_t)g * 32 + lane], a = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.0f, id = a > 0 ? 127.0f / a : 0.0f;
    int q = __float2int_rn(v * id), sum = q;
    xq[(size_t)g * 32 + lane] = (int8_t)q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) xd[g] = d, xs[g] = d * (float)sum;
}

/* The 8 words of group g of row r as signed bytes in element order, and its scale. */
template <int TYPE>
__device__ __forceinline__ float load_group_i8(const cu_wview &w, int r, int g, int *q) {
    float s = __half2float(w.d[(size_t)r * (w.n_in / 32) + g]);
    if (TYPE == CT_Q8_0) {
        const int4 *p = (const int4 *)(w.q + (size_t)r * w.n_in + (size_t)g * 32);
        int4 a = __ldg(p), b = __ldg(p + 1);
        q[0] = a.x, q[1] = a.y, q[2] = a.z, q[3] = a.w, q[4] = b.x, q[5] = b.y, q[6] = b.z, q[7] = b.w;
    } else { /* Q4_0: low nibbles are elements 0-15, high nibbles 16-31, each less 8 */
        int4 a = __ldg((const int4 *)(w.q + (size_t)r * (w.n_in / 2) + (size_t)g * 16));
        int words[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            q[i] = __vsub4(words[i] & 0x0f0f0f0f, 0x08080808);
            q[4 + i] = __vsub4((words[i] >> 4) & 0x0f0f0f0f, 0x08080808);
        }
    }
    return s;
}

template <int TYPE, int NT, int R>
__global__ void __launch_bounds__(MV_THREADS)
    k_matvec_dp4a(mv_jobs J, const int8_t *xq, const float *xd, int T, int S) {
    int row0, part, lane = threadIdx.x & 31;
    int j = mv_job(J, S, R, row0, part);
    const cu_wview &w = J.w[j];
    int n_out = J.n_out[j], ng = w.n_in / 32, step = 32 * S;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0;
    for (int g = part * 32 + lane; g < ng; g += step) {
        int xs[NT][8];
        float xsc[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            int tt = t < T ? t : 0;
            const int4 *xp = (const int4 *)(xq + (size_t)tt * w.n_in + (size_t)g * 32);
            int4 a = __ldg(xp), b = __ldg(xp + 1);
            xs[t][0] = a.x, xs[t][1] = a.y, xs[t][2] = a.z, xs[t][3] = a.w;
            xs[t][4] = b.x, xs[t][5] = b.y, xs[t][6] = b.z, xs[t][7] = b.w;
            xsc[t] = __ldg(xd + (size_t)tt * ng + g);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row0 + r >= n_out) break;
            int q[8];
            float ws = load_group_i8<TYPE>(w, row0 + r, g, q);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                int si = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) si = __dp4a(q[i], xs[t][i], si);
                acc[r][t] += ws * xsc[t] * (float)si;
            }
        }
    }
    mv_finish<NT, R>(acc, J.y[j], n_out, row0, part, S, T);
}


/* Q4_K with 8-bit activations: a lane takes 64 elements of a super-block
 * (its groups 2u and 2u + 1, whose quants share 32 bytes: low nibbles the
 * first, high the second) and the super-block's 16-byte head (d, dmin, the
 * 12 bytes of 6-bit scales and mins, read by the 4 lanes of the super-block
 * at once). Each group: d sc_j xd_g dot(q, xq) - dmin m_j (xd_g sum xq). */
__device__ __forceinline__ int q4k_byte(uint32_t s0, uint32_t s1, uint32_t s2, int k) {
    uint32_t w = k < 4 ? s0 : k < 8 ? s1 : s2;
    return (int)((w >> (8 * (k & 3))) & 0xff);
}

__device__ __forceinline__ void q4k_sm(uint32_t s0, uint32_t s1, uint32_t s2, int j, float &sc, float &m) {
    if (j < 4) {
        sc = (float)(q4k_byte(s0, s1, s2, j) & 63);
        m = (float)(q4k_byte(s0, s1, s2, j + 4) & 63);
    } else {
        int hi = q4k_byte(s0, s1, s2, j + 4);
        sc = (float)((hi & 0xf) | ((q4k_byte(s0, s1, s2, j - 4) >> 6) << 4));
        m = (float)((hi >> 4) | ((q4k_byte(s0, s1, s2, j) >> 6) << 4));
    }
}

template <int NT, int R>
__global__ void __launch_bounds__(MV_THREADS)
    k_matvec_q4k_dp4a(mv_jobs J, const int8_t *xq, const float *xd, const float *xsum, int T, int S) {
    int row0, part, lane = threadIdx.x & 31;
    int j = mv_job(J, S, R, row0, part);
    const cu_wview &w = J.w[j];
    int n_out = J.n_out[j], nu = w.n_in / 64, ng = w.n_in / 32, step = 32 * S;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0;
    for (int U = part * 32 + lane; U < nu; U += step) {
        int sbi = U >> 2, u = U & 3, g0 = 2 * U;
        int xs[NT][16];
        float xd0[NT], xd1[NT], xs0[NT], xs1[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            int tt = t < T ? t : 0;
            const int4 *xp = (const int4 *)(xq + (size_t)tt * w.n_in + (size_t)U * 64);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int4 a = __ldg(xp + i);
                xs[t][4 * i] = a.x, xs[t][4 * i + 1] = a.y, xs[t][4 * i + 2] = a.z, xs[t][4 * i + 3] = a.w;
            }
            xd0[t] = __ldg(xd + (size_t)tt * ng + g0), xd1[t] = __ldg(xd + (size_t)tt * ng + g0 + 1);
            xs0[t] = __ldg(xsum + (size_t)tt * ng + g0), xs1[t] = __ldg(xsum + (size_t)tt * ng + g0 + 1);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row0 + r >= n_out) break;
            const uint8_t *sb = w.q + (size_t)(row0 + r) * w.row_bytes + (size_t)sbi * 144;
            int4 h = __ldg((const int4 *)sb);
            const int4 *qp = (const int4 *)(sb + 16 + u * 32);
            int4 qa = __ldg(qp), qb = __ldg(qp + 1);
            int q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            float2 dm = __half22float2(*(const __half2 *)&h.x);
            float sc0, m0, sc1, m1;
            q4k_sm((uint32_t)h.y, (uint32_t)h.z, (uint32_t)h.w, 2 * u, sc0, m0);
            q4k_sm((uint32_t)h.y, (uint32_t)h.z, (uint32_t)h.w, 2 * u + 1, sc1, m1);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                int d0 = 0, d1 = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    d0 = __dp4a(q[i] & 0x0f0f0f0f, xs[t][i], d0);
                    d1 = __dp4a((q[i] >> 4) & 0x0f0f0f0f, xs[t][8 + i], d1);
                }
                acc[r][t] += dm.x * (sc0 * xd0[t] * (float)d0 + sc1 * xd1[t] * (float)d1) -
                             dm.y * (m0 * xs0[t] + m1 * xs1[t]);
            }
        }
    }
    mv_finish<NT, R>(acc, J.y[j], n_out, row0, part, S, T);
}


/* Q6_K with 8-bit activations: a lane takes 64 elements of a super-block,
 * groups sub and sub + 2 of one half (their low bits share 32 bytes of q, low
 * and high nibbles; all four groups of the half share its 32 bytes of qh);
 * each 16 elements have a scale: d sc_k dot(q - 32, xq) xd_g. */
template <int NT, int R>
__global__ void __launch_bounds__(MV_THREADS)
    k_matvec_q6k_dp4a(mv_jobs J, const int8_t *xq, const float *xd, int T, int S) {
    int row0, part, lane = threadIdx.x & 31;
    int j = mv_job(J, S, R, row0, part);
    const cu_wview &w = J.w[j];
    int n_out = J.n_out[j], nu = w.n_in / 64, ng = w.n_in / 32, nsb = w.n_in / 256, step = 32 * S;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0;
    for (int U = part * 32 + lane; U < nu; U += step) {
        int sbi = U >> 2, u = U & 3, n = u >> 1, sub = u & 1;
        int ga = sbi * 8 + n * 4 + sub, gb = ga + 2; /* the groups' indices among the row's 32-element groups */
        int xa[NT][8], xb[NT][8];
        float xda[NT], xdb[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            int tt = t < T ? t : 0;
            const int4 *pa = (const int4 *)(xq + (size_t)tt * w.n_in + (size_t)ga * 32);
            const int4 *pb = (const int4 *)(xq + (size_t)tt * w.n_in + (size_t)gb * 32);
            int4 a0 = __ldg(pa), a1 = __ldg(pa + 1), b0 = __ldg(pb), b1 = __ldg(pb + 1);
            xa[t][0] = a0.x, xa[t][1] = a0.y, xa[t][2] = a0.z, xa[t][3] = a0.w;
            xa[t][4] = a1.x, xa[t][5] = a1.y, xa[t][6] = a1.z, xa[t][7] = a1.w;
            xb[t][0] = b0.x, xb[t][1] = b0.y, xb[t][2] = b0.z, xb[t][3] = b0.w;
            xb[t][4] = b1.x, xb[t][5] = b1.y, xb[t][6] = b1.z, xb[t][7] = b1.w;
            xda[t] = __ldg(xd + (size_t)tt * ng + ga), xdb[t] = __ldg(xd + (size_t)tt * ng + gb);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row0 + r >= n_out) break;
            size_t i = (size_t)(row0 + r) * nsb + sbi;
            const int4 *lp = (const int4 *)(w.q + i * 128 + n * 64 + sub * 32);
            const int4 *hp = (const int4 *)(w.qh + i * 64 + n * 32);
            int4 l0 = __ldg(lp), l1 = __ldg(lp + 1), h0 = __ldg(hp), h1 = __ldg(hp + 1);
            int2 scw = __ldg((const int2 *)(w.sc + i * 16 + n * 8));
            float dd = __half2float(__ldg(w.d + i));
            int lw[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
            int hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
            /* scales of group sub (bytes 2 sub, 2 sub + 1) and of sub + 2 (bytes 2 sub + 4, + 5) */
            int sa = sub ? scw.x >> 16 : scw.x, sb2 = sub ? scw.y >> 16 : scw.y;
            float sa0 = (float)(int8_t)(sa & 0xff), sa1 = (float)(int8_t)((sa >> 8) & 0xff);
            float sb0 = (float)(int8_t)(sb2 & 0xff), sb1 = (float)(int8_t)((sb2 >> 8) & 0xff);
            int qa[8], qb[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                qa[k] = __vsub4((lw[k] & 0x0f0f0f0f) | (((hw[k] >> (2 * sub)) & 0x03030303) << 4), 0x20202020);
                qb[k] = __vsub4(((lw[k] >> 4) & 0x0f0f0f0f) | (((hw[k] >> (2 * sub + 4)) & 0x03030303) << 4),
                                0x20202020);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                int a0 = 0, a1 = 0, b0 = 0, b1 = 0;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    a0 = __dp4a(qa[k], xa[t][k], a0);
                    a1 = __dp4a(qa[k + 4], xa[t][k + 4], a1);
                    b0 = __dp4a(qb[k], xb[t][k], b0);
                    b1 = __dp4a(qb[k + 4], xb[t][k + 4], b1);
                }
                acc[r][t] += dd * (xda[t] * (sa0 * (float)a0 + sa1 * (float)a1) +
                                   xdb[t] * (sb0 * (float)b0 + sb1 * (float)b1));
            }
        }
    }
    mv_finish<NT, R>(acc, J.y[j], n_out, row0, part, S, T);
}

template <int NT, int R>
static void matvec_r(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T) {
    const cu_weight *w = ws[0];
    bool vec = w->n_in % 8 == 0;
    bool dp4a = dp4a_for(d, w, T);
    /* warps per row: enough warps in all to fill the SMs (32 each), but no
     * more than a row's lanes' worth of units (a lane takes 64 elements of
     * Q4_K and Q6_K with dp4a, 32 of the grouped types, 8 of float rows) */
    int unit = dp4a && (w->type == CT_Q4_K || w->type == CT_Q6_K) ? 64 : (w->type == CT_Q8_0 || w->type == CT_Q4_0 || w->type == CT_Q4_K ||
                                                   w->type == CT_Q6_K) ? 32 : vec ? 8 : 1;
    int s_max = w->n_in / unit / 32;
    size_t rows = 0;
    for (int i = 0; i < n; i++) rows += ((size_t)ws[i]->n_out + R - 1) / R;
    int want = 32 * d->prop.multiProcessorCount, S = 1;
    while (S < MV_WARPS && 2 * S <= s_max && rows * S < (size_t)want) S *= 2;
    mv_jobs J;
    memset(&J, 0, sizeof J);
    int blocks = 0, per_block = (MV_WARPS / S) * R;
    for (int i = 0; i < MV_JOBS; i++) {
        J.first_block[i] = blocks;
        if (i < n) {
            J.w[i] = view_of(ws[i]);
            J.y[i] = ys[i];
            J.n_out[i] = ws[i]->n_out;
            blocks += (ws[i]->n_out + per_block - 1) / per_block;
        } else J.first_block[i] = 1 << 30;
    }
    J.first_block[MV_JOBS] = 1 << 30;
    dim3 grid(blocks), block(MV_THREADS);
    if (dp4a) {
        int n_groups = T * (w->n_in / 32);
        if (d->xq_of != x || d->xq_rows != T) /* not quantized by the kernel that wrote x */
            cu_launch(d, "8-bit activations", k_quant_x, (n_groups + 7) / 8, 256, 0, d->xq, d->xqd, d->xqs, x, n_groups);
        d->xq_of = NULL;
        const char *what = "matrix-vector product (dp4a)";
        const int8_t *xq = d->xq;
        const float *xqd = d->xqd, *xqs = d->xqs;
        if (w->type == CT_Q8_0) cu_launch(d, what, k_matvec_dp4a<CT_Q8_0, NT, R>, grid, block, 0, J, xq, xqd, T, S);
        else if (w->type == CT_Q4_0) cu_launch(d, what, k_matvec_dp4a<CT_Q4_0, NT, R>, grid, block, 0, J, xq, xqd, T, S);
        else if (w->type == CT_Q4_K) cu_launch(d, what, k_matvec_q4k_dp4a<NT, R>, grid, block, 0, J, xq, xqd, xqs, T, S);
        else cu_launch(d, what, k_matvec_q6k_dp4a<NT, R>, grid, block, 0, J, xq, xqd, T, S);
        return;
    }
    const char *what = "matrix-vector product";
    switch (w->type) {
    case CT_Q8_0: cu_launch(d, what, k_matvec_grouped<CT_Q8_0, NT, R>, grid, block, 0, J, x, T, S); break;
    case CT_Q4_0: cu_launch(d, what, k_matvec_grouped<CT_Q4_0, NT, R>, grid, block, 0, J, x, T, S); break;
    case CT_Q4_K: cu_launch(d, what, k_matvec_grouped<CT_Q4_K, NT, R>, grid, block, 0, J, x, T, S); break;
    case CT_Q6_K: cu_launch(d, what, k_matvec_grouped<CT_Q6_K, NT, R>, grid, block, 0, J, x, T, S); break;
#define FLOAT_CASE(TY)                                                                          \
    case TY:                                                                                   \
        if (vec) cu_launch(d, what, k_matvec_float<TY, NT, R, true>, grid, block, 0, J, x, T, S); \
        else cu_launch(d, what, k_matvec_float<TY, NT, R, false>, grid, block, 0, J, x, T, S);    \
        break;
    FLOAT_CASE(CT_F32)
    FLOAT_CASE(CT_F16)
    FLOAT_CASE(CT_BF16)
#undef FLOAT_CASE
    default: cu_note(d, cudaErrorInvalidValue, "matrix-vector product: weight type");
    }
}

static void matvec(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T) {
    if (T == 1) matvec_r<1, 4>(d, ys, x, ws, n, T);
    else if (T == 2) matvec_r<2, 2>(d, ys, x, ws, n, T);
    else if (T <= 4) matvec_r<4, 1>(d, ys, x, ws, n, T);
    else matvec_r<8, 1>(d, ys, x, ws, n, T);
}

/* ---- matmul: the GEMM path ---- */

/* A thread per 32-element group: its group dequantized once, written as
 * four 16-byte pieces (the L2 merges a warp's pieces into whole sectors).
 * Four threads a group, each dequantizing the whole group for its quarter,
 * made Q8_0 / Q4_K prefill markedly slower. */
template <int TYPE>
__global__ void k_dequant_grouped(__half *out, cu_wview w, int n_out) {
    size_t ng = (size_t)w.n_in / 32, grp = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (grp >= ng * n_out) return;
    int r = (int)(grp / ng), g = (int)(grp % ng);
    float v[32];
    load_group<TYPE>(w, r, g, v);
    int4 *o = (int4 *)(out + (size_t)r * w.n_in + (size_t)g * 32);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        __align__(16) __half2 h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(v[q * 8 + 2 * i], v[q * 8 + 2 * i + 1]);
        o[q] = *(const int4 *)h;
    }
}

__global__ void k_to_half(__half *out, const void *in, int type, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2half_rn(elem_float(type, in, i));
}

static bool grow(cu_dev *d, __half **p, size_t *cap, size_t elems) {
    if (elems <= *cap) return true;
    cudaStreamSynchronize(d->stream);
    cudaFree(*p);
    *p = NULL;
    *cap = 0;
    if (cudaMalloc((void **)p, elems * sizeof(__half)) != cudaSuccess) {
        cu_note(d, cudaErrorMemoryAllocation, "GEMM scratch");
        *p = NULL;
        return false;
    }
    *cap = elems;
    return true;
}

static int blocks_for(size_t n, int per) { return (int)((n + per - 1) / per < 65535 * 16 ? (n + per - 1) / per : 65535 * 16); }

static void gemm(cu_dev *d, float *y, const float *x, const cu_weight *w, int T) {
    const float one = 1, zero = 0;
    int m = w->n_out, k = w->n_in;
    cublasStatus_t st;
    if (w->type == CT_F32) {
        st = cublasSgemm(d->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, T, k, &one, (const float *)w->q, k, x, k, &zero, y, m);
    } else {
        const __half *A = (const __half *)w->q;
        if (w->type != CT_F16) {
            size_t n = (size_t)m * k;
            if (!grow(d, &d->wscratch, &d->wscratch_cap, n)) return;
            cu_wview v = view_of(w);
            size_t groups = n / 32;
            int nb = (int)((groups + 255) / 256);
            switch (w->type) {
            case CT_Q8_0: k_dequant_grouped<CT_Q8_0><<<nb, 256, 0, d->stream>>>(d->wscratch, v, m); break;
            case CT_Q4_0: k_dequant_grouped<CT_Q4_0><<<nb, 256, 0, d->stream>>>(d->wscratch, v, m); break;
            case CT_Q4_K: k_dequant_grouped<CT_Q4_K><<<nb, 256, 0, d->stream>>>(d->wscratch, v, m); break;
            case CT_Q6_K: k_dequant_grouped<CT_Q6_K><<<nb, 256, 0, d->stream>>>(d->wscratch, v, m); break;
            default: k_to_half<<<blocks_for(n, 256), 256, 0, d->stream>>>(d->wscratch, w->q, w->type, n);
            }
            CU_LAUNCHED(d, "weight dequantization");
            A = d->wscratch;
        }
        size_t nx = (size_t)T * k;
        if (!grow(d, &d->xscratch, &d->xscratch_cap, nx)) return;
        k_to_half<<<blocks_for(nx, 256), 256, 0, d->stream>>>(d->xscratch, x, CT_F32, nx);
        CU_LAUNCHED(d, "activation conversion");
        st = cublasGemmEx(d->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, T, k, &one, A, CUDA_R_16F, k, d->xscratch, CUDA_R_16F, k,
                          &zero, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    d->pdl_prev = false; /* cuBLAS's kernels do not wait as cu_launch's do */
    if (st != CUBLAS_STATUS_SUCCESS) cu_note(d, cudaErrorUnknown, "cuBLAS GEMM");
}

int cu_matmul_gemm_min_rows(cu_dev *d) { return d->gemm_min; }

void cu_set_matmul_gemm_min_rows(cu_dev *d, int t) { d->gemm_min = t < 1 ? 1 : t > 9 ? 9 : t; }

/* Quantized weights for 9 to MV_CHUNK_ROWS rows: the matrix-vector kernels
 * over chunks of 8 rows (the weight read once a chunk) cost less than the
 * GEMM path, which first writes the whole matrix out in f16 and reads it
 * back (about five times the weight's bytes). */
#define MV_CHUNK_ROWS 32
static bool chunked_mv(const cu_dev *d, const cu_weight *w, int T) {
    return d->gemm_min > 8 && T <= MV_CHUNK_ROWS &&
           (w->type == CT_Q8_0 || w->type == CT_Q4_0 || w->type == CT_Q4_K || w->type == CT_Q6_K);
}

void cu_matmul_n(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T) {
    if (T <= 0 || n <= 0) return;
    bool same = n <= MV_JOBS, mv = true;
    for (int i = 1; i < n; i++) same = same && ws[i]->type == ws[0]->type && ws[i]->n_in == ws[0]->n_in;
    for (int i = 0; i < n; i++) mv = mv && ((T < d->gemm_min && T <= 8) || chunked_mv(d, ws[i], T));
    if (mv && same) {
        for (int t0 = 0; t0 < T; t0 += 8) {
            float *yc[MV_JOBS];
            for (int i = 0; i < n; i++) yc[i] = ys[i] + (size_t)t0 * ws[i]->n_out;
            matvec(d, yc, x + (size_t)t0 * ws[0]->n_in, ws, n, T - t0 < 8 ? T - t0 : 8);
        }
        return;
    }
    for (int i = 0; i < n; i++) {
        if ((T < d->gemm_min && T <= 8) || chunked_mv(d, ws[i], T))
            for (int t0 = 0; t0 < T; t0 += 8) {
                float *yc = ys[i] + (size_t)t0 * ws[i]->n_out;
                matvec(d, &yc, x + (size_t)t0 * ws[i]->n_in, &ws[i], 1, T - t0 < 8 ? T - t0 : 8);
            }
        else gemm(d, ys[i], x, ws[i], T);
    }
}

void cu_matmul(cu_dev *d, float *y, const float *x, const cu_weight *w, int T) { cu_matmul_n(d, &y, x, &w, 1, T); }

/* ---- SwiGLU ---- */

__global__ void k_swiglu(float *g, const float *u, size_t n) {
    pdl_wait();
    pdl_launch();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

/* The same, four elements a lane, and each group of 32 quantized for the
 * down product's dp4a kernel (n a multiple of 32). */
__global__ void k_swiglu_q(float *g, const float *u, size_t n, int8_t *xq, float *xd, float *xs) {
    pdl_wait();
    pdl_launch();
    size_t n4 = n / 4, stride = (size_t)gridDim.x * blockDim.x;
    /* whole warps step together, so a group's 8 lanes are all in or all out */
    for (size_t base = blockIdx.x * (size_t)blockDim.x; base < n4; base += stride) {
        size_t k = base + threadIdx.x;
        float4 o = make_float4(0, 0, 0, 0);
        if (k < n4) {
            float4 x = ((const float4 *)g)[k], v = ((const float4 *)u)[k];
            o.x = x.x / (1.0f + expf(-x.x)) * v.x, o.y = x.y / (1.0f + expf(-x.y)) * v.y;
            o.z = x.z / (1.0f + expf(-x.z)) * v.z, o.w = x.w / (1.0f + expf(-x.w)) * v.w;
            ((float4 *)g)[k] = o;
        }
        float gd, gs;
        int packed = quant4_of8(o, gd, gs);
        if (k < n4) {
            ((int *)xq)[k] = packed;
            if ((threadIdx.x & 7) == 0) xd[k / 8] = gd, xs[k / 8] = gs;
        }
    }
}

void cu_swiglu(cu_dev *d, float *gate, const float *up, int T, int n, const cu_weight *next) {
    d->xq_of = NULL;
    size_t all = (size_t)T * n;
    if (!all) return;
    if (next && n % 32 == 0 && next->n_in == n && dp4a_for(d, next, T)) {
        cu_launch(d, "SwiGLU", k_swiglu_q, blocks_for(all / 4, 256), 256, 0, gate, up, all, d->xq, d->xqd, d->xqs);
        d->xq_of = gate, d->xq_rows = T;
    } else cu_launch(d, "SwiGLU", k_swiglu, blocks_for(all, 256), 256, 0, gate, up, all);
}
