/* fuzz/fuzz_llama2c: llama2.c's formats: the first byte picks the checkpoint
 * reader (the rest is a model file, read with a tokenizer.bin built here for
 * any vocabulary size) or the tokenizer.bin reader (the next two bytes give
 * the vocabulary size the model header would state, the rest is the file). */
#include "fuzz_common.h"
#include "kvlm.h"
#include "model/vocab.h"

static fuzz_file model_file, tok_file;

/* A tokenizer.bin of n tokens ("<0x00>".. then letters): any checkpoint's
 * vocabulary size up to this many finds its tokenizer. */
enum { TOK_N = 4096 };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "error", 0);
    size_t cap = 4 + (size_t)TOK_N * 16, len = 0;
    uint8_t *b = malloc(cap);
    int32_t max_len = 8;
    memcpy(b, &max_len, 4);
    len = 4;
    for (int i = 0; i < TOK_N; i++) {
        char s[16];
        int32_t n = i < 256 ? snprintf(s, sizeof s, "<0x%02X>", i) : snprintf(s, sizeof s, "t%d", i);
        float score = -(float)i;
        memcpy(b + len, &score, 4);
        memcpy(b + len + 4, &n, 4);
        memcpy(b + len + 8, s, (size_t)n);
        len += 8 + (size_t)n;
    }
    fuzz_file_set(&tok_file, b, len);
    free(b);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    kvlm_error err = {0};
    if (data[0] & 1) { /* tokenizer.bin */
        if (size < 3) return 0;
        int n_vocab = (data[1] | data[2] << 8) % 2048 + 1;
        fuzz_file_set(&model_file, data + 3, size - 3);
        model_vocab v;
        if (vocab_from_llama2c(model_file.path, n_vocab, &v, &err) == KVLM_OK) {
            for (int i = 0; i < v.n_tokens; i++)
                if (strlen(v.tokens[i]) > v.lens[i]) abort(); /* lens[] covers the NUL-terminated string */
            vocab_free(&v);
        }
        return 0;
    }
    fuzz_file_set(&model_file, data + 1, size - 1);
    kvlm_model_params p = {.tokenizer_path = tok_file.path, .vocab_only = (data[0] & 2) != 0};
    kvlm_model *m = kvlm_model_load(model_file.path, &p, &err);
    if (m) {
        char buf[256];
        kvlm_model_describe(m, buf, sizeof buf);
        int32_t toks[16];
        (void)kvlm_tokenize(m, "hi there", 8, true, false, toks, 16, &err);
        kvlm_model_free(m);
    }
    return 0;
}
