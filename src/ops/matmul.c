/* ops/matmul: matmul entry points: picks the tile kernel for the weight type
 * and CPU, prepares (the caller's per-row work) and quantizes the activations,
 * hands row chunks to the threads; also the double-precision reference and the
 * memory read-bandwidth probe. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "dtype/dtype.h"
#include "ops/type_traits.h"
#include "util/mem.h"
#include "util/timing.h"

int op_matmul_act_kind(int wtype) {
    const op_type_traits *t = op_type_traits_of(wtype);
    return t ? t->act : -1;
}

op_mm_tile_fn op_mm_tile(int wtype) { return op_mm_tile_at(wtype, op_simd_level()); }

static size_t act_row_size(int kind, int n_in) {
    const op_act_traits *a = op_act_traits_of(kind);
    return a && a->row_size ? a->row_size(n_in) : 0;
}

size_t op_matmul_work_size(int wtype, int T, int n_in) {
    int kind = op_matmul_act_kind(wtype);
    if (kind <= 0 || T <= 0 || n_in <= 0) return 0;
    return (size_t)T * act_row_size(kind, n_in) + 64; /* + room to align */
}

/* ---- activation preparation and quantization job ------------------------- */
typedef struct {
    const float *X;
    uint8_t *xq;  /* NULL: only prep */
    size_t xs;
    int T, n_in;
    op_quantize_fn quant; /* the activation format's quantizer at this level */
    op_mm_prep_fn prep;
    void *user;
} quant_job;

static void quant_worker(void *p, int ith, int nth) {
    quant_job *j = p;
    long lo, hi;
    util_split(j->T, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++) {
        if (j->prep) j->prep(j->user, (int)t);
        const float *x = j->X + (size_t)t * j->n_in;
        if (!j->xq) continue;
        j->quant(x, j->xq + (size_t)t * j->xs, j->n_in);
    }
}

/* ---- the matmul job ------------------------------------------------------------
 * Rows are cut into chunks; each thread owns a contiguous home range of chunks
 * and takes them from its front, so its reads form one stream (which the
 * kernels' prefetch of the next rows follows). A thread that finishes early
 * steals chunks from the back of the others' ranges, so a thread that was
 * descheduled does not hold up the call. Which thread computes a chunk never
 * changes its result. */
#define MM_MAX_RANGES 64
typedef struct {
    _Atomic uint64_t fb; /* front (low 32 bits) and back (high 32 bits) */
    char pad[64 - sizeof(uint64_t)];
} mm_range;

/* One matrix of a job; its chunks are numbered from `first` on. */
typedef struct {
    op_mm_tile_fn fn;
    const uint8_t *W;
    size_t ws;
    float *Y;
    int n_out, chunk_rows, first;
} mm_mat;

typedef struct {
    mm_mat mats[OP_MM_MAX_OUTS];
    int n_mats;
    const uint8_t *X;
    size_t xs;
    int T, n_in, tb, n_ranges;
    mm_range *ranges;
} mm_job;

static int take_chunk(mm_range *r, int from_back) {
    uint64_t v = atomic_load_explicit(&r->fb, memory_order_relaxed);
    for (;;) {
        uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        if (f >= b) return -1;
        uint64_t nv = from_back ? ((uint64_t)(b - 1) << 32 | f) : v + 1;
        if (atomic_compare_exchange_weak_explicit(&r->fb, &v, nv, memory_order_relaxed, memory_order_relaxed))
            return (int)(from_back ? b - 1 : f);
    }
}

static void mm_chunk(const mm_job *j, int ci) {
    int m = j->n_mats - 1;
    while (ci < j->mats[m].first) m--;
    const mm_mat *M = &j->mats[m];
    int r0 = (ci - M->first) * M->chunk_rows;
    int nr = M->n_out - r0 < M->chunk_rows ? M->n_out - r0 : M->chunk_rows;
    /* the chunk's rows stay in cache while every token block passes */
    for (int t0 = 0; t0 < j->T; t0 += j->tb) {
        int nt = j->T - t0 < j->tb ? j->T - t0 : j->tb;
        M->fn(j->n_in, M->W + (size_t)r0 * M->ws, M->ws, j->X + (size_t)t0 * j->xs, j->xs,
              M->Y + (size_t)t0 * M->n_out + r0, (size_t)M->n_out, nr, nt);
    }
}

static void mm_worker(void *p, int ith, int nth) {
    (void)nth;
    mm_job *j = p;
    int home = ith % j->n_ranges, ci;
    while ((ci = take_chunk(&j->ranges[home], 0)) >= 0) mm_chunk(j, ci);
    for (int k = 1; k < j->n_ranges; k++) {
        mm_range *r = &j->ranges[(home + k) % j->n_ranges];
        while ((ci = take_chunk(r, 1)) >= 0) mm_chunk(j, ci);
    }
}

void op_matmul_prep(util_pool *pool, const float *X, int T, int n_in, const op_mm_out *outs, int n, void *work,
                    op_mm_prep_fn prep, void *user) {
    if (T <= 0 || n_in <= 0 || n < 0 || n > OP_MM_MAX_OUTS) return;
    int kind = n ? op_matmul_act_kind(outs[0].wtype) : -1;
    for (int i = 1; i < n; i++)
        if (op_matmul_act_kind(outs[i].wtype) != kind) { /* activations quantized differently: one by one */
            for (int k = 0; k < n; k++) op_matmul_prep(pool, X, T, n_in, &outs[k], 1, work, k ? NULL : prep, user);
            return;
        }
    int nth = util_pool_size(pool);
    mm_job j;
    j.n_mats = 0;
    /* Decode streams the weights once: chunks of ~32 KiB keep the hand-out
     * cheap and the threads balanced. Prefill reuses each chunk for all tokens,
     * so it is sized to sit in L2 (~128 KiB) next to a block of activations. */
    const size_t target = T == 1 ? (32u << 10) : (128u << 10);
    int n_chunks = 0;
    for (int i = 0; kind >= 0 && i < n; i++) {
        const op_mm_out *o = &outs[i];
        mm_mat *M = &j.mats[j.n_mats];
        M->fn = op_mm_tile(o->wtype);
        M->ws = op_pack_row_size(o->wtype, n_in); /* 0 if n_in is not whole blocks */
        if (o->n_out <= 0 || !M->fn || M->ws == 0) continue; /* unsupported: Y untouched */
        M->W = o->W;
        M->Y = o->Y;
        M->n_out = o->n_out;
        long cr = (long)(target / M->ws);
        long min_chunks = 4L * nth;
        if ((long)o->n_out / min_chunks < cr) cr = (long)o->n_out / min_chunks;
        /* a multiple of the largest register tile (a packed group) */
        const long tile_rows = op_type_traits_of(o->wtype)->tile_rows;
        cr = cr < tile_rows ? tile_rows : (cr + tile_rows - 1) / tile_rows * tile_rows;
        M->chunk_rows = (int)cr;
        M->first = n_chunks;
        n_chunks += (int)((o->n_out + cr - 1) / cr);
        j.n_mats++;
    }
    /* the rows prepared (always: prep's work is the caller's), then quantized
     * once for every matrix, in one pass */
    quant_job qj = {X, NULL, 0, T, n_in, NULL, prep, user};
    if (kind > 0 && j.n_mats) {
        qj.quant = op_act_quantizer(kind, op_simd_level());
        qj.xq = (uint8_t *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
        qj.xs = act_row_size(kind, n_in);
    }
    if (qj.xq || prep) { /* rows worth a pass: 2 per thread to quantize, 4 in all with prep's heavier work */
        if (T >= (prep ? OP_MM_PREP_MIN_T : 2 * nth) && nth > 1) util_pool_run(pool, quant_worker, &qj);
        else quant_worker(&qj, 0, 1);
    }
    if (!j.n_mats) return;
    j.X = qj.xq ? qj.xq : (const uint8_t *)X;
    j.xs = qj.xq ? qj.xs : (size_t)n_in * sizeof(float);
    j.T = T;
    j.n_in = n_in;
    j.tb = 64;
    mm_range ranges[MM_MAX_RANGES];
    j.n_ranges = nth < MM_MAX_RANGES ? nth : MM_MAX_RANGES;
    j.ranges = ranges;
    for (int i = 0; i < j.n_ranges; i++) {
        long lo, hi;
        util_split(n_chunks, i, j.n_ranges, &lo, &hi);
        atomic_init(&ranges[i].fb, (uint64_t)hi << 32 | (uint64_t)lo);
    }
    util_pool_run(pool, mm_worker, &j);
}

void op_matmul_n(util_pool *pool, const float *X, int T, int n_in, const op_mm_out *outs, int n, void *work) {
    op_matmul_prep(pool, X, T, n_in, outs, n, work, NULL, NULL);
}

void op_matmul(util_pool *pool, float *Y, const float *X, const void *W, int wtype, int T, int n_in,
               int n_out, void *work) {
    op_mm_out o = {Y, W, wtype, n_out};
    op_matmul_n(pool, X, T, n_in, &o, 1, work);
}

void op_matmul_ref(float *Y, const float *X, const void *W, int wtype, int T, int n_in, int n_out) {
    float *row = malloc((size_t)n_in * sizeof(float));
    if (!row) return;
    size_t rs = dt_row_size(wtype, n_in);
    for (int o = 0; o < n_out; o++) {
        dt_dequantize_row(wtype, (const uint8_t *)W + (size_t)o * rs, row, n_in);
        for (int t = 0; t < T; t++) {
            const float *x = X + (size_t)t * n_in;
            double s = 0;
            for (int i = 0; i < n_in; i++) s += (double)row[i] * (double)x[i];
            Y[(size_t)t * n_out + o] = (float)s;
        }
    }
    free(row);
}

/* ---- read bandwidth ----------------------------------------------------------- */
typedef struct {
    float *buf;
    size_t n;
    int fill, prefetch;
    double sums[64];
} bw_job;

static void bw_worker(void *p, int ith, int nth) {
    bw_job *j = p;
    long lo, hi;
    /* split in 32-float units so every slice stays 32-byte aligned */
    util_split((long)(j->n / 32), ith, nth, &lo, &hi);
    float *s = j->buf + lo * 32;
    size_t cnt = (size_t)(hi - lo) * 32;
    if (j->fill) {
        for (size_t i = 0; i < cnt; i++) s[i] = (float)(i & 7);
        return;
    }
    double r;
    if (op_simd_level() >= OP_SIMD_AVX2) r = op_read_sum_avx2(s, cnt, j->prefetch);
    else {
        float a[8] = {0};
        for (size_t i = 0; i < cnt; i += 8)
            for (int k = 0; k < 8; k++) a[k] += s[i + k];
        r = a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
    }
    j->sums[ith & 63] += r;
}

double op_measure_read_bandwidth(util_pool *pool, size_t bytes) {
    size_t n = bytes / sizeof(float) / 256 * 256;
    if (n == 0) return 0;
    bw_job j;
    memset(&j, 0, sizeof j);
    /* on huge pages, as the weights and the KV pool are (util/mem): a
     * 4 KiB-page buffer reads slower than the huge-page data it bounds,
     * which would flatter every share of this bound */
    j.buf = util_big_alloc(n * sizeof(float), false);
    if (!j.buf) return 0;
    j.n = n;
    j.fill = 1;
    util_pool_run(pool, bw_worker, &j); /* each thread first-touches its slice */
    j.fill = 0;
    double best = 1e30;
    /* plain loads and loads with software prefetch: the machine's bandwidth
     * is the better of the two */
    for (int rep = 0; rep < 10; rep++) {
        j.prefetch = rep & 1;
        double t0 = util_now_s();
        util_pool_run(pool, bw_worker, &j);
        double dt = util_now_s() - t0;
        if (dt < best) best = dt;
    }
    /* keep the sums alive so the reads are not optimised away */
    volatile double sink = 0;
    for (int i = 0; i < 64; i++) sink += j.sums[i];
    (void)sink;
    util_big_free(j.buf, n * sizeof(float));
    return (double)(n * sizeof(float)) / best;
}
