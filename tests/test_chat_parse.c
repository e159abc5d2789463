/* tests/test_chat_parse: the tool-call and reasoning parsers (tok/chat_parse)
 * on hand-written model outputs of every family: calls, content and
 * reasoning; each text cut at every byte parses to what a stream may show
 * (the deltas add up to the whole parse); malformed calls stay content;
 * hostile input is bounded. With --roundtrip CASES.json it parses the texts
 * tests/helpers/toolcall_roundtrip.py rendered with the real templates and
 * prints the messages (tests/cli_toolcall_roundtrip.sh). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "helpers/testutil.h"
#include "engine/grammar.h"
#include "model/model.h"
#include "tok/tok.h"
#include "tok/tool_grammar.h"
#include "tok/chat_parse.h"
#include "tok/chat_parse_impl.h"

/* A tool-call grammar as the server makes it: tok/tool_grammar's text, compiled (engine/grammar). */
static kvlm_grammar *tool_grammar(const kvlm_model *m, const tok_chat_syntax *s, const char *tail, const json_t *tools,
                                      const char *only, bool lazy, bool parallel, kvlm_error *err) {
    tok_tool_gbnf t;
    kvlm_grammar *g = NULL;
    if (!tok_tool_gbnf_make(s, tail, tools, only, lazy, parallel, &t, err)) g = eng_tool_grammar_compile(m, &t, err);
    tok_tool_gbnf_free(&t);
    return g;
}

/* ---- streaming: the deltas of every prefix's parse, added up ---- */

typedef struct {
    char *content, *reasoning;
    int n;
    char *id[64], *name[64], *args[64];
} acc;

static char *cat(char *a, const char *b) {
    size_t la = a ? strlen(a) : 0, lb = strlen(b);
    char *r = realloc(a, la + lb + 1);
    memcpy(r + la, b, lb + 1);
    return r;
}

static void acc_apply(acc *a, const json_t *d) {
    const char *s;
    if ((s = json_string_value(json_object_get(d, "content")))) a->content = cat(a->content, s);
    if ((s = json_string_value(json_object_get(d, "reasoning_content")))) a->reasoning = cat(a->reasoning, s);
    size_t i;
    const json_t *tc;
    json_array_foreach(json_object_get(d, "tool_calls"), i, tc) {
        int k = (int)json_integer_value(json_object_get(tc, "index"));
        const json_t *fn = json_object_get(tc, "function");
        if (k == a->n && k < 64) {
            a->id[k] = strdup(json_string_value(json_object_get(tc, "id")));
            a->name[k] = strdup(json_string_value(json_object_get(fn, "name")));
            a->args[k] = strdup("");
            a->n++;
        }
        if (k < a->n && (s = json_string_value(json_object_get(fn, "arguments")))) a->args[k] = cat(a->args[k], s);
    }
}

static void acc_free(acc *a) {
    free(a->content);
    free(a->reasoning);
    for (int k = 0; k < a->n; k++) free(a->id[k]), free(a->name[k]), free(a->args[k]);
}

static bool same(const char *a, const char *b) { return !strcmp(a ? a : "", b ? b : ""); }

/* Parses every prefix of text (partial), then the whole, adding up the
 * deltas; NULL when they give the whole parse, else what differs. */
static const char *stream_check(const tok_chat_syntax *s, const tok_chat_parse_opts *o0, const char *text, size_t n,
                                json_t **final_out) {
    static char why[512];
    tok_chat_parse_opts o = *o0;
    kvlm_error err = {0};
    acc a = {0};
    json_t *prev = NULL;
    why[0] = 0;
    for (size_t len = 0; len <= n && !why[0]; len++) {
        o.partial = len < n;
        json_t *m = tok_chat_parse(s, &o, text, len, &err);
        if (!m) {
            snprintf(why, sizeof why, "parse failed at %zu: %.200s", len, err.msg);
            break;
        }
        json_t *d = tok_chat_delta(prev, m);
        if (d) acc_apply(&a, d);
        json_decref(d);
        /* what was shown never changes: each parse extends the sum */
        const char *c = json_string_value(json_object_get(m, "content"));
        if (c && a.content && strncmp(c, a.content, strlen(a.content)))
            snprintf(why, sizeof why, "content at %zu: '%.100s' does not extend '%.100s'", len, c, a.content);
        if (json_array_size(json_object_get(m, "tool_calls")) < (size_t)a.n)
            snprintf(why, sizeof why, "at %zu: %zu calls after %d were shown", len,
                     json_array_size(json_object_get(m, "tool_calls")), a.n);
        json_decref(prev);
        prev = m;
    }
    if (!why[0]) {
        const json_t *calls = json_object_get(prev, "tool_calls");
        if (!same(a.content, json_string_value(json_object_get(prev, "content"))))
            snprintf(why, sizeof why, "content streamed '%.150s', whole '%.150s'", a.content ? a.content : "",
                     json_string_value(json_object_get(prev, "content")));
        else if (!same(a.reasoning, json_string_value(json_object_get(prev, "reasoning_content"))))
            snprintf(why, sizeof why, "reasoning streamed '%.150s', whole '%.150s'", a.reasoning ? a.reasoning : "",
                     json_string_value(json_object_get(prev, "reasoning_content")));
        else if ((size_t)a.n != json_array_size(calls))
            snprintf(why, sizeof why, "%d calls streamed, %zu whole", a.n, json_array_size(calls));
        for (int k = 0; k < a.n && !why[0]; k++) {
            const json_t *tc = json_array_get(calls, (size_t)k), *fn = json_object_get(tc, "function");
            if (!same(a.id[k], json_string_value(json_object_get(tc, "id"))) ||
                !same(a.name[k], json_string_value(json_object_get(fn, "name"))) ||
                !same(a.args[k], json_string_value(json_object_get(fn, "arguments"))))
                snprintf(why, sizeof why, "call %d streamed %s %s '%.150s', whole %s", k, a.id[k], a.name[k],
                         a.args[k], json_string_value(json_object_get(fn, "arguments")));
        }
    }
    acc_free(&a);
    if (final_out) *final_out = prev;
    else json_decref(prev);
    return why[0] ? why : NULL;
}

/* ---- --roundtrip: the texts the real templates rendered ---- */

static int roundtrip(const char *path) {
    json_error_t je;
    json_t *cases = json_load_file(path, 0, &je);
    if (!cases) {
        fprintf(stderr, "%s: %s\n", path, je.text);
        return 2;
    }
    json_t *out = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        kvlm_error err = {0};
        tok_chat_syntax *s = tok_chat_syntax_new(json_string_value(json_object_get(c, "template")),
                                                 json_string_value(json_object_get(c, "parser")), TOK_REASONING_AUTO,
                                                 &err);
        if (!s) {
            fprintf(stderr, "%s\n", err.msg);
            return 2;
        }
        const char *text = json_string_value(json_object_get(c, "text"));
        tok_chat_parse_opts o = {.prompt_tail = json_string_value(json_object_get(c, "prompt_tail")),
                                 .tools = json_object_get(c, "tools"), .id_seed = 42};
        json_t *m = NULL;
        const char *why = stream_check(s, &o, text, strlen(text), &m);
        json_t *r = json_pack("{s:O, s:s, s:o}", "id", json_object_get(c, "id"), "syntax", tok_chat_syntax_name(s),
                              "message", m);
        if (why) json_object_set_new(r, "stream_error", json_string(why));
        json_array_append_new(out, r);
        tok_chat_syntax_free(s);
    }
    char *dump = json_dumps(out, JSON_INDENT(1) | JSON_ENSURE_ASCII);
    puts(dump);
    free(dump);
    json_decref(out);
    json_decref(cases);
    return 0;
}

/* ---- unit tests ---- */

static json_t *g_tools;

/* Two tools: get_weather(city: string, days: integer, details: object),
 * search(query: string, limit: number, exact: boolean). */
static int setup(void **state) {
    (void)state;
    g_tools = json_loads(
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"},\"details\":{\"type\":\"object\"}},"
        "\"required\":[\"city\"]}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"query\":{\"type\":\"string\"},\"limit\":{\"type\":\"number\"},\"exact\":{\"type\":\"boolean\"}}}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"python\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"code\":{\"type\":\"string\"}}}}}]",
        0, NULL);
    return g_tools ? 0 : -1;
}
static int teardown(void **state) {
    (void)state;
    json_decref(g_tools);
    return 0;
}

typedef struct {
    const char *parser;     /* a --tool-call-parser name, or "@template text" */
    const char *tail;       /* the prompt's end */
    const char *text;
    const char *content;    /* NULL: null/empty */
    const char *reasoning;
    const char *calls[3][3]; /* name, arguments (compact JSON), id (or NULL: any) */
} pcase;

static tok_chat_syntax *syntax_of(const char *parser, int rf) {
    kvlm_error err = {0};
    tok_chat_syntax *s = parser[0] == '@' ? tok_chat_syntax_new(parser + 1, NULL, rf, &err)
                                          : tok_chat_syntax_new(NULL, parser, rf, &err);
    if (!s) fail_msg("%s: %s", parser, err.msg);
    return s;
}

static void check_case(const pcase *c) {
    tok_chat_syntax *s = syntax_of(c->parser, TOK_REASONING_AUTO);
    tok_chat_parse_opts o = {.prompt_tail = c->tail, .tools = g_tools, .id_seed = 7};
    json_t *m = NULL;
    const char *why = stream_check(s, &o, c->text, strlen(c->text), &m);
    if (why) fail_msg("%s on '%s': %s", c->parser, c->text, why);
    const char *content = json_string_value(json_object_get(m, "content"));
    if (!same(content, c->content)) fail_msg("%s on '%s': content '%s', expected '%s'", c->parser, c->text, content, c->content);
    const char *r = json_string_value(json_object_get(m, "reasoning_content"));
    if (!same(r, c->reasoning)) fail_msg("%s on '%s': reasoning '%s', expected '%s'", c->parser, c->text, r, c->reasoning);
    const json_t *calls = json_object_get(m, "tool_calls");
    size_t n = 0;
    while (n < 3 && c->calls[n][0]) n++;
    if (json_array_size(calls) != n)
        fail_msg("%s on '%s': %zu calls, expected %zu", c->parser, c->text, json_array_size(calls), n);
    for (size_t k = 0; k < n; k++) {
        const json_t *tc = json_array_get(calls, k), *fn = json_object_get(tc, "function");
        const char *nm = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        const char *id = json_string_value(json_object_get(tc, "id"));
        if (!same(nm, c->calls[k][0]) || !same(args, c->calls[k][1]))
            fail_msg("%s on '%s': call %zu %s %s, expected %s %s", c->parser, c->text, k, nm, args, c->calls[k][0],
                     c->calls[k][1]);
        if (c->calls[k][2] && !same(id, c->calls[k][2]))
            fail_msg("%s: call %zu id %s, expected %s", c->parser, k, id, c->calls[k][2]);
        assert_string_equal(json_string_value(json_object_get(tc, "type")), "function");
        json_t *parsed = json_loads(args, 0, NULL);
        if (!json_is_object(parsed)) fail_msg("%s: arguments '%s' are not a JSON object", c->parser, args);
        json_decref(parsed);
    }
    json_decref(m);
    tok_chat_syntax_free(s);
}

/* (the case tables leave trailing fields out: NULL, no calls) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#define W "get_weather"
#define A1 "{\"city\":\"Paris\",\"days\":2}"

/* Each family on what its models write: calls, content around them,
 * reasoning, and whole and cut at every byte. */
static void test_families(void **state) {
    (void)state;
    static const pcase cases[] = {
        /* Hermes / Qwen 2.5 / Qwen 3 */
        {"hermes", "", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
         NULL, NULL, {{W, A1}}},
        {"hermes", "", "Sure.\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":2}}\n</tool_call>\n"
                       "<tool_call>\n{\"arguments\": {\"query\": \"x\"}, \"name\": \"search\"}\n</tool_call>",
         "Sure.", NULL, {{W, A1}, {"search", "{\"query\":\"x\"}"}}},
        {"hermes", "", "<tool_call>{\"name\": \"search\", \"arguments\": \"{\\\"query\\\": \\\"q\\\"}\"}</tool_call>", NULL,
         NULL, {{"search", "{\"query\":\"q\"}"}}},
        {"@<tool_call><think>", "<|im_start|>assistant\n",
         "<think>\nI should look.\n</think>\n\n<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>", NULL,
         "I should look.", {{"search", "{}"}}},
        {"@<tool_call><think>", "<|im_start|>assistant\n<think>\n", "Thinking...\n</think>\n\nThe answer is 4.",
         "The answer is 4.", "Thinking..."},
        {"@<tool_call><think>", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Plain answer.", "Plain answer.", NULL},
        {"@<tool_call><think>", "<|im_start|>assistant\n<think>\n", "Still thinking", NULL, "Still thinking"},
        /* Qwen3-Coder / Qwen3.5 XML, typed by the schema */
        {"qwen3-coder", "",
         "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n<parameter=details>\n{\"wind\": true}\n</parameter>\n</function>\n</tool_call>",
         "I'll check.", NULL, {{W, "{\"city\":\"São Paulo\",\"days\":3,\"details\":{\"wind\":true}}"}}},
        {"qwen3-coder", "",
         "<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n\n</parameter>\n<parameter=exact>\nTrue\n"
         "</parameter>\n<parameter=limit>\n2.5\n</parameter>\n<parameter=other>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
         NULL, NULL, {{"search", "{\"query\":\"line one\\nline two\\n\",\"exact\":true,\"limit\":2.5,\"other\":[1,2]}"}}},
        {"qwen3-coder", "", "<tool_call>\n<function=search>\n</function>\n</tool_call>", NULL, NULL, {{"search", "{}"}}},
        {"seed-oss", "", "<seed:think>hmm</seed:think>Ok.<seed:tool_call>\n<function=search>\n<parameter=query>a<b</parameter>\n"
                         "</function>\n</seed:tool_call>",
         "Ok.", "hmm", {{"search", "{\"query\":\"a<b\"}"}}},
        /* Llama 3.x */
        {"llama3", "", "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 2}}", NULL, NULL, {{W, A1}}},
        {"llama3", "", "{\"type\": \"function\", \"name\": \"search\", \"parameters\": {\"query\": \"q\"}}; {\"name\": "
                       "\"search\", \"parameters\": {\"query\": \"r\"}}",
         NULL, NULL, {{"search", "{\"query\":\"q\"}"}, {"search", "{\"query\":\"r\"}"}}},
        {"llama3", "", "{\"name\": \"unknown_tool\", \"parameters\": {}}", "{\"name\": \"unknown_tool\", \"parameters\": {}}"},
        {"llama3", "", "{\"answer\": 42}", "{\"answer\": 42}"},
        {"llama3", "", "Hello {there}", "Hello {there}"},
        {"llama3", "", "<|python_tag|>brave_search.call(query=\"kvlm\", count=3)", NULL, NULL,
         {{"brave_search", "{\"query\":\"kvlm\",\"count\":3}"}}},
        {"llama3", "", "<|python_tag|>print(1 + 1)\n", NULL, NULL, {{"python", "{\"code\":\"print(1 + 1)\"}"}}},
        /* Mistral */
        {"mistral", "", "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"days\": 2}[TOOL_CALLS]search[ARGS]{}", NULL,
         NULL, {{W, A1}, {"search", "{}"}}},
        {"mistral", "", "Let me see.[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{\"query\": \"q\"}", "Let me see.", NULL,
         {{"search", "{\"query\":\"q\"}", "a1B2c3D4e"}}},
        {"mistral-nemo", "", "[TOOL_CALLS][{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}, \"id\": \"abcdefghi\"}]",
         NULL, NULL, {{"search", "{\"query\":\"q\"}"}}},
        {"@[TOOL_CALLS][ARGS][THINK]", "", "[THINK]Plan.[/THINK]Answer.", "Answer.", "Plan."},
        /* DeepSeek */
        {"deepseek-r1", "<｜Assistant｜><think>\n",
         "I need data.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         "{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
         "{\"query\": \"q\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         NULL, "I need data.", {{W, A1}, {"search", "{\"query\":\"q\"}"}}},
        {"deepseek-r1", "", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}\n```<｜tool▁call▁end｜>", NULL, NULL,
         {{"search", "{}"}}},
        {"deepseek-v3.1", "<｜Assistant｜><think></think>",
         "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "Checking.", NULL, {{W, A1}}},
        {"deepseek-v4", "<｜Assistant｜></think>",
         "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris"
         "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
         "<｜DSML｜invoke name=\"search\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
         NULL, NULL, {{W, A1}, {"search", "{}"}}},
        /* Kimi K2: its own ids */
        {"kimi-k2", "", "Ok.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                        "{\"city\": \"Paris\", \"days\": 2}<|tool_call_end|><|tool_call_begin|>functions.search:1"
                        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
         "Ok.", NULL, {{W, A1, "functions.get_weather:0"}, {"search", "{}", "functions.search:1"}}},
        /* Command R */
        {"command-r-plus", "", "I will search.\nAction:\n```json\n[\n    {\n        \"tool_name\": \"search\",\n        "
                               "\"parameters\": {\"query\": \"q\"}\n    }\n]\n```",
         "I will search.", NULL, {{"search", "{\"query\":\"q\"}"}}},
        {"command-r7b", "<|CHATBOT_TOKEN|>", "<|START_THINKING|>Plan it.<|END_THINKING|><|START_ACTION|>[\n    "
                                             "{\"tool_call_id\": \"0\", \"tool_name\": \"search\", \"parameters\": {\"query\": \"q\"}}\n]<|END_ACTION|>",
         NULL, "Plan it.", {{"search", "{\"query\":\"q\"}"}}},
        {"command-r7b", "<|CHATBOT_TOKEN|><|START_THINKING|>", "Hmm.<|END_THINKING|><|START_TEXT|>Hi there.<|END_TEXT|>",
         "Hi there.", "Hmm."},
        /* gpt-oss */
        {"gpt-oss", "<|start|>assistant",
         "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
         "<|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}",
         NULL, "Need weather.", {{W, A1}}},
        {"gpt-oss", "<|start|>assistant",
         "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|><|start|>assistant"
         "<|channel|>final<|message|>Done.",
         "Done.", "A.\n\nB."},
        {"gpt-oss", "<|start|>assistant", " to=functions.search<|channel|>commentary json<|message|>{\"query\": \"q\"}", NULL,
         NULL, {{"search", "{\"query\":\"q\"}"}}},
        /* GLM */
        {"glm-4.5", "<|assistant|>",
         "\n<think>Plan.</think>\nLooking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
         "Looking.", "Plan.", {{W, A1}}},
        {"glm-4.5", "<|assistant|><think>", "P.</think><tool_call>search<arg_key>query</arg_key><arg_value>1 2</arg_value>"
                                            "<arg_key>exact</arg_key><arg_value>false</arg_value></tool_call>",
         NULL, "P.", {{"search", "{\"query\":\"1 2\",\"exact\":false}"}}},
        /* Gemma 4 */
        {"gemma4", "<|turn>model\n",
         "<|channel>thought\nLook it up.<channel|><|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2,details:"
         "{hours:[6,12],wind:true}}<tool_call|>",
         NULL, "Look it up.", {{W, "{\"city\":\"Paris\",\"days\":2,\"details\":{\"hours\":[6,12],\"wind\":true}}"}}},
        /* Functionary */
        {"functionary-v3.1", "", "Sure<function=get_weather>{\"city\": \"Paris\", \"days\": 2}</function><|python_tag|>x = 1",
         "Sure", NULL, {{W, A1}, {"python", "{\"code\":\"x = 1\"}"}}},
        {"functionary-v3.2", "<|start_header_id|>assistant<|end_header_id|>\n\n>>>",
         "all\nLet me check.>>>get_weather\n{\"city\": \"Paris\", \"days\": 2}>>>python\nprint(2)", "Let me check.", NULL,
         {{W, A1}, {"python", "{\"code\":\"print(2)\"}"}}},
        {"functionary-v3.2", ">>>", "all\nJust text.", "Just text."},
        /* others */
        {"firefunction-v2", "", "Here. functools[{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}]", "Here.", NULL,
         {{"search", "{\"query\":\"q\"}"}}},
        {"granite", "", "<|tool_call|>[{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}]", NULL, NULL,
         {{"search", "{\"query\":\"q\"}"}}},
        {"apriel", "<|begin_assistant|>\nHere are my reasoning steps:\n",
         "Think.\n[BEGIN FINAL RESPONSE]\nCalling.\n<tool_calls>[{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}]</tool_calls>",
         "Calling.", "Think.", {{"search", "{\"query\":\"q\"}"}}},
        {"gigachat3", "assistant<|role_sep|>\n",
         "Ok<|message_sep|>\n\nfunction call<|role_sep|>\n{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}", "Ok", NULL,
         {{"search", "{\"query\":\"q\"}"}}},
        {"mirothinker", "",
         "Searching.\n<use_mcp_tool>\n<server_name>search_and_scrape_webpage</server_name>\n<tool_name>search</tool_name>\n"
         "<arguments>\n{\"query\": \"q\"}\n</arguments>\n</use_mcp_tool>",
         "Searching.", NULL, {{"search", "{\"query\":\"q\"}"}}},
        {"lfm2", "", "<|tool_call_start|>[get_weather(city='Paris', days=2), search(query=\"q\", exact=True)]<|tool_call_end|>Done.",
         "Done.", NULL, {{W, A1}, {"search", "{\"query\":\"q\",\"exact\":true}"}}},
        {"pythonic", "", "[search(query='a\\'b', limit=1.5, other=None)]", NULL, NULL,
         {{"search", "{\"query\":\"a'b\",\"limit\":1.5,\"other\":null}"}}},
        /* generic: a bare JSON call (its name a tool), or Hermes's tags */
        {"generic", "", "{\"name\": \"search\", \"arguments\": {\"query\": \"q\"}}", NULL, NULL, {{"search", "{\"query\":\"q\"}"}}},
        {"generic", "", "[{\"name\": \"search\", \"arguments\": {}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}]",
         NULL, NULL, {{"search", "{}"}, {W, A1}}},
        {"generic", "", "{\"result\": [1, 2]}", "{\"result\": [1, 2]}"},
        {"generic", "", "<think>x</think>\nHi <tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>", "Hi", "x",
         {{"search", "{}"}}},
        {"none", "", "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>",
         "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(&cases[i]);
}

/* Malformed calls and cut ones stay in content as written, in a whole parse;
 * what a partial parse showed as content is still there (never a call). */
static void test_malformed(void **state) {
    (void)state;
    static const pcase cases[] = {
        {"hermes", "", "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": }}</tool_call>",
         "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": }}</tool_call>"},
        {"hermes", "", "Hi <tool_call>{\"name\": \"search\", \"argu", "Hi <tool_call>{\"name\": \"search\", \"argu"},
        {"hermes", "", "<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>"},
        {"hermes", "", "<tool_call>{\"name\": \"search\", \"arguments\": [1]}</tool_call>",
         "<tool_call>{\"name\": \"search\", \"arguments\": [1]}</tool_call>"},
        {"hermes", "", "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",
         "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>"},
        {"mistral", "", "[TOOL_CALLS]search[ARGS]{\"a\": tru", "[TOOL_CALLS]search[ARGS]{\"a\": tru"},
        {"qwen3-coder", "", "<tool_call>\n<function=search>\n<parameter=query>\nq", "<tool_call>\n<function=search>\n<parameter=query>\nq"},
        {"gemma4", "", "<|tool_call>call:search{query:<|\"|>q}<tool_call|>", "<|tool_call>call:search{query:<|\"|>q}<tool_call|>"},
        {"kimi-k2", "", "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{]",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const pcase *c = &cases[i];
        tok_chat_syntax *s = syntax_of(c->parser, TOK_REASONING_AUTO);
        tok_chat_parse_opts o = {.tools = g_tools};
        kvlm_error err = {0};
        size_t n = strlen(c->text);
        json_t *whole = tok_chat_parse(s, &o, c->text, n, &err);
        assert_non_null(whole);
        const char *wc = json_string_value(json_object_get(whole, "content"));
        if (!same(wc, c->content)) fail_msg("%s on '%s': content '%s'", c->parser, c->text, wc);
        assert_int_equal(json_array_size(json_object_get(whole, "tool_calls")), 0);
        o.partial = true;
        for (size_t len = 0; len < n; len++) { /* content shown while cut is the whole's beginning */
            json_t *m = tok_chat_parse(s, &o, c->text, len, &err);
            assert_non_null(m);
            const char *pc = json_string_value(json_object_get(m, "content"));
            if (pc && strncmp(pc, wc, strlen(pc))) fail_msg("%s cut at %zu: content '%s' is not the whole's start", c->parser, len, pc);
            json_decref(m);
        }
        json_decref(whole);
        tok_chat_syntax_free(s);
    }
}

#pragma GCC diagnostic pop

/* Hostile text: nesting far past the limit, a huge argument, random bytes
 * around markers: bounded, never a crash, always a message. */
static void test_hostile(void **state) {
    (void)state;
    enum { DEEP = 100000, HUGE = 1 << 20 };
    char *t = malloc(DEEP * 2 + 200);
    int n = sprintf(t, "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": ");
    for (int i = 0; i < DEEP; i++) t[n++] = '[';
    for (int i = 0; i < DEEP; i++) t[n++] = ']';
    n += sprintf(t + n, "}}</tool_call>");
    tok_chat_syntax *s = syntax_of("hermes", TOK_REASONING_AUTO);
    tok_chat_parse_opts o = {.tools = g_tools};
    kvlm_error err = {0};
    json_t *m = tok_chat_parse(s, &o, t, (size_t)n, &err);
    assert_non_null(m);
    assert_int_equal(json_array_size(json_object_get(m, "tool_calls")), 0); /* past the depth limit: content */
    assert_int_equal(strlen(json_string_value(json_object_get(m, "content"))), (size_t)n);
    json_decref(m);
    free(t);
    /* a 1 MiB string argument, streamed in pieces */
    t = malloc(HUGE + 200);
    n = sprintf(t, "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"");
    for (int i = 0; i < HUGE; i++) t[n++] = (char)('a' + i % 26);
    n += sprintf(t + n, "\"}}</tool_call>");
    o.partial = true;
    m = tok_chat_parse(s, &o, t, (size_t)n - 20, &err);
    assert_non_null(m);
    const char *args = json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(m, "tool_calls"), 0), "function"), "arguments"));
    assert_non_null(args);
    assert_true(strlen(args) > HUGE - 100);
    json_decref(m);
    o.partial = false;
    m = tok_chat_parse(s, &o, t, (size_t)n, &err);
    assert_int_equal(json_array_size(json_object_get(m, "tool_calls")), 1);
    json_decref(m);
    free(t);
    tok_chat_syntax_free(s);
    /* random bytes around every family's markers */
    static const char *const bits[] = {"<tool_call>", "</tool_call>", "{", "}", "[", "]", "\"", ":", ",", "\\", "<|",
                                       "|>", "[TOOL_CALLS]", "[ARGS]", "<think>", "</think>", "<function=", ">",
                                       "<parameter=", "</parameter>", "</function>", "<|channel|>", "<|message|>",
                                       "<|end|>", "<|start|>", " to=functions.x", "\xe2\x80\x94", "\xc3", "null",
                                       "name", "arguments", ">>>", "\n", "<|\"|>", "(", ")", "=", "'"};
    const char *names[] = {"hermes", "qwen3-coder", "llama3", "mistral", "deepseek-r1", "deepseek-v3.1", "deepseek-v4",
                           "kimi-k2", "command-r-plus", "command-r7b", "firefunction-v2", "granite", "apriel",
                           "gigachat3", "functionary-v3.1", "functionary-v3.2", "gpt-oss", "seed-oss", "glm-4.5",
                           "mirothinker", "gemma4", "pythonic", "lfm2", "generic"};
    uint64_t x = 88172645463325252ull;
    int rounds = tu_quick() ? 60 : 400;
    for (size_t f = 0; f < sizeof names / sizeof names[0]; f++) {
        s = syntax_of(names[f], TOK_REASONING_AUTO);
        for (int r = 0; r < rounds; r++) {
            char buf[600];
            size_t len = 0;
            int pieces = 1 + (int)(x % 24);
            for (int k = 0; k < pieces; k++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                const char *b = bits[x % (sizeof bits / sizeof bits[0])];
                if (len + strlen(b) < sizeof buf) memcpy(buf + len, b, strlen(b)), len += strlen(b);
            }
            for (int partial = 0; partial < 2; partial++) {
                o.partial = partial;
                for (size_t cut = 0; cut <= len; cut += 1 + len / 8) {
                    m = tok_chat_parse(s, &o, buf, cut, &err);
                    assert_non_null(m);
                    json_decref(m);
                }
            }
        }
        tok_chat_syntax_free(s);
    }
}

/* reasoning_format none: the reasoning stays in content as written. */
static void test_reasoning_none(void **state) {
    (void)state;
    tok_chat_syntax *s = syntax_of("@<tool_call><think>", TOK_REASONING_NONE);
    tok_chat_parse_opts o = {.tools = g_tools};
    kvlm_error err = {0};
    const char *t = "<think>plan</think>\nHello <tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>";
    json_t *m = tok_chat_parse(s, &o, t, strlen(t), &err);
    assert_string_equal(json_string_value(json_object_get(m, "content")), "<think>plan</think>\nHello");
    assert_null(json_object_get(m, "reasoning_content"));
    assert_int_equal(json_array_size(json_object_get(m, "tool_calls")), 1);
    json_decref(m);
    o.prompt_tail = "<think>\n";
    t = "plan</think>answer";
    m = tok_chat_parse(s, &o, t, strlen(t), &err);
    assert_string_equal(json_string_value(json_object_get(m, "content")), "plan</think>answer");
    json_decref(m);
    const char *why = stream_check(s, &o, t, strlen(t), NULL);
    if (why) fail_msg("%s", why);
    tok_chat_syntax_free(s);
}

/* Which syntax each template picks (by its markers), names and aliases. */
static void test_detect(void **state) {
    (void)state;
    static const char *const pairs[][2] = {
        {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"},
        {"Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"},
        {"Qwen-Qwen3-0.6B.jinja", "hermes"},
        {"Qwen3.5-4B.jinja", "qwen3-coder"},
        {"stepfun-ai-Step-3.5-Flash.jinja", "qwen3-coder"},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"},
        {"meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-nemo"},
        {"Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"},
        {"unsloth-mistral-Devstral-Small-2507.jinja", "mistral"},
        {"mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral"},
        {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1"},
        {"deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1"},
        {"deepseek-ai-DeepSeek-V4.jinja", "deepseek-v4"},
        {"meetkai-functionary-medium-v3.1.jinja", "functionary-v3.1"},
        {"meetkai-functionary-medium-v3.2.jinja", "functionary-v3.2"},
        {"CohereForAI-c4ai-command-r-plus-tool_use.jinja", "command-r-plus"},
        {"CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b"},
        {"Cohere2MoE.jinja", "command-r7b"},
        {"openai-gpt-oss-120b.jinja", "gpt-oss"},
        {"moonshotai-Kimi-K2.jinja", "kimi-k2"},
        {"GLM-4.6.jinja", "glm-4.5"},
        {"GLM-5.2.jinja", "glm-4.5"},
        {"google-gemma-4-31B-it-interleaved.jinja", "gemma4"},
        {"fireworks-ai-llama-3-firefunction-v2.jinja", "firefunction-v2"},
        {"LFM2-8B-A1B.jinja", "lfm2"},
        {"Apriel-1.6-15b-Thinker-fixed.jinja", "apriel"},
        {"unsloth-Apriel-1.5.jinja", "apriel-1.5"},
        {"GigaChat3-10B-A1.8B.jinja", "gigachat3"},
        {"MiroThinker.jinja", "mirothinker"},
        {"HuggingFaceTB-SmolLM3-3B.jinja", "generic"},
        {"google-gemma-2-2b-it.jinja", "generic"},
    };
    char path[512];
    const char *dir = getenv("KVLM_TEMPLATES");
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir ? dir : KVLM_TEMPLATES_DIR, pairs[i][0]);
        char *src = tu_read_file(path, NULL);
        if (!src) {
            printf("SKIP: no %s\n", pairs[i][0]);
            continue;
        }
        kvlm_error err = {0};
        tok_chat_syntax *s = tok_chat_syntax_new(src, NULL, TOK_REASONING_AUTO, &err);
        assert_non_null(s);
        if (strcmp(tok_chat_syntax_name(s), pairs[i][1])) fail_msg("%s: %s, expected %s", pairs[i][0], tok_chat_syntax_name(s), pairs[i][1]);
        tok_chat_syntax_free(s);
        free(src);
    }
    kvlm_error err = {0};
    tok_chat_syntax *s = tok_chat_syntax_new(NULL, "Qwen3_Coder", TOK_REASONING_AUTO, &err);
    assert_string_equal(tok_chat_syntax_name(s), "qwen3-coder");
    tok_chat_syntax_free(s);
    s = tok_chat_syntax_new(NULL, "llama3_json", TOK_REASONING_AUTO, &err);
    assert_string_equal(tok_chat_syntax_name(s), "llama3");
    tok_chat_syntax_free(s);
    assert_null(tok_chat_syntax_new(NULL, "nope", TOK_REASONING_AUTO, &err));
    assert_int_equal(err.code, KVLM_EINVAL);
    assert_non_null(strstr(err.msg, "hermes"));
    assert_non_null(strstr(err.msg, "'nope'"));
    assert_null(tok_chat_syntax_new(NULL, NULL, 7, &err));
}

/* The deltas: a call's id, type and name first, its arguments appended. */
static void test_delta(void **state) {
    (void)state;
    json_t *a = json_loads("{\"content\": \"Hi\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\": "
                           "{\"name\": \"f\", \"arguments\": \"{\\\"a\\\":\"}}]}", 0, NULL);
    json_t *b = json_loads("{\"content\": \"Hi\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\": "
                           "{\"name\": \"f\", \"arguments\": \"{\\\"a\\\":1}\"}}, {\"id\": \"c2\", \"type\": \"function\", "
                           "\"function\": {\"name\": \"g\", \"arguments\": \"\"}}]}", 0, NULL);
    json_t *d = tok_chat_delta(NULL, a);
    char *t = json_dumps(d, JSON_COMPACT | JSON_SORT_KEYS);
    assert_string_equal(t, "{\"content\":\"Hi\",\"tool_calls\":[{\"function\":{\"arguments\":\"{\\\"a\\\":\",\"name\":\"f\"},"
                           "\"id\":\"c1\",\"index\":0,\"type\":\"function\"}]}");
    free(t);
    json_decref(d);
    d = tok_chat_delta(a, b);
    t = json_dumps(d, JSON_COMPACT | JSON_SORT_KEYS);
    assert_string_equal(t, "{\"tool_calls\":[{\"function\":{\"arguments\":\"1}\"},\"index\":0},{\"function\":{\"arguments\":"
                           "\"\",\"name\":\"g\"},\"id\":\"c2\",\"index\":1,\"type\":\"function\"}]}");
    free(t);
    json_decref(d);
    assert_null(tok_chat_delta(b, b));
    json_decref(a);
    json_decref(b);
}

/* Ids: OpenAI's shape (call_ and 24 alphanumerics), Mistral's 9; the same
 * for the same seed and index, others for another seed. */
static void test_ids(void **state) {
    (void)state;
    const char *t = "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>";
    tok_chat_syntax *s = syntax_of("hermes", TOK_REASONING_AUTO);
    tok_chat_parse_opts o = {.id_seed = 1};
    kvlm_error err = {0};
    json_t *m1 = tok_chat_parse(s, &o, t, strlen(t), &err), *m2 = tok_chat_parse(s, &o, t, strlen(t), &err);
    o.id_seed = 2;
    json_t *m3 = tok_chat_parse(s, &o, t, strlen(t), &err);
    const char *i10 = json_string_value(json_object_get(json_array_get(json_object_get(m1, "tool_calls"), 0), "id"));
    const char *i11 = json_string_value(json_object_get(json_array_get(json_object_get(m1, "tool_calls"), 1), "id"));
    const char *i20 = json_string_value(json_object_get(json_array_get(json_object_get(m2, "tool_calls"), 0), "id"));
    const char *i30 = json_string_value(json_object_get(json_array_get(json_object_get(m3, "tool_calls"), 0), "id"));
    assert_int_equal(strlen(i10), 29);
    assert_memory_equal(i10, "call_", 5);
    for (int k = 5; k < 29; k++) assert_true(isalnum((unsigned char)i10[k]));
    assert_string_equal(i10, i20);
    assert_string_not_equal(i10, i11);
    assert_string_not_equal(i10, i30);
    json_decref(m1);
    json_decref(m2);
    json_decref(m3);
    tok_chat_syntax_free(s);
    s = syntax_of("mistral", TOK_REASONING_AUTO);
    t = "[TOOL_CALLS]search[ARGS]{}";
    m1 = tok_chat_parse(s, &o, t, strlen(t), &err);
    const char *id = json_string_value(json_object_get(json_array_get(json_object_get(m1, "tool_calls"), 0), "id"));
    assert_int_equal(strlen(id), 9);
    for (int k = 0; k < 9; k++) assert_true(isalnum((unsigned char)id[k]));
    json_decref(m1);
    tok_chat_syntax_free(s);
}

/* ---- grammars: what a grammar lets out parses as valid calls ---- */

/* A token's text, a special token's too (what a tool grammar reads). */
static int tok_token_to_bytes_any(const kvlm_model *m, int32_t t, char *buf, size_t cap) {
    int k = kvlm_token_to_text(m, t, buf, cap);
    return k ? k : tok_token_to_bytes(m->tok, t, true, buf, cap);
}

static const char *k_gtools =
    "[{\"type\":\"function\",\"function\":{\"name\":\"set\",\"parameters\":{\"type\":\"object\",\"properties\":{"
    "\"mode\":{\"enum\":[\"on\",\"off\"]},\"level\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":9},"
    "\"flag\":{\"type\":\"boolean\"}},\"required\":[\"mode\",\"level\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"ping\",\"parameters\":{\"type\":\"object\",\"properties\":{"
    "\"n\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":3}},\"required\":[\"n\"]}}}]";

/* A call's arguments as the schema above allows (checked apart from the grammar). */
static const char *args_fault(const char *name, const char *args) {
    json_t *a = json_loads(args, 0, NULL);
    const char *why = NULL;
    if (!json_is_object(a)) why = "not an object";
    else if (!strcmp(name, "set")) {
        const char *mode = json_string_value(json_object_get(a, "mode"));
        json_t *lv = json_object_get(a, "level"), *fl = json_object_get(a, "flag");
        if (!mode || (strcmp(mode, "on") && strcmp(mode, "off"))) why = "mode";
        else if (!json_is_integer(lv) || json_integer_value(lv) < 0 || json_integer_value(lv) > 9) why = "level";
        else if (fl && !json_is_boolean(fl)) why = "flag";
        else if (json_object_size(a) > 3 || (json_object_size(a) == 3 && !fl)) why = "other keys";
    } else if (!strcmp(name, "ping")) {
        json_t *n = json_object_get(a, "n");
        if (!json_is_integer(n) || json_integer_value(n) < 1 || json_integer_value(n) > 3 || json_object_size(a) != 1) why = "n";
    } else why = "unknown tool";
    json_decref(a);
    return why;
}

/* Draws tokens the grammar allows (uniformly, an end token often once the
 * text may end) after prefix; the text, or NULL when it did not end. */
static char *draw(const kvlm_model *m, const kvlm_grammar *g, const char *prefix, uint64_t *rs, int limit,
                  size_t *out_len) {
    int nv = kvlm_vocab_size(m);
    bool *al = malloc((size_t)nv);
    int32_t *cand = malloc((size_t)nv * sizeof *cand);
    gm *s = gm_new(g);
    size_t cap = 8192, len = strlen(prefix);
    char *text = malloc(cap);
    memcpy(text, prefix, len + 1);
    bool ended = gm_feed(s, prefix, (int)len) ? false : true;
    if (ended) fail_msg("the grammar refused the prefix '%s'", prefix);
    for (int step = 0; step < limit && !ended; step++) {
        int n = gm_allowed(s, al), k = 0, eog = -1;
        for (int t = 0; t < nv; t++)
            if (al[t]) {
                if (kvlm_token_is_eog(m, t)) eog = t;
                else cand[k++] = t;
            }
        assert_true(n > 0);
        *rs ^= *rs << 13, *rs ^= *rs >> 7, *rs ^= *rs << 17;
        if (eog >= 0 && (!k || *rs % 3 == 0)) {
            ended = true;
            break;
        }
        int32_t t = cand[*rs % (uint64_t)k];
        char buf[300];
        int l = tok_token_to_bytes_any(m, t, buf, sizeof buf);
        assert_true(gm_feed_token(s, t));
        if (len + (size_t)l + 1 > cap) text = realloc(text, cap *= 2);
        memcpy(text + len, buf, (size_t)l);
        text[len += (size_t)l] = 0;
    }
    gm_free(s);
    free(al);
    free(cand);
    if (!ended) {
        free(text);
        return NULL;
    }
    *out_len = len; /* (a byte token may have written a NUL) */
    return text;
}

static void test_tool_grammar(void **state) {
    (void)state;
    const char *path = tu_model_path("stories260K.gguf");
    TU_REQUIRE(path);
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    assert_non_null(m);
    json_t *tools = json_loads(k_gtools, 0, NULL);
    static const char *const fams[] = {"hermes", "qwen3-coder", "seed-oss", "llama3", "mistral", "mistral-nemo",
                                       "deepseek-r1", "deepseek-v3.1", "deepseek-v4", "kimi-k2", "command-r-plus",
                                       "command-r7b", "firefunction-v2", "granite", "apriel", "gigachat3",
                                       "functionary-v3.1", "functionary-v3.2", "gpt-oss", "glm-4.5", "mirothinker",
                                       "generic"};
    uint64_t rs = 0x9e3779b97f4a7c15ull;
    int runs = tu_quick() ? 4 : 12, total = 0;
    for (size_t f = 0; f < sizeof fams / sizeof *fams; f++) {
        tok_chat_syntax *s = tok_chat_syntax_new(NULL, fams[f], TOK_REASONING_AUTO, &err);
        assert_non_null(s);
        const char *tail = !strcmp(fams[f], "functionary-v3.2") ? ">>>" : !strcmp(fams[f], "gpt-oss") ? "<|start|>assistant" : "";
        for (int mode = 0; mode < 3; mode++) { /* required, required of one named, auto */
            bool lazy = mode == 2, parallel = mode == 0;
            kvlm_grammar *g = tool_grammar(m, s, tail, tools, mode == 1 ? "ping" : NULL, lazy, parallel, &err);
            if (!g) fail_msg("%s: %s", fams[f], err.msg);
            /* a required call comes after the reasoning the family writes (Apriel's always opens its
             * answer): given here, so that a uniform draw does not wander in it */
            char *prefix = malloc(256);
            prefix[0] = 0;
            if (!lazy && s->think_end && !s->f->own_reasoning)
                snprintf(prefix, 256, "%sPlan.%s\n", s->f->think_open ? "" : s->think_start, s->think_end);
            if (lazy) { /* the text free, then a call's first word */
                kvlm_grammar_trigger *tr;
                int nt;
                tok_chat_gbnf_tool gt = {.name = "set", .args_rule = "x"};
                char *gb = tok_chat_syntax_gbnf(s, &gt, 1, true, true, tail, &tr, &nt, &err);
                assert_non_null(gb);
                assert_true(nt > 0);
                free(gb);
                free(prefix);
                prefix = malloc(strlen(tr[0].word) + 128);
                sprintf(prefix, "%s%s", tr[0].at_start ? "" : "Sure.", tr[0].word);
                if (!strcmp(fams[f], "functionary-v3.2")) sprintf(prefix, "all\nSure.>>>set\n");
                if (!strcmp(fams[f], "gpt-oss")) sprintf(prefix, "<|channel|>final<|message|>Sure.<|end|><|start|>assistant to=functions.");
                if (!strcmp(fams[f], "apriel")) sprintf(prefix, "Plan.\n[BEGIN FINAL RESPONSE]\nSure.<tool_calls>");
                tok_chat_triggers_free(tr, nt);
            }
            int done = 0;
            for (int r = 0; r < runs; r++) {
                size_t tlen = 0;
                char *text = draw(m, g, prefix, &rs, 600, &tlen);
                if (!text) continue;
                done++;
                tok_chat_parse_opts o = {.prompt_tail = tail, .tools = tools};
                json_t *msg = tok_chat_parse(s, &o, text, tlen, &err);
                const json_t *calls = json_object_get(msg, "tool_calls");
                if (!json_array_size(calls)) fail_msg("%s mode %d: no call in '%s'", fams[f], mode, text);
                if (!parallel && json_array_size(calls) != 1) fail_msg("%s mode %d: %zu calls in '%s'", fams[f], mode, json_array_size(calls), text);
                size_t i;
                const json_t *c;
                json_array_foreach(calls, i, c) {
                    const char *nm = json_string_value(json_object_get(json_object_get(c, "function"), "name"));
                    const char *args = json_string_value(json_object_get(json_object_get(c, "function"), "arguments"));
                    const char *why = args_fault(nm, args);
                    if (why) fail_msg("%s mode %d: %s(%s): %s, in '%s'", fams[f], mode, nm, args, why, text);
                    if (mode == 1 && strcmp(nm, "ping")) fail_msg("%s: %s called, ping named", fams[f], nm);
                }
                const char *want = strstr(prefix, "Sure.") ? "Sure." : NULL;
                if (lazy && !same(json_string_value(json_object_get(msg, "content")), want))
                    fail_msg("%s auto: content '%s' in '%s'", fams[f], json_string_value(json_object_get(msg, "content")), text);
                json_decref(msg);
                free(text);
            }
            if (!done) fail_msg("%s mode %d: no draw ended in 600 tokens", fams[f], mode);
            total += done;
            free(prefix);
            kvlm_grammar_free(g);
        }
        tok_chat_syntax_free(s);
    }
    print_message("  %d drawn answers parsed as valid calls\n", total);
    /* required after reasoning: opened by the prompt, or optional */
    static const struct { const char *parser, *tail, *text; bool ok; } texts[] = {
        {"@<tool_call><think>", "<think>\n", "I will call.</think>\n\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"n\": 2}}\n</tool_call>", true},
        {"@<tool_call><think>", "<think>\n", "<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"n\": 2}}\n</tool_call>", false},
        {"@<tool_call><think>", "", "<think>x</think><tool_call>{\"name\": \"ping\", \"arguments\": {\"n\": 3}}</tool_call>", true},
        {"@<tool_call><think>", "", "<tool_call>{\"name\": \"ping\", \"arguments\": {\"n\": 3}}</tool_call>", true},
        {"@<tool_call><think>", "", "Hi <tool_call>{\"name\": \"ping\", \"arguments\": {\"n\": 3}}</tool_call>", false},
        {"@<tool_call><think>", "", "<tool_call>{\"name\": \"ping\", \"arguments\": {\"n\": 4}}</tool_call>", false},
        {"gpt-oss", "<|start|>assistant", "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>commentary "
                                          "to=functions.ping <|constrain|>json<|message|>{\"n\": 1}", true},
        {"gpt-oss", "<|start|>assistant", " to=functions.set<|channel|>commentary json<|message|>{\"mode\": \"on\", \"level\": 0}", true},
        {"gpt-oss", "<|start|>assistant", "<|channel|>final<|message|>no", false},
    };
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        tok_chat_syntax *s = syntax_of(texts[i].parser, TOK_REASONING_AUTO);
        kvlm_grammar *g = tool_grammar(m, s, texts[i].tail, tools, NULL, false, true, &err);
        assert_non_null(g);
        gm *st = gm_new(g);
        bool ok = gm_feed(st, texts[i].text, (int)strlen(texts[i].text));
        ok = ok && gm_done(st);
        if (ok != texts[i].ok) fail_msg("%s after '%s': '%s' %s", texts[i].parser, texts[i].tail, texts[i].text, ok ? "taken" : "refused");
        gm_free(st);
        kvlm_grammar_free(g);
        tok_chat_syntax_free(s);
    }
    /* the families without a grammar say so */
    tok_chat_syntax *s = tok_chat_syntax_new(NULL, "gemma4", TOK_REASONING_AUTO, &err);
    assert_null(tool_grammar(m, s, "", tools, NULL, false, true, &err));
    assert_int_equal(err.code, KVLM_EUNSUPPORTED);
    tok_chat_syntax_free(s);
    /* refused tools */
    s = tok_chat_syntax_new(NULL, "hermes", TOK_REASONING_AUTO, &err);
    static const char *const bad[][2] = {
        {"[{\"type\":\"function\",\"function\":{}}]", "'tools[0].function.name' must be a string"},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]", "may only have letters"},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},{\"function\":{\"name\":\"a\"}}]", "is the name of tools[0] too"},
        {"[{\"type\":\"code\",\"function\":{\"name\":\"a\"}}]", "'tools[0].type' must be \"function\""},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":{\"type\":\"object\",\"properties\":"
         "{\"x\":{\"not\":{}}}}}}]", "tools[0] ('a') parameters: json_schema at /properties/x: 'not' is not supported"},
        {"{}", "'tools' must be an array"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        json_t *t = json_loads(bad[i][0], 0, NULL);
        assert_null(tool_grammar(m, s, "", t, NULL, false, true, &err));
        if (!strstr(err.msg, bad[i][1])) fail_msg("%s: '%s', want '%s'", bad[i][0], err.msg, bad[i][1]);
        json_decref(t);
    }
    assert_null(tool_grammar(m, s, "", tools, "nope", false, true, &err));
    assert_non_null(strstr(err.msg, "no tool is named 'nope'"));
    tok_chat_syntax_free(s);
    json_decref(tools);
    kvlm_model_free(m);
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--roundtrip")) return roundtrip(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_families), cmocka_unit_test(test_malformed), cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_reasoning_none), cmocka_unit_test(test_detect), cmocka_unit_test(test_delta),
        cmocka_unit_test(test_ids), cmocka_unit_test(test_tool_grammar),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
