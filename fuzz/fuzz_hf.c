/* fuzz/fuzz_hf: Hugging Face checkpoints' files. First byte with bit 7
 * set: the rest is a config.json, loaded as a whole directory beside a
 * fixed tiny llama (model.safetensors: dim 8, one layer, 16 tokens; a
 * tokenizer.json of 16 pieces) and, when it loads, run for one token.
 * Otherwise, first byte even: the rest is a safetensors file, parsed from
 * memory (st_open_buffer: every tensor found by name and its first and
 * last bytes read); odd: the rest is a tokenizer.json, written into a
 * directory and loaded as a vocabulary-only model (tokenizer built, a text
 * encoded and decoded). */
#include <sys/stat.h>
#include "fuzz_common.h"
#include "kvlm.h"
#include "model/safetensors.h"

static char dir[512], mdir[512]; /* a vocabulary's directory; a whole model's */

static void cleanup(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    rmdir(dir);
    const char *files[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", mdir, files[i]);
        unlink(path);
    }
    rmdir(mdir);
}

static void put_file(const char *d, const char *name, const void *data, size_t size) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", d, name);
    FILE *fp = fopen(path, "wb");
    if (!fp || (size && fwrite(data, 1, size, fp) != size)) abort();
    fclose(fp);
}

/* The tiny llama the config mode loads: every tensor a llama of dim 8,
 * hidden 16, 2 heads, 1 layer, 16 tokens has, in f32, filled with a ramp. */
static void write_tiny_model(void) {
    static const struct { const char *name; int rows, cols; } ts[] = {
        {"model.embed_tokens.weight", 16, 8}, {"model.norm.weight", 0, 8},
        {"model.layers.0.input_layernorm.weight", 0, 8}, {"model.layers.0.post_attention_layernorm.weight", 0, 8},
        {"model.layers.0.self_attn.q_proj.weight", 8, 8}, {"model.layers.0.self_attn.k_proj.weight", 8, 8},
        {"model.layers.0.self_attn.v_proj.weight", 8, 8}, {"model.layers.0.self_attn.o_proj.weight", 8, 8},
        {"model.layers.0.mlp.gate_proj.weight", 16, 8}, {"model.layers.0.mlp.up_proj.weight", 16, 8},
        {"model.layers.0.mlp.down_proj.weight", 8, 16},
    };
    enum { N = sizeof ts / sizeof ts[0] };
    char head[2048];
    size_t hl = 0, off = 0;
    hl += (size_t)snprintf(head + hl, sizeof head - hl, "{");
    for (int i = 0; i < N; i++) {
        size_t n = (size_t)(ts[i].rows ? ts[i].rows : 1) * (size_t)ts[i].cols;
        if (ts[i].rows)
            hl += (size_t)snprintf(head + hl, sizeof head - hl, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,%d],"
                                   "\"data_offsets\":[%zu,%zu]}", i ? "," : "", ts[i].name, ts[i].rows, ts[i].cols, off,
                                   off + 4 * n);
        else
            hl += (size_t)snprintf(head + hl, sizeof head - hl, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],"
                                   "\"data_offsets\":[%zu,%zu]}", i ? "," : "", ts[i].name, ts[i].cols, off, off + 4 * n);
        off += 4 * n;
    }
    hl += (size_t)snprintf(head + hl, sizeof head - hl, "}");
    while (hl % 8) head[hl++] = ' ';
    size_t total = 8 + hl + off;
    uint8_t *file = calloc(1, total);
    if (!file) abort();
    uint64_t h = hl;
    memcpy(file, &h, 8);
    memcpy(file + 8, head, hl);
    float *w = (float *)(file + 8 + hl);
    for (size_t i = 0; i < off / 4; i++) w[i] = (float)((int)(i % 13) - 6) / 16.0f + (i % 7 == 0 ? 1.0f : 0.0f);
    put_file(mdir, "model.safetensors", file, total);
    free(file);
    char tok[2048];
    size_t tl = (size_t)snprintf(tok, sizeof tok, "{\"model\":{\"type\":\"BPE\",\"byte_fallback\":false,\"vocab\":{");
    for (int i = 0; i < 16; i++)
        tl += (size_t)snprintf(tok + tl, sizeof tok - tl, "%s\"%c\":%d", i ? "," : "", 'a' + i, i);
    tl += (size_t)snprintf(tok + tl, sizeof tok - tl, "},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"}}");
    put_file(mdir, "tokenizer.json", tok, tl);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "error", 0);
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvlm-fuzz-hf-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) { perror(dir); abort(); }
    snprintf(mdir, sizeof mdir, "%s/kvlm-fuzz-hfm-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(mdir)) { perror(mdir); abort(); }
    atexit(cleanup);
    write_tiny_model();
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

static void config(const uint8_t *data, size_t size) {
    put_file(mdir, "config.json", data, size);
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(mdir, NULL, &err);
    if (!m) return;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    cp.n_ctx = 16;
    cp.kv_mem = 1 << 20;
    cp.n_threads = 1;
    kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
    if (ctx) {
        const int32_t tok[2] = {1, 2}, pos[2] = {0, 1}, seq[2] = {0, 0};
        const int8_t want[2] = {0, 1};
        kvlm_batch b = {.n_tokens = 2, .tokens = tok, .pos = pos, .logits = want, .seq = seq};
        if (kvlm_decode(ctx, &b, &err) == KVLM_OK && !kvlm_get_logits(ctx, -1)) abort();
        kvlm_ctx_free(ctx);
    }
    kvlm_model_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    if (data[0] & 0x80) config(data + 1, size - 1);
    else if (data[0] & 1) tokenizer(data + 1, size - 1);
    else safetensors(data + 1, size - 1);
    return 0;
}
