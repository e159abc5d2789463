/* bench/bench_attn: the decode attention kernels alone on stories110M-shaped
 * paged caches (12 layers x 12 heads, head_dim 64, 16-token blocks laid out as
 * kv/paged lays them out), per cache type (f32, f16, q8_0 by default), the
 * AVX2 kernels against the best level's in the same run:
 *   - one token at a long context, beside the bound that reading the cache
 *     once at the machine's read bandwidth puts on it (a streaming read
 *     before each round; the median of the rounds' shares); before each step a
 *     384 MB read pushes the cache out of the last-level cache, as a decode
 *     step's weights do; and beside the same cache read in the kernels'
 *     order with no arithmetic (what the layout's scattered blocks allow);
 *   - a batched decode step of 16 sequences at 20..90 tokens (the server's
 *     16-stream shape) through op_attention_n, caches in the LLC;
 *   - prefill: 64 query tokens over a 512-token cache. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "ops/kvtype.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"
#include "util/mem.h"
#include "util/pool.h"
#include "util/timing.h"

enum { LAYERS = 12, HEADS = 12, HD = 64, MAX_SEQ = 16, MAX_T = 64 };
static int BS = 16; /* tokens per cache block */

typedef struct {
    uint8_t *data;
    const float **ptrs; /* LAYERS x n_blocks */
    size_t head_bytes, k_bytes, bytes;
    int n_blocks, k_type, v_type;
} cache;

static uint64_t rng = 88172645463325252ull;
static float frand(void) { /* xorshift, uniform in [-1, 1) */
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((rng >> 40) * (2.0 / 16777216.0) - 1.0);
}

/* blocks of every layer and head, as kv/paged lays them: per block, per
 * layer, per head, the K region then the V region */
static cache make_cache(int n, int k_type, int v_type) {
    cache c = {0};
    c.k_type = k_type;
    c.v_type = v_type;
    c.k_bytes = op_kv_region_bytes(k_type, HD, BS);
    c.head_bytes = c.k_bytes + op_kv_region_bytes(v_type, HD, BS);
    c.n_blocks = (n + BS - 1) / BS;
    size_t block_bytes = (size_t)LAYERS * HEADS * c.head_bytes;
    c.bytes = (size_t)c.n_blocks * block_bytes;
    c.data = util_big_alloc(c.bytes, true); /* as kv/paged's pool: on huge pages, faulted in */
    c.ptrs = malloc(sizeof(float *) * LAYERS * c.n_blocks);
    if (!c.data || !c.ptrs) { fprintf(stderr, "out of memory\n"); exit(1); }
    float x[HD];
    size_t krb = op_kv_row_bytes(k_type, HD), vrb = op_kv_row_bytes(v_type, HD);
    for (int b = 0; b < c.n_blocks; b++)
        for (int l = 0; l < LAYERS; l++) {
            uint8_t *blk = c.data + (size_t)b * block_bytes + (size_t)l * HEADS * c.head_bytes;
            c.ptrs[l * c.n_blocks + b] = (const float *)blk;
            for (int h = 0; h < HEADS; h++)
                for (int s = 0; s < BS; s++) {
                    for (int i = 0; i < HD; i++) x[i] = frand();
                    op_kv_quantize_row(k_type, x, blk + h * c.head_bytes + s * krb, HD);
                    for (int i = 0; i < HD; i++) x[i] = frand();
                    op_kv_quantize_row(v_type, x, blk + h * c.head_bytes + c.k_bytes + s * vrb, HD);
                }
        }
    return c;
}

static float *evict_buf;
static size_t evict_floats = (size_t)96 << 20;
static volatile double evict_sink;

static int T_Q = 1; /* query tokens per sequence */

static op_attn_args args_of(const cache *c, int l, int n) {
    op_attn_args a = {0};
    a.T = T_Q;
    a.q_pos0 = n - T_Q;
    a.n_heads = a.n_kv_heads = HEADS;
    a.head_dim = HD;
    a.blocks = c->ptrs + (size_t)l * c->n_blocks;
    a.block_size = BS;
    a.k_type = c->k_type;
    a.v_type = c->v_type;
    a.head_bytes = c->head_bytes;
    a.v_bytes = c->k_bytes;
    a.stage_block = -1;
    a.scale = 1.0f / sqrtf((float)HD);
    return a;
}

/* seconds for one token's attention in every layer, for each of n_seq
 * sequences (contexts n[i], caches c[i]) in one op_attention_n call per
 * layer, as a batched decode step makes it; evict: push the caches out of
 * the LLC first */
static double step(util_pool *pool, const cache *c, const int *n, int n_seq, const float *q, float **out,
                   void *work, bool evict) {
    if (evict) evict_sink += op_read_sum_avx2(evict_buf, evict_floats, 1);
    op_attn_args a[MAX_SEQ];
    const float *qs[MAX_SEQ];
    double t0 = util_now_s();
    for (int l = 0; l < LAYERS; l++) {
        for (int i = 0; i < n_seq; i++) {
            a[i] = args_of(&c[i], l, n[i]);
            qs[i] = q + ((size_t)l * MAX_SEQ + i) * MAX_T * HEADS * HD;
        }
        op_attention_n(pool, n_seq, out, qs, a, work);
    }
    return util_now_s() - t0;
}

/* The long line's ceiling without the kernels' arithmetic: the same cache
 * read in their order (per layer, the KV heads shared among the threads;
 * per head, its K and V region block after block, the next block's asked
 * into L2 while this one is summed and the first lines of the block two
 * tiles ahead, as the kernels prefetch), pushed out of
 * the LLC first. Best seconds of `rounds` x 4 steps. */
typedef struct {
    const cache *c;
    int l;
    double sum[64];
} walk_job;

static void walk_worker(void *ctx, int ith, int nth) {
    walk_job *j = ctx;
    const cache *c = j->c;
    double s = 0;
    const int kick = 2 * 64 / BS;
    for (int h = ith; h < HEADS; h += nth)
        for (int b = 0; b < c->n_blocks; b++) {
            const uint8_t *r = (const uint8_t *)c->ptrs[(size_t)j->l * c->n_blocks + b] + (size_t)h * c->head_bytes;
            if (b + 1 < c->n_blocks) {
                const uint8_t *nx = (const uint8_t *)c->ptrs[(size_t)j->l * c->n_blocks + b + 1] +
                                    (size_t)h * c->head_bytes;
                for (size_t i = 0; i < c->head_bytes; i += 64) __builtin_prefetch(nx + i, 0, 2);
            }
            if (b + kick < c->n_blocks) { /* the kernels' start of the hardware's streams, 2 tiles ahead */
                uintptr_t s = (uintptr_t)c->ptrs[(size_t)j->l * c->n_blocks + b + kick] + (size_t)h * c->head_bytes;
                for (uintptr_t pg = s & ~(uintptr_t)63; pg < s + c->head_bytes; pg = (pg & ~(uintptr_t)4095) + 4096)
                    for (int x = 0; x < 2; x++) __builtin_prefetch((const void *)(pg + 64 * x), 0, 2);
            }
            s += op_read_sum_avx2((const float *)r, c->head_bytes / sizeof(float), 0);
        }
    j->sum[ith & 63] += s;
}

static double walk(util_pool *pool, const cache *c, int rounds) {
    walk_job j = {.c = c};
    double best = 1e9;
    for (int r = 0; r < rounds * 4; r++) {
        evict_sink += op_read_sum_avx2(evict_buf, evict_floats, 1);
        double t0 = util_now_s();
        for (j.l = 0; j.l < LAYERS; j.l++) util_pool_run(pool, walk_worker, &j);
        double dt = util_now_s() - t0;
        if (dt < best) best = dt;
    }
    for (int i = 0; i < 64; i++) evict_sink += j.sum[i];
    return best;
}

/* best seconds of the AVX2 path (t[0]) and the best level (t[1]), which
 * alternate, 4 steps each per round */
static void race(util_pool *pool, const cache *c, const int *n, int n_seq, const float *q, float **out, void *work,
                 bool evict, int rounds, double *t) {
    const int levels[2] = {OP_SIMD_AVX2, op_cpu_simd_level()};
    t[0] = t[1] = 1e9;
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < 2; v++) {
            op_set_simd_level(levels[v]);
            step(pool, c, n, n_seq, q, out, work, evict); /* warm */
            for (int i = 0; i < 4; i++) {
                double s = step(pool, c, n, n_seq, q, out, work, evict);
                if (s < t[v]) t[v] = s;
            }
        }
    op_set_simd_level(-1);
}

/* the median of x[0..n-1] (sorts x) */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

/* bench_attn [threads] [context] [rounds] [cache types] [block size] */
int main(int argc, char **argv) {
    int threads = argc > 1 && atoi(argv[1]) > 0 ? atoi(argv[1]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    int n = argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 4096;
    int rounds = argc > 3 && atoi(argv[3]) > 0 ? atoi(argv[3]) : 10;
    char types[256];
    snprintf(types, sizeof types, "%s", argc > 4 ? argv[4] : "f32,f16,q8_0");
    if (argc > 5 && atoi(argv[5]) > 0) BS = atoi(argv[5]);
    if (op_cpu_simd_level() < OP_SIMD_AVX2) { fprintf(stderr, "bench_attn: no AVX2 on this CPU\n"); return 0; }
    /* KVLM_BENCH_ATTN_LONG=1: the long-context line alone (for perf) */
    const bool long_only = getenv("KVLM_BENCH_ATTN_LONG") && atoi(getenv("KVLM_BENCH_ATTN_LONG"));
    const char *names[3] = {"scalar", "avx2", "vnni"}, *best = names[op_cpu_simd_level()];
    util_pool *pool = util_pool_create(threads);
    float *q = malloc(sizeof(float) * LAYERS * MAX_SEQ * MAX_T * HEADS * HD), *outs[MAX_SEQ];
    void *work = malloc(op_attention_work_size(threads, HD));
    evict_buf = aligned_alloc(64, evict_floats * sizeof(float));
    if (!q || !work || !evict_buf) return 1;
    for (int i = 0; i < MAX_SEQ; i++)
        if (!(outs[i] = malloc(sizeof(float) * MAX_T * HEADS * HD))) return 1;
    for (size_t i = 0; i < evict_floats; i++) evict_buf[i] = (float)(i & 7);
    for (int i = 0; i < LAYERS * MAX_SEQ * MAX_T * HEADS * HD; i++) q[i] = 3 * frand();
    double llc = op_measure_read_bandwidth(pool, (size_t)64 << 20); /* a buffer the LLC holds */
    printf("bench_attn: decode attention (12 layers x 12 heads, head_dim 64, %d-token blocks, %d threads, best of "
           "%d rounds), the AVX2 kernels against the %s ones in the same run\n", BS, threads, rounds, best);
    printf("  one token over %d keys, cache pushed out of the LLC (read bound: a streaming read of 256 MB before each "
           "round):\n", n);
    /* the serve-shaped step: 16 sequences at 20..90 tokens (stories110M at
     * 16 streams), their caches (f32: 62 MB) next to the weights in the LLC */
    int ns[MAX_SEQ], tot = 0;
    for (int i = 0; i < MAX_SEQ; i++) tot += ns[i] = 20 + i * 70 / (MAX_SEQ - 1);
    char line2[2048] = "", line3[2048] = "";
    size_t l2 = 0, l3 = 0;
    for (char *tok = strtok(types, ","); tok; tok = strtok(NULL, ",")) {
        int type = kvlm_cache_type_from_name(tok);
        if (type < 0 || !op_kv_type_valid(type, true)) {
            fprintf(stderr, "bench_attn: cache types are f32, f16, bf16, q8_0 or q4_0 (keys and values): %s\n", tok);
            return 1;
        }
        double t[2], rb = (double)op_kv_row_bytes(type, HD) * 2;
        cache c = make_cache(n, type, type);
        /* round by round, back to back: the streaming read that bounds the
         * line, the kernels, and the layout's own read. This VM's streaming
         * bandwidth drifts between 28 and 63 GB/s within a minute while the
         * scattered reads stay near 30, so a bound taken once says more
         * about the moment than about the kernels: each round's shares are
         * against its own bound, and the line gives their median. */
        bool walkable = c.head_bytes % 32 == 0; /* op_read_sum_avx2's aligned loads */
        double bytes = (double)LAYERS * HEADS * n * rb, wb = (double)LAYERS * HEADS * c.n_blocks * c.head_bytes;
        double sk[64], sw[64], bws[64], tw = 1e9;
        int nr = rounds < 64 ? rounds : 64;
        t[0] = t[1] = 1e9;
        for (int r = 0; r < nr; r++) {
            double tr[2];
            bws[r] = op_measure_read_bandwidth(pool, (size_t)256 << 20);
            race(pool, &c, &n, 1, q, outs, work, true, 1, tr);
            for (int v = 0; v < 2; v++) t[v] = tr[v] < t[v] ? tr[v] : t[v];
            sk[r] = bytes / tr[1] / bws[r];
            if (walkable) {
                double w = walk(pool, &c, 1);
                tw = w < tw ? w : tw;
                sw[r] = wb / w / bws[r];
            }
        }
        printf("    %-5s avx2 %7.3f ms  %s %7.3f ms  %5.2fx   %s: %5.1f GB/s, %5.1f%% of the bound (median of %d "
               "rounds; bound %.1f GB/s)\n", tok, 1e3 * t[0], best, 1e3 * t[1], t[0] / t[1], best,
               bytes / t[1] / 1e9, 100 * median(sk, nr), nr, median(bws, nr) / 1e9);
        if (walkable)
            printf("          the same cache read in the kernels' order, no arithmetic: %7.3f ms, %5.1f GB/s, %5.1f%% "
                   "of the bound; the kernels reach %.0f%% of it\n",
                   1e3 * tw, wb / tw / 1e9, 100 * median(sw, nr), 100 * (bytes / t[1]) / (wb / tw));
        util_big_free(c.data, c.bytes);
        free(c.ptrs);
        if (long_only) continue;
        cache cs[MAX_SEQ];
        for (int i = 0; i < MAX_SEQ; i++) cs[i] = make_cache(ns[i], type, type);
        race(pool, cs, ns, MAX_SEQ, q, outs, work, false, rounds, t);
        bytes = (double)LAYERS * HEADS * tot * rb;
        l2 += (size_t)snprintf(line2 + l2, sizeof line2 - l2,
                               "    %-5s avx2 %7.3f ms  %s %7.3f ms  %5.2fx   %s: %5.1f MB at %5.1f GB/s, %5.1f%% of "
                               "the bound\n", tok, 1e3 * t[0], best, 1e3 * t[1], t[0] / t[1], best, bytes / 1e6,
                               bytes / t[1] / 1e9, 100 * bytes / llc / t[1]);
        for (int i = 0; i < MAX_SEQ; i++) { util_big_free(cs[i].data, cs[i].bytes); free(cs[i].ptrs); }
        /* prefill: the last 64 of 512 tokens in one call per layer */
        int np = 512;
        cache cp = make_cache(np, type, type);
        T_Q = MAX_T;
        race(pool, &cp, &np, 1, q, outs, work, false, rounds, t);
        T_Q = 1;
        l3 += (size_t)snprintf(line3 + l3, sizeof line3 - l3, "    %-5s avx2 %7.3f ms  %s %7.3f ms  %5.2fx\n", tok,
                               1e3 * t[0], best, 1e3 * t[1], t[0] / t[1]);
        util_big_free(cp.data, cp.bytes);
        free(cp.ptrs);
    }
    if (long_only) goto done;
    printf("  a batched decode step of %d sequences at 20..90 tokens (op_attention_n), cache in the LLC (read bound "
           "%.1f GB/s):\n%s", MAX_SEQ, llc / 1e9, line2);
    printf("  prefill: %d query tokens at positions %d..511 of one sequence (op_attention), cache in the LLC:\n%s",
           MAX_T, 512 - MAX_T, line3);
done:
    free(q); free(work); free(evict_buf);
    for (int i = 0; i < MAX_SEQ; i++) free(outs[i]);
    util_pool_free(pool);
    return 0;
}
