/* fuzz/fuzz_openai: the OpenAI request parser: a request body through the
 * server's checks (UTF-8, JSON, every parameter, prompt or chat messages,
 * chat template rendered and tokenized, context length) without submitting
 * it. The first input byte picks the endpoint and a forced chat template
 * (or none: the model's); the rest is the body. The model: stories260K from
 * $KVLM_MODELS, or a small synthetic one when it is absent. */
#include "fuzz_common.h"
#include "kvlm.h"
#include "server/server.h"

static kvlm_server srv;
static const char *templates[16] = {NULL,    "chatml",  "llama2",     "llama3",           "zephyr", "plain",
                                    NULL,    "nonsense", "phi3",      "phi4",             "gemma",  "granite",
                                    "mistral-v7", "mistral-v7-tekken", NULL, "plain"};
/* each template's kvlm_chat, as kvlm serve makes it (NULL: it cannot be made; chat_errors says why) */
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
        kvlm_chat_params p = {.template_name = templates[i]};
        kvlm_error ce = {0};
        if (!(chats[i] = kvlm_chat_create(m, &p, &ce))) snprintf(chat_errors[i], sizeof chat_errors[i], "%s", ce.msg);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int t = (data[0] >> 1) & 15;
    srv.p.chat_template = templates[t];
    srv.chat = chats[t];
    snprintf(srv.chat_error, sizeof srv.chat_error, "%s", chat_errors[t]);
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
