/* ops/cuda/attention: the paged KV cache on the GPU: each token's q and k
 * biased and rotated (RoPE), its key and value rows written into its block
 * (in the cache's element type), and
 * flash-decoding attention over the blocks: every token's keys are split
 * across thread blocks, each computes a partial softmax-weighted sum with its
 * running max and sum, and a second kernel merges the parts by their
 * log-sum-exp. One thread block serves all query heads that share a KV head
 * (GQA), so each key and value is read once per group; f16 caches go
 * through tensor cores (k_attn_mma), where a prompt's tokens also share
 * their keys' reads. */
#include <math.h>
#include "ops/cuda/cuda_internal.cuh"

#define ATT_THREADS 128
#define ATT_TILE 128
#define ATT_MAX_HD 256
/* A split's part of one head: head_dim weighted sums, then its max and sum,
 * padded to whole 16-byte pieces (the merge reads four floats at a time). */
#define ATT_PSTRIDE(hd) ((size_t)(hd) + 4)

__device__ __forceinline__ int kv_group(int type, int hd) {
    return (type == KVLM_CACHE_Q8_0 || type == KVLM_CACHE_Q4_0) ? (hd % 32 == 0 ? 32 : hd) : 1;
}

__host__ __device__ inline size_t kv_row_bytes(int type, int hd) {
    int g = (type == KVLM_CACHE_Q8_0 || type == KVLM_CACHE_Q4_0) ? (hd % 32 == 0 ? 32 : hd) : 1;
    switch (type) {
    case KVLM_CACHE_F32: return (size_t)hd * 4;
    case KVLM_CACHE_F16:
    case KVLM_CACHE_BF16: return (size_t)hd * 2;
    case KVLM_CACHE_Q8_0: return (size_t)(hd / g) * (2 + g);
    case KVLM_CACHE_Q4_0: return (size_t)(hd / g) * (2 + (g + 1) / 2);
    default: return 0;
    }
}

__device__ __forceinline__ float kv_elem(int type, const uint8_t *row, int d, int g) {
    switch (type) {
    case KVLM_CACHE_F32: return ((const float *)row)[d];
    case KVLM_CACHE_F16: return __half2float(((const __half *)row)[d]);
    case KVLM_CACHE_BF16: return __uint_as_float((uint32_t)((const uint16_t *)row)[d] << 16);
    case KVLM_CACHE_Q8_0: {
        const uint8_t *b = row + (size_t)(d / g) * (2 + g);
        return __half2float(*(const __half *)b) * (float)(int8_t)b[2 + d % g];
    }
    default: { /* q4_0 */
        int half = (g + 1) / 2, j = d % g;
        const uint8_t *b = row + (size_t)(d / g) * (2 + half);
        int byte = b[2 + (j < half ? j : j - half)];
        int nib = j < half ? byte & 15 : byte >> 4;
        return __half2float(*(const __half *)b) * (float)(nib - 8);
    }
    }
}

/* Elements [d0, d0 + 8) of a row (zero past hd). */
__device__ __forceinline__ void kv_load8(int type, const uint8_t *row, int d0, int hd, int g, float *v) {
    if (type == KVLM_CACHE_F16 && d0 + 8 <= hd && ((uintptr_t)(row + 2 * d0) & 15) == 0) {
        int4 a = *(const int4 *)(row + 2 * d0);
        const __half2 *h = (const __half2 *)&a;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float2 f = __half22float2(h[k]);
            v[2 * k] = f.x, v[2 * k + 1] = f.y;
        }
        return;
    }
    if (type == KVLM_CACHE_F32 && d0 + 8 <= hd && ((uintptr_t)(row + 4 * d0) & 15) == 0) {
        float4 a = *(const float4 *)(row + 4 * d0), b = *((const float4 *)(row + 4 * d0) + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d0 + k < hd ? kv_elem(type, row, d0 + k, g) : 0.0f;
}

__device__ __forceinline__ uint8_t *kv_row(const cu_kv &kv, int32_t blk, int layer, int h, bool value, int slot) {
    size_t off = (size_t)blk * kv.block_bytes + ((size_t)layer * kv.n_kv_heads + h) * kv.head_bytes +
                 (value ? kv.v_offset : 0);
    return kv.base + off + (size_t)slot * kv_row_bytes(value ? kv.v_type : kv.k_type, kv.head_dim);
}

/* ---- writes ---- */

/* One row into its slot, as ops/kvtype.c's scalar quantizers write it
 * (no contracted multiply-adds, so the rounding is theirs). */
__device__ void store_row(int type, const float *x, uint8_t *dst, int hd, int tid, int nth) {
    int g = kv_group(type, hd);
    switch (type) {
    case KVLM_CACHE_F32:
        for (int i = tid; i < hd; i += nth) ((float *)dst)[i] = x[i];
        break;
    case KVLM_CACHE_F16:
        for (int i = tid; i < hd; i += nth) ((__half *)dst)[i] = __float2half_rn(x[i]);
        break;
    case KVLM_CACHE_BF16:
        for (int i = tid; i < hd; i += nth) {
            uint32_t u = __float_as_uint(x[i]);
            uint16_t b = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                          : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
            ((uint16_t *)dst)[i] = b;
        }
        break;
    case KVLM_CACHE_Q8_0:
        for (int gi = tid; gi < hd / g; gi += nth) {
            const float *xs = x + gi * g;
            uint8_t *b = dst + (size_t)gi * (2 + g);
            float amax = 0;
            for (int j = 0; j < g; j++) amax = fabsf(xs[j]) > amax ? fabsf(xs[j]) : amax;
            float d = __fdiv_rn(amax, 127.0f), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
            *(__half *)b = __float2half_rn(d);
            for (int j = 0; j < g; j++) {
                int q = __float2int_rn(__fmul_rn(xs[j], id));
                b[2 + j] = (uint8_t)(int8_t)(q < -127 ? -127 : q > 127 ? 127 : q);
            }
        }
        break;
    case KVLM_CACHE_Q4_0:
        for (int gi = tid; gi < hd / g; gi += nth) {
            const float *xs = x + gi * g;
            int half = (g + 1) / 2;
            uint8_t *b = dst + (size_t)gi * (2 + half);
            float amax = 0, vmax = 0;
            for (int j = 0; j < g; j++)
                if (fabsf(xs[j]) > amax) amax = fabsf(xs[j]), vmax = xs[j];
            float d = __fdiv_rn(vmax, -8.0f), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
            *(__half *)b = __float2half_rn(d);
            for (int j = 0; j < half; j++) {
                int lo = __float2int_rz(__fadd_rn(__fmul_rn(xs[j], id), 8.5f));
                lo = lo < 0 ? 0 : lo > 15 ? 15 : lo;
                int hi = 8;
                if (j + half < g) {
                    hi = __float2int_rz(__fadd_rn(__fmul_rn(xs[j + half], id), 8.5f));
                    hi = hi < 0 ? 0 : hi > 15 ? 15 : hi;
                }
                b[2 + j] = (uint8_t)(lo | (hi << 4));
            }
        }
        break;
    default: break;
    }
}

/* A block per (token, head): the pair indices' angles (in double, as
 * ops/rope.c computes them), then the head's bias and rotation; a KV head's
 * block also adds v's bias and writes both rows into the token's slot.
 * Heads in parallel blocks keep each block's chain of loads short. */
#define ROPE_MAX_HALF (ATT_MAX_HD / 2)
__global__ void k_qkv_rope_store(float *q, float *k, float *v, const float *bq, const float *bk, const float *bv,
                                 int n_heads, int rope_dim, float base, bool neox, cu_kv kv, int layer, cu_kv_batch b) {
    __shared__ float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    pdl_wait();
    pdl_launch();
    int t = blockIdx.x, h = blockIdx.y, hd = kv.head_dim, half = hd / 2, rhalf = rope_dim / 2, nkv = kv.n_kv_heads;
    bool isq = h < n_heads;
    int hk = h - n_heads;
    int p = b.pos[t];
    for (int i = threadIdx.x; i < rhalf; i += blockDim.x) {
        double th = (double)p * pow((double)base, -2.0 * i / rope_dim);
        cs[i] = (float)cos(th);
        sn[i] = (float)sin(th);
    }
    float *row = isq ? q + ((size_t)t * n_heads + h) * hd : k + ((size_t)t * nkv + hk) * hd;
    const float *bias = isq ? (bq ? bq + (size_t)h * hd : NULL) : (bk ? bk + (size_t)hk * hd : NULL);
    __syncthreads();
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        int a, c;
        if (i < rhalf) {
            a = neox ? i : 2 * i;
            c = neox ? i + rhalf : 2 * i + 1;
        } else {
            a = rope_dim + 2 * (i - rhalf);
            c = a + 1;
        }
        float x0 = row[a], x1 = row[c];
        if (bias) x0 += bias[a], x1 += bias[c];
        if (i < rhalf) {
            row[a] = x0 * cs[i] - x1 * sn[i];
            row[c] = x0 * sn[i] + x1 * cs[i];
        } else {
            row[a] = x0;
            row[c] = x1;
        }
    }
    if (isq) return;
    float *vr = v + ((size_t)t * nkv + hk) * hd;
    if (bv)
        for (int u = threadIdx.x; u < hd; u += blockDim.x) vr[u] += bv[(size_t)hk * hd + u];
    __syncthreads(); /* the rotated k and biased v rows are in */
    int32_t blk = b.tables[b.table_at[t] + p / kv.block_size];
    int slot = p % kv.block_size;
    store_row(kv.k_type, row, kv_row(kv, blk, layer, hk, false, slot), hd, threadIdx.x, blockDim.x);
    store_row(kv.v_type, vr, kv_row(kv, blk, layer, hk, true, slot), hd, threadIdx.x, blockDim.x);
}

void cu_qkv_rope_store(cu_dev *d, float *q, float *k, float *v, const float *bq, const float *bk, const float *bv,
                       int n_heads, int rope_dim, float rope_base, bool neox, const cu_kv *kv, int layer,
                       const cu_kv_batch *b) {
    if (b->T <= 0) return;
    if (rope_dim / 2 > ROPE_MAX_HALF || kv->head_dim > ATT_MAX_HD) {
        cu_note(d, cudaErrorInvalidValue, "RoPE: head_dim over 256");
        return;
    }
    int threads = kv->head_dim / 2 <= 32 ? 32 : kv->head_dim / 2 <= 64 ? 64 : 128;
    dim3 grid(b->T, n_heads + kv->n_kv_heads);
    cu_launch(d, "bias, RoPE and KV cache write", k_qkv_rope_store, grid, threads, 0, q, k, v, bq, bk, bv, n_heads,
              rope_dim, rope_base, neox, *kv, layer, *b);
}

/* ---- attention ---- */

/* Whether this block is the last of its n_splits to finish (counter c, set
 * back to zero by the last). */
__device__ bool attn_split_last(int *c, int n_splits) {
    __shared__ int last;
    __threadfence(); /* this block's part is visible before it is counted */
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(c, 1) == n_splits - 1;
        if (last) *c = 0;
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}

/* Token t's G heads of KV head kvh: every split's part merged into out. */
__device__ void attn_merge_token(float *out, const float *part, int t, int kvh, int G, int n_heads, int HD,
                                 int n_splits, float *sw) {
    __syncthreads(); /* sw's last readers are done */
    const size_t stride = ATT_PSTRIDE(HD);
    const float *p0 = part + ((size_t)t * n_heads + (size_t)kvh * G) * n_splits * stride;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int g = warp; g < G; g += nw) {
        const float *pg = p0 + (size_t)g * n_splits * stride;
        float M = -INFINITY;
        for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, __ldcg(pg + s * stride + HD));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float L = 0;
        for (int s = lane; s < n_splits; s += 32) {
            float m = __ldcg(pg + s * stride + HD), w = m > -INFINITY ? expf(m - M) : 0.0f;
            sw[g * n_splits + s] = w;
            L += w * __ldcg(pg + s * stride + HD + 1);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (lane == 0) sw[G * n_splits + g] = 1.0f / L;
    }
    __syncthreads();
    if (HD % 4 == 0) { /* four floats a load, four splits' loads at a time */
        int n4 = HD / 4;
        for (int i = threadIdx.x; i < G * n4; i += blockDim.x) {
            int g = i / n4, d4 = i % n4;
            const float *pg = p0 + (size_t)g * n_splits * stride + d4 * 4;
            const float *wg = sw + g * n_splits;
            float4 a = make_float4(0, 0, 0, 0);
            int s = 0;
#pragma unroll 2
            for (; s + 4 <= n_splits; s += 4) {
                float4 v[4];
#pragma unroll
                for (int k = 0; k < 4; k++) v[k] = __ldcg((const float4 *)(pg + (s + k) * stride));
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    float wk = wg[s + k];
                    a.x += wk * v[k].x, a.y += wk * v[k].y, a.z += wk * v[k].z, a.w += wk * v[k].w;
                }
            }
            for (; s < n_splits; s++) {
                float4 v = __ldcg((const float4 *)(pg + s * stride));
                float wk = wg[s];
                a.x += wk * v.x, a.y += wk * v.y, a.z += wk * v.z, a.w += wk * v.w;
            }
            float inv = sw[G * n_splits + g];
            a.x *= inv, a.y *= inv, a.z *= inv, a.w *= inv;
            *(float4 *)(out + ((size_t)t * n_heads + (size_t)kvh * G + g) * HD + d4 * 4) = a;
        }
        return;
    }
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x) {
        int g = i / HD, dd = i % HD;
        const float *pg = p0 + (size_t)g * n_splits * stride + dd;
        const float *wg = sw + g * n_splits;
        float a0 = 0;
        for (int s = 0; s < n_splits; s++) a0 += wg[s] * __ldcg(pg + s * stride);
        out[((size_t)t * n_heads + (size_t)kvh * G + g) * HD + dd] = a0 * sw[G * n_splits + g];
    }
}

/* After a split has written its part: the last of the n_splits blocks of
 * (token, KV head) to finish merges every split's part of its G heads by
 * log-sum-exp into out, so no second kernel is launched for the merge.
 * sw: G * (n_splits + 1) floats. */
__device__ void attn_merge_last(float *out, const float *part, int *count, int t, int kvh, int G, int n_heads, int HD,
                                int n_splits, float *sw) {
    if (attn_split_last(count + (size_t)t * gridDim.y + kvh, n_splits))
        attn_merge_token(out, part, t, kvh, G, n_heads, HD, n_splits, sw);
}

/* Partial results: [T][n_heads][n_splits] of head_dim sums, then max, sum. */
template <int GMAX, int DPT>
__global__ void __launch_bounds__(ATT_THREADS) k_attn_split(float *out, float *part, int *count, const float *q, cu_kv kv,
                                                            int layer, cu_kv_batch b, int n_heads, int G, float scale,
                                                            int n_splits) {
    pdl_wait();
    pdl_launch();
    int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z, tid = threadIdx.x;
    const int HD = kv.head_dim;
    extern __shared__ float smem[];
    float *sq = smem;                  /* [G][HD] scaled queries */
    float *ss = sq + G * HD;           /* [G][ATT_TILE] scores, then probabilities */
    float *sm_m = ss + G * (HD > ATT_TILE ? HD : ATT_TILE); /* [G] running max */
    float *sm_l = sm_m + GMAX;         /* [G] running sum */
    float *sm_a = sm_l + GMAX;         /* [G] this tile's rescale */
    int p = b.pos[t], n_keys = p + 1;
    int per = (n_keys + n_splits - 1) / n_splits;
    int k_begin = split * per, k_end = min(n_keys, k_begin + per);
    for (int i = tid; i < G * HD; i += ATT_THREADS) sq[i] = q[((size_t)t * n_heads + (size_t)kvh * G) * HD + i] * scale;
    if (tid < G) {
        sm_m[tid] = -INFINITY;
        sm_l[tid] = 0;
    }
    const int32_t *table = b.tables + b.table_at[t];
    const int gk = kv_group(kv.k_type, HD), gv = kv_group(kv.v_type, HD);
    /* the V pass: thread tid covers dims d0 + 128 j (j < DPT) of key
     * replica r: R = 128 / HD replicas take every R-th key of a tile */
    const int R = HD >= ATT_THREADS ? 1 : ATT_THREADS / HD;
    const int r = HD >= ATT_THREADS ? 0 : tid / HD, d0 = HD >= ATT_THREADS ? tid : tid % HD;
    const bool v_active = r < R && d0 < HD;
    float acc[GMAX][DPT];
#pragma unroll
    for (int g = 0; g < GMAX; g++)
#pragma unroll
        for (int j = 0; j < DPT; j++) acc[g][j] = 0;
    for (int k0 = k_begin; k0 < k_end; k0 += ATT_TILE) {
        int n = min(ATT_TILE, k_end - k0);
        __syncthreads(); /* the queries are in; the last tile's probabilities are used */
        if (tid < n) {
            int key = k0 + tid;
            const uint8_t *kr = kv_row(kv, table[key / kv.block_size], layer, kvh, false, key % kv.block_size);
            float dots[GMAX];
#pragma unroll
            for (int g = 0; g < GMAX; g++) dots[g] = 0;
            for (int dd = 0; dd < HD; dd += 8) {
                float kk[8];
                kv_load8(kv.k_type, kr, dd, HD, gk, kk);
#pragma unroll
                for (int g = 0; g < GMAX; g++) {
                    if (g >= G) break;
                    const float *qg = sq + g * HD + dd;
                    float s = 0;
#pragma unroll
                    for (int e = 0; e < 8; e++) s += dd + e < HD ? qg[e] * kk[e] : 0.0f;
                    dots[g] += s;
                }
            }
#pragma unroll
            for (int g = 0; g < GMAX; g++)
                if (g < G) ss[g * ATT_TILE + tid] = dots[g];
        }
        __syncthreads();
        int warp = tid >> 5, lane = tid & 31;
        for (int g = warp; g < G; g += ATT_THREADS / 32) {
            float mx = -INFINITY;
            for (int j = lane; j < n; j += 32) mx = fmaxf(mx, ss[g * ATT_TILE + j]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float m_old = sm_m[g], m_new = fmaxf(m_old, mx), sum = 0;
            for (int j = lane; j < n; j += 32) {
                float e = expf(ss[g * ATT_TILE + j] - m_new);
                ss[g * ATT_TILE + j] = e;
                sum += e;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) {
                float a = expf(m_old - m_new);
                sm_a[g] = a;
                sm_l[g] = sm_l[g] * a + sum;
                sm_m[g] = m_new;
            }
        }
        __syncthreads();
        if (v_active) {
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= G) break;
                float a = sm_a[g];
#pragma unroll
                for (int j = 0; j < DPT; j++) acc[g][j] *= a;
            }
            for (int jk = r; jk < n; jk += R) {
                int key = k0 + jk;
                const uint8_t *vr = kv_row(kv, table[key / kv.block_size], layer, kvh, true, key % kv.block_size);
#pragma unroll
                for (int j = 0; j < DPT; j++) {
                    int dd = d0 + j * ATT_THREADS;
                    if (dd >= HD) break;
                    float vv = kv_elem(kv.v_type, vr, dd, gv);
#pragma unroll
                    for (int g = 0; g < GMAX; g++) {
                        if (g >= G) break;
                        acc[g][j] += ss[g * ATT_TILE + jk] * vv;
                    }
                }
            }
        }
    }
    /* the replicas' sums (or the one replica's dims), through shared memory:
     * the scores are done with, and their region holds G x max(tile, HD) */
    __syncthreads();
    float *red = ss; /* [R][G][HD] */
    if (v_active)
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
#pragma unroll
            for (int j = 0; j < DPT; j++) {
                int dd = d0 + j * ATT_THREADS;
                if (dd < HD) red[((size_t)r * G + g) * HD + dd] = acc[g][j];
            }
        }
    __syncthreads();
    size_t stride = ATT_PSTRIDE(HD);
    for (int i = tid; i < G * HD; i += ATT_THREADS) {
        int g = i / HD, dd = i % HD;
        float s = 0;
        for (int rr = 0; rr < R; rr++) s += red[((size_t)rr * G + g) * HD + dd];
        float *o = part + (((size_t)t * n_heads + (size_t)kvh * G + g) * n_splits + split) * stride;
        o[dd] = s;
    }
    if (tid < G) {
        float *o = part + (((size_t)t * n_heads + (size_t)kvh * G + tid) * n_splits + split) * stride;
        o[HD] = sm_m[tid];
        o[HD + 1] = sm_l[tid];
    }
    attn_merge_last(out, part, count, t, kvh, G, n_heads, HD, n_splits, sm_a + GMAX);
}

/* The same for caches of f16, bf16 or f32 keys and values with head_dim a
 * multiple of 8 whose rows split into a power-of-two count of 16-byte pieces
 * (L = head_dim / 8 lanes per key, each holding 8 of its elements): P = 128
 * / L key slots, each taking KPT keys a pass: a pass's K and V pieces are
 * loaded while the pass before computes (and the block numbers of the pass
 * after while they load). Each slot keeps its own running max, sum and
 * weighted values (online softmax), so a pass needs no barrier; the slots
 * are merged at the end, within each warp by shuffles, then across warps. */
template <int TY>
struct kv_piece {
    uint4 w[TY == KVLM_CACHE_F32 ? 2 : 1];
};

template <int TY>
__device__ __forceinline__ void piece_load(kv_piece<TY> &p, const uint8_t *row, int sub) {
    const uint4 *src = (const uint4 *)(row + (size_t)sub * sizeof(kv_piece<TY>));
#pragma unroll
    for (int i = 0; i < (int)(sizeof p.w / sizeof p.w[0]); i++) p.w[i] = __ldg(src + i);
}

template <int TY>
__device__ __forceinline__ void piece_float(const kv_piece<TY> &p, float *v) {
    if (TY == KVLM_CACHE_F32) {
        const float *f = (const float *)p.w;
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = f[e];
    } else {
        const uint32_t *u = (const uint32_t *)p.w;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (TY == KVLM_CACHE_F16) {
                float2 f = __half22float2(*(const __half2 *)&u[k]);
                v[2 * k] = f.x, v[2 * k + 1] = f.y;
            } else {
                v[2 * k] = __uint_as_float(u[k] << 16);
                v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
            }
        }
    }
}

template <int GMAX, int TY, int KPT>
__global__ void __launch_bounds__(ATT_THREADS) k_attn_vec(float *out, float *part, int *count, const float *q, cu_kv kv,
                                                          int layer, cu_kv_batch b, int n_heads, int G, float scale,
                                                          int n_splits) {
    pdl_wait();
    pdl_launch();
    int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z, tid = threadIdx.x;
    const int HD = kv.head_dim, L = HD / 8, P = ATT_THREADS / L, bs = kv.block_size;
    const int sub = tid % L, slot = tid / L, warp = tid >> 5, lane = tid & 31;
    extern __shared__ float smem[];
    float *sq = smem;                   /* [G][HD] scaled queries */
    float *red = sq + G * HD;           /* [4 warps][G][HD + 2] */
    float *sw = red + 4 * G * (HD + 2); /* the merge's weights */
    int p = b.pos[t], n_keys = p + 1;
    int per = (n_keys + n_splits - 1) / n_splits;
    int k_begin = split * per, k_end = min(n_keys, k_begin + per);
    for (int i = tid; i < G * HD; i += ATT_THREADS) sq[i] = q[((size_t)t * n_heads + (size_t)kvh * G) * HD + i] * scale;
    const int32_t *table = b.tables + b.table_at[t];
    const size_t row_b = kv_row_bytes(TY, HD);
    const uint8_t *head = kv.base + ((size_t)layer * kv.n_kv_heads + kvh) * kv.head_bytes;
    const int step = KPT * P;
    float m[GMAX], l[GMAX], acc[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        m[g] = -INFINITY, l[g] = 0;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0;
    }
    /* keys of pass n: base_n + slot + i P. Pass n's pieces are loaded while
     * pass n - 1 computes, pass n + 1's block numbers while pass n loads. */
    int32_t blk[KPT];
    kv_piece<TY> kn[KPT], vn[KPT];
#pragma unroll
    for (int i = 0; i < KPT; i++) {
        int key = k_begin + slot + i * P;
        blk[i] = key < k_end ? __ldg(table + key / bs) : 0;
    }
#pragma unroll
    for (int i = 0; i < KPT; i++) {
        int key = k_begin + slot + i * P;
        if (key < k_end) {
            const uint8_t *r = head + (size_t)blk[i] * kv.block_bytes + (size_t)(key % bs) * row_b;
            piece_load<TY>(kn[i], r, sub);
            piece_load<TY>(vn[i], r + kv.v_offset, sub);
        } else kn[i] = vn[i] = kv_piece<TY>{};
    }
#pragma unroll
    for (int i = 0; i < KPT; i++) {
        int key = k_begin + step + slot + i * P;
        blk[i] = key < k_end ? __ldg(table + key / bs) : 0;
    }
    __syncthreads(); /* the queries are in */
    for (int base = k_begin; base < k_end; base += step) {
        kv_piece<TY> kp[KPT], vp[KPT];
        bool ok[KPT];
#pragma unroll
        for (int i = 0; i < KPT; i++) {
            kp[i] = kn[i], vp[i] = vn[i];
            ok[i] = base + slot + i * P < k_end;
        }
        /* the next pass's pieces, then the one after's block numbers */
#pragma unroll
        for (int i = 0; i < KPT; i++) {
            int key = base + step + slot + i * P;
            if (key < k_end) {
                const uint8_t *r = head + (size_t)blk[i] * kv.block_bytes + (size_t)(key % bs) * row_b;
                piece_load<TY>(kn[i], r, sub);
                piece_load<TY>(vn[i], r + kv.v_offset, sub);
            }
        }
#pragma unroll
        for (int i = 0; i < KPT; i++) {
            int key = base + 2 * step + slot + i * P;
            blk[i] = key < k_end ? __ldg(table + key / bs) : 0;
        }
        float sc[GMAX][KPT];
#pragma unroll
        for (int i = 0; i < KPT; i++) {
            float kf[8];
            piece_float<TY>(kp[i], kf);
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= G) break;
                const float *qg = sq + g * HD + sub * 8;
                float d = 0;
#pragma unroll
                for (int e = 0; e < 8; e++) d += qg[e] * kf[e];
                sc[g][i] = d;
            }
        }
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
#pragma unroll
            for (int i = 0; i < KPT; i++) {
                float d = sc[g][i];
                for (int o = L / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                sc[g][i] = ok[i] ? d : -INFINITY;
            }
        }
        float vf[KPT][8];
#pragma unroll
        for (int i = 0; i < KPT; i++) piece_float<TY>(vp[i], vf[i]);
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            float mx = sc[g][0];
#pragma unroll
            for (int i = 1; i < KPT; i++) mx = fmaxf(mx, sc[g][i]);
            float mn = fmaxf(m[g], mx);
            if (mn == -INFINITY) continue; /* no key of this slot yet */
            float a = __expf(m[g] - mn);
            l[g] *= a;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= a;
#pragma unroll
            for (int i = 0; i < KPT; i++) {
                float pi = ok[i] ? __expf(sc[g][i] - mn) : 0.0f;
                l[g] += pi;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] += pi * vf[i][e];
            }
            m[g] = mn;
        }
    }
    /* the slots of a warp, by shuffles (the partner has the same sub) */
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            float m2 = __shfl_xor_sync(0xffffffffu, m[g], o), l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
            float mn = fmaxf(m[g], m2);
            float a = mn > -INFINITY ? expf(m[g] - mn) : 0.0f, a2 = mn > -INFINITY ? expf(m2 - mn) : 0.0f;
            l[g] = l[g] * a + l2 * a2;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float x2 = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
                acc[g][e] = acc[g][e] * a + x2 * a2;
            }
            m[g] = mn;
        }
    }
    const size_t rs = (size_t)HD + 2;
    if (lane < L)
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            float *rg = red + ((size_t)warp * G + g) * rs;
#pragma unroll
            for (int e = 0; e < 8; e++) rg[sub * 8 + e] = acc[g][e];
            if (lane == 0) rg[HD] = m[g], rg[HD + 1] = l[g];
        }
    __syncthreads();
    /* the 4 warps: this split's result, or the answer when it is the only one */
    for (int i = tid; i < G * HD; i += ATT_THREADS) {
        int g = i / HD, dd = i % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < 4; w++) M = fmaxf(M, red[((size_t)w * G + g) * rs + HD]);
        float sum = 0, v = 0;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const float *rg = red + ((size_t)w * G + g) * rs;
            float a = rg[HD] > -INFINITY ? expf(rg[HD] - M) : 0.0f;
            sum += a * rg[HD + 1];
            v += a * rg[dd];
        }
        if (n_splits == 1) {
            out[((size_t)t * n_heads + (size_t)kvh * G + g) * HD + dd] = v / sum;
        } else {
            float *o = part + (((size_t)t * n_heads + (size_t)kvh * G + g) * n_splits + split) * ATT_PSTRIDE(HD);
            o[dd] = v;
            if (dd == 0) o[HD] = M, o[HD + 1] = sum;
        }
    }
    if (n_splits > 1) attn_merge_last(out, part, count, t, kvh, G, n_heads, HD, n_splits, sw);
}

/* ---- on tensor cores: f16 caches, head_dim 64 or 128 ----
 *
 * A warp takes 16 keys at a time for 8 or 16 query rows (a row: one query
 * head of one token; the G heads of a KV head, and for a run of tokens of
 * one sequence, R tokens' worth, so a prompt's keys are read once for R
 * tokens): S = Q K^T and O += P V as mma.sync m16n8k16 (f16 inputs, f32
 * sums). The keys and values go from global memory into the fragments
 * without shared memory: the dot product's order of dimensions is free, so
 * lane (g, t) of S's K fragment holds the contiguous quarter t of key g's
 * row; P V's V fragment pairs two keys' halves of one dimension, built from
 * 16-byte loads of each key's eighth g of its row by byte permutes (the
 * output dimension each lane holds follows from that). Q and P are each
 * split into an f16 part and the f16 of what it leaves over, two products
 * each, so the result keeps f32's precision (the cache's f16 keys and values
 * are exact in the products). Online softmax per row as the kernels above;
 * the 4 warps of a block take the same rows, each a quarter of the keys,
 * merged in shared memory, then across splits by attn_merge_token. */
__device__ __forceinline__ void mma_f16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x ~ hi + lo, both f16 pairs (x0 in the low halves) */
__device__ __forceinline__ void split_h2(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    __half2 h = __floats2half2_rn(x0, x1);
    float2 b = __half22float2(h);
    __half2 l = __floats2half2_rn(x0 - b.x, x1 - b.y);
    hi = *(uint32_t *)&h;
    lo = *(uint32_t *)&l;
}

template <int HD>
struct mma_tile {
    uint4 k[2][HD / 32]; /* keys g and g + 8: the quarter t of each row */
    uint4 v[4][HD / 64]; /* keys 2t, 2t + 1, 2t + 8, 2t + 9: the eighth g of each row */
};

/* N 16-byte pieces from byte off of key's row in a region (head: the K
 * regions, head + v_offset: the V regions); zeros past k_end */
template <int N>
__device__ __forceinline__ void mma_row_part(uint4 *dst, const uint8_t *region, const cu_kv &kv,
                                             const int32_t *table, int key, int k_end, size_t off) {
    if (key < k_end) {
        const uint4 *p = (const uint4 *)(region + (size_t)__ldg(table + key / kv.block_size) * kv.block_bytes +
                                         (size_t)(key % kv.block_size) * kv.head_dim * 2 + off);
#pragma unroll
        for (int u = 0; u < N; u++) dst[u] = __ldg(p + u);
    } else
#pragma unroll
        for (int u = 0; u < N; u++) dst[u] = make_uint4(0, 0, 0, 0);
}

template <int HD>
__device__ __forceinline__ void mma_load(mma_tile<HD> &x, const uint8_t *head, const cu_kv &kv, const int32_t *table,
                                         int k0, int k_end, int g, int t4) {
#pragma unroll
    for (int j = 0; j < 2; j++) mma_row_part<HD / 32>(x.k[j], head, kv, table, k0 + g + 8 * j, k_end, (size_t)t4 * (HD / 2));
#pragma unroll
    for (int j = 0; j < 4; j++)
        mma_row_part<HD / 64>(x.v[j], head + kv.v_offset, kv, table, k0 + 2 * t4 + (j & 1) + 8 * (j >> 1), k_end,
                              (size_t)g * (HD / 4));
}

template <int HD, bool R16>
__global__ void __launch_bounds__(ATT_THREADS) k_attn_mma(float *out, float *part, int *count, const float *q, cu_kv kv,
                                                          int layer, cu_kv_batch b, int n_heads, int G, int R,
                                                          float scale, int n_splits) {
    pdl_wait();
    pdl_launch();
    constexpr int WK = 4, RW = R16 ? 16 : 8, NC = HD / 16, NT = HD / 8;
    const int split = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3, wk = warp;
    const int T = b.T, t_blk = blockIdx.z * R, rows = R * G;
    extern __shared__ float smem[];
    float *red = smem;                     /* [4 warps][RW rows][HD + 2] */
    float *sw = red + 4 * RW * (HD + 2);   /* the merge's weights */
    int maxp = -1;
    for (int i = 0; i < R && t_blk + i < T; i++) maxp = max(maxp, __ldg(b.pos + t_blk + i));
    const int n_keys = maxp + 1, per = (n_keys + n_splits - 1) / n_splits;
    const int k_begin = split * per, k_end = min(n_keys, k_begin + per);
    const int32_t *table = b.tables + __ldg(b.table_at + t_blk);
    const uint8_t *head = kv.base + ((size_t)layer * kv.n_kv_heads + kvh) * kv.head_bytes;
    /* rows g and g + 8: their query fragments and the keys they see */
    uint32_t qh[NC][4], ql[NC][4];
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = g + 8 * h, tok = t_blk + r / G;
        bool ok = (h == 0 || R16) && r < rows && tok < T;
        lim[h] = ok ? min(__ldg(b.pos + tok) + 1, k_end) : 0;
        const float *qr = q + ((size_t)tok * n_heads + (size_t)kvh * G + r % G) * HD + t4 * (HD / 4);
#pragma unroll
        for (int c = 0; c < NC; c++) {
            float4 x = ok ? *(const float4 *)(qr + 4 * c) : make_float4(0, 0, 0, 0);
            split_h2(x.x * scale, x.y * scale, qh[c][h], ql[c][h]);
            split_h2(x.z * scale, x.w * scale, qh[c][2 + h], ql[c][2 + h]);
        }
    }
    float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0;
    /* head_dim 64: the next tile loads while this one computes (128 has no
     * registers for that; more warps in flight hide its loads) */
    constexpr bool PIPE = HD <= 64;
    const int step = 16 * WK;
    mma_tile<HD> cur, nxt;
    int k0 = k_begin + 16 * wk;
    if (PIPE && k0 < k_end) mma_load<HD>(cur, head, kv, table, k0, k_end, g, t4);
    for (; k0 < k_end; k0 += step) {
        if (!PIPE) mma_load<HD>(cur, head, kv, table, k0, k_end, g, t4);
        else if (k0 + step < k_end) mma_load<HD>(nxt, head, kv, table, k0 + step, k_end, g, t4);
        /* S: keys k0 + [0, 8) and k0 + [8, 16) */
        float s[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const uint32_t *kw = (const uint32_t *)cur.k[n];
#pragma unroll
            for (int c = 0; c < NC; c++) {
                mma_f16(s[n], qh[c], kw[2 * c], kw[2 * c + 1]);
                mma_f16(s[n], ql[c], kw[2 * c], kw[2 * c + 1]);
            }
        }
        /* online softmax: s[n][e] is row g (e < 2) or g + 8, key k0 + 8n + 2t + e % 2 */
        float p[2][4], a[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int key = k0 + 8 * n + 2 * t4 + e;
                    float v = key < lim[h] ? s[n][2 * h + e] : -INFINITY;
                    s[n][2 * h + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mn = fmaxf(m[h], mx);
            a[h] = mn == -INFINITY ? 1.0f : __expf(m[h] - mn);
            float sum = 0;
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float v = mn == -INFINITY ? 0.0f : __expf(s[n][2 * h + e] - mn);
                    p[n][2 * h + e] = v;
                    sum += v;
                }
            l[h] = l[h] * a[h] + sum;
            m[h] = mn;
        }
#pragma unroll
        for (int i = 0; i < NT; i++) o[i][0] *= a[0], o[i][1] *= a[0], o[i][2] *= a[1], o[i][3] *= a[1];
        /* P as the A operand: rows g, g + 8 by keys 2t, 2t + 1 (+ 8) */
        uint32_t ph[4], pl[4];
        split_h2(p[0][0], p[0][1], ph[0], pl[0]);
        split_h2(p[0][2], p[0][3], ph[1], pl[1]);
        split_h2(p[1][0], p[1][1], ph[2], pl[2]);
        split_h2(p[1][2], p[1][3], ph[3], pl[3]);
        /* O += P V: n-tile i is dims g' HD / 8 + i of lane (g', t) */
        const uint32_t *v0 = (const uint32_t *)cur.v[0], *v1 = (const uint32_t *)cur.v[1],
                       *v2 = (const uint32_t *)cur.v[2], *v3 = (const uint32_t *)cur.v[3];
#pragma unroll
        for (int i = 0; i < NT; i++) {
            const unsigned sel = (i & 1) ? 0x7632u : 0x5410u;
            uint32_t b0 = __byte_perm(v0[i >> 1], v1[i >> 1], sel), b1 = __byte_perm(v2[i >> 1], v3[i >> 1], sel);
            mma_f16(o[i], ph, b0, b1);
            mma_f16(o[i], pl, b0, b1);
        }
        if (PIPE) cur = nxt;
    }
    /* each row's sum over its 4 lanes; the warp's rows into shared memory */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    const int rs = HD + 2;
#pragma unroll
    for (int h = 0; h < (R16 ? 2 : 1); h++) {
        float *rr = red + ((size_t)warp * RW + g + 8 * h) * rs;
#pragma unroll
        for (int i = 0; i < NT; i++) {
            rr[(2 * t4) * (HD / 8) + i] = o[i][2 * h];
            rr[(2 * t4 + 1) * (HD / 8) + i] = o[i][2 * h + 1];
        }
        if (t4 == 0) rr[HD] = m[h], rr[HD + 1] = l[h];
    }
    __syncthreads();
    /* the 4 warps of each row: this split's part, or the answer */
    for (int i = tid; i < RW * HD; i += ATT_THREADS) {
        int rl = i / HD, dd = i % HD, tok = t_blk + rl / G;
        if (rl >= rows || tok >= T) continue;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < WK; w++) M = fmaxf(M, red[((size_t)w * RW + rl) * rs + HD]);
        float sum = 0, v = 0;
#pragma unroll
        for (int w = 0; w < WK; w++) {
            const float *rr = red + ((size_t)w * RW + rl) * rs;
            float aw = rr[HD] > -INFINITY ? expf(rr[HD] - M) : 0.0f;
            sum += aw * rr[HD + 1];
            v += aw * rr[dd];
        }
        size_t hrow = (size_t)tok * n_heads + (size_t)kvh * G + rl % G;
        if (n_splits == 1) {
            out[hrow * HD + dd] = v / sum;
        } else {
            float *po = part + (hrow * n_splits + split) * ATT_PSTRIDE(HD);
            po[dd] = v;
            if (dd == 0) po[HD] = M, po[HD + 1] = sum;
        }
    }
    if (n_splits > 1 && attn_split_last(count + (size_t)blockIdx.z * gridDim.y + kvh, n_splits))
        for (int i = 0; i < R && t_blk + i < T; i++)
            attn_merge_token(out, part, t_blk + i, kvh, G, n_heads, HD, n_splits, sw);
}

/* The work buffer holds max(max_T, ATT_PART_ROWS) token-splits per head. */
#define ATT_PART_ROWS 1024

size_t cu_attention_work_bytes(int max_T, int n_heads, int n_kv_heads, int head_dim) {
    (void)n_kv_heads;
    size_t rows = (size_t)(max_T > ATT_PART_ROWS ? max_T : ATT_PART_ROWS);
    return rows * n_heads * ATT_PSTRIDE(head_dim) * sizeof(float);
}

template <int GMAX, int DPT>
static void launch_split(cu_dev *d, float *out, float *part, const float *q, const cu_kv *kv, int layer,
                         const cu_kv_batch *b, int n_heads, int G, float scale, int n_splits) {
    dim3 grid(n_splits, kv->n_kv_heads, b->T);
    int hd = kv->head_dim;
    size_t sm = ((size_t)G * hd + (size_t)G * (hd > ATT_TILE ? hd : ATT_TILE) + 3 * GMAX + (size_t)G * (n_splits + 1)) *
                sizeof(float);
    cu_launch(d, "attention", k_attn_split<GMAX, DPT>, grid, ATT_THREADS, sm, out, part, d->att_count, q, *kv, layer, *b,
              n_heads, G, scale, n_splits);
}

/* n splits at most, no more parts than the work buffer holds and the
 * merge's weights (G per split) within 48 KB of shared memory beside
 * sm_base floats; at least one. */
static int splits_within(int n, int T, size_t sm_base, int G) {
    int cap = (T > ATT_PART_ROWS ? T : ATT_PART_ROWS) / T;
    int by_smem = (int)((48 * 1024 / sizeof(float) - sm_base) / G) - 1;
    if (n > cap) n = cap;
    if (n > by_smem) n = by_smem;
    return n < 1 ? 1 : n;
}

/* The tensor-core kernel takes f16 keys and values of head_dim 64 or 128
 * whose rows start on 16 bytes. */
static bool mma_fits(const cu_dev *d, const cu_kv *kv) {
    return d->att_mma && kv->k_type == KVLM_CACHE_F16 && kv->v_type == KVLM_CACHE_F16 &&
           (kv->head_dim == 64 || kv->head_dim == 128) &&
           ((uintptr_t)kv->base | kv->block_bytes | kv->head_bytes | kv->v_offset) % 16 == 0;
}

static void launch_mma(cu_dev *d, float *out, float *part, const float *q, const cu_kv *kv, int layer,
                       const cu_kv_batch *b, int n_heads, int G, float scale) {
    int T = b->T, hd = kv->head_dim, nkv = kv->n_kv_heads, run = b->run > 1 ? b->run : 1;
    /* a block's rows: G heads of R tokens (a run of one sequence: a prompt's
     * chunk) in 8 or 16 (4 warps over the same rows each taking a quarter of
     * the keys: faster for a prompt's attention than 4 warps over 4 times the
     * rows, each with all the keys) */
    int R = 1;
    if (run > 1 && (G & (G - 1)) == 0 && G < 16) R = 16 / G < run ? 16 / G : run;
    bool r16 = R * G > 8;
    int RW = r16 ? 16 : 8, NZ = (T + R - 1) / R;
    size_t sm_base = 4 * (size_t)RW * (hd + 2);
    /* no split when the blocks fill the GPU (a prompt); else two blocks an
     * SM, or keys of 2,048 a split where that gives more (blocks spread
     * evenly); two tiles of keys a warp at least, the work buffer's parts,
     * the merge's weights in 48 KB (measured on an H100: fewer splits lose
     * warps in flight, more lose to the merge) */
    int sms = d->prop.multiProcessorCount, max_keys = b->max_pos + 1;
    int blocks = NZ * nkv, by_keys = (max_keys + 127) / 128;
    int want = blocks >= sms ? 1 : 2 * sms / blocks, by_long = (max_keys + 2047) / 2048;
    if (blocks < sms && want < by_long) want = by_long;
    int n_splits = splits_within(want < by_keys ? want : by_keys, T, sm_base, G);
    dim3 grid(n_splits, nkv, NZ);
    size_t sm = (sm_base + (size_t)G * (n_splits + 1)) * sizeof(float);
#define LM(HD, R16) \
    cu_launch(d, "attention (tensor cores)", k_attn_mma<HD, R16>, grid, ATT_THREADS, sm, out, part, d->att_count, q, *kv, \
              layer, *b, n_heads, G, R, scale, n_splits)
    if (hd == 64) { if (r16) LM(64, true); else LM(64, false); }
    else { if (r16) LM(128, true); else LM(128, false); }
#undef LM
}

void cu_set_attention_mma(cu_dev *d, bool on) { d->att_mma = on; }

void cu_attention(cu_dev *d, float *out, const float *q, const cu_kv *kv, int layer, const cu_kv_batch *b, int n_heads,
                  float scale, void *work) {
    int T = b->T, hd = kv->head_dim, G = n_heads / kv->n_kv_heads;
    if (T <= 0) return;
    if (hd > ATT_MAX_HD || G > 16 || G * kv->n_kv_heads != n_heads) {
        cu_note(d, cudaErrorInvalidValue, "attention: head_dim over 256 or more than 16 query heads per KV head");
        return;
    }
    if ((size_t)T * kv->n_kv_heads > ATT_COUNT_MAX) {
        cu_note(d, cudaErrorInvalidValue, "attention: more than 65536 token x KV head pairs in one batch");
        return;
    }
    int sms = d->prop.multiProcessorCount, max_keys = b->max_pos + 1;
    float *part = (float *)work;
    /* tensor cores where they fit, but for one query head a KV head (MHA)
     * in decode, where 15 of 16 rows would be idle (the vector kernel
     * reads at the bandwidth there) */
    if (mma_fits(d, kv) && (G > 1 || b->run > 1)) {
        launch_mma(d, out, part, q, kv, layer, b, n_heads, G, scale);
        return;
    }
    /* the vector kernel: 16-byte rows of a power-of-two count of pieces,
     * float element types, K and V of one type, at most 8 heads a group */
    int L = hd / 8;
    bool fl = kv->k_type == KVLM_CACHE_F16 || kv->k_type == KVLM_CACHE_BF16 || kv->k_type == KVLM_CACHE_F32;
    bool vec = fl && kv->k_type == kv->v_type && hd % 8 == 0 && L <= 32 && (L & (L - 1)) == 0 && G <= 8;
    /* shared memory before the merge's weights (floats) */
    size_t sm_base = vec ? (size_t)G * hd + 4 * (size_t)G * (hd + 2)
                         : (size_t)G * hd + (size_t)G * (hd > ATT_TILE ? hd : ATT_TILE) + 3 * 16;
    /* enough thread blocks to fill the GPU twice over, keys of at least 64
     * per split, no more parts than the work buffer holds, and the merge's
     * weights within the default 48 KB of shared memory */
    int want = 2 * sms / (T * kv->n_kv_heads); /* one wave of two blocks an SM */
    int by_keys = (max_keys + 63) / 64;
    int n_splits = splits_within(want < by_keys ? want : by_keys, T, sm_base, G);
    if (vec) {
        dim3 grid(n_splits, kv->n_kv_heads, T);
        size_t sm = (sm_base + (size_t)G * (n_splits + 1)) * sizeof(float);
#define LV(GM, TY)                                                                                                  \
    cu_launch(d, "attention (vector)", k_attn_vec<GM, TY, (GM >= 8 ? 2 : 4)>, grid, ATT_THREADS, sm, out, part,   \
              d->att_count, q, *kv, layer, *b, n_heads, G, scale, n_splits)
#define LVT(TY) \
    if (G <= 1) LV(1, TY); \
    else if (G <= 2) LV(2, TY); \
    else if (G <= 4) LV(4, TY); \
    else LV(8, TY);
        if (kv->k_type == KVLM_CACHE_F16) { LVT(KVLM_CACHE_F16) }
        else if (kv->k_type == KVLM_CACHE_BF16) { LVT(KVLM_CACHE_BF16) }
        else { LVT(KVLM_CACHE_F32) }
#undef LVT
#undef LV
        return;
    }
    int dpt = hd > ATT_THREADS ? 2 : 1;
#define L(GM, DP) launch_split<GM, DP>(d, out, part, q, kv, layer, b, n_heads, G, scale, n_splits)
    if (dpt == 1) {
        if (G <= 1) L(1, 1);
        else if (G <= 2) L(2, 1);
        else if (G <= 4) L(4, 1);
        else if (G <= 8) L(8, 1);
        else L(16, 1);
    } else {
        if (G <= 1) L(1, 2);
        else if (G <= 2) L(2, 2);
        else if (G <= 4) L(4, 2);
        else if (G <= 8) L(8, 2);
        else L(16, 2);
    }
#undef L
}
