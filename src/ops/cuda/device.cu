/* ops/cuda/device: the CUDA device: its stream and cuBLAS handle, memory and
 * copies, weights uploaded in the kernels' layouts, error reporting, and the
 * measurements (copy bandwidth, GEMM rate) benchmarks compare against. */
#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include "ops/cuda/cuda_internal.cuh"

extern "C" {
/* dtype/dtype.h's (C) scalar dequantizer and row size */
void dt_dequantize_row(int type, const void *src, float *dst, int64_t n);
size_t dt_row_size(int type, int64_t n);
}

static int set_err(kvlm_error *err, int code, const char *fmt, const char *a, const char *b) {
    if (err) {
        err->code = code;
        snprintf(err->msg, sizeof err->msg, fmt, a, b);
    }
    return code;
}

void cu_note(cu_dev *d, cudaError_t e, const char *where) {
    d->pdl_prev = false;
    if (e == cudaSuccess || d->first_err != cudaSuccess) return;
    d->first_err = e;
    snprintf(d->err_where, sizeof d->err_where, "%s", where);
}

int cu_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

cu_dev *cu_open(int device, kvlm_error *err) {
    int n = cu_device_count();
    if (device < 0 || device >= n) {
        char a[32], b[32];
        snprintf(a, sizeof a, "%d", device);
        snprintf(b, sizeof b, "%d", n);
        set_err(err, KVLM_EUNSUPPORTED, "CUDA device %s is not there (the driver sees %s GPUs)", a, b);
        return NULL;
    }
    cu_dev *d = (cu_dev *)calloc(1, sizeof *d);
    if (!d) return NULL;
    d->id = device;
    d->gemm_min = 9;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&d->prop, device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        set_err(err, KVLM_EUNSUPPORTED, "CUDA: %s%s", cudaGetErrorString(e), "");
        free(d);
        return NULL;
    }
    if (cublasCreate(&d->blas) != CUBLAS_STATUS_SUCCESS) {
        set_err(err, KVLM_EUNSUPPORTED, "CUDA: cannot create a cuBLAS handle%s%s", "", "");
        cudaStreamDestroy(d->stream);
        free(d);
        return NULL;
    }
    cublasSetStream(d->blas, d->stream);
    const char *dp = getenv("KVLM_CUDA_DP4A");
    d->xq_disabled = dp && !strcmp(dp, "0");
    const char *ta = getenv("KVLM_CUDA_TIER_ASYNC");
    if (!(ta && !strcmp(ta, "0"))) {
        bool ok = cudaStreamCreateWithFlags(&d->copy, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaEventCreateWithFlags(&d->copy_done, cudaEventDisableTiming) == cudaSuccess &&
                  cudaEventCreateWithFlags(&d->compute_done, cudaEventDisableTiming) == cudaSuccess;
        for (int i = 0; ok && i < TC_SLOTS; i++)
            ok = cudaEventCreateWithFlags(&d->tc_ev[i], cudaEventDisableTiming) == cudaSuccess;
        if (!ok) {
            cudaGetLastError();
            set_err(err, KVLM_EUNSUPPORTED, "CUDA: cannot create the copy stream and its events%s%s", "", "");
            cu_close(d);
            return NULL;
        }
    }
    const char *am = getenv("KVLM_CUDA_MMA_ATTN");
    d->att_mma = !(am && !strcmp(am, "0"));
    const char *pd = getenv("KVLM_CUDA_PDL");
    d->pdl = !(pd && !strcmp(pd, "0")) && d->prop.major >= 9;
    if (cudaMalloc((void **)&d->xq, 8 * (size_t)XQ_MAX_IN) != cudaSuccess ||
        cudaMalloc((void **)&d->xqd, 8 * (size_t)XQ_MAX_IN / 32 * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&d->xqs, 8 * (size_t)XQ_MAX_IN / 32 * sizeof(float)) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(d->xq);
        cudaFree(d->xqd);
        cudaFree(d->xqs);
        d->xq = NULL; /* the float kernels then */
        d->xqd = d->xqs = NULL;
    }
    if (cudaMalloc((void **)&d->att_count, ATT_COUNT_MAX * sizeof(int)) != cudaSuccess ||
        cudaMemset(d->att_count, 0, ATT_COUNT_MAX * sizeof(int)) != cudaSuccess) {
        set_err(err, KVLM_ENOMEM, "CUDA: out of device memory%s%s", "", "");
        cudaGetLastError();
        cu_close(d);
        return NULL;
    }
    return d;
}

void cu_close(cu_dev *d) {
    if (!d) return;
    cudaSetDevice(d->id);
    cudaStreamSynchronize(d->stream);
    cudaFree(d->wscratch);
    cudaFree(d->xscratch);
    cudaFree(d->xq);
    cudaFree(d->xqd);
    cudaFree(d->xqs);
    cudaFree(d->att_count);
    cudaFreeHost(d->pinned);
    if (d->copy) cudaStreamSynchronize(d->copy);
    for (int i = 0; i < TC_SLOTS; i++) {
        cudaFreeHost(d->tc_pin[i]);
        if (d->tc_ev[i]) cudaEventDestroy(d->tc_ev[i]);
    }
    if (d->copy_done) cudaEventDestroy(d->copy_done);
    if (d->compute_done) cudaEventDestroy(d->compute_done);
    if (d->copy) cudaStreamDestroy(d->copy);
    cublasDestroy(d->blas);
    cudaStreamDestroy(d->stream);
    free(d);
}

void cu_describe(cu_dev *d, char *buf, size_t cap) {
    snprintf(buf, cap, "%s, %d SMs, %.1f GiB", d->prop.name, d->prop.multiProcessorCount,
             (double)d->prop.totalGlobalMem / (1u << 30));
}

size_t cu_mem_free(cu_dev *d) {
    size_t f = 0, t = 0;
    cudaSetDevice(d->id);
    cudaMemGetInfo(&f, &t);
    return f;
}

void *cu_alloc(cu_dev *d, size_t bytes) {
    void *p = NULL;
    cudaSetDevice(d->id);
    d->pdl_prev = false; /* the memset below is the stream's last work */
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    /* zeroed on the stream and waited for: the kernels run on a
     * non-blocking stream, which a plain cudaMemset would not order */
    if (cudaMemsetAsync(p, 0, bytes, d->stream) != cudaSuccess || cudaStreamSynchronize(d->stream) != cudaSuccess) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

void cu_free(cu_dev *d, void *p) {
    if (!p) return;
    cudaSetDevice(d->id);
    cudaFree(p);
}

int cu_h2d(cu_dev *d, void *dst, const void *src, size_t n) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, d->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(d->stream);
    cu_note(d, e, "host-to-device copy");
    return e == cudaSuccess ? KVLM_OK : KVLM_EIO;
}

int cu_d2h(cu_dev *d, void *dst, const void *src, size_t n) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, d->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(d->stream);
    cu_note(d, e, "device-to-host copy");
    return e == cudaSuccess ? KVLM_OK : KVLM_EIO;
}

void cu_d2d(cu_dev *d, void *dst, const void *src, size_t n) {
    cu_tier_join(d);
    cu_note(d, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, d->stream), "device-to-device copy");
}

int cu_h2d_async(cu_dev *d, void *dst, const void *src, size_t n) {
    size_t need = (n + 255) & ~(size_t)255;
    if (d->pinned_off + need > d->pinned_cap) {
        /* wrap: the copies that read the staging must be done first */
        cudaStreamSynchronize(d->stream);
        d->pinned_off = 0;
        if (need > d->pinned_cap) {
            cudaFreeHost(d->pinned);
            d->pinned = NULL;
            size_t cap = std::max(need, (size_t)4 << 20);
            if (cudaMallocHost((void **)&d->pinned, cap) != cudaSuccess) {
                d->pinned_cap = 0;
                cu_note(d, cudaErrorMemoryAllocation, "pinned staging");
                return KVLM_ENOMEM;
            }
            d->pinned_cap = cap;
        }
    }
    uint8_t *s = d->pinned + d->pinned_off;
    memcpy(s, src, n);
    d->pinned_off += need;
    cu_note(d, cudaMemcpyAsync(dst, s, n, cudaMemcpyHostToDevice, d->stream), "staged upload");
    return KVLM_OK;
}

/* ---- the KV cache's tier copies ---- */

/* A free staging slot of at least n bytes, or -1 (no pinned memory could
 * be had). Slots are taken in turn; a slot whose last copy is still in
 * flight is waited for (an event never recorded is complete). */
static int tc_slot(cu_dev *d, size_t n) {
    if (n > d->tc_cap) { /* bigger blocks than before (a first copy): new slots */
        cudaStreamSynchronize(d->copy);
        for (int i = 0; i < TC_SLOTS; i++) {
            cudaFreeHost(d->tc_pin[i]);
            d->tc_pin[i] = NULL;
        }
        /* as many slots as 64 MiB of pinned memory holds, 2 to 16 */
        size_t want = ((size_t)64 << 20) / n;
        d->tc_n = want < 2 ? 2 : want > TC_SLOTS ? TC_SLOTS : (int)want;
        d->tc_cap = n;
        d->tc_next = 0;
        for (int i = 0; i < d->tc_n; i++)
            if (cudaMallocHost((void **)&d->tc_pin[i], n) != cudaSuccess) {
                cudaGetLastError();
                for (int j = 0; j < i; j++) cudaFreeHost(d->tc_pin[j]), d->tc_pin[j] = NULL;
                d->tc_cap = 0;
                return -1;
            }
    }
    int i = d->tc_next;
    d->tc_next = (i + 1) % d->tc_n;
    cu_note(d, cudaEventSynchronize(d->tc_ev[i]), "tier copy");
    return i;
}

/* A staging slot for a tier copy of n bytes, the copy stream ordered after
 * the work queued on the compute stream so far (which may still read or
 * write the blocks); -1: copy synchronously (no copy stream or no pinned
 * memory; the copy stream's work is done by then). */
static int tc_begin(cu_dev *d, size_t n) {
    if (!d->copy) return -1;
    int i = tc_slot(d, n);
    if (i < 0) {
        cudaStreamSynchronize(d->copy);
        return -1;
    }
    cu_note(d, cudaEventRecord(d->compute_done, d->stream), "tier copy");
    cu_note(d, cudaStreamWaitEvent(d->copy, d->compute_done, 0), "tier copy");
    return i;
}

int cu_tier_write(cu_dev *d, void *dst, const void *src, size_t n) {
    int i = tc_begin(d, n);
    if (i < 0) return cu_h2d(d, dst, src, n);
    memcpy(d->tc_pin[i], src, n);
    cu_note(d, cudaMemcpyAsync(dst, d->tc_pin[i], n, cudaMemcpyHostToDevice, d->copy), "tier copy to the device");
    cu_note(d, cudaEventRecord(d->tc_ev[i], d->copy), "tier copy");
    d->copies_pending = true;
    return d->first_err == cudaSuccess ? KVLM_OK : KVLM_EIO;
}

int cu_tier_read(cu_dev *d, void *dst, const void *src, size_t n) {
    int i = tc_begin(d, n);
    if (i < 0) return cu_d2h(d, dst, src, n);
    cu_note(d, cudaMemcpyAsync(d->tc_pin[i], src, n, cudaMemcpyDeviceToHost, d->copy), "tier copy to the host");
    cu_note(d, cudaEventRecord(d->tc_ev[i], d->copy), "tier copy");
    cu_note(d, cudaEventSynchronize(d->tc_ev[i]), "tier copy");
    memcpy(dst, d->tc_pin[i], n);
    return d->first_err == cudaSuccess ? KVLM_OK : KVLM_EIO;
}

void cu_tier_join(cu_dev *d) {
    if (!d->copies_pending) return;
    cu_note(d, cudaEventRecord(d->copy_done, d->copy), "tier copy");
    cu_note(d, cudaStreamWaitEvent(d->stream, d->copy_done, 0), "tier copy");
    d->copies_pending = false;
}

int cu_sync(cu_dev *d, kvlm_error *err) {
    cu_note(d, cudaStreamSynchronize(d->stream), "stream");
    d->pinned_off = 0;
    if (d->first_err == cudaSuccess) return KVLM_OK;
    return set_err(err, KVLM_EIO, "CUDA error in %s: %s", d->err_where, cudaGetErrorString(d->first_err));
}

/* ---- weights ---- */

static bool kept_as_is(int type) {
    return type == CT_F32 || type == CT_F16 || type == CT_BF16 || type == CT_Q4_K || type == CT_Q6_K;
}

size_t cu_weight_bytes(int type, int64_t n_in, int64_t n_out) {
    if (type == CT_Q8_0) return (size_t)(n_in * n_out) + (size_t)(n_in / 32 * n_out) * 2;
    if (type == CT_Q4_0) return (size_t)(n_in * n_out) / 2 + (size_t)(n_in / 32 * n_out) * 2;
    if (kept_as_is(type)) return dt_row_size(type, n_in) * (size_t)n_out;
    return (size_t)(n_in * n_out) * 2;
}

int cu_weight_upload(cu_dev *d, cu_weight *w, const void *host, int type, int64_t n_in, int64_t n_out,
                     kvlm_error *err) {
    memset(w, 0, sizeof *w);
    w->n_in = (int)n_in;
    w->n_out = (int)n_out;
    size_t row = dt_row_size(type, n_in);
    if (!row) {
        char a[16], b[24];
        snprintf(a, sizeof a, "%d", type);
        snprintf(b, sizeof b, "%lld", (long long)n_in);
        return set_err(err, KVLM_EUNSUPPORTED, "CUDA: no layout for weight type %s with rows of %s elements", a, b);
    }
    std::vector<uint8_t> tmp;
    const void *src = host;
    size_t main_bytes;
    if (type == CT_Q6_K && n_in % 256 == 0) {
        /* split the super-blocks into planes (cuda_internal.cuh's cu_wview) */
        size_t nb = (size_t)(n_in / 256) * n_out;
        main_bytes = nb * 208;
        tmp.resize(nb * 210);
        uint8_t *ql = tmp.data(), *qh = ql + nb * 128, *sc = qh + nb * 64, *dp = sc + nb * 16;
        const uint8_t *s = (const uint8_t *)host;
        for (size_t i = 0; i < nb; i++) {
            const uint8_t *b = s + i * 210; /* ql[128], qh[64], scales[16], d */
            memcpy(ql + i * 128, b, 128);
            memcpy(qh + i * 64, b + 128, 64);
            memcpy(sc + i * 16, b + 192, 16);
            memcpy(dp + i * 2, b + 208, 2);
        }
        src = tmp.data();
        w->type = type;
    } else if (type == CT_Q8_0 || type == CT_Q4_0) {
        /* split the blocks into quants and scales */
        int per = type == CT_Q8_0 ? 32 : 16, blk = 2 + per;
        size_t nb = (size_t)(n_in / 32) * n_out;
        main_bytes = nb * per;
        tmp.resize(main_bytes + nb * 2);
        const uint8_t *s = (const uint8_t *)host;
        for (size_t i = 0; i < nb; i++) {
            memcpy(&tmp[main_bytes + 2 * i], s + i * blk, 2);
            memcpy(&tmp[i * per], s + i * blk + 2, per);
        }
        src = tmp.data();
        w->type = type;
    } else if (kept_as_is(type)) {
        main_bytes = row * (size_t)n_out;
        w->type = type;
    } else {
        /* any other type: dequantized once, kept as f16 */
        main_bytes = (size_t)(n_in * n_out) * 2;
        tmp.resize(main_bytes);
        std::vector<float> f((size_t)n_in);
        __half *h = (__half *)tmp.data();
        for (int64_t r = 0; r < n_out; r++) {
            dt_dequantize_row(type, (const uint8_t *)host + (size_t)r * row, f.data(), n_in);
            for (int64_t i = 0; i < n_in; i++) h[(size_t)r * n_in + i] = __float2half_rn(f[(size_t)i]);
        }
        src = tmp.data();
        w->type = CT_F16;
    }
    size_t total = cu_weight_bytes(w->type, n_in, n_out);
    uint8_t *p = (uint8_t *)cu_alloc(d, total);
    if (!p) return set_err(err, KVLM_ENOMEM, "CUDA: out of device memory for a weight%s%s", "", "");
    if (cudaMemcpyAsync(p, src, total, cudaMemcpyHostToDevice, d->stream) != cudaSuccess ||
        cudaStreamSynchronize(d->stream) != cudaSuccess) {
        cudaFree(p);
        return set_err(err, KVLM_EIO, "CUDA: weight upload failed%s%s", "", "");
    }
    w->q = p;
    w->d = (w->type == CT_Q8_0 || w->type == CT_Q4_0 || w->type == CT_Q6_K) ? p + main_bytes : NULL;
    w->bytes = total;
    return KVLM_OK;
}

void cu_weight_free(cu_dev *d, cu_weight *w) {
    cu_free(d, w->q);
    memset(w, 0, sizeof *w);
}

/* ---- graphs ---- */

struct cu_graph {
    cudaGraphExec_t exec;
};

int cu_graph_begin(cu_dev *d) {
    cudaError_t e = cudaStreamBeginCapture(d->stream, cudaStreamCaptureModeThreadLocal);
    cu_note(d, e, "graph capture");
    return e == cudaSuccess ? KVLM_OK : KVLM_EIO;
}

cu_graph *cu_graph_end(cu_dev *d) {
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(d->stream, &g);
    if (e != cudaSuccess || !g) {
        cu_note(d, e, "graph capture");
        return NULL;
    }
    cu_graph *r = (cu_graph *)calloc(1, sizeof *r);
    e = r ? cudaGraphInstantiate(&r->exec, g, 0) : cudaErrorMemoryAllocation;
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cu_note(d, e, "graph instantiation");
        free(r);
        return NULL;
    }
    return r;
}

void cu_graph_launch(cu_dev *d, cu_graph *g) { cu_note(d, cudaGraphLaunch(g->exec, d->stream), "graph launch"); }

void cu_graph_free(cu_graph *g) {
    if (!g) return;
    cudaGraphExecDestroy(g->exec);
    free(g);
}

/* ---- timing and measurements ---- */

struct cu_timer {
    cudaEvent_t a, b;
};

cu_timer *cu_timer_start(cu_dev *d) {
    cu_timer *t = (cu_timer *)calloc(1, sizeof *t);
    cudaEventCreate(&t->a);
    cudaEventCreate(&t->b);
    cudaEventRecord(t->a, d->stream);
    d->pdl_prev = false;
    return t;
}

double cu_timer_stop(cu_dev *d, cu_timer *t) {
    cudaEventRecord(t->b, d->stream);
    cudaEventSynchronize(t->b);
    float ms = 0;
    cudaEventElapsedTime(&ms, t->a, t->b);
    cudaEventDestroy(t->a);
    cudaEventDestroy(t->b);
    free(t);
    return ms / 1e3;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

__global__ void k_fill_random(__half *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 15;
        x *= 2246822519u;
        x ^= x >> 13;
        p[i] = __float2half((float)(x & 0xffff) / 65536.0f - 0.5f);
    }
}

double cu_measure_copy_bandwidth(cu_dev *d, size_t bytes) {
    uint8_t *a = (uint8_t *)cu_alloc(d, bytes), *b = (uint8_t *)cu_alloc(d, bytes);
    if (!a || !b) {
        cu_free(d, a);
        cu_free(d, b);
        return 0;
    }
    k_fill_random<<<1024, 256, 0, d->stream>>>((__half *)a, bytes / 2, 7);
    std::vector<double> ts;
    for (int i = 0; i < 12; i++) {
        cu_timer *t = cu_timer_start(d);
        cudaMemcpyAsync(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice, d->stream);
        double s = cu_timer_stop(d, t);
        if (i >= 2) ts.push_back(s);
    }
    cu_free(d, a);
    cu_free(d, b);
    return 2.0 * (double)bytes / median(ts);
}

double cu_measure_gemm_flops(cu_dev *d, int m, int n, int k) {
    __half *A = (__half *)cu_alloc(d, (size_t)m * k * 2), *B = (__half *)cu_alloc(d, (size_t)k * n * 2);
    float *C = (float *)cu_alloc(d, (size_t)m * n * 4);
    double r = 0;
    if (A && B && C) {
        k_fill_random<<<1024, 256, 0, d->stream>>>(A, (size_t)m * k, 1);
        k_fill_random<<<1024, 256, 0, d->stream>>>(B, (size_t)k * n, 2);
        float one = 1, zero = 0;
        std::vector<double> ts;
        for (int i = 0; i < 12; i++) {
            cu_timer *t = cu_timer_start(d);
            cublasGemmEx(d->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, A, CUDA_R_16F, k, B, CUDA_R_16F, k, &zero, C,
                         CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            double s = cu_timer_stop(d, t);
            if (i >= 2) ts.push_back(s);
        }
        r = 2.0 * m * n * (double)k / median(ts);
    }
    cu_free(d, A);
    cu_free(d, B);
    cu_free(d, C);
    return r;
}
