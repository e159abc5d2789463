/* bench/bench_matmul: matmul speed against the machine's read bandwidth,
 * measured in the same run: decode (T=1) GB/s of weights per type as a
 * fraction of bandwidth, prefill (T=64) per-token time against T=1, and
 * batched decode (T = 1..64 for Q8_0 and Q4_0) against T=1.
 * Usage: bench_matmul [threads (default 2)] [--quick: one shape] [--scalar]
 * [--avx2: kernels capped at the AVX2 level, to compare with the level above]
 * Env BENCH_TYPES=q4_0,f16 limits the types. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "dtype/dtype.h"
#include "ops/ops.h"
#include "ops/ops_internal.h"
#include "util/pool.h"
#include "util/timing.h"

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static float frand(void) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng >> 40) & 0xffffff) / (float)0x800000 - 1.0f;
}

/* Weights: `copies` back-to-back copies of an n_out x n_in matrix so that
 * cycling through them reads every byte from memory, not from the cache.
 * 64 distinct random rows are quantized once and tiled (quantizing millions of
 * rows with the reference quantizers would take minutes). */
static uint8_t *make_weights(int type, int n_in, int n_out, int copies, size_t *mat_bytes) {
    static const int packed_base[][2] = {{OP_Q8_0_R16, DT_Q8_0}, {OP_Q4_0_R16, DT_Q4_0}, {OP_Q5_0_R16, DT_Q5_0},
                                         {OP_Q4_1_R16, DT_Q4_1}, {OP_Q5_1_R16, DT_Q5_1}, {OP_Q4_K_R16, DT_Q4_K},
                                         {OP_Q5_K_R16, DT_Q5_K}, {OP_Q6_K_R16, DT_Q6_K}, {OP_IQ4_NL_R16, DT_IQ4_NL},
                                         {OP_IQ4_XS_R16, DT_IQ4_XS}, {OP_Q2_K_R16, DT_Q2_K}, {OP_Q3_K_R16, DT_Q3_K}};
    int base = -1;
    for (size_t i = 0; i < sizeof packed_base / sizeof packed_base[0]; i++)
        if (packed_base[i][0] == type) base = packed_base[i][1];
    if (base >= 0) { /* each copy packed */
        size_t qb;
        uint8_t *q = make_weights(base, n_in, n_out, copies, &qb);
        *mat_bytes = op_pack_size(base, n_in, n_out);
        uint8_t *w = q ? aligned_alloc(64, (*mat_bytes * (size_t)copies + 63) & ~(size_t)63) : NULL;
        for (int c = 0; w && c < copies; c++)
            op_pack(base, q + (size_t)c * qb, w + (size_t)c * *mat_bytes, n_in, n_out);
        free(q);
        return w;
    }
    size_t rs = dt_row_size(type, n_in);
    *mat_bytes = rs * (size_t)n_out;
    uint8_t *w = aligned_alloc(64, (*mat_bytes * (size_t)copies + 63) & ~(size_t)63);
    if (!w) return NULL;
    float *row = malloc((size_t)n_in * sizeof(float));
    uint8_t *proto = malloc(rs * 64);
    for (int r = 0; r < 64; r++) {
        for (int i = 0; i < n_in; i++) row[i] = frand() * 0.05f;
        dt_quantize_row(type, row, proto + (size_t)r * rs, n_in);
    }
    size_t total = (size_t)n_out * (size_t)copies;
    for (size_t r = 0; r < total; r++) memcpy(w + r * rs, proto + (r % 64) * rs, rs);
    free(row);
    free(proto);
    return w;
}

typedef struct { int n_out, n_in; } shape;

/* Whether name is one of the comma-separated names in list (NULL: all). */
static int wanted(const char *list, const char *name) {
    if (!list) return 1;
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)); p += n)
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) return 1;
    return 0;
}

/* Average seconds per call over passes through all copies; best of 5 passes
 * (the machine may be shared, so the best pass is the least disturbed one). */
static double time_calls(util_pool *pool, float *Y, const float *X, const uint8_t *W, size_t mat_bytes,
                         int copies, int type, int T, int n_in, int n_out, void *work, int min_calls) {
    int calls = copies > min_calls ? copies : min_calls;
    double best = 1e30;
    for (int pass = 0; pass < 5; pass++) {
        double t0 = util_now_s();
        for (int c = 0; c < calls; c++)
            op_matmul(pool, Y, X, W + (size_t)(c % copies) * mat_bytes, type, T, n_in, n_out, work);
        double dt = (util_now_s() - t0) / calls;
        if (dt < best) best = dt;
    }
    return best;
}

int main(int argc, char **argv) {
    int nth = 2, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--scalar")) op_set_simd(false);
        else if (!strcmp(argv[i], "--avx2")) op_set_simd_level(OP_SIMD_AVX2);
        else nth = atoi(argv[i]);
    }
    if (nth < 1) nth = 1;
    util_pool *pool = util_pool_create(nth);
    if (!pool) { fprintf(stderr, "cannot create pool\n"); return 1; }
    /* beyond the last-level cache (260 MiB on the reference machine) by far */
    size_t footprint = 1u << 30;
    /* The machine may be shared: bandwidth is measured at the start and again
     * next to every matrix, and fractions use the best bandwidth seen in the
     * whole run (the conservative choice). */
    double bw = op_measure_read_bandwidth(pool, footprint);
    printf("threads %d, simd %s\n", nth, op_cpu_has_avx2() ? "avx2" : "scalar");
    printf("read bandwidth (%zu MiB buffer, %d threads, best of 10, plain and prefetching loads): %.2f GB/s\n\n", footprint >> 20, nth, bw / 1e9);

    /* q8_0r, q4_0r, q4_Kr, q5_Kr, q6_Kr: packed as the engine does at load on AVX512-VNNI CPUs
     * (op_pack; elsewhere the scalar kernels read them: --scalar) */
    const int types[] = {DT_F32,  DT_F16,      DT_BF16,     DT_Q8_0,     DT_Q4_0,     DT_Q4_K,     DT_Q5_K, DT_Q6_K,
                         DT_Q4_1, DT_Q5_0,     DT_Q5_1,     OP_Q8_0_R16, OP_Q4_0_R16, OP_Q5_0_R16, OP_Q4_1_R16,
                         OP_Q5_1_R16, OP_Q4_K_R16, OP_Q5_K_R16, OP_Q6_K_R16, DT_Q2_K, DT_Q3_K, DT_IQ4_NL, DT_IQ4_XS, OP_IQ4_NL_R16,
                         OP_IQ4_XS_R16, OP_Q2_K_R16, OP_Q3_K_R16, DT_IQ3_S, DT_IQ3_XXS, DT_IQ2_S, DT_IQ2_XS,
                         DT_IQ2_XXS, DT_IQ1_M, DT_IQ1_S};
    const char *names[] = {"f32",   "f16",   "bf16",  "q8_0",  "q4_0",  "q4_K",  "q5_K",  "q6_K",  "q4_1",  "q5_0",
                           "q5_1",  "q8_0r", "q4_0r", "q5_0r", "q4_1r", "q5_1r", "q4_Kr", "q5_Kr", "q6_Kr",
                           "q2_K",  "q3_K",  "iq4_nl", "iq4_xs", "iq4_nlr", "iq4_xsr", "q2_Kr", "q3_Kr",
                           "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"};
    const double target[] = {0.85, 0.85, 0, 0.70, 0.70, 0, 0, 0, 0, 0, 0, 0.70, 0.70, 0, 0, 0, 0,
                             0,    0,    0, 0,    0,    0, 0, 0, 0, 0, 0, 0, 0,    0,    0, 0, 0};
    const shape shapes[] = {{5632, 2048}, {32000, 2048}, {2048, 5632}};
    enum { NT = 34, NS = 3, TP = 64 };
    const int n_shapes = quick ? 1 : NS;

    printf("decode (T=1) matrix-vector; weights cycled through >= %zu MiB so they come from memory\n",
           footprint >> 20);
    printf("%-6s %-12s %8s %9s %9s %9s\n", "type", "n_out x n_in", "MiB", "us/call", "GB/s", "bw now");
    float *X = malloc(sizeof(float) * (size_t)TP * 5632);
    float *Y = malloc(sizeof(float) * (size_t)TP * 32000);
    for (int i = 0; i < TP * 5632; i++) X[i] = frand();
    double gbs[NT][NS] = {{0}}, bwn[NT][NS] = {{0}}, pre[NT][2] = {{0}};
    const char *only = getenv("BENCH_TYPES");
    for (int ti = 0; ti < NT; ti++) {
        if (!wanted(only, names[ti])) continue;
        for (int si = 0; si < n_shapes; si++) {
            shape s = shapes[si];
            size_t mat = op_pack_row_size(types[ti], s.n_in) * (size_t)s.n_out;
            int copies = (int)((footprint + mat - 1) / mat);
            if (copies < 2) copies = 2;
            uint8_t *W = make_weights(types[ti], s.n_in, s.n_out, copies, &mat);
            size_t ws = op_matmul_work_size(types[ti], TP, s.n_in);
            void *work = ws ? malloc(ws) : NULL;
            if (!W || (ws && !work)) { fprintf(stderr, "out of memory\n"); return 1; }
            time_calls(pool, Y, X, W, mat, copies, types[ti], 1, s.n_in, s.n_out, work, 4); /* warm up */
            /* If the bandwidth right after the timing is well below the best
             * seen, something else was using the machine: measure again. */
            double t1 = 1e30, bw_now = 0;
            for (int attempt = 0; attempt < 10; attempt++) {
                if (attempt) sleep(1); /* let the other load pass */
                double t = time_calls(pool, Y, X, W, mat, copies, types[ti], 1, s.n_in, s.n_out, work, 16);
                if (t < t1) t1 = t;
                bw_now = op_measure_read_bandwidth(pool, 256u << 20);
                if (bw_now > bw) bw = bw_now;
                if (bw_now >= 0.9 * bw) break;
            }
            gbs[ti][si] = (double)mat / t1;
            bwn[ti][si] = bw_now;
            printf("%-6s %5dx%-6d %8.1f %9.1f %9.2f %9.2f\n", names[ti], s.n_out, s.n_in, (double)mat / (1 << 20),
                   t1 * 1e6, gbs[ti][si] / 1e9, bw_now / 1e9);
            if (si == 0) {
                double tp = time_calls(pool, Y, X, W, mat, copies, types[ti], TP, s.n_in, s.n_out, work, 4);
                pre[ti][0] = t1;
                pre[ti][1] = tp / TP;
            }
            free(work);
            free(W);
        }
    }

    printf("\nsummary: decode GB/s as a fraction of the best read bandwidth seen (%.2f GB/s);\n"
           "'?' marks a figure taken while the machine was busy (bandwidth then < 90%% of best)\n", bw / 1e9);
    printf("%-6s", "type");
    for (int si = 0; si < n_shapes; si++) printf("   %5dx%-5d", shapes[si].n_out, shapes[si].n_in);
    printf("    target\n");
    for (int ti = 0; ti < NT; ti++) {
        if (gbs[ti][0] == 0) continue;
        printf("%-6s", names[ti]);
        int ok = 1;
        for (int si = 0; si < n_shapes; si++) {
            /* '?': the machine was busy with something else even on retry */
            printf("   %10.1f%%%c", 100 * gbs[ti][si] / bw, bwn[ti][si] < 0.9 * bw ? '?' : ' ');
            if (gbs[ti][si] / bw < target[ti]) ok = 0;
        }
        if (target[ti] > 0) printf("   >= %.0f%% %s\n", 100 * target[ti], ok ? "met" : "NOT MET");
        else printf("   -\n");
    }

    printf("\nprefill: T=%d in one call vs T=1, per token, %dx%d weights from memory\n", TP, shapes[0].n_out,
           shapes[0].n_in);
    printf("%-6s %12s %14s %9s %10s\n", "type", "T=1 us/tok", "T=64 us/tok", "speedup", "GFLOP/s");
    for (int ti = 0; ti < NT; ti++) {
        if (pre[ti][0] == 0) continue;
        double flops = 2.0 * shapes[0].n_out * shapes[0].n_in;
        printf("%-6s %12.1f %14.2f %8.1fx %10.1f\n", names[ti], pre[ti][0] * 1e6, pre[ti][1] * 1e6,
               pre[ti][0] / pre[ti][1], flops / pre[ti][1] / 1e9);
    }
    /* Batched decode: the scheduler's steps run T = number of live sequences
     * through every matrix; per token the weights are read once per call. */
    printf("\nbatched decode: T tokens per call, %dx%d weights from memory; per-token time and speedup vs T=1\n",
           shapes[0].n_out, shapes[0].n_in);
    printf("%-6s", "type");
    const int bT[] = {1, 2, 4, 8, 16, 32, 64};
    for (int k = 0; k < 7; k++) printf("   T=%-2d us/tok (x)", bT[k]);
    printf("   GFLOP/s at 64\n");
    for (int ti = 3; ti < NT; ti++) {
        if (!wanted(only, names[ti])) continue;
        shape s = shapes[0];
        size_t mat = op_pack_row_size(types[ti], s.n_in) * (size_t)s.n_out;
        int copies = (int)((footprint + mat - 1) / mat);
        uint8_t *W = make_weights(types[ti], s.n_in, s.n_out, copies, &mat);
        void *work = malloc(op_matmul_work_size(types[ti], TP, s.n_in));
        if (!W || !work) { fprintf(stderr, "out of memory\n"); return 1; }
        printf("%-6s", names[ti]);
        double t1 = 0, tl = 0;
        for (int k = 0; k < 7; k++) {
            double t = time_calls(pool, Y, X, W, mat, copies, types[ti], bT[k], s.n_in, s.n_out, work, 8) / bT[k];
            if (k == 0) t1 = t;
            tl = t;
            printf("   %8.1f (%5.2fx)", t * 1e6, t1 / t);
            fflush(stdout);
        }
        printf("   %8.1f\n", 2.0 * s.n_out * s.n_in / tl / 1e9);
        free(work);
        free(W);
    }
    free(X);
    free(Y);
    util_pool_free(pool);
    return 0;
}
