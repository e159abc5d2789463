/* fuzz/fuzz_grammar: structured output's compilers and matcher over untrusted
 * text (a server takes both from any client). First byte: bit 0 picks a JSON
 * schema (kvlm_grammar_from_json_schema) or GBNF (kvlm_grammar_from_gbnf);
 * the text runs to the first NUL, and the bytes after it are fed to a
 * matcher. Checked: feeding them whole and byte by byte gives the same
 * answer; the token mask over stories260K's vocabulary (or a synthetic one)
 * counts what it allows, and a token it allows is taken. */
#include "fuzz_common.h"
#include "kvlm.h"
#include "engine/grammar.h"

static kvlm_model *model;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char path[1024];
    kvlm_model_params mp = {.vocab_only = true};
    kvlm_error err = {0};
    if (fuzz_model_path("stories260K.gguf", path, sizeof path)) model = kvlm_model_load(path, &mp, &err);
    if (!model) {
        kvlm_synth_params sp = {.arch = KVLM_ARCH_LLAMA, .dim = 8, .hidden_dim = 16, .n_layers = 1, .n_heads = 2,
                                .n_kv_heads = 2, .vocab_size = 600, .n_ctx = 32, .seed = 1};
        model = fuzz_synth_model(&sp, &mp);
    }
    if (!model) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 1 << 14) return 0;
    bool schema = data[0] & 1;
    const char *body = (const char *)data + 1;
    size_t n = size - 1, tl = strnlen(body, n);
    char *text = malloc(tl + 1);
    memcpy(text, body, tl);
    text[tl] = 0;
    const char *feed = tl < n ? body + tl + 1 : "";
    int nf = tl < n ? (int)(n - tl - 1) : 0;
    kvlm_error err = {0};
    kvlm_grammar *g = schema ? kvlm_grammar_from_json_schema(model, text, &err)
                             : kvlm_grammar_from_gbnf(model, text, NULL, &err);
    free(text);
    if (!g) {
        if (!err.msg[0]) abort(); /* a refusal always says why */
        return 0;
    }
    gm *a = gm_new(g), *b = gm_new(g);
    if (a && b) {
        bool whole = gm_feed(a, feed, nf), each = true;
        for (int i = 0; i < nf && each; i++) each = gm_feed(b, feed + i, 1);
        if (whole != each || (whole && gm_done(a) != gm_done(b))) abort();
        int nv = kvlm_vocab_size(model);
        bool *allowed = malloc((size_t)nv);
        int k = gm_allowed(b, allowed), count = 0, first = -1;
        for (int t = 0; t < nv; t++)
            if (allowed[t]) {
                count++;
                if (first < 0) first = t;
            }
        if (k != count || (first >= 0 && !gm_feed_token(b, first))) abort();
        free(allowed);
    }
    gm_free(a);
    gm_free(b);
    kvlm_grammar_free(g);
    return 0;
}
