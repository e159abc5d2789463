/* cli/cmd_run: `kvlm run`: prefill a prompt, then decode and stream text,
 * ending with one line of figures on stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "cli/cli.h"
#include "cli/llama_flags.h"
#include "cli/progress.h"

/* The last bytes of the text generated, where -r's texts are looked for. */
typedef struct {
    char buf[4096];
    size_t n;
} text_tail;

static void tail_add(text_tail *t, const char *p, size_t k) {
    if (k >= sizeof t->buf) { p += k - (sizeof t->buf - 1); k = sizeof t->buf - 1; }
    if (t->n + k >= sizeof t->buf) { /* keep the newest half */
        size_t drop = t->n + k - (sizeof t->buf - 1);
        memmove(t->buf, t->buf + drop, t->n - drop);
        t->n -= drop;
    }
    memcpy(t->buf + t->n, p, k);
    t->n += k;
    t->buf[t->n] = 0;
}

/* Streams a generated token's text to stdout; false (nothing written) for an
 * end-of-generation token. */
static bool emit_token(const kvlm_model *model, kvlm_detok *dt, int32_t token, text_tail *tail) {
    if (kvlm_token_is_eog(model, token)) return false;
    char text[1024];
    int len = kvlm_detok_push(dt, token, text, sizeof text);
    if (len > 0) {
        fwrite(text, 1, (size_t)len, stdout);
        fflush(stdout);
        tail_add(tail, text, (size_t)len);
    }
    return true;
}

/* -r: the text generated holds one of them (NUL bytes end the search early:
 * a reverse prompt has none). */
static bool reverse_hit(const cli_llama *ll, const text_tail *tail) {
    for (int k = 0; k < ll->n_reverse; k++)
        if (strstr(tail->buf, ll->reverse[k])) return true;
    return false;
}

static void run_usage(FILE *f) {
    fprintf(f,
            "usage: kvlm run -m MODEL [-p PROMPT | -f FILE] [-n N] [options]\n\n"
            "Streams the prompt and then the generated text to stdout; prints prompt tokens,\n"
            "prefill and decode tokens/s and KV cache bytes on stderr at the end.\n\n"
            "  -m, --model FILE        GGUF, llama2.c .bin, or a Hugging Face model directory (docs/hf-checkpoints.md)\n"
            "      --tokenizer FILE    tokenizer.bin for llama2.c models (default: beside the model)\n"
            "  -p, --prompt TEXT       prompt (default: empty, i.e. BOS only)\n"
            "  -f, --file FILE         read the prompt from a file\n"
            "  -n, --n-predict N       tokens to generate (default 256; stops early at end of text); -1: until\n"
            "                          the end of text (or the context is full), -2: until the context is full\n"
            "                          (also under --kv-evict), 0: none (the prompt is still prefilled)\n"
            "  -r, --reverse-prompt T  stop once the text generated holds T (repeatable)\n"
            "      --ignore-eos        never stop at end of text: its tokens are banned (to -n or a full context)\n"
            "  -e, --escape            read \\n, \\t, \\\\, \\', \\\", \\xHH in the prompt and -r as llama.cpp does\n"
            "  -cnv, --conversation    a conversation (kvlm chat, -p its system message; with --chat-template T)\n"
            CLI_SAMPLER_USAGE
            CLI_GRAMMAR_USAGE
            "      --special           recognise special tokens (e.g. <|im_start|>) in the prompt\n"
            "      --no-bos            do not add BOS before the prompt\n"
            CLI_CTX_USAGE
            "      --no-kv-cache       recompute the whole sequence for every token (the naive baseline)\n"
            "      --session FILE      reuse the cache FILE saved for a prompt this one starts with, and save\n"
            "                          this run's tokens and cache there at the end (llama.cpp's --prompt-cache)\n"
            "      --spec MODE         speculative decoding: lookup (drafts from n-grams of the prompt and text)\n"
            "                          or draft (a smaller model's drafts, --draft); same output (docs/speculative.md)\n"
            "      --draft FILE        the draft model (same vocabulary; implies --spec draft; -md, --model-draft)\n"
            "      --draft-n K         most draft tokens checked per step (default 8 lookup, 4 draft; llama.cpp's\n"
            "                          --draft-max, and --draft K with a number)\n"
            "      --draft-p-min P     draft: a step's drafts end before a token the draft model gives less\n"
            "                          than probability P (default 0: never; llama.cpp's --draft-p-min)\n"
            "      --draft-min N       fewer drafts than N are not checked: the token decodes alone (default 0;\n"
            "                          above --draft-n: --draft-n; llama.cpp's --draft-min, --draft-n-min)\n"
            "      --spec-ngram N      lookup: longest n-gram matched (default 3; then down to 1)\n"
            CLI_LLAMA_USAGE
            "  -h, --help              this help\n");
}

int cmd_run(int argc, char **argv) {
    const char *model_path = NULL, *tok_path = NULL, *prompt = NULL, *prompt_file = NULL, *kv_mem = NULL,
               *evict = NULL, *session = NULL, *spec_name = NULL, *draft_path = NULL, *chat_template = NULL;
    int n_predict = 256, draft_n = 0, draft_min = 0, spec_ngram = 0;
    float draft_p_min = 0;
    bool special = false, no_bos = false, seed_set = false;
    cli_grammar_opts gopt = {0};
    kvlm_grammar *grammar = NULL;
    kvlm_ctx_params cp = kvlm_ctx_default_params();
    kvlm_sampler_params sp = kvlm_sampler_default_params();
    cli_llama ll;
    cli_llama_init(&ll);
    /* -cnv: the same options for kvlm chat, -p as its system message (llama-cli's) */
    char **chat_argv = calloc((size_t)argc + 1, sizeof *chat_argv);
    int chat_argc = 0;
    if (!chat_argv) return cli_fail("run", "out of memory");
    chat_argv[chat_argc++] = argv[0];
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        int at = i;
        if (cli_is(argv[i], "-h", "--help")) { free(chat_argv); run_usage(stdout); return 0; }
        else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-p", "--prompt", &prompt, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &prompt_file, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, "-n", "--n-predict", &n_predict, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--session", &session, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--chat-template", &chat_template, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--spec", &spec_name, &bad)) {}
        else if (cli_opt_draft(argc, argv, &i, &draft_path, &draft_n, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--draft-min", &draft_min, &bad) ||
                 cli_opt_int(argc, argv, &i, NULL, "--draft-n-min", &draft_min, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--draft-p-min", &draft_p_min, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--spec-ngram", &spec_ngram, &bad)) {}
        else if (cli_opt_ctx(argc, argv, &i, &cp, &kv_mem, &evict, &bad)) {}
        else if (cli_opt_sampler(argc, argv, &i, &sp, &seed_set, &bad)) {}
        else if (cli_opt_grammar(argc, argv, &i, &gopt, &bad)) {}
        else if (cli_is(argv[i], NULL, "--special")) special = true;
        else if (cli_is(argv[i], NULL, "--no-bos")) no_bos = true;
        else if (cli_is(argv[i], NULL, "--no-kv-cache")) cp.no_kv_cache = true;
        else if (cli_opt_llama(argc, argv, &i, &ll, &bad)) {}
        else if (cli_llama_unsupported("run", argv[i])) { free(chat_argv); return 1; }
        else { fprintf(stderr, "kvlm run: unknown option '%s'\n", argv[i]); run_usage(stderr); free(chat_argv); return 1; }
        if (bad) { free(chat_argv); return 1; }
        if (cli_is(argv[at], "-cnv", "--conversation")) continue;
        if (cli_is(argv[at], "-p", "--prompt")) chat_argv[chat_argc++] = "--system";
        else chat_argv[chat_argc++] = argv[at];
        while (at < i) chat_argv[chat_argc++] = argv[++at];
    }
    if (ll.conversation) {
        /* llama-cli -cnv: kvlm chat, with what it takes of these options */
        if (prompt_file) { free(chat_argv); return cli_fail("run", "-cnv: give the system message with -p TEXT, not -f"); }
        cli_set_command("chat");
        int rc = cmd_chat(chat_argc, chat_argv);
        free(chat_argv);
        return rc;
    }
    free(chat_argv);
    if (chat_template)
        return cli_fail("run", "--chat-template is for a conversation: add -cnv (kvlm chat); run takes the prompt as it is");
    if (n_predict < -2)
        return cli_fail("run", "-n %d: expected a token count, -1 (until the end of text) or -2 (until the "
                        "context is full)", n_predict);
    if (ll.escape && prompt) cli_unescape((char *)prompt); /* (argv's own bytes) */
    if (!model_path) { fprintf(stderr, "kvlm run: no model given (-m FILE)\n"); run_usage(stderr); return 1; }
    if (prompt && prompt_file) return cli_fail("run", "give either -p or -f, not both");
    if (cli_ctx_finish("run", &cp, kv_mem, evict)) return 1;
    kvlm_model_params mp = {0};
    if (cli_llama_finish("run", &ll, &cp, &mp)) return 1;
    if (session && (cp.kv_evict || cp.no_kv_cache))
        return cli_fail("run", "--session keeps the whole cache: not with --kv-evict or --no-kv-cache");
    if (!seed_set) sp.seed = (uint64_t)time(NULL);
    if (cli_sampler_check("run", &sp, 0)) return 1; /* as the server checks a request's */
    int spec_mode = spec_name ? kvlm_spec_mode_from_name(spec_name) : draft_path ? KVLM_SPEC_DRAFT : KVLM_SPEC_NONE;
    if (spec_mode < 0) return cli_fail("run", "--spec %s: expected lookup, draft or none", spec_name);
    if (spec_mode == KVLM_SPEC_DRAFT && !draft_path) return cli_fail("run", "--spec draft needs --draft MODEL");
    if (draft_path && spec_mode != KVLM_SPEC_DRAFT) return cli_fail("run", "--draft goes with --spec draft");
    if (draft_n < 0 || draft_n > 64) return cli_fail("run", "--draft-n %d: expected 1..64", draft_n);
    if (draft_min < 0) return cli_fail("run", "--draft-min %d: expected 0 or more", draft_min);
    if (draft_min > 0 && !spec_mode) return cli_fail("run", "--draft-min goes with --spec or --draft");
    if (!(draft_p_min >= 0 && draft_p_min < 1)) return cli_fail("run", "--draft-p-min %g: expected 0 <= P < 1", draft_p_min);
    if (draft_p_min > 0 && spec_mode != KVLM_SPEC_DRAFT) return cli_fail("run", "--draft-p-min goes with --draft");
    if (spec_ngram < 0 || spec_ngram > 16) return cli_fail("run", "--spec-ngram %d: expected 1..16", spec_ngram);
    if (spec_mode && cp.no_kv_cache) return cli_fail("run", "--spec needs the KV cache (not --no-kv-cache)");

    char *file_text = NULL;
    size_t prompt_len = prompt ? strlen(prompt) : 0;
    if (prompt_file) {
        file_text = cli_read_file("run", prompt_file, &prompt_len);
        if (!file_text) return 1;
        if (ll.escape) prompt_len = strlen(cli_unescape(file_text));
        prompt = file_text;
    }
    if (prompt && !prompt_file) prompt_len = strlen(prompt);
    if (!prompt) prompt = "";

    int rc = 1;
    kvlm_error err = {0};
    mp.tokenizer_path = tok_path;
    kvlm_model *model = NULL;
    kvlm_ctx *ctx = NULL, *dctx = NULL;
    kvlm_model *dmodel = NULL;
    kvlm_spec *spec = NULL;
    kvlm_sampler *smp = NULL;
    int32_t *toks = NULL;
    model = cli_model_load(model_path, &mp, &err);
    if (!model) { cli_fail("run", "%s", err.msg); goto done; }
    sp.model = model; /* its end-of-generation tokens (--ignore-eos) and token texts (DRY's breakers) */
    sp.ignore_eos = ll.ignore_eos;
    if (cli_sampler_check("run", &sp, kvlm_vocab_size(model))) goto done; /* the bias's token ids */
    if (ll.verbose) {
        char desc[1024];
        kvlm_model_describe(model, desc, sizeof desc);
        fprintf(stderr, "kvlm run: %s: %s\n", model_path, desc);
    }
    bool draft_shared = false;
    /* its cache in the model's pool when the shapes allow (kvlm_ctx_create_draft) */
    if (draft_path && !(dmodel = cli_load_draft("run", draft_path, model, &cp, &draft_shared))) goto done;
    ctx = kvlm_ctx_create(model, &cp, &err);
    if (!ctx) { cli_fail("run", "%s", err.msg); goto done; }
    int n_ctx = kvlm_ctx_n_ctx(ctx), budget = kvlm_ctx_kv_budget(ctx);
    if (ll.verbose) {
        char dev[512];
        kvlm_ctx_describe_device(ctx, dev, sizeof dev);
        kvlm_kv_stats ks;
        kvlm_kv_stats_get(ctx, &ks);
        fprintf(stderr, "kvlm run: %s; context %d, KV cache %d blocks of %d tokens (keys %s, values %s, %.2f MiB)\n",
                dev, n_ctx, ks.n_blocks, ks.block_size, kvlm_cache_type_name(ks.type_k), kvlm_cache_type_name(ks.type_v),
                (double)kvlm_ctx_kv_capacity_bytes(ctx) / (1 << 20));
    }
    /* llama.cpp's -n -1: until the end of text (stopped below by a full
     * context, unless evicting); -2: until the context is full, evicting or not */
    bool until_full = n_predict == -2;
    if (n_predict < 0) n_predict = 2147483647;
    bool add_bos = !no_bos && kvlm_add_bos(model);
    int n_prompt = kvlm_tokenize(model, prompt, prompt_len, add_bos, special, NULL, 0, &err);
    if (n_prompt < 0) { cli_fail("run", "%s", err.msg); goto done; }
    if (n_prompt == 0) { cli_fail("run", "the prompt is empty and the model has no BOS token to start from"); goto done; }
    if (n_prompt > budget && !cp.kv_evict) {
        cli_fail("run", "the prompt is %d tokens, longer than the %s of %d (raise %s, or evict with --kv-evict sinks)",
                 n_prompt, budget < n_ctx ? "KV budget" : "context", budget, budget < n_ctx ? "--kv-budget" : "--ctx");
        goto done;
    }
    toks = malloc((size_t)n_prompt * sizeof *toks);
    if (!toks) { cli_fail("run", "out of memory"); goto done; }
    kvlm_tokenize(model, prompt, prompt_len, add_bos, special, toks, n_prompt, &err);
    bool gfailed;
    grammar = cli_grammar("run", &gopt, model, &gfailed);
    if (gfailed) goto done;
    sp.grammar = grammar;
    smp = kvlm_sampler_create(&sp, kvlm_vocab_size(model));
    if (!smp) { cli_fail("run", "out of memory"); goto done; }

    kvlm_detok dt;
    kvlm_detok_init(&dt, model);
    char text[1024];
    for (int i = 0; i < n_prompt; i++) {
        kvlm_sampler_accept(smp, toks[i]);
        int len = kvlm_detok_push(&dt, toks[i], text, sizeof text);
        fwrite(text, 1, (size_t)len, stdout); /* text may hold NUL bytes */
    }
    fflush(stdout);

    struct timespec t0, t1, t2;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    /* what a session file or the KV tiers already hold of the prompt */
    int cached = 0;
    if (session && (cached = kvlm_session_load(ctx, 0, toks, n_prompt, session, &err)) < 0) {
        fputc('\n', stdout);
        cli_fail("run", "%s", err.msg);
        goto done;
    }
    if (!cached && !cp.kv_evict && !cp.no_kv_cache) cached = kvlm_seq_reuse_prefix(ctx, 0, toks, n_prompt);
    /* under eviction the prompt goes in pieces that leave room for the sinks */
    int piece = cp.kv_evict ? (budget - (cp.kv_sinks > 0 ? cp.kv_sinks : 4)) / 2 : n_prompt;
    if (piece < 1) piece = 1;
    for (int i = cached; i < n_prompt; i += piece) {
        kvlm_batch b = {n_prompt - i < piece ? n_prompt - i : piece, toks + i, NULL, NULL, NULL};
        if (kvlm_decode(ctx, &b, &err)) { fputc('\n', stdout); cli_fail("run", "%s", err.msg); goto done; }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int n_gen = 0, n_decoded = 0;
    const char *stop = NULL;
    if (spec_mode) {
        kvlm_spec_params spp = {spec_mode, draft_n, spec_ngram, 0, NULL, draft_p_min, draft_min};
        if (draft_path) {
            kvlm_ctx_params dcp = cp; /* the target's, but keys a draft keeps in another type (q4_kc's) */
            dcp.cache_type_k = kvlm_cache_type_draft(cp.cache_type_k);
            dctx = draft_shared ? kvlm_ctx_create_draft(dmodel, ctx, &dcp, &err) : kvlm_ctx_create(dmodel, &dcp, &err);
            if (!dctx) {
                fputc('\n', stdout);
                cli_fail("run", "draft model %s: %s", draft_path, err.msg);
                goto done;
            }
            spp.draft_ctx = dctx;
        }
        if (!(spec = kvlm_spec_create(ctx, 0, toks, n_prompt, &spp, &err))) {
            fputc('\n', stdout);
            cli_fail("run", "%s", err.msg);
            goto done;
        }
    }
    int32_t spec_out[65];
    int spec_n = 0, spec_i = 0; /* tokens of the last step, and how many were given out */
    bool spec_unfed = false;    /* the last step's token is not in the cache (it was full) */
    text_tail tail = {.n = 0};
    tail.buf[0] = 0;
    if (n_predict == 0) stop = "-n 0, nothing generated (-n -1: until the end of text)";
    while (spec && n_gen < n_predict) {
        if (spec_i == spec_n) {
            if (spec_unfed) { /* the last token did not fit in the cache: as the plain loop, stop after it */
                stop = budget < n_ctx ? "KV budget full (--kv-evict none; use sinks or h2o to go on)" : "context full";
                break;
            }
            int past0 = kvlm_ctx_n_past(ctx);
            spec_n = kvlm_spec_next(spec, smp, spec_out, 65, &err);
            spec_unfed = spec_n == 1 && kvlm_ctx_n_past(ctx) == past0;
            spec_i = 0;
            if (spec_n < 0) {
                if (err.code == KVLM_EFULL) { stop = "KV cache budget full (raise --kv-mem)"; break; }
                fputc('\n', stdout);
                cli_fail("run", "%s", err.msg);
                goto done;
            }
        }
        int32_t next = spec_out[spec_i++];
        n_gen++;
        if (!emit_token(model, &dt, next, &tail)) { stop = "end of text"; break; }
        if (!spec_unfed) n_decoded++; /* fed */
        if (ll.n_reverse && reverse_hit(&ll, &tail)) { stop = "reverse prompt (-r)"; break; }
        if (until_full && n_prompt + n_gen >= n_ctx) { stop = "context full (-n -2)"; break; }
    }
    while (!spec && n_gen < n_predict) {
        int32_t next = kvlm_sampler_sample(smp, kvlm_get_logits(ctx, -1));
        n_gen++;
        if (!emit_token(model, &dt, next, &tail)) { stop = "end of text"; break; }
        if (ll.n_reverse && reverse_hit(&ll, &tail)) { stop = "reverse prompt (-r)"; break; }
        if (n_gen >= n_predict) break;
        if (until_full && n_prompt + n_gen >= n_ctx) { stop = "context full (-n -2)"; break; }
        if (!cp.kv_evict && kvlm_ctx_n_past(ctx) >= budget) {
            stop = budget < n_ctx ? "KV budget full (--kv-evict none; use sinks or h2o to go on)" : "context full";
            break;
        }
        kvlm_batch one = {1, &next, NULL, NULL, NULL};
        if (kvlm_decode(ctx, &one, &err)) {
            if (err.code == KVLM_EFULL) { stop = "KV cache budget full (raise --kv-mem)"; break; }
            fputc('\n', stdout);
            cli_fail("run", "%s", err.msg);
            goto done;
        }
        n_decoded++;
    }
    clock_gettime(CLOCK_MONOTONIC, &t2);
    fwrite(text, 1, (size_t)kvlm_detok_flush(&dt, text, sizeof text), stdout);
    fputc('\n', stdout);
    fflush(stdout);
    double prefill_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    double decode_s = (double)(t2.tv_sec - t1.tv_sec) + 1e-9 * (double)(t2.tv_nsec - t1.tv_nsec);
    size_t kv = kvlm_ctx_kv_bytes(ctx);
    fprintf(stderr,
            "prompt tokens: %d | prefill: %.1f tokens/s | decode: %.1f tokens/s (%d tokens) | KV cache: %zu bytes "
            "(%.2f MiB)",
            n_prompt, prefill_s > 0 ? n_prompt / prefill_s : 0.0, decode_s > 0 ? n_decoded / decode_s : 0.0,
            n_decoded, kv, (double)kv / (1 << 20));
    if (cached) fprintf(stderr, " | cached: %d tokens", cached);
    if (spec) {
        kvlm_spec_stats ss;
        kvlm_spec_stats_get(spec, &ss);
        fprintf(stderr, " | spec %s: %llu steps, %llu/%llu drafts accepted (%.0f%%), %.2f tokens/step",
                spec_mode == KVLM_SPEC_LOOKUP ? "lookup" : "draft", (unsigned long long)ss.steps,
                (unsigned long long)ss.accepted, (unsigned long long)ss.drafted,
                ss.drafted ? 100.0 * (double)ss.accepted / (double)ss.drafted : 0.0,
                ss.steps ? (double)ss.emitted / (double)ss.steps : 0.0);
        if (ss.draft_windows) fprintf(stderr, ", draft window moved %llu times", (unsigned long long)ss.draft_windows);
        if (dctx) { /* where the draft's cache lives */
            kvlm_kv_stats ds;
            kvlm_kv_stats_get(dctx, &ds);
            fprintf(stderr, ", draft cache %s (%d tokens a block, keys %s)",
                    draft_shared ? "in the model's pool" : "in a pool of its own", ds.block_size,
                    kvlm_cache_type_name(ds.type_k));
        }
    }
    if (cp.kv_evict)
        fprintf(stderr, " | %s: %d tokens kept, %ld evicted", kvlm_evict_name(cp.kv_evict), kvlm_ctx_n_past(ctx),
                kvlm_seq_n_evicted(ctx, 0));
    fprintf(stderr, "%s%s\n", stop ? " | stopped: " : "", stop ? stop : "");
    rc = 0;
    if (session && kvlm_session_save(ctx, 0, session, &err)) rc = cli_fail("run", "%s", err.msg);
done:
    free(toks);
    free(file_text);
    kvlm_sampler_free(smp);
    kvlm_spec_free(spec);
    kvlm_ctx_free(dctx);
    kvlm_model_free(dmodel);
    kvlm_ctx_free(ctx);
    kvlm_grammar_free(grammar);
    kvlm_model_free(model);
    return rc;
}
