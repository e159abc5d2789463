/* tests/test_json_mask: engine/json_mask's recognizer against documents that
 * are JSON objects and texts that are not (RFC 8259's grammar: numbers,
 * escapes, literals, nesting, UTF-8 in strings), fed whole, byte by byte and
 * in random pieces (the same answer whatever the cut); the whitespace limit;
 * and the token mask on stories260K: every token it allows keeps the text a
 * prefix of a JSON object, every one it refuses does not. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "engine/json_mask.h"

/* -1: every byte taken and the object closed; -2: every byte taken, not
 * closed (a prefix); else the offset of the first byte refused. */
static int run(const char *text, int piece, unsigned seed) {
    jm_state s;
    jm_init(&s);
    int n = (int)strlen(text);
    for (int i = 0; i < n;) {
        int k = piece > 0 ? piece : 1 + (int)(rand_r(&seed) % 7);
        if (k > n - i) k = n - i;
        jm_state before = s;
        if (!jm_feed(&s, text + i, k)) { /* find the byte */
            for (int j = 0; j < k; j++)
                if (!jm_feed(&before, text + i + j, 1)) return i + j;
            return -3; /* refused as a piece, taken byte by byte: never */
        }
        i += k;
    }
    return jm_done(&s) ? -1 : -2;
}

static void expect(const char *text, int want) {
    for (int piece = 0; piece <= 3; piece++) {
        int got = run(text, piece == 3 ? 0 : piece == 0 ? 1 << 20 : piece, 17u + (unsigned)piece);
        if (got != want) fail_msg("%s (pieces %d): got %d, want %d", text, piece, got, want);
    }
}

static void test_objects(void **state) {
    (void)state;
    const char *good[] = {
        "{}", " {}", "\n{}", "{\"a\":1}", "{\"a\": -0.5e+10, \"b\": [true, false, null, 0, 1.25E-3, \"x\"]}",
        "{\n  \"a\": {\"b\": {\"c\": []}},\n  \"d\": [[], [[1]], {}]\n}", "{\"\\u00e9\\n\\t\\\"\\\\\\/\": \"\\uD83D\"}",
        "{\"h\u00e9llo\": \"w\u00f6rld \u2713 \U0001F600\"}", "{\"a\":0,\"b\":10,\"c\":-9e9}", "{\r\n\"a\" : 1\r\n}",
    };
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) expect(good[i], -1);
    /* prefixes of good ones are prefixes */
    const char *pre[] = {"", "{", "{\"a", "{\"a\":", "{\"a\": -", "{\"a\": 1.", "{\"a\": 1e", "{\"a\": tr",
                         "{\"a\": [1, {\"b\"", "{\"a\": \"\\u00", "{\"a\": \"\xe2\x9c", "{\"a\":0"};
    for (size_t i = 0; i < sizeof pre / sizeof *pre; i++) expect(pre[i], -2);
    struct { const char *text; int at; } bad[] = {
        {"[]", 0}, {"\"a\"", 0}, {"1", 0}, {"x", 0}, {"{}}", 2}, {"{} ", 2}, {"{\"a\" 1}", 5}, {"{\"a\":}", 5},
        {"{\"a\":01}", 6}, {"{\"a\":1.}", 7}, {"{\"a\":-}", 6}, {"{\"a\":1e}", 7}, {"{\"a\":+1}", 5},
        {"{\"a\":.5}", 5}, {"{\"a\":tru}", 8}, {"{\"a\":nul1}", 8}, {"{a:1}", 1}, {"{\"a\":1,}", 7},
        {"{\"a\":[1,]}", 8}, {"{\"a\":[1}", 7}, {"{\"a\":{]}", 6}, {"{\"a\":\"\x01\"}", 6}, {"{\"a\":\"\\x\"}", 7},
        {"{\"a\":\"\\u12g4\"}", 10}, {"{\"a\":\"\xc0\xaf\"}", 6}, {"{\"a\":\"\xe0\x80\x80\"}", 7},
        {"{\"a\":\"\xed\xa0\x80\"}", 7}, {"{\"a\":\"\xf4\x90\x80\x80\"}", 7}, {"{\"a\":\"\xff\"}", 6},
        {"{\"a\":\"\xe2\x28\"}", 7}, {"{\"a\":1}x", 7}, {"{,}", 1}, {"{\"a\":1 2}", 7},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) expect(bad[i].text, bad[i].at);
}

static void test_limits(void **state) {
    (void)state;
    char deep[2 * JM_DEPTH + 16];
    /* {"a": then JM_DEPTH - 1 more arrays fit, one more does not */
    strcpy(deep, "{\"a\":");
    size_t n = strlen(deep);
    for (int i = 0; i < JM_DEPTH - 1; i++) deep[n++] = '[';
    deep[n] = 0;
    expect(deep, -2);
    deep[n++] = '[';
    deep[n] = 0;
    expect(deep, (int)n - 1);
    /* whitespace: one newline and 20 blanks in a row between tokens, no limit in strings */
    expect("{\n                    \"a\":1}", -1);
    expect("{\n                     \"a\":1}", 22);
    expect("{\n\n\"a\":1}", 2);
    expect("{\"a                                   \":1}", -1);
    expect("                     {}", 20);
}

/* On a real vocabulary: after each of a few prefixes, a token is allowed
 * exactly when the prefix with its text is still a JSON prefix (or, once
 * the object is closed, when it ends generation). */
static void test_mask(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    const json_vocab *v = jm_vocab(m);
    assert_non_null(v);
    assert_ptr_equal(v, jm_vocab(m)); /* built once */
    int nv = kvlm_vocab_size(m);
    bool *allowed = malloc((size_t)nv);
    const char *prefixes[] = {"", " {", "{\"a\": ", "{\"name\": \"Li", "{\"n\": 1", "{\"x\": [tr", "{}"};
    for (size_t p = 0; p < sizeof prefixes / sizeof *prefixes; p++) {
        jm_state s;
        jm_init(&s);
        assert_true(jm_feed(&s, prefixes[p], (int)strlen(prefixes[p])));
        int n = jm_allowed(v, &s, allowed), count = 0;
        for (int t = 0; t < nv; t++) {
            char buf[256], text[512];
            int k = kvlm_token_to_text(m, t, buf, sizeof buf);
            bool want;
            if (kvlm_token_is_eog(m, t)) want = jm_done(&s);
            else if (k <= 0 || jm_done(&s)) want = false;
            else {
                snprintf(text, sizeof text, "%s%.*s", prefixes[p], k, buf);
                int r = run(text, 1, 0);
                want = memchr(buf, 0, (size_t)k) == NULL && (r == -1 || r == -2);
            }
            if (allowed[t] != want) fail_msg("after '%s', token %d ('%.*s'): allowed %d", prefixes[p], t, k, buf, allowed[t]);
            count += want;
        }
        assert_int_equal(n, count);
        print_message("  after '%s': %d of %d tokens allowed\n", prefixes[p], n, nv);
    }
    free(allowed);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_objects),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_mask),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
