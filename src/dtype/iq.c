/* dtype/iq: the IQ types' codebooks expanded from iq_grids.c, their
 * reference dequantizer, and their quantizers (dtype/iq.h). */
#include "dtype/iq.h"
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

uint64_t dt_iq2xxs_grid[256], dt_iq2xs_grid[512], dt_iq2s_grid[1024], dt_iq1s_grid[2048];
uint32_t dt_iq3xxs_grid[256], dt_iq3s_grid[512];
uint8_t dt_iq_ksigns[128];
uint64_t dt_iq_signs64[256], dt_iq_ksigns64[128];

static uint64_t expand(uint16_t p, int dim, int bits, const uint8_t *levels) {
    uint64_t v = 0;
    for (int j = 0; j < dim; j++) v |= (uint64_t)levels[(p >> (bits * j)) & ((1 << bits) - 1)] << (8 * j);
    return v;
}

/* Runs before main (and before any kernel can be looked up): the tables are
 * 30 KB and take microseconds. */
__attribute__((constructor)) static void iq_expand_tables(void) {
    static const uint8_t l2[3] = {8, 25, 43}, l1[3] = {0xff, 0x00, 0x01};
    static const uint8_t l3x[8] = {4, 12, 20, 28, 36, 44, 52, 62}, l3s[8] = {1, 3, 5, 7, 9, 11, 13, 15};
    for (int i = 0; i < 256; i++) dt_iq2xxs_grid[i] = expand(dt_iq_points_iq2xxs[i], 8, 2, l2);
    for (int i = 0; i < 512; i++) dt_iq2xs_grid[i] = expand(dt_iq_points_iq2xs[i], 8, 2, l2);
    for (int i = 0; i < 1024; i++) dt_iq2s_grid[i] = expand(dt_iq_points_iq2s[i], 8, 2, l2);
    for (int i = 0; i < 2048; i++) dt_iq1s_grid[i] = expand(dt_iq_points_iq1s[i], 8, 2, l1);
    for (int i = 0; i < 256; i++) dt_iq3xxs_grid[i] = (uint32_t)expand(dt_iq_points_iq3xxs[i], 4, 3, l3x);
    for (int i = 0; i < 512; i++) dt_iq3s_grid[i] = (uint32_t)expand(dt_iq_points_iq3s[i], 4, 3, l3s);
    for (int b = 0; b < 256; b++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((b >> j) & 1 ? 0xff : 0x01) << (8 * j);
        dt_iq_signs64[b] = v;
    }
    for (int i = 0; i < 128; i++) {
        dt_iq_ksigns[i] = (uint8_t)(i | (__builtin_popcount((unsigned)i) & 1) << 7);
        dt_iq_ksigns64[i] = dt_iq_signs64[dt_iq_ksigns[i]];
    }
}

void dt_iq_dequantize(int type, const void *src, float *y, int64_t nb) {
    const size_t bs = dt_layout(type)->type_size;
    const float inv = 1.0f / (float)dt_iq_div(type);
    for (int64_t i = 0; i < nb; i++) {
        const void *b = (const uint8_t *)src + (size_t)i * bs;
        const float d = dt_iq_d(type, b);
        for (int ib = 0; ib < QK_K / 32; ib++, y += 32) {
            int8_t w[32];
            int ls[2];
            dt_iq_unpack(type, b, ib, w, ls);
            for (int h = 0; h < 2; h++) {
                /* d · ls rounded once, then the exact power of two: ggml's d · (0.5 + s) · 0.25 */
                const float dl = d * (float)ls[h] * inv;
                for (int j = 16 * h; j < 16 * h + 16; j++) y[j] = dl * (float)w[j];
            }
        }
    }
}

/* ---- quantizers ------------------------------------------------------------------
 * A codebook for the search: its points' coordinates as floats (IQ2/IQ3:
 * magnitudes, IQ1: -1/0/1), with each point's sum of squares and sum. */
typedef struct {
    int n, dim;      /* points, coordinates per point (8 or 4) */
    float *lv;       /* dim x n: coordinate j of point i at lv[j n + i] */
    float *nrm[3];   /* per point: |L + δ|² for the shifts -1/8, 0, +1/8 */
    float lmax;      /* the largest coordinate */
} iq_book;

enum { BOOK_2XXS, BOOK_2XS, BOOK_2S, BOOK_3XXS, BOOK_3S, BOOK_1S, BOOK_COUNT };
static iq_book books[BOOK_COUNT];
static pthread_once_t books_once = PTHREAD_ONCE_INIT;

static void book_make(iq_book *k, int n, int dim, const void *grid) {
    k->n = n;
    k->dim = dim;
    k->lv = malloc(sizeof(float) * (size_t)n * (size_t)dim);
    for (int h = 0; h < 3; h++) k->nrm[h] = malloc(sizeof(float) * (size_t)n);
    if (!k->lv || !k->nrm[0] || !k->nrm[1] || !k->nrm[2]) abort(); /* 160 KB, once */
    k->lmax = 0;
    for (int i = 0; i < n; i++) {
        const uint64_t g = dim == 8 ? ((const uint64_t *)grid)[i] : ((const uint32_t *)grid)[i];
        float s2 = 0, s1 = 0;
        for (int j = 0; j < dim; j++) {
            const int byte = (int)((g >> (8 * j)) & 255);
            const float v = grid == dt_iq1s_grid ? (float)(int8_t)byte : (float)byte;
            k->lv[j * n + i] = v;
            s2 += v * v;
            s1 += v;
            if (v > k->lmax) k->lmax = v;
        }
        for (int h = 0; h < 3; h++) {
            const float dl = (float)(h - 1) * IQ1_DELTA;
            k->nrm[h][i] = s2 + 2.0f * dl * s1 + (float)dim * dl * dl;
        }
    }
}

static void books_init(void) {
    book_make(&books[BOOK_2XXS], 256, 8, dt_iq2xxs_grid);
    book_make(&books[BOOK_2XS], 512, 8, dt_iq2xs_grid);
    book_make(&books[BOOK_2S], 1024, 8, dt_iq2s_grid);
    book_make(&books[BOOK_3XXS], 256, 4, dt_iq3xxs_grid);
    book_make(&books[BOOK_3S], 512, 4, dt_iq3s_grid);
    book_make(&books[BOOK_1S], 2048, 8, dt_iq1s_grid);
}

/* What the quantizer needs to know of a type. */
typedef struct {
    int book;
    int scale_len;   /* weights per scale: 16 or 32 */
    int parity;      /* sign patterns of even parity only (7-bit sign indices) */
    int ternary;     /* IQ1: signed points and a shift of ±1/8 instead of signs */
    int shift_len;   /* IQ1: weights per shift (32 or 8) */
    int max_code;    /* scales are 2c + 1, c in 0..max_code */
} iq_spec;

static iq_spec spec_of(int type) {
    switch (type) {
    case DT_IQ2_XXS: return (iq_spec){BOOK_2XXS, 32, 1, 0, 0, 15};
    case DT_IQ2_XS: return (iq_spec){BOOK_2XS, 16, 1, 0, 0, 15};
    case DT_IQ2_S: return (iq_spec){BOOK_2S, 16, 0, 0, 0, 15};
    case DT_IQ3_XXS: return (iq_spec){BOOK_3XXS, 32, 1, 0, 0, 15};
    case DT_IQ3_S: return (iq_spec){BOOK_3S, 32, 0, 0, 0, 15};
    case DT_IQ1_S: return (iq_spec){BOOK_1S, 32, 0, 1, 32, 7};
    default: return (iq_spec){BOOK_1S, 16, 0, 1, 8, 7}; /* IQ1_M */
    }
}

/* The best point of the book for dim targets at scale s, shift index sh
 * (0, 1, 2: -1/8, none, +1/8; weight ≈ s · (coordinate + shift)): argmin over
 * points of |t - s (L + shift)|², from the targets' dots with every point.
 * Returns the point; *err gets the error less |t|², the same for all points. */
typedef float iq_v4f __attribute__((vector_size(16), aligned(4)));
typedef int32_t iq_v4i __attribute__((vector_size(16), aligned(4)));

static int best_point(const iq_book *k, const float *dots, float tsum, float s, int sh, float *err) {
    /* 4 lanes, each keeping its first minimum; then the smallest value, the
     * lowest point on ties: the point a plain loop finds (n is a multiple of 4) */
    const float ss = s * s, s2 = 2.0f * s, *nrm = k->nrm[sh];
    iq_v4f best = {FLT_MAX, FLT_MAX, FLT_MAX, FLT_MAX};
    iq_v4i bi = {0, 0, 0, 0}, idx = {0, 1, 2, 3};
    const iq_v4i four = {4, 4, 4, 4};
    for (int i = 0; i < k->n; i += 4, idx += four) {
        iq_v4f a, b;
        memcpy(&a, nrm + i, sizeof a);
        memcpy(&b, dots + i, sizeof b);
        const iq_v4f e = ss * a - s2 * b;
        const iq_v4i m = e < best;
        best = (iq_v4f)(((iq_v4i)e & m) | ((iq_v4i)best & ~m));
        bi = (idx & m) | (bi & ~m);
    }
    float be = best[0];
    int bp = bi[0];
    for (int l = 1; l < 4; l++)
        if (best[l] < be || (best[l] == be && bi[l] < bp)) { be = best[l]; bp = bi[l]; }
    /* |t - s(L + δ)|² - |t|² = s² (|L|² + 2δ ΣL + dim δ²) - 2s (t·L + δ Σt) */
    *err = be - s2 * (float)(sh - 1) * IQ1_DELTA * tsum;
    return bp;
}

/* One super-block: the targets' signs, then per scale group the scale,
 * then d and the codes, then the points against the stored scales. */
typedef struct {
    int point[QK_K / 4];  /* per point group (dim weights) */
    unsigned signs[QK_K / 8]; /* per 8 weights: bit j negative */
    int shift[QK_K / 8];  /* IQ1: per 8 weights, +1 or -1 (the shift's sign) */
    int code[QK_K / 16];  /* per scale group */
    float d;
} iq_fit;

/* Points (and IQ1's shifts) of the ng point groups from g0 at scale s, into
 * f; returns their error. tsum: each point group's sum of targets. */
static float fit_group(const iq_spec *sp, const iq_book *k, const float *tsum, const float *dots, int g0, int ng,
                       float s, iq_fit *f) {
    float total = 0;
    const int per_shift = sp->ternary ? sp->shift_len / k->dim : ng; /* point groups per shift */
    for (int a = g0; a < g0 + ng; a += per_shift) {
        float best_e = FLT_MAX;
        int best_sh = 1, pts[8], best_pts[8];
        for (int sh = sp->ternary ? 0 : 1; sh <= (sp->ternary ? 2 : 1); sh += 2) {
            float e = 0, eg;
            for (int g = 0; g < per_shift; g++) {
                pts[g] = best_point(k, dots + (size_t)(a + g) * k->n, tsum[a + g], s, sh, &eg);
                e += eg;
            }
            if (e < best_e) {
                best_e = e;
                best_sh = sh;
                memcpy(best_pts, pts, sizeof(int) * (size_t)per_shift);
            }
        }
        for (int g = 0; g < per_shift; g++) {
            f->point[a + g] = best_pts[g];
            if (sp->ternary) f->shift[(a + g) * k->dim / 8] = best_sh - 1;
        }
        total += best_e;
    }
    return total;
}

static void fit_block(int type, const float *x, iq_fit *f, float *dots) {
    const iq_spec sp = spec_of(type);
    const iq_book *k = &books[sp.book];
    /* weight = d (2c + 1) L / div for a point coordinate L (IQ1: L = g ± 1/8, div 1) */
    const int dim = k->dim, groups = QK_K / dim, div = sp.ternary ? 1 : dt_iq_div(type);
    float t[QK_K];
    /* targets: magnitudes (a sign pattern of odd parity gives up its smallest
     * weight's sign: that weight's target becomes -|x|), or x itself (IQ1) */
    for (int g8 = 0; g8 < QK_K / 8; g8++) {
        unsigned sg = 0;
        int jmin = 0;
        for (int j = 0; j < 8; j++) {
            const float v = x[8 * g8 + j];
            t[8 * g8 + j] = sp.ternary ? v : fabsf(v);
            if (v < 0) sg |= 1u << j;
            if (fabsf(v) < fabsf(x[8 * g8 + jmin])) jmin = j;
        }
        if (sp.parity && (__builtin_popcount(sg) & 1)) {
            sg ^= 1u << jmin;
            t[8 * g8 + jmin] = -t[8 * g8 + jmin];
        }
        f->signs[g8] = sp.ternary ? 0 : sg;
    }
    float tsum[QK_K / 4];
    for (int g = 0; g < groups; g++) {
        tsum[g] = 0;
        for (int j = 0; j < dim; j++) tsum[g] += t[g * dim + j];
    }
    for (int g = 0; g < groups; g++) {
        float *dg = dots + (size_t)g * k->n;
        for (int i = 0; i < k->n; i++) dg[i] = 0;
        for (int j = 0; j < dim; j++) {
            const float tj = t[g * dim + j], *l = k->lv + (size_t)j * k->n;
            for (int i = 0; i < k->n; i++) dg[i] += tj * l[i];
        }
    }
    /* per scale group: the best of 7 scales around max |x| / largest level, refined by least squares */
    const int gps = sp.scale_len / dim, nsg = QK_K / sp.scale_len;
    float scale[QK_K / 16], smax = 0;
    for (int sg = 0; sg < nsg; sg++) {
        float amax = 0;
        for (int j = 0; j < sp.scale_len; j++) amax = fmaxf(amax, fabsf(x[sg * sp.scale_len + j]));
        scale[sg] = 0;
        if (amax == 0) continue;
        const float base = amax / (sp.ternary ? 1.0f + IQ1_DELTA : k->lmax);
        float best_e = FLT_MAX, best_s = base;
        for (int c = 0; c < 7; c++) {
            const float s = base * (0.55f + 0.12f * (float)c);
            const float e = fit_group(&sp, k, tsum, dots, sg * gps, gps, s, f);
            if (e < best_e) { best_e = e; best_s = s; }
        }
        fit_group(&sp, k, tsum, dots, sg * gps, gps, best_s, f);
        float num = 0, den = 0; /* least-squares scale for those points */
        for (int g = sg * gps; g < sg * gps + gps; g++) {
            const float sh = sp.ternary ? (float)f->shift[g * dim / 8] * IQ1_DELTA : 0.0f;
            for (int j = 0; j < dim; j++) {
                const float l = k->lv[j * k->n + f->point[g]] + sh;
                num += t[g * dim + j] * l;
                den += l * l;
            }
        }
        scale[sg] = den > 0 && num > 0 ? num / den : best_s;
        smax = fmaxf(smax, scale[sg]);
    }
    /* d: the largest scale is code max_code, weight = d (2c + 1) L / div */
    f->d = dt_f16_to_f32(dt_f32_to_f16(smax * (float)div / (float)(2 * sp.max_code + 1)));
    for (int sg = 0; sg < nsg; sg++) {
        if (f->d == 0 || scale[sg] == 0) {
            f->code[sg] = 0;
            fit_group(&sp, k, tsum, dots, sg * gps, gps, f->d / (float)div, f);
            continue;
        }
        int c0 = (int)lrintf((scale[sg] * (float)div / f->d - 1.0f) * 0.5f), best_c = 0;
        float best_e = FLT_MAX;
        for (int c = c0 - 1; c <= c0 + 1; c++) {
            if (c < 0 || c > sp.max_code) continue;
            const float e = fit_group(&sp, k, tsum, dots, sg * gps, gps, f->d * (float)(2 * c + 1) / (float)div, f);
            if (e < best_e) { best_e = e; best_c = c; }
        }
        f->code[sg] = best_c;
        fit_group(&sp, k, tsum, dots, sg * gps, gps, f->d * (float)(2 * best_c + 1) / (float)div, f);
    }
}

/* The sign index of 8 weights' sign bits (parity types: the low 7 bits). */
static void encode(int type, const iq_fit *f, void *dst) {
    memset(dst, 0, dt_layout(type)->type_size);
    const dt_f16 d = dt_f32_to_f16(f->d);
    switch (type) {
    case DT_IQ2_XXS: {
        block_iq2_xxs *b = dst;
        b->d = d;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t a0 = 0, a1 = (uint32_t)f->code[ib] << 28;
            for (int l = 0; l < 4; l++) {
                a0 |= (uint32_t)f->point[4 * ib + l] << (8 * l);
                a1 |= (f->signs[4 * ib + l] & 127u) << (7 * l);
            }
            memcpy((uint8_t *)b->qs + 8 * ib, &a0, 4);
            memcpy((uint8_t *)b->qs + 8 * ib + 4, &a1, 4);
        }
        break;
    }
    case DT_IQ2_XS: {
        block_iq2_xs *b = dst;
        b->d = d;
        for (int ib = 0; ib < 8; ib++) {
            b->scales[ib] = (uint8_t)(f->code[2 * ib] | f->code[2 * ib + 1] << 4);
            for (int l = 0; l < 4; l++) {
                const uint16_t v = (uint16_t)(f->point[4 * ib + l] | (f->signs[4 * ib + l] & 127u) << 9);
                memcpy((uint8_t *)b->qs + 2 * (4 * ib + l), &v, 2);
            }
        }
        break;
    }
    case DT_IQ2_S: {
        block_iq2_s *b = dst;
        b->d = d;
        for (int ib = 0; ib < 8; ib++) {
            b->scales[ib] = (uint8_t)(f->code[2 * ib] | f->code[2 * ib + 1] << 4);
            for (int l = 0; l < 4; l++) {
                const int p = f->point[4 * ib + l];
                b->qs[4 * ib + l] = (uint8_t)p;
                b->qh[ib] |= (uint8_t)((p >> 8) << (2 * l));
                b->qs[QK_K / 8 + 4 * ib + l] = (uint8_t)f->signs[4 * ib + l];
            }
        }
        break;
    }
    case DT_IQ3_XXS: {
        block_iq3_xxs *b = dst;
        b->d = d;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t a = (uint32_t)f->code[ib] << 28;
            for (int l = 0; l < 4; l++) a |= (f->signs[4 * ib + l] & 127u) << (7 * l);
            for (int k = 0; k < 8; k++) b->qs[8 * ib + k] = (uint8_t)f->point[8 * ib + k];
            memcpy(b->qs + QK_K / 4 + 4 * ib, &a, 4);
        }
        break;
    }
    case DT_IQ3_S: {
        block_iq3_s *b = dst;
        b->d = d;
        for (int ib = 0; ib < 8; ib++) {
            b->scales[ib / 2] |= (uint8_t)(f->code[ib] << (4 * (ib % 2)));
            for (int k = 0; k < 8; k++) {
                const int p = f->point[8 * ib + k];
                b->qs[8 * ib + k] = (uint8_t)p;
                b->qh[ib] |= (uint8_t)((p >> 8) << k);
            }
            for (int l = 0; l < 4; l++) b->signs[4 * ib + l] = (uint8_t)f->signs[4 * ib + l];
        }
        break;
    }
    case DT_IQ1_S: {
        block_iq1_s *b = dst;
        b->d = d;
        for (int ib = 0; ib < 8; ib++) {
            uint16_t h = (uint16_t)(f->code[ib] << 12 | (f->shift[4 * ib] < 0 ? 0x8000 : 0));
            for (int l = 0; l < 4; l++) {
                const int p = f->point[4 * ib + l];
                b->qs[4 * ib + l] = (uint8_t)p;
                h |= (uint16_t)((p >> 8) << (3 * l));
            }
            memcpy((uint8_t *)b->qh + 2 * ib, &h, 2);
        }
        break;
    }
    case DT_IQ1_M: {
        block_iq1_m *b = dst;
        uint16_t sc[4] = {0, 0, 0, 0};
        for (int ib = 0; ib < 8; ib++) {
            sc[ib / 2] |= (uint16_t)((f->code[2 * ib] | f->code[2 * ib + 1] << 3) << (6 * (ib % 2)));
            for (int l = 0; l < 4; l++) {
                const int p = f->point[4 * ib + l];
                b->qs[4 * ib + l] = (uint8_t)p;
                const unsigned nib = (unsigned)(p >> 8) | (f->shift[4 * ib + l] < 0 ? 8u : 0u);
                b->qh[2 * ib + l / 2] |= (uint8_t)(nib << (4 * (l % 2)));
            }
        }
        memcpy(b->scales, sc, 8);
        dt_iq_set_d(type, b, d);
        break;
    }
    default: break;
    }
}

void dt_iq_quantize(int type, const float *x, void *dst, int64_t nb) {
    pthread_once(&books_once, books_init);
    const iq_spec sp = spec_of(type);
    const iq_book *k = &books[sp.book];
    float *dots = malloc(sizeof(float) * (size_t)(QK_K / k->dim) * (size_t)k->n);
    if (!dots) abort(); /* 512 KB at most */
    const size_t bs = dt_layout(type)->type_size;
    for (int64_t i = 0; i < nb; i++, x += QK_K) {
        iq_fit f;
        memset(&f, 0, sizeof f);
        fit_block(type, x, &f, dots);
        encode(type, &f, (uint8_t *)dst + (size_t)i * bs);
    }
    free(dots);
}
