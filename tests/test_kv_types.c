/* tests/test_kv_types: quantized KV cache element types: round-trip error
 * bounds of each cache quantizer, the attention kernels over typed paged
 * blocks against the reference that dequantizes the whole cache, and the
 * engine end to end (perplexity, decode against prefill, fork and prefix
 * reuse) with quantized caches. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "kvlm.h"
#include "dtype/dtype.h"
#include "ops/kvtype.h"
#include "ops/ops_internal.h"

static uint64_t seed = 0x5eed;
static const int k_types[] = {KVLM_CACHE_F32, KVLM_CACHE_F16, KVLM_CACHE_BF16, KVLM_CACHE_Q8_0, KVLM_CACHE_Q4_0,
                              KVLM_CACHE_Q4_KC};
#define N_KTYPES 6
#define N_VTYPES 5 /* the first five: q4_kc is for keys only */

static float *rand_floats(size_t n, float scale) {
    float *x = malloc(n * sizeof(float));
    assert_non_null(x);
    tu_fill_random(x, n, &seed, scale);
    return x;
}

/* ---- names and sizes ------------------------------------------------------------ */
static void test_names_and_sizes(void **state) {
    (void)state;
    const char *names[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_kc"};
    const int ids[] = {KVLM_CACHE_F32, KVLM_CACHE_F16, KVLM_CACHE_BF16, KVLM_CACHE_Q8_0, KVLM_CACHE_Q4_0,
                       KVLM_CACHE_Q4_KC};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(kvlm_cache_type_from_name(names[i]), ids[i]);
        assert_string_equal(kvlm_cache_type_name(ids[i]), names[i]);
    }
    assert_int_equal(kvlm_cache_type_from_name("q4_1"), -1);
    assert_int_equal(kvlm_cache_type_from_name(NULL), -1);
    assert_null(kvlm_cache_type_name(3));
    /* bytes per element: GGUF's blocks where head_dim allows, one group per
     * row otherwise; q4_kc: (4 + block/2) bytes per channel and block */
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q8_0, 64, 16) == 34.0 / 32);
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q4_0, 128, 16) == 18.0 / 32);
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q8_0, 8, 16) == 10.0 / 8);
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q4_0, 8, 16) == 6.0 / 8);
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q4_KC, 8, 16) == 12.0 / 16);
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q4_KC, 64, 64) == 36.0 / 64);
    assert_true(kvlm_cache_type_elem_bytes(KVLM_CACHE_F16, 8, 16) == 2.0);
}

/* ---- quantizers ---------------------------------------------------------------- */
/* Bounds, per element, with amax the largest |x| of the element's group:
 *   f16   |e| <= 2^-11 |x| (round to nearest, normal range)
 *   bf16  |e| <= 2^-8 |x|
 *   q8_0  |e| <= amax * (1/254 + 2^-11): half a step of amax/127, plus the
 *         f16 rounding of the scale over at most 127 steps
 *   q4_0  |e| <= amax * (1/8 + 2^-10): steps of amax/8 and the code for
 *         +amax clamps at 7 steps when the largest element is negative
 *   q4_kc |e| <= range/30 * (1 + 2^-9) + (|min| + range) * 2^-10 per
 *         channel: half a step of range/15 plus f16 rounding of scale and min */
static void test_roundtrip_bounds(void **state) {
    (void)state;
    const int hds[] = {8, 16, 32, 64, 128, 80, 6};
    for (int hi = 0; hi < 7; hi++) {
        int hd = hds[hi];
        float *x = rand_floats((size_t)hd, 3.0f), *y = malloc(sizeof(float) * hd);
        uint8_t buf[1024];
        for (int ti = 0; ti < N_VTYPES; ti++) {
            int t = k_types[ti], g = op_kv_group(t, hd);
            op_kv_quantize_row(t, x, buf, hd);
            op_kv_dequantize_row(t, buf, y, hd);
            for (int i = 0; i < hd; i++) {
                float amax = 0;
                for (int j = i / g * g; j < i / g * g + g; j++) amax = fmaxf(amax, fabsf(x[j]));
                double e = fabs((double)x[i] - y[i]), bound = 0;
                switch (t) {
                case KVLM_CACHE_F16: bound = ldexp(fabs(x[i]), -11); break;
                case KVLM_CACHE_BF16: bound = ldexp(fabs(x[i]), -8); break;
                case KVLM_CACHE_Q8_0: bound = amax * (1.0 / 254 + ldexp(1, -11)); break;
                case KVLM_CACHE_Q4_0: bound = amax * (1.0 / 8 + ldexp(1, -10)); break;
                default: break;
                }
                if (e > bound) fail_msg("type %d hd %d elem %d: |%g - %g| > %g", t, hd, i, x[i], y[i], bound);
            }
            /* head dims that hold GGUF blocks give GGUF's bytes exactly */
            if (hd % 32 == 0 && (t == KVLM_CACHE_Q8_0 || t == KVLM_CACHE_Q4_0)) {
                uint8_t ref[1024];
                assert_int_equal(dt_quantize_row(t, x, ref, hd), 0);
                assert_memory_equal(ref, buf, op_kv_row_bytes(t, hd));
                assert_int_equal(op_kv_row_bytes(t, hd), dt_row_size(t, hd));
            }
        }
        free(x);
        free(y);
    }
    /* q4_kc: channels with offsets, as keys have; every block size */
    const int bss[] = {16, 7, 1, 32, 64};
    for (int bi = 0; bi < 5; bi++)
        for (int hi = 0; hi < 4; hi++) {
            int bs = bss[bi], hd = hds[hi];
            float *x = rand_floats((size_t)bs * hd, 1.0f), *y = malloc(sizeof(float) * bs * hd);
            uint16_t *h16 = malloc(sizeof(uint16_t) * bs * hd);
            for (int t = 0; t < bs; t++)
                for (int c = 0; c < hd; c++) {
                    size_t i = (size_t)t * hd + c;
                    h16[i] = dt_f32_to_f16(x[i] * (1 + c % 3) + (float)(c % 5) - 2.0f);
                }
            uint8_t *region = malloc(op_kv_region_bytes(KVLM_CACHE_Q4_KC, hd, bs));
            op_kv_quantize_kc(h16, region, hd, bs, bs);
            op_kv_dequantize_kc(region, y, hd, bs, 0, bs);
            for (int c = 0; c < hd; c++) {
                float lo = INFINITY, hi2 = -INFINITY;
                for (int t = 0; t < bs; t++) {
                    float v = dt_f16_to_f32(h16[(size_t)t * hd + c]);
                    lo = fminf(lo, v);
                    hi2 = fmaxf(hi2, v);
                }
                double r = hi2 - lo, bound = r / 30 * (1 + ldexp(1, -9)) + (fabs(lo) + r) * ldexp(1, -10);
                for (int t = 0; t < bs; t++) {
                    double e = fabs(dt_f16_to_f32(h16[(size_t)t * hd + c]) - (double)y[(size_t)t * hd + c]);
                    if (e > bound) fail_msg("q4_kc bs %d hd %d ch %d tok %d: error %g > %g", bs, hd, c, t, e, bound);
                }
            }
            /* any sub-range of tokens reads back the same floats */
            if (bs > 3) {
                float *z = malloc(sizeof(float) * 2 * hd);
                op_kv_dequantize_kc(region, z, hd, bs, 1, 2);
                assert_memory_equal(z, y + hd, sizeof(float) * 2 * hd);
                free(z);
            }
            free(x); free(y); free(h16); free(region);
        }
}

/* The write path's f16 rows (F16C) give the scalar reference's bits: ties,
 * subnormals, overflow, infinities, signed zeros, and rows with a NaN. */
static void test_f16_write(void **state) {
    (void)state;
    const int hds[] = {64, 8, 13, 128};
    float special[] = {0.0f, -0.0f, 1.0f + 0x1p-11f, 1.0f + 0x1p-11f + 0x1p-23f, 1.0f + 3 * 0x1p-11f, -(2.0f + 0x1p-10f),
                       65504.0f, 65519.99f, 65520.0f, -70000.0f, 1e30f, INFINITY, -INFINITY, 0x1p-24f, 0x1p-25f,
                       0x1.8p-25f, 3 * 0x1p-26f, 6e-5f, -6.1e-5f, 0x1p-14f, 0x1.ffcp-15f, 1e-7f, -1e-9f, 1e-40f};
    const int n_special = (int)(sizeof special / sizeof special[0]);
    for (int level = 0; level <= op_cpu_simd_level(); level++) {
        op_set_simd_level(level);
        for (int hi = 0; hi < 4; hi++)
            for (int round = 0; round < 200; round++) {
                int hd = hds[hi];
                float x[128];
                uint16_t got[128], want[128];
                for (int i = 0; i < hd; i++) {
                    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
                    uint64_t r = seed >> 11;
                    /* magnitudes 2^-30 .. 2^17 and the special values */
                    x[i] = r % 5 == 0 ? special[(r >> 8) % n_special]
                                      : ldexpf((float)((r >> 16) % 1000000) / 1e6f, (int)((r >> 40) % 48) - 30) *
                                            (r & 1 ? -1.0f : 1.0f);
                }
                if (round % 50 == 49) { /* NaNs with a payload: such rows take the scalar path */
                    uint32_t bits = 0x7fe00001u | (uint32_t)(round & 1) << 31;
                    memcpy(&x[round % hd], &bits, 4);
                }
                op_kv_quantize_row(KVLM_CACHE_F16, x, got, hd);
                op_kv_quantize_row_ref(KVLM_CACHE_F16, x, want, hd);
                for (int i = 0; i < hd; i++)
                    if (got[i] != want[i])
                        fail_msg("level %d hd %d: f16 of %a is 0x%04x, reference 0x%04x", level, hd, x[i], got[i],
                                 want[i]);
            }
    }
    op_set_simd_level(-1);
}

/* ---- attention over typed paged blocks ------------------------------------------- */
typedef struct {
    int T, q_pos0, n_heads, n_kv_heads, hd, bs;
} acase;

/* Builds a typed paged cache of keys/values k, v ([head][pos][hd]) in
 * shuffled blocks, as kv/paged lays them out; q4_kc keys of the last, partly
 * filled block go to an f16 staging area. */
typedef struct {
    uint8_t *pool;
    const float **blocks;
    uint16_t *stage;
    op_attn_args a;
} typed_cache;

static void build_cache(typed_cache *tc, const acase *c, int kt, int vt, const float *k, const float *v) {
    int n_pos = c->q_pos0 + c->T, bs = c->bs, hd = c->hd, H = c->n_kv_heads;
    int nb = (n_pos + bs - 1) / bs;
    size_t kb = (op_kv_region_bytes(kt, hd, bs) + 3) & ~(size_t)3, vb = (op_kv_region_bytes(vt, hd, bs) + 3) & ~(size_t)3;
    size_t head = kb + vb, blk = head * H, stride = (size_t)n_pos * hd;
    tc->pool = calloc((size_t)nb, blk);
    tc->blocks = malloc(sizeof(float *) * nb);
    tc->stage = calloc((size_t)H * bs * hd, sizeof(uint16_t));
    uint16_t *tmp = malloc(sizeof(uint16_t) * bs * hd);
    int stage_block = n_pos % bs ? nb - 1 : -1;
    for (int b = 0; b < nb; b++) {
        int slot = (nb % 7) ? (b * 7 + 3) % nb : nb - 1 - b;
        uint8_t *base = tc->pool + (size_t)slot * blk;
        tc->blocks[b] = (const float *)base;
        int n_in = n_pos - b * bs < bs ? n_pos - b * bs : bs;
        for (int h = 0; h < H; h++) {
            const float *kh = k + h * stride + (size_t)b * bs * hd, *vh = v + h * stride + (size_t)b * bs * hd;
            uint8_t *kr = base + h * head, *vr = kr + kb;
            for (int i = 0; i < n_in; i++)
                op_kv_quantize_row(vt, vh + (size_t)i * hd, vr + i * op_kv_row_bytes(vt, hd), hd);
            if (kt != KVLM_CACHE_Q4_KC) {
                for (int i = 0; i < n_in; i++)
                    op_kv_quantize_row(kt, kh + (size_t)i * hd, kr + i * op_kv_row_bytes(kt, hd), hd);
                continue;
            }
            uint16_t *dst = b == stage_block ? tc->stage + (size_t)h * bs * hd : tmp;
            for (int i = 0; i < n_in * hd; i++) dst[i] = dt_f32_to_f16(kh[i]);
            if (b != stage_block) op_kv_quantize_kc(tmp, kr, hd, bs, bs);
        }
    }
    free(tmp);
    op_attn_args a = {0};
    a.T = c->T;
    a.q_pos0 = c->q_pos0;
    a.n_heads = c->n_heads;
    a.n_kv_heads = H;
    a.head_dim = hd;
    a.scale = 1.0f / sqrtf((float)hd);
    a.blocks = tc->blocks;
    a.block_size = bs;
    a.k_type = kt;
    a.v_type = vt;
    a.head_bytes = head;
    a.v_bytes = kb;
    a.k_stage = kt == KVLM_CACHE_Q4_KC ? tc->stage : NULL;
    a.stage_block = kt == KVLM_CACHE_Q4_KC ? stage_block : -1;
    tc->a = a;
}

static void free_cache(typed_cache *tc) {
    free(tc->pool);
    free(tc->blocks);
    free(tc->stage);
}

static void check_typed(acase c, int kt, int vt, util_pool *p2, util_pool *p3) {
    int n_pos = c.q_pos0 + c.T, hd = c.hd;
    size_t stride = (size_t)n_pos * hd, nq = (size_t)c.T * c.n_heads * hd;
    float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
    float *q = rand_floats(nq, 1.0f);
    for (size_t i = 0; i < nq; i += 97) q[i] = 6.0f; /* sharp peaks move the online max */
    typed_cache tc;
    build_cache(&tc, &c, kt, vt, k, v);
    float *ref = malloc(nq * sizeof(float)), *o = malloc(nq * sizeof(float)), *o2 = malloc(nq * sizeof(float));
    float *scalar = malloc(nq * sizeof(float));
    /* H2O's weights: the reference's scalar pass, and the kernels' with
     * room for all T tokens' scores (and for two at a time) */
    float *wref = calloc((size_t)n_pos, sizeof(float)), *w = malloc(sizeof(float) * n_pos),
          *w2 = malloc(sizeof(float) * n_pos);
    size_t swn = op_attention_score_floats(c.T, c.n_heads, n_pos);
    float *sw = malloc(sizeof(float) * swn);
    op_attn_args ra = tc.a, wa = tc.a;
    ra.key_weights = wref;
    op_attention_ref(ref, q, &ra);
    wa.key_weights = w;
    wa.score_work = sw;
    wa.score_work_floats = swn;
    uint8_t *work = malloc(op_attention_work_size(3, hd));
    for (int level = 0; level <= op_cpu_simd_level(); level++) {
        op_set_simd_level(level);
        op_attention(NULL, o, q, &tc.a, work);
        /* both read the same dequantized floats (q4_kc keys: the kernel folds
         * the channel scales into q and reads the codes; q8_0 / q4_0 keys:
         * both see the query rounded to int8, which the fused kernels take as
         * codes in integer dot products; values: the fused kernels multiply
         * p by the scale before the code): only float rounding and summation
         * order differ, as for f32 (|v| <= ~1: the bound test_ops uses). The
         * SIMD level (fused decode kernels) against the scalar one (tiles of
         * dequantized rows) likewise. */
        double md = 0, ms = 0;
        for (size_t i = 0; i < nq; i++) md = fmax(md, fabs((double)o[i] - ref[i]));
        if (level == 0) memcpy(scalar, o, nq * sizeof(float));
        for (size_t i = 0; i < nq; i++) ms = fmax(ms, fabs((double)o[i] - scalar[i]));
        if (md > 2e-5 || ms > 2e-5)
            fail_msg("typed attention %s/%s T=%d pos0=%d heads %d/%d hd %d bs %d level %d: max diff %.3g, %.3g "
                     "from scalar",
                     kvlm_cache_type_name(kt), kvlm_cache_type_name(vt), c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd,
                     c.bs, level, md, ms);
        /* the same with H2O's weights on 1, 2, 3 threads: the output
         * unchanged and the same bits, the weights the same bits and within
         * 1e-5 (relative) of the reference's */
        util_pool *pools[] = {NULL, p2, p3};
        for (int pi = 0; pi < 3; pi++) {
            wa.key_weights = pi ? w2 : w;
            memset(wa.key_weights, 0, sizeof(float) * n_pos);
            op_attention(pools[pi], o2, q, &wa, work);
            assert_memory_equal(o, o2, nq * sizeof(float));
            if (pi) assert_memory_equal(w, w2, sizeof(float) * n_pos);
        }
        double total = 0;
        for (int p = 0; p < n_pos; p++) {
            total += w[p];
            if (fabs((double)w[p] - wref[p]) > 1e-5 * fabs(wref[p]) + 1e-7)
                fail_msg("h2o weights %s/%s T=%d pos0=%d heads %d/%d hd %d level %d: key %d %.9g, reference %.9g",
                         kvlm_cache_type_name(kt), kvlm_cache_type_name(vt), c.T, c.q_pos0, c.n_heads, c.n_kv_heads,
                         hd, level, p, w[p], wref[p]);
        }
        assert_true(fabs(total - (double)c.T * c.n_heads) < 1e-4 * c.T * c.n_heads);
        int top = op_cpu_simd_level();
        if (c.T > 1 && level == top) { /* scores of two tokens at a time */
            wa.key_weights = w2;
            wa.score_work_floats = op_attention_score_floats(2, c.n_heads, n_pos);
            memset(w2, 0, sizeof(float) * n_pos);
            op_attention(p2, o2, q, &wa, work);
            wa.score_work_floats = swn;
            for (size_t i = 0; i < nq; i++)
                if (fabs((double)o2[i] - ref[i]) > 2e-5) fail_msg("two tokens at a time: out[%zu] off (%s/%s T=%d pos0=%d heads %d/%d hd %d bs %d: %g vs %g)", i, kvlm_cache_type_name(kt), kvlm_cache_type_name(vt), c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd, c.bs, o2[i], ref[i]);
            for (int p = 0; p < n_pos; p++)
                if (fabs((double)w2[p] - wref[p]) > 1e-5 * fabs(wref[p]) + 1e-7)
                    fail_msg("two tokens at a time: key %d %.9g, reference %.9g", p, w2[p], wref[p]);
        }
    }
    op_set_simd_level(-1);
    free(wref); free(w); free(w2); free(sw);
    free(work); free(ref); free(o); free(o2); free(scalar); free(k); free(v); free(q);
    free_cache(&tc);
}

static void test_attention_typed(void **state) {
    (void)state;
    util_pool *p2 = util_pool_create(2), *p3 = util_pool_create(3);
    /* 8: one quantization group per row; 32..128: GGUF's 32-element groups,
     * which decode reads with the fused kernels */
    const int hds[] = {8, 32, 64, 128};
    /* GQA ratios 1, 2, 3 (pairs of rows and one left over), 8 and MQA */
    const int kv[][2] = {{4, 4}, {4, 2}, {9, 3}, {16, 2}, {8, 1}};
    const int bss[] = {16, 7};
    bool quick = tu_quick();
    for (int kt = 0; kt < N_KTYPES; kt++)
        for (int vt = 0; vt < N_VTYPES; vt++)
            for (int hi = 0; hi < 4; hi++)
                for (int g = 0; g < 5; g++)
                    for (int bi = 0; bi < 2; bi++) {
                        /* quick (sanitizer) runs: a rotating subset that still
                         * covers every type pair, head dim, ratio and block size */
                        if (quick && (kt + vt + hi + g + bi) % 4 != 0) continue;
                        int bs = bss[bi];
                        check_typed((acase){1, 37, kv[g][0], kv[g][1], hds[hi], bs}, k_types[kt], k_types[vt], p2, p3);
                        check_typed((acase){quick ? 40 : 90, 13, kv[g][0], kv[g][1], hds[hi], bs}, k_types[kt],
                                    k_types[vt], p2, p3);
                    }
    /* the first token alone, and a long context split among threads */
    check_typed((acase){1, 0, 4, 2, 64, 16}, KVLM_CACHE_Q4_KC, KVLM_CACHE_Q4_0, p2, p3);
    int n = quick ? 1000 : 3000;
    check_typed((acase){1, n, 8, 2, 64, 16}, KVLM_CACHE_Q4_KC, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){1, n + 5, 8, 1, 128, 16}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q4_0, p2, p3);
    check_typed((acase){3, n, 4, 4, 8, 7}, KVLM_CACHE_Q4_0, KVLM_CACHE_BF16, p2, p3);
    /* a few query tokens at once (rows that see different key counts) go
     * through the fused decode kernels too; blocks of 7 split key runs */
    check_typed((acase){2, 300, 8, 4, 64, 16}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q4_0, p2, p3);
    check_typed((acase){3, 37, 4, 4, 32, 7}, KVLM_CACHE_F16, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){4, 50, 6, 3, 16, 7}, KVLM_CACHE_BF16, KVLM_CACHE_F16, p2, p3);
    /* flash-decoding (keys split into parts, merged by log-sum-exp) with one
     * and two KV heads at 2000+ keys: the same bits on 1, 2 and 3 threads */
    check_typed((acase){1, 2100, 8, 1, 64, 16}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){1, 2501, 4, 2, 64, 16}, KVLM_CACHE_Q4_0, KVLM_CACHE_F16, p2, p3);
    check_typed((acase){1, 2049, 8, 2, 128, 16}, KVLM_CACHE_Q4_KC, KVLM_CACHE_Q4_0, p2, p3);
    check_typed((acase){1, n + 7, 9, 3, 64, 16}, KVLM_CACHE_Q8_0, KVLM_CACHE_F16, p2, p3);
    check_typed((acase){1, n, 12, 12, 64, 16}, KVLM_CACHE_Q4_0, KVLM_CACHE_Q8_0, p2, p3);
    /* q8_0 keys and values on AVX512-VNNI CPUs (the level loop runs them
     * against the AVX2 and scalar kernels): 16-key chunks over runs cut by
     * 7-token blocks and key splits, GQA pairs, rows that see different key
     * counts, head dim 128; prefill items of up to ATT_RMAX rows (GQA, and
     * one row per query head) */
    check_typed((acase){1, n + 3, 4, 2, 128, 7}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){2, 300, 9, 3, 64, 7}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){1, 1500, 12, 12, 64, 16}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){40, 70, 8, 2, 128, 7}, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){33, 50, 6, 6, 64, 16}, KVLM_CACHE_Q8_0, KVLM_CACHE_F16, p2, p3);
    /* q4_0 keys and values in the same tile: decode with a key split, GQA
     * pairs and a row left over, 7-token blocks, head dim 128, prefill */
    check_typed((acase){1, 1700, 9, 3, 64, 7}, KVLM_CACHE_Q4_0, KVLM_CACHE_Q4_0, p2, p3);
    check_typed((acase){2, 300, 4, 2, 128, 16}, KVLM_CACHE_F16, KVLM_CACHE_Q4_0, p2, p3);
    check_typed((acase){40, 70, 8, 2, 128, 7}, KVLM_CACHE_Q4_0, KVLM_CACHE_Q4_0, p2, p3);
    check_typed((acase){33, 50, 6, 6, 64, 16}, KVLM_CACHE_Q4_0, KVLM_CACHE_BF16, p2, p3);
    /* f32 / f16 / bf16 (and mixed with q8_0) in the AVX512 tile: key splits
     * at 1,500+ keys, GQA pairs and a row left over, rows that see different
     * key counts, 7-token blocks, head dims 32 and 128, and prefill items of
     * more than 8 rows (test_attention_kernels says which kernel each runs) */
    check_typed((acase){1, n + 3, 4, 2, 128, 7}, KVLM_CACHE_F32, KVLM_CACHE_F32, p2, p3);
    check_typed((acase){1, 1500, 12, 12, 64, 16}, KVLM_CACHE_F16, KVLM_CACHE_F16, p2, p3);
    check_typed((acase){1, 1600, 8, 1, 64, 16}, KVLM_CACHE_F32, KVLM_CACHE_F16, p2, p3);
    check_typed((acase){2, 300, 9, 3, 64, 7}, KVLM_CACHE_F16, KVLM_CACHE_F16, p2, p3);
    check_typed((acase){8, 100, 4, 4, 64, 16}, KVLM_CACHE_F32, KVLM_CACHE_BF16, p2, p3);
    check_typed((acase){3, 37, 8, 2, 32, 7}, KVLM_CACHE_BF16, KVLM_CACHE_F32, p2, p3);
    check_typed((acase){1, 700, 8, 2, 64, 16}, KVLM_CACHE_F16, KVLM_CACHE_Q8_0, p2, p3);
    check_typed((acase){2, 90, 8, 4, 128, 7}, KVLM_CACHE_Q8_0, KVLM_CACHE_F16, p2, p3);
    check_typed((acase){20, 70, 4, 2, 64, 16}, KVLM_CACHE_F16, KVLM_CACHE_Q8_0, p2, p3);
    /* head dims that are multiples of 16 but not of 64: a partial 64-wide chunk of P.V */
    check_typed((acase){2, 200, 8, 4, 80, 7}, KVLM_CACHE_F16, KVLM_CACHE_F32, p2, p3);
    check_typed((acase){1, 600, 6, 2, 96, 16}, KVLM_CACHE_F32, KVLM_CACHE_BF16, p2, p3);
    check_typed((acase){12, 30, 4, 4, 48, 16}, KVLM_CACHE_BF16, KVLM_CACHE_F16, p2, p3);
    util_pool_free(p2);
    util_pool_free(p3);
}

/* Sliding windows over typed paged caches, at every level against the
 * reference: decode (the fused and VNNI kernels, a key split at long
 * windows) and prefill (the tiled kernel), soft-capped or with sinks or not. The blocks
 * wholly before the first query's window point at a block of NaN bytes (as
 * the pool's null block stands in for released ones): reading one would show. */
static void test_attention_window(void **state) {
    (void)state;
    enum { F32 = KVLM_CACHE_F32, F16 = KVLM_CACHE_F16, BF16 = KVLM_CACHE_BF16, Q8 = KVLM_CACHE_Q8_0,
           Q4 = KVLM_CACHE_Q4_0 };
    const int types[][2] = {{F32, F32}, {F16, F16}, {BF16, F32}, {Q8, Q8}, {F16, Q8}, {Q4, F16}};
    const acase cases[] = {{1, 1500, 8, 2, 64, 16}, {1, 3000, 8, 1, 64, 16}, {1, 300, 12, 12, 64, 7},
                           {20, 400, 4, 2, 64, 16}, {3, 90, 8, 4, 128, 7}};
    const int windows[] = {1, 100, 1300};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
            for (int wi = 0; wi < 3; wi++)
                for (int cap = 0; cap < 3; cap++) { /* 1: soft-capping, 2: sinks (gpt-oss) */
                    acase c = cases[ci];
                    float sinks[12];
                    for (int h = 0; h < 12; h++) sinks[h] = 2.5f * (float)(h % 4) - 2.0f + (h == 5 ? 20.0f : 0.0f);
                    int W = windows[wi], n_pos = c.q_pos0 + c.T, hd = c.hd;
                    size_t stride = (size_t)n_pos * hd, nq = (size_t)c.T * c.n_heads * hd;
                    float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
                    float *q = rand_floats(nq, 1.0f);
                    typed_cache tc;
                    build_cache(&tc, &c, types[ti][0], types[ti][1], k, v);
                    size_t blk = ((op_kv_region_bytes(types[ti][0], hd, c.bs) + 3) & ~(size_t)3) +
                                 ((op_kv_region_bytes(types[ti][1], hd, c.bs) + 3) & ~(size_t)3);
                    uint8_t *nan_block = malloc(blk * c.n_kv_heads);
                    memset(nan_block, 0xff, blk * c.n_kv_heads);
                    int lo = c.q_pos0 + 1 - W > 0 ? c.q_pos0 + 1 - W : 0;
                    for (int b = 0; b < lo / c.bs; b++) tc.blocks[b] = (const float *)nan_block;
                    tc.a.window = W;
                    tc.a.softcap = cap == 1 ? 2.0f : 0;
                    tc.a.sinks = cap == 2 ? sinks : NULL;
                    float *ref = malloc(nq * sizeof(float)), *o = malloc(nq * sizeof(float));
                    op_attention_ref(ref, q, &tc.a);
                    uint8_t *work = malloc(op_attention_work_size(1, hd));
                    for (int level = 0; level <= op_cpu_simd_level(); level++) {
                        op_set_simd_level(level);
                        op_attention(NULL, o, q, &tc.a, work);
                        double md = 0;
                        for (size_t i = 0; i < nq; i++) {
                            double d = fabs((double)o[i] - ref[i]);
                            md = d > md || d != d ? d : md;
                        }
                        if (!(md <= 2e-5))
                            fail_msg("window %d softcap %d %s/%s T=%d pos0=%d heads %d/%d hd %d bs %d level %d "
                                     "(kernel %d): max diff %.3g", W, cap, kvlm_cache_type_name(types[ti][0]),
                                     kvlm_cache_type_name(types[ti][1]), c.T, c.q_pos0, c.n_heads, c.n_kv_heads, hd,
                                     c.bs, level, op_attention_kernel(&tc.a), md);
                    }
                    op_set_simd_level(-1);
                    free(work); free(ref); free(o); free(nan_block); free(k); free(v); free(q);
                    free_cache(&tc);
                }
}

/* Which kernel runs, by SIMD level, cache types, head dim and rows per item
 * (op_attention_kernel); H2O's weights and key splits do not change it. */
static int kernel_of(int kt, int vt, int hd, int T, int heads, int kv, int n_pos, bool h2o) {
    static float dummy;
    static const float *blocks[1] = {&dummy};
    op_attn_args a = {0};
    a.T = T;
    a.q_pos0 = n_pos - T;
    a.n_heads = heads;
    a.n_kv_heads = kv;
    a.head_dim = hd;
    a.blocks = blocks;
    a.block_size = 16;
    a.k_type = kt;
    a.v_type = vt;
    a.head_bytes = 1;
    a.key_weights = h2o ? &dummy : NULL;
    return op_attention_kernel(&a);
}

static void test_attention_kernels(void **state) {
    (void)state;
    enum { F32 = KVLM_CACHE_F32, F16 = KVLM_CACHE_F16, BF16 = KVLM_CACHE_BF16, Q8 = KVLM_CACHE_Q8_0,
           Q4 = KVLM_CACHE_Q4_0, KC = KVLM_CACHE_Q4_KC, VNNI = OP_ATT_VNNI_TILE, FUSED = OP_ATT_AVX2_FUSED,
           TILE = OP_ATT_AVX2_TILE };
    /* k, v, head dim, T, heads, KV heads, positions, H2O: kernel at the
     * AVX512-VNNI level, at the AVX2 level */
    const int cases[][10] = {
        {F32, F32, 64, 1, 12, 12, 60, 0, VNNI, TILE},    /* the server's default: stories110M decode */
        {F16, F16, 64, 1, 12, 12, 60, 0, VNNI, FUSED},
        {F16, F16, 128, 1, 32, 8, 3000, 1, VNNI, FUSED}, /* GQA, key split, H2O */
        {F32, F32, 128, 1, 8, 1, 3000, 1, VNNI, TILE},
        {BF16, F32, 32, 2, 8, 4, 90, 0, VNNI, FUSED},
        {F16, Q8, 64, 1, 8, 2, 90, 0, VNNI, FUSED},      /* mixed with q8_0 */
        {Q8, F16, 64, 2, 8, 2, 90, 0, VNNI, FUSED},
        {Q8, Q8, 64, 1, 8, 2, 90, 0, VNNI, FUSED},
        {F32, F32, 64, 40, 8, 8, 90, 0, VNNI, TILE},     /* prefill: the same kernel as decode */
        {F16, Q8, 64, 40, 8, 8, 90, 0, VNNI, TILE},
        {Q8, Q8, 64, 40, 8, 8, 90, 0, VNNI, TILE},       /* q8_0 keys too (AVX2: prefill dequantizes tiles) */
        {Q8, F16, 128, 64, 8, 2, 90, 0, VNNI, TILE},     /* the most rows an item holds (ATT_RMAX) */
        {F16, F32, 80, 1, 8, 4, 90, 0, VNNI, FUSED},
        {F32, F32, 8, 1, 8, 4, 90, 0, TILE, TILE},       /* head dims that are no multiple of 16 */
        {F16, F16, 8, 1, 8, 4, 90, 0, FUSED, FUSED},
        {Q8, Q8, 32, 1, 8, 4, 90, 0, FUSED, FUSED},      /* q8_0 at VNNI wants hd % 64 == 0 */
        {F16, Q4, 64, 1, 8, 4, 90, 0, VNNI, FUSED},      /* q4_0 as q8_0 */
        {Q4, Q8, 64, 1, 8, 4, 90, 0, VNNI, FUSED},
        {Q4, Q4, 64, 40, 8, 8, 90, 0, VNNI, TILE},
        {Q4, F16, 32, 1, 8, 4, 90, 0, FUSED, FUSED},
        {KC, F16, 64, 1, 8, 4, 90, 1, FUSED, FUSED},     /* q4_kc keys keep the AVX2 kernels, staging block and all */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int *c = cases[i];
        for (int level = 0; level <= op_cpu_simd_level(); level++) {
            op_set_simd_level(level);
            int want = level == OP_SIMD_VNNI ? c[8] : level == OP_SIMD_AVX2 ? c[9] : OP_ATT_SCALAR;
            int got = kernel_of(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]);
            if (got != want)
                fail_msg("case %zu (%s/%s hd %d T %d) at level %d: kernel %d, want %d", i, kvlm_cache_type_name(c[0]),
                         kvlm_cache_type_name(c[1]), c[2], c[3], level, got, want);
        }
    }
    op_set_simd_level(-1);
    if (op_cpu_simd_level() < OP_SIMD_VNNI) return;
    /* At the VNNI level, prefill and decode run one kernel over f32 / f16 /
     * bf16 / q8_0 / q4_0 caches: T tokens at once give the bits of T calls of
     * one token each (q8_0 / q4_0 keys: each row's query rounded to int8 alike) */
    const int pairs[][2] = {{F32, F32}, {F16, F16}, {BF16, F16}, {Q8, Q8}, {Q8, F16}, {F16, Q8}, {Q4, Q4}, {Q4, Q8}};
    for (int pi = 0; pi < 8; pi++) {
        acase c = {6, 40, 8, 2, 64, 16};
        int n_pos = c.q_pos0 + c.T, hd = c.hd;
        size_t stride = (size_t)n_pos * hd, per = (size_t)c.n_heads * hd, nq = c.T * per;
        float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
        float *q = rand_floats(nq, 1.0f), *o1 = malloc(nq * sizeof(float)), *o2 = malloc(nq * sizeof(float));
        uint8_t *work = malloc(op_attention_work_size(1, hd));
        typed_cache tc;
        build_cache(&tc, &c, pairs[pi][0], pairs[pi][1], k, v);
        op_attention(NULL, o1, q, &tc.a, work);
        for (int t = 0; t < c.T; t++) {
            op_attn_args a = tc.a;
            a.T = 1;
            a.q_pos0 = c.q_pos0 + t;
            op_attention(NULL, o2 + t * per, q + t * per, &a, work);
        }
        assert_memory_equal(o1, o2, nq * sizeof(float));
        free(k); free(v); free(q); free(o1); free(o2); free(work);
        free_cache(&tc);
    }
}

/* f32 through the typed-layout fields reads the same bytes as the float
 * strides: bit-identical results, fast and reference. */
static void test_attention_f32_unchanged(void **state) {
    (void)state;
    const acase cases[] = {{1, 200, 8, 2, 64, 16}, {37, 90, 4, 4, 16, 7}, {5, 3, 6, 3, 8, 16}};
    for (int ci = 0; ci < 3; ci++) {
        acase c = cases[ci];
        int n_pos = c.q_pos0 + c.T, hd = c.hd;
        size_t stride = (size_t)n_pos * hd, nq = (size_t)c.T * c.n_heads * hd;
        float *k = rand_floats(stride * c.n_kv_heads, 1.0f), *v = rand_floats(stride * c.n_kv_heads, 1.0f);
        float *q = rand_floats(nq, 1.0f);
        typed_cache tc;
        build_cache(&tc, &c, KVLM_CACHE_F32, KVLM_CACHE_F32, k, v);
        op_attn_args fa = tc.a; /* the same blocks through the float strides */
        fa.head_bytes = fa.v_bytes = 0;
        fa.head_stride = 2 * (size_t)c.bs * hd;
        fa.v_offset = (size_t)c.bs * hd;
        op_attn_args ca = {0}; /* and contiguous */
        ca.T = c.T; ca.q_pos0 = c.q_pos0; ca.n_heads = c.n_heads; ca.n_kv_heads = c.n_kv_heads; ca.head_dim = hd;
        ca.k = k; ca.v = v; ca.kv_head_stride = stride; ca.scale = tc.a.scale;
        float *o1 = malloc(nq * sizeof(float)), *o2 = malloc(nq * sizeof(float)), *o3 = malloc(nq * sizeof(float));
        uint8_t *work = malloc(op_attention_work_size(1, hd));
        for (int level = 0; level <= op_cpu_simd_level(); level++) {
            op_set_simd_level(level);
            op_attention(NULL, o1, q, &tc.a, work);
            op_attention(NULL, o2, q, &fa, work);
            op_attention(NULL, o3, q, &ca, work);
            assert_memory_equal(o1, o2, nq * sizeof(float));
            assert_memory_equal(o1, o3, nq * sizeof(float));
        }
        op_set_simd_level(-1);
        op_attention_ref(o1, q, &tc.a);
        op_attention_ref(o2, q, &ca);
        assert_memory_equal(o1, o2, nq * sizeof(float));
        free(work); free(o1); free(o2); free(o3); free(k); free(v); free(q);
        free_cache(&tc);
    }
}

/* ---- the engine ----------------------------------------------------------------- */
static kvlm_ctx *make_ctx(kvlm_model *m, int kt, int vt, int n_seq, int n_ctx, bool prefix) {
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_threads = 2;
    cp.n_ctx = n_ctx;
    cp.n_seq_max = n_seq;
    cp.cache_type_k = kt;
    cp.cache_type_v = vt;
    cp.no_prefix_cache = !prefix;
    kvlm_error err = {0};
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (!ctx) fail_msg("ctx: %s", err.msg);
    return ctx;
}

static kvlm_model *load_stories(void) {
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) return NULL;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    return m;
}

static int32_t *corpus_tokens(kvlm_model *m, int *n) {
    const char *cp = tu_corpus_path("tinystories-valid-head.txt");
    if (!cp) return NULL;
    size_t len;
    char *text = tu_read_file(cp, &len);
    assert_non_null(text);
    if (len > 200000) len = 200000;
    kvlm_error err = {0};
    int cnt = kvlm_tokenize(m, text, len, kvlm_add_bos(m), false, NULL, 0, &err);
    assert_true(cnt > 0);
    int32_t *t = malloc(sizeof(int32_t) * (size_t)cnt);
    kvlm_tokenize(m, text, len, kvlm_add_bos(m), false, t, cnt, &err);
    free(text);
    *n = cnt;
    return t;
}

static void test_bytes_and_errors(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    if (!m) skip();
    const kvlm_config *c = kvlm_model_config(m);
    /* stories260K: 5 layers, 4 KV heads, head_dim 8 (one group per row) */
    const int pairs[][2] = {{KVLM_CACHE_F32, KVLM_CACHE_F32}, {KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0},
                            {KVLM_CACHE_Q4_KC, KVLM_CACHE_Q4_0}, {KVLM_CACHE_F16, KVLM_CACHE_Q8_0}};
    for (int i = 0; i < 4; i++) {
        kvlm_ctx *ctx = make_ctx(m, pairs[i][0], pairs[i][1], 1, 64, true);
        double ek = kvlm_cache_type_elem_bytes(pairs[i][0], c->head_dim, 16),
               ev = kvlm_cache_type_elem_bytes(pairs[i][1], c->head_dim, 16);
        size_t want = (size_t)((double)c->n_layers * c->n_kv_heads * c->head_dim * (ek + ev) + 0.5);
        kvlm_kv_stats st;
        kvlm_kv_stats_get(ctx, &st);
        assert_int_equal(st.bytes_per_token, want);
        assert_int_equal(st.type_k, pairs[i][0]);
        int32_t toks[21] = {1};
        for (int t = 1; t < 21; t++) toks[t] = 10 + t;
        kvlm_batch b = {21, toks, NULL, NULL, NULL};
        kvlm_error err = {0};
        assert_int_equal(kvlm_decode(ctx, &b, &err), KVLM_OK);
        assert_int_equal(kvlm_ctx_kv_bytes(ctx), 21 * want);
        if (pairs[i][0] == KVLM_CACHE_Q4_KC)
            assert_int_equal(st.stage_bytes, (size_t)c->n_layers * c->n_kv_heads * 16 * c->head_dim * 2);
        else assert_int_equal(st.stage_bytes, 0);
        kvlm_ctx_free(ctx);
    }
    assert_int_equal(kvlm_cache_type_elem_bytes(KVLM_CACHE_Q8_0, c->head_dim, 16) * 2 * 5 * 4 * 8, 400);
    /* q4_kc is no value type; unknown ids are refused */
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 64;
    cp.cache_type_v = KVLM_CACHE_Q4_KC;
    kvlm_error err = {0};
    assert_null(kvlm_ctx_create(m, &cp, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
    assert_non_null(strstr(err.msg, "q4_kc"));
    cp.cache_type_v = 0;
    cp.cache_type_k = 5;
    assert_null(kvlm_ctx_create(m, &cp, &err));
    kvlm_model_free(m);
}

static double ppl_of(kvlm_model *m, int kt, int vt, const int32_t *toks, int n, int chunks) {
    kvlm_ctx *ctx = make_ctx(m, kt, vt, 1, 512, false);
    kvlm_ppl_result r;
    kvlm_error err = {0};
    if (kvlm_perplexity(ctx, toks, n, chunks, NULL, NULL, &r, &err)) fail_msg("perplexity: %s", err.msg);
    kvlm_ctx_free(ctx);
    return r.ppl;
}

static void test_perplexity_q8(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    if (!m) skip();
    int n;
    int32_t *toks = corpus_tokens(m, &n);
    if (!toks) { kvlm_model_free(m); skip(); }
    int chunks = 6; /* fewer chunks are too noisy for a 0.5% bound (2 chunks: 0.7%) */
    double f = ppl_of(m, KVLM_CACHE_F32, KVLM_CACHE_F32, toks, n, chunks);
    double q = ppl_of(m, KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0, toks, n, chunks);
    double kc = ppl_of(m, KVLM_CACHE_Q4_KC, KVLM_CACHE_Q8_0, toks, n, chunks);
    fprintf(stderr, "perplexity over %d chunks: f32 %.4f, q8_0/q8_0 %.4f, q4_kc/q8_0 %.4f\n", chunks, f, q, kc);
    assert_true(fabs(q / f - 1) < 0.005);
    assert_true(fabs(kc / f - 1) < 0.05);
    free(toks);
    kvlm_model_free(m);
}

/* Logits after each of the n tokens, fed `step` at a time into sequence seq. */
static float *run(kvlm_ctx *ctx, int seq, const int32_t *ids, int n, int step, int V) {
    float *out = malloc(sizeof(float) * (size_t)V * n);
    int8_t *want = malloc((size_t)n);
    int32_t *seqs = malloc(sizeof(int32_t) * (size_t)n);
    memset(want, 1, (size_t)n);
    for (int i = 0; i < n; i++) seqs[i] = seq;
    kvlm_error err = {0};
    for (int i = 0; i < n; i += step) {
        int T = n - i < step ? n - i : step;
        kvlm_batch b = {T, ids + i, NULL, want, seqs};
        if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
        for (int r = 0; r < T; r++) memcpy(out + (size_t)(i + r) * V, kvlm_get_logits(ctx, r), sizeof(float) * V);
    }
    free(want);
    free(seqs);
    return out;
}

/* max over rows of max |a - b| / max |b| */
static double max_err(const float *a, const float *b, int n_rows, int V) {
    double worst = 0;
    for (int t = 0; t < n_rows; t++) {
        double scale = 1e-3, e = 0;
        for (int v = 0; v < V; v++) {
            scale = fmax(scale, fabs(b[(size_t)t * V + v]));
            e = fmax(e, fabs(a[(size_t)t * V + v] - b[(size_t)t * V + v]));
        }
        worst = tu_worse(worst, e / scale);
    }
    return worst;
}

/* Prefill in one batch against token-by-token decode, per cache type.
 * Per-token types quantize each row from that row alone, so the two differ
 * only by float summation order, amplified at most by an occasional code
 * that rounds the other way: 1e-4 of the largest logit (measured: ~3e-7).
 * q4_kc differs by design: while decoding, the tokens of a filling block see
 * their block's keys in f16, while a prefill sees every full block quantized;
 * that difference must stay below q4_kc's own error against f32. */
static void test_decode_equals_prefill(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    if (!m) skip();
    int V = kvlm_vocab_size(m), n = 45;
    int32_t ids[45];
    for (int i = 0; i < n; i++) ids[i] = i == 0 ? 1 : 20 + (i * 37) % 400;
    const int pairs[][2] = {{KVLM_CACHE_Q8_0, KVLM_CACHE_Q8_0}, {KVLM_CACHE_F16, KVLM_CACHE_BF16},
                            {KVLM_CACHE_Q4_0, KVLM_CACHE_Q8_0}, {KVLM_CACHE_Q4_KC, KVLM_CACHE_Q4_0}};
    for (int i = 0; i < 4; i++) {
        kvlm_ctx *a = make_ctx(m, pairs[i][0], pairs[i][1], 1, 128, false);
        kvlm_ctx *b = make_ctx(m, pairs[i][0], pairs[i][1], 1, 128, false);
        float *pre = run(a, 0, ids, n, n, V), *dec = run(b, 0, ids, n, 1, V);
        double e = max_err(dec, pre, n, V);
        kvlm_ctx *f = make_ctx(m, KVLM_CACHE_F32, KVLM_CACHE_F32, 1, 128, false);
        float *exact = run(f, 0, ids, n, n, V);
        double eq = max_err(pre, exact, n, V);
        fprintf(stderr, "%s/%s: decode vs prefill %.3g, prefill vs f32 %.3g\n", kvlm_cache_type_name(pairs[i][0]),
                kvlm_cache_type_name(pairs[i][1]), e, eq);
        assert_true(pairs[i][0] == KVLM_CACHE_Q4_KC ? e < 1.5 * eq : e < 1e-4);
        free(exact);
        kvlm_ctx_free(f);
        free(pre);
        free(dec);
        kvlm_ctx_free(a);
        kvlm_ctx_free(b);
    }
    kvlm_model_free(m);
}

/* Forks share the quantized blocks and copy q4_kc's staging: the child's
 * continuation equals a fresh run of the same tokens, bit for bit, and the
 * parent is undisturbed; prefix reuse attaches quantized full blocks and
 * gives what a cold run gives. */
static void test_fork_and_prefix(void **state) {
    (void)state;
    kvlm_model *m = load_stories();
    if (!m) skip();
    int V = kvlm_vocab_size(m);
    int32_t ids[60];
    for (int i = 0; i < 60; i++) ids[i] = i == 0 ? 1 : 30 + (i * 53) % 450;
    const int pairs[][2] = {{KVLM_CACHE_Q4_KC, KVLM_CACHE_Q4_0}, {KVLM_CACHE_Q8_0, KVLM_CACHE_F16}};
    for (int pi = 0; pi < 2; pi++) {
        int kt = pairs[pi][0], vt = pairs[pi][1];
        /* fork after 37 tokens (a partly filled block), then different tails */
        kvlm_ctx *ctx = make_ctx(m, kt, vt, 2, 128, true);
        free(run(ctx, 0, ids, 37, 37, V));
        kvlm_error err = {0};
        assert_int_equal(kvlm_seq_fork(ctx, 0, 1, &err), KVLM_OK);
        float *child = run(ctx, 1, ids + 40, 20, 1, V);
        float *parent = run(ctx, 0, ids + 37, 23, 1, V);
        kvlm_ctx *fresh = make_ctx(m, kt, vt, 1, 128, false);
        int32_t cids[57];
        memcpy(cids, ids, sizeof(int32_t) * 37);
        memcpy(cids + 37, ids + 40, sizeof(int32_t) * 20);
        free(run(fresh, 0, cids, 37, 37, V));
        float *want_child = run(fresh, 0, cids + 37, 20, 1, V);
        assert_memory_equal(child, want_child, sizeof(float) * V * 20);
        kvlm_ctx_reset(fresh);
        free(run(fresh, 0, ids, 37, 37, V));
        float *want_parent = run(fresh, 0, ids + 37, 23, 1, V);
        assert_memory_equal(parent, want_parent, sizeof(float) * V * 23);
        free(child); free(parent); free(want_child); free(want_parent);
        kvlm_ctx_free(fresh);

        kvlm_ctx_free(ctx);
        /* prefix reuse: seq 0's full blocks are indexed; a new prompt sharing
         * its first 48 tokens reuses three blocks (a fresh pool, so they are
         * the prefill's blocks, not those the decode above indexed) */
        ctx = make_ctx(m, kt, vt, 2, 128, true);
        free(run(ctx, 0, ids, 60, 60, V));
        kvlm_seq_free(ctx, 0);
        int32_t p2[56];
        memcpy(p2, ids, sizeof(int32_t) * 48);
        for (int i = 48; i < 56; i++) p2[i] = 7 + i;
        int reused = kvlm_seq_reuse_prefix(ctx, 1, p2, 56);
        assert_int_equal(reused, 48);
        float *warm = run(ctx, 1, p2 + reused, 56 - reused, 56 - reused, V);
        kvlm_ctx *cold = make_ctx(m, kt, vt, 1, 128, false);
        free(run(cold, 0, p2, 48, 48, V));
        float *want = run(cold, 0, p2 + 48, 8, 8, V);
        double e = max_err(warm, want, 8, V);
        fprintf(stderr, "%s/%s: prefix reuse vs cold %.3g\n", kvlm_cache_type_name(kt), kvlm_cache_type_name(vt), e);
        assert_true(e < 1e-5);
        free(warm); free(want);
        kvlm_ctx_free(cold);
        kvlm_ctx_free(ctx);
    }
    /* another cache type never reuses these blocks: the types are in the salt */
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_sizes),
        cmocka_unit_test(test_roundtrip_bounds),
        cmocka_unit_test(test_f16_write),
        cmocka_unit_test(test_attention_typed),
        cmocka_unit_test(test_attention_kernels),
        cmocka_unit_test(test_attention_window),
        cmocka_unit_test(test_attention_f32_unchanged),
        cmocka_unit_test(test_bytes_and_errors),
        cmocka_unit_test(test_perplexity_q8),
        cmocka_unit_test(test_decode_equals_prefill),
        cmocka_unit_test(test_fork_and_prefix),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
