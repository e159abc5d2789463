/* tests/test_ops: every kernel's fast path against its scalar reference:
 * matmul for each weight type (against a double reference on the same
 * quantized activations, and against the pure-float one with a bound from the
 * activation rounding), activation quantizers, rmsnorm, rope, softmax, swiglu,
 * add and attention (tiled/online softmax vs materialised rows), plus
 * thread-count determinism. */
#include "helpers/testutil.h"
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "dtype/dtype.h"
#include "dtype/iq.h"
#include "dtype/tq.h"
#include "ops/ops.h"
#include "ops/backend.h"
#include "ops/ops_internal.h"
#include "ops/type_traits.h"
#include "util/pool.h"

static uint64_t seed = 12345;

static float *rand_floats(size_t n, float scale) {
    float *x = malloc(n * sizeof(float));
    assert_non_null(x);
    tu_fill_random(x, n, &seed, scale);
    return x;
}

/* Levels to compare: scalar, then each SIMD level the CPU has. */
static int n_levels(void) { return op_cpu_simd_level() + 1; }

/* ---- activation quantizers ----------------------------------------------------- */
static void test_quant_act_simd_equals_scalar(void **state) {
    (void)state;
    const int sizes[] = {256, 512, 2048, 4096};
    for (int si = 0; si < 4; si++) {
        int n = sizes[si];
        float *x = rand_floats((size_t)n, 3.0f);
        x[5] = 0.0f;
        for (int i = 32; i < 64; i++) x[i] = 0.0f; /* an all-zero block: d = 0 */
        x[70] = 1e-30f;
        size_t ra = op_q8a_row_size(n), rk = op_q8k_row_size(n);
        uint8_t *a0 = calloc(1, ra), *a1 = calloc(1, ra), *k0 = calloc(1, rk), *k1 = calloc(1, rk);
        op_set_simd(false);
        op_quantize_q8a(x, a0, n);
        op_quantize_q8k(x, k0, n);
        op_set_simd(true);
        op_quantize_q8a(x, a1, n);
        op_quantize_q8k(x, k1, n);
        assert_memory_equal(a0, a1, ra);
        assert_memory_equal(k0, k1, rk);
        /* dequantized values are within half a step of the input */
        float *y = malloc(sizeof(float) * (size_t)n);
        op_dequantize_q8a(a0, y, n);
        for (int i = 0; i < n; i++) assert_true(fabsf(y[i] - x[i]) <= 0.5f * op_q8a_d(a0, n)[i / 32] * 1.0001f + 1e-30f);
        op_dequantize_q8k(k0, y, n);
        const block_q8_K *kb = (const block_q8_K *)k0;
        for (int i = 0; i < n; i++) assert_true(fabsf(y[i] - x[i]) <= 0.5f * kb[i / QK_K].d * 1.0001f + 1e-30f);
        for (int b = 0; b < n / QK_K; b++)
            for (int j = 0; j < 16; j++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += kb[b].qs[16 * j + i];
                assert_int_equal(s, kb[b].bsums[j]);
            }
        free(y);
        free(a0); free(a1); free(k0); free(k1); free(x);
    }
}

/* ---- matmul ------------------------------------------------------------------------ */
typedef struct {
    int type;
    const char *name;
} wtype;
static const wtype k_types[] = {{DT_F32, "f32"}, {DT_F16, "f16"}, {DT_BF16, "bf16"}, {DT_Q8_0, "q8_0"},
                                {DT_Q4_0, "q4_0"}, {DT_Q4_1, "q4_1"}, {DT_Q5_0, "q5_0"}, {DT_Q5_1, "q5_1"},
                                {DT_Q4_K, "q4_K"}, {DT_Q5_K, "q5_K"}, {DT_Q6_K, "q6_K"}, {DT_Q2_K, "q2_K"},
                                {DT_Q3_K, "q3_K"}, {DT_IQ4_NL, "iq4_nl"}, {DT_IQ4_XS, "iq4_xs"},
                                {DT_IQ2_XXS, "iq2_xxs"}, {DT_IQ2_XS, "iq2_xs"}, {DT_IQ2_S, "iq2_s"},
                                {DT_IQ3_XXS, "iq3_xxs"}, {DT_IQ3_S, "iq3_s"}, {DT_IQ1_S, "iq1_s"},
                                {DT_IQ1_M, "iq1_m"}, {DT_MXFP4, "mxfp4"}, {DT_TQ1_0, "tq1_0"},
                                {DT_TQ2_0, "tq2_0"}};
#define N_TYPES ((int)(sizeof k_types / sizeof k_types[0]))

static void *make_weights(int type, int n_in, int n_out, float **wf_out) {
    size_t rs = dt_row_size(type, n_in);
    assert_true(rs > 0);
    uint8_t *w = malloc(rs * (size_t)n_out);
    float *wf = rand_floats((size_t)n_in * n_out, 0.5f);
    if (dt_is_iq(type) || dt_is_tq(type) || type == DT_MXFP4) {
        /* the codebook and ternary types and MXFP4: random blocks (every
         * index, sign, scale and code pattern) with d = 1/64 (MXFP4: half
         * scales 2^-10 .. 2^-3); their quantizers are test_dtype's */
        static uint64_t s = 5;
        const size_t bs = dt_info(type)->type_size, nb = rs * (size_t)n_out / bs;
        for (size_t i = 0; i < rs * (size_t)n_out; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            w[i] = (uint8_t)(s >> 56);
        }
        for (size_t b = 0; b < nb; b++) {
            uint8_t *blk = w + b * bs;
            if (type == DT_MXFP4) blk[0] = (uint8_t)(118 + blk[0] % 8);
            else if (dt_is_tq(type)) memcpy(blk + bs - 2, &(dt_f16){0x2400}, 2);
            else dt_iq_set_d(type, blk, 0x2400);
        }
    } else
        for (int o = 0; o < n_out; o++) assert_int_equal(dt_quantize_row(type, wf + (size_t)o * n_in, w + rs * o, n_in), 0);
    /* the weights the kernels see are the dequantized ones */
    for (int o = 0; o < n_out; o++) dt_dequantize_row(type, w + rs * o, wf + (size_t)o * n_in, n_in);
    *wf_out = wf;
    return w;
}

static void run_matmul(util_pool *pool, float *Y, const float *X, const void *W, int type, int T, int n_in,
                       int n_out) {
    size_t ws = op_matmul_work_size(type, T, n_in);
    /* exact size, misaligned by one byte: ASan sees any overrun, and the
     * kernel must align the scratch itself */
    uint8_t *buf = ws ? malloc(ws + 1) : NULL;
    op_matmul(pool, Y, X, W, type, T, n_in, n_out, ws ? buf + 1 : NULL);
    free(buf);
}

/* Checks one shape for one type at every SIMD level and thread count. */
static void check_matmul(int type, const char *name, int T, int n_in, int n_out, util_pool *p2, util_pool *p3) {
    float *wf;
    void *W = make_weights(type, n_in, n_out, &wf);
    float *X = rand_floats((size_t)T * n_in, 2.0f);
    X[0] = 40.0f; /* an outlier: its block gets a coarse scale */
    size_t ny = (size_t)T * n_out;
    float *Y = malloc(ny * sizeof(float)), *Yt = malloc(ny * sizeof(float));
    float *Yref = malloc(ny * sizeof(float));
    op_matmul_ref(Yref, X, W, type, T, n_in, n_out);

    /* The activations exactly as the kernels quantize them (the quantizers are
     * bit-identical at every level, tested above). */
    int kind = op_matmul_act_kind(type);
    float *Xq = malloc((size_t)T * n_in * sizeof(float));
    float *half_step = malloc((size_t)T * n_in * sizeof(float)); /* bound on |x - xq| */
    for (int t = 0; t < T; t++) {
        const float *x = X + (size_t)t * n_in;
        float *xq = Xq + (size_t)t * n_in, *hs = half_step + (size_t)t * n_in;
        if (kind == 0) {
            memcpy(xq, x, sizeof(float) * n_in);
            for (int i = 0; i < n_in; i++) hs[i] = 0;
        } else {
            size_t rs = kind == 1 ? op_q8a_row_size(n_in) : op_q8k_row_size(n_in);
            uint8_t *row = malloc(rs);
            if (kind == 1) {
                op_quantize_q8a(x, row, n_in);
                op_dequantize_q8a(row, xq, n_in);
                for (int i = 0; i < n_in; i++) hs[i] = 0.5f * op_q8a_d(row, n_in)[i / 32];
            } else {
                op_quantize_q8k(x, row, n_in);
                op_dequantize_q8k(row, xq, n_in);
                for (int i = 0; i < n_in; i++) hs[i] = 0.5f * ((const block_q8_K *)row)[i / QK_K].d;
            }
            free(row);
        }
    }

    for (int level = 0; level < n_levels(); level++) {
        op_set_simd_level(level);
        run_matmul(NULL, Y, X, W, type, T, n_in, n_out);
        for (int t = 0; t < T; t++)
            for (int o = 0; o < n_out; o++) {
                const float *w = wf + (size_t)o * n_in;
                const float *xq = Xq + (size_t)t * n_in, *hs = half_step + (size_t)t * n_in;
                double exact = 0, mag = 0, qerr = 0;
                for (int i = 0; i < n_in; i++) {
                    exact += (double)w[i] * xq[i];
                    mag += fabs((double)w[i] * xq[i]);
                    qerr += fabs((double)w[i]) * hs[i];
                }
                double y = Y[(size_t)t * n_out + o];
                /* Same activations: integer block sums are exact, so the only
                 * error is float rounding of the block scales and the running
                 * sum: at most ~(n_in/8 + 8) roundings of 2^-24 relative to
                 * sum |w x| for the float types, fewer for the block types. */
                double tol = (n_in / 8 + 16) * 6e-8 * mag + 1e-30;
                if (fabs(y - exact) > tol) {
                    fprintf(stderr, "%s level %d T=%d n_in=%d row %d tok %d: %.9g vs %.9g (tol %.3g)\n", name,
                            level, T, n_in, o, t, y, exact, tol);
                    fail();
                }
                /* Pure-float reference: additionally the activation rounding,
                 * |sum w (x - xq)| <= sum |w| * half a quantization step. */
                double yr = Yref[(size_t)t * n_out + o];
                if (fabs(y - yr) > qerr * 1.0001 + tol + 1e-6 * fabs(yr)) {
                    fprintf(stderr, "%s level %d vs float ref: %.9g vs %.9g (bound %.3g)\n", name, level, y, yr,
                            qerr + tol);
                    fail();
                }
            }
        /* threads: same bits */
        run_matmul(p2, Yt, X, W, type, T, n_in, n_out);
        assert_memory_equal(Y, Yt, ny * sizeof(float));
        run_matmul(p3, Yt, X, W, type, T, n_in, n_out);
        assert_memory_equal(Y, Yt, ny * sizeof(float));
    }
    op_set_simd_level(-1);
    free(Xq); free(half_step);
    free(Y); free(Yt); free(Yref); free(X); free(W); free(wf);
}

static void test_matmul_all_types(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    const int Ts[] = {1, 3, 17, 64};
    const int n_ins[] = {256, 512, 768};
    const int n_outs[] = {67, 5};
    for (int ti = 0; ti < N_TYPES; ti++)
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 3; b++)
                for (int c = 0; c < 2; c++) {
                    if (tu_quick() && (b == 2 || (a == 3 && c == 1))) continue;
                    check_matmul(k_types[ti].type, k_types[ti].name, Ts[a], n_ins[b], n_outs[c], p2, p3);
                }
    util_pool_free(p2);
    util_pool_free(p3);
}

/* Float types take any n_in; Q8_0/Q4_0 any multiple of 32 (partial groups of
 * 8 blocks in the SIMD kernels). */
static void test_matmul_odd_sizes(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    const int f_ins[] = {1, 7, 8, 13, 100};
    for (int i = 0; i < 5; i++)
        for (int t = 0; t < 3; t++) check_matmul(k_types[t].type, k_types[t].name, 3, f_ins[i], 9, p2, p3);
    const int q_ins[] = {32, 96, 224, 288};
    for (int i = 0; i < 4; i++) {
        check_matmul(DT_Q8_0, "q8_0", 1, q_ins[i], 13, p2, p3);
        check_matmul(DT_Q4_0, "q4_0", 5, q_ins[i], 13, p2, p3);
        check_matmul(DT_IQ4_NL, "iq4_nl", 2, q_ins[i], 13, p2, p3);
    }
    util_pool_free(p2);
    util_pool_free(p3);
}

/* Batched decode must give each sequence the bits it gets alone: a (row,
 * token) result of Q8_0/Q4_0 may not depend on T, on which tile or token
 * block it lands in, nor on the rows around it (odd row counts pair a row
 * with itself). For every SIMD level: all T tokens at once, every prefix
 * 1..T, and each token alone give the same bits; shapes with an odd number
 * of blocks and partial groups of 8 blocks; plus accuracy at T = 2, 5, 70. */
static void test_matmul_batch_bits(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    const int types[] = {DT_Q8_0, DT_Q4_0};
    const char *names[] = {"q8_0", "q4_0"};
    const int n_ins[] = {32, 96, 288, 768}, n_outs[] = {13, 37, 6};
    const int TM = 70;
    for (int ti = 0; ti < 2; ti++)
        for (int a = 0; a < 4; a++) {
            int n_in = n_ins[a], n_out = n_outs[a % 3];
            float *wf;
            void *W = make_weights(types[ti], n_in, n_out, &wf);
            float *X = rand_floats((size_t)TM * n_in, 1.5f);
            float *Yall = malloc(sizeof(float) * TM * n_out), *Y = malloc(sizeof(float) * TM * n_out);
            for (int level = 0; level < n_levels(); level++) {
                op_set_simd_level(level);
                run_matmul(p2, Yall, X, W, types[ti], TM, n_in, n_out);
                for (int T = 1; T <= TM; T += (tu_quick() && T > 8 ? 7 : 1)) {
                    run_matmul(T & 1 ? p3 : NULL, Y, X, W, types[ti], T, n_in, n_out);
                    if (memcmp(Y, Yall, sizeof(float) * T * n_out)) {
                        fprintf(stderr, "%s level %d n_in %d: T=%d differs from T=%d\n", names[ti], level, n_in,
                                T, TM);
                        fail();
                    }
                }
                for (int t = 0; t < TM; t++) {
                    run_matmul(NULL, Y, X + (size_t)t * n_in, W, types[ti], 1, n_in, n_out);
                    assert_memory_equal(Y, Yall + (size_t)t * n_out, sizeof(float) * n_out);
                }
            }
            op_set_simd_level(-1);
            free(W); free(wf); free(X); free(Yall); free(Y);
        }
    for (int ti = 0; ti < 2; ti++) {
        check_matmul(types[ti], names[ti], 2, 96, 7, p2, p3);
        check_matmul(types[ti], names[ti], 5, 288, 13, p2, p3);
        if (!tu_quick()) check_matmul(types[ti], names[ti], TM, 768, 37, p2, p3);
    }
    util_pool_free(p2);
    util_pool_free(p3);
}

/* F16 and BF16 at every SIMD level: a
 * (row, token) result may not depend on T, the thread count or the tile it
 * lands in, n_in with a partial 16- or 8-wide tail included; check_matmul
 * bounds the error against the exact dot product. */
static void test_matmul_half_bits(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    const int types[] = {DT_F16, DT_BF16};
    const char *names[] = {"f16", "bf16"};
    const int n_ins[] = {17, 33, 100, 768}, n_outs[] = {13, 6, 37, 9};
    const int TM = 23;
    for (int ti = 0; ti < 2; ti++)
        for (int a = 0; a < 4; a++) {
            int n_in = n_ins[a], n_out = n_outs[a];
            float *wf;
            void *W = make_weights(types[ti], n_in, n_out, &wf);
            float *X = rand_floats((size_t)TM * n_in, 1.5f);
            float *Yall = malloc(sizeof(float) * TM * n_out), *Y = malloc(sizeof(float) * TM * n_out);
            for (int level = 0; level < n_levels(); level++) {
                op_set_simd_level(level);
                run_matmul(p2, Yall, X, W, types[ti], TM, n_in, n_out);
                for (int T = 1; T <= TM; T += 1 + (tu_quick() ? 3 : 0)) {
                    run_matmul(T & 1 ? p3 : NULL, Y, X, W, types[ti], T, n_in, n_out);
                    if (memcmp(Y, Yall, sizeof(float) * T * n_out)) {
                        fprintf(stderr, "%s level %d n_in %d: T=%d differs from T=%d\n", names[ti], level, n_in,
                                T, TM);
                        fail();
                    }
                }
                for (int t = 0; t < TM; t++) {
                    run_matmul(t & 1 ? p2 : NULL, Y, X + (size_t)t * n_in, W, types[ti], 1, n_in, n_out);
                    assert_memory_equal(Y, Yall + (size_t)t * n_out, sizeof(float) * n_out);
                }
            }
            op_set_simd_level(-1);
            free(W); free(wf); free(X); free(Yall); free(Y);
            check_matmul(types[ti], names[ti], 1, n_in, n_out, p2, p3);
            check_matmul(types[ti], names[ti], 7, n_in, n_out, p2, p3);
        }
    util_pool_free(p2);
    util_pool_free(p3);
}

/* Packed weights (OP_Q8_0_R16, OP_Q4_0_R16 and the K-quants': 16-row groups) at every SIMD
 * level, T and thread count: bit-identical to the scalar kernel of the base
 * type on the unpacked weights, rows of a last partial group included. */
static void test_matmul_packed(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    const int types[] = {DT_Q8_0, DT_Q4_0, DT_Q5_0, DT_Q4_1, DT_Q5_1, DT_IQ4_NL, DT_Q4_K, DT_Q5_K, DT_Q6_K, DT_IQ4_XS, DT_Q2_K, DT_Q3_K, DT_MXFP4},
              packed[] = {OP_Q8_0_R16, OP_Q4_0_R16, OP_Q5_0_R16, OP_Q4_1_R16, OP_Q5_1_R16,
                          OP_IQ4_NL_R16, OP_Q4_K_R16, OP_Q5_K_R16, OP_Q6_K_R16, OP_IQ4_XS_R16, OP_Q2_K_R16, OP_Q3_K_R16,
                          OP_MXFP4_R16};
    const int n_ins[] = {32, 96, 288, 768, 64}, n_outs[] = {16, 37, 13, 64, 200};
    const int TM = 21;
    for (int ti = 0; ti < 13; ti++)
        for (int a = 0; a < 5; a++) {
            /* K-quants: 256-column super-blocks */
            int n_in = ti >= 6 && ti < 12 ? 256 * (1 + a % 3) : n_ins[a], n_out = n_outs[a];
            float *wf;
            void *W = make_weights(types[ti], n_in, n_out, &wf);
            size_t ps = op_pack_size(types[ti], n_in, n_out);
            assert_int_equal(ps, (size_t)(n_out + 15) / 16 * 16 * op_pack_row_size(packed[ti], n_in));
            assert_true(op_pack_row_size(packed[ti], n_in) >= dt_row_size(types[ti], n_in));
            uint8_t *P = malloc(ps);
            op_pack(types[ti], W, P, n_in, n_out);
            float *X = rand_floats((size_t)TM * n_in, 1.5f);
            float *Yref = malloc(sizeof(float) * TM * n_out), *Y = malloc(sizeof(float) * TM * n_out);
            float *Yd = malloc(sizeof(float) * TM * n_out);
            op_set_simd_level(OP_SIMD_SCALAR);
            run_matmul(NULL, Yref, X, W, types[ti], TM, n_in, n_out);
            op_matmul_ref(Yd, X, W, types[ti], TM, n_in, n_out);
            for (size_t i = 0; i < (size_t)TM * n_out; i++) /* a sanity bound (check_matmul has the tight one) */
                assert_true(fabsf(Yref[i] - Yd[i]) <= 0.1f * (1.0f + fabsf(Yd[i])));
            for (int level = 0; level < n_levels(); level++) {
                op_set_simd_level(level);
                for (int T = 1; T <= TM; T += (tu_quick() && T > 9 ? 4 : 1)) {
                    run_matmul(T & 1 ? p3 : p2, Y, X + (size_t)(TM - T) * n_in, P, packed[ti], T, n_in, n_out);
                    if (memcmp(Y, Yref + (size_t)(TM - T) * n_out, sizeof(float) * T * n_out)) {
                        fprintf(stderr, "packed type %d level %d n_in %d n_out %d T=%d differs from scalar\n", ti,
                                level, n_in, n_out, T);
                        fail();
                    }
                }
            }
            op_set_simd_level(-1);
            free(W); free(wf); free(P); free(X); free(Yref); free(Y); free(Yd);
        }
    util_pool_free(p2);
    util_pool_free(p3);
}

/* op_matmul_n gives each output exactly what op_matmul gives it alone: types
 * sharing the activation format (Q8_0, packed Q8_0, Q4_0) quantize once, a
 * different one (Q6_K) falls back to one call each; odd row counts. */
static void test_matmul_n(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2);
    const int n_in = 256, T = 5;
    const int types[] = {DT_Q8_0, DT_Q4_0, DT_Q8_0, DT_Q6_K}, n_outs[] = {40, 16, 23, 7};
    void *W[4];
    float *wf[4], *Y[4], *Yn[4];
    for (int i = 0; i < 4; i++) {
        W[i] = make_weights(types[i], n_in, n_outs[i], &wf[i]);
        Y[i] = malloc(sizeof(float) * T * n_outs[i]);
        Yn[i] = malloc(sizeof(float) * T * n_outs[i]);
    }
    uint8_t *P = malloc(op_pack_size(DT_Q8_0, n_in, n_outs[2]));
    op_pack(DT_Q8_0, W[2], P, n_in, n_outs[2]);
    op_mm_out o[4] = {{Yn[0], W[0], types[0], n_outs[0]}, {Yn[1], W[1], types[1], n_outs[1]},
                      {Yn[2], P, OP_Q8_0_R16, n_outs[2]}, {Yn[3], W[3], types[3], n_outs[3]}};
    float *X = rand_floats((size_t)T * n_in, 1.0f);
    size_t ws = 0;
    for (int i = 0; i < 4; i++) ws = op_matmul_work_size(types[i], T, n_in) > ws ? op_matmul_work_size(types[i], T, n_in) : ws;
    void *work = malloc(ws);
    for (int n = 3; n <= 4; n++) {
        for (int i = 0; i < n; i++) memset(Yn[i], 0, sizeof(float) * T * n_outs[i]);
        op_matmul_n(p2, X, T, n_in, o, n, work);
        for (int i = 0; i < n; i++) {
            run_matmul(NULL, Y[i], X, o[i].W, o[i].wtype, T, n_in, n_outs[i]);
            assert_memory_equal(Y[i], Yn[i], sizeof(float) * T * n_outs[i]);
        }
    }
    for (int i = 0; i < 4; i++) { free(W[i]); free(wf[i]); free(Y[i]); free(Yn[i]); }
    free(P); free(X); free(work);
    util_pool_free(p2);
}

/* op_matmul_prep: rows written by prep from the threads give op_matmul_n's
 * bits on the rows written beforehand; prep runs exactly once per row, also
 * for float weights (its own pass), mixed activation formats (one call each)
 * and no matrix at all. */
typedef struct {
    float *X;
    const float *src;
    int n_in;
    _Atomic int *calls;
} prep_ctx;

static void prep_rows(void *p, int t) {
    prep_ctx *c = p;
    for (int i = 0; i < c->n_in; i++) c->X[(size_t)t * c->n_in + i] = 2.0f * c->src[(size_t)t * c->n_in + i] - 0.25f;
    atomic_fetch_add(&c->calls[t], 1);
}

static void test_matmul_prep(void **state) {
    (void)state;
    util_pool *pools[3] = {NULL, util_pool_create(2), util_pool_create(3)};
    const int n_in = 256, n_out = 37, Ts[] = {1, 3, 4, 6, 17};
    const int types[][2] = {{DT_F32, -1}, {DT_Q8_0, -1}, {OP_Q8_0_R16, -1}, {DT_Q4_K, -1}, {DT_Q8_0, DT_Q6_K}};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        int base = types[ti][0] == OP_Q8_0_R16 ? DT_Q8_0 : types[ti][0];
        float *wf[2];
        void *W[2] = {make_weights(base, n_in, n_out, &wf[0]), NULL};
        if (types[ti][0] == OP_Q8_0_R16) {
            void *P = malloc(op_pack_size(DT_Q8_0, n_in, n_out));
            op_pack(DT_Q8_0, W[0], P, n_in, n_out);
            free(W[0]);
            W[0] = P;
        }
        int n = types[ti][1] < 0 ? 1 : 2;
        if (n == 2) W[1] = make_weights(types[ti][1], n_in, n_out, &wf[1]);
        for (size_t k = 0; k < sizeof Ts / sizeof Ts[0]; k++)
            for (int pi = 0; pi < 3; pi++) {
                int T = Ts[k];
                float *src = rand_floats((size_t)T * n_in, 1.0f), *X = malloc(sizeof(float) * T * n_in);
                float *Y[2], *Yp[2];
                _Atomic int calls[17];
                for (int t = 0; t < T; t++) atomic_init(&calls[t], 0);
                size_t ws = op_matmul_work_size(base, T, n_in) +
                            (n == 2 ? op_matmul_work_size(types[ti][1], T, n_in) : 0);
                void *work = malloc(ws + 64);
                prep_ctx pc = {X, src, n_in, calls};
                op_mm_out o[2], op[2];
                for (int i = 0; i < n; i++) {
                    Y[i] = malloc(sizeof(float) * T * n_out);
                    Yp[i] = malloc(sizeof(float) * T * n_out);
                    o[i] = (op_mm_out){Y[i], W[i], i ? types[ti][1] : types[ti][0], n_out};
                    op[i] = o[i];
                    op[i].Y = Yp[i];
                }
                op_matmul_prep(pools[pi], X, T, n_in, op, n, work, prep_rows, &pc);
                for (int t = 0; t < T; t++) assert_int_equal(atomic_load(&calls[t]), 1);
                op_matmul_n(pools[pi], X, T, n_in, o, n, work); /* X as prep left it */
                for (int i = 0; i < n; i++) assert_memory_equal(Y[i], Yp[i], sizeof(float) * T * n_out);
                op_matmul_prep(pools[pi], X, T, n_in, o, 0, work, prep_rows, &pc); /* no matrix: prep still runs */
                for (int t = 0; t < T; t++) assert_int_equal(atomic_load(&calls[t]), 2);
                for (int i = 0; i < n; i++) { free(Y[i]); free(Yp[i]); }
                free(src); free(X); free(work);
            }
        for (int i = 0; i < n; i++) { free(W[i]); free(wf[i]); }
    }
    util_pool_free(pools[1]);
    util_pool_free(pools[2]);
}

static void test_matmul_work_size(void **state) {
    (void)state;
    assert_int_equal(op_matmul_work_size(DT_F32, 8, 256), 0);
    assert_int_equal(op_matmul_work_size(DT_F16, 8, 256), 0);
    assert_true(op_matmul_work_size(DT_Q4_0, 8, 256) >= 8 * op_q8a_row_size(256));
    assert_true(op_matmul_work_size(DT_Q6_K, 8, 256) >= 8 * op_q8k_row_size(256));
    /* an unsupported type leaves Y alone */
    float y = 7.0f, x[32] = {0};
    uint8_t w[64] = {0};
    op_matmul(NULL, &y, x, w, DT_Q8_1, 1, 32, 1, NULL);
    assert_true(y == 7.0f);
}

static void test_read_bandwidth(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2);
    double bw = op_measure_read_bandwidth(p2, 8u << 20);
    assert_true(bw > 1e8); /* any machine reads faster than 100 MB/s */
    util_pool_free(p2);
}

/* ---- elementwise ---------------------------------------------------------------- */
static void test_rmsnorm(void **state) {
    (void)state;
    const int ns[] = {1, 7, 64, 4096, 4097};
    for (int k = 0; k < 5; k++) {
        int n = ns[k];
        float *x = rand_floats((size_t)n, 5.0f), *w = rand_floats((size_t)n, 1.0f);
        float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
        op_rmsnorm_ref(b, x, w, n, 1e-5f);
        for (int level = 0; level < n_levels(); level++) {
            op_set_simd_level(level);
            op_rmsnorm(a, x, w, n, 1e-5f);
            /* the sum of squares in float lanes: ~n * 2^-24 relative at worst,
             * but its square root halves it; outputs are x * inv * w */
            assert_true(tu_max_rel_diff(a, b, n, 1e-3) < 2e-6);
            memcpy(a, x, sizeof(float) * n); /* in place */
            op_rmsnorm(a, a, w, n, 1e-5f);
            assert_true(tu_max_rel_diff(a, b, n, 1e-3) < 2e-6);
        }
        op_set_simd_level(-1);
        free(x); free(w); free(a); free(b);
    }
}

static void test_rope(void **state) {
    (void)state;
    const int pos[] = {0, 1, 17, 1000, 4095, 32767, 100000};
    const int dims[][3] = {{64, 64, 4}, {128, 128, 2}, {64, 32, 3}, {80, 80, 2}, {8, 8, 5}, {6, 4, 3}, {256, 200, 1}};
    /* frequency factors as Llama 3.1's scaling makes them: 1 for the fast
     * pairs, 8 for the slow ones, between in the middle */
    float factors[128];
    for (int i = 0; i < 128; i++) factors[i] = i < 8 ? 1.0f : i < 24 ? 1.0f + 7.0f * (float)(i - 8) / 16.0f : 8.0f;
    for (int d = 0; d < 7; d++)
        for (int fi = 0; fi < 4; fi++)
            for (int pi = 0; pi < 7; pi++) {
                const int neox = fi & 1;
                const float *ff = fi & 2 ? factors : NULL;
                int hd = dims[d][0], rd = dims[d][1], nh = dims[d][2], n = hd * nh;
                float *x = rand_floats((size_t)n, 2.0f);
                float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
                memcpy(b, x, sizeof(float) * n);
                op_rope_ref(b, nh, hd, rd, pos[pi], 10000.0f, ff, neox);
                for (int level = 0; level < n_levels(); level++) {
                    op_set_simd_level(level);
                    memcpy(a, x, sizeof(float) * n);
                    op_rope(a, nh, hd, rd, pos[pi], 10000.0f, ff, neox);
                    /* same cos/sin (computed in double) and same float ops */
                    assert_true(tu_max_rel_diff(a, b, n, 1.0) < 1e-6);
                    /* the angles computed once and applied: op_rope's bits */
                    float cs[128], sn[128], *t = malloc(sizeof(float) * n);
                    memcpy(t, x, sizeof(float) * n);
                    op_rope_cossin(cs, sn, rd, pos[pi], 10000.0f, ff);
                    op_rope_apply(t, nh, hd, rd, cs, sn, neox);
                    assert_memory_equal(t, a, sizeof(float) * n);
                    free(t);
                }
                op_set_simd_level(-1);
                for (int h = 0; h < nh; h++)
                    for (int i = rd; i < hd; i++) assert_true(a[h * hd + i] == x[h * hd + i]); /* untouched */
                if (pos[pi] == 0) assert_memory_equal(a, x, sizeof(float) * n); /* identity */
                /* a rotation: each pair keeps its length */
                for (int h = 0; h < nh; h++)
                    for (int i = 0; i < rd / 2; i++) {
                        int i0 = neox ? i : 2 * i, i1 = neox ? i + rd / 2 : 2 * i + 1;
                        float *v = x + h * hd, *r = a + h * hd;
                        double l0 = hypot(v[i0], v[i1]), l1 = hypot(r[i0], r[i1]);
                        assert_true(fabs(l0 - l1) <= 1e-6 * (l0 + 1));
                    }
                free(x); free(a); free(b);
            }
    /* an independent check of the angle at a large position: pair 1 of 8 dims,
     * theta = pos * 10000^(-2/8) */
    float v[8] = {0, 0, 1, 0, 0, 0, 0, 0};
    op_rope(v, 1, 8, 8, 30000, 10000.0f, NULL, false);
    double th = 30000.0 * pow(10000.0, -0.25);
    assert_true(fabs(v[2] - cos(th)) < 1e-6 && fabs(v[3] - sin(th)) < 1e-6);
    /* with a factor of 8 on that pair the angle is an eighth */
    const float ff8[4] = {1, 8, 1, 1};
    float w[8] = {0, 0, 1, 0, 0, 0, 0, 0};
    op_rope(w, 1, 8, 8, 30000, 10000.0f, ff8, false);
    assert_true(fabs(w[2] - cos(th / 8)) < 1e-6 && fabs(w[3] - sin(th / 8)) < 1e-6);
}

static void test_softmax(void **state) {
    (void)state;
    const int ns[] = {1, 5, 8, 33, 1000, 32000};
    for (int k = 0; k < 6; k++) {
        int n = ns[k];
        float *x = rand_floats((size_t)n, 30.0f);
        for (int i = 0; i < n; i++) x[i] += 1000.0f; /* large values: exp would overflow without the max */
        if (n > 4) { x[1] = -INFINITY; x[3] = -1e30f; }
        float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
        memcpy(b, x, sizeof(float) * n);
        op_softmax_ref(b, n);
        for (int level = 0; level < n_levels(); level++) {
            op_set_simd_level(level);
            memcpy(a, x, sizeof(float) * n);
            op_softmax(a, n);
            /* exp to ~1e-7 relative, sums of up to 32000 terms in float lanes */
            double sum = 0;
            for (int i = 0; i < n; i++) {
                if (!(fabsf(a[i] - b[i]) <= 2e-6f * b[i] + 1e-12f))
                    fprintf(stderr, "softmax n=%d level %d [%d]: %.9g vs %.9g\n", n, level, i, a[i], b[i]);
                assert_true(fabsf(a[i] - b[i]) <= 2e-6f * b[i] + 1e-12f);
                sum += a[i];
            }
            assert_true(fabs(sum - 1.0) < 1e-5);
            if (n > 4) assert_true(a[1] == 0.0f && a[3] == 0.0f);
        }
        op_set_simd_level(-1);
        free(x); free(a); free(b);
    }
}

/* argmax at every level: the reference's first largest index, with ties,
 * NaNs (never chosen; a NaN first element gives 0) and infinities. */
static void test_argmax(void **state) {
    (void)state;
    const int ns[] = {1, 2, 7, 8, 9, 31, 64, 100, 32000};
    for (int k = 0; k < 9; k++)
        for (int v = 0; v < 6; v++) {
            int n = ns[k];
            float *x = rand_floats((size_t)n, 3.0f);
            if (v == 1) for (int i = 0; i < n; i++) x[i] = (float)(i % 5); /* ties: first 4 wins */
            if (v == 2) x[n / 2] = NAN;
            if (v == 3) x[0] = NAN;
            if (v == 4) for (int i = 0; i < n; i++) x[i] = -INFINITY;
            if (v == 5) { x[n - 1] = INFINITY; x[n / 3] = NAN; }
            int want = op_argmax_ref(x, n);
            if (v == 3) assert_int_equal(want, 0);
            for (int level = 0; level < n_levels(); level++) {
                op_set_simd_level(level);
                assert_int_equal(op_argmax(x, n), want);
            }
            op_set_simd_level(-1);
            free(x);
        }
    assert_int_equal(op_argmax(NULL, 0), -1);
}

static void test_swiglu_add(void **state) {
    (void)state;
    const int n = 1031;
    float *g = rand_floats(n, 12.0f), *u = rand_floats(n, 3.0f);
    g[0] = -100.0f; g[1] = 100.0f; g[2] = 0.0f; g[3] = -89.0f; g[4] = 89.0f;
    for (int i = 5; i < 40; i++) g[i] = -88.7f + 0.05f * (float)i; /* exp's clamps and subnormals */
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n), *a2 = malloc(sizeof(float) * n);
    memcpy(b, g, sizeof(float) * n);
    op_swiglu_ref(b, u, n);
    for (int level = 0; level < n_levels(); level++) {
        op_set_simd_level(level);
        memcpy(a, g, sizeof(float) * n);
        op_swiglu(a, u, n);
        /* exp ~1e-7, one division and two products */
        assert_true(tu_max_rel_diff(a, b, n, 1e-6) < 2e-6);
        if (level == OP_SIMD_AVX2) memcpy(a2, a, sizeof(float) * n);
        /* AVX-512 gives the AVX2 path's bits (batched == alone relies on it) */
        if (level > OP_SIMD_AVX2) assert_memory_equal(a, a2, sizeof(float) * n);
        memcpy(a, g, sizeof(float) * n);
        op_add(a, u, n);
        for (int i = 0; i < n; i++) assert_true(a[i] == g[i] + u[i]);
    }
    op_set_simd_level(-1);
    free(g); free(u); free(a); free(b); free(a2);
}

/* The per-type table's rows agree with each other and with dtype's layouts,
 * and every type a kernel takes has a scalar kernel and a kernel at every
 * level (the lower level's where it has none of its own). */
static void test_type_traits(void **state) {
    (void)state;
    int n_rows = 0, n_packed = 0;
    for (int w = 0; w < 0x200; w++) {
        const op_type_traits *t = op_type_traits_of(w);
        if (!t) {
            assert_int_equal(op_matmul_act_kind(w), -1);
            assert_null(op_mm_tile_at(w, OP_SIMD_VNNI));
            continue;
        }
        n_rows++;
        assert_non_null(dt_info(t->base)); /* its rows are a file type's */
        assert_non_null(t->tile[OP_SIMD_SCALAR]);
        for (int l = 0; l < OP_SIMD_LEVELS; l++) assert_non_null(op_mm_tile_at(w, l));
        assert_true(t->act >= 0 && t->act < OP_ACT_COUNT);
        assert_int_equal(op_matmul_act_kind(w), t->act);
        assert_true((t->act == OP_ACT_F32) == (op_act_traits_of(t->act)->row_size == NULL));
        assert_true(16 % t->tile_rows == 0);
        if (t->base != w) { /* a packed type: its base's row points back to it */
            n_packed++;
            assert_int_equal(op_type_traits_of(t->base)->packed, w);
            assert_int_equal(t->tile_rows, 16);
            assert_int_equal(t->packed, -1);
            assert_null(t->pack);
        } else if (t->packed >= 0) {
            assert_non_null(t->pack);
            assert_int_equal(op_type_traits_of(t->packed)->base, w);
            assert_int_equal(op_type_traits_of(t->packed)->act, t->act);
        } else assert_null(t->pack);
    }
    assert_true(n_rows >= 11 && n_packed >= 8);
    for (int a = 0; a < OP_ACT_COUNT; a++)
        for (int l = 0; l < OP_SIMD_LEVELS; l++)
            assert_true((op_act_quantizer(a, l) != NULL) == (a != OP_ACT_F32));
}

/* The backend the engine calls follows the level cap: its elementwise
 * kernels give the bits of the op_ functions at that level. */
static void test_backend_levels(void **state) {
    (void)state;
    const int n = 517;
    float *x = rand_floats(n, 2.0f), *w = rand_floats(n, 1.0f), *a = malloc(sizeof(float) * n),
          *b = malloc(sizeof(float) * n);
    const char *names[OP_SIMD_LEVELS] = {"cpu-scalar", "cpu-avx2", "cpu-avx512"};
    for (int level = 0; level < n_levels(); level++) {
        op_set_simd_level(level);
        const op_backend *be = op_backend_cpu();
        assert_string_equal(be->name, names[level]);
        be->rmsnorm(a, x, w, n, 1e-5f);
        op_rmsnorm(b, x, w, n, 1e-5f);
        assert_memory_equal(a, b, sizeof(float) * n);
        memcpy(a, x, sizeof(float) * n);
        memcpy(b, x, sizeof(float) * n);
        be->swiglu(a, w, n);
        op_swiglu(b, w, n);
        assert_memory_equal(a, b, sizeof(float) * n);
    }
    op_set_simd_level(OP_SIMD_SCALAR); /* the scalar kernels are their own, not an AVX2 one */
    op_backend_cpu()->rmsnorm(a, x, w, n, 1e-5f);
    op_rmsnorm_scalar(b, x, w, n, 1e-5f);
    assert_memory_equal(a, b, sizeof(float) * n);
    op_set_simd_level(-1);
    free(x); free(w); free(a); free(b);
}

/* ---- attention ---------------------------------------------------------------------- */
typedef struct {
    int T, q_pos0, n_heads, n_kv_heads, head_dim;
} att_case;

static void check_attention(att_case c, util_pool *p2, util_pool *p3) {
    int n_pos = c.q_pos0 + c.T, hd = c.head_dim;
    size_t stride = (size_t)(n_pos + 3) * hd; /* cache capacity beyond what is used */
    float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
    size_t nq = (size_t)c.T * c.n_heads * hd;
    float *q = rand_floats(nq, 1.0f);
    /* a few sharp score peaks so the online max changes between key blocks */
    for (size_t i = 0; i < nq; i += 97) q[i] = 6.0f;
    op_attn_args a = {c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd, k, v, stride, 1.0f / sqrtf((float)hd),
                      NULL, 0, 0, 0, 0, 0, 0, 0, NULL, -1, NULL, NULL, 0, 0, 0, 0, NULL};
    float *ref = malloc(nq * sizeof(float)), *o = malloc(nq * sizeof(float)), *o2 = malloc(nq * sizeof(float));
    op_attention_ref(ref, q, &a);
    for (int level = 0; level < n_levels() && level <= OP_SIMD_AVX2; level++) {
        op_set_simd_level(level);
        size_t ws = op_attention_work_size(3, hd);
        uint8_t *work = malloc(ws);
        op_attention(NULL, o, q, &a, work);
        /* outputs are convex combinations of V rows (|v| <= 1): absolute
         * error from float scores (~hd * 2^-24), exp (~1e-7) and the running
         * sums over up to a few thousand keys */
        double md = 0, e2 = 0, r2 = 0;
        for (size_t i = 0; i < nq; i++) {
            double d = (double)o[i] - ref[i];
            md = fmax(md, fabs(d));
            e2 += d * d;
            r2 += (double)ref[i] * ref[i];
        }
        /* and relative to the output's size (norm-wise): the key split must
         * not lose accuracy in the merge */
        if (md > 2e-5 || sqrt(e2 / r2) > 1e-5) {
            fprintf(stderr, "attention T=%d pos0=%d heads %d/%d hd=%d level %d: max diff %.3g, rel %.3g\n", c.T,
                    c.q_pos0, c.n_heads, c.n_kv_heads, hd, level, md, sqrt(e2 / r2));
            fail();
        }
        op_attention(p2, o2, q, &a, work);
        assert_memory_equal(o, o2, nq * sizeof(float));
        op_attention(p3, o2, q, &a, work);
        assert_memory_equal(o, o2, nq * sizeof(float));
        free(work);
    }
    op_set_simd_level(-1);
    free(k); free(v); free(q); free(ref); free(o); free(o2);
}

/* Sliding window, soft-capping (gemma2) and attention sinks (gpt-oss): every level against the
 * reference, decode (key-split at long positions) and prefill; the keys and
 * values before the first query's window are NaN, so reading one would show. */
static void test_attention_window(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2);
    const int windows[] = {1, 3, 64, 100, 700, 2000}; /* 2000: decode at 3000 splits the window's keys */
    const att_case cases[] = {{1, 3000, 8, 2, 64}, {1, 40, 4, 4, 16}, {70, 200, 8, 2, 32}, {19, 5, 4, 1, 16},
                              {130, 1000, 4, 2, 64}};
    for (int wi = 0; wi < 6; wi++)
        for (int ci = 0; ci < 5; ci++)
            for (int cap = 0; cap < 3; cap++) { /* 1: soft-capping, 2: sinks (and the first time no window) */
                att_case c = cases[ci];
                int n_pos = c.q_pos0 + c.T, hd = c.head_dim, W = windows[wi];
                float sinks[16];
                for (int h = 0; h < 16; h++) sinks[h] = 2.5f * (float)(h % 4) - 2.0f + (h == 5 ? 20.0f : 0.0f);
                size_t stride = (size_t)n_pos * hd, nq = (size_t)c.T * c.n_heads * hd;
                float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
                float *q = rand_floats(nq, 1.0f);
                for (size_t i = 0; i < nq; i += 97) q[i] = 6.0f;
                int lo = c.q_pos0 + 1 - W > 0 && !(cap == 2 && wi == 0) ? c.q_pos0 + 1 - W : 0;
                for (int h = 0; h < c.n_kv_heads; h++)
                    for (size_t i = 0; i < (size_t)lo * hd; i++) k[h * stride + i] = v[h * stride + i] = NAN;
                op_attn_args a = {c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd, k, v, stride, 1.0f / sqrtf((float)hd),
                                  NULL, 0, 0, 0, 0, 0, 0, 0, NULL, -1, NULL, NULL, 0, 0, cap == 2 && wi == 0 ? 0 : W,
                                  cap == 1 ? 1.5f : 0, cap == 2 ? sinks : NULL};
                float *ref = malloc(nq * sizeof(float)), *o = malloc(nq * sizeof(float)), *o2 = malloc(nq * sizeof(float));
                op_attention_ref(ref, q, &a);
                for (int level = 0; level < n_levels(); level++) {
                    op_set_simd_level(level);
                    uint8_t *work = malloc(op_attention_work_size(2, hd));
                    op_attention(NULL, o, q, &a, work);
                    double md = 0;
                    for (size_t i = 0; i < nq; i++) md = tu_worse(md, fabs((double)o[i] - ref[i]));
                    if (md > 2e-5) {
                        fprintf(stderr, "window %d softcap %d T=%d pos0=%d heads %d/%d hd %d level %d: max diff %.3g\n",
                                W, cap, c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd, level, md);
                        fail();
                    }
                    op_attention(p2, o2, q, &a, work);
                    assert_memory_equal(o, o2, nq * sizeof(float));
                    free(work);
                }
                op_set_simd_level(-1);
                free(k); free(v); free(q); free(ref); free(o); free(o2);
            }
    util_pool_free(p2);
}

static void test_attention_shapes(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    const int hds[] = {8, 16, 64, 128, 80, 6};
    const int kv[][2] = {{4, 4}, {4, 2}, {8, 2}, {8, 1}, {16, 2}, {3, 1}};
    for (int h = 0; h < 6; h++)
        for (int g = 0; g < 6; g++) {
            check_attention((att_case){1, 0, kv[g][0], kv[g][1], hds[h]}, p2, p3);   /* first token */
            check_attention((att_case){1, 37, kv[g][0], kv[g][1], hds[h]}, p2, p3);  /* decode */
            check_attention((att_case){19, 5, kv[g][0], kv[g][1], hds[h]}, p2, p3);  /* prefill chunk */
        }
    /* longer prefills, with and without earlier context */
    check_attention((att_case){300, 0, 8, 2, 64}, p2, p3);
    check_attention((att_case){300, 123, 4, 4, 128}, p2, p3);
    check_attention((att_case){129, 70, 8, 1, 16}, p2, p3);
    check_attention((att_case){65, 1, 128, 1, 8}, p2, p3); /* group larger than a tile's rows */
    util_pool_free(p2);
    util_pool_free(p3);
}

/* The paged layout gives the same bits as the contiguous one, for block sizes
 * that do and do not divide the kernel's key tiles; blocks are scattered in a
 * pool in shuffled order, keys and values interleaved per block. */
static void test_attention_paged(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2);
    const int bss[] = {1, 7, 16, 64, 100};
    const att_case cases[] = {{1, 200, 8, 2, 64}, {37, 90, 4, 4, 16}, {1, 700, 8, 1, 128}, {5, 3, 6, 3, 8}};
    for (int ci = 0; ci < 4; ci++)
        for (int bi = 0; bi < 5; bi++) {
            att_case c = cases[ci];
            int bs = bss[bi], hd = c.head_dim, n_pos = c.q_pos0 + c.T;
            int nb = (n_pos + bs - 1) / bs;
            size_t stride = (size_t)n_pos * hd;
            float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
            size_t nq = (size_t)c.T * c.n_heads * hd;
            float *q = rand_floats(nq, 1.0f);
            /* block layout: [head][pos in block][dim] keys, then the same for values */
            size_t head_stride = (size_t)bs * hd, v_off = (size_t)c.n_kv_heads * head_stride;
            size_t blk = 2 * v_off;
            float *pool = calloc((size_t)nb * blk, sizeof(float));
            const float **blocks = malloc(sizeof(float *) * nb);
            for (int b = 0; b < nb; b++) {
                int slot = (b * 7 + 3) % nb; /* shuffled; 7 is coprime with most nb */
                if ((nb % 7) == 0) slot = nb - 1 - b;
                blocks[b] = pool + (size_t)slot * blk;
                for (int h = 0; h < c.n_kv_heads; h++)
                    for (int i = 0; i < bs && b * bs + i < n_pos; i++) {
                        int p = b * bs + i;
                        memcpy((float *)blocks[b] + h * head_stride + (size_t)i * hd, k + h * stride + (size_t)p * hd, sizeof(float) * hd);
                        memcpy((float *)blocks[b] + v_off + h * head_stride + (size_t)i * hd, v + h * stride + (size_t)p * hd, sizeof(float) * hd);
                    }
            }
            op_attn_args a = {c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd, k, v, stride, 1.0f / sqrtf((float)hd),
                              NULL, 0, 0, 0, 0, 0, 0, 0, NULL, -1, NULL, NULL, 0, 0, 0, 0, NULL};
            op_attn_args ap = a;
            ap.k = ap.v = NULL;
            ap.blocks = blocks;
            ap.block_size = bs;
            ap.head_stride = head_stride;
            ap.v_offset = v_off;
            float *o1 = malloc(nq * sizeof(float)), *o2 = malloc(nq * sizeof(float));
            uint8_t *work = malloc(op_attention_work_size(2, hd));
            for (int level = 0; level < n_levels() && level <= OP_SIMD_AVX2; level++) {
                op_set_simd_level(level);
                op_attention(NULL, o1, q, &a, work);
                op_attention(p2, o2, q, &ap, work);
                assert_memory_equal(o1, o2, nq * sizeof(float));
            }
            op_set_simd_level(-1);
            op_attention_ref(o1, q, &a);
            op_attention_ref(o2, q, &ap);
            assert_memory_equal(o1, o2, nq * sizeof(float));
            free(work); free(o1); free(o2); free(pool); free(blocks); free(k); free(v); free(q);
        }
    util_pool_free(p2);
}

/* op_attention_n (a batched decode step's sequences in one pass of the
 * threads) gives each call exactly what op_attention gives it alone: short
 * decodes and a prefill share the pass, a long decode (split across threads)
 * and one with H2O weights run on their own. */
static void test_attention_n(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2);
    enum { N = 12 };
    const int hd = 64, n_heads = 8, n_kv = 2;
    const int Ts[N] = {1, 1, 1, 5, 1, 1, 1, 1, 1, 3, 1, 1}, pos0[N] = {0, 17, 300, 40, 2500, 1, 63, 64, 9, 0, 120, 33};
    op_attn_args a[N];
    float *k[N], *v[N], *q[N], *o1[N], *o2[N], *kw1 = calloc(200, sizeof(float)), *kw2 = calloc(200, sizeof(float));
    for (int i = 0; i < N; i++) {
        int n_pos = pos0[i] + Ts[i];
        size_t stride = (size_t)n_pos * hd, nq = (size_t)Ts[i] * n_heads * hd;
        k[i] = rand_floats(stride * n_kv, 1.0f);
        v[i] = rand_floats(stride * n_kv, 1.0f);
        q[i] = rand_floats(nq, 1.0f);
        o1[i] = malloc(nq * sizeof(float));
        o2[i] = malloc(nq * sizeof(float));
        op_attn_args c = {Ts[i], pos0[i], n_heads, n_kv, hd, k[i], v[i], stride, 1.0f / sqrtf((float)hd),
                          NULL, 0, 0, 0, 0, 0, 0, 0, NULL, -1, NULL, NULL, 0, 0, 0, 0, NULL};
        a[i] = c;
    }
    a[10].key_weights = kw2; /* H2O: its own pass */
    uint8_t *work = malloc(op_attention_work_size(2, hd));
    for (int level = 0; level < n_levels(); level++) {
        op_set_simd_level(level);
        memset(kw2, 0, 200 * sizeof(float));
        op_attention_n(p2, N, o2, (const float *const *)q, a, work);
        memcpy(kw1, kw2, 200 * sizeof(float));
        memset(kw2, 0, 200 * sizeof(float));
        for (int i = 0; i < N; i++) {
            op_attention(p2, o1[i], q[i], &a[i], work);
            assert_memory_equal(o1[i], o2[i], (size_t)Ts[i] * n_heads * hd * sizeof(float));
        }
        assert_memory_equal(kw1, kw2, 200 * sizeof(float));
        assert_true(kw1[0] > 0);
    }
    op_set_simd_level(-1);
    for (int i = 0; i < N; i++) { free(k[i]); free(v[i]); free(q[i]); free(o1[i]); free(o2[i]); }
    free(kw1); free(kw2); free(work);
    util_pool_free(p2);
}

/* Flash-decoding: one or two KV heads decoding at 2000+ keys, where the keys
 * are split into parts merged by log-sum-exp: close to the reference, and the
 * same bits on 1, 2 and 3 threads (check_attention compares them). */
static void test_attention_flash_decode(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    check_attention((att_case){1, 2100, 8, 1, 64}, p2, p3);
    check_attention((att_case){1, 2047, 4, 2, 128}, p2, p3);
    check_attention((att_case){1, 3000, 2, 2, 64}, p2, p3);
    check_attention((att_case){2, 2500, 16, 1, 80}, p2, p3); /* two tokens, odd head dim */
    util_pool_free(p2);
    util_pool_free(p3);
}

static void test_attention_long(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    int n = tu_quick() ? 1200 : 5000;
    /* decode at a long position: few items, so keys are split among threads */
    check_attention((att_case){1, n, 8, 1, 64}, p2, p3);
    check_attention((att_case){1, n, 8, 2, 128}, p2, p3);
    check_attention((att_case){2, n, 4, 4, 64}, p2, p3);
    /* a prefill chunk late in a long sequence */
    check_attention((att_case){tu_quick() ? 40 : 96, n, 8, 2, 64}, p2, p3);
    util_pool_free(p2);
    util_pool_free(p3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quant_act_simd_equals_scalar),
        cmocka_unit_test(test_matmul_all_types),
        cmocka_unit_test(test_matmul_odd_sizes),
        cmocka_unit_test(test_matmul_batch_bits),
        cmocka_unit_test(test_matmul_half_bits),
        cmocka_unit_test(test_matmul_packed),
        cmocka_unit_test(test_matmul_n),
        cmocka_unit_test(test_matmul_prep),
        cmocka_unit_test(test_matmul_work_size),
        cmocka_unit_test(test_read_bandwidth),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_softmax),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_type_traits),
        cmocka_unit_test(test_backend_levels),
        cmocka_unit_test(test_attention_shapes),
        cmocka_unit_test(test_attention_window),
        cmocka_unit_test(test_attention_paged),
        cmocka_unit_test(test_attention_n),
        cmocka_unit_test(test_attention_flash_decode),
        cmocka_unit_test(test_attention_long),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
