/* ops/cuda/kernels: the forward pass's kernels other than attention:
 * embedding, rmsnorm (with the residual add), matmul (matrix-vector kernels
 * that read each weight once for up to 8 rows; above that the weight
 * dequantized to f16 and cuBLAS's GEMM), bias + RoPE, SwiGLU. */
#include <math.h>
#include <string.h>
#include "ops/cuda/cuda_internal.cuh"

static cu_wview view_of(const cu_weight *w) {
    cu_wview v;
    v.q = (const uint8_t *)w->q;
    v.d = (const __half *)w->d;
    v.n_in = w->n_in;
    v.row_bytes = w->type == CT_Q4_K ? (size_t)w->n_in / 256 * 144 : w->type == CT_Q6_K ? (size_t)w->n_in / 256 * 210 : 0;
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
    int t = blockIdx.x, ng = w.n_in / 32;
    int32_t tok = tokens[t];
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
        float v[32];
        load_group<TYPE>(w, tok, g, v);
        for (int i = 0; i < 32; i++) x[(size_t)t * w.n_in + g * 32 + i] = v[i];
    }
}

__global__ void k_embed_float(float *x, const void *W, int type, int n_in, const int32_t *tokens) {
    int t = blockIdx.x;
    size_t r = (size_t)tokens[t] * n_in;
    for (int i = threadIdx.x; i < n_in; i += blockDim.x) x[(size_t)t * n_in + i] = elem_float(type, W, r + i);
}

void cu_embed(cu_dev *d, float *x, const cu_weight *emb, const int32_t *tokens, int T) {
    cu_wview v = view_of(emb);
    switch (emb->type) {
    case CT_Q8_0: k_embed_grouped<CT_Q8_0><<<T, 64, 0, d->stream>>>(x, v, tokens); break;
    case CT_Q4_0: k_embed_grouped<CT_Q4_0><<<T, 64, 0, d->stream>>>(x, v, tokens); break;
    case CT_Q4_K: k_embed_grouped<CT_Q4_K><<<T, 64, 0, d->stream>>>(x, v, tokens); break;
    case CT_Q6_K: k_embed_grouped<CT_Q6_K><<<T, 64, 0, d->stream>>>(x, v, tokens); break;
    default: k_embed_float<<<T, 256, 0, d->stream>>>(x, emb->q, emb->type, emb->n_in, tokens);
    }
    CU_LAUNCHED(d, "embedding");
}

/* ---- rmsnorm ---- */

__global__ void k_rmsnorm(float *out, float *x, const float *add, const float *w, const int32_t *rows, int dim,
                          float eps) {
    int i = blockIdx.x, r = rows ? rows[i] : i;
    float *xr = x + (size_t)r * dim;
    const float *ar = add ? add + (size_t)r * dim : NULL;
    float ss = 0;
    for (int k = threadIdx.x; k < dim; k += blockDim.x) {
        float v = xr[k];
        if (ar) xr[k] = v = v + ar[k];
        ss += v * v;
    }
    __shared__ float part[32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0;
        v = warp_sum(v);
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    float inv = 1.0f / sqrtf(part[0] / dim + eps);
    for (int k = threadIdx.x; k < dim; k += blockDim.x) out[(size_t)i * dim + k] = xr[k] * inv * w[k];
}

void cu_rmsnorm(cu_dev *d, float *out, float *x, const float *add, const float *w, const int32_t *rows, int n,
                int dim, float eps) {
    if (n <= 0) return;
    k_rmsnorm<<<n, 256, 0, d->stream>>>(out, x, add, w, rows, dim, eps);
    CU_LAUNCHED(d, "rmsnorm");
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

/* This block's job, and the first of the R rows of this warp's row group. */
__device__ __forceinline__ int mv_job(const mv_jobs &J, int S, int R, int &row0, int &part) {
    int j = 0;
    while (j + 1 < MV_JOBS && (int)blockIdx.x >= J.first_block[j + 1]) j++;
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
__global__ void k_quant_x(int8_t *xq, float *xd, const float *x, int n_groups) {
    int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (g >= n_groups) return;
    float v = x[(size_t)g * 32 + lane], a = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = a / 127.0f, id = a > 0 ? 127.0f / a : 0.0f;
    xq[(size_t)g * 32 + lane] = (int8_t)__float2int_rn(v * id);
    if (lane == 0) xd[g] = d;
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

template <int NT, int R>
static void matvec_r(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T) {
    /* warps per row: enough warps in all to fill the SMs (32 each) */
    size_t rows = 0;
    for (int i = 0; i < n; i++) rows += ((size_t)ws[i]->n_out + R - 1) / R;
    int want = 32 * d->prop.multiProcessorCount, S = 1;
    while (S < MV_WARPS && rows * S < (size_t)want) S *= 2;
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
    const cu_weight *w = ws[0];
    bool vec = w->n_in % 8 == 0;
    dim3 grid(blocks), block(MV_THREADS);
    bool dp4a = (w->type == CT_Q8_0 || w->type == CT_Q4_0) && d->xq && !d->xq_disabled && w->n_in <= XQ_MAX_IN &&
                w->n_in % 32 == 0;
    if (dp4a) {
        int n_groups = T * (w->n_in / 32);
        k_quant_x<<<(n_groups + 7) / 8, 256, 0, d->stream>>>(d->xq, d->xqd, x, n_groups);
        if (w->type == CT_Q8_0) k_matvec_dp4a<CT_Q8_0, NT, R><<<grid, block, 0, d->stream>>>(J, d->xq, d->xqd, T, S);
        else k_matvec_dp4a<CT_Q4_0, NT, R><<<grid, block, 0, d->stream>>>(J, d->xq, d->xqd, T, S);
        CU_LAUNCHED(d, "matrix-vector product (dp4a)");
        return;
    }
    switch (w->type) {
    case CT_Q8_0: k_matvec_grouped<CT_Q8_0, NT, R><<<grid, block, 0, d->stream>>>(J, x, T, S); break;
    case CT_Q4_0: k_matvec_grouped<CT_Q4_0, NT, R><<<grid, block, 0, d->stream>>>(J, x, T, S); break;
    case CT_Q4_K: k_matvec_grouped<CT_Q4_K, NT, R><<<grid, block, 0, d->stream>>>(J, x, T, S); break;
    case CT_Q6_K: k_matvec_grouped<CT_Q6_K, NT, R><<<grid, block, 0, d->stream>>>(J, x, T, S); break;
#define FLOAT_CASE(TY)                                                                                \
    case TY:                                                                                         \
        if (vec) k_matvec_float<TY, NT, R, true><<<grid, block, 0, d->stream>>>(J, x, T, S);          \
        else k_matvec_float<TY, NT, R, false><<<grid, block, 0, d->stream>>>(J, x, T, S);             \
        break;
    FLOAT_CASE(CT_F32)
    FLOAT_CASE(CT_F16)
    FLOAT_CASE(CT_BF16)
#undef FLOAT_CASE
    default: break;
    }
    CU_LAUNCHED(d, "matrix-vector product");
}

static void matvec(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T) {
    if (T == 1) matvec_r<1, 4>(d, ys, x, ws, n, T);
    else if (T == 2) matvec_r<2, 2>(d, ys, x, ws, n, T);
    else if (T <= 4) matvec_r<4, 1>(d, ys, x, ws, n, T);
    else matvec_r<8, 1>(d, ys, x, ws, n, T);
}

/* ---- matmul: the GEMM path ---- */

/* Four threads per 32-element group, each writing 8 of its halves (16
 * bytes), so a warp's stores cover 512 consecutive bytes. */
template <int TYPE>
__global__ void k_dequant_grouped(__half *out, cu_wview w, int n_out) {
    size_t ng = (size_t)w.n_in / 32, idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= ng * n_out * 4) return;
    size_t grp = idx >> 2;
    int quarter = (int)(idx & 3), r = (int)(grp / ng), g = (int)(grp % ng);
    float v[32];
    load_group<TYPE>(w, r, g, v);
    __align__(16) __half2 h[4];
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(v[quarter * 8 + 2 * i], v[quarter * 8 + 2 * i + 1]);
    *(int4 *)(out + (size_t)r * w.n_in + (size_t)g * 32 + quarter * 8) = *(const int4 *)h;
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
            int nb = (int)((groups * 4 + 255) / 256);
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
    if (st != CUBLAS_STATUS_SUCCESS) cu_note(d, cudaErrorUnknown, "cuBLAS GEMM");
}

int cu_matmul_gemm_min_rows(cu_dev *d) { return d->gemm_min; }

void cu_set_matmul_gemm_min_rows(cu_dev *d, int t) { d->gemm_min = t < 1 ? 1 : t > 9 ? 9 : t; }

void cu_matmul_n(cu_dev *d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T) {
    if (T <= 0 || n <= 0) return;
    bool same = n <= MV_JOBS;
    for (int i = 1; i < n; i++) same = same && ws[i]->type == ws[0]->type && ws[i]->n_in == ws[0]->n_in;
    if (T < d->gemm_min && T <= 8 && same) {
        matvec(d, ys, x, ws, n, T);
        return;
    }
    for (int i = 0; i < n; i++) {
        if (T < d->gemm_min && T <= 8) matvec(d, &ys[i], x, &ws[i], 1, T);
        else gemm(d, ys[i], x, ws[i], T);
    }
}

void cu_matmul(cu_dev *d, float *y, const float *x, const cu_weight *w, int T) { cu_matmul_n(d, &y, x, &w, 1, T); }

/* ---- bias + RoPE, SwiGLU ---- */

/* Block per token; thread u < n_heads * half + n_kv_heads * half handles one
 * pair of a q or k head (bias, then rotation; pairs past rope_dim only the
 * bias); the v row's bias after. half = head_dim / 2. */
__global__ void k_qkv_post(float *q, float *k, float *v, const float *bq, const float *bk, const float *bv,
                           const int32_t *pos, int n_heads, int n_kv_heads, int hd, int rope_dim, float base, bool neox) {
    int t = blockIdx.x, half = hd / 2, rhalf = rope_dim / 2;
    int p = pos[t];
    int nq = n_heads * half, nk = n_kv_heads * half;
    for (int u = threadIdx.x; u < nq + nk; u += blockDim.x) {
        bool isq = u < nq;
        int uu = isq ? u : u - nq, h = uu / half, i = uu % half;
        float *row = (isq ? q + ((size_t)t * n_heads + h) * hd : k + ((size_t)t * n_kv_heads + h) * hd);
        const float *b = isq ? (bq ? bq + h * hd : NULL) : (bk ? bk + h * hd : NULL);
        int a, c;
        if (i < rhalf) {
            a = neox ? i : 2 * i;
            c = neox ? i + rhalf : 2 * i + 1;
        } else {
            a = rope_dim + 2 * (i - rhalf);
            c = a + 1;
        }
        float x0 = row[a], x1 = row[c];
        if (b) x0 += b[a], x1 += b[c];
        if (i < rhalf) {
            double th = (double)p * pow((double)base, -2.0 * i / rope_dim);
            float cs = (float)cos(th), sn = (float)sin(th);
            row[a] = x0 * cs - x1 * sn;
            row[c] = x0 * sn + x1 * cs;
        } else {
            row[a] = x0;
            row[c] = x1;
        }
    }
    if (bv)
        for (int u = threadIdx.x; u < n_kv_heads * hd; u += blockDim.x) v[(size_t)t * n_kv_heads * hd + u] += bv[u];
}

void cu_qkv_post(cu_dev *d, float *q, float *k, float *v, const float *bq, const float *bk, const float *bv,
                 const int32_t *pos, int T, int n_heads, int n_kv_heads, int head_dim, int rope_dim, float rope_base,
                 bool neox) {
    if (T <= 0) return;
    k_qkv_post<<<T, 256, 0, d->stream>>>(q, k, v, bq, bk, bv, pos, n_heads, n_kv_heads, head_dim, rope_dim, rope_base,
                                         neox);
    CU_LAUNCHED(d, "bias and RoPE");
}

__global__ void k_swiglu(float *g, const float *u, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

void cu_swiglu(cu_dev *d, float *gate, const float *up, size_t n) {
    if (!n) return;
    k_swiglu<<<blocks_for(n, 256), 256, 0, d->stream>>>(gate, up, n);
    CU_LAUNCHED(d, "SwiGLU");
}
