/* tests/test_jinja: tok/jinja, the chat-template interpreter, on its own
 * (tests/cli_template.sh holds it to Python's jinja2 over the real
 * templates): the language's pieces against outputs jinja2 gave (whitespace
 * control, operators, loops, scopes, macros, filters, tests, methods, Python's
 * repr and json.dumps of floats and non-ASCII text); errors naming the line;
 * raise_exception's message as given; every limit (nesting 5,000 and 50,000
 * levels deep of parentheses, ifs, lists and chains; 10^10 loop iterations;
 * output; macro recursion; memory) refused cleanly, naming it, and the stack
 * a render takes at the limits measured; the sandbox (no mutating methods,
 * no dunders); renders from many threads at once; the public calls, and a
 * model's template through kvlm_model_chat_template. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <jansson.h>
#include "helpers/testutil.h"
#include "tok/jinja.h"
#include "model/model.h"

static const char *VARS =
    "{\"xs\": [3, 1, 2], \"d\": {\"b\": 2, \"a\": 1}, \"s\": \"Hello World\", \"u\": \"h\u00e9llo \u4f60\u597d \U0001f600\","
    " \"msgs\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}";

/* jinja2 3.1 (transformers' environment) gave these */
static const struct { const char *tmpl, *vars, *want; } k_cases[] = {
    {"{% if true %}\n  x\n{% endif %}\ny",
     "{}",
     "  x\ny"},
    {"  {% if true %}\nx\n  {% endif %}\n",
     "{}",
     "x\n"},
    {"a  {%- if true -%}  b  {%- endif -%}  c",
     "{}",
     "abc"},
    {"a {{- ' b ' -}} c",
     "{}",
     "a b c"},
    {"a\n  {# c #}\nb",
     "{}",
     "a\nb"},
    {"  {%+ if true %}x{% endif %}",
     "{}",
     "  x"},
    {"{% if true +%}\nz{% endif %}",
     "{}",
     "\nz"},
    {"{% raw %}{{ x }}{% endraw %}",
     "{}",
     "{{ x }}"},
    {"{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7.5 // 2 }}",
     "{}",
     "3 -4 2 3.5 2.0 1024 0.5 3.0"},
    {"{{ 1 < 2 < 3 }} {{ 1 == 1.0 }} {{ 'a' ~ 1 ~ none }} {{ 0 or 'x' }} {{ 1 and 0 }}",
     "{}",
     "True True a1None x 0"},
    {"{{ 'x' if false }}|{{ none }}|{{ True }}|{{ 'ab' * 2 }}|{{ [1] + [2] }}",
     "{}",
     "|None|True|abab|[1, 2]"},
    {"{{ xs[0] }}{{ xs[-1] }}{{ xs[1:] }}{{ xs[::-1] }}{{ u[1:4] }}{{ u[::-1] }}{{ s[100] }}",
     NULL,
     "32[1, 2][2, 1, 3]éll😀 好你 olléh"},
    {"{% for i in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('a','b') }};{% endfor %}",
     NULL,
     "103TrueFalse31a;212FalseFalse332b;321FalseTrue31a;"},
    {"{% for i in xs if i > 1 %}{{ i }}{% else %}none{% endfor %}|{% for i in [] %}x{% else %}else{% endfor %}",
     NULL,
     "32|else"},
    {"{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|dictsort %}{{ k }}{{ v }}{% endfor %}",
     NULL,
     "b=2;a=1;a1b2"},
    {"{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
     "{}",
     "023"},
    {"{% set x = 0 %}{% for i in xs %}{% set x = i %}{% endfor %}{{ x }}",
     NULL,
     "0"},
    {"{% set ns = namespace(t=0) %}{% for i in xs %}{% set ns.t = ns.t + i %}{% endfor %}{{ ns.t }}",
     NULL,
     "6"},
    {"{% set x %}a{{ 1 }}{% endset %}{{ x }}|{% set a, b = 1, 2 %}{{ b }}{{ a }}",
     "{}",
     "a1|21"},
    {"{% macro m(a, b=2) %}{{ a }}{{ b }}{{ varargs }}{% endmacro %}{{ m(1) }}|{{ m(1, 3, 4) }}|{{ m(b=5, a=0) }}",
     "{}",
     "12()|13(4,)|05()"},
    {"{% macro w() %}[{{ caller(1) }}]{% endmacro %}{% call(x) w() %}c{{ x }}{% endcall %}",
     "{}",
     "[c1]"},
    {"{% filter upper %}ab{% endfilter %}{% with q = 2 %}{{ q }}{% endwith %}{{ q }}",
     "{}",
     "AB2"},
    {"{{ s|upper }}{{ s|lower }}{{ u|upper }}{{ s|title }}{{ 'hELLO'|capitalize }}{{ '  x '|trim }}{{ s|length }}{{ u|length }}",
     NULL,
     "HELLO WORLDhello worldHÉLLO 你好 😀Hello WorldHellox1110"},
    {"{{ xs|first }}{{ xs|last }}{{ xs|join(',') }}{{ s|replace('l', 'L') }}{{ x|default('d') }}{{ ''|default('e', true) }}",
     NULL,
     "323,1,2HeLLo WorLdde"},
    {"{{ xs|sort }}{{ xs|sort(reverse=true) }}{{ ['b', 'A', 'a']|sort }}{{ [1, 1, 2]|unique|list }}{{ msgs|map(attribute='role')|list }}",
     NULL,
     "[1, 2, 3][3, 2, 1]['A', 'a', 'b'][1, 2]['user', 'assistant']"},
    {"{{ msgs|selectattr('role', 'equalto', 'user')|list|length }}{{ msgs|rejectattr('role', 'equalto', 'user')|list|length }}{{ xs|select('odd')|list }}{{ xs|reject('odd')|list }}",
     NULL,
     "11[3, 1][2]"},
    {"{{ '42'|int }}{{ '4.5'|float }}{{ 2.5|round }}{{ 3.14159|round(2) }}{{ -3|abs }}{{ 'x'|int(7) }}{{ xs|sum }}{{ xs|min }}{{ xs|max }}",
     NULL,
     "424.52.03.1437613"},
    {"{{ 'a\\nb'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(2, blank=true) }}",
     "{}",
     "a\n  b|  a\n  b|a\n  \n  b"},
    {"{{ 'one two three'|wordcount }}{{ 'abcdefghij klm'|truncate(9) }}{{ 'ab'|center(6) }}|{{ '<&>'|e }}|{{ '<a>'|safe + '<b>' }}",
     "{}",
     "3abcdefghij klm  ab  |&lt;&amp;&gt;|<a>&lt;b&gt;"},
    {"{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ d|tojson(sort_keys=true) }}|{{ u|tojson }}|{{ u|tojson(ensure_ascii=true) }}|{{ [1.0, 1e16, 1e-05, 0.1]|tojson }}",
     NULL,
     "{\"b\": 2, \"a\": 1}|{\n  \"b\": 2,\n  \"a\": 1\n}|{\"a\": 1, \"b\": 2}|\"héllo 你好 😀\"|\"h\\u00e9llo \\u4f60\\u597d \\ud83d\\ude00\"|[1.0, 1e+16, 1e-05, 0.1]"},
    {"{{ {'a': 1, 'b': [True, None, 1.5]} }}|{{ (1,) }}|{{ ['it\\'s', \"q\\\"\"] }}|{{ [u] }}|{{ [1e16, 1e-5, 100.0] }}",
     NULL,
     "{'a': 1, 'b': [True, None, 1.5]}|(1,)|[\"it's\", 'q\"']|['héllo 你好 😀']|[1e+16, 1e-05, 100.0]"},
    {"{{ s.startswith('He') }}{{ s.split() }}{{ 'a,b'.split(',') }}{{ ' x '.strip() }}{{ 'xax'.strip('x') }}{{ s.find('o') }}{{ s.count('l') }}{{ '-'.join(['a', 'b']) }}{{ '{} {}'.format(1, 'a') }}{{ '%s=%d' % ('a', 3) }}",
     NULL,
     "True['Hello', 'World']['a', 'b']xa43a-b1 aa=3"},
    {"{{ d.get('a') }}{{ d.get('z', 0) }}{{ d.keys()|list }}{{ d.items()|list }}{{ xs.index(2) }}{{ xs.count(1) }}",
     NULL,
     "10['b', 'a'][('b', 2), ('a', 1)]21"},
    {"{{ x is defined }}{{ xs is iterable }}{{ s is string }}{{ d is mapping }}{{ 3 is odd }}{{ 4 is divisibleby 2 }}{{ none is none }}{{ 1 is number }}{{ true is boolean }}{{ xs is sequence }}",
     NULL,
     "FalseTrueTrueTrueTrueTrueTrueTrueTrueTrue"},
    {"{{ d.missing }}|{{ none.x }}|{{ x.__class__ }}|{{ s.__class__ }}",
     NULL,
     "|||"},
    {"{{ strftime_now('%Y-%m-%d %b') }}",
     "{}",
     "2023-11-14 Nov"},
    {"{{ messages[0]['content'] }}",
     "{\"messages\": [{\"content\": [{\"type\": \"text\", \"text\": \"x\"}]}]}",
     "[{'type': 'text', 'text': 'x'}]"},
};

static char *render_o(const char *tmpl, const char *vars, const jinja_opts *o, kvlm_error *err) {
    jinja_template *t = jinja_parse(tmpl, strlen(tmpl), err);
    if (!t) return NULL;
    json_error_t je;
    json_t *j = json_loads(vars, 0, &je);
    if (!j) fail_msg("bad test vars: %s", je.text);
    size_t n = 0;
    char *s = jinja_render(t, j, o, &n, err);
    if (s && n != strlen(s)) fail_msg("length %zu, text %zu", n, strlen(s));
    json_decref(j);
    jinja_free(t);
    return s;
}

static void expect_text(const char *tmpl, const char *vars, const char *want) {
    kvlm_error err = {0};
    char *s = render_o(tmpl, vars, NULL, &err);
    if (!s) fail_msg("%s: failed: %s", tmpl, err.msg);
    if (strcmp(s, want)) fail_msg("%s:\n  got  '%s'\n  want '%s'", tmpl, s, want);
    free(s);
}

static void expect_error_o(const char *tmpl, const char *vars, const jinja_opts *o, const char *want) {
    kvlm_error err = {0};
    char *s = render_o(tmpl, vars, o, &err);
    if (s) fail_msg("%.80s: rendered '%.80s', want an error '%s'", tmpl, s, want);
    if (err.code != KVLM_EINVAL) fail_msg("%.80s: code %d (%s)", tmpl, err.code, err.msg);
    if (!strstr(err.msg, want)) fail_msg("%.80s: error '%s', want '%s'", tmpl, err.msg, want);
}
static void expect_error(const char *tmpl, const char *vars, const char *want) { expect_error_o(tmpl, vars, NULL, want); }

static void test_language(void **state) {
    (void)state;
    setenv("TZ", "UTC", 1);
    tzset();
    for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++) {
        /* strftime_now reads the pinned time (1700000000: 2023-11-14 UTC) */
        kvlm_error err = {0};
        jinja_opts o = {.now = 1700000000};
        char *s = render_o(k_cases[i].tmpl, k_cases[i].vars ? k_cases[i].vars : VARS, &o, &err);
        if (!s) fail_msg("case %zu %s: failed: %s", i, k_cases[i].tmpl, err.msg);
        if (strcmp(s, k_cases[i].want)) fail_msg("case %zu %s:\n  got  '%s'\n  want '%s'", i, k_cases[i].tmpl, s, k_cases[i].want);
        free(s);
    }
}

/* a macro's closure, loop scopes, namespaces, whitespace at the edges */
static void test_scopes(void **state) {
    (void)state;
    expect_text("{% macro m() %}{{ x }}{% endmacro %}{% set x = 1 %}{{ m() }}{% set x = 2 %}{{ m() }}", "{}", "12");
    expect_text("{% set x = 0 %}{% for i in [1, 2, 3] %}{{ x }}{% set x = i %}{{ x }};{% endfor %}{{ x }}", "{}",
                "01;02;03;0");
    expect_text("{% for i in [1, 2] %}{% if i > 1 %}[{{ y }}]{% endif %}{% set y = i %}{% endfor %}[{{ y }}]", "{}", "[][]");
    expect_text("{% if true %}{% set z = 5 %}{% endif %}{{ z }}", "{}", "5");
    expect_text("{% set y %}{% set z = 1 %}a{% endset %}{{ y }}{{ z }}", "{}", "a");
    expect_text("{% set messages = messages + ['b'] %}{{ messages }}", "{\"messages\": [\"a\"]}", "['a', 'b']");
    expect_text("a\n", "{}", "a");
    expect_text("a\n\n", "{}", "a\n");
    expect_text("a\r\nb\rc", "{}", "a\nb\nc");
    expect_text("{% for i in [[1, [2]], [3]] recursive %}<{{ i if i is number else loop(i) }}>{% endfor %}", "{}",
                "<<1><<2>>><<3>>");
}

static void test_errors(void **state) {
    (void)state;
    expect_error("{% if x %}\n\n{% endfor %}", "{}", "line 3: encountered unknown tag 'endfor'");
    expect_error("line 1\n{{ x|xmlattr }}", "{\"x\": {}}", "line 2: filter 'xmlattr' is not supported");
    expect_error("{{ x|from_json }}", "{}", "line 1: no filter named 'from_json'");
    expect_text("{% if false %}{{ x|from_json }}{% endif %}ok", "{}", "ok"); /* Jinja2 checks it only when reached */
    expect_error("{% if true %}{{ x|from_json }}{% endif %}", "{}", "no filter named 'from_json'");
    expect_error("{{ x is nosuchtest }}", "{}", "no test named 'nosuchtest'");
    expect_error("\n{% include 'other.jinja' %}", "{}", "line 2: tag 'include' is not supported");
    expect_error("{% for x in y %}", "{}", "unexpected end of template: 'for' (line 1) needs 'endfor'");
    expect_error("{{ 'abc }}", "{}", "unterminated string");
    expect_error("{# no end", "{}", "missing end of comment tag");
    expect_error("{{ 1 +* 2 }}", "{}", "line 1: unexpected '*'");
    expect_error("{{ 1 / 0 }}", "{}", "division by zero");
    expect_error("{{ 'a' + 1 }}", "{}", "unsupported operand type(s) for +: 'str' and 'int'");
    expect_error("{{ x.y }}", "{}", "'x' is undefined");
    expect_error("{{ 9223372036854775807 + 1 }}", "{}", "integer overflow");
    expect_error("{{ 99999999999999999999 }}", "{}", "integer literal too large");
    expect_error("{% break %}", "{}", "'break' outside of a loop");
    expect_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "{}", "macro 'm' takes not more than 1 argument(s)");
    kvlm_error err = {0};
    assert_null(jinja_parse("\xff\xfe{{ x }}", 8, &err));
    assert_non_null(strstr(err.msg, "not valid UTF-8"));
    /* raise_exception: its message alone, as transformers' TemplateError says it */
    err = (kvlm_error){0};
    char *s = render_o("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
                       "{\"messages\": [{\"role\": \"system\"}]}", NULL, &err);
    assert_null(s);
    assert_int_equal(err.code, KVLM_EINVAL);
    assert_string_equal(err.msg, "System role not supported");
}

/* open n times, mid, close n times (malloc'd) */
static char *nest(const char *open, int n, const char *mid, const char *close) {
    size_t lo = strlen(open), lc = strlen(close), len = (lo + lc) * (size_t)n + strlen(mid);
    char *s = malloc(len + 1), *q = s;
    assert_non_null(s);
    for (int i = 0; i < n; i++) q += sprintf(q, "%s", open);
    q += sprintf(q, "%s", mid);
    for (int i = 0; i < n; i++) q += sprintf(q, "%s", close);
    return s;
}

static void test_nesting(void **state) {
    (void)state;
    static const int depths[] = {5000, 50000};
    for (int k = 0; k < 2; k++) {
        int n = depths[k];
        /* parentheses inside one expression */
        char *p = nest("(", n, "1", ")"), *t = malloc(strlen(p) + 8);
        sprintf(t, "{{ %s }}", p);
        expect_error(t, "{}", "brackets nested too deep (limit 200)");
        free(t);
        free(p);
        p = nest("[", n, "1", "]");
        t = malloc(strlen(p) + 8);
        sprintf(t, "{{ %s }}", p);
        expect_error(t, "{}", "brackets nested too deep (limit 200)");
        free(t);
        free(p);
        p = nest("{% if true %}", n, "x", "{% endif %}");
        expect_error(p, "{}", "nesting too deep (the parser's limit is 200 levels)");
        free(p);
        p = nest("{% for i in [1] %}", n, "x", "{% endfor %}");
        expect_error(p, "{}", "nesting too deep (the parser's limit is 200 levels)");
        free(p);
        p = nest("{% macro m() %}", n, "x", "{% endmacro %}");
        expect_error(p, "{}", "nesting too deep (the parser's limit is 200 levels)");
        free(p);
        /* chains the parser builds without recursing: the evaluator's depth refuses them */
        p = nest("- ", n, "1", "");
        t = malloc(strlen(p) + 8);
        sprintf(t, "{{ %s }}", p);
        expect_error(t, "{}", "nesting too deep (the parser's limit is 200 levels)");
        free(t);
        free(p);
        p = nest("", n, "{{ 'x'", "|trim");
        t = malloc(strlen(p) + 8);
        sprintf(t, "%s }}", p);
        expect_error(t, "{}", "nesting too deep (the evaluator's limit is 1000 levels)");
        free(t);
        free(p);
        p = nest("", n, "{{ 1", " + 1");
        t = malloc(strlen(p) + 8);
        sprintf(t, "%s }}", p);
        expect_error(t, "{}", "nesting too deep (the evaluator's limit is 1000 levels)");
        free(t);
        free(p);
        /* variables nested that deep */
        p = nest("[", n, "1", "]");
        t = malloc(strlen(p) + 16);
        sprintf(t, "{\"v\": %s}", p);
        json_error_t je;
        json_t *j = json_loads(t, 0, &je); /* jansson stops at 2048 levels: build it by hand past that */
        if (!j) {
            j = json_integer(1);
            for (int i = 0; i < n; i++) {
                json_t *a = json_array();
                json_array_append_new(a, j);
                j = a;
            }
            json_t *o = json_object();
            json_object_set_new(o, "v", j);
            j = o;
        }
        jinja_template *tt = jinja_parse("{{ v }}", 7, NULL);
        kvlm_error err = {0};
        char *s = jinja_render(tt, j, NULL, NULL, &err);
        assert_null(s);
        assert_non_null(strstr(err.msg, "nest deeper than 1000 levels"));
        jinja_free(tt);
        json_decref(j);
        free(t);
        free(p);
    }
    /* at the limits: taken */
    char *p = nest("(", 190, "1", ")"), *t = malloc(strlen(p) + 8);
    sprintf(t, "{{ %s }}", p);
    expect_text(t, "{}", "1");
    free(t);
    free(p);
    p = nest("{% if true %}", 190, "x", "{% endif %}");
    expect_text(p, "{}", "x");
    free(p);
}

static void test_limits(void **state) {
    (void)state;
    /* 10^10 iterations: the step limit ends it */
    jinja_opts o = {.max_steps = 200000};
    expect_error_o("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "{}", &o,
                   "step limit reached (200000");
    if (!tu_quick()) /* the default limit, 5,000,000 */
        expect_error("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "{}",
                     "step limit reached (5000000");
    expect_error("{{ range(100001)|length }}", "{}", "range too big");
    /* output */
    o = (jinja_opts){.max_output = 10000};
    expect_error_o("{% for i in range(2000) %}xxxxxxxxxx{% endfor %}", "{}", &o, "output limit of 10000 bytes");
    expect_error_o("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                   "{}", &o, "output limit of 10000 bytes");
    expect_error_o("{{ 'x' * 100000 }}", "{}", &o, "output limit");
    expect_error_o("{{ ('x\\n' * 1000)|indent(1000) }}", "{}", &o, "output limit");
    expect_error("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "{}", "output limit of 33554432 bytes");
    /* memory: many pieces each under the output limit */
    expect_error("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 10000] %}{% endfor %}",
                 "{}", "limit");
    /* macro recursion */
    expect_error("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", "{}",
                 "nesting too deep (the evaluator's limit is 1000 levels)");
    o = (jinja_opts){.max_depth = 50};
    expect_error_o("{% macro r(n) %}{% if n %}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(30) }}", "{}", &o,
                   "the evaluator's limit is 50 levels");
    expect_text("{% macro r(n) %}{% if n %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(5) }}", "{}", "54321");
}

static void test_sandbox(void **state) {
    (void)state;
    expect_error("{{ messages.append(1) }}", "{\"messages\": []}", "access to attribute 'append' of 'list' object is unsafe");
    expect_error("{{ messages.pop() }}", "{\"messages\": [1]}", "access to attribute 'pop' of 'list' object is unsafe");
    expect_error("{{ d.update({'a': 1}) }}", "{\"d\": {}}", "access to attribute 'update' of 'dict' object is unsafe");
    expect_error("{{ d.clear() }}", "{\"d\": {}}", "unsafe");
    expect_text("{{ messages.append }}|{{ messages.append is defined }}", "{\"messages\": []}", "|False");
    expect_text("{{ x.__class__ }}|{{ s.__class__ }}|{{ s.__init__ }}|{{ d._k }}", "{\"s\": \"a\", \"d\": {\"_k\": 1}}", "|||1");
    expect_error("{{ s.__class__.__mro__ }}", "{\"s\": \"a\"}", "access to attribute '__class__' of 'str' object is unsafe");
    expect_error("{{ ''.__class__.__mro__[1].__subclasses__() }}", "{}", "unsafe");
    expect_error("{{ cycler.__init__.__globals__ }}", "{}", "unsafe");
    expect_text("{{ nothing }}{{ os }}{{ self }}{{ config }}", "{}", ""); /* only what is passed in */
    expect_error("{{ s.encode() }}", "{\"s\": \"a\"}", "string method 'encode' is not supported");
}

/* ---- many threads ---- */
typedef struct { jinja_template *t; json_t *vars; const char *want; int bad; } thread_job;
static void *thread_main(void *p) {
    thread_job *j = p;
    for (int i = 0; i < 200; i++) {
        kvlm_error err = {0};
        char *s = jinja_render(j->t, j->vars, NULL, NULL, &err);
        if (!s || strcmp(s, j->want)) j->bad++;
        free(s);
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    const char *src = "{% for m in msgs %}<{{ m.role }}>{{ m.content|upper }}{{ m|tojson }}{{ [m.content, 1.5] }}\n"
                      "{% endfor %}{{ u|upper }}{{ [u] }}";
    jinja_template *t = jinja_parse(src, strlen(src), NULL);
    json_t *vars = json_loads(VARS, 0, NULL);
    kvlm_error err = {0};
    char *want = jinja_render(t, vars, NULL, NULL, &err);
    assert_non_null(want);
    thread_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (thread_job){t, vars, want, 0};
        assert_int_equal(pthread_create(&th[i], NULL, thread_main, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].bad, 0);
    }
    free(want);
    json_decref(vars);
    jinja_free(t);
}

/* ---- stack at the limits, on a thread with the HTTP thread's 8 MiB ---- */
typedef struct { const char *src; kvlm_error err; } stack_job;
static void stack_main(void *p) {
    stack_job *j = p;
    jinja_template *t = jinja_parse(j->src, strlen(j->src), &j->err);
    if (!t) return;
    free(jinja_render(t, NULL, NULL, NULL, &j->err));
    jinja_free(t);
}

static void test_stack(void **state) {
    (void)state;
    /* a quarter of the HTTP thread's stack; the sanitizers' red zones make frames several times larger */
#if defined(__SANITIZE_ADDRESS__)
    const size_t size = (size_t)8 << 20, budget = size / 2;
#else
    const size_t size = (size_t)8 << 20, budget = size / 4;
#endif
    char *srcs[4];
    srcs[0] = nest("(", 199, "1", ")"); /* parser at its limit */
    char *t = malloc(strlen(srcs[0]) + 8);
    sprintf(t, "{{ %s }}", srcs[0]);
    free(srcs[0]);
    srcs[0] = t;
    srcs[1] = nest("{% if true %}", 199, "x", "{% endif %}");
    srcs[2] = strdup("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}"); /* evaluator at its limit */
    srcs[3] = nest("", 990, "{{ 1", " + 1");
    char *c = malloc(strlen(srcs[3]) + 4);
    sprintf(c, "%s }}", srcs[3]);
    free(srcs[3]);
    srcs[3] = c;
    for (int i = 0; i < 4; i++) {
        stack_job j = {srcs[i], {0}};
        size_t peak = tu_stack_peak(stack_main, &j, size);
        printf("  stack case %d: %zu bytes (%s)\n", i, peak, j.err.msg[0] ? j.err.msg : "rendered");
        if (peak > budget) fail_msg("case %d: %zu bytes of stack, over %zu", i, peak, budget);
        free(srcs[i]);
    }
}

static void test_public_api(void **state) {
    (void)state;
    kvlm_error err = {0};
    const char *src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ strftime_now('%Y') }}";
    kvlm_template *t = kvlm_template_parse(src, strlen(src), &err);
    assert_non_null(t);
    char *out = NULL;
    size_t len = 0;
    kvlm_template_opts o = {.now = 1700000000};
    assert_int_equal(kvlm_template_render_opts(t, "{\"bos_token\": \"<s>\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}",
                                               &o, &out, &len, &err), 0);
    assert_string_equal(out, "<s>[user] x2023");
    assert_int_equal(len, strlen(out));
    free(out);
    assert_int_equal(kvlm_template_render(t, NULL, &out, &len, &err), 0); /* no variables */
    free(out);
    assert_int_equal(kvlm_template_render(t, "[1]", &out, &len, &err), KVLM_EINVAL);
    assert_non_null(strstr(err.msg, "JSON object"));
    assert_int_equal(kvlm_template_render(t, "{bad", &out, &len, &err), KVLM_EINVAL);
    assert_null(out);
    kvlm_template_free(t);
    assert_null(kvlm_template_parse("{% if %}", 8, &err));
    assert_non_null(strstr(err.msg, "line 1"));
    kvlm_template_free(NULL);
}

static void test_model_template(void **state) {
    (void)state;
    const char *path = tu_tmp_path(".gguf");
    kvlm_synth_params p = {.arch = KVLM_ARCH_LLAMA, .dim = 8, .hidden_dim = 16, .n_layers = 1, .n_heads = 2,
                           .n_kv_heads = 2, .vocab_size = 300, .n_ctx = 32, .seed = 1,
                           .chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"};
    kvlm_error err = {0};
    if (kvlm_model_synth(&p, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model_params mp = {.vocab_only = true};
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    assert_non_null(m);
    assert_string_equal(kvlm_model_chat_template(m, NULL), p.chat_template);
    assert_null(kvlm_model_chat_template(m, "tool_use"));
    assert_non_null(kvlm_token_piece(m, kvlm_token_bos(m)));
    assert_null(kvlm_token_piece(m, -1));
    assert_null(kvlm_token_piece(m, 1 << 30));
    kvlm_model_free(m);
    /* named templates (tokenizer.chat_template.NAME): written with the vocabulary, read back */
    m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    assert_int_equal(vocab_add_named_template(&m->vocab, "tool_use", 8, "{{ tools|tojson }}", 18), KVLM_OK);
    assert_int_equal(vocab_add_named_template(&m->vocab, "rag", 3, "{{ documents|length }}", 22), KVLM_OK);
    const char *path2 = tu_tmp_path(".gguf");
    assert_int_equal(kvlm_model_save_gguf(m, path2, -1, &err), 0);
    kvlm_model_free(m);
    m = kvlm_model_load(path2, &mp, &err);
    assert_non_null(m);
    assert_string_equal(kvlm_model_chat_template(m, NULL), p.chat_template);
    assert_string_equal(kvlm_model_chat_template(m, "tool_use"), "{{ tools|tojson }}");
    assert_string_equal(kvlm_model_chat_template(m, "rag"), "{{ documents|length }}");
    assert_null(kvlm_model_chat_template(m, "other"));
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_language), cmocka_unit_test(test_scopes),     cmocka_unit_test(test_errors),
        cmocka_unit_test(test_nesting),  cmocka_unit_test(test_limits),     cmocka_unit_test(test_sandbox),
        cmocka_unit_test(test_threads),  cmocka_unit_test(test_stack),      cmocka_unit_test(test_public_api),
        cmocka_unit_test(test_model_template),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
