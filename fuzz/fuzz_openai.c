/* fuzz/fuzz_openai: the OpenAI request parser: a request body through the
 * server's checks (UTF-8, JSON, every parameter, prompt or chat messages,
 * chat template rendered and tokenized, context length) without submitting
 * it. The first input byte picks the endpoint and a chat format (the
 * model's own, a built-in family, a Jinja template, or none that could be
 * made); the rest is the body. The model: stories260K from
 * $KVLM_MODELS, or a small synthetic one when it is absent. */
#include "fuzz_common.h"
#include "kvlm.h"
#include "server/server.h"

static kvlm_server srv;
/* the formats the first byte picks: a name (NULL: the model's own), or a Jinja template's text */
static const struct { const char *name, *jinja; } k_formats[16] = {
    {NULL, NULL}, {"chatml", NULL}, {"llama2", NULL}, {"llama3", NULL}, {"zephyr", NULL}, {"plain", NULL},
    {NULL, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"},
    {"nonsense", NULL}, {"phi3", NULL}, {"phi4", NULL}, {"gemma", NULL}, {"granite", NULL}, {"mistral-v7", NULL},
    {"mistral-v7-tekken", NULL},
    {NULL, "{%- if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% if m.role == 'tool' %}"
           "[{{ m.tool_call_id }}] {{ m.content }}{% elif m.tool_calls %}{% for c in m.tool_calls %}"
           "{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% else %}{{ m.role }}: "
           "{{ m.content | trim }}\n{% endif %}{% if m.role == 'user' and m.content | length > 100000 %}"
           "{{ raise_exception('too long') }}{% endif %}{% endfor %}{{ 'assistant:' if add_generation_prompt }}"},
    {"plain", NULL}};
static kvlm_chat *chats[16];
static char chat_errors[16][512];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "error", 0);
    char path[1024];
    kvlm_error err = {0};
    kvlm_model *m;
    if (fuzz_model_path("stories260K.gguf", path, sizeof path)) m = kvlm_model_load(path, NULL, &err);
    else {
        kvlm_synth_params sp = {.arch = KVLM_ARCH_LLAMA, .dim = 16, .hidden_dim = 32, .n_layers = 1, .n_heads = 2,
                                .vocab_size = 400, .n_ctx = 128, .type = kvlm_type_from_name("f32"), .seed = 1};
        m = fuzz_synth_model(&sp, NULL);
    }
    if (!m) { fprintf(stderr, "fuzz_openai: no model: %s\n", err.msg); abort(); }
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 128;
    cp.n_threads = 1;
    if (!(srv.ctx = kvlm_ctx_create(m, &cp, &err))) { fprintf(stderr, "fuzz_openai: ctx: %s\n", err.msg); abort(); }
    srv.model = m;
    snprintf(srv.model_id, sizeof srv.model_id, "stories260K");
    for (int i = 0; i < 16; i++) {
        kvlm_chat_params p = {.template_name = k_formats[i].name, .template_text = k_formats[i].jinja};
        kvlm_error cerr = {0};
        if (!(chats[i] = kvlm_chat_create(m, &p, &cerr))) snprintf(chat_errors[i], sizeof chat_errors[i], "%s", cerr.msg);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int f = (data[0] >> 1) & 15;
    srv.chat = chats[f]; /* NULL ("nonsense"): chat requests are refused with why */
    snprintf(srv.chat_error, sizeof srv.chat_error, "%s", chat_errors[f]);
    bool chat = data[0] & 1;
    kvlm_request_params rp;
    int n_tokens = -1;
    char msg[512];
    int status = srv_parse_request(&srv, (const char *)data + 1, size - 1, chat, &rp, &n_tokens, msg, sizeof msg, NULL);
    if (status == 200) {
        /* what would be submitted is within the checked ranges */
        if (n_tokens <= 0 || rp.max_tokens <= 0 || rp.n < 1 || rp.n > 128 || rp.logprobs < -1 ||
            rp.logprobs > KVLM_MAX_LOGPROBS || !(rp.sampling.temperature >= 0 && rp.sampling.temperature <= 2)) {
            fprintf(stderr, "accepted with n_tokens %d max_tokens %d n %d logprobs %d temperature %g\n", n_tokens,
                    rp.max_tokens, rp.n, rp.logprobs, rp.sampling.temperature);
            abort();
        }
    } else if (status < 400 || status > 599 || !msg[0]) {
        fprintf(stderr, "status %d with message \"%s\"\n", status, msg);
        abort();
    }
    return 0;
}
