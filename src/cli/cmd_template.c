/* cli/cmd_template: `kvlm template`: a chat template (a file, or a model's own)
 * rendered with the variables of a JSON case, as transformers renders it;
 * a batch mode for the oracle test and a repeat mode for timing. */
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "cli/cli.h"

static void template_usage(FILE *f) {
    fprintf(f,
            "usage: kvlm template TEMPLATE.jinja CASE.json\n"
            "       kvlm template -m MODEL [--name NAME] CASE.json\n\n"
            "Renders a chat template (Hugging Face Jinja) with the variables of CASE.json, a JSON\n"
            "object (messages, tools, add_generation_prompt, bos_token, ...), as transformers renders\n"
            "it, and writes the text to stdout exactly (no newline added). A template error (a\n"
            "raise_exception, a syntax error, a limit) prints its message, exit 1.\n\n"
            "  -m, --model FILE    the model's own template (a GGUF's tokenizer.chat_template, or a\n"
            "                      Hugging Face directory's); its BOS and EOS tokens are bos_token and\n"
            "                      eos_token unless CASE.json gives them\n"
            "      --name NAME     the model's named template tokenizer.chat_template.NAME (tool_use, rag, ...)\n"
            "      --now EPOCH     the time strftime_now reads, in seconds since the epoch (also\n"
            "                      $KVLM_TEMPLATE_NOW; default: the clock)\n"
            "      --batch         CASE.json is an array of cases: one JSON line each on stdout,\n"
            "                      {\"ok\": true, \"text\": ...} or {\"ok\": false, \"error\": ...}; without\n"
            "                      TEMPLATE each case is {\"template\": TEXT, \"vars\": {...}}\n"
            "      --repeat N      render N times and print the microseconds a render takes, wall and\n"
            "                      CPU (stderr; the variables' JSON is parsed in each render)\n"
            "      --max-output N  bytes of text a render may make (default 32 MiB)\n"
            "      --max-steps N   statements, loop iterations and calls (default 5,000,000)\n"
            "      --max-depth N   evaluator recursion (default 1000)\n"
            "  -h, --help          this help\n\n"
            "See docs/chat-templates.md for what the interpreter supports.\n");
}

static double now_us(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* the case's variables with bos_token / eos_token from the model where it has none */
static char *with_tokens(const char *case_json, const kvlm_model *m, kvlm_error *err) {
    json_error_t je;
    json_t *j = json_loads(case_json, JSON_ALLOW_NUL, &je);
    if (!j) { snprintf(err->msg, sizeof err->msg, "line %d: %s", je.line, je.text); return NULL; }
    if (!json_is_object(j)) { snprintf(err->msg, sizeof err->msg, "the case must be a JSON object"); json_decref(j); return NULL; }
    const char *names[2] = {"bos_token", "eos_token"};
    int32_t ids[2] = {kvlm_token_bos(m), kvlm_token_eos(m)};
    for (int i = 0; i < 2; i++) {
        const char *piece = ids[i] >= 0 ? kvlm_token_piece(m, ids[i]) : NULL;
        if (!json_object_get(j, names[i]) && piece) json_object_set_new(j, names[i], json_string(piece));
    }
    char *s = json_dumps(j, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (!s) snprintf(err->msg, sizeof err->msg, "out of memory");
    return s;
}

static void put_result(int r, const char *out, size_t olen, const char *msg) {
    json_t *line = r ? json_pack("{s:b,s:s}", "ok", 0, "error", msg) : json_pack("{s:b,s:s%}", "ok", 1, "text", out, olen);
    char *ls = line ? json_dumps(line, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    if (ls) puts(ls);
    else puts("{\"ok\": false, \"error\": \"out of memory\"}");
    free(ls);
    json_decref(line);
}

/* --batch without a template: every case brings its own ({"template": ..., "vars": {...}}) */
static int snippets(const char *path, const kvlm_template_opts *opts) {
    size_t len;
    char *text = cli_read_file("template", path, &len);
    if (!text) return 1;
    json_error_t je;
    json_t *cases = json_loads(text, JSON_ALLOW_NUL, &je);
    free(text);
    if (!json_is_array(cases)) {
        json_decref(cases);
        return cli_fail("template", "%s: a JSON array of {\"template\", \"vars\"} expected", path);
    }
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        const char *src = json_string_value(json_object_get(c, "template"));
        size_t sl = json_string_length(json_object_get(c, "template"));
        json_t *vj = json_object_get(c, "vars");
        char *vars = vj ? json_dumps(vj, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
        kvlm_error e = {0};
        char *out = NULL;
        size_t olen = 0;
        int r;
        kvlm_template *t = src ? kvlm_template_parse(src, sl, &e) : NULL;
        if (!src) r = 1, snprintf(e.msg, sizeof e.msg, "case %zu has no template", i);
        else if (!t) r = 1;
        else r = kvlm_template_render_opts(t, vars, opts, &out, &olen, &e);
        put_result(r, out, olen, e.msg);
        free(out);
        free(vars);
        kvlm_template_free(t);
    }
    json_decref(cases);
    return 0;
}

int cmd_template(int argc, char **argv) {
    const char *model_path = NULL, *name = NULL, *now_s = getenv("KVLM_TEMPLATE_NOW");
    const char *files[2];
    int nfiles = 0, repeat = 0, max_depth = 0;
    uint64_t max_output = 0, max_steps = 0;
    bool batch = false;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) { template_usage(stdout); return 0; }
        else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--name", &name, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--now", &now_s, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--repeat", &repeat, &bad)) {}
        else if (cli_opt_u64(argc, argv, &i, NULL, "--max-output", &max_output, &bad)) {}
        else if (cli_opt_u64(argc, argv, &i, NULL, "--max-steps", &max_steps, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--max-depth", &max_depth, &bad)) {}
        else if (cli_is(argv[i], NULL, "--batch")) batch = true;
        else if (argv[i][0] == '-' && argv[i][1]) { fprintf(stderr, "kvlm template: unknown option '%s'\n", argv[i]); template_usage(stderr); return 1; }
        else if (nfiles < 2) files[nfiles++] = argv[i];
        else return cli_fail("template", "one template and one case, not '%s' too", argv[i]);
        if (bad) return 1;
    }
    bool snip = batch && !model_path && nfiles == 1;
    if (!snip && nfiles != (model_path ? 1 : 2)) { template_usage(stderr); return 1; }
    if (name && !model_path) return cli_fail("template", "--name picks one of a model's templates: give -m MODEL");
    if (repeat < 0 || max_depth < 0 || max_steps > (uint64_t)LONG_MAX)
        return cli_fail("template", "--repeat, --max-steps and --max-depth take a number >= 0");
    kvlm_template_opts opts = {.max_output = (size_t)max_output, .max_steps = (long)max_steps, .max_depth = max_depth};
    if (now_s) {
        char *end;
        opts.now = strtol(now_s, &end, 10);
        if (*end || end == now_s) return cli_fail("template", "--now '%s': seconds since the epoch expected", now_s);
    }
    if (snip) return snippets(files[0], &opts);
    kvlm_error err = {0};
    kvlm_model *model = NULL;
    char *src = NULL;
    const char *tmpl;
    size_t tlen;
    if (model_path) {
        kvlm_model_params mp = {.vocab_only = true};
        if (!(model = kvlm_model_load(model_path, &mp, &err))) return cli_fail("template", "%s", err.msg);
        tmpl = kvlm_model_chat_template(model, name);
        if (!tmpl) {
            kvlm_model_free(model);
            if (name) return cli_fail("template", "%s has no chat template named '%s' (tokenizer.chat_template.%s)", model_path, name, name);
            return cli_fail("template", "%s has no chat template (tokenizer.chat_template)", model_path);
        }
        tlen = strlen(tmpl);
    } else {
        if (!(src = cli_read_file("template", files[0], &tlen))) return 1;
        tmpl = src;
    }
    const char *case_path = files[nfiles - 1];
    size_t clen;
    char *case_text = cli_read_file("template", case_path, &clen);
    int rc = 1;
    kvlm_template *t = NULL;
    if (!case_text) goto out;
    if (!(t = kvlm_template_parse(tmpl, tlen, &err))) {
        fprintf(stderr, "kvlm template: %s: %s\n", model_path ? model_path : files[0], err.msg);
        goto out;
    }
    if (batch) {
        json_error_t je;
        json_t *cases = json_loads(case_text, JSON_ALLOW_NUL, &je);
        if (!json_is_array(cases)) {
            json_decref(cases);
            cli_fail("template", "%s: a JSON array of cases expected (line %d: %s)", case_path, je.line, cases ? "not an array" : je.text);
            goto out;
        }
        for (size_t i = 0; i < json_array_size(cases); i++) {
            char *vars = json_dumps(json_array_get(cases, i), JSON_COMPACT | JSON_PRESERVE_ORDER);
            char *withtok = vars && model ? with_tokens(vars, model, &err) : NULL;
            char *out = NULL;
            size_t olen = 0;
            kvlm_error e = {0};
            int r = vars ? kvlm_template_render_opts(t, withtok ? withtok : vars, &opts, &out, &olen, &e) : KVLM_ENOMEM;
            put_result(r, out, olen, vars ? e.msg : "out of memory");
            free(out);
            free(withtok);
            free(vars);
        }
        json_decref(cases);
        rc = 0;
        goto out;
    }
    char *vars = case_text, *withtok = NULL;
    if (model && !(withtok = with_tokens(case_text, model, &err))) {
        cli_fail("template", "%s: %s", case_path, err.msg);
        goto out;
    }
    if (withtok) vars = withtok;
    char *out = NULL;
    size_t olen = 0;
    double t0 = now_us(CLOCK_MONOTONIC), c0 = now_us(CLOCK_PROCESS_CPUTIME_ID);
    int n = repeat > 0 ? repeat : 1;
    for (int i = 0; i < n; i++) {
        free(out);
        out = NULL;
        if (kvlm_template_render_opts(t, vars, &opts, &out, &olen, &err)) {
            fprintf(stderr, "kvlm template: %s\n", err.msg);
            free(withtok);
            goto out;
        }
    }
    double us = (now_us(CLOCK_MONOTONIC) - t0) / n, cpu = (now_us(CLOCK_PROCESS_CPUTIME_ID) - c0) / n;
    /* the CPU time too: on a busy machine the wall clock counts other processes' turns */
    if (repeat > 0)
        fprintf(stderr, "kvlm template: %d renders, %.1f us per render (%.1f us of CPU; %zu bytes of text)\n", n, us,
                cpu, olen);
    fwrite(out, 1, olen, stdout);
    free(out);
    free(withtok);
    rc = 0;
out:
    kvlm_template_free(t);
    free(case_text);
    free(src);
    kvlm_model_free(model);
    return rc;
}
