/* bench/bench_attn: the decode attention kernel alone at long context on a
 * stories110M-shaped paged cache (12 layers x 12 heads, head_dim 64, 16-token
 * blocks laid out as kv/paged lays them out), the best SIMD path against the
 * AVX2 one in the same run, beside the bound that reading the cache once at
 * the machine's read bandwidth puts on it. Before each step a 384 MB read
 * pushes the cache out of the last-level cache, as a decode step's weights do
 * (an 80 MB cache would otherwise partly stay in a large L3). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "ops/kvtype.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"
#include "util/pool.h"
#include "util/timing.h"

enum { LAYERS = 12, HEADS = 12, HD = 64 };
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
    c.data = aligned_alloc(64, (c.bytes + 63) & ~(size_t)63);
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

/* seconds for one token's attention over n keys in every layer */
static double step(util_pool *pool, const cache *c, int n, const float *q, float *out, void *work) {
    if (evict_buf) evict_sink += op_read_sum_avx2(evict_buf, evict_floats, 1);
    double t0 = util_now_s();
    for (int l = 0; l < LAYERS; l++) {
        op_attn_args a = {0};
        a.T = 1;
        a.q_pos0 = n - 1;
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
        op_attention(pool, out, q + (size_t)l * HEADS * HD, &a, work);
    }
    return util_now_s() - t0;
}

/* bench_attn [threads] [context] [rounds] [cache type] [block size] */
int main(int argc, char **argv) {
    int threads = argc > 1 && atoi(argv[1]) > 0 ? atoi(argv[1]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    int n = argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 4096;
    int rounds = argc > 3 && atoi(argv[3]) > 0 ? atoi(argv[3]) : 10;
    int type = kvlm_cache_type_from_name(argc > 4 ? argv[4] : "q8_0");
    if (type < 0 || !op_kv_type_valid(type, true)) {
        fprintf(stderr, "bench_attn: the cache type must be f32, f16, bf16, q8_0 or q4_0 (keys and values)\n");
        return 1;
    }
    if (argc > 5 && atoi(argv[5]) > 0) BS = atoi(argv[5]);
    util_pool *pool = util_pool_create(threads);
    cache c = make_cache(n, type, type);
    float *q = malloc(sizeof(float) * LAYERS * HEADS * HD), *out = malloc(sizeof(float) * HEADS * HD);
    void *work = malloc(op_attention_work_size(threads, HD));
    evict_buf = aligned_alloc(64, evict_floats * sizeof(float));
    if (!q || !out || !work || !evict_buf) return 1;
    for (size_t i = 0; i < evict_floats; i++) evict_buf[i] = (float)(i & 7);
    for (int i = 0; i < LAYERS * HEADS * HD; i++) q[i] = 3 * frand();
    /* the cache bytes one step reads: every visible row of K and V */
    double bytes = (double)LAYERS * HEADS * n * (double)(op_kv_row_bytes(type, HD) * 2);
    const int levels[2] = {OP_SIMD_AVX2, op_cpu_simd_level()};
    const char *names[3] = {"scalar", "avx2", "vnni"};
    if (levels[1] < OP_SIMD_AVX2) { fprintf(stderr, "bench_attn: no AVX2 on this CPU\n"); return 0; }
    double best[2] = {1e9, 1e9};
    /* the two paths alternate, 4 steps each, best per path */
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < 2; v++) {
            op_set_simd_level(levels[v]);
            step(pool, &c, n, q, out, work); /* warm */
            for (int i = 0; i < 4; i++) {
                double t = step(pool, &c, n, q, out, work);
                if (t < best[v]) best[v] = t;
            }
        }
    op_set_simd_level(-1);
    double bw = op_measure_read_bandwidth(pool, (size_t)256 << 20);
    printf("bench_attn: decode attention of one token over %d keys, 12 layers x 12 heads, head_dim 64, %s cache, "
           "%d-token blocks, %d threads (best of %d rounds)\n", n, argc > 4 ? argv[4] : "q8_0", BS, threads, rounds);
    for (int v = 0; v < 2; v++)
        printf("  %-6s %7.3f ms  %6.1f GB/s of cache read  %5.1f%% of the %.1f GB/s bound\n", names[levels[v]],
               1e3 * best[v], bytes / best[v] / 1e9, 100 * bytes / bw / best[v], bw / 1e9);
    printf("  %s vs avx2: %.2fx\n", names[levels[1]], best[0] / best[1]);
    free(q); free(out); free(work); free(c.data); free(c.ptrs); free(evict_buf);
    util_pool_free(pool);
    return 0;
}
