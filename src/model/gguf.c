/* model/gguf: the GGUF v2/v3 reader (mmap or caller buffer; every count, length,
 * type, shape and offset is checked against the file size before use) and writer. */
#include "model/gguf.h"
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "dtype/dtype.h"
#include "util/error.h"
#include "util/file.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvlm reads and writes little-endian GGUF files on little-endian hosts only"
#endif

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ARRAY_DEPTH 8
/* Smallest possible encodings, used to reject counts a file cannot hold
 * before anything is allocated for them. */
#define MIN_KV_BYTES 14      /* key length 8 + 1 byte of key + type 4 + 1 byte of value */
#define MIN_TENSOR_BYTES 33  /* name length 8 + 1 + n_dims 4 + one dim 8 + type 4 + offset 8 */
#define MAX_NAME_LEN 127     /* gguf_tensor.cname holds names up to this long */

/* The public gguf_file plus what only this file needs: name for messages,
 * the mapping, hash indexes for lookups, and each value's raw bytes (so a
 * writer can copy values it does not interpret). */
typedef struct {
    gguf_file pub;
    char fname[256];
    void *mapping;
    size_t mapping_len;
    uint32_t *kv_index, *t_index; /* open addressing; slot = index + 1, 0 = empty */
    size_t kv_cap, t_cap;
    const uint8_t **kv_raw;       /* start of each value (after its type) */
    size_t *kv_raw_len;
} gguf_impl;

/* ---- little-endian loads (the map may be unaligned) ----------------------- */

static uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t ld64(const uint8_t *p) { return (uint64_t)ld32(p) | ((uint64_t)ld32(p + 4) << 32); }

static size_t vtype_size(gguf_vtype t) {
    switch (t) {
    case GGUF_UINT8: case GGUF_INT8: case GGUF_BOOL: return 1;
    case GGUF_UINT16: case GGUF_INT16: return 2;
    case GGUF_UINT32: case GGUF_INT32: case GGUF_FLOAT32: return 4;
    case GGUF_UINT64: case GGUF_INT64: case GGUF_FLOAT64: return 8;
    default: return 0; /* strings, arrays: variable */
    }
}

const char *gguf_vtype_name(gguf_vtype t) {
    static const char *names[GGUF_VTYPE_COUNT] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                                  "bool", "string", "array", "u64", "i64", "f64"};
    return (unsigned)t < GGUF_VTYPE_COUNT ? names[t] : "unknown";
}

static uint64_t fnv1a(const void *data, size_t n) {
    const uint8_t *p = data;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static bool str_eq(gguf_str s, const char *c, size_t n) { return s.len == n && memcmp(s.data, c, n) == 0; }

/* ---- the reader's cursor -------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t size, off;
    const char *fname;
    char ctx[192];     /* what is being read, for messages ("key x", "tensor y") */
    kvlm_error *err;
} reader;

static int rd_fail(reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int rd_fail(reader *r, const char *fmt, ...) {
    char msg[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->ctx[0]) return util_err_set(r->err, KVLM_EFORMAT, "%s: %s: %s", r->fname, r->ctx, msg);
    return util_err_set(r->err, KVLM_EFORMAT, "%s: %s", r->fname, msg);
}

static size_t rd_left(const reader *r) { return r->size - r->off; }

static int rd_need(reader *r, uint64_t n, const char *what) {
    if (n > rd_left(r))
        return rd_fail(r, "%s at offset %zu needs %" PRIu64 " bytes, but the file ends at %zu (truncated?)", what,
                       r->off, n, r->size);
    return 0;
}

static int rd_u32(reader *r, uint32_t *v, const char *what) {
    if (rd_need(r, 4, what)) return -1;
    *v = ld32(r->p + r->off);
    r->off += 4;
    return 0;
}

static int rd_u64(reader *r, uint64_t *v, const char *what) {
    if (rd_need(r, 8, what)) return -1;
    *v = ld64(r->p + r->off);
    r->off += 8;
    return 0;
}

static int rd_str(reader *r, gguf_str *s, const char *what) {
    uint64_t len;
    if (rd_u64(r, &len, what)) return -1;
    if (len > rd_left(r))
        return rd_fail(r, "%s at offset %zu has length %" PRIu64 ", past the end of the file (%zu bytes)", what,
                       r->off - 8, len, r->size);
    s->len = len;
    s->data = (const char *)r->p + r->off;
    r->off += (size_t)len;
    return 0;
}

static int rd_vtype(reader *r, gguf_vtype *t, const char *what) {
    uint32_t v;
    if (rd_u32(r, &v, what)) return -1;
    if (v >= GGUF_VTYPE_COUNT) return rd_fail(r, "unknown value type %u at offset %zu", v, r->off - 4);
    *t = (gguf_vtype)v;
    return 0;
}

/* Validates (and steps over) one value of type t; arrays may nest up to
 * GGUF_MAX_ARRAY_DEPTH. Every loop below is bounded by the bytes left, since
 * each element consumes at least one byte. */
static int skip_value(reader *r, gguf_vtype t, int depth) {
    size_t sz = vtype_size(t);
    if (sz) {
        if (rd_need(r, sz, gguf_vtype_name(t))) return -1;
        if (t == GGUF_BOOL && r->p[r->off] > 1)
            return rd_fail(r, "bool value %u at offset %zu is neither 0 nor 1", r->p[r->off], r->off);
        r->off += sz;
        return 0;
    }
    if (t == GGUF_STRING) {
        gguf_str s;
        return rd_str(r, &s, "string");
    }
    /* GGUF_ARRAY */
    if (depth >= GGUF_MAX_ARRAY_DEPTH) return rd_fail(r, "arrays nested deeper than %d levels", GGUF_MAX_ARRAY_DEPTH);
    gguf_vtype et = GGUF_UINT8;
    uint64_t n = 0;
    if (rd_vtype(r, &et, "array element type") || rd_u64(r, &n, "array length")) return -1;
    size_t esz = vtype_size(et);
    /* strings take >= 8 bytes, arrays >= 12 */
    size_t min_elem = esz ? esz : et == GGUF_STRING ? 8 : 12;
    if (n > rd_left(r) / min_elem)
        return rd_fail(r, "array of %" PRIu64 " %s values at offset %zu does not fit in the %zu bytes left", n,
                       gguf_vtype_name(et), r->off, rd_left(r));
    if (esz && et != GGUF_BOOL) {
        r->off += (size_t)(n * esz);
        return 0;
    }
    for (uint64_t i = 0; i < n; i++)
        if (skip_value(r, et, depth + 1)) return -1;
    return 0;
}

/* Reads one top-level value into kv (scalars decoded; arrays indexed). */
static int read_value(reader *r, gguf_kv *kv) {
    const uint8_t *start = r->p + r->off;
    if (skip_value(r, kv->type, 0)) return -1;
    switch (kv->type) {
    case GGUF_UINT8: kv->v.u = start[0]; break;
    case GGUF_INT8: kv->v.i = (int8_t)start[0]; break;
    case GGUF_UINT16: kv->v.u = ld16(start); break;
    case GGUF_INT16: kv->v.i = (int16_t)ld16(start); break;
    case GGUF_UINT32: kv->v.u = ld32(start); break;
    case GGUF_INT32: kv->v.i = (int32_t)ld32(start); break;
    case GGUF_UINT64: kv->v.u = ld64(start); break;
    case GGUF_INT64: kv->v.i = (int64_t)ld64(start); break;
    case GGUF_FLOAT32: {
        float f;
        memcpy(&f, start, 4);
        kv->v.f = f;
        break;
    }
    case GGUF_FLOAT64: memcpy(&kv->v.f, start, 8); break;
    case GGUF_BOOL: kv->v.b = start[0] != 0; break;
    case GGUF_STRING:
        kv->v.s.len = ld64(start);
        kv->v.s.data = (const char *)start + 8;
        break;
    case GGUF_ARRAY: {
        kv->arr_type = (gguf_vtype)ld32(start);
        kv->arr_n = ld64(start + 4);
        kv->arr_data = start + 12;
        if (kv->arr_type == GGUF_STRING && kv->arr_n) {
            /* skip_value proved the strings are there (>= 8 bytes each) */
            kv->arr_strs = malloc((size_t)kv->arr_n * sizeof *kv->arr_strs);
            if (!kv->arr_strs) return util_err_set(r->err, KVLM_ENOMEM, "%s: %s: out of memory", r->fname, r->ctx);
            const uint8_t *q = kv->arr_data;
            for (uint64_t i = 0; i < kv->arr_n; i++) {
                kv->arr_strs[i].len = ld64(q);
                kv->arr_strs[i].data = (const char *)q + 8;
                q += 8 + kv->arr_strs[i].len;
            }
        }
        break;
    }
    default: break;
    }
    return 0;
}

/* ---- hash indexes ----------------------------------------------------------- */

static size_t index_cap(uint64_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    return cap;
}

/* Inserts idx under name; returns the existing index + 1 if the name is
 * already present (a duplicate), else 0. */
static uint32_t index_insert(uint32_t *tab, size_t cap, const gguf_str *names, size_t stride, uint32_t idx) {
    const gguf_str *nm = (const gguf_str *)((const char *)names + stride * idx);
    size_t h = (size_t)fnv1a(nm->data, (size_t)nm->len) & (cap - 1);
    while (tab[h]) {
        const gguf_str *o = (const gguf_str *)((const char *)names + stride * (tab[h] - 1));
        if (o->len == nm->len && memcmp(o->data, nm->data, (size_t)nm->len) == 0) return tab[h];
        h = (h + 1) & (cap - 1);
    }
    tab[h] = idx + 1;
    return 0;
}

static long index_find(const uint32_t *tab, size_t cap, const gguf_str *names, size_t stride, const char *key) {
    if (!tab) return -1;
    size_t n = strlen(key);
    size_t h = (size_t)fnv1a(key, n) & (cap - 1);
    while (tab[h]) {
        const gguf_str *o = (const gguf_str *)((const char *)names + stride * (tab[h] - 1));
        if (str_eq(*o, key, n)) return (long)tab[h] - 1;
        h = (h + 1) & (cap - 1);
    }
    return -1;
}

/* ---- opening ------------------------------------------------------------------ */

static int parse_header(gguf_impl *g, reader *r) {
    gguf_file *f = &g->pub;
    if (r->size < 4 || memcmp(r->p, GGUF_MAGIC, 4) != 0)
        return rd_fail(r, "not a GGUF file (the first bytes are not \"GGUF\")");
    r->off = 4;
    if (rd_u32(r, &f->version, "version")) return -1;
    if (f->version == 1)
        return util_err_set(r->err, KVLM_EUNSUPPORTED,
                            "%s: GGUF version 1 is not supported (only versions 2 and 3): re-convert the file with a "
                            "current converter", r->fname);
    if (f->version != 2 && f->version != 3) {
        uint32_t sw = __builtin_bswap32(f->version);
        if (sw >= 1 && sw <= 3)
            return util_err_set(r->err, KVLM_EUNSUPPORTED,
                                "%s: this is a big-endian GGUF file (version %u), which kvlm does not read", r->fname,
                                sw);
        return util_err_set(r->err, KVLM_EUNSUPPORTED,
                            "%s: unsupported GGUF version %u (only versions 2 and 3 are supported)", r->fname,
                            f->version);
    }
    if (rd_u64(r, &f->n_tensors, "tensor count") || rd_u64(r, &f->n_kv, "key/value count")) return -1;
    size_t left = rd_left(r);
    /* Indexes are 32-bit; each count is bounded first so the sum cannot overflow. */
    if (f->n_kv >= UINT32_MAX || f->n_tensors >= UINT32_MAX || f->n_kv > left / MIN_KV_BYTES ||
        f->n_tensors > left / MIN_TENSOR_BYTES || f->n_kv * MIN_KV_BYTES + f->n_tensors * MIN_TENSOR_BYTES > left)
        return rd_fail(r, "header claims %" PRIu64 " tensors and %" PRIu64
                          " keys, more than a file of %zu bytes can hold",
                       f->n_tensors, f->n_kv, r->size);
    return 0;
}

static int parse_kvs(gguf_impl *g, reader *r) {
    gguf_file *f = &g->pub;
    if (f->n_kv) {
        f->kv = calloc((size_t)f->n_kv, sizeof *f->kv);
        g->kv_raw = calloc((size_t)f->n_kv, sizeof *g->kv_raw);
        g->kv_raw_len = calloc((size_t)f->n_kv, sizeof *g->kv_raw_len);
        g->kv_cap = index_cap(f->n_kv);
        g->kv_index = calloc(g->kv_cap, sizeof *g->kv_index);
        if (!f->kv || !g->kv_raw || !g->kv_raw_len || !g->kv_index)
            return util_err_set(r->err, KVLM_ENOMEM, "%s: out of memory for %" PRIu64 " keys", r->fname, f->n_kv);
    }
    for (uint64_t i = 0; i < f->n_kv; i++) {
        gguf_kv *kv = &f->kv[i];
        snprintf(r->ctx, sizeof r->ctx, "key #%" PRIu64, i);
        if (rd_str(r, &kv->key, "key")) return -1;
        if (kv->key.len == 0) return rd_fail(r, "empty key");
        snprintf(r->ctx, sizeof r->ctx, "key %.*s", (int)(kv->key.len < 120 ? kv->key.len : 120), kv->key.data);
        if (rd_vtype(r, &kv->type, "value type")) return -1;
        g->kv_raw[i] = r->p + r->off;
        if (read_value(r, kv)) return -1;
        g->kv_raw_len[i] = (size_t)(r->p + r->off - g->kv_raw[i]);
        if (index_insert(g->kv_index, g->kv_cap, &f->kv[0].key, sizeof *f->kv, (uint32_t)i))
            return rd_fail(r, "duplicate key");
    }
    r->ctx[0] = 0;
    /* The alignment must be known before the tensors' offsets are checked. */
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    long ai = f->n_kv ? index_find(g->kv_index, g->kv_cap, &f->kv[0].key, sizeof *f->kv, "general.alignment") : -1;
    if (ai >= 0) {
        const gguf_kv *kv = &f->kv[ai];
        uint64_t a;
        switch (kv->type) {
        case GGUF_UINT8: case GGUF_UINT16: case GGUF_UINT32: case GGUF_UINT64: a = kv->v.u; break;
        case GGUF_INT8: case GGUF_INT16: case GGUF_INT32: case GGUF_INT64: a = kv->v.i < 0 ? 0 : (uint64_t)kv->v.i; break;
        default:
            return rd_fail(r, "general.alignment has type %s, expected an integer", gguf_vtype_name(kv->type));
        }
        if (a == 0 || (a & (a - 1)) || a > (1u << 30))
            return rd_fail(r, "general.alignment is %" PRIu64 ", not a power of two between 1 and 2^30", a);
        f->alignment = a;
    }
    return 0;
}

static int by_offset(const void *a, const void *b) {
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int parse_tensors(gguf_impl *g, reader *r) {
    gguf_file *f = &g->pub;
    if (f->n_tensors) {
        f->tensors = calloc((size_t)f->n_tensors, sizeof *f->tensors);
        g->t_cap = index_cap(f->n_tensors);
        g->t_index = calloc(g->t_cap, sizeof *g->t_index);
        if (!f->tensors || !g->t_index)
            return util_err_set(r->err, KVLM_ENOMEM, "%s: out of memory for %" PRIu64 " tensors", r->fname,
                                f->n_tensors);
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        snprintf(r->ctx, sizeof r->ctx, "tensor #%" PRIu64, i);
        if (rd_str(r, &t->name, "tensor name")) return -1;
        if (t->name.len == 0 || t->name.len > MAX_NAME_LEN)
            return rd_fail(r, "name length %" PRIu64 " is not between 1 and %d", t->name.len, MAX_NAME_LEN);
        if (memchr(t->name.data, 0, (size_t)t->name.len)) return rd_fail(r, "name contains a NUL byte");
        memcpy(t->cname, t->name.data, (size_t)t->name.len);
        t->cname[t->name.len] = 0;
        snprintf(r->ctx, sizeof r->ctx, "tensor %s", t->cname);
        uint32_t nd;
        if (rd_u32(r, &nd, "n_dims")) return -1;
        if (nd < 1 || nd > GGUF_MAX_DIMS) return rd_fail(r, "n_dims is %u, expected 1 to %d", nd, GGUF_MAX_DIMS);
        t->n_dims = (int)nd;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < nd; d++) {
            uint64_t ne;
            if (rd_u64(r, &ne, "dimension")) return -1;
            if (ne == 0 || ne > (uint64_t)INT64_MAX)
                return rd_fail(r, "dimension %u is %" PRIu64 ", expected 1 to 2^63-1", d, ne);
            t->ne[d] = (int64_t)ne;
        }
        uint32_t type;
        if (rd_u32(r, &type, "type")) return -1;
        if (!dt_layout((int)type)) return rd_fail(r, "unknown tensor type id %u", type);
        t->type = (int)type;
        if (rd_u64(r, &t->offset, "data offset")) return -1;
        if (index_insert(g->t_index, g->t_cap, &f->tensors[0].name, sizeof *f->tensors, (uint32_t)i))
            return rd_fail(r, "duplicate tensor name");
    }
    /* The data section starts at the next multiple of the alignment. */
    uint64_t a = f->alignment, end = r->off;
    f->data_offset = (end + a - 1) / a * a;
    if (f->n_tensors && f->data_offset > r->size)
        return rd_fail(r, "the tensor data section (at offset %" PRIu64 ") starts past the end of the file (%zu bytes)",
                       f->data_offset, r->size);
    uint64_t data_size = f->data_offset <= r->size ? r->size - f->data_offset : 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        snprintf(r->ctx, sizeof r->ctx, "tensor %s", t->cname);
        const dt_traits *tr = dt_layout(t->type);
        if (t->ne[0] % tr->block_size)
            return rd_fail(r, "row length %" PRId64 " is not a multiple of the %s block size %d", t->ne[0], tr->name,
                           tr->block_size);
        uint64_t rows = 1, nbytes = (uint64_t)(t->ne[0] / tr->block_size);
        bool ovf = __builtin_mul_overflow(nbytes, (uint64_t)tr->type_size, &nbytes);
        for (int d = 1; d < GGUF_MAX_DIMS; d++) ovf |= __builtin_mul_overflow(rows, (uint64_t)t->ne[d], &rows);
        ovf |= __builtin_mul_overflow(nbytes, rows, &nbytes);
        if (ovf || nbytes > SIZE_MAX)
            return rd_fail(r, "shape %" PRId64 "x%" PRId64 "x%" PRId64 "x%" PRId64 " is too large", t->ne[0],
                           t->ne[1], t->ne[2], t->ne[3]);
        t->nbytes = (size_t)nbytes;
        if (t->offset % a)
            return rd_fail(r, "data offset %" PRIu64 " is not a multiple of the alignment %" PRIu64, t->offset, a);
        if (t->offset > data_size || nbytes > data_size - t->offset)
            return rd_fail(r, "data at offset %" PRIu64 " + %" PRIu64
                              " bytes runs past the end of the file (%zu bytes, data section at %" PRIu64 ")",
                           t->offset, nbytes, r->size, f->data_offset);
        t->data = r->p + f->data_offset + t->offset;
        /* a tensor's elements are read in place (f32 norms and biases as
         * floats): a general.alignment of 1 or 2 may leave them misaligned */
        if ((uintptr_t)t->data % dt_align(t->type))
            return rd_fail(r, "data at offset %" PRIu64 " is not %zu-byte aligned, as %s elements must be (general.alignment %" PRIu64 ")",
                           t->offset, dt_align(t->type), tr->name, a);
    }
    r->ctx[0] = 0;
    /* no two tensors may share bytes: sorted by offset, each starts at or
     * after the end of the one before */
    if (f->n_tensors > 1) {
        const gguf_tensor **by = malloc((size_t)f->n_tensors * sizeof *by);
        if (!by) return util_err_set(r->err, KVLM_ENOMEM, "%s: out of memory", r->fname);
        for (uint64_t i = 0; i < f->n_tensors; i++) by[i] = &f->tensors[i];
        qsort(by, (size_t)f->n_tensors, sizeof *by, by_offset);
        for (uint64_t i = 1; i < f->n_tensors; i++)
            if (by[i]->offset < by[i - 1]->offset + by[i - 1]->nbytes) {
                int rc = rd_fail(r, "tensors %s (data %" PRIu64 "..%" PRIu64 ") and %s (from %" PRIu64
                                    ") overlap in the data section", by[i - 1]->cname, by[i - 1]->offset,
                                 by[i - 1]->offset + by[i - 1]->nbytes, by[i]->cname, by[i]->offset);
                free(by);
                return rc;
            }
        free(by);
    }
    return 0;
}

static gguf_file *open_impl(const uint8_t *buf, size_t size, const char *name, void *mapping, kvlm_error *err) {
    gguf_impl *g = calloc(1, sizeof *g);
    if (!g) {
        if (mapping) munmap(mapping, size);
        util_err_set(err, KVLM_ENOMEM, "%s: out of memory", name);
        return NULL;
    }
    snprintf(g->fname, sizeof g->fname, "%s", name);
    g->mapping = mapping;
    g->mapping_len = size;
    g->pub.map = buf;
    g->pub.size = size;
    reader r = {.p = buf, .size = size, .off = 0, .fname = g->fname, .err = err};
    if (parse_header(g, &r) || parse_kvs(g, &r) || parse_tensors(g, &r)) {
        gguf_close(&g->pub);
        return NULL;
    }
    return &g->pub;
}

gguf_file *gguf_open(const char *path, kvlm_error *err) { return gguf_open_flags(path, 0, err); }

gguf_file *gguf_open_flags(const char *path, int map_flags, kvlm_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        util_err_set(err, KVLM_EIO, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        util_err_set(err, KVLM_EIO, "%s: not a regular file", path);
        close(fd);
        return NULL;
    }
    if (st.st_size < 24) {
        close(fd);
        util_err_set(err, KVLM_EFORMAT, "%s: file too short for a GGUF header (%lld bytes)", path,
                     (long long)st.st_size);
        return NULL;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        util_err_set(err, KVLM_EIO, "%s: file too large to map", path);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    void *map = util_map_file(fd, size, map_flags, path);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) {
        util_err_set(err, KVLM_EIO, "%s: cannot %s the file: %s", path, map_flags & UTIL_MAP_READ ? "read" : "map",
                     strerror(map_errno));
        return NULL;
    }
    return open_impl(map, size, path, map, err);
}

gguf_file *gguf_open_buffer(const void *buf, size_t size, kvlm_error *err) {
    return open_impl(buf, size, "(buffer)", NULL, err);
}

void gguf_close(gguf_file *f) {
    if (!f) return;
    gguf_impl *g = (gguf_impl *)f;
    for (uint64_t i = 0; f->kv && i < f->n_kv; i++) free(f->kv[i].arr_strs);
    free(f->kv);
    free(f->tensors);
    free(g->kv_index);
    free(g->t_index);
    free(g->kv_raw);
    free(g->kv_raw_len);
    if (g->mapping) munmap(g->mapping, g->mapping_len);
    free(g);
}

/* ---- lookups ------------------------------------------------------------------- */

const gguf_kv *gguf_find(const gguf_file *f, const char *key) {
    if (!f || !key || !f->kv) return NULL;
    const gguf_impl *g = (const gguf_impl *)f;
    long i = index_find(g->kv_index, g->kv_cap, &f->kv[0].key, sizeof *f->kv, key);
    return i >= 0 ? &f->kv[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    if (!f || !name || !f->tensors) return NULL;
    const gguf_impl *g = (const gguf_impl *)f;
    long i = index_find(g->t_index, g->t_cap, &f->tensors[0].name, sizeof *f->tensors, name);
    return i >= 0 ? &f->tensors[i] : NULL;
}

static bool vtype_is_uint(gguf_vtype t) {
    return t == GGUF_UINT8 || t == GGUF_UINT16 || t == GGUF_UINT32 || t == GGUF_UINT64;
}
static bool vtype_is_sint(gguf_vtype t) {
    return t == GGUF_INT8 || t == GGUF_INT16 || t == GGUF_INT32 || t == GGUF_INT64;
}

bool gguf_get_int(const gguf_file *f, const char *key, int64_t *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return false;
    if (vtype_is_uint(kv->type)) {
        if (kv->v.u > (uint64_t)INT64_MAX) return false;
        *out = (int64_t)kv->v.u;
        return true;
    }
    if (vtype_is_sint(kv->type)) {
        *out = kv->v.i;
        return true;
    }
    return false;
}

bool gguf_get_float(const gguf_file *f, const char *key, double *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv) return false;
    if (kv->type == GGUF_FLOAT32 || kv->type == GGUF_FLOAT64) *out = kv->v.f;
    else if (vtype_is_uint(kv->type)) *out = (double)kv->v.u; /* some converters store e.g. rope bases as ints */
    else if (vtype_is_sint(kv->type)) *out = (double)kv->v.i;
    else return false;
    return true;
}

bool gguf_get_bool(const gguf_file *f, const char *key, bool *out) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv || kv->type != GGUF_BOOL) return false;
    *out = kv->v.b;
    return true;
}

bool gguf_get_str(const gguf_file *f, const char *key, char *buf, size_t cap) {
    const gguf_kv *kv = gguf_find(f, key);
    if (!kv || kv->type != GGUF_STRING || cap == 0) return false;
    size_t n = kv->v.s.len < cap - 1 ? (size_t)kv->v.s.len : cap - 1;
    memcpy(buf, kv->v.s.data, n);
    buf[n] = 0;
    return true;
}

/* Element i of a numeric array as raw parts; false if not numeric / out of range. */
static bool arr_elem(const gguf_kv *kv, uint64_t i, uint64_t *u, int64_t *s, double *d, int *kind) {
    if (!kv || kv->type != GGUF_ARRAY || i >= kv->arr_n) return false;
    size_t esz = vtype_size(kv->arr_type);
    if (!esz) return false;
    const uint8_t *p = kv->arr_data + i * esz;
    *kind = 0;
    switch (kv->arr_type) {
    case GGUF_UINT8: case GGUF_BOOL: *u = p[0]; break;
    case GGUF_UINT16: *u = ld16(p); break;
    case GGUF_UINT32: *u = ld32(p); break;
    case GGUF_UINT64: *u = ld64(p); break;
    case GGUF_INT8: *s = (int8_t)p[0]; *kind = 1; break;
    case GGUF_INT16: *s = (int16_t)ld16(p); *kind = 1; break;
    case GGUF_INT32: *s = (int32_t)ld32(p); *kind = 1; break;
    case GGUF_INT64: *s = (int64_t)ld64(p); *kind = 1; break;
    case GGUF_FLOAT32: {
        uint32_t b = ld32(p);
        float fv;
        memcpy(&fv, &b, 4);
        *d = fv;
        *kind = 2;
        break;
    }
    case GGUF_FLOAT64: {
        uint64_t b = ld64(p);
        memcpy(d, &b, 8);
        *kind = 2;
        break;
    }
    default: return false;
    }
    return true;
}

int64_t gguf_arr_int(const gguf_kv *kv, uint64_t i) {
    uint64_t u = 0;
    int64_t s = 0;
    double d = 0;
    int kind;
    if (!arr_elem(kv, i, &u, &s, &d, &kind)) return 0;
    if (kind == 0) return u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u;
    if (kind == 1) return s;
    if (isnan(d)) return 0;
    if (d >= 9.2e18) return INT64_MAX; /* clamp: casting out-of-range doubles is undefined */
    if (d <= -9.2e18) return INT64_MIN;
    return (int64_t)d;
}

double gguf_arr_float(const gguf_kv *kv, uint64_t i) {
    uint64_t u = 0;
    int64_t s = 0;
    double d = 0;
    int kind;
    if (!arr_elem(kv, i, &u, &s, &d, &kind)) return 0;
    return kind == 0 ? (double)u : kind == 1 ? (double)s : d;
}

/* ---- printing -------------------------------------------------------------------- */

typedef struct { char *buf; size_t cap, n; } sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->n + 1 >= b->cap) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->buf + b->n, b->cap - b->n, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    b->n = b->n + (size_t)k < b->cap ? b->n + (size_t)k : b->cap - 1;
}

/* A quoted string, control bytes escaped, at most max_bytes shown. */
static void sb_quoted(sbuf *b, const char *s, uint64_t len, size_t max_bytes) {
    sb_printf(b, "\"");
    for (uint64_t i = 0; i < len && i < max_bytes; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') sb_printf(b, "\\%c", c);
        else if (c == '\n') sb_printf(b, "\\n");
        else if (c == '\t') sb_printf(b, "\\t");
        else if (c < 0x20 || c == 0x7f) sb_printf(b, "\\x%02x", c);
        else sb_printf(b, "%c", c);
    }
    sb_printf(b, len > max_bytes ? "\"..." : "\"");
}

void gguf_kv_format(const gguf_kv *kv, char *buf, size_t cap) {
    if (!buf || cap == 0) return;
    buf[0] = 0;
    if (!kv) return;
    sbuf b = {buf, cap, 0};
    switch (kv->type) {
    case GGUF_UINT8: case GGUF_UINT16: case GGUF_UINT32: case GGUF_UINT64: sb_printf(&b, "%" PRIu64, kv->v.u); break;
    case GGUF_INT8: case GGUF_INT16: case GGUF_INT32: case GGUF_INT64: sb_printf(&b, "%" PRId64, kv->v.i); break;
    case GGUF_FLOAT32: case GGUF_FLOAT64: sb_printf(&b, "%g", kv->v.f); break;
    case GGUF_BOOL: sb_printf(&b, kv->v.b ? "true" : "false"); break;
    case GGUF_STRING: sb_quoted(&b, kv->v.s.data, kv->v.s.len, 200); break;
    case GGUF_ARRAY: {
        sb_printf(&b, "[%s x %" PRIu64 "]", gguf_vtype_name(kv->arr_type), kv->arr_n);
        const uint64_t show = 8;
        for (uint64_t i = 0; i < kv->arr_n && i < show; i++) {
            sb_printf(&b, i ? ", " : " ");
            if (kv->arr_type == GGUF_STRING) sb_quoted(&b, kv->arr_strs[i].data, kv->arr_strs[i].len, 40);
            else if (kv->arr_type == GGUF_FLOAT32 || kv->arr_type == GGUF_FLOAT64)
                sb_printf(&b, "%g", gguf_arr_float(kv, i));
            else if (kv->arr_type == GGUF_BOOL) sb_printf(&b, gguf_arr_int(kv, i) ? "true" : "false");
            else if (kv->arr_type == GGUF_UINT64) {
                uint64_t u = ld64(kv->arr_data + 8 * i);
                sb_printf(&b, "%" PRIu64, u);
            } else if (kv->arr_type == GGUF_ARRAY) {
                sb_printf(&b, "[...]");
            } else sb_printf(&b, "%" PRId64, gguf_arr_int(kv, i));
        }
        if (kv->arr_n > show) sb_printf(&b, ", ...");
        break;
    }
    default: sb_printf(&b, "?"); break;
    }
}

/* ---- writer ---------------------------------------------------------------------- */

typedef struct { uint8_t *p; size_t n, cap; bool oom; } bbuf;

static void bb_put(bbuf *b, const void *data, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) { b->oom = true; return; }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, data, n);
    b->n += n;
}
static void bb_u32(bbuf *b, uint32_t v) { bb_put(b, &v, 4); } /* host is little-endian (checked above) */
static void bb_u64(bbuf *b, uint64_t v) { bb_put(b, &v, 8); }
static void bb_str(bbuf *b, const char *s, size_t n) { bb_u64(b, n); bb_put(b, s, n); }

typedef struct {
    char *key;
    gguf_vtype type;
    uint8_t *val; /* the value as encoded in the file (after the type) */
    size_t len;
} wkv;

typedef struct {
    char name[MAX_NAME_LEN + 1];
    int type, n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    const void *data;
    size_t nbytes;
} wtensor;

struct gguf_writer {
    wkv *kv;
    size_t n_kv, cap_kv;
    wtensor *t;
    size_t n_t, cap_t;
    int fail_code;      /* first deferred error of a setter (they return void) */
    char fail_msg[256];
};

gguf_writer *gguf_writer_create(void) { return calloc(1, sizeof(gguf_writer)); }

void gguf_writer_free(gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    free(w->kv);
    free(w->t);
    free(w);
}

static void w_fail(gguf_writer *w, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void w_fail(gguf_writer *w, int code, const char *fmt, ...) {
    if (w->fail_code) return;
    w->fail_code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->fail_msg, sizeof w->fail_msg, fmt, ap);
    va_end(ap);
}

static long w_find(const gguf_writer *w, const char *key) {
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kv[i].key, key) == 0) return (long)i;
    return -1;
}

/* Takes ownership of the encoded value in b; replaces an existing key in place
 * (keeping its position), else appends. */
static void w_set(gguf_writer *w, const char *key, gguf_vtype type, bbuf *b) {
    if (!w) { free(b->p); return; }
    if (!key || !*key) { free(b->p); w_fail(w, KVLM_EINVAL, "empty metadata key"); return; }
    if (b->oom) { free(b->p); w_fail(w, KVLM_ENOMEM, "out of memory setting %s", key); return; }
    long i = w_find(w, key);
    if (i >= 0) {
        free(w->kv[i].val);
        w->kv[i].type = type;
        w->kv[i].val = b->p;
        w->kv[i].len = b->n;
        return;
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        wkv *p = realloc(w->kv, cap * sizeof *p);
        if (!p) { free(b->p); w_fail(w, KVLM_ENOMEM, "out of memory setting %s", key); return; }
        w->kv = p;
        w->cap_kv = cap;
    }
    char *k = strdup(key);
    if (!k) { free(b->p); w_fail(w, KVLM_ENOMEM, "out of memory setting %s", key); return; }
    w->kv[w->n_kv++] = (wkv){k, type, b->p, b->n};
}

static void w_scalar(gguf_writer *w, const char *key, gguf_vtype t, const void *v) {
    bbuf b = {0};
    bb_put(&b, v, vtype_size(t));
    w_set(w, key, t, &b);
}

void gguf_writer_set_u8(gguf_writer *w, const char *key, uint8_t v) { w_scalar(w, key, GGUF_UINT8, &v); }
void gguf_writer_set_i8(gguf_writer *w, const char *key, int8_t v) { w_scalar(w, key, GGUF_INT8, &v); }
void gguf_writer_set_u16(gguf_writer *w, const char *key, uint16_t v) { w_scalar(w, key, GGUF_UINT16, &v); }
void gguf_writer_set_i16(gguf_writer *w, const char *key, int16_t v) { w_scalar(w, key, GGUF_INT16, &v); }
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v) { w_scalar(w, key, GGUF_UINT32, &v); }
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v) { w_scalar(w, key, GGUF_INT32, &v); }
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v) { w_scalar(w, key, GGUF_UINT64, &v); }
void gguf_writer_set_i64(gguf_writer *w, const char *key, int64_t v) { w_scalar(w, key, GGUF_INT64, &v); }
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v) { w_scalar(w, key, GGUF_FLOAT32, &v); }
void gguf_writer_set_f64(gguf_writer *w, const char *key, double v) { w_scalar(w, key, GGUF_FLOAT64, &v); }
void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v) {
    uint8_t b = v ? 1 : 0;
    w_scalar(w, key, GGUF_BOOL, &b);
}

void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v) {
    bbuf b = {0};
    if (!v) v = "";
    bb_str(&b, v, strlen(v));
    w_set(w, key, GGUF_STRING, &b);
}

void gguf_writer_set_arr_strn(gguf_writer *w, const char *key, const char *const *v, const uint32_t *lens,
                              uint64_t n) {
    bbuf b = {0};
    bb_u32(&b, GGUF_STRING);
    bb_u64(&b, n);
    for (uint64_t i = 0; i < n; i++) {
        const char *s = v[i] ? v[i] : "";
        bb_str(&b, s, lens && v[i] ? lens[i] : strlen(s));
    }
    w_set(w, key, GGUF_ARRAY, &b);
}

void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n) {
    gguf_writer_set_arr_strn(w, key, v, NULL, n);
}

void gguf_writer_set_arr(gguf_writer *w, const char *key, gguf_vtype type, const void *v, uint64_t n) {
    size_t esz = vtype_size(type);
    if (!esz) {
        if (w) w_fail(w, KVLM_EINVAL, "%s: gguf_writer_set_arr takes numeric or bool elements, not %s",
                      key ? key : "?", gguf_vtype_name(type));
        return;
    }
    bbuf b = {0};
    bb_u32(&b, (uint32_t)type);
    bb_u64(&b, n);
    if (n > SIZE_MAX / esz) b.oom = true;
    else if (type == GGUF_BOOL) {
        for (uint64_t i = 0; i < n; i++) {
            uint8_t x = ((const uint8_t *)v)[i] ? 1 : 0; /* bools must be 0/1 in the file */
            bb_put(&b, &x, 1);
        }
    } else bb_put(&b, v, (size_t)(n * esz));
    w_set(w, key, GGUF_ARRAY, &b);
}

void gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n) {
    gguf_writer_set_arr(w, key, GGUF_FLOAT32, v, n);
}

void gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n) {
    gguf_writer_set_arr(w, key, GGUF_INT32, v, n);
}

int gguf_writer_set_raw(gguf_writer *w, const char *key, gguf_vtype type, const void *val, size_t len,
                        kvlm_error *err) {
    if (!w || !key) return util_err_set(err, KVLM_EINVAL, "gguf_writer_set_raw: no writer or key");
    /* The bytes must be exactly one valid value, checked like a file's. */
    reader r = {.p = val, .size = len, .off = 0, .fname = key, .err = err};
    if ((unsigned)type >= GGUF_VTYPE_COUNT) return util_err_set(err, KVLM_EINVAL, "%s: unknown value type %d", key, (int)type);
    if (skip_value(&r, type, 0)) return err ? err->code : KVLM_EFORMAT;
    if (r.off != len)
        return util_err_set(err, KVLM_EINVAL, "%s: %zu bytes left over after the %s value", key, len - r.off,
                            gguf_vtype_name(type));
    bbuf b = {0};
    bb_put(&b, val, len);
    w_set(w, key, type, &b);
    return w->fail_code ? util_err_set(err, w->fail_code, "%s", w->fail_msg) : KVLM_OK;
}

void gguf_writer_copy_kv(gguf_writer *w, const gguf_file *f, const char *prefix) {
    if (!w || !f) return;
    const gguf_impl *g = (const gguf_impl *)f;
    size_t plen = prefix ? strlen(prefix) : 0;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const gguf_kv *kv = &f->kv[i];
        if (kv->key.len < plen || memcmp(kv->key.data, prefix, plen) != 0) continue;
        if (memchr(kv->key.data, 0, (size_t)kv->key.len)) continue; /* not representable as a C key */
        char *key = malloc((size_t)kv->key.len + 1);
        if (!key) { w_fail(w, KVLM_ENOMEM, "out of memory copying metadata"); return; }
        memcpy(key, kv->key.data, (size_t)kv->key.len);
        key[kv->key.len] = 0;
        if (w_find(w, key) < 0) {
            bbuf b = {0};
            bb_put(&b, g->kv_raw[i], g->kv_raw_len[i]);
            w_set(w, key, kv->type, &b);
        }
        free(key);
    }
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, int type, int n_dims, const int64_t *ne,
                           const void *data, kvlm_error *err) {
    if (!w || !name || !ne) return util_err_set(err, KVLM_EINVAL, "gguf_writer_add_tensor: missing argument");
    size_t len = strlen(name);
    if (len == 0 || len > MAX_NAME_LEN)
        return util_err_set(err, KVLM_EINVAL, "tensor name \"%.40s\" must be 1 to %d bytes", name, MAX_NAME_LEN);
    const dt_traits *tr = dt_layout(type);
    if (!tr) return util_err_set(err, KVLM_EINVAL, "tensor %s: unknown type id %d", name, type);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return util_err_set(err, KVLM_EINVAL, "tensor %s: n_dims %d, expected 1 to %d", name, n_dims, GGUF_MAX_DIMS);
    uint64_t rows = 1, nbytes;
    bool ovf = false;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] <= 0) return util_err_set(err, KVLM_EINVAL, "tensor %s: dimension %d is %lld", name, d, (long long)ne[d]);
        if (d) ovf |= __builtin_mul_overflow(rows, (uint64_t)ne[d], &rows);
    }
    if (ne[0] % tr->block_size)
        return util_err_set(err, KVLM_EINVAL, "tensor %s: row length %lld is not a multiple of the %s block size %d",
                            name, (long long)ne[0], tr->name, tr->block_size);
    ovf |= __builtin_mul_overflow((uint64_t)(ne[0] / tr->block_size), (uint64_t)tr->type_size, &nbytes);
    ovf |= __builtin_mul_overflow(nbytes, rows, &nbytes);
    if (ovf || nbytes > SIZE_MAX) return util_err_set(err, KVLM_EINVAL, "tensor %s: too large", name);
    if (!data) return util_err_set(err, KVLM_EINVAL, "tensor %s: no data", name);
    for (size_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0) return util_err_set(err, KVLM_EINVAL, "duplicate tensor name %s", name);
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? 2 * w->cap_t : 16;
        wtensor *p = realloc(w->t, cap * sizeof *p);
        if (!p) return util_err_set(err, KVLM_ENOMEM, "out of memory adding tensor %s", name);
        w->t = p;
        w->cap_t = cap;
    }
    wtensor *t = &w->t[w->n_t++];
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, len + 1);
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->data = data;
    t->nbytes = (size_t)nbytes;
    return KVLM_OK;
}

/* Builds everything before the tensor data (padded to the alignment) and
 * the total file size. */
static int w_build_header(gguf_writer *w, bbuf *h, uint64_t *align_out, uint64_t *total, kvlm_error *err) {
    if (w->fail_code) return util_err_set(err, w->fail_code, "%s", w->fail_msg);
    uint64_t a = GGUF_DEFAULT_ALIGNMENT;
    long ai = w_find(w, "general.alignment");
    if (ai >= 0) {
        const wkv *kv = &w->kv[ai];
        if (kv->type == GGUF_UINT32) a = ld32(kv->val);
        else if (kv->type == GGUF_UINT64) a = ld64(kv->val);
        else return util_err_set(err, KVLM_EINVAL, "general.alignment must be an unsigned integer, not %s",
                                 gguf_vtype_name(kv->type));
        if (a == 0 || (a & (a - 1)) || a > (1u << 30))
            return util_err_set(err, KVLM_EINVAL, "general.alignment %" PRIu64 " is not a power of two up to 2^30", a);
    }
    bb_put(h, GGUF_MAGIC, 4);
    bb_u32(h, 3);
    bb_u64(h, w->n_t);
    bb_u64(h, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        bb_str(h, w->kv[i].key, strlen(w->kv[i].key));
        bb_u32(h, (uint32_t)w->kv[i].type);
        bb_put(h, w->kv[i].val, w->kv[i].len);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        bb_str(h, t->name, strlen(t->name));
        bb_u32(h, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++) bb_u64(h, (uint64_t)t->ne[d]);
        bb_u32(h, (uint32_t)t->type);
        bb_u64(h, off);
        off += (t->nbytes + a - 1) / a * a;
    }
    static const uint8_t zeros[64];
    while (h->n % a) bb_put(h, zeros, (size_t)(a - h->n % a) < sizeof zeros ? (size_t)(a - h->n % a) : sizeof zeros);
    if (h->oom) return util_err_set(err, KVLM_ENOMEM, "out of memory building the GGUF header");
    *align_out = a;
    *total = h->n + off;
    return KVLM_OK;
}

int gguf_writer_write(gguf_writer *w, const char *path, kvlm_error *err) {
    return gguf_writer_write_progress(w, path, NULL, NULL, 0, 1, err);
}

int gguf_writer_write_progress(gguf_writer *w, const char *path, kvlm_progress_callback cb, void *user, float lo,
                               float hi, kvlm_error *err) {
    if (!w || !path) return util_err_set(err, KVLM_EINVAL, "gguf_writer_write: no writer or path");
    bbuf h = {0};
    uint64_t a, total;
    int rc = w_build_header(w, &h, &a, &total, err);
    if (rc) { free(h.p); return rc; }
    /* Write beside the target and rename, so a failed write never leaves a
     * half-written model under the real name. */
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *fp = fopen(tmp, "wb");
    if (!fp) {
        free(h.p);
        return util_err_set(err, KVLM_EIO, "cannot create %s: %s", tmp, strerror(errno));
    }
    static const uint8_t zeros[4096];
    bool ok = fwrite(h.p, 1, h.n, fp) == h.n, canceled = false;
    free(h.p);
    uint64_t done = 0, all = 0;
    for (size_t i = 0; i < w->n_t; i++) all += w->t[i].nbytes;
    for (size_t i = 0; ok && i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        if (cb && !cb(lo + (hi - lo) * (float)((double)done / (double)(all ? all : 1)), user)) {
            ok = false;
            canceled = true;
            break;
        }
        done += t->nbytes;
        ok = fwrite(t->data, 1, t->nbytes, fp) == t->nbytes;
        size_t pad = (size_t)((a - t->nbytes % a) % a);
        while (ok && pad) {
            size_t k = pad < sizeof zeros ? pad : sizeof zeros;
            ok = fwrite(zeros, 1, k, fp) == k;
            pad -= k;
        }
    }
    int save_errno = errno;
    if (fclose(fp) != 0 && ok) { ok = false; save_errno = errno; }
    if (ok && rename(tmp, path) != 0) { ok = false; save_errno = errno; }
    if (!ok) {
        unlink(tmp);
        if (canceled) return util_err_set(err, KVLM_ECANCELED, "%s: writing canceled by the progress callback", path);
        return util_err_set(err, KVLM_EIO, "cannot write %s: %s", path, strerror(save_errno));
    }
    (void)total; /* the file is streamed; only the memory image needs it */
    return KVLM_OK;
}

int gguf_writer_write_mem(gguf_writer *w, void **out, size_t *size, kvlm_error *err) {
    if (!w || !out || !size) return util_err_set(err, KVLM_EINVAL, "gguf_writer_write_mem: missing argument");
    bbuf h = {0};
    uint64_t a, total;
    int rc = w_build_header(w, &h, &a, &total, err);
    if (rc) { free(h.p); return rc; }
    if (total > SIZE_MAX) { free(h.p); return util_err_set(err, KVLM_ENOMEM, "GGUF image too large for memory"); }
    uint8_t *buf = calloc(1, (size_t)total ? (size_t)total : 1);
    if (!buf) { free(h.p); return util_err_set(err, KVLM_ENOMEM, "out of memory for a %" PRIu64 "-byte GGUF image", total); }
    memcpy(buf, h.p, h.n);
    size_t off = h.n;
    for (size_t i = 0; i < w->n_t; i++) {
        memcpy(buf + off, w->t[i].data, w->t[i].nbytes);
        off += (size_t)((w->t[i].nbytes + a - 1) / a * a);
    }
    free(h.p);
    *out = buf;
    *size = (size_t)total;
    return KVLM_OK;
}
