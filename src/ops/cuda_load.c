/* ops/cuda_load: the CUDA backend (ops/cuda/cuda.h) loaded when it is first
 * asked for. Its kernels, with the CUDA runtime and cuBLAS they link, live in
 * a module of their own, libkvlm-cuda.so: linked into every program, cuBLAS
 * alone cost 0.4 s at each start (kvlm --help included) on a machine with
 * CUDA and no GPU. Here each cu_* call goes to the module's; cu_device_count
 * and cu_open load it (they answer "none" and an error naming the module
 * when it cannot be), and every other call comes after a cu_open that did.
 * Where it is looked for: $KVLM_CUDA_MODULE; beside the program or the
 * libkvlm.so this code is in (a build folder), and in ../lib from there; the
 * library folder it was installed to; the loader's own search path. */
#ifdef KVLM_HAVE_CUDA
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ops/cuda/cuda.h"
#include "dtype/dtype.h"
#include "util/error.h"

#define CU_MODULE "libkvlm-cuda.so"

/* Every call of cuda.h: return type, name (after cu_), parameters, arguments;
 * L: the two that load the module (written out below), V: those that return nothing. */
#define CU_CALLS(L, R, V)                                                                                            \
    L(int, device_count, (void), ())                                                                                 \
    L(cu_dev *, open, (int device, kvlm_error *err), (device, err))                                                  \
    V(close, (cu_dev * d), (d))                                                                                      \
    V(describe, (cu_dev * d, char *buf, size_t cap), (d, buf, cap))                                                  \
    R(size_t, mem_free, (cu_dev * d), (d))                                                                           \
    R(void *, alloc, (cu_dev * d, size_t bytes), (d, bytes))                                                         \
    V(free, (cu_dev * d, void *p), (d, p))                                                                           \
    R(int, h2d, (cu_dev * d, void *dst, const void *src, size_t n), (d, dst, src, n))                                \
    R(int, d2h, (cu_dev * d, void *dst, const void *src, size_t n), (d, dst, src, n))                                \
    V(d2d, (cu_dev * d, void *dst, const void *src, size_t n), (d, dst, src, n))                                     \
    R(int, h2d_async, (cu_dev * d, void *dst, const void *src, size_t n), (d, dst, src, n))                          \
    R(int, tier_write, (cu_dev * d, void *dst, const void *src, size_t n), (d, dst, src, n))                         \
    R(int, tier_read, (cu_dev * d, void *dst, const void *src, size_t n), (d, dst, src, n))                          \
    V(tier_join, (cu_dev * d), (d))                                                                                  \
    R(int, sync, (cu_dev * d, kvlm_error *err), (d, err))                                                            \
    R(int, weight_upload,                                                                                            \
      (cu_dev * d, cu_weight *w, const void *host, int type, int64_t n_in, int64_t n_out, kvlm_error *err),          \
      (d, w, host, type, n_in, n_out, err))                                                                          \
    V(weight_free, (cu_dev * d, cu_weight *w), (d, w))                                                               \
    R(size_t, weight_bytes, (int type, int64_t n_in, int64_t n_out), (type, n_in, n_out))                            \
    V(embed, (cu_dev * d, float *x, const cu_weight *emb, const int32_t *tokens, int T), (d, x, emb, tokens, T))     \
    V(rmsnorm,                                                                                                       \
      (cu_dev * d, float *out, float *x, const float *add, const float *w, const int32_t *rows, int n, int dim,      \
       float eps, const cu_weight *next),                                                                            \
      (d, out, x, add, w, rows, n, dim, eps, next))                                                                  \
    V(matmul, (cu_dev * d, float *y, const float *x, const cu_weight *w, int T), (d, y, x, w, T))                    \
    V(matmul_n, (cu_dev * d, float *const *ys, const float *x, const cu_weight *const *ws, int n, int T),            \
      (d, ys, x, ws, n, T))                                                                                          \
    R(int, matmul_gemm_min_rows, (cu_dev * d), (d))                                                                  \
    V(set_matmul_gemm_min_rows, (cu_dev * d, int t), (d, t))                                                         \
    V(swiglu, (cu_dev * d, float *gate, const float *up, int T, int n, const cu_weight *next),                       \
      (d, gate, up, T, n, next))                                                                                     \
    V(qkv_rope_store,                                                                                                \
      (cu_dev * d, float *q, float *k, float *v, const float *bq, const float *bk, const float *bv, int n_heads,      \
       int rope_dim, float rope_base, bool neox, const cu_kv *kv, int layer, const cu_kv_batch *b),                  \
      (d, q, k, v, bq, bk, bv, n_heads, rope_dim, rope_base, neox, kv, layer, b))                                    \
    R(size_t, attention_work_bytes, (int max_T, int n_heads, int n_kv_heads, int head_dim),                          \
      (max_T, n_heads, n_kv_heads, head_dim))                                                                        \
    V(attention,                                                                                                     \
      (cu_dev * d, float *out, const float *q, const cu_kv *kv, int layer, const cu_kv_batch *b, int n_heads,        \
       float scale, void *work),                                                                                     \
      (d, out, q, kv, layer, b, n_heads, scale, work))                                                               \
    V(set_attention_mma, (cu_dev * d, bool on), (d, on))                                                             \
    R(int, graph_begin, (cu_dev * d), (d))                                                                           \
    R(cu_graph *, graph_end, (cu_dev * d), (d))                                                                      \
    V(graph_launch, (cu_dev * d, cu_graph *g), (d, g))                                                               \
    V(graph_free, (cu_graph * g), (g))                                                                               \
    R(double, measure_copy_bandwidth, (cu_dev * d, size_t bytes), (d, bytes))                                        \
    R(double, measure_gemm_flops, (cu_dev * d, int m, int n, int k), (d, m, n, k))                                   \
    R(cu_timer *, timer_start, (cu_dev * d), (d))                                                                    \
    R(double, timer_stop, (cu_dev * d, cu_timer *t), (d, t))

#define PTR_R(ret, name, params, args) static ret(*p_##name) params;
#define PTR_V(name, params, args) static void(*p_##name) params;
CU_CALLS(PTR_R, PTR_R, PTR_V)

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static bool g_loaded;
static char g_why[768];

/* The module's one call into libkvlm: the host functions it uses, given at load. */
typedef void (*cu_module_init_fn)(size_t (*row_size)(int, int64_t), void (*dequantize_row)(int, const void *, float *,
                                                                                            int64_t));

static void *try_open(const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        size_t n = strlen(g_why);
        snprintf(g_why + n, sizeof g_why - n, "%s%s", n ? "; " : "", e ? e : path);
    }
    return h;
}

static void *find_module(void) {
    const char *env = getenv("KVLM_CUDA_MODULE");
    if (env && *env) return try_open(env);
    char path[PATH_MAX + 64];
    Dl_info info;
    if (dladdr((void *)&find_module, &info) && info.dli_fname && strchr(info.dli_fname, '/')) {
        const char *slash = strrchr(info.dli_fname, '/');
        int dir = (int)(slash - info.dli_fname);
        snprintf(path, sizeof path, "%.*s/" CU_MODULE, dir, info.dli_fname);
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
        snprintf(path, sizeof path, "%.*s/../lib/" CU_MODULE, dir, info.dli_fname);
        if ((h = dlopen(path, RTLD_NOW | RTLD_LOCAL))) return h;
    }
#ifdef KVLM_CUDA_MODULE_DIR
    snprintf(path, sizeof path, "%s/" CU_MODULE, KVLM_CUDA_MODULE_DIR);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
#endif
    return try_open(CU_MODULE);
}

static void load(void) {
    void *h = find_module();
    if (!h) return;
    bool ok = true;
#define SYM_R(ret, name, params, args)                                                                               \
    if (!(*(void **)&p_##name = dlsym(h, "cu_" #name))) ok = false;
#define SYM_V(name, params, args) SYM_R(void, name, params, args)
    CU_CALLS(SYM_R, SYM_R, SYM_V)
    cu_module_init_fn init;
    *(void **)&init = dlsym(h, "cu_module_init");
    if (!ok || !init) {
        snprintf(g_why, sizeof g_why, CU_MODULE " lacks a call of ops/cuda/cuda.h (a module of another kvlm version?)");
        dlclose(h);
        return;
    }
    init(dt_row_size, dt_dequantize_row);
    g_loaded = true; /* kept loaded for the process's life */
}

static bool loaded(void) {
    pthread_once(&g_once, load);
    return g_loaded;
}

const char *cu_unavailable(void) { return loaded() ? NULL : g_why; }

int cu_device_count(void) { return loaded() ? p_device_count() : 0; }

cu_dev *cu_open(int device, kvlm_error *err) {
    if (!loaded()) {
        util_err_set(err, KVLM_EUNSUPPORTED, "the CUDA backend (" CU_MODULE ") could not be loaded: %s", g_why);
        return NULL;
    }
    return p_open(device, err);
}

/* The rest: only ever called on a device cu_open gave, so the module is there. */
#define FWD_R(ret, name, params, args) ret cu_##name params { return p_##name args; }
#define FWD_V(name, params, args) void cu_##name params { p_##name args; }
#define NONE(ret, name, params, args)
CU_CALLS(NONE, FWD_R, FWD_V)
#else
typedef int kvlm_no_cuda_backend; /* (an empty unit is not C) */
#endif
