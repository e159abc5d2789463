/* fuzz/fuzz_hf: Hugging Face checkpoints' files. First byte even: the rest
 * is a safetensors file, parsed from memory (st_open_buffer: every tensor
 * found by name and its first and last bytes read). Odd: the rest is a
 * tokenizer.json, written into a directory and loaded as a vocabulary-only
 * model (tokenizer built, a text encoded and decoded). */
#include <sys/stat.h>
#include "fuzz_common.h"
#include "kvlm.h"
#include "model/safetensors.h"

static char dir[512];

static void cleanup(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "error", 0);
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvlm-fuzz-hf-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) { perror(dir); abort(); }
    atexit(cleanup);
    return 0;
}

static void safetensors(const uint8_t *data, size_t size) {
    kvlm_error err = {0};
    uint8_t *copy = malloc(size ? size : 1); /* exactly size bytes: ASan sees a read past them */
    if (!copy) return;
    memcpy(copy, data, size);
    st_file *f = st_open_buffer(copy, size, "fuzz", &err);
    if (f) {
        for (int i = 0; i < f->n_tensors; i++) {
            const st_tensor *t = &f->tensors[i];
            if (st_find(f, t->name) != t) abort();
            if (t->nbytes) {
                volatile uint8_t x = ((const uint8_t *)t->data)[0];
                x = ((const uint8_t *)t->data)[t->nbytes - 1];
                (void)x;
            }
        }
        st_close(f);
    }
    free(copy);
}

static void tokenizer(const uint8_t *data, size_t size) {
    char path[600];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *fp = fopen(path, "wb");
    if (!fp) abort();
    if (size && fwrite(data, 1, size, fp) != size) abort();
    fclose(fp);
    kvlm_error err = {0};
    kvlm_model_params mp = {.vocab_only = true};
    kvlm_model *m = kvlm_model_load(dir, &mp, &err);
    if (!m) return;
    static const char text[] = "Hello world, <s> caf\xc3\xa9 \xe2\x96\x81\n\t 123 \xff";
    int32_t toks[128];
    int n = kvlm_tokenize(m, text, sizeof text - 1, true, true, toks, 128, &err);
    char buf[256];
    for (int t = 0; t < n && t < 128; t++) (void)kvlm_token_to_text(m, toks[t], buf, sizeof buf);
    kvlm_model_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    if (data[0] & 1) tokenizer(data + 1, size - 1);
    else safetensors(data + 1, size - 1);
    return 0;
}
