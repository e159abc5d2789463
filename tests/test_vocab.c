/* tests/test_vocab: vocabularies from GGUF files and llama2.c tokenizer.bin,
 * written back to GGUF, and malformed inputs rejected with a message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "model/gguf.h"
#include "model/vocab.h"

static void load_gguf_vocab(const char *path, model_vocab *v) {
    kvlm_error err = {0};
    gguf_file *f = gguf_open(path, &err);
    if (!f) fail_msg("%s", err.msg);
    int rc = vocab_from_gguf(f, v, &err);
    gguf_close(f);
    if (rc) fail_msg("%s", err.msg);
}

static void assert_vocab_equal(const model_vocab *a, const model_vocab *b) {
    assert_string_equal(a->model, b->model);
    assert_string_equal(a->pre, b->pre);
    assert_int_equal(a->n_tokens, b->n_tokens);
    for (int i = 0; i < a->n_tokens; i++) {
        assert_int_equal(a->lens[i], b->lens[i]);
        assert_memory_equal(a->tokens[i], b->tokens[i], a->lens[i]);
        assert_true(a->scores[i] == b->scores[i]);
        assert_int_equal(a->types[i], b->types[i]);
    }
    assert_int_equal(a->n_merges, b->n_merges);
    for (int i = 0; i < a->n_merges; i++) assert_string_equal(a->merges[i], b->merges[i]);
    assert_int_equal(a->bos, b->bos);
    assert_int_equal(a->eos, b->eos);
    assert_int_equal(a->unk, b->unk);
    assert_int_equal(a->pad, b->pad);
    assert_int_equal(a->eot, b->eot);
    assert_int_equal(a->add_bos, b->add_bos);
    assert_int_equal(a->add_eos, b->add_eos);
    assert_int_equal(a->add_space_prefix, b->add_space_prefix);
    if (a->chat_template || b->chat_template) {
        assert_non_null(a->chat_template);
        assert_non_null(b->chat_template);
        assert_string_equal(a->chat_template, b->chat_template);
    }
}

/* vocab -> GGUF (in memory) -> vocab */
static void round_trip(const model_vocab *v, model_vocab *out) {
    gguf_writer *w = gguf_writer_create();
    vocab_to_gguf(v, w);
    void *mem;
    size_t size;
    kvlm_error err = {0};
    assert_int_equal(gguf_writer_write_mem(w, &mem, &size, &err), KVLM_OK);
    gguf_writer_free(w);
    gguf_file *f = gguf_open_buffer(mem, size, &err);
    if (!f) fail_msg("%s", err.msg);
    int rc = vocab_from_gguf(f, out, &err);
    gguf_close(f);
    free(mem);
    if (rc) fail_msg("%s", err.msg);
}

static void test_llama_spm(void **state) {
    (void)state;
    const char *p = tu_model_path("vocab/ggml-vocab-llama-spm.gguf");
    TU_REQUIRE(p);
    model_vocab v;
    load_gguf_vocab(p, &v);
    assert_string_equal(v.model, "llama");
    assert_string_equal(v.pre, "default");
    assert_int_equal(v.n_tokens, 32000);
    assert_string_equal(v.tokens[0], "<unk>");
    assert_string_equal(v.tokens[1], "<s>");
    assert_string_equal(v.tokens[13], "<0x0A>");
    assert_int_equal(v.types[0], VOCAB_T_UNKNOWN);
    assert_int_equal(v.types[1], VOCAB_T_CONTROL);
    assert_int_equal(v.types[13], VOCAB_T_BYTE);
    assert_int_equal(v.types[500], VOCAB_T_NORMAL);
    assert_int_equal(v.bos, 1);
    assert_int_equal(v.eos, 2);
    assert_int_equal(v.unk, 0);
    assert_int_equal(v.pad, -1);
    assert_true(v.add_bos);
    assert_false(v.add_eos);
    assert_true(v.add_space_prefix); /* default for llama */
    assert_int_equal(v.n_merges, 0);
    assert_null(v.chat_template);
    /* "▁the" is in Llama's vocabulary with a negative score */
    bool found = false;
    for (int i = 0; i < v.n_tokens; i++)
        if (strcmp(v.tokens[i], "\xe2\x96\x81the") == 0) {
            found = true;
            assert_true(v.scores[i] < 0);
        }
    assert_true(found);
    model_vocab back;
    round_trip(&v, &back);
    assert_vocab_equal(&v, &back);
    vocab_free(&back);
    vocab_free(&v);
    assert_int_equal(v.n_tokens, 0);
    assert_null(v.tokens);
    assert_int_equal(v.bos, -1);
    vocab_free(&v); /* twice is harmless */
}

static void test_gpt2(void **state) {
    (void)state;
    const char *p = tu_model_path("vocab/ggml-vocab-gpt-2.gguf");
    TU_REQUIRE(p);
    model_vocab v;
    load_gguf_vocab(p, &v);
    assert_string_equal(v.model, "gpt2");
    assert_string_equal(v.pre, "gpt-2");
    assert_int_equal(v.n_tokens, 50257);
    assert_int_equal(v.n_merges, 50000);
    assert_string_equal(v.merges[0], "\xc4\xa0 t"); /* "Ġ t" */
    assert_int_equal(v.bos, 50256);
    assert_int_equal(v.eos, 50256);
    assert_int_equal(v.unk, -1);
    assert_false(v.add_bos);
    assert_false(v.add_space_prefix);
    assert_string_equal(v.tokens[50256], "<|endoftext|>");
    assert_true(v.scores[100] == 0.0f); /* absent: zeros */
    v.chat_template = strdup("{% for m in messages %}{{ m.content }}{% endfor %}");
    v.eot = 50256;
    model_vocab back;
    round_trip(&v, &back);
    assert_vocab_equal(&v, &back);
    vocab_free(&back);
    vocab_free(&v);
}

static void test_llama2c(void **state) {
    (void)state;
    const char *found = tu_model_path("tok512.bin");
    TU_REQUIRE(found);
    char p[4096]; /* tu_model_path's string is overwritten by the next call */
    snprintf(p, sizeof p, "%s", found);
    kvlm_error err = {0};
    model_vocab v;
    if (vocab_from_llama2c(p, 512, &v, &err)) fail_msg("%s", err.msg);
    assert_string_equal(v.model, "llama");
    assert_int_equal(v.n_tokens, 512);
    assert_string_equal(v.tokens[0], "<unk>");
    assert_string_equal(v.tokens[1], "<s>");
    assert_string_equal(v.tokens[2], "</s>");
    assert_string_equal(v.tokens[3 + 10], "<0x0A>");
    assert_int_equal(v.types[0], VOCAB_T_UNKNOWN);
    assert_int_equal(v.types[1], VOCAB_T_CONTROL);
    assert_int_equal(v.types[2], VOCAB_T_CONTROL);
    assert_int_equal(v.types[13], VOCAB_T_BYTE);
    assert_int_equal(v.bos, 1);
    assert_int_equal(v.eos, 2);
    assert_int_equal(v.unk, 0);
    assert_true(v.add_bos);
    assert_true(v.add_space_prefix);
    int spaces = 0, marks = 0;
    for (int i = 0; i < v.n_tokens; i++) {
        if (strchr(v.tokens[i], ' ')) spaces++;
        if (strstr(v.tokens[i], "\xe2\x96\x81")) marks++;
        assert_int_equal(strlen(v.tokens[i]), v.lens[i]);
    }
    assert_int_equal(spaces, 0);
    assert_true(marks > 50);
    /* the same vocabulary as llama.cpp's conversion of the same model */
    const char *g = tu_model_path("stories260K.gguf");
    if (g) {
        model_vocab gv;
        load_gguf_vocab(g, &gv);
        assert_int_equal(gv.n_tokens, 512);
        for (int i = 0; i < 512; i++) {
            if (strcmp(v.tokens[i], gv.tokens[i]) != 0) fail_msg("token %d: \"%s\" vs \"%s\"", i, v.tokens[i], gv.tokens[i]);
            assert_true(v.scores[i] == gv.scores[i]);
            assert_int_equal(v.types[i], gv.types[i]);
        }
        assert_int_equal(gv.bos, 1);
        assert_int_equal(gv.pad, -1); /* stored as u32 0xffffffff */
        vocab_free(&gv);
    }
    /* a smaller n_vocab reads a prefix; a larger one runs out of file */
    model_vocab small;
    assert_int_equal(vocab_from_llama2c(p, 100, &small, &err), KVLM_OK);
    assert_int_equal(small.n_tokens, 100);
    vocab_free(&small);
    assert_int_not_equal(vocab_from_llama2c(p, 513, &small, &err), KVLM_OK);
    assert_non_null(strstr(err.msg, "truncated at token 512"));
    model_vocab back;
    round_trip(&v, &back);
    assert_vocab_equal(&v, &back);
    vocab_free(&back);
    vocab_free(&v);
}

/* ---- malformed llama2.c tokenizers ---- */

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
static void put_i32(bytes *b, int32_t v) { put(b, &v, 4); }
static void put_tok(bytes *b, float score, const char *s) {
    put(b, &score, 4);
    put_i32(b, (int32_t)strlen(s));
    put(b, s, strlen(s));
}

static void test_llama2c_malformed(void **state) {
    (void)state;
    bytes b = {0};
    put_i32(&b, 6);
    put_tok(&b, 0, "<unk>");
    put_tok(&b, 0, "\n<s>\n");
    put_tok(&b, 0, "\n</s>\n");
    put_tok(&b, 0, "<0x41>");
    put_tok(&b, -1.5f, " a b");
    const char *path = tu_tmp_path(".bin");
    kvlm_error err = {0};
    model_vocab v;
    /* every proper prefix is rejected; the whole file reads */
    for (size_t n = 0; n <= b.n; n++) {
        assert_int_equal(tu_write_file(path, b.p, n), 0);
        int rc = vocab_from_llama2c(path, 5, &v, &err);
        if (n < b.n) {
            if (rc == KVLM_OK) fail_msg("prefix of %zu bytes accepted", n);
            assert_non_null(strstr(err.msg, path));
            assert_int_equal(v.n_tokens, 0);
        } else {
            if (rc) fail_msg("%s", err.msg);
        }
    }
    assert_string_equal(v.tokens[4], "\xe2\x96\x81" "a" "\xe2\x96\x81" "b");
    assert_int_equal(v.lens[4], 8);
    assert_true(v.scores[4] == -1.5f);
    assert_int_equal(v.types[3], VOCAB_T_BYTE);
    assert_int_equal(v.types[4], VOCAB_T_NORMAL);
    vocab_free(&v);
    /* negative, huge and over-long lengths */
    const int32_t bad_lens[] = {-1, INT32_MIN, 7, 1 << 30};
    for (size_t i = 0; i < sizeof bad_lens / sizeof bad_lens[0]; i++) {
        bytes c = {0};
        put_i32(&c, 6);
        put_tok(&c, 0, "<unk>");
        float sc = 0;
        put(&c, &sc, 4);
        put_i32(&c, bad_lens[i]);
        put(&c, "abcdefgh", 8);
        assert_int_equal(tu_write_file(path, c.p, c.n), 0);
        assert_int_not_equal(vocab_from_llama2c(path, 2, &v, &err), KVLM_OK);
        assert_non_null(strstr(err.msg, "token 1 has length"));
        free(c.p);
    }
    /* implausible header */
    int32_t zero = 0;
    assert_int_equal(tu_write_file(path, &zero, 4), 0);
    assert_int_not_equal(vocab_from_llama2c(path, 2, &v, &err), KVLM_OK);
    assert_non_null(strstr(err.msg, "max token length"));
    /* bad arguments, missing file */
    assert_int_equal(vocab_from_llama2c(path, 0, &v, &err), KVLM_EINVAL);
    assert_int_equal(vocab_from_llama2c(path, -5, &v, &err), KVLM_EINVAL);
    assert_int_equal(vocab_from_llama2c("/nonexistent/tokenizer.bin", 5, &v, &err), KVLM_EIO);
    free(b.p);
}

/* A llama2.c header whose vocabulary size is INT32_MIN (found by
 * fuzz/fuzz_llama2c: negating it was undefined; a KVLM_SANITIZE build
 * catches a regression): one clear error. */
static void test_llama2c_header_int32_min(void **state) {
    (void)state;
    int32_t h[16] = {8, 16, 1, 2, 2, INT32_MIN, 4};
    const char *path = tu_tmp_path(".bin");
    assert_int_equal(tu_write_file(path, h, sizeof h), 0);
    kvlm_error err = {0};
    assert_null(kvlm_model_load(path, NULL, &err));
    assert_int_equal(err.code, KVLM_EFORMAT);
    assert_non_null(strstr(err.msg, "not a valid llama2.c checkpoint"));
}

/* ---- malformed GGUF tokenizers ---- */

static int vocab_from_writer(gguf_writer *w, model_vocab *v, kvlm_error *err) {
    void *mem;
    size_t size;
    assert_int_equal(gguf_writer_write_mem(w, &mem, &size, err), KVLM_OK);
    gguf_writer_free(w);
    gguf_file *f = gguf_open_buffer(mem, size, err);
    assert_non_null(f);
    int rc = vocab_from_gguf(f, v, err);
    gguf_close(f);
    free(mem);
    return rc;
}

static const char *k_toks[] = {"<unk>", "<s>", "</s>", "a", "b"};

static gguf_writer *base_writer(void) {
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", k_toks, 5);
    return w;
}

static void expect_vocab_error(gguf_writer *w, const char *needle) {
    model_vocab v;
    kvlm_error err = {0};
    int rc = vocab_from_writer(w, &v, &err);
    if (rc == KVLM_OK) {
        vocab_free(&v);
        fail_msg("accepted (expected \"%s\")", needle);
    }
    if (!strstr(err.msg, needle)) fail_msg("message \"%s\" lacks \"%s\"", err.msg, needle);
    assert_int_equal(v.n_tokens, 0);
    assert_null(v.tokens);
}

static void test_gguf_vocab_defaults_and_errors(void **state) {
    (void)state;
    model_vocab v;
    kvlm_error err = {0};
    /* minimal llama vocabulary: defaults fill in */
    assert_int_equal(vocab_from_writer(base_writer(), &v, &err), KVLM_OK);
    assert_int_equal(v.bos, 1);
    assert_int_equal(v.eos, 2);
    assert_int_equal(v.unk, 0);
    assert_true(v.add_bos);
    assert_true(v.add_space_prefix);
    assert_int_equal(v.types[3], VOCAB_T_NORMAL);
    assert_true(v.scores[3] == 0.0f);
    assert_string_equal(v.pre, "");
    vocab_free(&v);
    /* explicit "none" ids and flags */
    gguf_writer *w = base_writer();
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", UINT32_MAX);
    gguf_writer_set_i32(w, "tokenizer.ggml.eos_token_id", -1);
    gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false);
    gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", false);
    assert_int_equal(vocab_from_writer(w, &v, &err), KVLM_OK);
    assert_int_equal(v.bos, -1);
    assert_int_equal(v.eos, -1);
    assert_false(v.add_bos);
    assert_false(v.add_space_prefix);
    model_vocab back;
    round_trip(&v, &back);
    assert_vocab_equal(&v, &back); /* "none" survives, not replaced by the defaults */
    vocab_free(&back);
    vocab_free(&v);

    /* missing pieces */
    w = gguf_writer_create();
    gguf_writer_set_str(w, "general.architecture", "llama");
    expect_vocab_error(w, "no tokenizer in file");
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    expect_vocab_error(w, "no tokenizer in file");
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", k_toks, 0);
    expect_vocab_error(w, "empty");
    /* wrong types */
    w = gguf_writer_create();
    gguf_writer_set_u32(w, "tokenizer.ggml.model", 1);
    expect_vocab_error(w, "tokenizer.ggml.model has type u32");
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.tokens", (const float[]){1, 2}, 2);
    expect_vocab_error(w, "tokenizer.ggml.tokens has type array of f32");
    w = base_writer();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "a-tokenizer-name-that-is-much-too-long");
    expect_vocab_error(w, "tokenizer.ggml.model is");
    /* counts that do not match the tokens */
    w = base_writer();
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", (const float[]){1, 2, 3}, 3);
    expect_vocab_error(w, "tokenizer.ggml.scores has 3 entries but there are 5 tokens");
    w = base_writer();
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", (const int32_t[]){1, 1, 1, 1, 1, 1}, 6);
    expect_vocab_error(w, "tokenizer.ggml.token_type has 6 entries");
    w = base_writer();
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.token_type", (const float[]){1, 1, 1, 1, 1}, 5);
    expect_vocab_error(w, "expected an array of integers");
    w = base_writer();
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", (const int32_t[]){1, 1, 9, 1, 1}, 5);
    expect_vocab_error(w, "tokenizer.ggml.token_type[2] is 9");
    /* ids out of range */
    w = base_writer();
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 5);
    expect_vocab_error(w, "tokenizer.ggml.bos_token_id is 5, outside the vocabulary of 5 tokens");
    w = base_writer();
    gguf_writer_set_i32(w, "tokenizer.ggml.eot_token_id", -7);
    expect_vocab_error(w, "tokenizer.ggml.eot_token_id is -7");
    w = base_writer();
    gguf_writer_set_str(w, "tokenizer.ggml.unknown_token_id", "0");
    expect_vocab_error(w, "expected an integer");
    w = base_writer();
    gguf_writer_set_u32(w, "tokenizer.ggml.add_bos_token", 1);
    expect_vocab_error(w, "tokenizer.ggml.add_bos_token has type u32, expected bool");
    /* merges */
    const char *bad_merges[] = {"a b", "ab"};
    w = base_writer();
    gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", bad_merges, 2);
    expect_vocab_error(w, "tokenizer.ggml.merges[1] = \"ab\"");
    const char *bad_merges2[] = {" ab"};
    w = base_writer();
    gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", bad_merges2, 1);
    expect_vocab_error(w, "not of the form");
    w = base_writer();
    gguf_writer_set_u32(w, "tokenizer.chat_template", 3);
    expect_vocab_error(w, "tokenizer.chat_template has type u32");
    /* a gpt2 vocabulary has no BOS/UNK defaults */
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", k_toks, 5);
    gguf_writer_set_str(w, "tokenizer.chat_template", "{{ x }}");
    assert_int_equal(vocab_from_writer(w, &v, &err), KVLM_OK);
    assert_int_equal(v.bos, -1);
    assert_int_equal(v.unk, -1);
    assert_false(v.add_bos);
    assert_string_equal(v.chat_template, "{{ x }}");
    vocab_free(&v);
}

/* Mutated tokenizers: rejected or read, never a crash (ASan). */
static void test_fuzz(void **state) {
    (void)state;
    gguf_writer *w = base_writer();
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", (const float[]){0, 0, 0, -1, -2}, 5);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", (const int32_t[]){2, 3, 3, 1, 1}, 5);
    const char *merges[] = {"a b", "ab b"};
    gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 2);
    gguf_writer_set_u32(w, "tokenizer.ggml.eot_token_id", 4);
    gguf_writer_set_str(w, "tokenizer.chat_template", "{{ x }}");
    void *mem;
    size_t size;
    kvlm_error err = {0};
    assert_int_equal(gguf_writer_write_mem(w, &mem, &size, &err), KVLM_OK);
    gguf_writer_free(w);
    uint8_t *work = malloc(size);
    uint64_t s = 77;
    int iters = tu_quick() ? 500 : 3000, ok = 0;
    for (int it = 0; it < iters; it++) {
        memcpy(work, mem, size);
        for (int k = 0; k < 2; k++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            work[(s >> 33) % size] ^= (uint8_t)(1u << ((s >> 20) & 7));
        }
        gguf_file *f = gguf_open_buffer(work, size, &err);
        if (!f) continue;
        model_vocab v;
        if (vocab_from_gguf(f, &v, &err) == KVLM_OK) {
            ok++;
            for (int i = 0; i < v.n_tokens; i++) assert_int_equal(v.tokens[i][v.lens[i]], 0);
            assert_true(v.bos < v.n_tokens && v.eos < v.n_tokens && v.unk < v.n_tokens && v.eot < v.n_tokens);
            vocab_free(&v);
        } else {
            assert_null(v.tokens);
        }
        gguf_close(f);
    }
    print_message("  gguf: %d of %d mutated vocabularies still valid\n", ok, iters);
    free(work);
    free(mem);

    /* llama2.c tokenizer files */
    bytes b = {0};
    put_i32(&b, 6);
    put_tok(&b, 0, "<unk>");
    put_tok(&b, 0, "\n<s>\n");
    put_tok(&b, 0, "\n</s>\n");
    put_tok(&b, 0, "<0x41>");
    put_tok(&b, -1.5f, " a b");
    const char *path = tu_tmp_path(".bin");
    iters = tu_quick() ? 200 : 1000;
    ok = 0;
    for (int it = 0; it < iters; it++) {
        bytes c = {0};
        put(&c, b.p, b.n);
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        c.p[(s >> 33) % c.n] ^= (uint8_t)(1u << ((s >> 20) & 7));
        assert_int_equal(tu_write_file(path, c.p, c.n), 0);
        model_vocab v;
        if (vocab_from_llama2c(path, 5, &v, &err) == KVLM_OK) {
            ok++;
            vocab_free(&v);
        }
        free(c.p);
    }
    print_message("  llama2.c: %d of %d mutated tokenizers still valid\n", ok, iters);
    free(b.p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_spm),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_llama2c),
        cmocka_unit_test(test_llama2c_malformed),
        cmocka_unit_test(test_llama2c_header_int32_min),
        cmocka_unit_test(test_gguf_vocab_defaults_and_errors),
        cmocka_unit_test(test_fuzz),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
