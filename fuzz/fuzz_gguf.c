/* fuzz/fuzz_gguf: the GGUF reader: the bytes parsed from memory (every
 * key/value and tensor walked and printed, the vocabulary read), then loaded
 * as a model from a path: metadata only, vocabulary only and whole (weights
 * bound, tokenizer built and run on a short text). */
#include "fuzz_common.h"
#include "kvlm.h"
#include "model/gguf.h"
#include "model/vocab.h"

static fuzz_file file;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "error", 0); /* rejected inputs are logged: keep the fuzzer's output readable */
    return 0;
}

static void walk(const gguf_file *f) {
    char buf[256];
    for (uint64_t i = 0; i < f->n_kv; i++) {
        const gguf_kv *kv = &f->kv[i];
        gguf_kv_format(kv, buf, sizeof buf);
        if (kv->type == GGUF_ARRAY && kv->arr_type != GGUF_STRING && kv->arr_type != GGUF_ARRAY && kv->arr_n) {
            (void)gguf_arr_int(kv, 0);
            (void)gguf_arr_float(kv, kv->arr_n - 1);
        }
    }
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (gguf_find_tensor(f, t->cname) == NULL) abort(); /* a listed tensor is found by its name */
        if (t->nbytes && t->data) {
            volatile uint8_t x = ((const uint8_t *)t->data)[0];
            x = ((const uint8_t *)t->data)[t->nbytes - 1]; /* inside the buffer (ASan checks) */
            (void)x;
        }
    }
    int64_t n;
    double d;
    bool b;
    (void)gguf_get_int(f, "general.alignment", &n);
    (void)gguf_get_float(f, "llama.rope.freq_base", &d);
    (void)gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b);
    (void)gguf_get_str(f, "general.architecture", buf, sizeof buf);
    model_vocab v;
    kvlm_error err = {0};
    if (vocab_from_gguf(f, &v, &err) == KVLM_OK) vocab_free(&v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvlm_error err = {0};
    /* gguf_open_buffer keeps the pointer: give it a copy of exactly size bytes */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, data, size);
    gguf_file *f = gguf_open_buffer(copy, size, &err);
    if (f) {
        walk(f);
        gguf_close(f);
    }
    free(copy);
    if (size < 4 || memcmp(data, "GGUF", 4)) return 0; /* llama2.c checkpoints: fuzz_llama2c */
    fuzz_file_set(&file, data, size);
    static const kvlm_model_params modes[3] = {{.metadata_only = true}, {.vocab_only = true}, {0}};
    for (int i = 0; i < 3; i++) {
        kvlm_model *m = kvlm_model_load(file.path, &modes[i], &err);
        if (!m) continue;
        char buf[512];
        kvlm_model_describe(m, buf, sizeof buf);
        for (int k = 0; k < kvlm_model_n_meta(m) && k < 64; k++) {
            char key[128];
            (void)kvlm_model_meta(m, k, key, sizeof key, buf, sizeof buf);
        }
        if (kvlm_vocab_size(m) > 0) {
            int32_t toks[64];
            static const char text[] = "Hello world, <s> caf\xc3\xa9 \xe2\x96\x81\n\t 123";
            int n = kvlm_tokenize(m, text, sizeof text - 1, true, true, toks, 64, &err);
            for (int t = 0; t < n && t < 64; t++) (void)kvlm_token_to_text(m, toks[t], buf, sizeof buf);
        }
        kvlm_model_free(m);
    }
    return 0;
}
