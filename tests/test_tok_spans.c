/* tests/test_tok_spans: kvlm_tokenize_spans (text with spans whose token ids
 * are known) against kvlm_tokenize and kvlm_detok: no spans gives
 * kvlm_tokenize's tokens; a span whose ids spell it is taken verbatim, the
 * tokens before it are those of the text before it alone (what the prefix
 * cache needs), the whole decodes to the text (no SentencePiece space after a
 * span); a span whose ids do not spell it changes nothing; bad spans are
 * refused. On tok512 (SentencePiece), GPT-2 (byte-level BPE) and Llama's
 * SentencePiece vocabulary (special tokens). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"

static kvlm_model *load(const char *name, bool vocab_only) {
    const char *path = tu_model_path(name);
    if (!path) return NULL;
    kvlm_model_params mp = {0};
    mp.vocab_only = vocab_only;
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) fail_msg("%s: %s", path, err.msg);
    return m;
}

static int32_t *tok(const kvlm_model *m, const char *s, size_t len, bool bos, bool special, int *n) {
    kvlm_error err = {0};
    *n = kvlm_tokenize(m, s, len, bos, special, NULL, 0, &err);
    if (*n < 0) fail_msg("kvlm_tokenize: %s", err.msg);
    int32_t *t = malloc(((size_t)*n + 1) * sizeof *t);
    assert_non_null(t);
    assert_int_equal(kvlm_tokenize(m, s, len, bos, special, t, *n, &err), *n);
    return t;
}

static int32_t *tok_spans(const kvlm_model *m, const char *s, size_t len, bool bos, bool special, kvlm_token_span *sp,
                          int n_sp, int *n) {
    kvlm_error err = {0};
    *n = kvlm_tokenize_spans(m, s, len, bos, special, sp, n_sp, NULL, 0, &err);
    if (*n < 0) fail_msg("kvlm_tokenize_spans: %s", err.msg);
    int32_t *t = malloc(((size_t)*n + 1) * sizeof *t);
    assert_non_null(t);
    int again = kvlm_tokenize_spans(m, s, len, bos, special, sp, n_sp, t, *n, &err);
    assert_int_equal(again, *n);
    return t;
}

/* The text of ids as kvlm_detok gives it after prev, flushed (malloc'd). */
static char *detok(const kvlm_model *m, int32_t prev, const int32_t *ids, int n) {
    size_t cap = 64 + (size_t)n * 800, len = 0;
    char *out = malloc(cap), piece[1024];
    assert_non_null(out);
    kvlm_detok d;
    kvlm_detok_init(&d, m);
    d.prev = prev;
    for (int i = 0; i <= n; i++) {
        int k = i < n ? kvlm_detok_push(&d, ids[i], piece, sizeof piece) : kvlm_detok_flush(&d, piece, sizeof piece);
        memcpy(out + len, piece, (size_t)k);
        len += (size_t)k;
    }
    out[len] = 0;
    return out;
}

/* Ids that spell s byte by byte: its bytes' <0xHH> tokens (SentencePiece:
 * ids 3 + HH in Llama's layout, checked), or each character encoded alone
 * (byte-level BPE, ASCII). */
static int32_t *byte_ids(const kvlm_model *m, const char *s, size_t len) {
    int32_t *ids = malloc((len + 1) * sizeof *ids);
    assert_non_null(ids);
    for (size_t i = 0; i < len; i++) {
        int32_t b = 3 + (unsigned char)s[i];
        char one[8];
        if (b < kvlm_vocab_size(m) && kvlm_token_to_text(m, b, one, sizeof one) == 1 && one[0] == s[i]) {
            ids[i] = b;
            continue;
        }
        kvlm_error err = {0};
        int32_t t[4];
        assert_int_equal(kvlm_tokenize(m, s + i, 1, false, false, t, 4, &err), 1);
        ids[i] = t[0];
    }
    return ids;
}

static const char *const k_texts[] = {
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "Tom said: \"Hello!\"\nThen they  ran   home, happy.",
    "a b  c   d\n\ne",
    "Hello world",
};

/* kvlm_tokenize_spans with no spans is kvlm_tokenize. */
static void check_no_spans(const kvlm_model *m) {
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++)
        for (int bos = 0; bos < 2; bos++)
            for (int special = 0; special < 2; special++) {
                const char *s = k_texts[i];
                int n1, n2;
                int32_t *a = tok(m, s, strlen(s), bos, special, &n1), *b = tok_spans(m, s, strlen(s), bos, special, NULL, 0, &n2);
                assert_int_equal(n1, n2);
                assert_memory_equal(a, b, (size_t)n1 * sizeof *a);
                free(a);
                free(b);
            }
}

/* One span of every text's every [off, off + len) (a sample), spelled byte by byte: taken at
 * the place the text before it ends; the tokens before it are that text's alone; the whole
 * decodes to the text. A span whose ids do not spell it changes nothing. */
static void check_one_span(const kvlm_model *m) {
    int step = tu_quick() ? 7 : 3;
    for (size_t i = 0; i < sizeof k_texts / sizeof k_texts[0]; i++) {
        const char *s = k_texts[i];
        size_t len = strlen(s);
        for (size_t off = 0; off < len; off += (size_t)step)
            for (size_t sl = 1; off + sl <= len; sl += (size_t)step + 2) {
                int32_t *ids = byte_ids(m, s + off, sl);
                for (int bos = 0; bos < 2; bos++) {
                    kvlm_token_span sp = {off, sl, ids, (int)sl, 99};
                    int n;
                    int32_t *t = tok_spans(m, s, len, bos, false, &sp, 1, &n);
                    assert_true(sp.at >= 0);
                    assert_memory_equal(t + sp.at, ids, sl * sizeof *ids);
                    int np;
                    int32_t *pre = tok(m, s, off, bos, false, &np);
                    assert_int_equal(np, sp.at);
                    assert_memory_equal(t, pre, (size_t)np * sizeof *t);
                    char *back = detok(m, -1, t, n);
                    if (strcmp(back, s))
                        fail_msg("span [%zu, +%zu) of \"%s\" (BOS %d): decodes as \"%s\"", off, sl, s, bos, back);
                    free(back);
                    free(pre);
                    free(t);
                    /* the same ids for a span one byte longer or moved: not taken, kvlm_tokenize's tokens */
                    kvlm_token_span bad = {off + 1 <= len - sl ? off + 1 : off, off + 1 <= len - sl ? sl : sl - 1, ids,
                                           (int)sl, 99};
                    if (bad.len && memcmp(s + bad.offset, s + off, sl) && bad.len == sl) {
                        t = tok_spans(m, s, len, bos, false, &bad, 1, &n);
                        assert_int_equal(bad.at, -1);
                        int nw;
                        int32_t *w = tok(m, s, len, bos, false, &nw);
                        assert_int_equal(n, nw);
                        assert_memory_equal(t, w, (size_t)n * sizeof *t);
                        free(w);
                        free(t);
                    }
                }
                free(ids);
            }
    }
}

/* Several spans: the tokens before each are those of the text before it with
 * the spans before it (the prefix property, span by span). */
static void check_many_spans(const kvlm_model *m) {
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    int rounds = tu_quick() ? 60 : 300;
    for (int r = 0; r < rounds; r++) {
        const char *s = k_texts[r % 4];
        size_t len = strlen(s);
        kvlm_token_span sp[4];
        int32_t *ids[4] = {0};
        int ns = 0;
        size_t at = 0;
        for (int k = 0; k < 4 && at < len; k++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            size_t off = at + rng % 7, sl = 1 + (rng >> 8) % 9;
            if (off + sl > len) break;
            ids[ns] = byte_ids(m, s + off, sl);
            /* every other one spelled by its canonical tokens, when they spell it (no space prefix) */
            int nc = 0;
            int32_t *canon = (rng >> 20) & 1 ? tok(m, s + off, sl, false, false, &nc) : NULL;
            char *spelled = canon ? detok(m, 12345 % kvlm_vocab_size(m), canon, nc) : NULL;
            if (spelled && strlen(spelled) == sl && !memcmp(spelled, s + off, sl)) {
                free(ids[ns]);
                ids[ns] = canon;
                sp[ns] = (kvlm_token_span){off, sl, ids[ns], nc, 0};
            } else {
                free(canon);
                sp[ns] = (kvlm_token_span){off, sl, ids[ns], (int)sl, 0};
            }
            free(spelled);
            ns++;
            at = off + sl;
        }
        int bos = r & 1, n;
        int32_t *t = tok_spans(m, s, len, bos, false, sp, ns, &n);
        char *back = detok(m, -1, t, n);
        assert_string_equal(back, s);
        free(back);
        for (int k = 0; k < ns; k++) {
            if (sp[k].at < 0) continue;
            assert_memory_equal(t + sp[k].at, sp[k].ids, (size_t)sp[k].n_ids * sizeof *t);
            kvlm_token_span before[4];
            memcpy(before, sp, sizeof before);
            int np;
            int32_t *pre = tok_spans(m, s, sp[k].offset, bos, false, before, k, &np);
            assert_int_equal(np, sp[k].at);
            assert_memory_equal(t, pre, (size_t)np * sizeof *t);
            free(pre);
        }
        free(t);
        for (int k = 0; k < ns; k++) free(ids[k]);
    }
}

static void test_tok512(void **state) {
    (void)state;
    kvlm_model *m = load("stories260K.gguf", false);
    if (!m) skip();
    check_no_spans(m);
    check_one_span(m);
    check_many_spans(m);
    /* the piece after a span continues the text: no SentencePiece space prefix before it */
    const char *s = "Lily ran.Then";
    int32_t *ids = byte_ids(m, s, 9);
    kvlm_token_span sp = {0, 9, ids, 9, 0};
    int n, nw;
    int32_t *t = tok_spans(m, s, strlen(s), false, false, &sp, 1, &n), *w = tok(m, "Then", 4, false, false, &nw);
    char *tail = detok(m, t[8], t + 9, n - 9), *alone = detok(m, 1000, w, nw);
    assert_string_equal(tail, "Then");
    assert_string_equal(alone, " Then"); /* (as a text's start, after a token that is not BOS) */
    free(tail);
    free(alone);
    free(w);
    free(t);
    /* kvlm_detok's rule, as an answer's text was made: a lone UTF-8 lead byte reads as U+FFFD */
    int32_t lead = ids[0] - (int32_t)(unsigned char)s[0] + 0xC3;
    const char *fffd = "ab\xEF\xBF\xBD";
    kvlm_token_span u = {2, 3, &lead, 1, 0};
    t = tok_spans(m, fffd, strlen(fffd), false, false, &u, 1, &n);
    assert_int_equal(u.at, n - 1);
    assert_int_equal(t[n - 1], lead);
    free(t);
    const char *raw = "ab\xC3";
    u = (kvlm_token_span){2, 1, &lead, 1, 0};
    t = tok_spans(m, raw, strlen(raw), false, false, &u, 1, &n);
    assert_int_equal(u.at, -1);
    free(t);
    free(ids);
    kvlm_model_free(m);
}

static void test_gpt2(void **state) {
    (void)state;
    kvlm_model *m = load("vocab/ggml-vocab-gpt-2.gguf", true);
    if (!m) skip();
    check_no_spans(m);
    check_one_span(m);
    check_many_spans(m);
    kvlm_model_free(m);
}

/* Special tokens are still recognised in the pieces between spans; control tokens in a span's
 * ids (no text) do not stop it spelling its text. */
static void test_llama_special(void **state) {
    (void)state;
    kvlm_model *m = load("vocab/ggml-vocab-llama-spm.gguf", true);
    if (!m) skip();
    check_no_spans(m);
    const char *s = "<s>Hi</s> there</s>";
    int n, nw;
    int32_t *hi = byte_ids(m, "Hi", 2);
    int32_t with_eos[3] = {kvlm_token_eos(m), hi[0], hi[1]};
    kvlm_token_span sp = {3, 2, with_eos, 3, 0};
    int32_t *t = tok_spans(m, s, strlen(s), false, true, &sp, 1, &n), *w = tok(m, s, strlen(s), false, true, &nw);
    assert_int_equal(sp.at, 1);
    assert_int_equal(t[0], kvlm_token_bos(m));
    assert_int_equal(t[4], kvlm_token_eos(m)); /* "</s>" after the span */
    assert_int_equal(t[n - 1], kvlm_token_eos(m));
    char *back = detok(m, -1, t, n), *want = detok(m, -1, w, nw);
    assert_string_equal(back, want);
    free(back);
    free(want);
    free(t);
    free(w);
    free(hi);
    kvlm_model_free(m);
}

static void test_errors(void **state) {
    (void)state;
    kvlm_model *m = load("stories260K.gguf", false);
    if (!m) skip();
    const char *s = "Hello world";
    int32_t ids[3] = {100, 101, 102}, big = kvlm_vocab_size(m), neg = -1;
    kvlm_error err = {0};
    kvlm_token_span over[2] = {{0, 5, ids, 3, 0}, {4, 3, ids, 3, 0}};
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, over, 2, NULL, 0, &err), -1);
    assert_non_null(strstr(err.msg, "out of order"));
    kvlm_token_span past = {8, 4, ids, 3, 0};
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, &past, 1, NULL, 0, &err), -1);
    kvlm_token_span far = {(size_t)-2, 4, ids, 3, 0};
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, &far, 1, NULL, 0, &err), -1);
    kvlm_token_span bad_id = {0, 5, &big, 1, 0}, neg_id = {0, 5, &neg, 1, 0}, no_ids = {0, 5, NULL, 2, 0};
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, &bad_id, 1, NULL, 0, &err), -1);
    assert_non_null(strstr(err.msg, "vocabulary"));
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, &neg_id, 1, NULL, 0, &err), -1);
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, &no_ids, 1, NULL, 0, &err), -1);
    assert_int_equal(kvlm_tokenize_spans(m, NULL, 3, true, false, NULL, 0, NULL, 0, &err), -1);
    assert_int_equal(kvlm_tokenize_spans(m, s, strlen(s), true, false, NULL, 1, NULL, 0, &err), -1);
    /* empty spans, and spans without ids, are not taken; only the first max tokens are written */
    kvlm_token_span empty[2] = {{2, 0, ids, 3, 0}, {5, 3, ids, 0, 0}};
    int32_t out[2] = {-7, -7};
    int n = kvlm_tokenize_spans(m, s, strlen(s), true, false, empty, 2, out, 2, &err);
    int nw;
    int32_t *w = tok(m, s, strlen(s), true, false, &nw);
    assert_int_equal(n, nw);
    assert_true(n > 2);
    assert_int_equal(empty[0].at, -1);
    assert_int_equal(empty[1].at, -1);
    assert_memory_equal(out, w, 2 * sizeof *w);
    free(w);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tok512),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_llama_special),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
