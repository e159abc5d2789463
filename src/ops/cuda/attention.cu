/* ops/cuda/attention: the paged KV cache on the GPU: writing each token's
 * key and value rows into its block (in the cache's element type), and
 * flash-decoding attention over the blocks: every token's keys are split
 * across thread blocks, each computes a partial softmax-weighted sum with its
 * running max and sum, and a second kernel merges the parts by their
 * log-sum-exp. One thread block serves all query heads that share a KV head
 * (GQA), so each key and value is read once per group. */
#include <math.h>
#include "ops/cuda/cuda_internal.cuh"

#define ATT_THREADS 128
#define ATT_TILE 128
#define ATT_MAX_HD 256

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

__global__ void k_kv_store(cu_kv kv, int layer, cu_kv_batch b, const float *k, const float *v) {
    int t = blockIdx.x, h = blockIdx.y, hd = kv.head_dim;
    int p = b.pos[t];
    int32_t blk = b.tables[b.table_at[t] + p / kv.block_size];
    int slot = p % kv.block_size;
    const float *kr = k + ((size_t)t * kv.n_kv_heads + h) * hd, *vr = v + ((size_t)t * kv.n_kv_heads + h) * hd;
    store_row(kv.k_type, kr, kv_row(kv, blk, layer, h, false, slot), hd, threadIdx.x, blockDim.x);
    store_row(kv.v_type, vr, kv_row(kv, blk, layer, h, true, slot), hd, threadIdx.x, blockDim.x);
}

void cu_kv_store(cu_dev *d, const cu_kv *kv, int layer, const cu_kv_batch *b, const float *k, const float *v) {
    if (b->T <= 0) return;
    dim3 grid(b->T, kv->n_kv_heads);
    k_kv_store<<<grid, 64, 0, d->stream>>>(*kv, layer, *b, k, v);
    CU_LAUNCHED(d, "KV cache write");
}

/* ---- attention ---- */

/* Partial results: [T][n_heads][n_splits] of head_dim sums, then max, sum. */
template <int GMAX, int DPT>
__global__ void __launch_bounds__(ATT_THREADS) k_attn_split(float *part, const float *q, cu_kv kv, int layer,
                                                            cu_kv_batch b, int n_heads, int G, float scale, int n_splits) {
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
    size_t stride = (size_t)HD + 2;
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
}

/* The same for caches of f16, bf16 or f32 keys and values with head_dim a
 * multiple of 8 whose rows split into a power-of-two count of 16-byte pieces
 * (L = head_dim / 8 lanes per key): L lanes share a key, each loading 8 of
 * its elements at once, so a warp reads whole rows; 128 / L keys at a time,
 * two passes' loads in flight before they are used. */
template <int TYPE>
__device__ __forceinline__ void row8(const uint8_t *row, int sub, float *v) {
    if (TYPE == KVLM_CACHE_F32) {
        const float4 *p = (const float4 *)(row + (size_t)sub * 32);
        float4 a = __ldg(p), b = __ldg(p + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        int4 a = __ldg((const int4 *)(row + (size_t)sub * 16));
        uint32_t u[4] = {(uint32_t)a.x, (uint32_t)a.y, (uint32_t)a.z, (uint32_t)a.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (TYPE == KVLM_CACHE_F16) {
                float2 f = __half22float2(*(__half2 *)&u[k]);
                v[2 * k] = f.x, v[2 * k + 1] = f.y;
            } else {
                v[2 * k] = __uint_as_float(u[k] << 16);
                v[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
            }
        }
    }
}

template <int GMAX, int KT, int VT>
__global__ void __launch_bounds__(ATT_THREADS) k_attn_split_vec(float *part, const float *q, cu_kv kv, int layer,
                                                                cu_kv_batch b, int n_heads, int G, float scale,
                                                                int n_splits) {
    int split = blockIdx.x, kvh = blockIdx.y, t = blockIdx.z, tid = threadIdx.x;
    const int HD = kv.head_dim, L = HD / 8, P = ATT_THREADS / L;
    const int sub = tid % L, slot = tid / L;
    extern __shared__ float smem[];
    float *sq = smem;                 /* [G][HD] */
    float *ss = sq + G * HD;          /* [G][ATT_TILE] */
    float *red = ss + G * ATT_TILE;   /* [4 warps][G][HD] */
    float *sm_m = red + 4 * G * HD, *sm_l = sm_m + GMAX, *sm_a = sm_l + GMAX;
    int p = b.pos[t], n_keys = p + 1;
    int per = (n_keys + n_splits - 1) / n_splits;
    int k_begin = split * per, k_end = min(n_keys, k_begin + per);
    for (int i = tid; i < G * HD; i += ATT_THREADS) sq[i] = q[((size_t)t * n_heads + (size_t)kvh * G) * HD + i] * scale;
    if (tid < G) {
        sm_m[tid] = -INFINITY;
        sm_l[tid] = 0;
    }
    const int32_t *table = b.tables + b.table_at[t];
    const size_t krow = kv_row_bytes(KT, HD), vrow = kv_row_bytes(VT, HD);
    const size_t head_off = ((size_t)layer * kv.n_kv_heads + kvh) * kv.head_bytes;
    float acc[GMAX][8];
#pragma unroll
    for (int g = 0; g < GMAX; g++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[g][e] = 0;
    for (int k0 = k_begin; k0 < k_end; k0 += ATT_TILE) {
        int n = min(ATT_TILE, k_end - k0);
        __syncthreads();
        /* scores: keys j = slot, slot + P, ...; two rows' loads at a time */
        for (int j = slot; j < ATT_TILE; j += 2 * P) {
            float k0v[8], k1v[8];
            int ja = j, jb = j + P;
            bool va = ja < n, vb = jb < n;
            if (va) {
                int key = k0 + ja;
                row8<KT>(kv.base + (size_t)table[key / kv.block_size] * kv.block_bytes + head_off +
                             (size_t)(key % kv.block_size) * krow, sub, k0v);
            }
            if (vb) {
                int key = k0 + jb;
                row8<KT>(kv.base + (size_t)table[key / kv.block_size] * kv.block_bytes + head_off +
                             (size_t)(key % kv.block_size) * krow, sub, k1v);
            }
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= G) break;
                const float *qg = sq + g * HD + sub * 8;
                float da = 0, db = 0;
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    da += va ? qg[e] * k0v[e] : 0.0f;
                    db += vb ? qg[e] * k1v[e] : 0.0f;
                }
                for (int o = L / 2; o > 0; o >>= 1) {
                    da += __shfl_xor_sync(0xffffffffu, da, o);
                    db += __shfl_xor_sync(0xffffffffu, db, o);
                }
                if (sub == 0) {
                    if (va) ss[g * ATT_TILE + ja] = da;
                    if (vb) ss[g * ATT_TILE + jb] = db;
                }
            }
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
#pragma unroll
        for (int g = 0; g < GMAX; g++) {
            if (g >= G) break;
            float a = sm_a[g];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= a;
        }
        for (int j = slot; j < n; j += 2 * P) {
            float v0[8], v1[8];
            int jb = j + P;
            bool vb = jb < n;
            int key = k0 + j;
            row8<VT>(kv.base + (size_t)table[key / kv.block_size] * kv.block_bytes + head_off + kv.v_offset +
                         (size_t)(key % kv.block_size) * vrow, sub, v0);
            if (vb) {
                key = k0 + jb;
                row8<VT>(kv.base + (size_t)table[key / kv.block_size] * kv.block_bytes + head_off + kv.v_offset +
                             (size_t)(key % kv.block_size) * vrow, sub, v1);
            }
#pragma unroll
            for (int g = 0; g < GMAX; g++) {
                if (g >= G) break;
                float pa = ss[g * ATT_TILE + j], pb = vb ? ss[g * ATT_TILE + jb] : 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] += pa * v0[e] + (vb ? pb * v1[e] : 0.0f);
            }
        }
    }
    /* sum the key slots: within the warp by shuffles, then the 4 warps */
    int warp = tid >> 5, lane = tid & 31;
#pragma unroll
    for (int g = 0; g < GMAX; g++) {
        if (g >= G) break;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float v = acc[g][e];
            for (int o = L; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane < L) red[((size_t)warp * G + g) * HD + sub * 8 + e] = v;
        }
    }
    __syncthreads();
    size_t stride = (size_t)HD + 2;
    for (int i = tid; i < G * HD; i += ATT_THREADS) {
        int g = i / HD, dd = i % HD;
        float s = red[(size_t)g * HD + dd] + red[((size_t)G + g) * HD + dd] + red[((size_t)2 * G + g) * HD + dd] +
                  red[((size_t)3 * G + g) * HD + dd];
        part[(((size_t)t * n_heads + (size_t)kvh * G + g) * n_splits + split) * stride + dd] = s;
    }
    if (tid < G) {
        float *o = part + (((size_t)t * n_heads + (size_t)kvh * G + tid) * n_splits + split) * stride;
        o[HD] = sm_m[tid];
        o[HD + 1] = sm_l[tid];
    }
}

__global__ void k_attn_merge(float *out, const float *part, int n_heads, int hd, int n_splits) {
    int th = blockIdx.x; /* token * n_heads + head */
    size_t stride = (size_t)hd + 2;
    const float *p = part + (size_t)th * n_splits * stride;
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, p[s * stride + hd]);
    float L = 0;
    for (int s = 0; s < n_splits; s++) {
        float m = p[s * stride + hd];
        if (m > -INFINITY) L += p[s * stride + hd + 1] * expf(m - M);
    }
    for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
        float acc = 0;
        for (int s = 0; s < n_splits; s++) {
            float m = p[s * stride + hd];
            if (m > -INFINITY) acc += p[s * stride + dd] * expf(m - M);
        }
        out[(size_t)th * hd + dd] = acc / L;
    }
}

/* The work buffer holds max(max_T, ATT_PART_ROWS) token-splits per head. */
#define ATT_PART_ROWS 1024

size_t cu_attention_work_bytes(int max_T, int n_heads, int n_kv_heads, int head_dim) {
    (void)n_kv_heads;
    size_t rows = (size_t)(max_T > ATT_PART_ROWS ? max_T : ATT_PART_ROWS);
    return rows * n_heads * ((size_t)head_dim + 2) * sizeof(float);
}

template <int GMAX, int DPT>
static void launch_split(cu_dev *d, float *part, const float *q, const cu_kv *kv, int layer, const cu_kv_batch *b,
                         int n_heads, int G, float scale, int n_splits) {
    dim3 grid(n_splits, kv->n_kv_heads, b->T);
    int hd = kv->head_dim;
    size_t sm = ((size_t)G * hd + (size_t)G * (hd > ATT_TILE ? hd : ATT_TILE) + 3 * GMAX) * sizeof(float);
    k_attn_split<GMAX, DPT><<<grid, ATT_THREADS, sm, d->stream>>>(part, q, *kv, layer, *b, n_heads, G, scale, n_splits);
}

void cu_attention(cu_dev *d, float *out, const float *q, const cu_kv *kv, int layer, const cu_kv_batch *b, int n_heads,
                  float scale, void *work) {
    int T = b->T, hd = kv->head_dim, G = n_heads / kv->n_kv_heads;
    if (T <= 0) return;
    if (hd > ATT_MAX_HD || G > 16 || G * kv->n_kv_heads != n_heads) {
        cu_note(d, cudaErrorInvalidValue, "attention: head_dim over 256 or more than 16 query heads per KV head");
        return;
    }
    /* enough thread blocks to fill the GPU twice over, keys of at least 64
     * per split, and no more parts than the work buffer holds */
    int sms = d->prop.multiProcessorCount, max_keys = b->max_pos + 1;
    int want = (2 * sms + T * kv->n_kv_heads - 1) / (T * kv->n_kv_heads);
    int by_keys = (max_keys + 63) / 64;
    int cap = (T > ATT_PART_ROWS ? T : ATT_PART_ROWS) / T;
    int n_splits = want < by_keys ? want : by_keys;
    if (n_splits > cap) n_splits = cap;
    if (n_splits < 1) n_splits = 1;
    float *part = (float *)work;
    /* the vector kernel: 16-byte rows of a power-of-two count of pieces,
     * float element types, shared memory within the default 48 KB */
    int L = hd / 8;
    bool fl_k = kv->k_type == KVLM_CACHE_F16 || kv->k_type == KVLM_CACHE_BF16 || kv->k_type == KVLM_CACHE_F32;
    bool fl_v = kv->v_type == KVLM_CACHE_F16 || kv->v_type == KVLM_CACHE_BF16 || kv->v_type == KVLM_CACHE_F32;
    size_t vec_sm = ((size_t)G * hd + (size_t)G * ATT_TILE + 4 * (size_t)G * hd + 48) * sizeof(float);
    if (fl_k && fl_v && kv->k_type == kv->v_type && hd % 8 == 0 && L <= 32 && (L & (L - 1)) == 0 &&
        vec_sm <= 48 * 1024 && G <= 8) {
        dim3 grid(n_splits, kv->n_kv_heads, T);
#define LV(GM, TY) k_attn_split_vec<GM, TY, TY><<<grid, ATT_THREADS, vec_sm, d->stream>>>(part, q, *kv, layer, *b, n_heads, G, scale, n_splits)
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
        CU_LAUNCHED(d, "attention (split, vector)");
        k_attn_merge<<<T * n_heads, hd < 32 ? 32 : (hd > 256 ? 256 : hd), 0, d->stream>>>(out, part, n_heads, hd, n_splits);
        CU_LAUNCHED(d, "attention (merge)");
        return;
    }
    int dpt = hd > ATT_THREADS ? 2 : 1;
#define L(GM, DP) launch_split<GM, DP>(d, part, q, kv, layer, b, n_heads, G, scale, n_splits)
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
    CU_LAUNCHED(d, "attention (split)");
    k_attn_merge<<<T * n_heads, hd < 32 ? 32 : (hd > 256 ? 256 : hd), 0, d->stream>>>(out, part, n_heads, hd, n_splits);
    CU_LAUNCHED(d, "attention (merge)");
}
