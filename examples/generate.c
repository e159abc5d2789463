/* examples/generate.c: a program built against an installed libkvlm (through
 * pkg-config, examples/Makefile; docs/library.md). Loads a model, generates
 * N tokens greedily from a prompt with the public API, and prints the prompt
 * and the text, as `kvlm run -m MODEL -p PROMPT -n N --temp 0` does.
 *
 *   generate MODEL [PROMPT [N]]      (PROMPT default "Once upon a time", N 64) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <kvlm.h>

static int fail(const char *what, const kvlm_error *err) {
    fprintf(stderr, "generate: %s: %s\n", what, err->msg);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 4) {
        fprintf(stderr, "usage: %s MODEL [PROMPT [N]]\n", argv[0]);
        return 2;
    }
    const char *prompt = argc > 2 ? argv[2] : "Once upon a time";
    int n_predict = argc > 3 ? atoi(argv[3]) : 64;

    int rc = 1;
    kvlm_error err = {0};
    kvlm_ctx *ctx = NULL;
    int32_t *toks = NULL;
    kvlm_model_params mp = {0};
    kvlm_model *model = kvlm_model_load(argv[1], &mp, &err);
    if (!model) return fail(argv[1], &err);
    kvlm_ctx_params cp = kvlm_ctx_default_params(); /* context: the model's trained one */
    if (!(ctx = kvlm_ctx_create(model, &cp, &err))) { fail("context", &err); goto done; }

    /* Tokenize: a first call counts the tokens, a second writes them. */
    bool add_bos = kvlm_add_bos(model);
    int n_prompt = kvlm_tokenize(model, prompt, strlen(prompt), add_bos, false, NULL, 0, &err);
    if (n_prompt < 0) { fail("tokenize", &err); goto done; }
    if (n_prompt == 0 || n_prompt > kvlm_ctx_n_ctx(ctx)) {
        fprintf(stderr, "generate: the prompt is %d tokens (context %d)\n", n_prompt, kvlm_ctx_n_ctx(ctx));
        goto done;
    }
    if (!(toks = malloc((size_t)n_prompt * sizeof *toks))) { fprintf(stderr, "generate: out of memory\n"); goto done; }
    kvlm_tokenize(model, prompt, strlen(prompt), add_bos, false, toks, n_prompt, &err);

    /* The detokenizer turns tokens back into whole UTF-8 text, as a stream. */
    kvlm_detok dt;
    kvlm_detok_init(&dt, model);
    char text[1024];
    for (int i = 0; i < n_prompt; i++) {
        int len = kvlm_detok_push(&dt, toks[i], text, sizeof text);
        fwrite(text, 1, (size_t)len, stdout);
    }

    /* Prefill the prompt in one batch (its logits: after the last token). */
    kvlm_batch batch = {.n_tokens = n_prompt, .tokens = toks};
    if (kvlm_decode(ctx, &batch, &err)) { fail("decode", &err); goto done; }
    int n_vocab = kvlm_vocab_size(model);
    for (int n = 0; n < n_predict; n++) {
        const float *logits = kvlm_get_logits(ctx, -1);
        int32_t next = 0; /* greedy: the first largest logit */
        for (int32_t t = 1; t < n_vocab; t++)
            if (logits[t] > logits[next]) next = t;
        if (kvlm_token_is_eog(model, next)) break;
        int len = kvlm_detok_push(&dt, next, text, sizeof text);
        fwrite(text, 1, (size_t)len, stdout);
        if (n + 1 == n_predict || kvlm_ctx_n_past(ctx) >= kvlm_ctx_n_ctx(ctx)) break;
        kvlm_batch one = {.n_tokens = 1, .tokens = &next};
        if (kvlm_decode(ctx, &one, &err)) { fail("decode", &err); goto done; }
    }
    int len = kvlm_detok_flush(&dt, text, sizeof text); /* an unfinished UTF-8 sequence */
    fwrite(text, 1, (size_t)len, stdout);
    fputc('\n', stdout);
    rc = 0;
done:
    free(toks);
    kvlm_ctx_free(ctx);
    kvlm_model_free(model);
    return rc;
}
