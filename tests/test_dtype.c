/* tests/test_dtype: element types: traits, half-precision conversions, exact
 * dequantization of hand-built blocks, and quantize round-trip error bounds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "dtype/dtype.h"
#include "dtype/iq.h"
#include "dtype/tq.h"

static float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static void test_traits(void **state) {
    (void)state;
    const int ok[] = {DT_F32,     DT_F16,    DT_BF16,    DT_Q8_0,    DT_Q4_0,   DT_Q4_1,  DT_Q5_0,
                      DT_Q5_1,    DT_Q4_K,   DT_Q5_K,    DT_Q6_K,    DT_Q8_K,   DT_Q2_K,  DT_Q3_K,
                      DT_IQ4_NL,  DT_IQ4_XS, DT_IQ2_XXS, DT_IQ2_XS,  DT_IQ2_S,  DT_IQ3_XXS, DT_IQ3_S,
                      DT_IQ1_S,   DT_IQ1_M,  DT_MXFP4,   DT_TQ1_0,   DT_TQ2_0};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        const dt_traits *t = dt_info(ok[i]);
        assert_non_null(t);
        assert_int_equal(dt_from_name(t->name), ok[i]);
        assert_string_equal(dt_name(ok[i]), t->name);
    }
    assert_int_equal(dt_info(DT_Q4_0)->type_size, 18);
    assert_int_equal(dt_info(DT_Q4_K)->type_size, 144);
    assert_int_equal(dt_info(DT_Q5_K)->type_size, 176);
    assert_int_equal(dt_info(DT_Q6_K)->type_size, 210);
    assert_int_equal(dt_info(DT_Q8_K)->type_size, 292);
    assert_int_equal(dt_info(DT_Q8_K)->block_size, 256);
    /* ggml's sizes: Q2_K 2 + 2 + 16 + 64, Q3_K 2 + 12 + 32 + 64, IQ4_NL 2 + 16, IQ4_XS 2 + 2 + 4 + 128 */
    assert_int_equal(dt_info(DT_Q2_K)->type_size, 84);
    assert_int_equal(dt_info(DT_Q3_K)->type_size, 110);
    assert_int_equal(dt_info(DT_IQ4_NL)->type_size, 18);
    assert_int_equal(dt_info(DT_IQ4_NL)->block_size, 32);
    assert_int_equal(dt_info(DT_IQ4_XS)->type_size, 136);
    assert_int_equal(dt_info(DT_IQ4_XS)->block_size, 256);
    assert_int_equal(dt_from_name("IQ4_XS"), DT_IQ4_XS);
    /* ggml's sizes of the codebook types: d + qs (+ scales, qh, signs) */
    const struct { int type; size_t bytes; } iq[] = {{DT_IQ2_XXS, 66}, {DT_IQ2_XS, 74}, {DT_IQ2_S, 82},
                                                     {DT_IQ3_XXS, 98}, {DT_IQ3_S, 110}, {DT_IQ1_S, 50}, {DT_IQ1_M, 56}};
    for (size_t i = 0; i < sizeof iq / sizeof iq[0]; i++) {
        assert_int_equal(dt_info(iq[i].type)->type_size, iq[i].bytes);
        assert_int_equal(dt_info(iq[i].type)->block_size, 256);
    }
    /* ggml's sizes: MXFP4 e + 16 bytes of nibbles per 32; TQ1_0 48 + 4 + 2, TQ2_0 64 + 2 per 256 */
    assert_int_equal(dt_info(DT_MXFP4)->type_size, 17);
    assert_int_equal(dt_info(DT_MXFP4)->block_size, 32);
    assert_int_equal(dt_info(DT_TQ1_0)->type_size, 54);
    assert_int_equal(dt_info(DT_TQ2_0)->type_size, 66);
    assert_int_equal(dt_info(DT_TQ1_0)->block_size, 256);
    assert_int_equal(dt_from_name("TQ1_0"), DT_TQ1_0);
    assert_int_equal(dt_from_name("MXFP4"), DT_MXFP4);
    assert_int_equal(dt_from_name("IQ2_XXS"), DT_IQ2_XXS);
    assert_int_equal(dt_from_name("iq1_m"), DT_IQ1_M);
    assert_int_equal(dt_from_name("q2_k"), DT_Q2_K);
    /* ggml types kvlm does not compute with: known layout, no traits */
    assert_null(dt_info(DT_Q8_1));
    assert_non_null(dt_layout(DT_Q8_1));
    assert_int_equal(dt_layout(DT_Q8_1)->type_size, 36);
    assert_string_equal(dt_name(DT_Q8_1), "q8_1");
    assert_null(dt_info(24)); /* i8 */
    assert_null(dt_info(-1));
    assert_null(dt_info(4));
    assert_null(dt_layout(4));
    assert_null(dt_info(DT_COUNT));
    assert_null(dt_info(1000));
    assert_string_equal(dt_name(4), "unknown");
    assert_int_equal(dt_from_name("Q4_K"), DT_Q4_K);
    assert_int_equal(dt_from_name("q4_k"), DT_Q4_K);
    assert_int_equal(dt_from_name("Q6_k"), DT_Q6_K);
    assert_int_equal(dt_from_name("BF16"), DT_BF16);
    assert_int_equal(dt_from_name("q8_k"), DT_Q8_K);
    assert_int_equal(dt_from_name("q5_k"), DT_Q5_K);
    assert_int_equal(dt_from_name("q8_1"), -1); /* not supported */
    assert_int_equal(dt_from_name("nope"), -1);
    assert_int_equal(dt_from_name(NULL), -1);
    assert_int_equal(dt_row_size(DT_F32, 7), 28);
    assert_int_equal(dt_row_size(DT_Q8_0, 64), 68);
    assert_int_equal(dt_row_size(DT_Q4_K, 512), 288);
    assert_int_equal(dt_row_size(DT_Q4_K, 100), 0);
    assert_int_equal(dt_row_size(99, 32), 0);
    float x[32] = {0};
    uint8_t out[64];
    assert_int_equal(dt_quantize_row(DT_Q8_1, x, out, 32), -1); /* q8_1: no quantizer */
    assert_int_equal(dt_quantize_row(DT_Q8_0, x, out, 31), -1);
}

static void test_f16(void **state) {
    (void)state;
    assert_int_equal(dt_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(dt_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(dt_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(dt_f32_to_f16(65519.0f), 0x7bff); /* below the halfway point to 65536 */
    assert_int_equal(dt_f32_to_f16(65520.0f), 0x7c00); /* halfway: rounds to even = overflow */
    assert_int_equal(dt_f32_to_f16(1e10f), 0x7c00);
    assert_int_equal(dt_f32_to_f16(-INFINITY), 0xfc00);
    assert_int_equal(dt_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(dt_f32_to_f16(-0.0f), 0x8000);
    uint16_t hn = dt_f32_to_f16(NAN);
    assert_int_equal(hn & 0x7c00, 0x7c00);
    assert_true(hn & 0x3ff);
    assert_true(isnan(dt_f16_to_f32(hn)));
    /* round to nearest even at the 11th bit */
    assert_int_equal(dt_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00);     /* tie -> even (down) */
    assert_int_equal(dt_f32_to_f16(1.0f + 3 * ldexpf(1, -11)), 0x3c02); /* tie -> even (up) */
    assert_int_equal(dt_f32_to_f16(1.0f + ldexpf(1, -11) + ldexpf(1, -20)), 0x3c01);
    /* subnormals: smallest 2^-24, largest normal boundary 2^-14 */
    assert_int_equal(dt_f32_to_f16(ldexpf(1, -24)), 0x0001);
    assert_int_equal(dt_f32_to_f16(ldexpf(1, -25)), 0x0000);                 /* tie -> even 0 */
    assert_int_equal(dt_f32_to_f16(ldexpf(3, -26)), 0x0001);                 /* 0.75 ulp -> 1 */
    assert_int_equal(dt_f32_to_f16(ldexpf(3, -25)), 0x0002);                 /* 1.5 ulp tie -> 2 */
    assert_int_equal(dt_f32_to_f16(ldexpf(1, -14)), 0x0400);
    assert_int_equal(dt_f32_to_f16(ldexpf(1023, -24)), 0x03ff);
    assert_int_equal(dt_f32_to_f16(ldexpf(2047, -25)), 0x0400);              /* rounds up into normals */
    assert_int_equal(dt_f32_to_f16(-ldexpf(5, -24)), 0x8005);
    assert_true(dt_f16_to_f32(0x0001) == ldexpf(1, -24));
    assert_true(dt_f16_to_f32(0x03ff) == ldexpf(1023, -24));
    assert_true(dt_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(isinf(dt_f16_to_f32(0x7c00)));
    /* every half survives f16 -> f32 -> f16 (NaNs stay NaN) */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = dt_f16_to_f32((dt_f16)h);
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
            assert_true(isnan(f));
            continue;
        }
        assert_int_equal(dt_f32_to_f16(f), h);
    }
#ifdef __FLT16_MAX__
    /* the compiler's own conversion (round to nearest even) as a second opinion */
    uint64_t s = 12345;
    for (int i = 0; i < 200000; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        uint32_t b = (uint32_t)(s >> 32);
        /* keep to magnitudes around the half range, including subnormals */
        b = (b & 0x807fffffu) | ((uint32_t)(100 + (s >> 20) % 50) << 23);
        float f = bits_f32(b);
        _Float16 h = (_Float16)f;
        uint16_t hb;
        memcpy(&hb, &h, 2);
        assert_int_equal(dt_f32_to_f16(f), hb);
    }
#endif
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(dt_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(dt_f32_to_bf16(bits_f32(0x3f808000u)), 0x3f80); /* tie -> even */
    assert_int_equal(dt_f32_to_bf16(bits_f32(0x3f818000u)), 0x3f82); /* tie -> even */
    assert_int_equal(dt_f32_to_bf16(bits_f32(0x3f808001u)), 0x3f81);
    assert_int_equal(dt_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(dt_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(dt_f32_to_bf16(bits_f32(0x7f7fffffu)), 0x7f80); /* FLT_MAX rounds to inf */
    assert_int_equal(dt_f32_to_bf16(bits_f32(0x00000001u)), 0x0000); /* tiny subnormal */
    assert_int_equal(dt_f32_to_bf16(bits_f32(0x00018000u)), 0x0002); /* subnormal tie -> even */
    assert_true(isnan(dt_bf16_to_f32(dt_f32_to_bf16(NAN))));
    assert_true(isnan(dt_bf16_to_f32(dt_f32_to_bf16(bits_f32(0x7f800001u))))); /* NaN must not become inf */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = dt_bf16_to_f32((dt_bf16)h);
        assert_int_equal(f32_bits(f), h << 16);
        if (!isnan(f)) assert_int_equal(dt_f32_to_bf16(f), h);
    }
}

/* ---- dequantizers on hand-built blocks ---- */

static void test_deq_q4_0_q8_0(void **state) {
    (void)state;
    block_q4_0 b4;
    b4.d = 0x3800; /* 0.5 */
    for (int j = 0; j < 16; j++) b4.qs[j] = (uint8_t)(j | ((15 - j) << 4));
    float y[32];
    dt_dequantize_row(DT_Q4_0, &b4, y, 32);
    for (int j = 0; j < 16; j++) {
        assert_true(y[j] == (float)(j - 8) * 0.5f);
        assert_true(y[16 + j] == (float)(7 - j) * 0.5f);
    }
    block_q8_0 b8;
    b8.d = 0x3400; /* 0.25 */
    for (int j = 0; j < 32; j++) b8.qs[j] = (int8_t)(j * 8 - 128);
    dt_dequantize_row(DT_Q8_0, &b8, y, 32);
    for (int j = 0; j < 32; j++) assert_true(y[j] == (float)(j * 8 - 128) * 0.25f);
}

/* Q4_K and Q5_K blocks share d, dmin and the 12 bytes of scales, packed by
 * hand: bytes 0-3 scales 0-3 (+2 high bits of scales 4-7), bytes 4-7 mins 0-3
 * (+2 high bits of mins 4-7), bytes 8-11 low nibbles of scales 4-7 and (high
 * nibble) mins 4-7; and the same nibbles. Q5_K adds element 64c + l's 5th bit
 * at bit 2c of qh[l] and element 64c + 32 + l's at bit 2c + 1 (ggml's
 * dequantize_row_q5_K). Checks every element of one block of each. */
static void check_deq_qk(int q5) {
    static const int sc[8] = {1, 2, 3, 4, 17, 3, 37, 55}, mn[8] = {5, 6, 7, 8, 18, 4, 6, 56};
    const uint8_t packed[12] = {0x41, 0x02, 0x83, 0xC4, 0x45, 0x06, 0x07, 0xC8, 0x21, 0x43, 0x65, 0x87};
    block_q5_K b; /* Q4_K's fields are its first ones, then qh (unused by Q4_K) */
    block_q4_K b4;
    b.d = b4.d = 0x3c00;    /* 1.0 */
    b.dmin = b4.dmin = 0x3800; /* 0.5 */
    memcpy(b.scales, packed, 12);
    memcpy(b4.scales, packed, 12);
    for (int k = 0; k < 128; k++) b.qs[k] = b4.qs[k] = (uint8_t)((k & 15) | (((k * 7) & 15) << 4));
    for (int k = 0; k < 32; k++) b.qh[k] = (uint8_t)(k * 53 + 17);
    float y[256];
    dt_dequantize_row(q5 ? DT_Q5_K : DT_Q4_K, q5 ? (const void *)&b : (const void *)&b4, y, 256);
    for (int e = 0; e < 256; e++) {
        int c = e / 64, p = e % 64, sub = 2 * c + (p >= 32);
        uint8_t byte = b.qs[32 * c + p % 32];
        int q = (p < 32 ? (byte & 15) : (byte >> 4)) + (q5 ? 16 * ((b.qh[p % 32] >> sub) & 1) : 0);
        float want = 1.0f * (float)sc[sub] * (float)q - 0.5f * (float)mn[sub];
        assert_true(y[e] == want);
    }
    if (!q5) { /* a few worked by hand */
        assert_true(y[0] == -2.5f);  /* q 0, min 5 */
        assert_true(y[33] == 11.0f); /* q 7 * scale 2 - 0.5 * 6 */
        assert_true(y[200] == 293.0f); /* q 8 * 37 - 0.5 * 6 */
        assert_true(y[255] == 467.0f); /* q 9 * 55 - 0.5 * 56 */
    } else {
        assert_true(y[0] == 16.0f - 2.5f); /* nibble 0, qh[0] = 17 (bit 0 set): q 16, scale 1, min 5 */
        assert_true(y[255] == 9.0f * 55.0f - 28.0f); /* nibble 9, qh[31] = 124: bit 7 clear */
    }
}
static void test_deq_q4_K(void **state) { (void)state; check_deq_qk(0); }
static void test_deq_q5_K(void **state) { (void)state; check_deq_qk(1); }

/* Q4_1, Q5_0, Q5_1 (ggml's dequantize_row_q4_1 / q5_0 / q5_1): element j's
 * nibble in byte j % 16 (low for j < 16), its 5th bit bit j of qh. */
static void test_deq_legacy(void **state) {
    (void)state;
    block_q4_1 a = {.d = 0x3800, .m = 0xbc00}; /* 0.5, -1 */
    block_q5_0 b = {.d = 0x4000};              /* 2 */
    block_q5_1 c = {.d = 0x3400, .m = 0x3c00}; /* 0.25, 1 */
    const uint8_t qh[4] = {0x35, 0x00, 0xf0, 0x81};
    for (int k = 0; k < 16; k++) a.qs[k] = b.qs[k] = c.qs[k] = (uint8_t)(k | ((15 - k) << 4));
    memcpy(b.qh, qh, 4);
    memcpy(c.qh, qh, 4);
    float ya[32], yb[32], yc[32];
    dt_dequantize_row(DT_Q4_1, &a, ya, 32);
    dt_dequantize_row(DT_Q5_0, &b, yb, 32);
    dt_dequantize_row(DT_Q5_1, &c, yc, 32);
    uint32_t h = 0x81f00035u;
    for (int j = 0; j < 32; j++) {
        int nib = j < 16 ? j : 15 - (j - 16), q5 = nib | (int)((h >> j) & 1) << 4;
        assert_true(ya[j] == 0.5f * (float)nib - 1.0f);
        assert_true(yb[j] == 2.0f * (float)(q5 - 16));
        assert_true(yc[j] == 0.25f * (float)q5 + 1.0f);
    }
    /* by hand: element 0 has bit 0 of qh (0x35) set: q5 16; element 31: nibble 0, bit 31 set: 16 */
    assert_true(yb[0] == 0.0f && yb[31] == 0.0f);
    assert_true(yb[1] == 2.0f * (1 - 16)); /* bit 1 of 0x35 clear */
    assert_true(yc[2] == 0.25f * 18 + 1.0f); /* bit 2 set: 2 + 16 */
}

static void test_deq_q6_K_q8_K(void **state) {
    (void)state;
    block_q6_K b;
    b.d = 0x3800; /* 0.5 */
    for (int k = 0; k < 128; k++) b.ql[k] = (uint8_t)k;
    for (int k = 0; k < 64; k++) b.qh[k] = (uint8_t)(k * 37);
    for (int k = 0; k < 16; k++) b.scales[k] = (int8_t)(k - 8);
    float y[256];
    dt_dequantize_row(DT_Q6_K, &b, y, 256);
    for (int e = 0; e < 256; e++) {
        int h = e / 128, p = e % 128;
        uint8_t l = b.ql[64 * h + (p & 63)];
        int lo = p < 64 ? (l & 15) : (l >> 4);
        int hi = (b.qh[32 * h + (p & 31)] >> (2 * (p / 32))) & 3;
        float want = 0.5f * (float)b.scales[e / 16] * (float)((lo | (hi << 4)) - 32);
        assert_true(y[e] == want);
    }
    assert_true(y[0] == 128.0f);  /* q -32, scale -8 */
    assert_true(y[200] == -56.0f); /* lo 4 (high nibble of ql[72]), hi 0, scale 4 */

    block_q8_K k8;
    memset(&k8, 0, sizeof k8);
    k8.d = 0.125f;
    for (int j = 0; j < 256; j++) k8.qs[j] = (int8_t)(j - 128);
    dt_dequantize_row(DT_Q8_K, &k8, y, 256);
    for (int j = 0; j < 256; j++) assert_true(y[j] == (float)(j - 128) * 0.125f);
}

/* ---- Q2_K, Q3_K, IQ4_NL, IQ4_XS against ggml's layout ------------------------
 * The blocks are raw bytes at ggml's offsets (block_q2_K: scales[16], qs[64],
 * d, dmin; block_q3_K: hmask[32], qs[64], scales[12], d; block_iq4_nl: d,
 * qs[16]; block_iq4_xs: d, scales_h, scales_l[4], qs[128]), and the expected
 * values follow the loop structure of ggml's dequantize_row_* (not kvlm's
 * code), so both the struct offsets and every bit field are checked. */
static const int8_t k_iq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void test_deq_q2_K_layout(void **state) {
    (void)state;
    uint8_t blk[84];
    for (int k = 0; k < 16; k++) blk[k] = (uint8_t)(k | ((k * 7 + 3) & 15) << 4); /* every scale and min nibble */
    for (int k = 0; k < 64; k++) blk[16 + k] = (uint8_t)(k * 37 + 11);
    blk[80] = 0x00, blk[81] = 0x3c; /* d = 1 (f16 0x3c00, little-endian) */
    blk[82] = 0x00, blk[83] = 0x38; /* dmin = 0.5 */
    float y[256], want[256];
    dt_dequantize_row(DT_Q2_K, blk, y, 256);
    int o = 0, is = 0;
    for (int n = 0; n < 256; n += 128) {
        const uint8_t *q = blk + 16 + n / 4;
        for (int shift = 0; shift < 8; shift += 2)
            for (int half = 0; half < 2; half++) {
                int sc = blk[is++];
                for (int l = 0; l < 16; l++) want[o++] = (float)(sc & 15) * (float)((q[l + 16 * half] >> shift) & 3) - 0.5f * (float)(sc >> 4);
            }
    }
    for (int e = 0; e < 256; e++) assert_true(y[e] == want[e]);
    /* by hand: element 0: qs[0] = 11 -> bits 0..1 = 3, scale 0, min 3 -> -1.5;
     * element 17: qs[17] = 0x80 -> 0, scale 1, min 10 -> -5; element 200 (half 1,
     * j 2, l 8): qs[40] = 0xd3 -> bits 4..5 = 1, sub-block 12: scale 12, min 7 -> 12 - 3.5 */
    assert_true(y[0] == -1.5f);
    assert_true(y[17] == -5.0f);
    assert_true(y[200] == 8.5f);
}

static void test_deq_q3_K_layout(void **state) {
    (void)state;
    uint8_t blk[110];
    for (int k = 0; k < 32; k++) blk[k] = (uint8_t)(k * 29 + 5);           /* hmask */
    for (int k = 0; k < 64; k++) blk[32 + k] = (uint8_t)(k * 53 + 7);      /* qs */
    const uint8_t sc12[12] = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe, 0xe4, 0x1b, 0x4e, 0xb1};
    memcpy(blk + 96, sc12, 12);
    blk[108] = 0x00, blk[109] = 0x38; /* d = 0.5 */
    float y[256], want[256];
    dt_dequantize_row(DT_Q3_K, blk, y, 256);
    /* ggml's scale unpacking: four 32-bit words and the masks 0x03030303 / 0x0f0f0f0f */
    uint32_t aux[4];
    memcpy(aux, sc12, 12);
    uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & 0x0f0f0f0fu) | (((tmp >> 4) & 0x03030303u) << 4);
    aux[3] = ((aux[1] >> 4) & 0x0f0f0f0fu) | (((tmp >> 6) & 0x03030303u) << 4);
    aux[0] = (aux[0] & 0x0f0f0f0fu) | (((tmp >> 0) & 0x03030303u) << 4);
    aux[1] = (aux[1] & 0x0f0f0f0fu) | (((tmp >> 2) & 0x03030303u) << 4);
    const uint8_t *scales = (const uint8_t *)aux;
    int o = 0, is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        const uint8_t *q = blk + 32 + n / 4, *hm = blk;
        for (int shift = 0; shift < 8; shift += 2, m = (uint8_t)(m << 1))
            for (int half = 0; half < 2; half++) {
                float dl = 0.5f * (float)(scales[is++] - 32);
                for (int l = 16 * half; l < 16 * half + 16; l++)
                    want[o++] = dl * (float)(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            }
    }
    for (int e = 0; e < 256; e++) assert_true(y[e] == want[e]);
    /* by hand: scale 0 = low nibble of 0x10 (0) | bits 0..1 of 0xe4 (0) << 4 = 0 -> -32;
     * element 0: qs 7 -> 3, hmask[0] = 5 bit 0 set -> q 3: 0.5 * -32 * 3 = -48.
     * scale 15 = high nibble of 0xfe (15) | bits 6..7 of 0xb1 (2) << 4 = 47 -> 15;
     * element 255 (half 1, j 3, l 31): qs[63] = 0x12 -> bits 6..7 = 0, hmask[31] = 0x88
     * bit 7 set -> q 0. element 254: qs[62] = 0xdd -> 3, hmask[30] = 0x6b bit 7 clear
     * -> q -1: 0.5 * 15 * -1 */
    assert_true(y[0] == -48.0f);
    assert_true(y[255] == 0.0f);
    assert_true(y[254] == -7.5f);
}

static void test_deq_iq4_layout(void **state) {
    (void)state;
    uint8_t nl[18];
    nl[0] = 0x00, nl[1] = 0x34; /* d = 0.25 */
    for (int k = 0; k < 16; k++) nl[2 + k] = (uint8_t)(k | (15 - k) << 4);
    float y[256];
    dt_dequantize_row(DT_IQ4_NL, nl, y, 32);
    for (int j = 0; j < 16; j++) {
        assert_true(y[j] == 0.25f * k_iq4[j]);
        assert_true(y[j + 16] == 0.25f * k_iq4[15 - j]);
    }
    assert_true(y[0] == -31.75f && y[16] == 28.25f); /* -127 / 4, 113 / 4 */

    uint8_t xs[136];
    xs[0] = 0x00, xs[1] = 0x38;   /* d = 0.5 */
    xs[2] = 0xe4, xs[3] = 0xb1;   /* scales_h = 0xb1e4: high bits 0,1,2,3,1,0,3,2 */
    const uint8_t sl[4] = {0x1f, 0x2e, 0x3d, 0x4c};
    memcpy(xs + 4, sl, 4);
    for (int k = 0; k < 128; k++) xs[8 + k] = (uint8_t)(k * 71 + 3);
    dt_dequantize_row(DT_IQ4_XS, xs, y, 256);
    const uint16_t sh = 0xb1e4;
    for (int ib = 0; ib < 8; ib++) {
        int ls = ((sl[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((sh >> 2 * ib) & 3) << 4);
        float dl = 0.5f * (float)(ls - 32);
        const uint8_t *q = xs + 8 + 16 * ib;
        for (int j = 0; j < 16; j++) {
            assert_true(y[32 * ib + j] == dl * k_iq4[q[j] & 0xf]);
            assert_true(y[32 * ib + j + 16] == dl * k_iq4[q[j] >> 4]);
        }
    }
    /* by hand: sub-block 0: ls = 15 | 0 << 4 -> -17; qs[0] = 3: level -65 -> 0.5 * -17 * -65;
     * sub-block 7: ls = 4 | 2 << 4 = 36 -> 4; qs[127] = 0x3c (127 * 71 + 3 = 9020):
     * high nibble 3, level -65, element 255: 0.5 * 4 * -65 */
    assert_true(y[0] == 552.5f);
    assert_true(y[255] == -130.0f);
}

/* ---- quantize -> dequantize ---- */

/* ---- the codebook types (IQ2_*, IQ3_*, IQ1_*) -------------------------------
 * The codebooks: ggml's tables are sorted (IQ1's by coordinates read as signed
 * bytes, from the last), each coordinate one of the type's levels, no point
 * twice; a few entries as ggml's tables have them. */
static int iq_levels_ok(uint64_t v, int dim, const int *lv, int nlv) {
    for (int j = 0; j < dim; j++) {
        int b = (int)((v >> (8 * j)) & 255), ok = 0;
        for (int k = 0; k < nlv; k++) ok |= b == lv[k];
        if (!ok) return 0;
    }
    return 1;
}

static void test_iq_grids(void **state) {
    (void)state;
    const int l2[] = {8, 25, 43}, l3x[] = {4, 12, 20, 28, 36, 44, 52, 62}, l3s[] = {1, 3, 5, 7, 9, 11, 13, 15},
              l1[] = {0xff, 0x00, 0x01};
    const struct { const uint64_t *g; int n; } g2[] = {{dt_iq2xxs_grid, 256}, {dt_iq2xs_grid, 512}, {dt_iq2s_grid, 1024}};
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < g2[t].n; i++) {
            assert_true(iq_levels_ok(g2[t].g[i], 8, l2, 3));
            if (i) assert_true(g2[t].g[i] > g2[t].g[i - 1]);
        }
    for (int i = 0; i < 256; i++) {
        assert_true(iq_levels_ok(dt_iq3xxs_grid[i], 4, l3x, 8));
        if (i) assert_true(dt_iq3xxs_grid[i] > dt_iq3xxs_grid[i - 1]);
    }
    for (int i = 0; i < 512; i++) {
        assert_true(iq_levels_ok(dt_iq3s_grid[i], 4, l3s, 8));
        if (i) assert_true(dt_iq3s_grid[i] > dt_iq3s_grid[i - 1]);
    }
    for (int i = 0; i < 2048; i++) {
        assert_true(iq_levels_ok(dt_iq1s_grid[i], 8, l1, 3));
        if (!i) continue;
        int cmp = 0; /* signed bytes, coordinate 7 first */
        for (int j = 7; j >= 0 && !cmp; j--) {
            int a = (int8_t)(dt_iq1s_grid[i - 1] >> (8 * j)), b = (int8_t)(dt_iq1s_grid[i] >> (8 * j));
            cmp = (a > b) - (a < b);
        }
        assert_int_equal(cmp, -1);
    }
    assert_true(dt_iq2xxs_grid[1] == 0x080808080808082bull && dt_iq2xxs_grid[255] == 0x2b2b2b1908081908ull);
    assert_true(dt_iq2xs_grid[511] == 0x2b2b2b2b2b2b2b2bull && dt_iq2s_grid[1023] == 0x2b2b2b2b2b2b2b2bull);
    assert_true(dt_iq3xxs_grid[0] == 0x04040404u && dt_iq3xxs_grid[255] == 0x3e341c04u);
    assert_true(dt_iq3s_grid[0] == 0x01010101u && dt_iq3s_grid[511] == 0x0f0f0101u);
    assert_true(dt_iq1s_grid[0] == 0xffffffffffffffffull && dt_iq1s_grid[1023] == 0x0000000000ff01ffull &&
                dt_iq1s_grid[1024] == 0x0000000000ff0100ull && dt_iq1s_grid[2047] == 0x0101010101010101ull);
    for (int i = 0; i < 128; i++) {
        assert_int_equal(dt_iq_ksigns[i] & 127, i);
        assert_int_equal(__builtin_popcount(dt_iq_ksigns[i]) % 2, 0);
    }
}

/* ggml's dequantizers' loops, written out here independently of dtype/iq.h's
 * unpacking: d and the odd scales as ggml forms them (d · (0.5 + s) · 0.25
 * and so on), signs through a kmask, IQ1 as dl · (g ± 1/8). */
static float iq_sign(unsigned signs, int j) { return (signs >> j) & 1 ? -1.0f : 1.0f; }
static uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static unsigned le16(const uint8_t *p) { return (unsigned)p[0] | (unsigned)p[1] << 8; }

static void ggml_order_iq(int type, const uint8_t *b, float *y) {
    const float d = dt_f16_to_f32((dt_f16)le16(b));
    switch (type) {
    case DT_IQ2_XXS: /* d, then per 32: 4 grid bytes, u32 of 7-bit signs and the scale in bits 28..31 */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint32_t aux = le32(q + 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++) {
                const uint8_t *g = (const uint8_t *)&dt_iq2xxs_grid[q[l]];
                const unsigned sg = dt_iq_ksigns[(aux >> 7 * l) & 127];
                for (int j = 0; j < 8; j++) *y++ = db * g[j] * iq_sign(sg, j);
            }
        }
        break;
    case DT_IQ2_XS: /* d, qs[32] u16, scales[8] */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t sc = b[66 + ib];
            const float db[2] = {d * (0.5f + (float)(sc & 0xf)) * 0.25f, d * (0.5f + (float)(sc >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++) {
                const unsigned v = le16(b + 2 + 2 * (4 * ib + l));
                const uint8_t *g = (const uint8_t *)&dt_iq2xs_grid[v & 511];
                for (int j = 0; j < 8; j++) *y++ = db[l / 2] * g[j] * iq_sign(dt_iq_ksigns[v >> 9], j);
            }
        }
        break;
    case DT_IQ2_S: /* d, qs[64] (32 grid bytes, 32 sign bytes), qh[8], scales[8] */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t sc = b[74 + ib], qh = b[66 + ib];
            const float db[2] = {d * (0.5f + (float)(sc & 0xf)) * 0.25f, d * (0.5f + (float)(sc >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++) {
                const uint8_t *g = (const uint8_t *)&dt_iq2s_grid[b[2 + 4 * ib + l] | (qh << (8 - 2 * l) & 0x300)];
                for (int j = 0; j < 8; j++) *y++ = db[l / 2] * g[j] * iq_sign(b[34 + 4 * ib + l], j);
            }
        }
        break;
    case DT_IQ3_XXS: /* d, 64 grid bytes, 8 u32 of signs and scales */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint32_t aux = le32(b + 66 + 4 * ib);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++) {
                const unsigned sg = dt_iq_ksigns[(aux >> 7 * l) & 127];
                const uint8_t *g1 = (const uint8_t *)&dt_iq3xxs_grid[q[2 * l]], *g2 = (const uint8_t *)&dt_iq3xxs_grid[q[2 * l + 1]];
                for (int j = 0; j < 4; j++) y[j] = db * g1[j] * iq_sign(sg, j);
                for (int j = 0; j < 4; j++) y[j + 4] = db * g2[j] * iq_sign(sg, j + 4);
                y += 8;
            }
        }
        break;
    case DT_IQ3_S: /* d, qs[64], qh[8], signs[32], scales[4]: two sub-blocks per loop as ggml */
        for (int ib = 0; ib < 8; ib += 2) {
            const uint8_t sc = b[106 + ib / 2];
            const float dbs[2] = {d * (float)(1 + 2 * (sc & 0xf)), d * (float)(1 + 2 * (sc >> 4))};
            for (int h = 0; h < 2; h++) {
                const uint8_t *q = b + 2 + 8 * (ib + h), *sg = b + 74 + 4 * (ib + h);
                const unsigned qh = b[66 + ib + h];
                for (int l = 0; l < 4; l++) {
                    const uint8_t *g1 = (const uint8_t *)&dt_iq3s_grid[q[2 * l] | ((qh << (8 - 2 * l)) & 256)];
                    const uint8_t *g2 = (const uint8_t *)&dt_iq3s_grid[q[2 * l + 1] | ((qh << (7 - 2 * l)) & 256)];
                    for (int j = 0; j < 4; j++) y[j] = dbs[h] * g1[j] * iq_sign(sg[l], j);
                    for (int j = 0; j < 4; j++) y[j + 4] = dbs[h] * g2[j] * iq_sign(sg[l], j + 4);
                    y += 8;
                }
            }
        }
        break;
    case DT_IQ1_S: /* d, qs[32], qh[8] u16 */
        for (int ib = 0; ib < 8; ib++) {
            const unsigned qh = le16(b + 34 + 2 * ib);
            const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -0.125f : 0.125f;
            for (int l = 0; l < 4; l++) {
                const int8_t *g = (const int8_t *)&dt_iq1s_grid[b[2 + 4 * ib + l] | (((qh >> 3 * l) & 7) << 8)];
                for (int j = 0; j < 8; j++) *y++ = dl * ((float)g[j] + delta);
            }
        }
        break;
    case DT_IQ1_M: { /* qs[32], qh[16], scales[8] (4 u16; d in their top nibbles) */
        unsigned sc[4];
        for (int k = 0; k < 4; k++) sc[k] = le16(b + 48 + 2 * k);
        const float dm = dt_f16_to_f32((dt_f16)((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000)));
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 4 * ib, *qh = b + 32 + 2 * ib;
            const float dl1 = dm * (float)(2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 7) + 1);
            const float dl2 = dm * (float)(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 7) + 1);
            const unsigned idx[4] = {q[0] | ((qh[0] << 8) & 0x700), q[1] | ((qh[0] << 4) & 0x700),
                                     q[2] | ((qh[1] << 8) & 0x700), q[3] | ((qh[1] << 4) & 0x700)};
            const float delta[4] = {qh[0] & 0x08 ? -0.125f : 0.125f, qh[0] & 0x80 ? -0.125f : 0.125f,
                                    qh[1] & 0x08 ? -0.125f : 0.125f, qh[1] & 0x80 ? -0.125f : 0.125f};
            for (int l = 0; l < 4; l++) {
                const int8_t *g = (const int8_t *)&dt_iq1s_grid[idx[l]];
                for (int j = 0; j < 8; j++) *y++ = (l < 2 ? dl1 : dl2) * ((float)g[j] + delta[l]);
            }
        }
        break;
    }
    default: fail();
    }
}

/* Random blocks (every bit pattern of the indices, signs and scales) with a
 * d of a few chosen values: kvlm's dequantizer gives ggml's loops' bits. */
static void test_deq_iq_layout(void **state) {
    (void)state;
    const int types[] = {DT_IQ2_XXS, DT_IQ2_XS, DT_IQ2_S, DT_IQ3_XXS, DT_IQ3_S, DT_IQ1_S, DT_IQ1_M};
    const uint16_t ds[] = {0x3800, 0x2e66, 0xb555, 0x0401}; /* 0.5, 0.1, -0.333, a small normal */
    uint64_t s = 99;
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const size_t bs = dt_info(types[t])->type_size;
        for (int rep = 0; rep < 64; rep++) {
            uint8_t blk[128];
            for (size_t i = 0; i < bs; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                blk[i] = (uint8_t)(s >> 56);
            }
            const uint16_t d = ds[rep % 4];
            dt_iq_set_d(types[t], blk, d);
            float y[256], r[256];
            dt_dequantize_row(types[t], blk, y, 256);
            ggml_order_iq(types[t], blk, r);
            for (int i = 0; i < 256; i++)
                if (f32_bits(y[i]) != f32_bits(r[i])) fail_msg("%s block %d element %d: %g, ggml's order %g", dt_name(types[t]), rep, i, y[i], r[i]);
        }
    }
    /* by hand, IQ2_XXS sub-block 0: grid bytes 1, 0, ..; signs word 0x10000003
     * (scale 1 -> db = d · 1.5 · 0.25; group 0's sign index 3 -> bits 0, 1 set
     * (even), group 1's 0): point 1 = 0x080808080808082b */
    uint8_t b[66] = {0x00, 0x3c}; /* d = 1 */
    b[2] = 1, b[6] = 0x03, b[9] = 0x10;
    float y[256];
    dt_dequantize_row(DT_IQ2_XXS, b, y, 256);
    assert_true(y[0] == -43 * 0.375f && y[1] == -8 * 0.375f && y[2] == 8 * 0.375f && y[8] == 8 * 0.375f);
}

/* ---- MXFP4 and the ternary types ----------------------------------------------
 * ggml's dequantization loops, written out as its reference has them: MXFP4
 * as IQ4_NL's with GGML_E8M0_TO_FP32_HALF; TQ1_0 with pow3 and (q 3) >> 8 over
 * qs in runs of 32 and 16 bytes and then qh; TQ2_0 over 32-byte runs. */
static float ggml_e8m0_half(uint8_t x) { return bits_f32(x < 2 ? 0x00200000u << x : (uint32_t)(x - 1) << 23); }
static void ggml_order_small(int type, const uint8_t *blk, float *y) {
    static const int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    if (type == DT_MXFP4) {
        const float d = ggml_e8m0_half(blk[0]);
        for (int j = 0; j < 16; j++) {
            y[j] = kv[blk[1 + j] & 0x0f] * d;
            y[j + 16] = kv[blk[1 + j] >> 4] * d;
        }
        return;
    }
    if (type == DT_TQ2_0) {
        const float d = dt_f16_to_f32((dt_f16)(blk[64] | blk[65] << 8));
        for (size_t j = 0; j < 64; j += 32)
            for (size_t l = 0; l < 4; ++l)
                for (size_t m = 0; m < 32; ++m) {
                    int8_t q = (int8_t)((blk[j + m] >> (l * 2)) & 3);
                    *y++ = (float)(q - 1) * d;
                }
        return;
    }
    const uint8_t pow3[6] = {1, 3, 9, 27, 81, 243};
    const uint8_t *qs = blk, *qh = blk + 48;
    const float d = dt_f16_to_f32((dt_f16)(blk[52] | blk[53] << 8));
    for (size_t j = 0; j < 48 - 48 % 32; j += 32)
        for (size_t n = 0; n < 5; ++n)
            for (size_t m = 0; m < 32; ++m) {
                uint8_t q = (uint8_t)(qs[j + m] * pow3[n]);
                int16_t xi = (int16_t)(((uint16_t)q * 3) >> 8);
                *y++ = (float)(xi - 1) * d;
            }
    for (size_t j = 48 - 48 % 32; j < 48; j += 16)
        for (size_t n = 0; n < 5; ++n)
            for (size_t m = 0; m < 16; ++m) {
                uint8_t q = (uint8_t)(qs[j + m] * pow3[n]);
                int16_t xi = (int16_t)(((uint16_t)q * 3) >> 8);
                *y++ = (float)(xi - 1) * d;
            }
    for (size_t n = 0; n < 4; ++n)
        for (size_t j = 0; j < 4; ++j) {
            uint8_t q = (uint8_t)(qh[j] * pow3[n]);
            int16_t xi = (int16_t)(((uint16_t)q * 3) >> 8);
            *y++ = (float)(xi - 1) * d;
        }
}

/* ggml's TQ1_0 packing of ternary values t (x / d = -1, 0, 1), written out. */
static void ggml_pack_tq1_0(const int *t, uint8_t *blk) {
    for (size_t m = 0; m < 32; ++m) {
        uint8_t q = 0;
        for (size_t n = 0; n < 5; ++n) q = (uint8_t)(q * 3 + (t[m + n * 32] + 1));
        blk[m] = (uint8_t)(((uint16_t)q * 256 + (243 - 1)) / 243);
    }
    t += 5 * 32;
    for (size_t m = 0; m < 16; ++m) {
        uint8_t q = 0;
        for (size_t n = 0; n < 5; ++n) q = (uint8_t)(q * 3 + (t[m + n * 16] + 1));
        blk[32 + m] = (uint8_t)(((uint16_t)q * 256 + (243 - 1)) / 243);
    }
    t += 5 * 16;
    for (size_t j = 0; j < 4; ++j) {
        uint8_t q = 0;
        for (size_t m = 0; m < 4; ++m) q = (uint8_t)(q * 3 + (t[j + m * 4] + 1));
        q = (uint8_t)(q * 3);
        blk[48 + j] = (uint8_t)(((uint16_t)q * 256 + (243 - 1)) / 243);
    }
}

static void test_deq_small_layout(void **state) {
    (void)state;
    const int types[] = {DT_MXFP4, DT_TQ1_0, DT_TQ2_0};
    uint64_t s = 77;
    for (size_t t = 0; t < 3; t++) {
        const int n = dt_info(types[t])->block_size;
        const size_t bs = dt_info(types[t])->type_size;
        for (int rep = 0; rep < 256; rep++) {
            uint8_t blk[66];
            for (size_t i = 0; i < bs; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                blk[i] = (uint8_t)(s >> 56);
            }
            if (types[t] != DT_MXFP4) blk[bs - 1] &= 0x7b; /* a finite d */
            else if (rep < 4) blk[0] = (uint8_t)(rep < 2 ? rep : 253 + rep); /* the subnormal and top scales */
            float y[256], r[256];
            dt_dequantize_row(types[t], blk, y, n);
            ggml_order_small(types[t], blk, r);
            for (int i = 0; i < n; i++)
                if (f32_bits(y[i]) != f32_bits(r[i]))
                    fail_msg("%s block %d element %d: %g, ggml's order %g", dt_name(types[t]), rep, i, y[i], r[i]);
        }
    }
    /* by hand: MXFP4 e = 125 (half scale 2^-3), byte 0x9f: element 0 nibble 15
     * (-6 in E2M1: -12 doubled), element 16 nibble 9 (-0.5) */
    uint8_t mx[17] = {125, 0x9f};
    float y[256];
    dt_dequantize_row(DT_MXFP4, mx, y, 32);
    assert_true(y[0] == -1.5f && y[16] == -0.125f && y[1] == 0.0f);
    /* TQ1_0 byte 0 = ceil(81 * 256 / 243) = 86 holds codes 1, 0, 0, 0, 0
     * (base 3: 10000 = 81): element 0 is 0 and elements 32, 64, 96, 128 are -d */
    uint8_t t1[54] = {86};
    t1[52] = 0x00, t1[53] = 0x40; /* d = 2 */
    dt_dequantize_row(DT_TQ1_0, t1, y, 256);
    assert_true(y[0] == 0.0f && y[32] == -2.0f && y[64] == -2.0f && y[96] == -2.0f && y[128] == -2.0f);
    assert_true(y[1] == -2.0f); /* byte 1 is 0: codes 0 */

    /* Every 5-code pattern: TQ1_0's bytes decode to the codes they pack, and
     * quantizing ternary values gives ggml's bytes, whatever the scale. */
    for (int p = 0; p < 243; p++) {
        int c[5];
        for (int k = 0, v = p; k < 5; k++, v /= 3) c[4 - k] = v % 3;
        uint8_t q = (uint8_t)((p * 256 + 242) / 243);
        for (int k = 0; k < 5; k++) assert_int_equal(dt_tq1_code(q, k), c[k]);
    }
    for (int rep = 0; rep < 32; rep++) {
        int tv[256];
        float x[256];
        const float a = rep == 0 ? 1.0f : 0.0123f * (float)(rep + 1); /* any scale, f16-exact or not */
        for (int i = 0; i < 256; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            tv[i] = (int)((s >> 33) % 3) - 1;
            x[i] = (float)tv[i] * a;
        }
        tv[rep] = 1, x[rep] = a; /* never all zero */
        uint8_t got[54], want[54], got2[66];
        assert_int_equal(dt_quantize_row(DT_TQ1_0, x, got, 256), 0);
        ggml_pack_tq1_0(tv, want);
        assert_memory_equal(got, want, 52);
        const dt_f16 dh = dt_f32_to_f16(a);
        assert_int_equal(got[52] | got[53] << 8, dh);
        /* TQ2_0 of the same values: the same codes */
        assert_int_equal(dt_quantize_row(DT_TQ2_0, x, got2, 256), 0);
        float y1[256], y2[256];
        dt_dequantize_row(DT_TQ1_0, got, y1, 256);
        dt_dequantize_row(DT_TQ2_0, got2, y2, 256);
        for (int i = 0; i < 256; i++) assert_true(y1[i] == (float)tv[i] * dt_f16_to_f32(dh) && y2[i] == y1[i]);
    }
}

static double rel_rms_err(int type, const float *x, int n) {
    const dt_traits *t = dt_info(type);
    void *q = malloc(dt_row_size(type, n));
    float *y = malloc((size_t)n * sizeof *y);
    assert_non_null(q);
    assert_non_null(y);
    assert_int_equal(dt_quantize_row(type, x, q, n), 0);
    dt_dequantize_row(type, q, y, n);
    double se = 0, sx = 0;
    for (int i = 0; i < n; i++) {
        se += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        sx += (double)x[i] * x[i];
    }
    (void)t;
    free(q);
    free(y);
    return sqrt(se / sx);
}

static void fill_gauss(float *x, int n, uint64_t *s) {
    for (int i = 0; i < n; i += 2) {
        float u[2];
        tu_fill_random(u, 2, s, 1.0f);
        double a = (u[0] + 1.0) / 2.0 * 0.999999 + 1e-7, b = (u[1] + 1.0) * M_PI;
        double r = sqrt(-2 * log(a));
        x[i] = (float)(r * cos(b));
        if (i + 1 < n) x[i + 1] = (float)(r * sin(b));
    }
}

static void test_round_trip(void **state) {
    (void)state;
    enum { N = 256 * 64 };
    float *x = malloc(N * sizeof *x);
    assert_non_null(x);
    /* Bounds on RMS error relative to the signal's RMS; the theory for a
     * uniform quantizer with step D is D/sqrt(12):
     *   uniform data in [-1,1]: q8_0 ~0.4%, q6_K ~1.5%, q4_K/q4_0 ~6-7%. */
    const struct { int type; double bound_u, bound_g; } cases[] = {
        {DT_F16, 0.0005, 0.0005}, {DT_BF16, 0.004, 0.004}, {DT_Q8_0, 0.006, 0.008}, {DT_Q8_K, 0.006, 0.012},
        {DT_Q6_K, 0.02, 0.03},    {DT_Q5_K, 0.04, 0.06},   {DT_Q4_K, 0.075, 0.11},  {DT_Q4_0, 0.09, 0.13},
        {DT_Q5_0, 0.045, 0.065},  {DT_Q5_1, 0.04, 0.06},   {DT_Q4_1, 0.08, 0.12},
        {DT_Q3_K, 0.135, 0.165},  {DT_Q2_K, 0.26, 0.31},   {DT_IQ4_NL, 0.07, 0.085}, {DT_IQ4_XS, 0.07, 0.085},
        /* the codebook types, plain least squares (no importance matrix) */
        {DT_IQ3_S, 0.135, 0.145}, {DT_IQ3_XXS, 0.195, 0.2}, {DT_IQ2_S, 0.255, 0.27}, {DT_IQ2_XS, 0.31, 0.32},
        {DT_IQ2_XXS, 0.365, 0.37}, {DT_IQ1_M, 0.41, 0.47},  {DT_IQ1_S, 0.43, 0.5},
        /* MXFP4: E2M1's levels under a power-of-two scale; the ternary types on
         * data that is not ternary (test_deq_small_layout has them exact on
         * ternary data) */
        {DT_MXFP4, 0.11, 0.125}, {DT_TQ1_0, 0.345, 0.45}, {DT_TQ2_0, 0.345, 0.45},
    };
    uint64_t s = 42;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tu_fill_random(x, N, &s, 1.0f);
        double eu = rel_rms_err(cases[c].type, x, N);
        fill_gauss(x, N, &s);
        double eg = rel_rms_err(cases[c].type, x, N);
        /* large magnitudes and an offset (all-positive blocks exercise the
         * unsigned Q4_K min) */
        for (int i = 0; i < N; i++) x[i] = x[i] * 300.0f + 1000.0f;
        double eo = rel_rms_err(cases[c].type, x, N);
        print_message("  %-5s relative RMS error: uniform %.5f  gaussian %.5f  offset %.5f\n",
                      dt_name(cases[c].type), eu, eg, eo);
        assert_true(eu < cases[c].bound_u);
        assert_true(eg < cases[c].bound_g);
        assert_true(eo < cases[c].bound_g);
    }
    free(x);
}

static void test_quantize_special(void **state) {
    (void)state;
    const int types[] = {DT_Q8_0, DT_Q4_0, DT_Q4_1, DT_Q5_0, DT_Q5_1, DT_Q4_K, DT_Q5_K, DT_Q6_K, DT_Q8_K,
                         DT_Q2_K, DT_Q3_K, DT_IQ4_NL, DT_IQ4_XS, DT_MXFP4, DT_TQ1_0, DT_TQ2_0};
    float x[512], y[512];
    uint8_t q[2048];
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        /* zeros stay zeros */
        memset(x, 0, sizeof x);
        assert_int_equal(dt_quantize_row(types[t], x, q, 512), 0);
        dt_dequantize_row(types[t], q, y, 512);
        for (int i = 0; i < 512; i++) assert_true(y[i] == 0.0f);
        /* a block with one nonzero value, and constant negative blocks */
        x[7] = 3.0f;
        for (int i = 256; i < 512; i++) x[i] = -0.75f;
        assert_int_equal(dt_quantize_row(types[t], x, q, 512), 0);
        dt_dequantize_row(types[t], q, y, 512);
        for (int i = 0; i < 512; i++) assert_true(fabsf(y[i] - x[i]) <= 0.02f * 3.0f);
    }
    /* q8_0 is exact for values on its grid: amax 31.75 gives d = 0.25 */
    x[0] = -31.75f;
    for (int i = 1; i < 32; i++) x[i] = (float)(i * 8 - 127) * 0.25f;
    assert_int_equal(dt_quantize_row(DT_Q8_0, x, q, 32), 0);
    dt_dequantize_row(DT_Q8_0, q, y, 32);
    for (int i = 0; i < 32; i++) assert_true(y[i] == x[i]);
    /* q8_K bsums are the sums of each 16 quants */
    uint64_t s = 7;
    tu_fill_random(x, 256, &s, 2.0f);
    block_q8_K k8;
    assert_int_equal(dt_quantize_row(DT_Q8_K, x, &k8, 256), 0);
    for (int j = 0; j < 16; j++) {
        int sum = 0;
        for (int l = 0; l < 16; l++) sum += k8.qs[16 * j + l];
        assert_int_equal(k8.bsums[j], sum);
    }
    /* q4_K scales and mins stay within 6 bits and dequantize consistently:
     * re-quantizing a dequantized row changes it only by rounding noise */
    tu_fill_random(x, 512, &s, 1.0f);
    assert_int_equal(dt_quantize_row(DT_Q4_K, x, q, 512), 0);
    dt_dequantize_row(DT_Q4_K, q, y, 512);
    float z[512];
    uint8_t q2[2048];
    assert_int_equal(dt_quantize_row(DT_Q4_K, y, q2, 512), 0);
    dt_dequantize_row(DT_Q4_K, q2, z, 512);
    double se = 0, sx = 0;
    for (int i = 0; i < 512; i++) {
        se += (double)(z[i] - y[i]) * (z[i] - y[i]);
        sx += (double)y[i] * y[i];
    }
    assert_true(sqrt(se / sx) < 0.05);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_traits),         cmocka_unit_test(test_f16),
        cmocka_unit_test(test_bf16),           cmocka_unit_test(test_deq_q4_0_q8_0),
        cmocka_unit_test(test_deq_q4_K),
        cmocka_unit_test(test_deq_q5_K),
        cmocka_unit_test(test_deq_legacy),       cmocka_unit_test(test_deq_q6_K_q8_K),
        cmocka_unit_test(test_deq_q2_K_layout),  cmocka_unit_test(test_deq_q3_K_layout),
        cmocka_unit_test(test_deq_iq4_layout),   cmocka_unit_test(test_iq_grids),
        cmocka_unit_test(test_deq_iq_layout),    cmocka_unit_test(test_deq_small_layout),
        cmocka_unit_test(test_round_trip),     cmocka_unit_test(test_quantize_special),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
