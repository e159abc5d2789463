/* fuzz/fuzz_tok: tokenizer encode/decode for each algorithm and pre-tokenizer:
 * SentencePiece-style BPE (stories260K's vocabulary, Llama's) and byte-level
 * BPE (GPT-2's vocabulary under each pre-tokenizer regex). Vocabularies come
 * from $KVLM_MODELS, or are built in memory when the files are absent. The
 * first input byte picks the tokenizer and the flags; the rest is the text.
 * Checked: ids in range, pre-tokenizer chunks tile the text, and decode(encode)
 * gives the text back (exactly for byte-level BPE; for SentencePiece after
 * its space prefix, U+2581 read as a space on both sides). */
#include "fuzz_common.h"
#include "kvlm.h"
#include "model/vocab.h"
#include "model/model.h" /* struct kvlm_model: the vocabulary a loaded model holds */
#include "tok/pretok.h"
#include "tok/tok.h"

enum { MAX_TOK = 48 };
static struct { tok_tokenizer *t; bool spm, exact; const char *name; } toks[MAX_TOK];
static int n_toks;
static kvlm_model *models[4];
static model_vocab variants[MAX_TOK]; /* GPT-2's vocabulary under other pre-tokenizers (shallow copies) */

static const kvlm_model *load_vocab(const char *name) {
    char path[1024];
    if (!fuzz_model_path(name, path, sizeof path)) return NULL;
    kvlm_model_params p = {.vocab_only = true};
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, &p, &err);
    if (!m) { fprintf(stderr, "fuzz_tok: %s: %s\n", path, err.msg); abort(); }
    for (int i = 0; i < 4; i++)
        if (!models[i]) { models[i] = m; break; }
    return m;
}

static void add(const model_vocab *v, bool spm, bool exact, const char *name) {
    kvlm_error err = {0};
    tok_tokenizer *t = tok_create(v, &err);
    if (!t) { fprintf(stderr, "fuzz_tok: %s: %s\n", name, err.msg); abort(); }
    toks[n_toks].t = t;
    toks[n_toks].spm = spm;
    toks[n_toks].exact = exact;
    toks[n_toks++].name = name;
}

/* GPT-2's byte-to-symbol map: printable bytes stand for themselves, the
 * others for U+0100 onwards. */
static void gpt2_vocab(model_vocab *v) {
    static const char *merges[] = {"\xc4\xa0 t", "h e", "\xc4\xa0t he", "i n", "e r"};
    int nm = (int)(sizeof merges / sizeof merges[0]);
    memset(v, 0, sizeof *v);
    snprintf(v->model, sizeof v->model, "gpt2");
    snprintf(v->pre, sizeof v->pre, "gpt-2");
    v->n_tokens = 256 + nm + 1;
    v->tokens = calloc((size_t)v->n_tokens, sizeof *v->tokens);
    v->lens = calloc((size_t)v->n_tokens, sizeof *v->lens);
    v->scores = calloc((size_t)v->n_tokens, sizeof *v->scores);
    v->types = calloc((size_t)v->n_tokens, sizeof *v->types);
    v->merges = calloc((size_t)nm, sizeof *v->merges);
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int cp = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174) ? b : 256 + extra++;
        char s[4];
        int n = cp < 0x80 ? (s[0] = (char)cp, 1) : (s[0] = (char)(0xc0 | cp >> 6), s[1] = (char)(0x80 | (cp & 63)), 2);
        s[n] = 0;
        v->tokens[b] = strdup(s);
        v->lens[b] = (uint32_t)n;
        v->types[b] = VOCAB_T_NORMAL;
    }
    for (int i = 0; i < nm; i++) {
        v->merges[i] = strdup(merges[i]);
        char s[32];
        size_t k = 0;
        for (const char *p = merges[i]; *p; p++)
            if (*p != ' ') s[k++] = *p;
        s[k] = 0;
        v->tokens[256 + i] = strdup(s);
        v->lens[256 + i] = (uint32_t)k;
        v->types[256 + i] = VOCAB_T_NORMAL;
    }
    v->n_merges = nm;
    v->tokens[256 + nm] = strdup("<|endoftext|>");
    v->lens[256 + nm] = 13;
    v->types[256 + nm] = VOCAB_T_CONTROL;
    v->bos = v->eos = 256 + nm;
    v->unk = v->pad = v->eot = -1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "error", 0);
    const kvlm_model *m;
    if ((m = load_vocab("stories260K.gguf"))) add(&m->vocab, true, true, "spm-stories260K");
    else { /* a synthetic model's vocabulary: <unk> <s> </s>, bytes, letters */
        kvlm_synth_params sp = {.arch = KVLM_ARCH_LLAMA, .dim = 8, .hidden_dim = 16, .n_layers = 1, .n_heads = 2,
                                .vocab_size = 400, .n_ctx = 16, .type = kvlm_type_from_name("f32"), .seed = 1};
        kvlm_model_params p = {.vocab_only = true};
        if (!(models[3] = fuzz_synth_model(&sp, &p))) abort();
        add(&models[3]->vocab, true, true, "spm-synth");
    }
    if ((m = load_vocab("vocab/ggml-vocab-llama-spm.gguf"))) add(&m->vocab, true, true, "spm-llama");
    model_vocab *g = &variants[0];
    if ((m = load_vocab("vocab/ggml-vocab-gpt-2.gguf"))) *g = m->vocab;
    else gpt2_vocab(g);
    static const char *pres[] = {"gpt-2", "llama-bpe", "qwen2"};
    int nv = 0;
    for (int i = 0; i < 3; i++, nv++) {
        if (i) variants[i] = *g;
        snprintf(variants[i].pre, sizeof variants[i].pre, "%s", pres[i]);
        add(&variants[i], false, true, pres[i]);
    }
    /* Then every other pre-tokenizer kind (the first name of each row).
     * Exact round trips only for byte-level ones: GPT-2's vocabulary has no
     * <0xHH> tokens for the raw (Gemma 4, whitespace) ones to fall back on. */
    static char names[MAX_TOK][32];
    for (int r = 0; r < tok_pretok_n_defs() && n_toks < MAX_TOK; r++) {
        const char *list = tok_pretok_def_names(r);
        snprintf(names[r], sizeof names[r], "%.*s", (int)strcspn(list, "|"), list);
        if (!strcmp(names[r], "gpt-2") || !strcmp(names[r], "llama-bpe") || !strcmp(names[r], "qwen2")) continue;
        kvlm_error err = {0};
        tok_pretok *pt = tok_pretok_create(names[r], &err);
        if (!pt) { fprintf(stderr, "fuzz_tok: %s: %s\n", names[r], err.msg); abort(); }
        bool raw = tok_pretok_raw(pt);
        tok_pretok_free(pt);
        variants[nv] = *g;
        snprintf(variants[nv].pre, sizeof variants[nv].pre, "%s", names[r]);
        add(&variants[nv++], false, !raw, names[r]);
    }
    return 0;
}

/* U+2581 read as a space (a byte-fallback tokenizer may give it back as
 * its bytes or as a space): n bytes of s normalised into out. */
static size_t spaces(const char *s, size_t n, char *out) {
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 3 <= n && !memcmp(s + i, "\xe2\x96\x81", 3)) {
            out[j++] = ' ';
            i += 2;
        } else out[j++] = s[i];
    }
    return j;
}

/* expected: " " + text (when not empty), both with U+2581 read as a space */
static bool same_spm(const char *text, size_t len, const char *dec, size_t dlen) {
    char *a = malloc(len + 2), *b = malloc(dlen + 1);
    size_t na = 0;
    if (len) a[na++] = ' ';
    na += spaces(text, len, a + na);
    size_t nb = spaces(dec, dlen, b);
    bool same = na == nb && !memcmp(a, b, na);
    free(a);
    free(b);
    return same;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || n_toks == 0) return 0;
    int which = data[0] % n_toks;
    bool add_bos = data[0] & 0x40, special = data[0] & 0x80;
    const tok_tokenizer *t = toks[which].t;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    kvlm_error err = {0};
    int cap = (int)len + 8;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    int n = tok_encode(t, text, len, add_bos, special, ids, cap, &err);
    if (n > cap) { /* the count when it does not fit: room for it, again */
        cap = n;
        ids = realloc(ids, (size_t)cap * sizeof *ids);
        n = tok_encode(t, text, len, add_bos, special, ids, cap, &err);
    }
    if (n < 0 || n > cap) {
        fprintf(stderr, "%s: encode returned %d for %zu bytes: %s\n", toks[which].name, n, len, err.msg);
        abort();
    }
    int nv = tok_n_vocab(t);
    size_t dcap = (size_t)n * 64 + 16, dlen = 0;
    char *dec = malloc(dcap);
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= nv) { fprintf(stderr, "id %d out of range\n", ids[i]); abort(); }
        int k = tok_token_to_bytes(t, ids[i], false, dec + dlen, dcap - dlen);
        if (k < 0) abort();
        dlen += (size_t)k;
        (void)tok_is_eog(t, ids[i]);
    }
    if (toks[which].exact && !special) {
        bool ok = toks[which].spm ? same_spm(text, len, dec, dlen) : (dlen == len && !memcmp(dec, text, len));
        if (!ok) {
            fprintf(stderr, "%s: decode(encode(text)) differs: %zu bytes in, %zu out: \"%.*s\" -> \"%.*s\"\n",
                    toks[which].name, len, dlen, (int)len, text, (int)dlen, dec);
            abort();
        }
    }
    tok_span spans[256];
    int ns = tok_pretokenize(t, text, len, spans, 256, &err);
    if (ns < 0) abort();
    size_t at = 0;
    for (int i = 0; i < ns && i < 256; i++) {
        if (spans[i].off != at || spans[i].len == 0 || spans[i].off + spans[i].len > len) {
            fprintf(stderr, "%s: chunk %d (%zu+%zu) does not continue at %zu\n", toks[which].name, i, spans[i].off,
                    spans[i].len, at);
            abort();
        }
        at += spans[i].len;
    }
    if (ns <= 256 && at != len) { fprintf(stderr, "%s: chunks cover %zu of %zu bytes\n", toks[which].name, at, len); abort(); }
    free(dec);
    free(ids);
    return 0;
}
