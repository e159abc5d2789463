/* tests/test_gguf: the GGUF reader and writer: round trips of every value and
 * tensor type, real files, and malformed files (rejected cleanly, no crash). */
#include <inttypes.h>
#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "dtype/dtype.h"
#include "model/gguf.h"
#include "kvlm.h"

/* ---- a byte builder for hand-made files (independent of the writer) ---- */

typedef struct { uint8_t *p; size_t n, cap; } bytes;

static void put(bytes *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void put_u32(bytes *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(bytes *b, uint64_t v) { put(b, &v, 8); }
static void put_str(bytes *b, const char *s) {
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void put_pad(bytes *b, size_t a) {
    while (b->n % a) put(b, "", 1);
}

typedef struct {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[5];
    uint32_t type;
    uint64_t offset;
    uint64_t nbytes; /* data bytes to emit for it */
} tspec;

typedef struct {
    uint32_t version;
    bool claim_counts;          /* use n_kv/n_tensors below instead of the real ones */
    uint64_t n_kv, n_tensors;
    bool has_align;
    uint32_t align_type;        /* GGUF_UINT32 normally */
    uint32_t align;
    uint32_t str_type;          /* type written for the "test.str" key */
    uint64_t str_len_claim;     /* 0: real length */
    const char *dup_key;        /* a second key with this name */
    int n_t;
    tspec t[3];
} fspec;

static fspec base_spec(void) {
    fspec s = {.version = 3, .align_type = GGUF_UINT32, .str_type = GGUF_STRING, .n_t = 2};
    s.t[0] = (tspec){"a.weight", 2, {8, 2}, DT_F32, 0, 64};
    s.t[1] = (tspec){"b.weight", 1, {32}, DT_Q8_0, 64, 34};
    return s;
}

static bytes build(const fspec *s) {
    bytes b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, s->version);
    uint64_t n_kv = 1 + (s->has_align ? 1 : 0) + (s->dup_key ? 1 : 0);
    put_u64(&b, s->claim_counts ? s->n_tensors : (uint64_t)s->n_t);
    put_u64(&b, s->claim_counts ? s->n_kv : n_kv);
    if (s->has_align) {
        put_str(&b, "general.alignment");
        put_u32(&b, s->align_type);
        if (s->align_type == GGUF_STRING) put_str(&b, "32");
        else put_u32(&b, s->align);
    }
    put_str(&b, "test.str");
    put_u32(&b, s->str_type);
    if (s->str_type == GGUF_STRING) {
        put_u64(&b, s->str_len_claim ? s->str_len_claim : 5);
        put(&b, "hello", 5);
    } else {
        put_u64(&b, 5); /* whatever the type, some bytes follow */
    }
    if (s->dup_key) {
        put_str(&b, s->dup_key);
        put_u32(&b, GGUF_UINT8);
        put(&b, "\x01", 1);
    }
    for (int i = 0; i < s->n_t; i++) {
        put_str(&b, s->t[i].name);
        put_u32(&b, s->t[i].n_dims);
        for (uint32_t d = 0; d < s->t[i].n_dims && d < 5; d++) put_u64(&b, s->t[i].ne[d]);
        put_u32(&b, s->t[i].type);
        put_u64(&b, s->t[i].offset);
    }
    size_t a = s->has_align && s->align && !(s->align & (s->align - 1)) ? s->align : 32;
    put_pad(&b, a);
    size_t data0 = b.n;
    for (int i = 0; i < s->n_t; i++) {
        while (b.n < data0 + s->t[i].offset && s->t[i].offset < 4096) put(&b, "", 1);
        for (uint64_t k = 0; k < s->t[i].nbytes && k < 4096; k++) {
            uint8_t v = (uint8_t)(k * 13 + (uint64_t)i);
            put(&b, &v, 1);
        }
    }
    put_pad(&b, a);
    return b;
}

/* Opens a copy of exactly n bytes (so ASan sees any read past the end). */
static gguf_file *open_copy(const void *data, size_t n, kvlm_error *err) {
    void *c = malloc(n ? n : 1);
    assert_non_null(c);
    memcpy(c, data, n);
    gguf_file *f = gguf_open_buffer(c, n, err);
    if (!f) free(c); /* else close_copy frees it (f->map) */
    return f;
}
static void close_copy(gguf_file *f) {
    if (!f) return;
    void *c = (void *)f->map;
    gguf_close(f);
    free(c);
}

static void expect_reject(const fspec *s, const char *needle1, const char *needle2) {
    bytes b = build(s);
    kvlm_error err = {0};
    gguf_file *f = open_copy(b.p, b.n, &err);
    if (f) {
        close_copy(f);
        free(b.p);
        fail_msg("accepted a malformed file (expected \"%s\")", needle1);
    }
    assert_int_not_equal(err.code, KVLM_OK);
    if (needle1 && !strstr(err.msg, needle1)) fail_msg("message \"%s\" lacks \"%s\"", err.msg, needle1);
    if (needle2 && !strstr(err.msg, needle2)) fail_msg("message \"%s\" lacks \"%s\"", err.msg, needle2);
    free(b.p);
}

static void test_handmade_valid(void **state) {
    (void)state;
    fspec s = base_spec();
    bytes b = build(&s);
    kvlm_error err = {0};
    gguf_file *f = open_copy(b.p, b.n, &err);
    if (!f) fail_msg("%s", err.msg);
    assert_int_equal(f->version, 3);
    assert_int_equal(f->n_tensors, 2);
    const gguf_tensor *t = gguf_find_tensor(f, "b.weight");
    assert_non_null(t);
    assert_int_equal(t->nbytes, 34);
    assert_int_equal(t->ne[0], 32);
    assert_int_equal(t->ne[1], 1);
    assert_int_equal((const uint8_t *)t->data - f->map, f->data_offset + 64);
    char buf[64];
    assert_true(gguf_get_str(f, "test.str", buf, sizeof buf));
    assert_string_equal(buf, "hello");
    close_copy(f);
    free(b.p);
    /* the smallest valid file: a header with no keys and no tensors */
    bytes e = {0};
    put(&e, "GGUF", 4);
    put_u32(&e, 3);
    put_u64(&e, 0);
    put_u64(&e, 0);
    f = open_copy(e.p, e.n, &err);
    if (!f) fail_msg("%s", err.msg);
    assert_int_equal(f->n_kv, 0);
    assert_int_equal(f->n_tensors, 0);
    assert_int_equal(f->alignment, 32);
    assert_null(gguf_find(f, "general.alignment"));
    assert_null(gguf_find_tensor(f, "x"));
    close_copy(f);
    free(e.p);
    /* version 2 reads the same */
    s.version = 2;
    b = build(&s);
    f = open_copy(b.p, b.n, &err);
    assert_non_null(f);
    assert_int_equal(f->version, 2);
    close_copy(f);
    free(b.p);
}

static void test_malformed(void **state) {
    (void)state;
    fspec s;
    /* magic and version */
    bytes b = build(&(fspec){.version = 3});
    b.p[0] = 'X';
    kvlm_error err = {0};
    assert_null(open_copy(b.p, b.n, &err));
    assert_non_null(strstr(err.msg, "not a GGUF file"));
    assert_null(open_copy(b.p, 3, &err));
    free(b.p);
    s = base_spec(); s.version = 1; expect_reject(&s, "version 1", NULL);
    s = base_spec(); s.version = 99; expect_reject(&s, "version 99", NULL);
    s = base_spec(); s.version = 0x03000000; expect_reject(&s, "big-endian", NULL);
    /* absurd counts: rejected before any allocation */
    s = base_spec(); s.claim_counts = true; s.n_kv = 1ull << 62; s.n_tensors = 2;
    expect_reject(&s, "more than a file", NULL);
    s = base_spec(); s.claim_counts = true; s.n_kv = 1; s.n_tensors = 1ull << 62;
    expect_reject(&s, "more than a file", NULL);
    s = base_spec(); s.claim_counts = true; s.n_kv = UINT64_MAX; s.n_tensors = UINT64_MAX;
    expect_reject(&s, "more than a file", NULL);
    /* counts larger than what is there, but plausible for the size */
    s = base_spec(); s.claim_counts = true; s.n_kv = 3; s.n_tensors = 2; expect_reject(&s, NULL, NULL);
    /* strings */
    s = base_spec(); s.str_len_claim = 1ull << 40; expect_reject(&s, "test.str", "past the end");
    s = base_spec(); s.str_len_claim = UINT64_MAX; expect_reject(&s, "past the end", NULL);
    /* value types */
    s = base_spec(); s.str_type = 13; expect_reject(&s, "unknown value type 13", "test.str");
    s = base_spec(); s.str_type = 0xffffffffu; expect_reject(&s, "unknown value type", NULL);
    /* duplicate keys and tensors */
    s = base_spec(); s.dup_key = "test.str"; expect_reject(&s, "duplicate key", "test.str");
    s = base_spec(); s.t[1].name = "a.weight"; expect_reject(&s, "duplicate tensor", "a.weight");
    /* tensor shapes and types */
    s = base_spec(); s.t[1].type = 200; expect_reject(&s, "tensor b.weight", "unknown tensor type id 200");
    s = base_spec(); s.t[1].type = 4; expect_reject(&s, "tensor b.weight", "type id 4");
    s = base_spec(); s.t[0].n_dims = 0; expect_reject(&s, "tensor a.weight", "n_dims is 0");
    s = base_spec(); s.t[0].n_dims = 5; s.t[0].ne[2] = s.t[0].ne[3] = s.t[0].ne[4] = 1;
    expect_reject(&s, "n_dims is 5", NULL);
    s = base_spec(); s.t[0].ne[1] = 0; expect_reject(&s, "tensor a.weight", "dimension 1 is 0");
    s = base_spec(); s.t[0].ne[0] = 1ull << 63; expect_reject(&s, "dimension 0", NULL);
    s = base_spec(); s.t[0].n_dims = 4; s.t[0].ne[0] = 1ull << 40; s.t[0].ne[1] = 1ull << 40;
    s.t[0].ne[2] = 1ull << 40; s.t[0].ne[3] = 1ull << 40; expect_reject(&s, "too large", NULL);
    s = base_spec(); s.t[0].ne[0] = 1ull << 62; s.t[0].ne[1] = 1; expect_reject(&s, "too large", NULL);
    s = base_spec(); s.t[0].ne[0] = 1ull << 40; expect_reject(&s, "past the end", "a.weight");
    s = base_spec(); s.t[1].ne[0] = 33; expect_reject(&s, "not a multiple of the q8_0 block size", NULL);
    s = base_spec(); s.t[1].name = "a name that is far too long for a tensor: 0123456789012345678901234567890123456789"
                                   "0123456789012345678901234567890123456789"
                                   "0123456789012345678901234567890123456789";
    expect_reject(&s, "name length 162", NULL);
    /* offsets */
    s = base_spec(); s.t[1].offset = 1ull << 40; expect_reject(&s, "tensor b.weight", "past the end");
    s = base_spec(); s.t[1].offset = UINT64_MAX - 31; expect_reject(&s, "past the end", NULL);
    s = base_spec(); s.t[1].offset = 48; expect_reject(&s, "b.weight", "not a multiple of the alignment 32");
    s = base_spec(); s.t[1].offset = 70; expect_reject(&s, "alignment", NULL);
    /* alignment */
    /* alignment 2 lets an f32 tensor start 2 bytes off a multiple of 4: refused, not read misaligned */
    int misaligned = 0;
    for (uint64_t off = 2; off <= 4; off += 2) {
        s = base_spec(); s.has_align = true; s.align = 2; s.t[0].offset = off; s.t[1].offset = 128;
        bytes bb = build(&s);
        kvlm_error e2 = {0};
        gguf_file *g2 = open_copy(bb.p, bb.n, &e2); /* malloc's copy: aligned, so the file's offsets decide */
        if (!g2) {
            if (!strstr(e2.msg, "is not 4-byte aligned, as f32 elements must be (general.alignment 2)"))
                fail_msg("offset %d: %s", (int)off, e2.msg);
            misaligned++;
        }
        close_copy(g2);
        free(bb.p);
    }
    assert_int_equal(misaligned, 1);
    s = base_spec(); s.has_align = true; s.align = 0; expect_reject(&s, "general.alignment is 0", NULL);
    s = base_spec(); s.has_align = true; s.align = 48; expect_reject(&s, "general.alignment is 48", NULL);
    s = base_spec(); s.has_align = true; s.align_type = GGUF_STRING; expect_reject(&s, "general.alignment has type", NULL);
    s = base_spec(); s.has_align = true; s.align = 64; s.t[1].offset = 32; expect_reject(&s, "alignment 64", NULL);
    s = base_spec(); s.has_align = true; s.align = 64; s.t[1].offset = 64;
    b = build(&s);
    gguf_file *f = open_copy(b.p, b.n, &err);
    if (!f) fail_msg("%s", err.msg);
    assert_int_equal(f->alignment, 64);
    assert_int_equal(f->data_offset % 64, 0);
    close_copy(f);
    free(b.p);
    /* empty and tiny buffers */
    assert_null(gguf_open_buffer("", 0, &err));
    assert_null(gguf_open_buffer("GGUF", 4, &err));
}

/* Arrays: nesting limits, impossible lengths, bool values. */
static void test_malformed_values(void **state) {
    (void)state;
    kvlm_error err = {0};
    /* a key whose value is given by the caller */
    typedef struct { const char *what; uint8_t val[256]; size_t len; uint32_t type; const char *needle; } vcase;
    vcase cases[12];
    int n = 0;
    bytes v;
    /* bool 2 */
    cases[n] = (vcase){"bool 2", {2}, 1, GGUF_BOOL, "neither 0 nor 1"};
    n++;
    /* array of u64 claiming 2^61 elements */
    v = (bytes){0};
    put_u32(&v, GGUF_UINT64);
    put_u64(&v, 1ull << 61);
    memcpy(cases[n].val, v.p, v.n);
    cases[n].len = v.n; cases[n].type = GGUF_ARRAY; cases[n].what = "huge array"; cases[n].needle = "does not fit";
    n++;
    free(v.p);
    /* array of strings claiming more than fit */
    v = (bytes){0};
    put_u32(&v, GGUF_STRING);
    put_u64(&v, 1000);
    put_str(&v, "x");
    memcpy(cases[n].val, v.p, v.n);
    cases[n].len = v.n; cases[n].type = GGUF_ARRAY; cases[n].what = "string array"; cases[n].needle = "does not fit";
    n++;
    free(v.p);
    /* arrays nested 9 deep */
    v = (bytes){0};
    for (int d = 0; d < 9; d++) { put_u32(&v, GGUF_ARRAY); put_u64(&v, 1); }
    put_u32(&v, GGUF_UINT8);
    put_u64(&v, 0);
    memcpy(cases[n].val, v.p, v.n);
    cases[n].len = v.n; cases[n].type = GGUF_ARRAY; cases[n].what = "deep"; cases[n].needle = "nested deeper";
    n++;
    free(v.p);
    /* array with an unknown element type */
    v = (bytes){0};
    put_u32(&v, 77);
    put_u64(&v, 1);
    memcpy(cases[n].val, v.p, v.n);
    cases[n].len = v.n; cases[n].type = GGUF_ARRAY; cases[n].what = "elem type"; cases[n].needle = "unknown value type 77";
    n++;
    free(v.p);
    /* bool array with a 3 */
    v = (bytes){0};
    put_u32(&v, GGUF_BOOL);
    put_u64(&v, 3);
    put(&v, "\x01\x00\x03", 3);
    memcpy(cases[n].val, v.p, v.n);
    cases[n].len = v.n; cases[n].type = GGUF_ARRAY; cases[n].what = "bool array"; cases[n].needle = "neither 0 nor 1";
    n++;
    free(v.p);
    for (int i = 0; i < n; i++) {
        bytes b = {0};
        put(&b, "GGUF", 4);
        put_u32(&b, 3);
        put_u64(&b, 0);
        put_u64(&b, 1);
        put_str(&b, "bad.value");
        put_u32(&b, cases[i].type);
        put(&b, cases[i].val, cases[i].len);
        for (int k = 0; k < 64; k++) put(&b, "", 1); /* room, so only the value is wrong */
        gguf_file *f = open_copy(b.p, b.n, &err);
        if (f) fail_msg("%s: accepted", cases[i].what);
        if (!strstr(err.msg, cases[i].needle) || !strstr(err.msg, "bad.value"))
            fail_msg("%s: message \"%s\" lacks \"%s\"", cases[i].what, err.msg, cases[i].needle);
        free(b.p);
        /* the writer's raw setter rejects the same bytes */
        gguf_writer *w = gguf_writer_create();
        assert_int_not_equal(gguf_writer_set_raw(w, "k", (gguf_vtype)cases[i].type, cases[i].val, cases[i].len, &err),
                             KVLM_OK);
        gguf_writer_free(w);
    }
}

/* ---- writer -> reader ---- */

static const int64_t k_shape_types[] = {DT_F32, DT_F16, DT_BF16, DT_Q8_0, DT_Q4_0, DT_Q4_K, DT_Q6_K, DT_Q8_K};

static gguf_writer *make_full_writer(void **tensor_data, int *n_tensor_data) {
    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_u8(w, "v.u8", 200);
    gguf_writer_set_i8(w, "v.i8", -100);
    gguf_writer_set_u16(w, "v.u16", 60000);
    gguf_writer_set_i16(w, "v.i16", -30000);
    gguf_writer_set_u32(w, "v.u32", 4000000000u);
    gguf_writer_set_i32(w, "v.i32", -2000000000);
    gguf_writer_set_u64(w, "v.u64", UINT64_MAX);
    gguf_writer_set_i64(w, "v.i64", INT64_MIN);
    gguf_writer_set_f32(w, "v.f32", 1.5f);
    gguf_writer_set_f64(w, "v.f64", -2.25e300);
    gguf_writer_set_bool(w, "v.bool", true);
    gguf_writer_set_str(w, "v.str", "quote \" and \n newline");
    gguf_writer_set_str(w, "v.empty", "");
    const char *strs[] = {"<unk>", "<s>", "", "\xe2\x96\x81the"};
    gguf_writer_set_arr_str(w, "a.str", strs, 4);
    const char *nul_tok[] = {"a\0b"};
    const uint32_t nul_len[] = {3};
    gguf_writer_set_arr_strn(w, "a.strn", nul_tok, nul_len, 1);
    const float fl[] = {0.5f, -1.0f, 3.25f};
    gguf_writer_set_arr_f32(w, "a.f32", fl, 3);
    const int32_t in[] = {-1, 0, 2147483647};
    gguf_writer_set_arr_i32(w, "a.i32", in, 3);
    const uint8_t u8s[] = {1, 2, 255};
    gguf_writer_set_arr(w, "a.u8", GGUF_UINT8, u8s, 3);
    const int8_t i8s[] = {-128, 127};
    gguf_writer_set_arr(w, "a.i8", GGUF_INT8, i8s, 2);
    const uint16_t u16s[] = {65535};
    gguf_writer_set_arr(w, "a.u16", GGUF_UINT16, u16s, 1);
    const int16_t i16s[] = {-32768};
    gguf_writer_set_arr(w, "a.i16", GGUF_INT16, i16s, 1);
    const uint32_t u32s[] = {4294967295u, 7};
    gguf_writer_set_arr(w, "a.u32", GGUF_UINT32, u32s, 2);
    const uint64_t u64s[] = {UINT64_MAX, 1};
    gguf_writer_set_arr(w, "a.u64", GGUF_UINT64, u64s, 2);
    const int64_t i64s[] = {INT64_MIN, -5};
    gguf_writer_set_arr(w, "a.i64", GGUF_INT64, i64s, 2);
    const double f64s[] = {1e-300, 2.5};
    gguf_writer_set_arr(w, "a.f64", GGUF_FLOAT64, f64s, 2);
    const uint8_t bools[] = {1, 0, 7};
    gguf_writer_set_arr(w, "a.bool", GGUF_BOOL, bools, 3);
    gguf_writer_set_arr(w, "a.empty", GGUF_INT32, NULL, 0);
    /* arrays of arrays, in the file encoding: [[1,2],[3]] of u32 and [["x"],[]] */
    bytes v = {0};
    put_u32(&v, GGUF_ARRAY);
    put_u64(&v, 2);
    put_u32(&v, GGUF_UINT32); put_u64(&v, 2); put_u32(&v, 1); put_u32(&v, 2);
    put_u32(&v, GGUF_UINT32); put_u64(&v, 1); put_u32(&v, 3);
    kvlm_error err = {0};
    assert_int_equal(gguf_writer_set_raw(w, "a.nested", GGUF_ARRAY, v.p, v.n, &err), KVLM_OK);
    free(v.p);
    v = (bytes){0};
    put_u32(&v, GGUF_ARRAY);
    put_u64(&v, 2);
    put_u32(&v, GGUF_STRING); put_u64(&v, 1); put_str(&v, "x");
    put_u32(&v, GGUF_STRING); put_u64(&v, 0);
    assert_int_equal(gguf_writer_set_raw(w, "a.nested_str", GGUF_ARRAY, v.p, v.n, &err), KVLM_OK);
    free(v.p);
    /* setting a key again replaces it in place */
    gguf_writer_set_u8(w, "v.u8", 201);

    /* one tensor of each type, 2 rows */
    uint64_t s = 99;
    int nt = 0;
    for (size_t i = 0; i < sizeof k_shape_types / sizeof k_shape_types[0]; i++) {
        int type = (int)k_shape_types[i];
        int64_t ne[2] = {type == DT_F32 || type == DT_F16 || type == DT_BF16 ? 7 : dt_info(type)->block_size * 2, 2};
        size_t rs = dt_row_size(type, ne[0]);
        float *x = malloc((size_t)(ne[0] * ne[1]) * sizeof *x);
        uint8_t *q = malloc(rs * 2);
        tu_fill_random(x, (size_t)(ne[0] * ne[1]), &s, 1.0f);
        for (int r = 0; r < 2; r++) assert_int_equal(dt_quantize_row(type, x + r * ne[0], q + r * rs, ne[0]), 0);
        free(x);
        char name[64];
        snprintf(name, sizeof name, "blk.%d.%s.weight", (int)i, dt_name(type));
        assert_int_equal(gguf_writer_add_tensor(w, name, type, 2, ne, q, &err), KVLM_OK);
        tensor_data[nt++] = q;
    }
    /* a 4-D tensor and a ggml type kvlm does not compute with */
    static uint8_t odd[288 * 3];
    for (size_t i = 0; i < sizeof odd; i++) odd[i] = (uint8_t)i;
    int64_t ne4[4] = {256, 1, 3, 1};
    assert_int_equal(gguf_writer_add_tensor(w, "odd.q8_1", DT_Q8_1 /* 36 bytes per 32, not computed with */, 4, ne4, odd, &err), KVLM_OK);
    *n_tensor_data = nt;
    return w;
}

static void check_full_file(const gguf_file *f, uint64_t want_align) {
    assert_int_equal(f->version, 3);
    assert_int_equal(f->alignment, want_align);
    int64_t iv;
    double dv;
    bool bv;
    char buf[256];
    /* insertion order, with the replaced key kept in its place */
    assert_int_equal(f->kv[0].key.len, strlen("general.architecture"));
    assert_memory_equal(f->kv[1].key.data, "v.u8", 4);
    assert_int_equal(f->kv[1].type, GGUF_UINT8);
    assert_true(gguf_get_int(f, "v.u8", &iv) && iv == 201);
    assert_true(gguf_get_int(f, "v.i8", &iv) && iv == -100);
    assert_true(gguf_get_int(f, "v.u16", &iv) && iv == 60000);
    assert_true(gguf_get_int(f, "v.i16", &iv) && iv == -30000);
    assert_true(gguf_get_int(f, "v.u32", &iv) && iv == 4000000000LL);
    assert_true(gguf_get_int(f, "v.i32", &iv) && iv == -2000000000LL);
    assert_false(gguf_get_int(f, "v.u64", &iv)); /* does not fit int64 */
    assert_int_equal(gguf_find(f, "v.u64")->v.u, UINT64_MAX);
    assert_true(gguf_get_int(f, "v.i64", &iv) && iv == INT64_MIN);
    assert_true(gguf_get_float(f, "v.f32", &dv) && dv == 1.5);
    assert_true(gguf_get_float(f, "v.f64", &dv) && dv == -2.25e300);
    assert_true(gguf_get_float(f, "v.u8", &dv) && dv == 201.0);
    assert_false(gguf_get_int(f, "v.f32", &iv));
    assert_false(gguf_get_int(f, "v.str", &iv));
    assert_true(gguf_get_bool(f, "v.bool", &bv) && bv);
    assert_false(gguf_get_bool(f, "v.u8", &bv));
    assert_true(gguf_get_str(f, "v.str", buf, sizeof buf));
    assert_string_equal(buf, "quote \" and \n newline");
    assert_true(gguf_get_str(f, "v.str", buf, 6));
    assert_string_equal(buf, "quote");
    assert_true(gguf_get_str(f, "v.empty", buf, sizeof buf));
    assert_string_equal(buf, "");
    assert_false(gguf_get_str(f, "v.u8", buf, sizeof buf));
    assert_null(gguf_find(f, "missing"));
    assert_false(gguf_get_int(f, "missing", &iv));

    const gguf_kv *kv = gguf_find(f, "a.str");
    assert_non_null(kv);
    assert_int_equal(kv->type, GGUF_ARRAY);
    assert_int_equal(kv->arr_type, GGUF_STRING);
    assert_int_equal(kv->arr_n, 4);
    assert_int_equal(kv->arr_strs[2].len, 0);
    assert_memory_equal(kv->arr_strs[3].data, "\xe2\x96\x81the", 6);
    gguf_kv_format(kv, buf, sizeof buf);
    assert_string_equal(buf, "[string x 4] \"<unk>\", \"<s>\", \"\", \"\xe2\x96\x81the\"");
    kv = gguf_find(f, "a.strn");
    assert_int_equal(kv->arr_strs[0].len, 3);
    assert_memory_equal(kv->arr_strs[0].data, "a\0b", 3);
    kv = gguf_find(f, "a.f32");
    assert_true(gguf_arr_float(kv, 2) == 3.25);
    assert_int_equal(gguf_arr_int(kv, 1), -1);
    assert_true(gguf_arr_float(kv, 3) == 0); /* out of range */
    gguf_kv_format(kv, buf, sizeof buf);
    assert_string_equal(buf, "[f32 x 3] 0.5, -1, 3.25");
    kv = gguf_find(f, "a.i32");
    assert_int_equal(gguf_arr_int(kv, 0), -1);
    assert_int_equal(gguf_arr_int(kv, 2), 2147483647);
    kv = gguf_find(f, "a.u8");
    assert_int_equal(kv->arr_type, GGUF_UINT8);
    assert_int_equal(gguf_arr_int(kv, 2), 255);
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.i8"), 0), -128);
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.u16"), 0), 65535);
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.i16"), 0), -32768);
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.u32"), 0), 4294967295LL);
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.u64"), 0), INT64_MAX); /* clamped */
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.u64"), 1), 1);
    assert_int_equal(gguf_arr_int(gguf_find(f, "a.i64"), 0), INT64_MIN);
    assert_true(gguf_arr_float(gguf_find(f, "a.f64"), 0) == 1e-300);
    kv = gguf_find(f, "a.bool");
    assert_int_equal(gguf_arr_int(kv, 0), 1);
    assert_int_equal(gguf_arr_int(kv, 1), 0);
    assert_int_equal(gguf_arr_int(kv, 2), 1);
    gguf_kv_format(kv, buf, sizeof buf);
    assert_string_equal(buf, "[bool x 3] true, false, true");
    kv = gguf_find(f, "a.empty");
    assert_int_equal(kv->arr_n, 0);
    kv = gguf_find(f, "a.nested");
    assert_int_equal(kv->arr_type, GGUF_ARRAY);
    assert_int_equal(kv->arr_n, 2);
    assert_int_equal(gguf_arr_int(kv, 0), 0); /* not numeric */
    gguf_kv_format(kv, buf, sizeof buf);
    assert_string_equal(buf, "[array x 2] [...], [...]");
    assert_non_null(gguf_find(f, "a.nested_str"));
    gguf_kv_format(gguf_find(f, "v.u64"), buf, sizeof buf);
    assert_string_equal(buf, "18446744073709551615");
    gguf_kv_format(gguf_find(f, "v.str"), buf, sizeof buf);
    assert_string_equal(buf, "\"quote \\\" and \\n newline\"");
    gguf_kv_format(gguf_find(f, "v.str"), buf, 8); /* truncation is safe */
    assert_int_equal(strlen(buf), 7);

    /* tensors */
    assert_int_equal(f->n_tensors, sizeof k_shape_types / sizeof k_shape_types[0] + 1);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        assert_int_equal(((const uint8_t *)t->data - f->map) % want_align, 0);
        assert_int_equal(t->offset % want_align, 0);
        assert_ptr_equal(gguf_find_tensor(f, t->cname), t);
    }
    const gguf_tensor *t = gguf_find_tensor(f, "odd.q8_1");
    assert_non_null(t);
    assert_int_equal(t->type, DT_Q8_1);
    assert_null(dt_info(t->type));
    assert_int_equal(t->n_dims, 4);
    assert_int_equal(t->ne[2], 3);
    assert_int_equal(t->nbytes, 288 * 3);
    for (int i = 0; i < 288 * 3; i++) assert_int_equal(((const uint8_t *)t->data)[i], (uint8_t)i);
    assert_null(gguf_find_tensor(f, "nope"));
}

static void test_writer_round_trip(void **state) {
    (void)state;
    void *data[16];
    int nd;
    gguf_writer *w = make_full_writer(data, &nd);
    kvlm_error err = {0};
    const char *path = tu_tmp_path(".gguf");
    assert_int_equal(gguf_writer_write(w, path, &err), KVLM_OK);
    void *mem;
    size_t mem_size;
    assert_int_equal(gguf_writer_write_mem(w, &mem, &mem_size, &err), KVLM_OK);
    gguf_file *f = gguf_open(path, &err);
    if (!f) fail_msg("%s", err.msg);
    /* the file and the memory image are the same bytes */
    assert_int_equal(f->size, mem_size);
    assert_memory_equal(f->map, mem, mem_size);
    check_full_file(f, 32);
    /* tensor bytes are what was given */
    for (int i = 0; i < nd; i++) {
        const gguf_tensor *t = &f->tensors[i];
        assert_memory_equal(t->data, data[i], t->nbytes);
        /* and they dequantize (every supported type) */
        float *y = malloc((size_t)t->ne[0] * sizeof *y);
        dt_dequantize_row(t->type, t->data, y, t->ne[0]);
        free(y);
    }
    gguf_close(f);
    free(mem);

    /* copy_kv: everything (but keys already set), or a prefix */
    gguf_file *src = gguf_open(path, &err);
    assert_non_null(src);
    gguf_writer *w2 = gguf_writer_create();
    gguf_writer_set_str(w2, "v.str", "mine");
    gguf_writer_copy_kv(w2, src, "a.");
    gguf_writer_copy_kv(w2, src, "v.s");
    assert_int_equal(gguf_writer_write_mem(w2, &mem, &mem_size, &err), KVLM_OK);
    gguf_close(src);
    f = gguf_open_buffer(mem, mem_size, &err);
    assert_non_null(f);
    char buf[64];
    assert_true(gguf_get_str(f, "v.str", buf, sizeof buf));
    assert_string_equal(buf, "mine");
    assert_null(gguf_find(f, "v.u8"));
    assert_null(gguf_find(f, "general.architecture"));
    assert_int_equal(gguf_find(f, "a.str")->arr_n, 4);
    assert_int_equal(gguf_find(f, "a.nested")->arr_n, 2);
    assert_int_equal(f->n_tensors, 0);
    gguf_close(f);
    free(mem);
    gguf_writer_free(w2);

    /* another alignment */
    gguf_writer_set_u32(w, "general.alignment", 256);
    assert_int_equal(gguf_writer_write_mem(w, &mem, &mem_size, &err), KVLM_OK);
    f = gguf_open_buffer(mem, mem_size, &err);
    if (!f) fail_msg("%s", err.msg);
    check_full_file(f, 256);
    gguf_close(f);
    free(mem);
    gguf_writer_set_u32(w, "general.alignment", 24);
    assert_int_not_equal(gguf_writer_write_mem(w, &mem, &mem_size, &err), KVLM_OK);
    assert_non_null(strstr(err.msg, "alignment"));
    gguf_writer_free(w);
    for (int i = 0; i < nd; i++) free(data[i]);
}

static void test_writer_errors(void **state) {
    (void)state;
    gguf_writer *w = gguf_writer_create();
    kvlm_error err = {0};
    float x[64] = {0};
    int64_t ne[2] = {32, 2};
    assert_int_equal(gguf_writer_add_tensor(w, "t", DT_F32, 2, ne, x, &err), KVLM_OK);
    assert_int_not_equal(gguf_writer_add_tensor(w, "t", DT_F32, 2, ne, x, &err), KVLM_OK);
    assert_non_null(strstr(err.msg, "duplicate"));
    assert_int_not_equal(gguf_writer_add_tensor(w, "u", 4, 2, ne, x, &err), KVLM_OK);
    assert_int_not_equal(gguf_writer_add_tensor(w, "u", DT_F32, 0, ne, x, &err), KVLM_OK);
    assert_int_not_equal(gguf_writer_add_tensor(w, "u", DT_F32, 5, ne, x, &err), KVLM_OK);
    assert_int_not_equal(gguf_writer_add_tensor(w, "", DT_F32, 2, ne, x, &err), KVLM_OK);
    int64_t bad[2] = {33, 1};
    assert_int_not_equal(gguf_writer_add_tensor(w, "u", DT_Q8_0, 2, bad, x, &err), KVLM_OK);
    int64_t zero[2] = {32, 0};
    assert_int_not_equal(gguf_writer_add_tensor(w, "u", DT_F32, 2, zero, x, &err), KVLM_OK);
    /* writing into a folder that does not exist */
    assert_int_equal(gguf_writer_write(w, "/nonexistent-dir/x.gguf", &err), KVLM_EIO);
    gguf_writer_free(w);
    /* opening what is not there / not a file */
    assert_null(gguf_open("/nonexistent-dir/x.gguf", &err));
    assert_int_equal(err.code, KVLM_EIO);
    assert_null(gguf_open("/", &err));
    const char *empty = tu_tmp_path(".gguf");
    assert_int_equal(tu_write_file(empty, "", 0), 0);
    assert_null(gguf_open(empty, &err));
    assert_non_null(strstr(err.msg, empty));
}

/* Every prefix of a small valid file is rejected cleanly, or (when only
 * trailing padding is cut) reads the same. */
static void small_image(void **mem, size_t *size) {
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_u32(w, "llama.block_count", 2);
    const char *toks[] = {"a", "bc", "<0x0A>"};
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    const float sc[] = {0, -1, -2};
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", sc, 3);
    bytes v = {0};
    put_u32(&v, GGUF_ARRAY);
    put_u64(&v, 1);
    put_u32(&v, GGUF_INT16);
    put_u64(&v, 2);
    put(&v, "\x01\x00\x02\x00", 4);
    kvlm_error err = {0};
    assert_int_equal(gguf_writer_set_raw(w, "x.nested", GGUF_ARRAY, v.p, v.n, &err), KVLM_OK);
    free(v.p);
    static float a[40];
    static uint8_t q[34 * 2];
    for (int i = 0; i < 40; i++) a[i] = (float)i;
    assert_int_equal(dt_quantize_row(DT_Q8_0, a, q, 32), 0);
    assert_int_equal(dt_quantize_row(DT_Q8_0, a, q + 34, 32), 0);
    int64_t ne_a[2] = {5, 8}, ne_q[2] = {32, 2};
    assert_int_equal(gguf_writer_add_tensor(w, "a", DT_F32, 2, ne_a, a, &err), KVLM_OK);
    assert_int_equal(gguf_writer_add_tensor(w, "q", DT_Q8_0, 2, ne_q, q, &err), KVLM_OK);
    assert_int_equal(gguf_writer_write_mem(w, mem, size, &err), KVLM_OK);
    gguf_writer_free(w);
}

static void test_truncation(void **state) {
    (void)state;
    void *mem;
    size_t size;
    small_image(&mem, &size);
    kvlm_error err;
    gguf_file *full = gguf_open_buffer(mem, size, &err);
    assert_non_null(full);
    size_t last_end = 0;
    for (uint64_t i = 0; i < full->n_tensors; i++) {
        size_t e = (size_t)(full->data_offset + full->tensors[i].offset + full->tensors[i].nbytes);
        if (e > last_end) last_end = e;
    }
    int accepted = 0;
    for (size_t n = 0; n < size; n++) {
        err.code = KVLM_OK;
        err.msg[0] = 0;
        gguf_file *f = open_copy(mem, n, &err);
        if (f) {
            /* only cutting trailing padding may leave a valid file */
            assert_true(n >= last_end);
            assert_int_equal(f->n_tensors, full->n_tensors);
            assert_int_equal(f->n_kv, full->n_kv);
            assert_memory_equal(f->tensors[1].data, full->tensors[1].data, full->tensors[1].nbytes);
            accepted++;
            close_copy(f);
        } else {
            assert_int_not_equal(err.code, KVLM_OK);
            assert_true(strlen(err.msg) > 10);
        }
    }
    print_message("  %zu prefixes, %d valid (padding cut)\n", size, accepted);
    gguf_close(full);
    free(mem);
}

/* Random byte changes: never a crash or an out-of-bounds read (ASan). */
static void touch_everything(const gguf_file *f) {
    char buf[512];
    volatile unsigned sum = 0;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        gguf_kv_format(&f->kv[i], buf, sizeof buf);
        if (f->kv[i].type == GGUF_ARRAY)
            for (uint64_t k = 0; k < f->kv[i].arr_n && k < 64; k++) {
                sum += (unsigned)gguf_arr_int(&f->kv[i], k);
                if (f->kv[i].arr_type == GGUF_STRING)
                    for (uint64_t c = 0; c < f->kv[i].arr_strs[k].len; c++) sum += (unsigned)f->kv[i].arr_strs[k].data[c];
            }
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const uint8_t *d = f->tensors[i].data;
        for (size_t k = 0; k < f->tensors[i].nbytes; k++) sum += d[k];
        assert_ptr_equal(gguf_find_tensor(f, f->tensors[i].cname), &f->tensors[i]);
    }
    (void)sum;
}

static void test_fuzz(void **state) {
    (void)state;
    void *mem;
    size_t size;
    small_image(&mem, &size);
    uint8_t *work = malloc(size);
    uint64_t s = 0x1234567;
    int iters = tu_quick() ? 600 : 4000, ok = 0;
    for (int it = 0; it < iters; it++) {
        memcpy(work, mem, size);
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        int flips = 1 + (int)((s >> 60) & 3);
        for (int k = 0; k < flips; k++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            size_t pos = (size_t)((s >> 33) % size);
            /* mostly the header and metadata, where the structure lives */
            if ((s >> 20) & 1) pos %= (size < 400 ? size : 400);
            uint8_t val = (uint8_t)(s >> 12);
            if ((s >> 8) & 1) val = (uint8_t)(work[pos] ^ (1u << ((s >> 4) & 7)));
            work[pos] = val;
        }
        size_t n = size;
        if (((s >> 40) & 7) == 0) n = (size_t)((s >> 44) % size);
        kvlm_error err = {0};
        gguf_file *f = open_copy(work, n, &err);
        if (f) {
            touch_everything(f);
            ok++;
            close_copy(f);
        } else {
            assert_true(err.msg[0] != 0);
        }
    }
    print_message("  %d mutated files, %d still valid\n", iters, ok);
    free(work);
    free(mem);
}

static void test_real_files(void **state) {
    (void)state;
    const char *p = tu_model_path("stories260K.gguf");
    TU_REQUIRE(p);
    kvlm_error err = {0};
    gguf_file *f = gguf_open(p, &err);
    if (!f) fail_msg("%s", err.msg);
    assert_int_equal(f->version, 3);
    int64_t v;
    assert_true(gguf_get_int(f, "llama.block_count", &v));
    assert_int_equal(v, 5);
    assert_true(gguf_get_int(f, "llama.embedding_length", &v));
    assert_int_equal(v, 64);
    char arch[32];
    assert_true(gguf_get_str(f, "general.architecture", arch, sizeof arch));
    assert_string_equal(arch, "llama");
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, DT_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 512);
    t = gguf_find_tensor(f, "blk.4.ffn_down.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 172);
    assert_int_equal(t->ne[1], 64);
    t = gguf_find_tensor(f, "blk.0.attn_k.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 32); /* 4 KV heads x 8 */
    assert_non_null(gguf_find_tensor(f, "output_norm.weight"));
    /* every tensor's data lies inside the map */
    for (uint64_t i = 0; i < f->n_tensors; i++)
        assert_true((const uint8_t *)f->tensors[i].data + f->tensors[i].nbytes <= f->map + f->size);
    char buf[256];
    gguf_kv_format(gguf_find(f, "tokenizer.ggml.tokens"), buf, sizeof buf);
    assert_non_null(strstr(buf, "[string x 512] \"<unk>\", \"<s>\", \"</s>\""));
    print_message("  %s: %" PRIu64 " keys, %" PRIu64 " tensors; tokens %s\n", p, f->n_kv, f->n_tensors, buf);
    gguf_close(f);

    const char *names[] = {"vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-gpt-2.gguf"};
    const uint64_t n_tok[] = {32000, 50257};
    for (int i = 0; i < 2; i++) {
        p = tu_model_path(names[i]);
        if (!p) continue;
        f = gguf_open(p, &err);
        if (!f) fail_msg("%s", err.msg);
        assert_int_equal(f->n_tensors, 0);
        const gguf_kv *kv = gguf_find(f, "tokenizer.ggml.tokens");
        assert_non_null(kv);
        assert_int_equal(kv->arr_n, n_tok[i]);
        gguf_close(f);
    }
}

/* ---- model files: nonsense rejected with one clear error ---- */

enum { MUT_NONE, MUT_DROP_BLOCK1, MUT_EXTRA_BLOCK, MUT_FREQS_ZERO, MUT_FREQS_SHORT, MUT_FREQS_OK };
/* The model sp describes, written and opened, and a writer holding set's
 * keys, then the file's (set first: copy_kv keeps what is already set); the
 * caller adds the tensors, then rewrite_load. */
static gguf_file *rewrite_begin(const kvlm_synth_params *sp, void (*set)(gguf_writer *), gguf_writer **w,
                                kvlm_error *err) {
    char src[512];
    snprintf(src, sizeof src, "%s", tu_tmp_path(".gguf"));
    assert_int_equal(kvlm_model_synth(sp, src, err), KVLM_OK);
    gguf_file *f = gguf_open(src, err);
    assert_non_null(f);
    *w = gguf_writer_create();
    if (set) set(*w);
    gguf_writer_copy_kv(*w, f, "");
    return f;
}
/* Writes w, closes both, loads the result: the model, or NULL with err filled. */
static kvlm_model *rewrite_load(gguf_writer *w, gguf_file *f, kvlm_error *err) {
    const char *path = tu_tmp_path(".gguf");
    assert_int_equal(gguf_writer_write(w, path, err), KVLM_OK);
    gguf_writer_free(w);
    gguf_close(f);
    return kvlm_model_load(path, NULL, err);
}

/* A valid 2-block synthetic model of arch rewritten with keys overridden by
 * set and its blocks' tensors altered; returns the load's code (the model
 * freed), err filled. */
static int load_mutated_arch(kvlm_arch arch, void (*set)(gguf_writer *), int mut, kvlm_error *err) {
    kvlm_synth_params sp = {0};
    sp.arch = arch;
    sp.dim = 32; sp.hidden_dim = 64; sp.n_layers = 2; sp.n_heads = 4; sp.vocab_size = 64; sp.n_ctx = 64;
    sp.type = kvlm_type_from_name("f32");
    gguf_writer *w;
    gguf_file *f = rewrite_begin(&sp, set, &w, err);
    float ff[4] = {1, 2, 4, 4}; /* the writer keeps the pointer until it writes */
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (mut == MUT_DROP_BLOCK1 && !strncmp(t->cname, "blk.1.", 6)) continue;
        assert_int_equal(gguf_writer_add_tensor(w, t->cname, t->type, t->n_dims, t->ne, t->data, err), KVLM_OK);
        if (mut >= MUT_FREQS_ZERO && i == 0) { /* head dim 8: rope_freqs.weight of 4 factors */
            ff[3] = mut == MUT_FREQS_ZERO ? 0 : 4;
            int64_t ne[1] = {mut == MUT_FREQS_SHORT ? 3 : 4};
            assert_int_equal(gguf_writer_add_tensor(w, "rope_freqs.weight", 0 /* f32 */, 1, ne, ff, err), KVLM_OK);
        }
        if (mut == MUT_EXTRA_BLOCK && !strcmp(t->cname, "blk.0.attn_norm.weight"))
            assert_int_equal(gguf_writer_add_tensor(w, "blk.7.attn_norm.weight", t->type, t->n_dims, t->ne, t->data, err),
                             KVLM_OK);
    }
    kvlm_model *m = rewrite_load(w, f, err);
    if (!m) return err->code;
    kvlm_model_free(m);
    return KVLM_OK;
}
static int load_mutated(void (*set)(gguf_writer *), int mut, kvlm_error *err) {
    return load_mutated_arch(KVLM_ARCH_LLAMA, set, mut, err);
}
static void set_blocks_str(gguf_writer *w) { gguf_writer_set_str(w, "llama.block_count", "2"); }
static void set_blocks_float(gguf_writer *w) { gguf_writer_set_f32(w, "llama.block_count", 2.0f); }
static void set_eps_nan(gguf_writer *w) { gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", NAN); }
static void set_eps_neg(gguf_writer *w) { gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", -1e-5f); }
static void set_base_inf(gguf_writer *w) { gguf_writer_set_f32(w, "llama.rope.freq_base", INFINITY); }
static void set_base_neg(gguf_writer *w) { gguf_writer_set_f32(w, "llama.rope.freq_base", -10000.0f); }
static void set_base_str(gguf_writer *w) { gguf_writer_set_str(w, "llama.rope.freq_base", "10000"); }
static void set_blocks_4(gguf_writer *w) { gguf_writer_set_u32(w, "llama.block_count", 4); }
static void set_ctx_zero(gguf_writer *w) { gguf_writer_set_i32(w, "llama.context_length", -5); }
static void set_scaling_longrope(gguf_writer *w) { gguf_writer_set_str(w, "llama.rope.scaling.type", "longrope"); }
static void set_yarn_no_ctx(gguf_writer *w) {
    gguf_writer_set_str(w, "llama.rope.scaling.type", "yarn");
    gguf_writer_set_f32(w, "llama.rope.scaling.factor", 4.0f);
}
static void set_experts_no_used(gguf_writer *w) { gguf_writer_set_u32(w, "llama.expert_count", 4); }
static void set_experts_many(gguf_writer *w) { gguf_writer_set_u32(w, "llama.expert_count", 5000); }
static void set_experts_no_tensors(gguf_writer *w) {
    gguf_writer_set_u32(w, "llama.expert_count", 4);
    gguf_writer_set_u32(w, "llama.expert_used_count", 2);
}
static void set_olmo_window(gguf_writer *w) { gguf_writer_set_u32(w, "olmo2.attention.sliding_window", 4096); }
/* OLMo 3's pattern as llama.cpp's converter writes it: a bool per layer (local) */
static const uint8_t k_pat_ok[2] = {1, 0}, k_pat_bad[2] = {0, 1};
static void set_olmo_pattern_ok(gguf_writer *w) {
    set_olmo_window(w);
    gguf_writer_set_arr(w, "olmo2.attention.sliding_window_pattern", GGUF_BOOL, k_pat_ok, 2);
}
static void set_olmo_pattern_bad(gguf_writer *w) {
    set_olmo_window(w);
    gguf_writer_set_arr(w, "olmo2.attention.sliding_window_pattern", GGUF_BOOL, k_pat_bad, 2);
}
static void set_olmo_pattern_short(gguf_writer *w) {
    set_olmo_window(w);
    gguf_writer_set_arr(w, "olmo2.attention.sliding_window_pattern", GGUF_BOOL, k_pat_ok, 1);
}
static void set_olmo_yarn_factor(gguf_writer *w) {
    set_olmo_window(w);
    gguf_writer_set_str(w, "olmo2.rope.scaling.type", "yarn");
    gguf_writer_set_f32(w, "olmo2.rope.scaling.factor", 4.0f);
    gguf_writer_set_u32(w, "olmo2.rope.scaling.original_context_length", 16);
    gguf_writer_set_f32(w, "olmo2.rope.scaling.attn_factor", 1.5f);
}
static void set_olmo_yarn_own(gguf_writer *w) { /* the converter's copy of YaRN's own magnitude: taken */
    set_olmo_yarn_factor(w);
    gguf_writer_set_f32(w, "olmo2.rope.scaling.attn_factor", (float)(1.0 + 0.1 * log(4.0)));
}
static void set_granite_nope(gguf_writer *w) { gguf_writer_set_bool(w, "granite.rope.scaling.finetuned", false); }
static void set_granitemoe_nope(gguf_writer *w) { gguf_writer_set_bool(w, "granitemoe.rope.scaling.finetuned", false); }
static void set_granitemoe_tuned(gguf_writer *w) { gguf_writer_set_bool(w, "granitemoe.rope.scaling.finetuned", true); }
static void set_linear_nan(gguf_writer *w) {
    gguf_writer_set_str(w, "llama.rope.scaling.type", "linear");
    gguf_writer_set_f32(w, "llama.rope.scaling.factor", NAN);
}

static void test_model_nonsense(void **state) {
    (void)state;
    struct { void (*set)(gguf_writer *); int mut; const char *needle1, *needle2; } cases[] = {
        {set_blocks_str, MUT_NONE, "llama.block_count has type string", "expected an integer"},
        {set_blocks_float, MUT_NONE, "llama.block_count has type f32", "expected an integer"},
        {set_eps_nan, MUT_NONE, "layer_norm_rms_epsilon = nan", "finite"},
        {set_eps_neg, MUT_NONE, "layer_norm_rms_epsilon = -1e-05", "at least 0"},
        {set_base_inf, MUT_NONE, "rope.freq_base = inf", "finite"},
        {set_base_neg, MUT_NONE, "rope.freq_base = -10000", "above 0"},
        {set_base_str, MUT_NONE, "rope.freq_base has type string", "expected a number"},
        {set_blocks_4, MUT_NONE, "block_count is 4", "tensors for 2 blocks"},
        {NULL, MUT_DROP_BLOCK1, "block_count is 2", "tensors for 1 blocks (none for block 1)"},
        {NULL, MUT_EXTRA_BLOCK, "blk.7.attn_norm.weight belongs to block 7", "block_count is 2"},
        {set_ctx_zero, MUT_NONE, "context_length = -5", "at least 1"},
        {NULL, MUT_FREQS_ZERO, "rope_freqs.weight: factor 3 is 0", "finite and above 0"},
        {NULL, MUT_FREQS_SHORT, "tensor rope_freqs.weight: shape 3x1", "expected 4"},
        {set_linear_nan, MUT_NONE, "rope.scaling.factor = nan", "finite"},
        {set_yarn_no_ctx, MUT_NONE, "YaRN RoPE scaling needs llama.rope.scaling.original_context_length", "1 to 2^24"},
        {set_experts_no_used, MUT_NONE, "key llama.expert_used_count is missing", "1 to the 4 experts"},
        {set_experts_many, MUT_NONE, "llama.expert_count = 5000 is outside 1..1024", ""},
        {set_experts_no_tensors, MUT_NONE, "missing tensor blk.0.ffn_gate_inp.weight", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvlm_error err = {0};
        int rc = load_mutated(cases[i].set, cases[i].mut, &err);
        printf("  case %zu: %s\n", i, err.msg);
        assert_int_equal(rc, KVLM_EFORMAT);
        if (!strstr(err.msg, cases[i].needle1) || !strstr(err.msg, cases[i].needle2))
            fail_msg("case %zu: \"%s\" lacks \"%s\" or \"%s\"", i, err.msg, cases[i].needle1, cases[i].needle2);
    }
    kvlm_error err = {0};
    assert_int_equal(load_mutated(NULL, MUT_NONE, &err), KVLM_OK); /* the unaltered file loads */
    assert_int_equal(load_mutated(NULL, MUT_FREQS_OK, &err), KVLM_OK); /* and with Llama 3.1's factors */
    /* a RoPE scaling kvlm does not apply is refused by name, never run as plain RoPE */
    assert_int_equal(load_mutated(set_scaling_longrope, MUT_NONE, &err), KVLM_EUNSUPPORTED);
    printf("  longrope on llama: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "llama.rope.scaling.type = \"longrope\""));
    /* OLMo 3's sliding windows under the olmo2 name: a period of 4 by default, or a bool per layer
     * that must be one; a YaRN attention factor other than YaRN's own is refused */
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, NULL, MUT_NONE, &err), KVLM_OK);
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, set_olmo_window, MUT_NONE, &err), KVLM_OK);
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, set_olmo_pattern_ok, MUT_NONE, &err), KVLM_OK);
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, set_olmo_yarn_own, MUT_NONE, &err), KVLM_OK);
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, set_olmo_pattern_bad, MUT_NONE, &err), KVLM_EUNSUPPORTED);
    printf("  olmo2 with a pattern of no period: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "layer 1 is local, but kvlm (as llama.cpp) takes one global layer in every 1"));
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, set_olmo_pattern_short, MUT_NONE, &err), KVLM_EFORMAT);
    assert_non_null(strstr(err.msg, "an array of 2 bools (one per layer) is expected"));
    assert_int_equal(load_mutated_arch(KVLM_ARCH_OLMO2, set_olmo_yarn_factor, MUT_NONE, &err), KVLM_EUNSUPPORTED);
    printf("  olmo2 with an attention factor of its own: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "olmo2.rope.scaling.attn_factor = 1.5"));
    /* llama.cpp reads granite's rope.scaling.finetuned = false as "no RoPE": refused, not rotated */
    assert_int_equal(load_mutated_arch(KVLM_ARCH_GRANITEMOE, NULL, MUT_NONE, &err), KVLM_OK);
    assert_int_equal(load_mutated_arch(KVLM_ARCH_GRANITEMOE, set_granitemoe_tuned, MUT_NONE, &err), KVLM_OK);
    assert_int_equal(load_mutated_arch(KVLM_ARCH_GRANITEMOE, set_granitemoe_nope, MUT_NONE, &err), KVLM_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "granitemoe.rope.scaling.finetuned = false"));
    assert_int_equal(load_mutated_arch(KVLM_ARCH_GRANITE, set_granite_nope, MUT_NONE, &err), KVLM_EUNSUPPORTED);
    printf("  granite without RoPE: %s\n", err.msg);
}

/* ---- LongRoPE (phi3): the factor tensors and keys checked ---- */

enum { LR_NONE, LR_DROP_SHORT, LR_ZERO_LONG, LR_SHORT_LEN };
/* A synthetic phi3 with LongRoPE (factor 2, original context 32) rewritten
 * with keys overridden by set and its factor tensors altered; returns the
 * load's code, err filled. */
static int load_longrope(void (*set)(gguf_writer *), int mut, kvlm_error *err) {
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_PHI3;
    sp.dim = 32; sp.hidden_dim = 64; sp.n_layers = 1; sp.n_heads = 4; sp.vocab_size = 64; sp.n_ctx = 64;
    sp.type = kvlm_type_from_name("f32");
    sp.longrope = 2;
    gguf_writer *w;
    gguf_file *f = rewrite_begin(&sp, set, &w, err);
    float ff[4] = {1, 1.5f, 2, 0}; /* the writer keeps the pointer until it writes */
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        const void *data = t->data;
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        if (!strcmp(t->cname, "rope_factors_short.weight")) {
            if (mut == LR_DROP_SHORT) continue;
            if (mut == LR_SHORT_LEN) ne[0] = 3;
        }
        if (!strcmp(t->cname, "rope_factors_long.weight") && mut == LR_ZERO_LONG) data = ff;
        assert_int_equal(gguf_writer_add_tensor(w, t->cname, t->type, t->n_dims, ne, data, err), KVLM_OK);
    }
    kvlm_model *m = rewrite_load(w, f, err);
    if (!m) return err->code;
    const kvlm_config *c = kvlm_model_config(m);
    assert_non_null(c->rope_freqs);
    assert_non_null(c->rope_freqs_short);
    assert_int_equal(c->longrope_orig_ctx, 32);
    assert_true(fabs(c->longrope_attn_factor - sqrt(1 + log(2.0) / log(32.0))) < 1e-6);
    kvlm_model_free(m);
    return KVLM_OK;
}
static void set_lr_attn_nan(gguf_writer *w) { gguf_writer_set_f32(w, "phi3.rope.scaling.attn_factor", NAN); }
static void set_lr_orig_zero(gguf_writer *w) { gguf_writer_set_u32(w, "phi3.rope.scaling.original_context_length", 0); }
static void set_lr_linear(gguf_writer *w) {
    gguf_writer_set_str(w, "phi3.rope.scaling.type", "linear");
    gguf_writer_set_f32(w, "phi3.rope.scaling.factor", 2.0f);
}

static void test_longrope_nonsense(void **state) {
    (void)state;
    kvlm_error err = {0};
    assert_int_equal(load_longrope(NULL, LR_NONE, &err), KVLM_OK); /* the unaltered file loads */
    struct { void (*set)(gguf_writer *); int mut, code; const char *needle1, *needle2; } cases[] = {
        {NULL, LR_DROP_SHORT, KVLM_EFORMAT, "needs both rope_factors_long.weight and rope_factors_short.weight",
         "only rope_factors_long.weight"},
        {NULL, LR_ZERO_LONG, KVLM_EFORMAT, "rope_factors_long.weight: factor 3 is 0", "finite and above 0"},
        {NULL, LR_SHORT_LEN, KVLM_EFORMAT, "tensor rope_factors_short.weight: shape 3x1", "expected 4"},
        {set_lr_attn_nan, LR_NONE, KVLM_EFORMAT, "rope.scaling.attn_factor = nan", "finite"},
        {set_lr_orig_zero, LR_NONE, KVLM_EFORMAT, "original_context_length 0", "1 to 2^24"},
        {set_lr_linear, LR_NONE, KVLM_EUNSUPPORTED, "LongRoPE factors beside linear RoPE scaling", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memset(&err, 0, sizeof err);
        int rc = load_longrope(cases[i].set, cases[i].mut, &err);
        printf("  case %zu: %s\n", i, err.msg);
        assert_int_equal(rc, cases[i].code);
        if (!strstr(err.msg, cases[i].needle1) || !strstr(err.msg, cases[i].needle2))
            fail_msg("case %zu: \"%s\" lacks \"%s\" or \"%s\"", i, err.msg, cases[i].needle1, cases[i].needle2);
    }
}

/* Two tensors whose data ranges overlap, each aligned and inside the file. */
static void test_overlap(void **state) {
    (void)state;
    fspec s = base_spec();
    s.t[1].offset = 32; /* a.weight is 64 bytes from 0 */
    bytes b = build(&s);
    kvlm_error err = {0};
    gguf_file *f = open_copy(b.p, b.n, &err);
    assert_null(f);
    assert_int_equal(err.code, KVLM_EFORMAT);
    printf("  %s\n", err.msg);
    assert_non_null(strstr(err.msg, "overlap"));
    assert_non_null(strstr(err.msg, "a.weight"));
    free(b.p);
    s = base_spec();
    s.has_align = true;
    s.align = 0;
    b = build(&s);
    assert_null(open_copy(b.p, b.n, &err));
    assert_non_null(strstr(err.msg, "general.alignment is 0, not a power of two"));
    free(b.p);
    s.align = 24;
    b = build(&s);
    assert_null(open_copy(b.p, b.n, &err));
    assert_non_null(strstr(err.msg, "general.alignment is 24, not a power of two"));
    free(b.p);
}

/* A file claiming a context whose KV pool is far more than this machine has:
 * a context made without n_ctx fails with one clear error; asked for 256
 * tokens, what is allocated follows what is asked. */
static void test_huge_context(void **state) {
    (void)state;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    double phys = (double)pages * (double)page;
    /* dim 256, f16 cache: 1 KiB a token a layer, 4 GiB a layer at 2^22 tokens */
    int layers = (int)(2 * phys / (4.0 * (1 << 30))) + 1;
    if (layers > 256) skip();
    kvlm_synth_params sp = {0};
    sp.dim = 256; sp.hidden_dim = 32; sp.n_layers = layers; sp.n_heads = 4; sp.vocab_size = 32; sp.n_ctx = 1 << 22;
    sp.type = kvlm_type_from_name("q8_0");
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    assert_int_equal(kvlm_model_synth(&sp, path, &err), KVLM_OK);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 0;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    assert_null(ctx);
    printf("  %s\n", err.msg);
    assert_int_equal(err.code, KVLM_ENOMEM);
    assert_non_null(strstr(err.msg, "the model file's context length"));
    assert_non_null(strstr(err.msg, "more than this machine's"));
    cp.n_ctx = 256;
    ctx = kvlm_ctx_create(m, &cp, &err);
    assert_non_null(ctx);
    kvlm_ctx_free(ctx);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handmade_valid), cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_malformed_values), cmocka_unit_test(test_writer_round_trip),
        cmocka_unit_test(test_writer_errors),  cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_fuzz),           cmocka_unit_test(test_real_files),
        cmocka_unit_test(test_model_nonsense), cmocka_unit_test(test_longrope_nonsense),
        cmocka_unit_test(test_overlap),
        cmocka_unit_test(test_huge_context),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
