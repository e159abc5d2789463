/* fuzz/fuzz_toolcall: a model's answer through the tool-call and reasoning
 * parsers (tok/chat_parse): what a model writes is untrusted text. First
 * byte: the syntax (low 5 bits, one of every family), whether the prompt
 * opened the reasoning (bit 5), reasoning_format none (bit 6), no tools
 * (bit 7); the rest is the answer. Checked: the whole parse is a message
 * whose calls' arguments are JSON objects; at cuts across the text, the
 * partial parses' content and reasoning are each the start of the whole's
 * (what a stream showed is never taken back), and their deltas add up. */
#include "fuzz_common.h"
#include <jansson.h>
#include "tok/chat_parse.h"

static const char *const k_names[] = {
    "hermes", "qwen3-coder", "llama3", "mistral", "mistral-nemo", "deepseek-r1", "deepseek-v3.1", "deepseek-v4",
    "kimi-k2", "command-r-plus", "command-r7b", "firefunction-v2", "granite", "apriel", "apriel-1.5", "gigachat3",
    "functionary-v3.1", "functionary-v3.2", "gpt-oss", "seed-oss", "glm-4.5", "mirothinker", "gemma4", "pythonic",
    "lfm2", "generic", "none"};
enum { N_NAMES = sizeof k_names / sizeof k_names[0] };
static tok_chat_syntax *g_syn[N_NAMES][2];
static json_t *g_tools;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    kvlm_error err = {0};
    /* a template with <think> gives each syntax its reasoning markers */
    for (int i = 0; i < N_NAMES; i++)
        for (int r = 0; r < 2; r++)
            if (!(g_syn[i][r] = tok_chat_syntax_new("<think></think>", k_names[i], r, &err))) abort();
    g_tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\","
                         "\"properties\":{\"a\":{\"type\":\"string\"},\"n\":{\"type\":\"integer\"}}}}},"
                         "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}]",
                         0, NULL);
    return g_tools ? 0 : -1;
}

static const char *str(const json_t *m, const char *k) {
    const char *s = json_string_value(json_object_get(m, k));
    return s ? s : "";
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 1 << 14) return 0;
    const tok_chat_syntax *s = g_syn[(data[0] & 31) % N_NAMES][(data[0] >> 6) & 1];
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    tok_chat_parse_opts o = {.prompt_tail = data[0] & 32 ? "<|im_start|>assistant\n<think>\n" : "",
                             .tools = data[0] & 128 ? NULL : g_tools, .id_seed = 1, .no_calls = (data[0] & 128) != 0};
    kvlm_error err = {0};
    json_t *whole = tok_chat_parse(s, &o, text, n, &err);
    if (!whole) abort(); /* only out of memory */
    const json_t *calls = json_object_get(whole, "tool_calls"), *c;
    size_t i;
    json_array_foreach(calls, i, c) {
        const char *args = str(json_object_get(c, "function"), "arguments");
        json_error_t je;
        json_t *a = json_loads(args, JSON_ALLOW_NUL, &je);
        /* a whole call's arguments are an object (JSON allows what jansson refuses: \\u0000 in a
         * key, integers past 64 bits, reals past a double) */
        if (!json_is_object(a) && !strstr(args, "\\u0000") && !strstr(je.text, "too big") && !strstr(je.text, "overflow"))
            abort();
        json_decref(a);
        if (!*str(json_object_get(c, "function"), "name") || !*str(c, "id")) abort();
    }
    const char *wc = str(whole, "content"), *wr = str(whole, "reasoning_content");
    o.partial = true;
    json_t *prev = NULL;
    size_t step = n / 24 + 1;
    for (size_t cut = 0; cut < n; cut += step) {
        json_t *m = tok_chat_parse(s, &o, text, cut, &err);
        if (!m) abort();
        const char *pc = str(m, "content"), *pr = str(m, "reasoning_content");
        if (strncmp(pc, wc, strlen(pc)) || strncmp(pr, wr, strlen(pr))) {
            fprintf(stderr, "cut at %zu: content '%s' / reasoning '%s' is not the start of the whole's '%s' / '%s'\n",
                    cut, pc, pr, wc, wr);
            abort();
        }
        json_decref(tok_chat_delta(prev, m));
        json_decref(prev);
        prev = m;
    }
    json_decref(tok_chat_delta(prev, whole));
    json_decref(prev);
    json_decref(whole);
    return 0;
}
