/* tests/test_limits: the nesting limits of the parsers that read a client's
 * input (a request body, its GBNF grammar, its JSON schema and the schema's
 * patterns), each checked before the parser goes one level deeper. One level
 * past a limit, and far past it (5,000 and 50,000 levels), is refused with a
 * message that names the limit; the limit itself is taken; and the stack a
 * parse takes at its limit is measured on a thread of its own and held far
 * below the HTTP thread's (SRV_HTTP_STACK). Also: the server's request parser
 * and `kvlm grammar` build one schema into the same GBNF, and refuse a $ref
 * cycle that could never end with the same message; and a token mask's work
 * is bounded too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "helpers/testutil.h"
#include "server/server.h"
#include "engine/grammar.h"

/* pre, then open n times, mid, close n times, post (malloc'd) */
static char *nest(const char *pre, const char *open, int n, const char *mid, const char *close, const char *post) {
    size_t lo = strlen(open), lc = strlen(close), len = strlen(pre) + (lo + lc) * (size_t)n + strlen(mid) + strlen(post);
    char *s = malloc(len + 1), *q = s;
    assert_non_null(s);
    q += sprintf(q, "%s", pre);
    for (int i = 0; i < n; i++) q += sprintf(q, "%s", open);
    q += sprintf(q, "%s", mid);
    for (int i = 0; i < n; i++) q += sprintf(q, "%s", close);
    sprintf(q, "%s", post);
    return s;
}

/* One build on a measured thread. */
typedef struct { int kind; const char *text; kvlm_grammar *g; kvlm_error err; } build_job;
static void build_main(void *p) {
    build_job *b = p;
    b->g = kvlm_grammar_build(NULL, b->kind, b->text, &b->err);
}

/* The most stack a parse at a limit may take: a quarter of the HTTP thread's. */
static size_t budget(void) { return (size_t)SRV_HTTP_STACK / 4; }

/* Builds text on a thread with the HTTP thread's stack; NULL or the grammar,
 * err as it said; the peak printed and checked against the budget. */
static kvlm_grammar *build_measured(const char *what, int kind, const char *text, kvlm_error *err) {
    build_job b = {kind, text, NULL, {0}};
    size_t peak = tu_stack_peak(build_main, &b, SRV_HTTP_STACK);
    printf("  %-58s stack %7zu bytes (%s)\n", what, peak, b.g ? "taken" : b.err.msg);
    if (peak > budget()) fail_msg("%s: %zu bytes of stack, over %zu", what, peak, budget());
    *err = b.err;
    return b.g;
}

static void expect_refused(const char *what, int kind, const char *text, const char *want) {
    kvlm_error err;
    kvlm_grammar *g = build_measured(what, kind, text, &err);
    if (g) fail_msg("%s: taken", what);
    if (!strstr(err.msg, want)) fail_msg("%s: '%s', want '%s'", what, err.msg, want);
}

static void expect_taken(const char *what, int kind, const char *text, const char *sentence) {
    kvlm_error err;
    kvlm_grammar *g = build_measured(what, kind, text, &err);
    if (!g) fail_msg("%s: refused: %s", what, err.msg);
    gm *m = gm_new(g);
    assert_non_null(m);
    if (!gm_feed(m, sentence, (int)strlen(sentence)) || !gm_done(m)) fail_msg("%s: '%.60s' not taken", what, sentence);
    gm_free(m);
    kvlm_grammar_free(g);
}

static void test_gbnf(void **state) {
    (void)state;
    printf("GBNF groups (KVLM_GRAMMAR_MAX_NESTING %d):\n", KVLM_GRAMMAR_MAX_NESTING);
    char *at = nest("root ::= ", "(", KVLM_GRAMMAR_MAX_NESTING, "\"a\"", ")", "\n");
    expect_taken("256 nested groups", KVLM_GRAMMAR_GBNF, at, "a");
    free(at);
    /* the 257th '(' is refused where it stands: line 1, column 9 + 257 */
    int ns[] = {KVLM_GRAMMAR_MAX_NESTING + 1, 5000, 50000};
    for (int i = 0; i < 3; i++) {
        char *t = nest("root ::= ", "(", ns[i], "\"a\"", ")", "\n"), what[64];
        snprintf(what, sizeof what, "%d nested groups", ns[i]);
        expect_refused(what, KVLM_GRAMMAR_GBNF, t, "grammar: line 1, column 266: groups nested deeper than 256 levels");
        free(t);
    }
    /* unclosed, and nested inside alternatives and repetitions */
    char *t = nest("root ::= ", "(\"x\" | (", 30000, "", "", "");
    expect_refused("30000 unclosed groups in alternatives", KVLM_GRAMMAR_GBNF, t, "groups nested deeper than 256 levels");
    free(t);
    t = nest("root ::= ", "(", 20000, "\"a\"", ")*", "\n");
    expect_refused("20000 nested starred groups", KVLM_GRAMMAR_GBNF, t, "groups nested deeper than 256 levels");
    free(t);
    /* a grammar that parses but whose expansion would multiply stacks without reading */
    char big[4096], *q = big + sprintf(big, "root ::= r1 \"x\"\n");
    for (int k = 1; k < 40; k++) q += sprintf(q, "r%d ::= r%d r%d\n", k, k + 1, k + 1);
    sprintf(q, "r40 ::= \"\"\n");
    expect_refused("40 rules each two of the next, over \"\"", KVLM_GRAMMAR_GBNF, big, "over 262144 parse stacks");
}

static void test_schema(void **state) {
    (void)state;
    printf("JSON schema subschemas (KVLM_JSON_SCHEMA_MAX_DEPTH %d), patterns (KVLM_PATTERN_MAX_NESTING %d):\n",
           KVLM_JSON_SCHEMA_MAX_DEPTH, KVLM_PATTERN_MAX_NESTING);
    /* each kind of subschema: 64 levels taken, 65 refused by the converter, 1,000 too (the
     * JSON under jansson's 2,048 levels), 5,000 by jansson itself */
    struct { const char *what, *open, *close, *s_open, *s_close; } kinds[] = {
        {"properties", "{\"type\": \"object\", \"properties\": {\"a\": ", "}, \"required\": [\"a\"]}", "{\"a\":", "}"},
        {"items", "{\"type\": \"array\", \"items\": ", ", \"minItems\": 1, \"maxItems\": 1}", "[", "]"},
        {"anyOf", "{\"anyOf\": [", "]}", "", ""},
        {"oneOf", "{\"oneOf\": [{\"type\": \"string\"}, ", "]}", "", ""},
        {"allOf", "{\"allOf\": [", "]}", "", ""},
        {"additionalProperties", "{\"type\": \"object\", \"additionalProperties\": ", "}", NULL, NULL},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        int ns[] = {KVLM_JSON_SCHEMA_MAX_DEPTH, KVLM_JSON_SCHEMA_MAX_DEPTH + 1, 1000, 5000};
        for (int i = 0; i < 4; i++) {
            char *t = nest("", kinds[k].open, ns[i], "{\"type\": \"null\"}", kinds[k].close, ""), what[96];
            snprintf(what, sizeof what, "%d nested %s", ns[i], kinds[k].what);
            if (i == 0 && kinds[k].s_open) {
                char *sentence = nest("", kinds[k].s_open, ns[i], "null", kinds[k].s_close, "");
                expect_taken(what, KVLM_GRAMMAR_JSON_SCHEMA, t, sentence);
                free(sentence);
            } else if (i == 0) {
                expect_taken(what, KVLM_GRAMMAR_JSON_SCHEMA, t, "{}");
            } else
                expect_refused(what, KVLM_GRAMMAR_JSON_SCHEMA, t,
                               i < 3 ? "subschemas nested deeper than 64 levels" : "maximum parsing depth reached");
            free(t);
        }
    }
    /* a chain of $refs: each one a level */
    for (int n = KVLM_JSON_SCHEMA_MAX_DEPTH - 1; n <= KVLM_JSON_SCHEMA_MAX_DEPTH + 1; n += 2) {
        char *t = malloc(64 * (size_t)n + 256), *q = t;
        q += sprintf(q, "{\"$ref\": \"#/$defs/d0\", \"$defs\": {");
        for (int i = 0; i < n; i++) q += sprintf(q, "\"d%d\": {\"$ref\": \"#/$defs/d%d\"}, ", i, i + 1);
        sprintf(q, "\"d%d\": {\"type\": \"null\"}}}", n);
        char what[64];
        snprintf(what, sizeof what, "a chain of %d $refs", n + 1);
        if (n < KVLM_JSON_SCHEMA_MAX_DEPTH) expect_taken(what, KVLM_GRAMMAR_JSON_SCHEMA, t, "null");
        else expect_refused(what, KVLM_GRAMMAR_JSON_SCHEMA, t, "subschemas nested deeper than 64 levels");
        free(t);
    }
    /* a pattern's groups */
    int ns[] = {KVLM_PATTERN_MAX_NESTING, KVLM_PATTERN_MAX_NESTING + 1, 5000};
    for (int i = 0; i < 3; i++) {
        char *t = nest("{\"type\": \"string\", \"pattern\": \"^", "(", ns[i], "a", ")", "$\"}"), what[64];
        snprintf(what, sizeof what, "a pattern of %d nested groups", ns[i]);
        if (!i) expect_taken(what, KVLM_GRAMMAR_JSON_SCHEMA, t, "\"a\"");
        else expect_refused(what, KVLM_GRAMMAR_JSON_SCHEMA, t, "'pattern': groups nested deeper than 64 levels");
        free(t);
    }
    /* a const as deep as JSON's own parser takes (values 2048 levels deep), written as one literal */
    char *t = nest("{\"const\": ", "[", 2046, "1", "]", "}"), *sentence = nest("", "[", 2046, "1", "]", "");
    expect_taken("a const of 2046 nested arrays", KVLM_GRAMMAR_JSON_SCHEMA, t, sentence);
    free(t);
    free(sentence);
    /* the deepest schema text of all (what kvlm grammar, run and chat parse on their main
     * thread): 64 levels of properties (128 levels of JSON) over a const (1) of 1918 arrays
     * and the number in them: 2048 */
    char *inner = nest("{\"const\": ", "[", 2048 - 2 * KVLM_JSON_SCHEMA_MAX_DEPTH - 2, "1", "]", "}");
    t = nest("", "{\"type\": \"object\", \"properties\": {\"a\": ", KVLM_JSON_SCHEMA_MAX_DEPTH, inner, "}}", "");
    kvlm_error err;
    kvlm_grammar *g = build_measured("64 levels of properties over a const, 2048 levels in all", KVLM_GRAMMAR_JSON_SCHEMA, t, &err);
    if (!g) fail_msg("refused: %s", err.msg);
    kvlm_grammar_free(g);
    free(inner);
    free(t);
    t = nest("{\"const\": ", "[", 2047, "1", "]", "}");
    expect_refused("a const of 2047 nested arrays", KVLM_GRAMMAR_JSON_SCHEMA, t, "maximum parsing depth reached");
    free(t);
}

/* ---- through the server's request parser (srv_parse_request) ---- */

static kvlm_server srv;
static kvlm_model *model;

static int setup(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    if (!path) return 0;
    kvlm_error err = {0};
    if (!(model = kvlm_model_load(path, NULL, &err))) return -1;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 128;
    cp.n_threads = 1;
    if (!(srv.ctx = kvlm_ctx_create(model, &cp, &err))) return -1;
    srv.model = model;
    snprintf(srv.model_id, sizeof srv.model_id, "stories260K");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kvlm_ctx_free(srv.ctx);
    kvlm_model_free(model);
    return 0;
}

typedef struct { const char *body; int status; char msg[512]; char *gbnf; } parse_job;
static void parse_main(void *p) {
    parse_job *j = p;
    kvlm_request_params rp;
    int n;
    j->status = srv_parse_request(&srv, j->body, strlen(j->body), false, &rp, &n, j->msg, sizeof j->msg, &j->gbnf);
}

/* The status the body gets; msg its error, *gbnf (if given) its grammar's text. */
static int parse_measured(const char *what, const char *body, char *msg, char **gbnf) {
    parse_job j = {body, 0, "", NULL};
    size_t peak = tu_stack_peak(parse_main, &j, SRV_HTTP_STACK);
    printf("  %-58s stack %7zu bytes (%d%s%.90s)\n", what, peak, j.status, j.msg[0] ? ": " : "", j.msg);
    if (peak > budget()) fail_msg("%s: %zu bytes of stack, over %zu", what, peak, budget());
    if (msg) strcpy(msg, j.msg);
    if (gbnf) *gbnf = j.gbnf;
    else free(j.gbnf);
    return j.status;
}

static void test_request(void **state) {
    (void)state;
    TU_REQUIRE(model);
    printf("request bodies through the server's parser (JSON_PARSER_MAX_DEPTH %d):\n", JSON_PARSER_MAX_DEPTH);
    char msg[512];
    /* JSON's own limit: values 2048 levels deep (the object, 2046 arrays, the number in them)
     * taken by jansson (and refused by the field), 2049 not JSON */
    char *b = nest("{\"prompt\": \"x\", \"stop\": ", "[", 2046, "1", "]", "}");
    assert_int_equal(parse_measured("a body 2048 levels deep", b, msg, NULL), 400);
    assert_non_null(strstr(msg, "'stop' must be a string"));
    free(b);
    b = nest("{\"prompt\": \"x\", \"stop\": ", "[", 2047, "1", "]", "}");
    assert_int_equal(parse_measured("a body 2049 levels deep", b, msg, NULL), 400);
    assert_non_null(strstr(msg, "not valid JSON"));
    free(b);
    b = nest("{\"prompt\": \"x\", \"stop\": ", "[", 50000, "1", "]", "}");
    assert_int_equal(parse_measured("a body 50002 levels deep", b, msg, NULL), 400);
    assert_non_null(strstr(msg, "not valid JSON"));
    free(b);
    /* a grammar past its limit, a schema past its limit, a pattern past its limit */
    char *g = nest("root ::= ", "(", 5000, "\\\"a\\\"", ")", "");
    b = nest("{\"prompt\": \"x\", \"grammar\": \"", "", 0, g, "", "\"}");
    assert_int_equal(parse_measured("grammar: 5000 nested groups", b, msg, NULL), 400);
    assert_non_null(strstr(msg, "'grammar': grammar: line 1, column 266: groups nested deeper than 256 levels"));
    free(g);
    free(b);
    static const char rf[] = "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
                             "{\"name\": \"n\", \"schema\": ";
    b = nest(rf, "{\"type\": \"array\", \"items\": ", 1000, "{}", "}", "}}}");
    assert_int_equal(parse_measured("schema: 1000 nested items", b, msg, NULL), 400);
    assert_non_null(strstr(msg, "subschemas nested deeper than 64 levels"));
    free(b);
    b = nest(rf, "", 0, "{\"type\": \"string\", \"pattern\": \"", "", "");
    char *b2 = nest(b, "(", 5000, "a", ")", "\"}}}}");
    assert_int_equal(parse_measured("pattern: 5000 nested groups", b2, msg, NULL), 400);
    assert_non_null(strstr(msg, "'pattern': groups nested deeper than 64 levels"));
    free(b);
    free(b2);
    /* the deepest a schema may go, with a const as deep as the body allows below it: taken */
    /* (the body, response_format, json_schema, 64 schemas and their properties, the const's
     * schema: 132 levels; then 1915 arrays and the number in them: 2048) */
    char *inner = nest("", "[", 2048 - 4 - 2 * KVLM_JSON_SCHEMA_MAX_DEPTH - 1, "1", "]", "");
    char *mid = nest("{\"const\": ", "", 0, inner, "", "}");
    char *sc = nest("", "{\"type\": \"object\", \"properties\": {\"a\": ", KVLM_JSON_SCHEMA_MAX_DEPTH, mid, "}}", "");
    b = nest(rf, "", 0, sc, "", "}}}");
    assert_int_equal(parse_measured("schema: 64 levels over a const, 2048 levels in all", b, msg, NULL), 200);
    free(inner);
    free(mid);
    free(sc);
    free(b);
}

/* kvlm grammar's output for a schema file (stdout; *err_out its stderr's last line). */
static char *cli_grammar_of(const char *schema, char *err_out, size_t cap) {
    const char *bin = getenv("KVLM_BIN");
    if (!bin) return NULL;
    const char *path = tu_tmp_path(".json"), *errp = tu_tmp_path(".err");
    assert_int_equal(tu_write_file(path, schema, strlen(schema)), 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' grammar --json-schema-file '%s' 2>'%s'", bin, path, errp);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = 0, c = 1 << 16;
    char *out = malloc(c);
    for (size_t k; (k = fread(out + n, 1, c - n - 1, p)) > 0;)
        if ((n += k) + 1 == c) out = realloc(out, c *= 2);
    out[n] = 0;
    pclose(p);
    size_t el;
    char *e = tu_read_file(errp, &el);
    err_out[0] = 0;
    if (e) {
        while (el && e[el - 1] == '\n') e[--el] = 0;
        snprintf(err_out, cap, "%s", e);
        free(e);
    }
    return out;
}

/* One builder: the server's request and kvlm grammar, from the same schema
 * (the CLI's with its own spacing), give the same GBNF, or the same refusal. */
static void test_one_builder(void **state) {
    (void)state;
    TU_REQUIRE(model);
    const char *bin = getenv("KVLM_BIN");
    if (!bin || access(bin, X_OK)) {
        fprintf(stderr, "SKIP: no kvlm binary at KVLM_BIN (%s)\n", bin ? bin : "unset");
        skip();
    }
    static const char tree[] = "{\n  \"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\n"
                               "    \"name\": {\"type\": \"string\"},\n"
                               "    \"kids\": {\"type\": \"array\", \"items\": {\"$ref\": \"#/$defs/node\"}}},\n"
                               "    \"required\": [\"name\"]}},\n  \"$ref\": \"#/$defs/node\"\n}\n";
    static const char cycle[] = "{\"$ref\": \"#/$defs/a\", \"$defs\": {\"a\": {\"$ref\": \"#/$defs/a\"}}}";
    static const char rf[] = "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
                             "{\"name\": \"n\", \"schema\": %s}}}";
    char body[2048], msg[512], cli_err[512];
    snprintf(body, sizeof body, rf, tree);
    char *server_gbnf = NULL, *cli = cli_grammar_of(tree, cli_err, sizeof cli_err);
    assert_int_equal(parse_measured("a tree of nodes ($ref through items)", body, msg, &server_gbnf), 200);
    assert_non_null(server_gbnf);
    if (strcmp(server_gbnf, cli)) fail_msg("the server's GBNF:\n%s\nkvlm grammar's:\n%s", server_gbnf, cli);
    kvlm_error err = {0};
    kvlm_grammar *g = kvlm_grammar_build(NULL, KVLM_GRAMMAR_JSON_SCHEMA, tree, &err);
    assert_non_null(g);
    assert_string_equal(kvlm_grammar_gbnf(g), cli);
    gm *m = gm_new(g);
    const char *doc = "{\"name\": \"a\", \"kids\": [{\"name\": \"b\", \"kids\": []}, {\"name\": \"c\"}]}";
    assert_true(gm_feed(m, doc, (int)strlen(doc)) && gm_done(m));
    gm_free(m);
    kvlm_grammar_free(g);
    printf("  the tree's GBNF, %zu bytes, the same from both\n", strlen(cli));
    free(server_gbnf);
    free(cli);
    /* a cycle that never ends: the same refusal */
    snprintf(body, sizeof body, rf, cycle);
    cli = cli_grammar_of(cycle, cli_err, sizeof cli_err);
    assert_string_equal(cli, "");
    assert_int_equal(parse_measured("a $ref cycle", body, msg, NULL), 400);
    const char *want = "json_schema at #/$defs/a: '$ref' '#/$defs/a' comes back to itself with no object or array "
                       "between, so it could never end";
    if (!strstr(msg, want) || !strstr(cli_err, want)) fail_msg("server: '%s'; kvlm grammar: '%s'", msg, cli_err);
    assert_non_null(strstr(msg, "'response_format': "));
    printf("  the cycle refused alike: %s\n", want);
    free(cli);
}

/* A grammar that compiles but whose token mask would go through millions of
 * stacks (a few states of tens of thousands each) ends at its first mask,
 * within a bounded amount of work (the engine thread makes masks for every
 * request); JSON mode's masks over the same 32,000 tokens are far inside it. */
static void test_mask_work(void **state) {
    (void)state;
    const char *path = tu_model_path("vocab/ggml-vocab-llama-spm.gguf");
    TU_REQUIRE(path);
    kvlm_model_params mp = {.vocab_only = true};
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    assert_non_null(m);
    int nv = kvlm_vocab_size(m);
    bool *allowed = malloc((size_t)nv);
    kvlm_grammar *g = kvlm_grammar_build(m, KVLM_GRAMMAR_GBNF, "root ::= (([a-z\\u2581]{0,60}){0,60}){0,60}\n", &err);
    assert_non_null(g);
    gm *x = gm_new(g);
    assert_non_null(x);
    assert_int_equal(gm_allowed(x, allowed), 0);
    for (int t = 0; t < nv; t++) assert_false(allowed[t]);
    assert_false(gm_feed(x, "a", 1)); /* the grammar ended there */
    printf("  (([a-z\\u2581]{0,60}){0,60}){0,60} over %d tokens: its first mask allows nothing, the grammar ends\n", nv);
    gm_free(x);
    kvlm_grammar_free(g);
    g = kvlm_grammar_build(m, KVLM_GRAMMAR_JSON_OBJECT, NULL, &err);
    x = gm_new(g);
    const char *doc = "{\"name\": \"Bob\", \"items\": [1, 2.5e3, {\"a\": [true, null]}]}";
    for (const char *p = doc; *p; p++) {
        assert_true(gm_allowed(x, allowed) > 0);
        assert_true(gm_feed(x, p, 1));
    }
    gm_free(x);
    kvlm_grammar_free(g);
    free(allowed);
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gbnf),
        cmocka_unit_test(test_schema),
        cmocka_unit_test(test_request),
        cmocka_unit_test(test_one_builder),
        cmocka_unit_test(test_mask_work),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
