/* tests/test_grammar: engine/grammar and tok/json_schema. The JSON mode's
 * grammar against documents that are JSON objects and texts that are not
 * (RFC 8259: numbers, escapes, literals, nesting, UTF-8 in strings), fed
 * whole, byte by byte and in random pieces (the same answer whatever the
 * cut); GBNF's syntax (literals, classes, repetitions, groups, comments,
 * alternatives over lines) and its errors (line and column); JSON schemas
 * (properties in order, required, enum, const, anyOf, recursive $ref, bounds,
 * formats) and the keywords they refuse; the token mask on real vocabularies
 * against feeding each token's text to a fresh matcher; and the sampler
 * drawing only what the grammar allows. */
#include <math.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "engine/grammar.h"
#include "model/model.h"
#include "tok/tok.h"

static kvlm_grammar *gbnf(const char *text) {
    kvlm_error err = {0};
    kvlm_grammar *g = kvlm_grammar_from_gbnf(NULL, text, NULL, &err);
    if (!g) fail_msg("%s: %s", text, err.msg);
    return g;
}

static kvlm_grammar *schema(const char *text) {
    kvlm_error err = {0};
    kvlm_grammar *g = kvlm_grammar_from_json_schema(NULL, text, &err);
    if (!g) fail_msg("%s: %s", text, err.msg);
    return g;
}

/* -1: every byte taken and the grammar complete; -2: every byte taken, not
 * complete (a prefix); else the offset of the first byte refused. */
static int run(const kvlm_grammar *g, const char *text, int piece, unsigned seed) {
    gm *m = gm_new(g);
    assert_non_null(m);
    int n = (int)strlen(text), r = -3;
    for (int i = 0; i < n;) {
        int k = piece > 0 ? piece : 1 + (int)(rand_r(&seed) % 7);
        if (k > n - i) k = n - i;
        if (!gm_feed(m, text + i, k)) { /* find the byte: nothing changed */
            for (int j = 0; j < k; j++)
                if (!gm_feed(m, text + i + j, 1)) { r = i + j; break; }
            goto out;
        }
        i += k;
    }
    r = gm_done(m) ? -1 : -2;
out:
    gm_free(m);
    return r;
}

static void expect(const kvlm_grammar *g, const char *text, int want) {
    for (int piece = 0; piece <= 3; piece++) {
        int got = run(g, text, piece == 3 ? 0 : piece == 0 ? 1 << 20 : piece, 17u + (unsigned)piece);
        if (got != want) fail_msg("'%s' (pieces %d): got %d, want %d", text, piece, got, want);
    }
}

/* want -3: refused somewhere */
static void expect_refused(const kvlm_grammar *g, const char *text) {
    int got = run(g, text, 1, 0);
    if (got < 0) fail_msg("'%s': taken (%d), want refused", text, got);
}

static void test_json_object(void **state) {
    (void)state;
    kvlm_grammar *g = schema("{\"type\": \"object\"}");
    const char *good[] = {
        "{}", " {}", "\n{}", "{\"a\":1}", "{\"a\": -0.5e+10, \"b\": [true, false, null, 0, 1.25E-3, \"x\"]}",
        "{\n  \"a\": {\"b\": {\"c\": []}},\n  \"d\": [[], [[1]], {}]\n}", "{\"\\u00e9\\n\\t\\\"\\\\\\/\": \"\\uD83D\"}",
        "{\"h\u00e9llo\": \"w\u00f6rld \u2713 \U0001F600\"}", "{\"a\":0,\"b\":10,\"c\":-9e9}", "{\"a\" : 1\n}",
    };
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) expect(g, good[i], -1);
    /* prefixes of good ones are prefixes */
    const char *pre[] = {"", "{", "{\"a", "{\"a\":", "{\"a\": -", "{\"a\": 1.", "{\"a\": 1e", "{\"a\": tr",
                         "{\"a\": [1, {\"b\"", "{\"a\": \"\\u00", "{\"a\": \"\xe2\x9c", "{\"a\":0"};
    for (size_t i = 0; i < sizeof pre / sizeof *pre; i++) expect(g, pre[i], -2);
    struct { const char *text; int at; } bad[] = {
        {"[]", 0}, {"\"a\"", 0}, {"1", 0}, {"x", 0}, {"{}}", 2}, {"{} ", 2}, {"{\"a\" 1}", 5}, {"{\"a\":}", 5},
        {"{\"a\":01}", 6}, {"{\"a\":1.}", 7}, {"{\"a\":-}", 6}, {"{\"a\":1e}", 7}, {"{\"a\":+1}", 5},
        {"{\"a\":.5}", 5}, {"{\"a\":tru}", 8}, {"{\"a\":nul1}", 8}, {"{a:1}", 1}, {"{\"a\":1,}", 7},
        {"{\"a\":[1,]}", 8}, {"{\"a\":[1}", 7}, {"{\"a\":{]}", 6}, {"{\"a\":\"\x01\"}", 6}, {"{\"a\":\"\\x\"}", 7},
        {"{\"a\":\"\\u12g4\"}", 10}, {"{\"a\":\"\xc0\xaf\"}", 6}, {"{\"a\":\"\xe0\x80\x80\"}", 7},
        {"{\"a\":\"\xed\xa0\x80\"}", 7}, {"{\"a\":\"\xf4\x90\x80\x80\"}", 7}, {"{\"a\":\"\xff\"}", 6},
        {"{\"a\":\"\xe2\x28\"}", 7}, {"{\"a\":1}x", 7}, {"{,}", 1}, {"{\"a\":1 2}", 7}, {"{\r\n}", 1}, {" \xf0", 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) expect(g, bad[i].text, bad[i].at);
    /* whitespace between tokens: nothing, a space, or a newline and 20 blanks; no limit in strings */
    expect(g, "{\n                    \"a\":1}", -1);
    expect(g, "{\n                     \"a\":1}", 22);
    expect(g, "{\n\n\"a\":1}", 2);
    expect(g, "{  \"a\":1}", 2);
    expect(g, "{\"a                                   \":1}", -1);
    expect(g, "  {}", 1);
    /* numbers: 16 digits before the point and after it, 3 in the exponent */
    expect(g, "{\"a\":-1234567890123456.1234567890123456e-123}", -1);
    expect(g, "{\"a\":12345678901234567}", 21);
    expect(g, "{\"a\":0.12345678901234567}", 23);
    expect(g, "{\"a\":1e1234}", 10);
    /* deep nesting is only stack: 500 arrays */
    char deep[1100];
    strcpy(deep, "{\"a\":");
    size_t n = strlen(deep);
    for (int i = 0; i < 500; i++) deep[n++] = '[';
    for (int i = 0; i < 500; i++) deep[n++] = ']';
    deep[n++] = '}';
    deep[n] = 0;
    expect(g, deep, -1);
    kvlm_grammar_free(g);
}

static void test_gbnf(void **state) {
    (void)state;
    kvlm_grammar *g = gbnf("# a greeting\n"
                           "root ::= greeting (\" \" name)? \"!\"{1,3} tail\n"
                           "greeting ::= \"hi\" | \"hello\"   # two ways\n"
                           "name ::= [A-Z] [a-z]*\n"
                           "tail ::= | \"\\n\" digits\n"
                           "digits ::= [0-9]{2,4}\n");
    const char *good[] = {"hi!", "hello Bob!!!", "hi Al!\n12", "hi!\n1234", "hello!!"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) expect(g, good[i], -1);
    expect(g, "hel", -2);
    expect(g, "hi B", -2);
    expect(g, "hi!\n1", -2);
    expect(g, "hi!!!!", 5);
    expect(g, "hi bob", 3);
    expect(g, "hey", 2);
    expect(g, "hi!\n12345", 8);
    expect(g, "hi!\n", -2);
    kvlm_grammar_free(g);

    /* classes: negated, escapes, '.', Unicode; alternatives continued on a line of their own */
    g = gbnf("root ::= item (\",\" item)*\n"
             "item ::= [a-z ]+\n"
             "     | \"\\\"\" ( [^\"\\\\] | \"\\\\\" . )* \"\\\"\"\n"
             "     | [\\u00e9-\\u00ea] \"\\x41\" \"\xe2\x9c\x93\"\n");
    expect(g, "a,b c,\"x,y\"", -1);
    expect(g, "\"\\\"q\\\"\"", -1);
    expect(g, "\xc3\xa9" "A\xe2\x9c\x93", -1);
    expect(g, "\xc3\xaa" "A\xe2\x9c", -2);
    expect(g, "\xc3\xab", 1); /* U+00EB: past the range at its second byte */
    expect(g, "a,,", 2);
    kvlm_grammar_free(g);
    /* a code point begun lives while some class can take what it may become */
    g = gbnf("root ::= [a-z] | [\\u0100-\\u0200]\n");
    expect(g, "\xc4", -2);
    expect(g, "\xc4\x80", -1);
    expect(g, "\xc3", 0);
    expect(g, "\xf0", 0);
    expect(g, "\xe0", 0);
    expect(g, "\xc8\x81", 1);
    expect(g, "a\n", 1);
    kvlm_grammar_free(g);

    /* {m}, {m,}, nested groups, a rule used before its definition */
    g = gbnf("root ::= (ab \"-\"){2} x{1,}\nab ::= \"a\" | \"b\"\nx ::= ( \"x\" | \"y\" \"z\"? )\n");
    expect(g, "a-b-x", -1);
    expect(g, "a-b-xyzyx", -1);
    expect(g, "a-b-", -2);
    expect(g, "a-b-c", 4);
    expect(g, "a-", -2);
    kvlm_grammar_free(g);
    /* a star over what can be empty: a cycle of references that end their alternatives,
     * which the matcher only comes back around (not left recursion) */
    g = gbnf("root ::= (\"a\"*)* \"b\" ((\"c\"? \"d\"?)+)\n");
    expect(g, "b", -1);
    expect(g, "aab", -1);
    expect(g, "aabcdcdd", -1);
    expect(g, "aac", 2);
    expect(g, "ba", 1);
    kvlm_grammar_free(g);
    g = gbnf("root ::= a \"!\"\na ::= a | \"x\"\n");
    expect(g, "x!", -1);
    expect(g, "xx", 1);
    kvlm_grammar_free(g);
    /* another start rule */
    kvlm_error err = {0};
    g = kvlm_grammar_from_gbnf(NULL, "root ::= \"a\"\nother ::= \"b\"+\n", "other", &err);
    assert_non_null(g);
    expect(g, "bbb", -1);
    expect(g, "a", 0);
    kvlm_grammar_free(g);
}

static void test_gbnf_errors(void **state) {
    (void)state;
    struct { const char *text, *want; } bad[] = {
        {"root ::= foo", "line 1, column 10: rule 'foo' is used but not defined"},
        {"a ::= \"x\"", "no rule 'root'"},
        {"root ::= root \"x\" | \"y\"", "rule 'root' is left-recursive"},
        {"root ::= a\na ::= b? root \"x\"\nb ::= \"y\"", "left-recursive"},
        {"root ::= x\nx ::= (\"a\" | x) \"b\"", "a group or repetition in rule 'x' is left-recursive"},
        {"root ::= root", "rule 'root' matches no text"},
        {"root ::= \"x\" a\na ::= b\nb ::= a", "rule 'a' matches no text"},
        {"root ::= \"abc", "line 1, column 10: unterminated string"},
        {"root ::= \"a\"\nroot ::= \"b\"", "line 2, column 1: rule 'root' is defined twice"},
        {"root ::= * \"a\"", "a repetition with nothing before it"},
        {"root ::= [z-a]", "end is before its start"},
        {"root ::= \"\\q\"", "unknown escape"},
        {"root ::= \"a\"{3,1}", "at least the minimum"},
        {"root ::= \"a\"{100000}", "over 65536"},
        {"root ::= (\"a\"", "expected ')'"},
        {"root = \"a\"", "expected '::='"},
        {"root ::= \"a\" )", "unexpected character"},
        {"", "no rule 'root'"},
        {"root ::= \"\xff\"", "invalid UTF-8"},
    };
    /* too big, too ambiguous */
    size_t cap = 70000 * 6 + 64;
    char *big = malloc(cap);
    char *q = big + sprintf(big, "root ::= \"a\"");
    for (int i = 0; i < 70000; i++) q += sprintf(q, " | \"a\"");
    kvlm_error err = {0};
    assert_null(kvlm_grammar_from_gbnf(NULL, big, NULL, &err));
    assert_non_null(strstr(err.msg, "too ambiguous"));
    /* nested repetitions refer to rules (small), but "a" splits among a million parses */
    strcpy(big, "root ::= ((\"a\"{0,1000}){0,1000}){0,1000}");
    assert_null(kvlm_grammar_from_gbnf(NULL, big, NULL, &err));
    assert_non_null(strstr(err.msg, "too ambiguous"));
    kvlm_grammar *small = kvlm_grammar_from_gbnf(NULL, "root ::= ((\"a\"{0,10}){0,10}){0,10}", NULL, &err);
    assert_non_null(small);
    expect(small, "aaaa", -1);
    kvlm_grammar_free(small);
    /* copies of a repetition's minimum are elements */
    q = big + sprintf(big, "root ::=");
    for (int i = 0; i < 20; i++) q += sprintf(q, " \"a\"{60000}");
    assert_null(kvlm_grammar_from_gbnf(NULL, big, NULL, &err));
    assert_non_null(strstr(err.msg, "too large"));
    free(big);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kvlm_error err = {0};
        kvlm_grammar *g = kvlm_grammar_from_gbnf(NULL, bad[i].text, NULL, &err);
        if (g) fail_msg("'%s' was taken", bad[i].text);
        if (!strstr(err.msg, bad[i].want)) fail_msg("'%s': '%s', want '%s'", bad[i].text, err.msg, bad[i].want);
        assert_int_equal(err.code, KVLM_EINVAL);
    }
}

static void test_schema(void **state) {
    (void)state;
    kvlm_grammar *g = schema("{\"type\": \"object\", \"properties\": {"
                             "\"name\": {\"type\": \"string\", \"maxLength\": 5, \"title\": \"Name\"},"
                             "\"age\": {\"type\": \"integer\", \"minimum\": 0},"
                             "\"tags\": {\"type\": \"array\", \"items\": {\"enum\": [\"a\", \"b\"]}, \"maxItems\": 2}},"
                             "\"required\": [\"name\"], \"description\": \"a person\"}");
    const char *good[] = {"{\"name\":\"Al\"}", "{\"name\":\"Al\",\"age\":3}", "{\"name\": \"Al\", \"tags\": [\"a\", \"b\"]}",
                          "{\n \"name\": \"x\",\n \"age\": 0,\n \"tags\": []\n}", "{\"name\":\"\",\"age\":120}"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) expect(g, good[i], -1);
    expect(g, "{\"name\":\"toolong\"}", 14);
    expect(g, "{\"age\":3}", 2);
    expect(g, "{\"name\":\"a\",\"age\":-1}", 18);
    expect(g, "{\"name\":\"a\",\"age\":01}", 19);
    expect_refused(g, "{\"name\":\"a\",\"tags\":[\"c\"]}");
    expect(g, "{\"name\":\"a\",\"tags\":[\"a\",\"b\",\"a\"]}", 27);
    expect_refused(g, "{\"name\":\"a\",\"x\":1}");
    expect_refused(g, "{\"name\":\"a\",\"tags\":[],\"age\":1}"); /* the schema's order */
    expect(g, "{}", 1);
    kvlm_grammar_free(g);

    /* a tree through a recursive $ref */
    g = schema("{\"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\"v\": {\"type\": \"integer\"},"
               "\"kids\": {\"type\": \"array\", \"items\": {\"$ref\": \"#/$defs/node\"}}}, \"required\": [\"v\"]}},"
               "\"$ref\": \"#/$defs/node\"}");
    expect(g, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":-3,\"kids\":[{\"v\":4,\"kids\":[]}]}]}", -1);
    expect_refused(g, "{\"v\":1,\"kids\":[{}]}");
    kvlm_grammar_free(g);

    g = schema("{\"anyOf\": [{\"type\": \"null\"}, {\"type\": \"number\"}]}");
    expect(g, "null", -1);
    expect(g, "-1.5e3", -1);
    expect(g, "true", 0);
    kvlm_grammar_free(g);
    g = schema("{\"type\": [\"string\", \"null\"]}");
    expect(g, "\"x\"", -1);
    expect(g, "null", -1);
    expect(g, "1", 0);
    kvlm_grammar_free(g);
    g = schema("{\"const\": {\"a\": [1, \"x\"]}}");
    expect(g, "{\"a\":[1,\"x\"]}", -1);
    expect(g, "{\"a\": [1,\"x\"]}", 5);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"format\": \"date\"}");
    expect(g, "\"2024-02-29\"", -1);
    expect(g, "\"2024-13-01\"", 7);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"format\": \"date-time\"}");
    expect(g, "\"2024-02-29T23:59:60Z\"", 18);
    expect(g, "\"2024-02-29T23:59:59.125+01:00\"", -1);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"format\": \"uuid\"}");
    expect(g, "\"123e4567-e89b-12d3-a456-426614174000\"", -1);
    expect(g, "\"123e4567e89b\"", 9);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"object\", \"additionalProperties\": {\"type\": \"boolean\"}}");
    expect(g, "{\"x\":true, \"y\": false}", -1);
    expect(g, "{\"x\":1}", 5);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"object\", \"properties\": {\"a\": {}, \"b\": {}}, \"additionalProperties\": false}");
    expect(g, "{}", -1);
    expect(g, "{\"b\":[1]}", -1);
    expect(g, "{\"a\":{\"z\":null},\"b\":2}", -1);
    expect(g, "{\"b\":1,\"a\":2}", 6);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"array\", \"items\": {\"type\": \"integer\"}, \"minItems\": 2, \"maxItems\": 3}");
    expect(g, "[1,2]", -1);
    expect(g, "[1, 2, 3]", -1);
    expect(g, "[1]", 2);
    expect(g, "[]", 1);
    expect(g, "[1,2,3,4]", 6);
    kvlm_grammar_free(g);
    /* tuples: prefixItems, then items (or nothing more: items false) */
    g = schema("{\"type\": \"array\", \"prefixItems\": [{\"type\": \"integer\"}, {\"type\": \"string\"}],"
               "\"minItems\": 2, \"maxItems\": 2}");
    expect(g, "[1, \"a\"]", -1);
    expect(g, "[1]", 2);
    expect(g, "[\"a\", 1]", 1);
    expect(g, "[1,\"a\",2]", 6);
    kvlm_grammar_free(g);
    g = schema("{\"prefixItems\": [{\"const\": \"x\"}], \"items\": {\"type\": \"boolean\"}}");
    expect(g, "[]", -1);
    expect(g, "[\"x\"]", -1);
    expect(g, "[\"x\", true, false]", -1);
    expect(g, "[true]", 1);
    kvlm_grammar_free(g);
    g = schema("{\"prefixItems\": [{\"type\": \"null\"}, {\"type\": \"null\"}], \"items\": false, \"minItems\": 1}");
    expect(g, "[null]", -1);
    expect(g, "[null,null]", -1);
    expect(g, "[]", 1);
    expect(g, "[null,null,null]", 10);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"minLength\": 2, \"maxLength\": 3}");
    expect(g, "\"ab\"", -1);
    expect(g, "\"\\u00e9\xc3\xa9x\"", -1);
    expect(g, "\"a\"", 2);
    expect(g, "\"abcd\"", 4);
    kvlm_grammar_free(g);
    /* integer bounds: every integer near each range is taken exactly when inside it */
    struct { const char *schema; long lo, hi; } ranges[] = {
        {"{\"type\": \"integer\", \"minimum\": -20, \"maximum\": 123}", -20, 123},
        {"{\"type\": \"integer\", \"minimum\": 1, \"maximum\": 5}", 1, 5},
        {"{\"type\": \"integer\", \"exclusiveMinimum\": -1, \"maximum\": 999}", 0, 999},
        {"{\"type\": \"integer\", \"minimum\": -105, \"exclusiveMaximum\": -6.5}", -105, -7},
        {"{\"type\": \"integer\", \"minimum\": 37.2, \"maximum\": 1234}", 38, 1234},
        {"{\"type\": \"integer\", \"minimum\": 90}", 90, 100000},
        {"{\"type\": \"integer\", \"maximum\": -3}", -100000, -3},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof *ranges; i++) {
        g = schema(ranges[i].schema);
        long from = ranges[i].lo < -1000 ? -1500 : ranges[i].lo - 150, to = ranges[i].hi > 10000 ? 1500 : ranges[i].hi + 150;
        for (long x = from; x <= to; x++) {
            char t[32];
            snprintf(t, sizeof t, "%ld", x);
            bool in = x >= ranges[i].lo && x <= ranges[i].hi;
            if ((run(g, t, 1 << 20, 0) == -1) != in) fail_msg("%s: %ld %s", ranges[i].schema, x, in ? "refused" : "taken");
        }
        kvlm_grammar_free(g);
    }
    /* number bounds: every decimal of up to 3 fraction digits (and trailing
     * zeros) near each range, taken exactly when inside it, in thousandths */
    struct { const char *schema; long lo, hi; bool lx, hx; } nums[] = {
        {"{\"type\": \"number\", \"minimum\": 0, \"maximum\": 1}", 0, 1000, false, false},
        {"{\"type\": \"number\", \"exclusiveMinimum\": -1.5, \"maximum\": 2.25}", -1500, 2250, true, false},
        {"{\"type\": \"number\", \"minimum\": 0.1}", 100, LONG_MAX, false, false},
        {"{\"type\": \"number\", \"exclusiveMaximum\": -0.25}", LONG_MIN, -250, false, true},
        {"{\"type\": \"number\", \"minimum\": -3, \"exclusiveMaximum\": 3}", -3000, 3000, false, true},
        {"{\"type\": \"number\", \"minimum\": 1.5, \"maximum\": 1.5}", 1500, 1500, false, false},
        {"{\"type\": \"number\", \"minimum\": 10.125, \"maximum\": 12, \"exclusiveMaximum\": 11.999}", 10125, 11999, false, true},
        {"{\"type\": \"number\", \"exclusiveMinimum\": 0, \"exclusiveMaximum\": 0.01}", 0, 10, true, true},
        {"{\"type\": \"number\", \"minimum\": -0.75, \"maximum\": -0.125}", -750, -125, false, false},
    };
    for (size_t i = 0; i < sizeof nums / sizeof *nums; i++) {
        g = schema(nums[i].schema);
        int n_in = 0;
        for (long x = -14000; x <= 14000; x += (labs(x) < 3000 ? 1 : 7)) {
            for (int form = 0; form < 4; form++) { /* 0: shortest, 1: 3 digits, 2: a trailing zero, 3: one digit (x % 100 == 0) */
                long a = labs(x);
                char t[48];
                if (form == 0) {
                    int nd = a % 1000 == 0 ? 0 : a % 100 == 0 ? 1 : a % 10 == 0 ? 2 : 3;
                    long f = a % 1000;
                    if (nd == 0) snprintf(t, sizeof t, "%s%ld", x < 0 ? "-" : "", a / 1000);
                    else snprintf(t, sizeof t, "%s%ld.%0*ld", x < 0 ? "-" : "", a / 1000, nd, nd == 1 ? f / 100 : nd == 2 ? f / 10 : f);
                } else if (form == 1) snprintf(t, sizeof t, "%s%ld.%03ld", x < 0 ? "-" : "", a / 1000, a % 1000);
                else if (form == 2) snprintf(t, sizeof t, "%s%ld.%03ld0", x < 0 ? "-" : "", a / 1000, a % 1000);
                else if (a % 100 == 0) snprintf(t, sizeof t, "%s%ld.%ld", x < 0 ? "-" : "", a / 1000, (a % 1000) / 100);
                else continue;
                if (x == 0 && form == 0 && x < 0) continue;
                bool in = (nums[i].lx ? x > nums[i].lo : x >= nums[i].lo) && (nums[i].hx ? x < nums[i].hi : x <= nums[i].hi);
                n_in += in;
                if ((run(g, t, 1 << 20, 0) == -1) != in) fail_msg("%s: %s %s", nums[i].schema, t, in ? "refused" : "taken");
            }
        }
        assert_true(n_in > 0);
        kvlm_grammar_free(g);
    }
    g = schema("{\"type\": \"number\", \"minimum\": 0, \"maximum\": 1}");
    expect(g, "1e-3", 1);   /* no exponents between bounds */
    expect(g, "-0", 0);     /* nor a negative zero */
    expect(g, "0.0000000000000001", -1);
    expect(g, "01", 1);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"number\", \"maximum\": 0.1, \"minimum\": 0.1}");
    expect(g, "0.1", -1);
    expect(g, "0.10000", -1);
    expect(g, "0.10000000000000001", 18); /* past 16 fraction digits */
    kvlm_grammar_free(g);
    /* multipleOf: whole multiples by the remainder automaton, every integer
     * near 0 taken exactly when a multiple; powers of ten as fraction digits */
    const int ks[] = {2, 3, 7, 10, 25, 360, 97, 1000};
    for (size_t i = 0; i < sizeof ks / sizeof *ks; i++) {
        char sch[96];
        snprintf(sch, sizeof sch, "{\"type\": \"%s\", \"multipleOf\": %d}", i % 2 ? "number" : "integer", ks[i]);
        g = schema(sch);
        for (long x = -2000; x <= 2000; x++) {
            char t[32];
            snprintf(t, sizeof t, "%ld", x);
            if ((run(g, t, 1 << 20, 0) == -1) != (x % ks[i] == 0)) fail_msg("%s: %ld", sch, x);
        }
        expect(g, "-0", 1);
        kvlm_grammar_free(g);
    }
    g = schema("{\"type\": \"integer\", \"multipleOf\": 7}"); /* at most 16 digits, as every integer */
    expect(g, "1000000000000001", -1);   /* 7 x 142857142857143 */
    expect(g, "10000000000000003", 15); /* its 16 digits 1000000000000000 are no multiple, and 17 are too many */
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"number\", \"multipleOf\": 0.01}");
    expect(g, "12.34", -1);
    expect(g, "-0.5", -1);
    expect(g, "7", -1);
    expect(g, "0.125", 4);
    expect(g, "1e2", 1);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"number\", \"multipleOf\": 0.01, \"minimum\": 0.005, \"exclusiveMaximum\": 0.5}");
    expect(g, "0.01", -1);
    expect(g, "0.49", -1);
    expect(g, "0", -2);     /* not yet: 0.01 may follow */
    expect(g, "0.00", 3);
    expect(g, "0.5", 2);
    expect(g, "0.015", 4);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"number\", \"multipleOf\": 1, \"maximum\": 3}");
    expect(g, "3", -1);
    expect(g, "-12", -1);
    expect(g, "2.5", 1);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"integer\", \"minimum\": 1, \"maximum\": 5}");
    expect(g, "05", 0);
    expect(g, "-0", 0);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"integer\", \"minimum\": -9}");
    expect(g, "-0", 1);
    expect(g, "1234567890123456", -1);
    expect(g, "12345678901234567", 16);
    kvlm_grammar_free(g);
    /* patterns: anchored or matched anywhere, classes, shorthands, groups, escapes */
    g = schema("{\"type\": \"string\", \"pattern\": \"^[A-Z]{3}-\\\\d{2,4}$\"}");
    expect(g, "\"ABC-123\"", -1);
    expect(g, "\"AB-12\"", 3);
    expect(g, "\"ABC-12345\"", 9);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"pattern\": \"ab\"}");
    expect(g, "\"xxabyy\"", -1);
    expect(g, "\"ab\"", -1);
    expect(g, "\"a\"", 2);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"pattern\": \"^(?:cat|dog)s?$\"}");
    expect(g, "\"cats\"", -1);
    expect(g, "\"dog\"", -1);
    expect(g, "\"cow\"", 2);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"pattern\": \"^a\\\\.[^x\\\\s]\\\\w+ say \\\"hi\\\"\\\\\\\\$\"}");
    expect(g, "\"a.b_9 say \\\"hi\\\"\\\\\"", -1);
    expect(g, "\"axb\"", 2);
    expect(g, "\"a.x\"", 3);
    expect(g, "\"a. \"", 3);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"pattern\": \"^.{2}$\"}");
    expect(g, "\"\xc3\xa9z\"", -1);
    expect(g, "\"a\\n\"", 2);
    kvlm_grammar_free(g);
    /* a star over what can match nothing, a valid ECMA-262 pattern */
    g = schema("{\"type\": \"string\", \"pattern\": \"^(a*)*$\"}");
    expect(g, "\"\"", -1);
    expect(g, "\"aaaa\"", -1);
    expect(g, "\"ab\"", 2);
    kvlm_grammar_free(g);
    g = schema("{\"type\": \"string\", \"pattern\": \"^(?:a|b?)+c(d*|e)*$\"}");
    expect(g, "\"c\"", -1);
    expect(g, "\"abbacdde\"", -1);
    expect(g, "\"ad\"", 2);
    kvlm_grammar_free(g);
    g = schema("true");
    expect(g, "[1, {\"a\": \"b\"}]", -1);
    kvlm_grammar_free(g);

    struct { const char *text, *want; } bad[] = {
        {"{\"type\": \"array\", \"uniqueItems\": true}", "json_schema at the root: 'uniqueItems' is not supported"},
        {"{\"type\": \"string\", \"pattern\": \"(?=a)b\"}", "'pattern': lookaround is not supported"},
        {"{\"type\": \"string\", \"pattern\": \"(a)\\\\1\"}", "'pattern': back-references"},
        {"{\"type\": \"string\", \"pattern\": \"a**\"}", "a quantifier on a quantifier"},
        {"{\"type\": \"string\", \"pattern\": \"[z-a]\"}", "end is before its start"},
        {"{\"type\": \"string\", \"pattern\": \"a^b\"}", "only at the ends"},
        {"{\"type\": \"string\", \"pattern\": \"(ab\"}", "without its ')'"},
        {"{\"type\": \"string\", \"pattern\": \"[\\\"]\"}", "nothing a JSON string holds unescaped"},
        {"{\"type\": \"string\", \"pattern\": \"a\", \"maxLength\": 3}", "'pattern' beside"},
        {"{\"properties\": {\"n\": {\"type\": \"number\", \"minimum\": 3, \"exclusiveMaximum\": 3}}}", "at /properties/n: no number lies between its bounds"},
        {"{\"type\": \"number\", \"maximum\": 1e-20}", "'maximum' needs more than 16 digits"},
        {"{\"type\": \"number\", \"multipleOf\": 0.25}", "'multipleOf' other than a power of ten"},
        {"{\"type\": \"integer\", \"multipleOf\": 101}", "'multipleOf' other than a power of ten"},
        {"{\"type\": \"integer\", \"multipleOf\": 5, \"minimum\": 0}", "'multipleOf' a whole number beside bounds"},
        {"{\"multipleOf\": 5}", "'multipleOf' is supported in a schema of type number or integer"},
        {"{\"type\": \"integer\", \"multipleOf\": 0}", "'multipleOf' must be a number above 0"},
        {"{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 4}", "no integer lies between its bounds"},
        {"{\"type\": \"integer\", \"minimum\": 1e20}", "past 16 digits"},
        {"{\"properties\": {\"y\": {}}, \"required\": [\"x\"]}", "required 'x' is not among the properties"},
        {"{\"$ref\": \"#/nope\"}", "names nothing"},
        {"{\"$ref\": \"http://x/y\"}", "only local references"},
        {"{", "json_schema: line 1, column 1"},
        {"{\"type\": \"objekt\"}", "unknown type 'objekt'"},
        {"{\"properties\": {\"a\": {}}, \"additionalProperties\": true}", "'additionalProperties' beside 'properties'"},
        {"false", "matches nothing"},
        {"{\"allOf\": [{}, {}]}", "'allOf' of more than one"},
        {"{\"enum\": []}", "'enum' must be a non-empty array"},
        {"{\"type\": \"array\", \"minItems\": 3, \"maxItems\": 2}", "'minItems' is above 'maxItems'"},
        {"{\"prefixItems\": [{}], \"items\": false, \"minItems\": 2}", "'minItems' is above the items"},
        {"{\"prefixItems\": []}", "'prefixItems' must be an array of 1 to 64"},
        {"{\"type\": \"array\", \"maxItems\": -1}", "'maxItems' must be an integer"},
        {"[1]", "a schema must be an object or a boolean"},
        /* $ref cycles with no object or array between: they could never end */
        {"{\"$ref\": \"#/$defs/a\", \"$defs\": {\"a\": {\"$ref\": \"#/$defs/a\"}}}",
         "json_schema at #/$defs/a: '$ref' '#/$defs/a' comes back to itself with no object or array between"},
        {"{\"$ref\": \"#/$defs/a\", \"$defs\": {\"a\": {\"anyOf\": [{\"$ref\": \"#/$defs/b\"}, {\"type\": \"null\"}]}, "
         "\"b\": {\"allOf\": [{\"$ref\": \"#/$defs/a\"}]}}}", "json_schema at #/$defs/b/0: '$ref' '#/$defs/a' comes back"},
        {"{\"$ref\": \"#\"}", "'$ref' '#' comes back to itself"},
        {"{\"properties\": {\"x\": {\"$ref\": \"#/$defs/a\"}}, \"$defs\": {\"a\": {\"$ref\": \"#/$defs/a\"}}}",
         "'$ref' '#/$defs/a' comes back"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        kvlm_error err = {0};
        kvlm_grammar *x = kvlm_grammar_from_json_schema(NULL, bad[i].text, &err);
        if (x) fail_msg("'%s' was taken", bad[i].text);
        if (!strstr(err.msg, bad[i].want)) fail_msg("'%s': '%s', want '%s'", bad[i].text, err.msg, bad[i].want);
    }
    /* the GBNF text itself, for a person to read */
    kvlm_error err = {0};
    char *text = kvlm_json_schema_to_gbnf("{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"boolean\"}}}", &err);
    assert_non_null(text);
    assert_non_null(strstr(text, "root ::= ws "));
    assert_non_null(strstr(text, "\"\\\"a\\\"\" ws \":\" ws"));
    free(text);
}

/* On a real vocabulary: after each of a few prefixes, a token is allowed
 * exactly when a fresh matcher takes the prefix and then its text (an end
 * token: when the prefix is complete). */
static void check_mask(const kvlm_model *m, const kvlm_grammar *g, const char *const *prefixes, int np) {
    int nv = kvlm_vocab_size(m);
    bool *allowed = malloc((size_t)nv);
    for (int p = 0; p < np; p++) {
        gm *s = gm_new(g);
        assert_true(gm_feed(s, prefixes[p], (int)strlen(prefixes[p])));
        int n = gm_allowed(s, allowed), count = 0;
        for (int t = 0; t < nv; t++) {
            char buf[300];
            int k = kvlm_token_to_text(m, t, buf, sizeof buf);
            bool want;
            if (kvlm_token_is_eog(m, t)) want = gm_done(s);
            else if (k <= 0) want = false;
            else {
                gm *f = gm_new(g);
                want = gm_feed(f, prefixes[p], (int)strlen(prefixes[p])) && gm_feed(f, buf, k);
                gm_free(f);
            }
            if (allowed[t] != want) fail_msg("after '%s', token %d ('%.*s'): allowed %d", prefixes[p], t, k, buf, allowed[t]);
            count += want;
        }
        assert_int_equal(n, count);
        /* the token fed moves the matcher as its bytes do */
        print_message("  after '%s': %d of %d tokens allowed\n", prefixes[p], n, nv);
        gm_free(s);
    }
    free(allowed);
}

static void test_mask(void **state) {
    (void)state;
    const char *names[] = {"stories260K.gguf", "stories4M_hd64.gguf"};
    int ran = 0;
    for (int i = 0; i < 2; i++) {
        const char *path = tu_model_path(names[i]);
        if (!path) continue;
        kvlm_error err = {0};
        kvlm_model *m = kvlm_model_load(path, NULL, &err);
        assert_non_null(m);
        kvlm_grammar *g = kvlm_grammar_from_json_schema(m, "{\"type\": \"object\"}", &err);
        assert_non_null(g);
        const char *pre[] = {"", " {", "{\"a\": ", "{\"name\": \"Li", "{\"n\": 1", "{\"x\": [tr", "{}", "{\"a\": \"\xe2\x9c"};
        check_mask(m, g, pre, (int)(sizeof pre / sizeof *pre));
        kvlm_grammar_free(g);
        g = kvlm_grammar_from_json_schema(m, "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\","
                                          "\"maxLength\": 4}, \"n\": {\"enum\": [1, 22, 333]}}}", &err);
        assert_non_null(g);
        const char *pre2[] = {"", "{", "{\"name\": \"ab", "{\"name\": \"abcd", "{\"n\": 2", "{\"n\": 22"};
        check_mask(m, g, pre2, (int)(sizeof pre2 / sizeof *pre2));
        kvlm_grammar_free(g);
        kvlm_model_free(m);
        ran++;
    }
    TU_REQUIRE(ran ? "" : NULL);
}

/* The sampler draws only what the grammar allows: from random logits, at
 * temperature 1 and greedy, the text of the tokens drawn stays in the
 * language, ends complete when an end token is drawn, and greedy takes the
 * most likely allowed token. */
static void test_sampler(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    int nv = kvlm_vocab_size(m);
    kvlm_grammar *g = kvlm_grammar_from_json_schema(m, "{\"type\": \"object\", \"properties\": {\"ok\": {\"type\": "
                                                    "\"boolean\"}, \"list\": {\"type\": \"array\", \"items\": "
                                                    "{\"type\": \"integer\"}, \"maxItems\": 3}}, \"required\": [\"ok\"]}", &err);
    assert_non_null(g);
    float *logits = malloc((size_t)nv * sizeof *logits);
    bool *allowed = malloc((size_t)nv);
    uint64_t rs = 7;
    int ended = 0;
    for (int run = 0; run < 40; run++) {
        kvlm_sampler_params p = kvlm_sampler_default_params();
        p.temperature = run % 4 == 3 ? 0 : 1.0f;
        p.top_k = 0;
        p.top_p = 1;
        p.min_p = 0;
        p.seed = (uint64_t)run;
        p.grammar = g;
        kvlm_sampler *s = kvlm_sampler_create(&p, nv);
        assert_non_null(s);
        gm *ref = gm_new(g);
        char text[4096];
        size_t len = 0;
        for (int step = 0; step < 200; step++) {
            tu_fill_random(logits, (size_t)nv, &rs, 4.0f);
            if (p.temperature == 0) gm_allowed(ref, allowed);
            int32_t t = kvlm_sampler_sample(s, logits);
            if (p.temperature == 0) {
                int best = -1;
                for (int i = 0; i < nv; i++)
                    if (allowed[i] && (best < 0 || logits[i] > logits[best])) best = i;
                assert_int_equal(t, best);
            }
            if (kvlm_token_is_eog(m, t)) {
                if (!gm_done(ref)) fail_msg("run %d: an end token after '%.*s'", run, (int)len, text);
                ended++;
                break;
            }
            char buf[300];
            int k = kvlm_token_to_text(m, t, buf, sizeof buf);
            assert_true(k > 0);
            if (!gm_feed_token(ref, t)) fail_msg("run %d: token %d ('%.*s') after '%.*s'", run, t, k, buf, (int)len, text);
            if (len + (size_t)k < sizeof text) {
                memcpy(text + len, buf, (size_t)k);
                len += (size_t)k;
            }
        }
        gm_free(ref);
        kvlm_sampler_free(s);
    }
    print_message("  %d of 40 draws closed their object\n", ended);
    assert_true(ended > 0);
    /* the sampler holds its own reference: the grammar may go first */
    kvlm_sampler_params p = kvlm_sampler_default_params();
    kvlm_grammar *g2 = kvlm_grammar_from_gbnf(m, "root ::= \"yes\" | \"no\"", NULL, &err);
    p.grammar = g2;
    kvlm_sampler *s = kvlm_sampler_create(&p, nv);
    kvlm_grammar_free(g2);
    tu_fill_random(logits, (size_t)nv, &rs, 4.0f);
    int32_t t = kvlm_sampler_sample(s, logits);
    char buf[300];
    int k = kvlm_token_to_text(m, t, buf, sizeof buf);
    assert_true(k > 0 && (buf[0] == 'y' || buf[0] == 'n'));
    kvlm_sampler_free(s);
    kvlm_grammar_free(g);
    free(logits);
    free(allowed);
    kvlm_model_free(m);
}

/* ---- lazy grammars ---- */

static kvlm_grammar *lazy(const kvlm_model *m, const char *text, const char *const *words, const bool *at_start, int n) {
    kvlm_grammar_trigger tr[8];
    for (int i = 0; i < n; i++) tr[i] = (kvlm_grammar_trigger){words[i], at_start ? at_start[i] : false};
    kvlm_grammar_opts o = {.triggers = tr, .n_triggers = n, .special = true};
    kvlm_error err = {0};
    kvlm_grammar *g = kvlm_grammar_compile(m, text, &o, &err);
    if (!g) fail_msg("'%s': %s", text, err.msg);
    return g;
}

/* The reference a lazy matcher is held to, written apart from it: the first
 * trigger in the whole text (an at_start one only after blanks), and a plain
 * matcher of the same grammar over the text from there. 1: taken, complete;
 * 0: taken; -1: refused. */
static int lazy_ref(const kvlm_grammar *plain, const char *text, size_t n, const char *const *words,
                    const bool *at_start, int nw) {
    size_t best = n + 1;
    for (int w = 0; w < nw; w++) {
        size_t l = strlen(words[w]);
        for (size_t p = 0; p + l <= n && p < best; p++) {
            if (memcmp(text + p, words[w], l)) continue;
            bool ok = true;
            for (size_t k = 0; at_start && at_start[w] && k < p; k++) ok &= strchr(" \n\t\r", text[k]) != NULL;
            if (ok) best = p;
            break;
        }
    }
    if (best > n) return 1; /* free text */
    gm *r = gm_new(plain);
    bool ok = gm_feed(r, text + best, (int)(n - best));
    int res = ok ? (gm_done(r) ? 1 : 0) : -1;
    gm_free(r);
    return res;
}

static void test_lazy(void **state) {
    (void)state;
    const char *gr = "root ::= \"<call>\" [a-z]+ \"</call>\"";
    const char *w1[] = {"<call>"};
    kvlm_grammar *g = lazy(NULL, gr, w1, NULL, 1), *plain = gbnf(gr);
    assert_true(kvlm_grammar_is_lazy(g));
    assert_false(kvlm_grammar_is_lazy(plain));
    static const char *const texts[] = {"hello world", "hello <call>abc</call>", "hello <cal", "<call>ab1", "x <call></call>",
                                        "<<call>abc</call>", "a <call>b</call> c", "<call", "<call>a</call><call>"};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        size_t n = strlen(texts[i]);
        int want = lazy_ref(plain, texts[i], n, w1, NULL, 1);
        for (int piece = 1; piece <= 3; piece++) { /* the word cut across pieces */
            gm *m = gm_new(g);
            bool ok = true;
            for (size_t at = 0; at < n && ok; at += (size_t)piece)
                ok = gm_feed(m, texts[i] + at, (int)(n - at < (size_t)piece ? n - at : (size_t)piece));
            int got = ok ? (gm_done(m) ? 1 : 0) : -1;
            if (got != want) fail_msg("'%s' in pieces of %d: %d, expected %d", texts[i], piece, got, want);
            gm_free(m);
        }
    }
    kvlm_grammar_free(g);
    kvlm_grammar_free(plain);
    /* at_start: "{" counts only after blanks */
    const char *gj = "root ::= \"{\" [a-z]* \"}\"";
    const char *w2[] = {"{"};
    bool st[] = {true};
    g = lazy(NULL, gj, w2, st, 1);
    plain = gbnf(gj);
    static const char *const t2[] = {"  {ab}", "{ab", "a {1", "{1", " \n{}"};
    for (size_t i = 0; i < sizeof t2 / sizeof *t2; i++) {
        gm *m = gm_new(g);
        bool ok = gm_feed(m, t2[i], (int)strlen(t2[i]));
        int got = ok ? (gm_done(m) ? 1 : 0) : -1, want = lazy_ref(plain, t2[i], strlen(t2[i]), w2, st, 1);
        if (got != want) fail_msg("'%s': %d, expected %d", t2[i], got, want);
        gm_free(m);
    }
    kvlm_grammar_free(g);
    kvlm_grammar_free(plain);
    /* refused: a word the grammar does not start with, an empty one */
    kvlm_error err = {0};
    kvlm_grammar_trigger bad[] = {{"<cell>", false}};
    kvlm_grammar_opts o = {.triggers = bad, .n_triggers = 1};
    assert_null(kvlm_grammar_compile(NULL, gr, &o, &err));
    assert_non_null(strstr(err.msg, "'<cell>' is not how its text can begin"));
    bad[0].word = "";
    assert_null(kvlm_grammar_compile(NULL, gr, &o, &err));
    assert_non_null(strstr(err.msg, "trigger 0 has 0 bytes"));
}

/* On stories260K's tokens: waiting for "and" (a word inside many tokens:
 * " and", "hand", "andy"), a token is allowed exactly when the reference
 * takes the text so far and then its text; the sampler draws by it. */
static void test_lazy_mask(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    int nv = kvlm_vocab_size(m);
    const char *gr = "root ::= \"and\" ( \" \" [a-z]+ )? \".\"";
    const char *words[] = {"and"};
    kvlm_grammar *g = lazy(m, gr, words, NULL, 1), *plain = kvlm_grammar_from_gbnf(m, gr, NULL, &err);
    bool *allowed = malloc((size_t)nv);
    static const char *const pre[] = {"", "Once upon a time", "The dog h", "a", "an", "The boy an", "The c", "and th"};
    int refused = 0;
    for (size_t p = 0; p < sizeof pre / sizeof *pre; p++) {
        gm *s = gm_new(g);
        size_t pl = strlen(pre[p]);
        assert_true(gm_feed(s, pre[p], (int)pl));
        int n = gm_allowed(s, allowed), count = 0;
        for (int t = 0; t < nv; t++) {
            char buf[300], text[400];
            int k = kvlm_token_to_text(m, t, buf, sizeof buf);
            if (!k) k = tok_token_to_bytes(m->tok, t, true, buf, sizeof buf); /* a special token's text (the grammar allows them) */
            bool want;
            if (kvlm_token_is_eog(m, t)) want = gm_done(s);
            else if (k <= 0) want = true; /* free text: a token without text too */
            else {
                memcpy(text, pre[p], pl);
                memcpy(text + pl, buf, (size_t)k);
                want = lazy_ref(plain, text, pl + (size_t)k, words, NULL, 1) >= 0;
            }
            if (allowed[t] != want) fail_msg("after '%s', token %d ('%.*s'): allowed %d", pre[p], t, k, buf, allowed[t]);
            count += want;
            refused += !want;
        }
        assert_int_equal(n, count);
        gm_free(s);
    }
    print_message("  %d tokens refused over %zu prefixes (a trigger with text after it the grammar refuses)\n", refused,
                  sizeof pre / sizeof *pre);
    assert_true(refused > 0);
    /* the sampler: whatever it draws, the text is the reference's */
    float *logits = malloc((size_t)nv * sizeof *logits);
    uint64_t rs = 11;
    int fired = 0;
    for (int run = 0; run < 30; run++) {
        kvlm_sampler_params sp = kvlm_sampler_default_params();
        sp.temperature = 1.0f;
        sp.top_k = 0, sp.top_p = 1, sp.min_p = 0;
        sp.seed = (uint64_t)run;
        sp.grammar = g;
        kvlm_sampler *smp = kvlm_sampler_create(&sp, nv);
        char text[2048];
        size_t len = 0;
        for (int step = 0; step < 120; step++) {
            tu_fill_random(logits, (size_t)nv, &rs, 3.0f);
            /* lean on "and" so that it comes */
            int32_t ids[4];
            int ni = kvlm_tokenize(m, " and", 4, false, false, ids, 4, &err);
            if (ni == 1) logits[ids[0]] += 3.0f;
            int32_t t = kvlm_sampler_sample(smp, logits);
            if (kvlm_token_is_eog(m, t)) break;
            char buf[300];
            int k = kvlm_token_to_text(m, t, buf, sizeof buf);
            if (!k) k = tok_token_to_bytes(m->tok, t, true, buf, sizeof buf); /* the grammar reads special tokens' texts */
            if (k > 0 && len + (size_t)k < sizeof text) memcpy(text + len, buf, (size_t)k), len += (size_t)k;
            int r = lazy_ref(plain, text, len, words, NULL, 1);
            if (r < 0) fail_msg("run %d: '%.*s' left the language", run, (int)len, text);
        }
        fired += memmem(text, len, "and", 3) != NULL;
        kvlm_sampler_free(smp);
    }
    print_message("  %d of 30 draws met the trigger\n", fired);
    assert_true(fired > 0);
    kvlm_grammar_free(g);
    kvlm_grammar_free(plain);
    /* special tokens: drawn where a grammar that allows them writes their text */
    kvlm_grammar_opts o = {.special = true};
    g = kvlm_grammar_compile(m, "root ::= \"<s>\" \"a\"", &o, &err);
    plain = kvlm_grammar_from_gbnf(m, "root ::= \"<s>\" \"a\"", NULL, &err);
    gm *s1 = gm_new(g), *s2 = gm_new(plain);
    gm_allowed(s1, allowed);
    assert_true(allowed[kvlm_token_bos(m)]);
    gm_allowed(s2, allowed);
    assert_false(allowed[kvlm_token_bos(m)]);
    assert_true(gm_feed_token(s1, kvlm_token_bos(m)));
    assert_false(gm_feed_token(s2, kvlm_token_bos(m)));
    gm_free(s1);
    gm_free(s2);
    kvlm_grammar_free(g);
    kvlm_grammar_free(plain);
    free(logits);
    free(allowed);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lazy), cmocka_unit_test(test_lazy_mask),
        cmocka_unit_test(test_json_object), cmocka_unit_test(test_gbnf),  cmocka_unit_test(test_gbnf_errors),
        cmocka_unit_test(test_schema),      cmocka_unit_test(test_mask),  cmocka_unit_test(test_sampler),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
