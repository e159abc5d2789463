/* tests/test_tok: the tokenizers against llama.cpp's reference tokenizations
 * (ggml-vocab-*.gguf.inp/.out), round trips, special tokens, pre-tokenizer
 * splits, llama2.c's tok512 vocabulary, hand-built vocabularies and bad input. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "model/gguf.h"
#include "model/vocab.h"
#include "tok/pretok.h"
#include "tok/tok_internal.h"
#include "tok/tok.h"

/* ---- helpers ----------------------------------------------------------------------- */

typedef struct {
    model_vocab v;
    tok_tokenizer *t;
} loaded;

/* Loads a vocabulary-only GGUF from the models folder; false (after a SKIP
 * line) if the file is absent. */
static bool load_gguf_vocab(const char *name, loaded *l) {
    const char *path = tu_model_path(name);
    if (!path) return false;
    kvlm_error err = {0};
    gguf_file *f = gguf_open(path, &err);
    if (!f) fail_msg("%s: %s", path, err.msg);
    if (vocab_from_gguf(f, &l->v, &err)) fail_msg("%s: %s", path, err.msg);
    gguf_close(f);
    l->t = tok_create(&l->v, &err);
    if (!l->t) fail_msg("%s: %s", path, err.msg);
    return true;
}

static void unload(loaded *l) {
    tok_free(l->t);
    vocab_free(&l->v);
}

/* Encodes into a fresh array (count in *n). */
static int32_t *encode(const tok_tokenizer *t, const char *s, size_t len, bool bos, bool special, int *n) {
    kvlm_error err = {0};
    int cnt = tok_encode(t, s, len, bos, special, NULL, 0, &err);
    if (cnt < 0) fail_msg("tok_encode: %s", err.msg);
    int32_t *ids = malloc(((size_t)cnt + 1) * sizeof *ids);
    assert_non_null(ids);
    int again = tok_encode(t, s, len, bos, special, ids, cnt, &err);
    assert_int_equal(again, cnt);
    *n = cnt;
    return ids;
}

/* Concatenated token bytes (not NUL-terminated; length in *len). */
static char *decode(const tok_tokenizer *t, const int32_t *ids, int n, bool show_special, size_t *len) {
    size_t cap = 64, o = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (int i = 0; i < n; i++) {
        char piece[256];
        int k = tok_token_to_bytes(t, ids[i], show_special, piece, sizeof piece);
        assert_true(k >= 0);
        if (o + (size_t)k > cap) {
            while (o + (size_t)k > cap) cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        memcpy(buf + o, piece, (size_t)k);
        o += (size_t)k;
    }
    *len = o;
    return buf;
}

/* The round-trip rule: byte-level BPE gives the text back exactly. A
 * SentencePiece vocabulary with add_space_prefix turns text x into " " + x
 * (for non-empty x, no special tokens), so decoding drops that one leading
 * space; with it, decode(encode(x)) == x for any bytes x that do not contain
 * U+2581 (which SentencePiece reads as a space). */
static void check_round_trip(const tok_tokenizer *t, const model_vocab *v, const char *s, size_t len) {
    int n;
    int32_t *ids = encode(t, s, len, false, false, &n);
    size_t dl;
    char *d = decode(t, ids, n, false, &dl);
    const char *p = d;
    if (tok_is_spm(t) && v->add_space_prefix && len > 0) {
        assert_true(dl > 0 && d[0] == ' ');
        p++;
        dl--;
    }
    if (dl != len || memcmp(p, s, len) != 0)
        fail_msg("round trip of %zu bytes gave %zu bytes: \"%.*s\" -> \"%.*s\"", len, dl, (int)(len < 200 ? len : 200),
                 s, (int)(dl < 200 ? dl : 200), p);
    free(d);
    free(ids);
}

/* Splits llama.cpp's .inp file: every string is followed by the line
 * "__ggml_vocab_test__", i.e. strings are separated (and ended) by
 * "\n__ggml_vocab_test__\n". Returns the count; strs point into buf. */
static int split_inp(char *buf, size_t len, char **strs, size_t *lens, int max) {
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t sl = sizeof sep - 1, pos = 0;
    int n = 0;
    while (pos < len && n < max) {
        char *hit = memmem(buf + pos, len - pos, sep, sl);
        if (!hit) break;
        strs[n] = buf + pos;
        lens[n] = (size_t)(hit - (buf + pos));
        n++;
        pos = (size_t)(hit - buf) + sl;
    }
    return n;
}

static void check_reference(const char *vocab_name) {
    loaded l;
    if (!load_gguf_vocab(vocab_name, &l)) skip();
    char inp_name[256], out_name[256];
    snprintf(inp_name, sizeof inp_name, "%s.inp", vocab_name);
    snprintf(out_name, sizeof out_name, "%s.out", vocab_name);
    char inp_path[4096], out_path[4096];
    const char *p = tu_model_path(inp_name);
    if (!p) { unload(&l); skip(); }
    snprintf(inp_path, sizeof inp_path, "%s", p);
    p = tu_model_path(out_name);
    if (!p) { unload(&l); skip(); }
    snprintf(out_path, sizeof out_path, "%s", p);

    size_t inp_len, out_len;
    char *inp = tu_read_file(inp_path, &inp_len);
    char *out = tu_read_file(out_path, &out_len);
    assert_non_null(inp);
    assert_non_null(out);
    char *strs[256];
    size_t lens[256];
    int n = split_inp(inp, inp_len, strs, lens, 256);
    assert_true(n > 40);

    char *line = out;
    int failures = 0;
    for (int i = 0; i < n; i++) {
        assert_true(line < out + out_len);
        char *nl = strchr(line, '\n');
        assert_non_null(nl);
        *nl = 0;
        int32_t want[512];
        int nw = 0;
        for (char *q = line; *q;) {
            char *end;
            long id = strtol(q, &end, 10);
            if (end == q) { q++; continue; }
            assert_true(nw < 512);
            want[nw++] = (int32_t)id;
            q = end;
        }
        int ng;
        int32_t *got = encode(l.t, strs[i], lens[i], false, false, &ng);
        if (ng != nw || memcmp(got, want, (size_t)nw * sizeof *want) != 0) {
            failures++;
            fprintf(stderr, "%s: string %d \"%.*s\"\n  want:%s\n  got: ", vocab_name, i, (int)lens[i], strs[i], line);
            for (int k = 0; k < ng; k++) fprintf(stderr, " %d", got[k]);
            fprintf(stderr, "\n");
        }
        free(got);
        check_round_trip(l.t, &l.v, strs[i], lens[i]);
        line = nl + 1;
    }
    assert_true(line == out + out_len); /* one .out line per .inp string */
    assert_int_equal(failures, 0);
    free(inp);
    free(out);
    unload(&l);
}

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

/* ---- real vocabularies ---------------------------------------------------------------- */

static void test_spm_reference(void **state) {
    (void)state;
    check_reference("vocab/ggml-vocab-llama-spm.gguf");
}

static void test_gpt2_reference(void **state) {
    (void)state;
    check_reference("vocab/ggml-vocab-gpt-2.gguf");
}

/* Random bytes (NULs, invalid UTF-8, stray continuation bytes) round-trip. */
static void random_round_trips(const char *vocab_name) {
    loaded l;
    if (!load_gguf_vocab(vocab_name, &l)) skip();
    uint64_t seed = 12345;
    int iters = tu_quick() ? 100 : 400;
    char buf[300];
    for (int it = 0; it < iters; it++) {
        size_t len = rng_next(&seed) % sizeof buf;
        for (size_t i = 0; i < len; i++) {
            uint64_t r = rng_next(&seed);
            /* Mix ASCII words and spaces with arbitrary bytes and multi-byte
             * sequences, so both merges and byte fallback get exercised. */
            switch (r % 4) {
            case 0: buf[i] = " \n\t"[r / 4 % 3]; break;
            case 1: buf[i] = (char)('a' + r / 4 % 26); break;
            case 2: buf[i] = (char)(0xC0 + r / 4 % 0x40); break;
            default: buf[i] = (char)(r / 4 % 256); break;
            }
        }
        /* U+2581 in the input reads as a space in SentencePiece: avoid it. */
        for (size_t i = 0; i + 2 < len; i++)
            if ((uint8_t)buf[i] == 0xE2 && (uint8_t)buf[i + 1] == 0x96 && (uint8_t)buf[i + 2] == 0x81) buf[i] = 'x';
        check_round_trip(l.t, &l.v, buf, len);
    }
    unload(&l);
}

static void test_spm_random_round_trip(void **state) {
    (void)state;
    random_round_trips("vocab/ggml-vocab-llama-spm.gguf");
}

static void test_gpt2_random_round_trip(void **state) {
    (void)state;
    random_round_trips("vocab/ggml-vocab-gpt-2.gguf");
}

static void expect_ids(const tok_tokenizer *t, const char *s, bool bos, bool special, const int32_t *want, int nw) {
    int n;
    int32_t *got = encode(t, s, strlen(s), bos, special, &n);
    if (n != nw || (nw > 0 && memcmp(got, want, (size_t)nw * sizeof *want) != 0)) {
        fprintf(stderr, "\"%s\" (bos %d, special %d): want", s, bos, special);
        for (int i = 0; i < nw; i++) fprintf(stderr, " %d", want[i]);
        fprintf(stderr, ", got");
        for (int i = 0; i < n; i++) fprintf(stderr, " %d", got[i]);
        fprintf(stderr, "\n");
        fail();
    }
    free(got);
}

static void test_spm_special(void **state) {
    (void)state;
    loaded l;
    if (!load_gguf_vocab("vocab/ggml-vocab-llama-spm.gguf", &l)) skip();
    const tok_tokenizer *t = l.t;
    /* From the reference: "Hello world" -> 15043 3186 ("▁Hello", "▁world"). */
    expect_ids(t, "Hello world", false, false, (int32_t[]){15043, 3186}, 2);
    expect_ids(t, "Hello world", true, false, (int32_t[]){1, 15043, 3186}, 3);
    expect_ids(t, "", true, false, (int32_t[]){1}, 1);
    expect_ids(t, "", false, false, NULL, 0);
    /* Special tokens cut out; the text after each gets the space prefix
     * again, as llama.cpp does ("<s>Hello" -> <s> ▁Hello). */
    expect_ids(t, "<s>Hello</s>", false, true, (int32_t[]){1, 15043, 2}, 3);
    expect_ids(t, "Hello</s>world", false, true, (int32_t[]){15043, 2, 3186}, 3);
    expect_ids(t, "</s></s>", false, true, (int32_t[]){2, 2}, 2);
    /* Off: the same text is ordinary characters. */
    int n;
    int32_t *ids = encode(t, "<s>Hello</s>", 12, false, false, &n);
    assert_true(n > 3);
    for (int i = 0; i < n; i++) assert_true(ids[i] != 1 && ids[i] != 2);
    free(ids);
    check_round_trip(t, &l.v, "<s>Hello</s>", 12);
    /* Decoding: control tokens are hidden unless asked for. */
    char buf[16];
    assert_int_equal(tok_token_to_bytes(t, 1, false, buf, sizeof buf), 0);
    assert_int_equal(tok_token_to_bytes(t, 1, true, buf, sizeof buf), 3);
    assert_memory_equal(buf, "<s>", 3);
    assert_int_equal(tok_token_to_bytes(t, 15043, false, buf, sizeof buf), 6);
    assert_memory_equal(buf, " Hello", 6);
    assert_int_equal(tok_token_to_bytes(t, 15043, false, buf, 3), 3); /* truncated */
    assert_int_equal(tok_token_to_bytes(t, 13, false, buf, sizeof buf), 1); /* <0x0A> */
    assert_int_equal(buf[0], '\n');
    assert_int_equal(tok_token_to_bytes(t, -1, false, buf, sizeof buf), -1);
    assert_int_equal(tok_token_to_bytes(t, 32000, false, buf, sizeof buf), -1);
    assert_int_equal(tok_token_to_bytes(t, INT32_MAX, false, buf, sizeof buf), -1);
    assert_true(tok_is_eog(t, 2));
    assert_false(tok_is_eog(t, 1));
    assert_false(tok_is_eog(t, -5));
    assert_false(tok_is_eog(t, 1 << 30));
    assert_true(tok_is_spm(t));
    assert_int_equal(tok_n_vocab(t), 32000);
    unload(&l);
}

static void test_gpt2_special(void **state) {
    (void)state;
    loaded l;
    if (!load_gguf_vocab("vocab/ggml-vocab-gpt-2.gguf", &l)) skip();
    const tok_tokenizer *t = l.t;
    /* "Hello world" -> 15496 995 (reference). */
    expect_ids(t, "Hello world<|endoftext|>", false, true, (int32_t[]){15496, 995, 50256}, 3);
    expect_ids(t, "<|endoftext|>Hello world", true, true, (int32_t[]){50256, 50256, 15496, 995}, 4);
    int n;
    int32_t *ids = encode(t, "<|endoftext|>", 13, false, false, &n);
    assert_true(n > 1);
    for (int i = 0; i < n; i++) assert_int_not_equal(ids[i], 50256);
    free(ids);
    char buf[32];
    assert_int_equal(tok_token_to_bytes(t, 50256, false, buf, sizeof buf), 0);
    assert_int_equal(tok_token_to_bytes(t, 50256, true, buf, sizeof buf), 13);
    assert_int_equal(tok_token_to_bytes(t, 995, false, buf, sizeof buf), 6);
    assert_memory_equal(buf, " world", 6);
    assert_int_equal(tok_token_to_bytes(t, 50257, false, buf, sizeof buf), -1);
    assert_true(tok_is_eog(t, 50256));
    assert_false(tok_is_eog(t, 995));
    assert_false(tok_is_spm(t));
    tok_span sp[4];
    kvlm_error e2 = {0};
    assert_int_equal(tok_pretokenize(t, "Hello world!!", 13, sp, 4, &e2), 3);
    assert_true(sp[0].off == 0 && sp[0].len == 5 && sp[1].off == 5 && sp[1].len == 6 && sp[2].off == 11 && sp[2].len == 2);
    /* Truncated output still reports the full count. */
    int32_t two[2] = {-7, -7};
    kvlm_error err = {0};
    assert_int_equal(tok_encode(t, "Hello world, Hello world", 24, false, false, two, 2, &err), 5);
    assert_int_equal(two[0], 15496);
    assert_int_equal(two[1], 995);
    unload(&l);
}

/* A 100 KB stretch of WikiText tokenizes (once per vocabulary) and comes back
 * exactly. Timing lives in bench/, not here; this only has to stay quick. */
static void test_corpus_round_trip(void **state) {
    (void)state;
    const char *cp = tu_corpus_path("wiki.test.raw");
    if (!cp) skip();
    size_t len;
    char *text = tu_read_file(cp, &len);
    assert_non_null(text);
    size_t n = len < 100000 ? len : 100000;
    while (n < len && ((uint8_t)text[n] & 0xC0) == 0x80) n++; /* whole characters */
    const char *names[] = {"vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-gpt-2.gguf"};
    for (int k = 0; k < 2; k++) {
        loaded l;
        if (!load_gguf_vocab(names[k], &l)) continue;
        int cnt;
        int32_t *ids = encode(l.t, text, n, false, false, &cnt);
        assert_true(cnt > (int)(n / 8) && cnt < (int)n);
        if (tok_is_spm(l.t)) {
            /* Merging word by word (the fast path) must equal merging the
             * whole text as one sequence, as llama.cpp does. */
            assert_true(l.t->spm_split);
            l.t->spm_split = false;
            int cnt2;
            int32_t *ids2 = encode(l.t, text, n, false, false, &cnt2);
            l.t->spm_split = true;
            assert_int_equal(cnt2, cnt);
            assert_memory_equal(ids2, ids, (size_t)cnt * sizeof *ids);
            free(ids2);
        }
        free(ids);
        check_round_trip(l.t, &l.v, text, n);
        unload(&l);
    }
    free(text);
}

/* Inputs that tend to break tokenizers: long runs of one character (no
 * quadratic blow-up), NULs, invalid UTF-8, lone surrogates, truncated sequences. */
static void test_hostile_input(void **state) {
    (void)state;
    const char *names[] = {"vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-gpt-2.gguf"};
    size_t big = tu_quick() ? 20000 : 200000;
    char *buf = malloc(big);
    assert_non_null(buf);
    for (int k = 0; k < 2; k++) {
        loaded l;
        if (!load_gguf_vocab(names[k], &l)) continue;
        const char runs[] = {'a', ' ', '\n', '1', '!', (char)0xFF, 0};
        for (size_t r = 0; r < sizeof runs; r++) {
            memset(buf, runs[r], big);
            check_round_trip(l.t, &l.v, buf, big);
        }
        for (size_t i = 0; i < big; i += 3) memcpy(buf + i, "\xE4\xB8\xAD", big - i < 3 ? big - i : 3);
        check_round_trip(l.t, &l.v, buf, big);
        /* Near-misses of special tokens everywhere: each position starts a
         * lookup that fails late. */
        const char *near = k == 0 ? "</s" : "<|endoftext|";
        for (size_t i = 0; i < big; i++) buf[i] = near[i % strlen(near)];
        int n;
        int32_t *ids = encode(l.t, buf, big, false, true, &n);
        for (int i = 0; i < n; i++) assert_true(ids[i] != l.v.eos);
        free(ids);
        static const char *odd[] = {"\xED\xA0\x80", "\xC0\xAF", "\xF4\x90\x80\x80", "\xE4\xB8", "\x80\x80",
                                    "a\0b", "\xF0\x9F\x98", "  \xFF  x"};
        static const size_t odd_len[] = {3, 2, 4, 2, 2, 3, 3, 6};
        for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) check_round_trip(l.t, &l.v, odd[i], odd_len[i]);
        kvlm_error err = {0};
        assert_int_equal(tok_encode(l.t, NULL, 0, false, true, NULL, 0, &err), 0);
        assert_int_equal(tok_encode(l.t, NULL, 5, false, true, NULL, 0, &err), -1);
        unload(&l);
    }
    free(buf);
}

static void test_tok512(void **state) {
    (void)state;
    const char *p = tu_model_path("tok512.bin");
    if (!p) skip();
    model_vocab v;
    kvlm_error err = {0};
    if (vocab_from_llama2c(p, 512, &v, &err)) fail_msg("%s", err.msg);
    tok_tokenizer *t = tok_create(&v, &err);
    if (!t) fail_msg("%s", err.msg);
    const char *s = "Once upon a time";
    int n;
    int32_t *ids = encode(t, s, strlen(s), true, false, &n);
    assert_true(n >= 4 && n <= 12);
    assert_int_equal(ids[0], 1);
    for (int i = 1; i < n; i++) assert_true(ids[i] > 2 && ids[i] < 512);
    size_t dl;
    char *d = decode(t, ids, n, false, &dl);
    assert_int_equal(dl, strlen(s) + 1);
    assert_memory_equal(d, " Once upon a time", dl);
    free(d);
    free(ids);
    check_round_trip(t, &v, "Lily and Ben went to the park. \"Wow!\" she said.\n\nThe end.", 56);
    check_round_trip(t, &v, "\xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80", 12); /* byte fallback */
    tok_free(t);
    vocab_free(&v);
}

/* ---- hand-built vocabularies ---------------------------------------------------------- */

typedef struct {
    const char *text;
    float score;
    int32_t type;
} mini_tok;

static void mini_vocab(model_vocab *v, const char *model, const char *pre, const mini_tok *toks, int n,
                       const char *const *merges, int n_merges) {
    memset(v, 0, sizeof *v);
    snprintf(v->model, sizeof v->model, "%s", model);
    snprintf(v->pre, sizeof v->pre, "%s", pre);
    v->n_tokens = n;
    v->tokens = calloc((size_t)n, sizeof *v->tokens);
    v->lens = calloc((size_t)n, sizeof *v->lens);
    v->scores = calloc((size_t)n, sizeof *v->scores);
    v->types = calloc((size_t)n, sizeof *v->types);
    for (int i = 0; i < n; i++) {
        v->tokens[i] = strdup(toks[i].text);
        v->lens[i] = (uint32_t)strlen(toks[i].text);
        v->scores[i] = toks[i].score;
        v->types[i] = toks[i].type ? toks[i].type : VOCAB_T_NORMAL;
    }
    v->n_merges = n_merges;
    v->merges = n_merges ? calloc((size_t)n_merges, sizeof *v->merges) : NULL;
    for (int i = 0; i < n_merges; i++) v->merges[i] = strdup(merges[i]);
    v->bos = v->eos = v->unk = v->pad = v->eot = -1;
    v->add_space_prefix = true;
}

#define SP "\xE2\x96\x81"

static void test_spm_mini(void **state) {
    (void)state;
    /* Scores decide the merge order: "bc" (-1) beats "ab" (-2), so "abc"
     * becomes a + bc, never ab + c, though "ab" is to the left. */
    const mini_tok toks[] = {
        {"<unk>", 0, VOCAB_T_UNKNOWN}, {"<s>", 0, VOCAB_T_CONTROL}, {"</s>", 0, VOCAB_T_CONTROL},
        {"a", -5, 0}, {"b", -5, 0}, {"c", -5, 0}, {"ab", -2, 0}, {"bc", -1, 0}, {SP, -3, 0},
        {SP "a", -4, 0}, {"<0x41>", 0, VOCAB_T_BYTE}, {"<|user|>", 0, VOCAB_T_USER_DEFINED},
        {"<|u", 0, VOCAB_T_CONTROL}, {"aa", -3, 0}, {"<|us", 0, VOCAB_T_CONTROL},
    };
    model_vocab v;
    mini_vocab(&v, "llama", "", toks, (int)(sizeof toks / sizeof toks[0]), NULL, 0);
    v.unk = 0;
    v.bos = 1;
    v.eos = 2;
    kvlm_error err = {0};
    tok_tokenizer *t = tok_create(&v, &err);
    if (!t) fail_msg("%s", err.msg);
    v.add_space_prefix = false;
    expect_ids(t, "abc", false, false, (int32_t[]){3, 7}, 2);
    /* Equal scores: the leftmost pair merges first: "aaa" -> aa + a. */
    expect_ids(t, "aaa", false, false, (int32_t[]){13, 3}, 2);
    /* 'A' has a byte token; 'Z' has none and becomes <unk>. */
    expect_ids(t, "AZ", false, false, (int32_t[]){10, 0}, 2);
    v.add_space_prefix = true;
    expect_ids(t, "abc", false, false, (int32_t[]){9, 7}, 2);
    expect_ids(t, "abc", true, false, (int32_t[]){1, 9, 7}, 3);
    /* Longest special first: "<|user|>" wins over "<|us" and "<|u". */
    v.add_space_prefix = false;
    expect_ids(t, "<|user|>a", false, true, (int32_t[]){11, 3}, 2);
    expect_ids(t, "<|usa", false, true, (int32_t[]){14, 3}, 2);
    /* Without parse_special, control tokens are text but user-defined
     * tokens are still cut out (as llama.cpp and Hugging Face do). */
    expect_ids(t, "<|usa", false, false, (int32_t[]){0, 0, 0, 0, 3}, 5);
    expect_ids(t, "<|user|>a", false, false, (int32_t[]){11, 3}, 2);
    char buf[16];
    assert_int_equal(tok_token_to_bytes(t, 11, false, buf, sizeof buf), 8);
    assert_int_equal(tok_token_to_bytes(t, 0, false, buf, sizeof buf), 0);
    assert_int_equal(tok_token_to_bytes(t, 9, false, buf, sizeof buf), 2);
    assert_memory_equal(buf, " a", 2);
    assert_true(tok_is_eog(t, 2));
    tok_free(t);
    vocab_free(&v);
}

static void test_bpe_mini(void **state) {
    (void)state;
    /* GPT-2 characters: 'Ġ' (U+0120) is the space byte. The lowest rank
     * merges first: "aab" -> a + ab since "a b" ranks before "a a". */
    const mini_tok toks[] = {
        {"a", 0, 0}, {"b", 0, 0}, {"\xC4\xA0", 0, 0}, {"ab", 0, 0}, {"aa", 0, 0},
        {"\xC4\xA0" "a", 0, 0}, {"<|im_end|>", 0, VOCAB_T_CONTROL}, {"\xC4\xA0" "ab", 0, 0},
    };
    const char *merges[] = {"\xC4\xA0 a", "a b", "a a", "\xC4\xA0" "a b", "x y"};
    model_vocab v;
    mini_vocab(&v, "gpt2", "qwen2", toks, (int)(sizeof toks / sizeof toks[0]), merges, 5);
    kvlm_error err = {0};
    tok_tokenizer *t = tok_create(&v, &err);
    if (!t) fail_msg("%s", err.msg);
    expect_ids(t, "aab", false, false, (int32_t[]){0, 3}, 2);
    expect_ids(t, "aaa", false, false, (int32_t[]){4, 0}, 2);
    expect_ids(t, " ab", false, false, (int32_t[]){7}, 1);
    expect_ids(t, " aab", false, false, (int32_t[]){5, 3}, 2);
    /* Equal ranks: the leftmost pair first. */
    expect_ids(t, "aaaa", false, false, (int32_t[]){4, 4}, 2);
    expect_ids(t, "ab<|im_end|>", false, true, (int32_t[]){3, 6}, 2);
    assert_true(tok_is_eog(t, 6));
    char buf[16];
    assert_int_equal(tok_token_to_bytes(t, 7, false, buf, sizeof buf), 3);
    assert_memory_equal(buf, " ab", 3);
    tok_free(t);
    vocab_free(&v);
}

/* gpt-oss's harmony tokens (llama.cpp's rules): with <|return|>, <|call|>
 * and <|end|> all there, a turn ends at the first two, and <|end|> (which
 * closes the analysis before the final answer) does not end generation,
 * even as the file's end-of-turn id; elsewhere <|end|> does (Phi-3). The
 * header markers and <|end|> show in the text; <|return|> does not. */
static void test_harmony_eog(void **state) {
    (void)state;
    const mini_tok toks[] = {{"a", 0, 0},
                             {"<|end|>", 0, VOCAB_T_CONTROL},
                             {"<|return|>", 0, VOCAB_T_CONTROL},
                             {"<|call|>", 0, VOCAB_T_CONTROL},
                             {"<|endoftext|>", 0, VOCAB_T_CONTROL},
                             {"<|channel|>", 0, VOCAB_T_CONTROL}};
    for (int harmony = 0; harmony < 2; harmony++) {
        model_vocab v;
        mini_vocab(&v, "gpt2", "gpt-4o", toks, harmony ? 6 : 2, NULL, 0);
        v.eot = 1;
        kvlm_error err = {0};
        tok_tokenizer *t = tok_create(&v, &err);
        if (!t) fail_msg("%s", err.msg);
        assert_int_equal(tok_is_eog(t, 1), !harmony);
        if (harmony) {
            assert_true(tok_is_eog(t, 2));
            assert_true(tok_is_eog(t, 3));
            assert_true(tok_is_eog(t, 4));
        }
        assert_false(tok_is_eog(t, 0));
        char buf[16];
        assert_int_equal(tok_token_to_bytes(t, 1, false, buf, sizeof buf), harmony ? 7 : 0); /* <|end|> */
        if (harmony) {
            assert_int_equal(tok_token_to_bytes(t, 5, false, buf, sizeof buf), 11);
            assert_memory_equal(buf, "<|channel|>", 11);
            assert_int_equal(tok_token_to_bytes(t, 2, false, buf, sizeof buf), 0); /* <|return|> */
        }
        tok_free(t);
        vocab_free(&v);
    }
}

/* Llama 3's ignore_merges: a chunk that is a token is taken whole, where
 * the merges alone ("a b" only here) would stop at ab + c. */
static void test_bpe_ignore_merges(void **state) {
    (void)state;
    const mini_tok toks[] = {{"a", 0, 0}, {"b", 0, 0}, {"c", 0, 0}, {"ab", 0, 0}, {"abc", 0, 0}};
    const char *merges[] = {"a b"};
    const char *pres[] = {"llama-bpe", "qwen2"};
    for (int k = 0; k < 2; k++) {
        model_vocab v;
        mini_vocab(&v, "gpt2", pres[k], toks, 5, merges, 1);
        kvlm_error err = {0};
        tok_tokenizer *t = tok_create(&v, &err);
        if (!t) fail_msg("%s", err.msg);
        if (k == 0) expect_ids(t, "abc", false, false, (int32_t[]){4}, 1);
        else expect_ids(t, "abc", false, false, (int32_t[]){3, 2}, 2);
        tok_free(t);
        vocab_free(&v);
    }
}

static void test_errors(void **state) {
    (void)state;
    const mini_tok toks[] = {{"a", 0, 0}};
    model_vocab v;
    kvlm_error err = {0};
    mini_vocab(&v, "gpt2", "no-such-pre", toks, 1, NULL, 0);
    assert_null(tok_create(&v, &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "no-such-pre"));
    assert_non_null(strstr(err.msg, "llama-bpe")); /* lists what is supported */
    assert_non_null(strstr(err.msg, "qwen2"));
    vocab_free(&v);
    mini_vocab(&v, "t5", "", toks, 1, NULL, 0); /* Unigram: not read */
    assert_null(tok_create(&v, &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    vocab_free(&v);
    /* Absent pre on a gpt2 vocabulary means llama.cpp's "default". */
    mini_vocab(&v, "gpt2", "", toks, 1, NULL, 0);
    tok_tokenizer *t = tok_create(&v, &err);
    assert_non_null(t);
    tok_free(t);
    vocab_free(&v);
}

/* ---- pre-tokenizer splits --------------------------------------------------------------- */

typedef struct {
    const char *chunks[64];
    int n;
    char store[1024];
    size_t used;
} split_result;

static int collect(void *ctx, const char *chunk, size_t n) {
    split_result *r = ctx;
    assert_true(r->n < 64 && r->used + n + 1 <= sizeof r->store);
    memcpy(r->store + r->used, chunk, n);
    r->store[r->used + n] = 0;
    r->chunks[r->n++] = r->store + r->used;
    r->used += n + 1;
    return 0;
}

/* want: the chunks joined by '|' (none of the inputs contain '|'). */
static void expect_split(const char *pre, const char *text, const char *want) {
    kvlm_error err = {0};
    tok_pretok *p = tok_pretok_create(pre, &err);
    if (!p) fail_msg("%s", err.msg);
    split_result r = {0};
    assert_int_equal(tok_pretok_split(p, text, strlen(text), collect, &r, &err), 0);
    char joined[1024];
    size_t o = 0;
    for (int i = 0; i < r.n; i++) o += (size_t)snprintf(joined + o, sizeof joined - o, "%s%s", i ? "|" : "", r.chunks[i]);
    joined[o] = 0;
    if (strcmp(joined, want) != 0) fail_msg("%s split of \"%s\":\n  want \"%s\"\n  got  \"%s\"", pre, text, want, joined);
    tok_pretok_free(p);
}

static void test_pretok_splits(void **state) {
    (void)state;
    /* GPT-2: lowercase contractions only, a space joins the next word or
     * number, runs of digits stay whole, whitespace before a word leaves its
     * last space to the word. */
    expect_split("gpt-2", "Hello world", "Hello| world");
    expect_split("gpt-2", "I'm 12345 ok", "I|'m| 12345| ok");
    expect_split("gpt-2", "I'M", "I|'|M");
    expect_split("gpt-2", "a   b", "a|  | b");
    expect_split("gpt-2", "x!!  \n", "x|!!|  \n");
    /* Llama 3: numbers in groups of up to three digits, case-insensitive
     * contractions, one non-letter may lead a word, newlines gather with the
     * whitespace before them. */
    expect_split("llama-bpe", "1234567 x", "123|456|7| x");
    expect_split("llama-bpe", "I'M here", "I|'M| here");
    expect_split("llama-bpe", "we'LL see", "we|'LL| see");
    expect_split("llama-bpe", "(hello) world", "(hello|)| world");
    expect_split("llama-bpe", "a  \n\nb", "a|  \n\n|b");
    expect_split("llama-bpe", "a   b", "a|  | b");
    expect_split("llama-bpe", "x ...\n\ny", "x| ...\n\n|y");
    expect_split("llama3", "3.14", "3|.|14");
    /* Qwen2: like Llama 3 but every digit alone. */
    expect_split("qwen2", "1234 x", "1|2|3|4| x");
    expect_split("qwen2", "I'VE 42", "I|'VE| |4|2");
    expect_split("qwen2", "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C",
                 "\xE4\xBD\xA0\xE5\xA5\xBD|\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C"); /* "你好，世界" */
    /* StarCoder family: digits split first, then GPT-2's pattern. */
    expect_split("starcoder", "ab 123", "ab| |1|2|3");
    expect_split("smollm", "x1y", "x|1|y");
    /* Invalid UTF-8 never matches; it becomes chunks of its own. */
    expect_split("gpt-2", "ab\xFF" "cd", "ab|\xFF|cd");
    expect_split("llama-bpe", "\xC3(x", "\xC3|(x");
}

static int count_chunk(void *ctx, const char *chunk, size_t n) {
    size_t *c = ctx;
    (void)chunk;
    c[0]++;
    c[1] += n;
    return 0;
}

/* Long runs through every pattern: the chunks cover the text, and the
 * backtracking in \s*[\r\n]+ and \s+(?!\S) stays linear (no timeouts). */
static void test_pretok_hostile(void **state) {
    (void)state;
    size_t big = tu_quick() ? 20000 : 300000;
    char *buf = malloc(big);
    assert_non_null(buf);
    const char *pres[] = {"gpt-2", "llama-bpe", "qwen2", "starcoder"};
    const char *fills[] = {" ", "\n", " \n", "\t ", "1", "a", "\xFF", "\xE4\xB8", "'s", " \xC3"};
    for (size_t k = 0; k < sizeof pres / sizeof pres[0]; k++) {
        kvlm_error err = {0};
        tok_pretok *p = tok_pretok_create(pres[k], &err);
        if (!p) fail_msg("%s", err.msg);
        for (size_t f = 0; f < sizeof fills / sizeof fills[0]; f++) {
            size_t fl = strlen(fills[f]);
            for (size_t i = 0; i < big; i++) buf[i] = fills[f][i % fl];
            buf[big - 1] = 'x';
            size_t c[2] = {0, 0};
            assert_int_equal(tok_pretok_split(p, buf, big, count_chunk, c, &err), 0);
            assert_int_equal(c[1], big);
            if (!strcmp(fills[f], "1") && !strcmp(pres[k], "llama-bpe")) assert_int_equal(c[0], (big - 1 + 2) / 3 + 1);
        }
        tok_pretok_free(p);
    }
    free(buf);
}

/* Through the public API on stories260K: decoding (kvlm_detok) what
 * kvlm_tokenize made of a text gives the text back exactly, with BOS and
 * without (--no-bos): the SentencePiece leading space is neither kept nor
 * eaten from the text's own leading spaces. */
static void test_detok_round_trip_bos(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) skip();
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("%s: %s", path, err.msg);
    static const char *texts[] = {"Hello world", " Hello world", "  two  spaces ", "a", "Once upon a time,\nthere was",
                                  "\nHello", " ", "Lily's dog: \"Max\"!"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        for (int bos = 0; bos < 2; bos++) {
            int32_t toks[256];
            int n = kvlm_tokenize(m, texts[i], strlen(texts[i]), bos, false, toks, 256, &err);
            assert_true(n > 0 && n <= 256);
            assert_int_equal(toks[0] == kvlm_token_bos(m), bos);
            kvlm_detok dt;
            kvlm_detok_init(&dt, m);
            char out[1024] = "", piece[256];
            for (int k = 0; k < n; k++) {
                kvlm_detok_push(&dt, toks[k], piece, sizeof piece);
                strcat(out, piece);
            }
            kvlm_detok_flush(&dt, piece, sizeof piece);
            strcat(out, piece);
            if (strcmp(out, texts[i])) fail_msg("%s BOS: \"%s\" decodes as \"%s\"", bos ? "with" : "without", texts[i], out);
        }
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spm_mini),
        cmocka_unit_test(test_bpe_mini),
        cmocka_unit_test(test_harmony_eog),
        cmocka_unit_test(test_bpe_ignore_merges),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_pretok_hostile),
        cmocka_unit_test(test_pretok_splits),
        cmocka_unit_test(test_spm_reference),
        cmocka_unit_test(test_gpt2_reference),
        cmocka_unit_test(test_spm_random_round_trip),
        cmocka_unit_test(test_gpt2_random_round_trip),
        cmocka_unit_test(test_spm_special),
        cmocka_unit_test(test_gpt2_special),
        cmocka_unit_test(test_corpus_round_trip),
        cmocka_unit_test(test_hostile_input),
        cmocka_unit_test(test_tok512),
        cmocka_unit_test(test_detok_round_trip_bos),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
