/* fuzz/fuzz_jinja: the chat-template interpreter (tok/jinja) over untrusted
 * templates and variables (a server renders a model's template with any
 * client's messages; a model file brings any template). The bytes up to the
 * first NUL are the template; the rest, when it is a JSON object, the
 * variables (else a small conversation with tools). Checked: a refusal says
 * why; a text ends where its length says; rendering twice gives the same
 * text or the same error (no state leaks between renders). Limits are small
 * so every input runs fast: 20,000 steps, 1 MiB of text, depth 200. */
#include <jansson.h>
#include "fuzz_common.h"
#include "tok/jinja.h"

static json_t *default_vars;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    default_vars = json_loads(
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
        " {\"role\": \"user\", \"content\": \"Weather in Z\\u00fcrich? \\ud83c\\udf26\"},"
        " {\"role\": \"assistant\", \"content\": \"\", \"reasoning_content\": \"call it\", \"tool_calls\":"
        " [{\"id\": \"abc123456\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\","
        " \"arguments\": {\"city\": \"Z\\u00fcrich\", \"days\": 3, \"step\": 1.5}}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"abc123456\", \"name\": \"get_weather\", \"content\": \"21 C\"},"
        " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"thanks\"}]}],"
        " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather\","
        " \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"},"
        " \"days\": {\"type\": \"integer\", \"enum\": [1, 3]}}, \"required\": [\"city\"]}}}],"
        " \"add_generation_prompt\": true, \"enable_thinking\": false, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}",
        0, NULL);
    if (!default_vars) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 1 << 16) return 0;
    const char *src = (const char *)data;
    size_t tl = strnlen(src, size);
    json_t *vars = NULL;
    if (tl + 1 < size) {
        json_error_t je;
        vars = json_loadb(src + tl + 1, size - tl - 1, 0, &je);
        if (vars && !json_is_object(vars)) { json_decref(vars); vars = NULL; }
    }
    kvlm_error err = {0};
    jinja_template *t = jinja_parse(src, tl, &err);
    if (!t) {
        if (!err.msg[0] || err.code != KVLM_EINVAL) abort(); /* a refusal says why */
        json_decref(vars);
        return 0;
    }
    jinja_opts o = {.max_output = 1 << 20, .max_steps = 20000, .max_depth = 200, .now = 1700000000};
    char *out[2];
    size_t len[2] = {0, 0};
    kvlm_error e[2] = {{0}, {0}};
    for (int i = 0; i < 2; i++) {
        out[i] = jinja_render(t, vars ? vars : default_vars, &o, &len[i], &e[i]);
        if (out[i] && out[i][len[i]] != 0) abort();                 /* the text ends where its length says */
        if (!out[i] && (!e[i].msg[0] || (e[i].code != KVLM_EINVAL && e[i].code != KVLM_ENOMEM))) abort();
    }
    if (!out[0] != !out[1]) abort(); /* the same input, the same answer */
    if (out[0] && (len[0] != len[1] || memcmp(out[0], out[1], len[0]))) abort();
    if (!out[0] && strcmp(e[0].msg, e[1].msg)) abort();
    free(out[0]);
    free(out[1]);
    jinja_free(t);
    json_decref(vars);
    return 0;
}
