/* cli/llama_flags: llama.cpp's command-line names in kvlm (see llama_flags.h):
 * aliases, the flags with a meaning of their own, and the table of all of
 * llama.cpp's, for a clear word on those kvlm lacks. */
#include "cli/llama_flags.h"
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

static const char *g_cmd = "";
void cli_set_command(const char *cmd) { g_cmd = cmd ? cmd : ""; }
const char *cli_command(void) { return g_cmd; }

/* Is the current command one of the space-separated names in cmds? */
static bool in_cmds(const char *cmds) {
    size_t n = strlen(g_cmd);
    for (const char *p = cmds; n && (p = strstr(p, g_cmd)); p += n)
        if ((p == cmds || p[-1] == ' ') && (p[n] == ' ' || !p[n])) return true;
    return false;
}

#define LLAMA_CMDS "run chat serve perplexity"
/* llama.cpp's names for kvlm's options: same meaning, same value. */
static const struct { const char *alias, *name, *cmds; } k_alias[] = {
    {"--ctx-size", "--ctx", LLAMA_CMDS},
    {"--predict", "--n-predict", "run chat"},
    {"-ctk", "--cache-type-k", LLAMA_CMDS},
    {"-ctv", "--cache-type-v", LLAMA_CMDS},
    {"-s", "--seed", "run chat"},
    {"-j", "--json-schema", "run chat"},
    {"--draft-max", "--draft-n", "run serve"},
    {"--prompt-cache", "--session", "run"},
    {"-a", "--alias", "serve"},
    {"-to", "--timeout", "serve"},
    {"--embedding", "--embeddings", "serve"},
    /* llama-server's logical batch (-b) and physical one (-ub) are both one
     * engine step here: its most tokens */
    {"-b", "--batch-tokens", "serve"},
    {"--batch-size", "--batch-tokens", "serve"},
    {"-ub", "--batch-tokens", "serve"},
    {"--ubatch-size", "--batch-tokens", "serve"},
};

const char *cli_llama_alias(const char *arg) {
    if (!arg || arg[0] != '-') return NULL;
    for (size_t k = 0; k < sizeof k_alias / sizeof k_alias[0]; k++)
        if (!strcmp(arg, k_alias[k].alias) && in_cmds(k_alias[k].cmds)) return k_alias[k].name;
    return NULL;
}

/* Every flag of llama.cpp b4747 (common/arg.cpp: each add_opt's names, in
 * its order), as data: what kvlm takes is parsed before this is looked at. */
static const char *const k_llama_flags[][3] = {
    {"-h", "--help", "--usage"}, {"--version"}, {"--completion-bash"}, {"--verbose-prompt"},
    {"--no-display-prompt"}, {"-co", "--color"}, {"-t", "--threads"}, {"-tb", "--threads-batch"},
    {"-C", "--cpu-mask"}, {"-Cr", "--cpu-range"}, {"--cpu-strict"}, {"--prio"}, {"--poll"},
    {"-Cb", "--cpu-mask-batch"}, {"-Crb", "--cpu-range-batch"}, {"--cpu-strict-batch"}, {"--prio-batch"},
    {"--poll-batch"}, {"-lcs", "--lookup-cache-static"}, {"-lcd", "--lookup-cache-dynamic"}, {"-c", "--ctx-size"},
    {"-n", "--predict", "--n-predict"}, {"-b", "--batch-size"}, {"-ub", "--ubatch-size"}, {"--keep"},
    {"--no-context-shift"}, {"--chunks"}, {"-fa", "--flash-attn"}, {"-p", "--prompt"}, {"--no-perf"},
    {"-f", "--file"}, {"--in-file"}, {"-bf", "--binary-file"}, {"-e", "--escape"}, {"--no-escape"},
    {"-ptc", "--print-token-count"}, {"--prompt-cache"}, {"--prompt-cache-all"}, {"--prompt-cache-ro"},
    {"-r", "--reverse-prompt"}, {"-sp", "--special"}, {"-cnv", "--conversation"}, {"-no-cnv", "--no-conversation"},
    {"-i", "--interactive"}, {"-if", "--interactive-first"}, {"-mli", "--multiline-input"}, {"--in-prefix-bos"},
    {"--in-prefix"}, {"--in-suffix"}, {"--no-warmup"}, {"--spm-infill"}, {"--samplers"}, {"-s", "--seed"},
    {"--sampling-seq", "--sampler-seq"}, {"--ignore-eos"}, {"--temp"}, {"--top-k"}, {"--top-p"}, {"--min-p"},
    {"--top-nsigma"}, {"--xtc-probability"}, {"--xtc-threshold"}, {"--typical"}, {"--repeat-last-n"},
    {"--repeat-penalty"}, {"--presence-penalty"}, {"--frequency-penalty"}, {"--dry-multiplier"}, {"--dry-base"},
    {"--dry-allowed-length"}, {"--dry-penalty-last-n"}, {"--dry-sequence-breaker"}, {"--dynatemp-range"},
    {"--dynatemp-exp"}, {"--mirostat"}, {"--mirostat-lr"}, {"--mirostat-ent"}, {"-l", "--logit-bias"},
    {"--grammar"}, {"--grammar-file"}, {"-j", "--json-schema"}, {"--pooling"}, {"--attention"}, {"--rope-scaling"},
    {"--rope-scale"}, {"--rope-freq-base"}, {"--rope-freq-scale"}, {"--yarn-orig-ctx"}, {"--yarn-ext-factor"},
    {"--yarn-attn-factor"}, {"--yarn-beta-slow"}, {"--yarn-beta-fast"}, {"-gan", "--grp-attn-n"},
    {"-gaw", "--grp-attn-w"}, {"-dkvc", "--dump-kv-cache"}, {"-nkvo", "--no-kv-offload"},
    {"-ctk", "--cache-type-k"}, {"-ctv", "--cache-type-v"}, {"--perplexity", "--all-logits"}, {"--hellaswag"},
    {"--hellaswag-tasks"}, {"--winogrande"}, {"--winogrande-tasks"}, {"--multiple-choice"},
    {"--multiple-choice-tasks"}, {"--kl-divergence"}, {"--save-all-logits", "--kl-divergence-base"},
    {"--ppl-stride"}, {"--ppl-output-type"}, {"-dt", "--defrag-thold"}, {"-np", "--parallel"},
    {"-ns", "--sequences"}, {"-cb", "--cont-batching"}, {"-nocb", "--no-cont-batching"}, {"--mmproj"}, {"--image"},
    {"--rpc"}, {"--mlock"}, {"--no-mmap"}, {"--numa"}, {"-dev", "--device"}, {"--list-devices"},
    {"-ngl", "--gpu-layers", "--n-gpu-layers"}, {"-sm", "--split-mode"}, {"-ts", "--tensor-split"},
    {"-mg", "--main-gpu"}, {"--check-tensors"}, {"--override-kv"}, {"--lora"}, {"--lora-scaled"},
    {"--control-vector"}, {"--control-vector-scaled"}, {"--control-vector-layer-range"}, {"-a", "--alias"},
    {"-m", "--model"}, {"-mu", "--model-url"}, {"-hf", "-hfr", "--hf-repo"}, {"-hfd", "-hfrd", "--hf-repo-draft"},
    {"-hff", "--hf-file"}, {"-hfv", "-hfrv", "--hf-repo-v"}, {"-hffv", "--hf-file-v"}, {"-hft", "--hf-token"},
    {"--context-file"}, {"--chunk-size"}, {"--chunk-separator"}, {"--junk"}, {"--pos"},
    {"-o", "--output", "--output-file"}, {"-ofreq", "--output-frequency"}, {"--save-frequency"},
    {"--process-output"}, {"--no-ppl"}, {"--chunk", "--from-chunk"}, {"-pps"}, {"-npp"}, {"-ntg"}, {"-npl"},
    {"--embd-normalize"}, {"--embd-output-format"}, {"--embd-separator"}, {"--host"}, {"--port"}, {"--path"},
    {"--no-webui"}, {"--embedding", "--embeddings"}, {"--reranking", "--rerank"}, {"--api-key"}, {"--api-key-file"},
    {"--ssl-key-file"}, {"--ssl-cert-file"}, {"-to", "--timeout"}, {"--threads-http"}, {"--cache-reuse"},
    {"--metrics"}, {"--slots"}, {"--props"}, {"--no-slots"}, {"--slot-save-path"}, {"--jinja"},
    {"--reasoning-format"}, {"--chat-template"}, {"--chat-template-file"}, {"-sps", "--slot-prompt-similarity"},
    {"--lora-init-without-apply"}, {"--simple-io"}, {"--positive-file"}, {"--negative-file"}, {"--pca-batch"},
    {"--pca-iter"}, {"--method"}, {"--output-format"}, {"--log-disable"}, {"--log-file"}, {"--log-colors"},
    {"-v", "--verbose", "--log-verbose"}, {"-lv", "--verbosity", "--log-verbosity"}, {"--log-prefix"},
    {"--log-timestamps"}, {"-td", "--threads-draft"}, {"-tbd", "--threads-batch-draft"},
    {"-Cd", "--cpu-mask-draft"}, {"-Crd", "--cpu-range-draft"}, {"--cpu-strict-draft"}, {"--prio-draft"},
    {"--poll-draft"}, {"-Cbd", "--cpu-mask-batch-draft"}, {"-Crbd", "--cpu-range-batch-draft"},
    {"--cpu-strict-batch-draft"}, {"--prio-batch-draft"}, {"--poll-batch-draft"},
    {"--draft-max", "--draft", "--draft-n"}, {"--draft-min", "--draft-n-min"}, {"--draft-p-split"},
    {"--draft-p-min"}, {"-cd", "--ctx-size-draft"}, {"-devd", "--device-draft"},
    {"-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"}, {"-md", "--model-draft"}, {"-mv", "--model-vocoder"},
    {"--tts-use-guide-tokens"}, {"--tts-oute-default"}, {"--embd-bge-small-en-default"},
    {"--embd-e5-small-en-default"}, {"--embd-gte-small-default"}, {"--fim-qwen-1.5b-default"},
    {"--fim-qwen-3b-default"}, {"--fim-qwen-7b-default"},
};

/* Why, for some of them: what kvlm has instead. */
static const struct { const char *flag, *why; } k_why[] = {
    {"--draft-min", "kvlm checks drafts of any length; --draft-p-min ends them early"},
    {"--draft-n-min", "kvlm checks drafts of any length; --draft-p-min ends them early"},
    {"-hf", "kvlm reads local files: download the GGUF and give -m FILE"},
    {"-hfr", "kvlm reads local files: download the GGUF and give -m FILE"},
    {"--hf-repo", "kvlm reads local files: download the GGUF and give -m FILE"},
    {"-mu", "kvlm reads local files: download the GGUF and give -m FILE"},
    {"--model-url", "kvlm reads local files: download the GGUF and give -m FILE"},
    {"-i", "kvlm chat is the interactive conversation"},
    {"--interactive", "kvlm chat is the interactive conversation"},
    {"-if", "kvlm chat is the interactive conversation"},
    {"--interactive-first", "kvlm chat is the interactive conversation"},
    {"--in-prefix", "kvlm chat renders each turn with the model's chat template, or --chat-template's"},
    {"--in-suffix", "kvlm chat renders each turn with the model's chat template, or --chat-template's"},
    {"-mli", "in kvlm chat a line ending with \\ goes on on the next"},
    {"--multiline-input", "in kvlm chat a line ending with \\ goes on on the next"},
    {"--keep", "kvlm's --kv-evict sinks --kv-sinks N keeps the first N tokens"},
    {"-tb", "kvlm uses -t threads for prefill and decode alike"},
    {"--threads-batch", "kvlm uses -t threads for prefill and decode alike"},
    {"--grammar-file", "kvlm run and chat take it; a request's response_format gives one to kvlm serve"},
    {"--grammar", "kvlm run and chat take it; a request's response_format gives one to kvlm serve"},
    {"--pooling", "kvlm pools as the model file says ({arch}.pooling_type; kvlm convert --pooling writes it)"},
    {"--reranking", "kvlm serves generation and embeddings, no reranking"},
    {"--rerank", "kvlm serves generation and embeddings, no reranking"},
};

bool cli_llama_unsupported(const char *cmd, const char *arg) {
    if (!arg || arg[0] != '-') return false;
    for (size_t k = 0; k < sizeof k_llama_flags / sizeof k_llama_flags[0]; k++)
        for (int j = 0; j < 3 && k_llama_flags[k][j]; j++)
            if (!strcmp(arg, k_llama_flags[k][j])) {
                const char *why = NULL;
                for (size_t w = 0; w < sizeof k_why / sizeof k_why[0]; w++)
                    if (!strcmp(arg, k_why[w].flag)) why = k_why[w].why;
                fprintf(stderr, "kvlm %s: llama.cpp's %s is not supported by kvlm %s%s%s (docs/cli.md lists the "
                        "llama.cpp flags kvlm takes)\n", cmd, arg, cmd, why ? ": " : "", why ? why : "");
                return true;
            }
    return false;
}

bool cli_opt_draft(int argc, char **argv, int *i, const char **path, int *n, bool *bad) {
    const char *v;
    if (cli_opt_str(argc, argv, i, NULL, "--draft", &v, bad)) {
        if (*bad) return true;
        if (v[0] && strspn(v, "0123456789") == strlen(v)) { /* llama.cpp's --draft N */
            long x = strtol(v, NULL, 10);
            *n = x > 1000 ? 1000 : (int)x; /* (the range is checked by the command) */
        } else *path = v;
        return true;
    }
    return cli_opt_str(argc, argv, i, "-md", "--model-draft", path, bad) ||
           cli_opt_int(argc, argv, i, NULL, "--draft-n", n, bad);
}

void cli_llama_init(cli_llama *ll) {
    memset(ll, 0, sizeof *ll);
    ll->n_gpu_layers = -1;
}

/* -ngl's value: a layer count, or llama.cpp's later "auto" / "all". */
static bool gpu_layers(const char *v, int *out) {
    if (!strcmp(v, "auto") || !strcmp(v, "all")) { *out = 999; return true; }
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || end == v || x < -1 || x > 1000000) return false;
    *out = x < 0 ? 999 : (int)x; /* -1: llama.cpp's newer "all" */
    return true;
}

bool cli_opt_llama(int argc, char **argv, int *i, cli_llama *ll, bool *bad) {
    const char *a = argv[*i], *v = NULL;
    bool serve = !strcmp(g_cmd, "serve"), run = !strcmp(g_cmd, "run"), chat = !strcmp(g_cmd, "chat");
    if (cli_opt_str(argc, argv, i, "-ngl", "--n-gpu-layers", &v, bad) ||
        cli_opt_str(argc, argv, i, NULL, "--gpu-layers", &v, bad)) {
        if (!*bad && !gpu_layers(v, &ll->n_gpu_layers)) {
            fprintf(stderr, "kvlm: option %s: '%s' is not a layer count\n", a, v);
            *bad = true;
        }
        return true;
    }
    if (cli_is(a, "-fa", "--flash-attn")) {
        /* b4747 takes no value; later llama.cpp takes on|off|auto */
        static const char *const vals[] = {"on", "off", "auto", "1", "0", "true", "false"};
        for (size_t k = 0; *i + 1 < argc && k < sizeof vals / sizeof vals[0]; k++)
            if (!strcmp(argv[*i + 1], vals[k])) { ++*i; break; }
        return true;
    }
    if (!serve && cli_opt_int(argc, argv, i, "-ub", "--ubatch-size", &ll->ubatch, bad)) {
        if (!*bad && (ll->ubatch < 1 || ll->ubatch > 1 << 20)) {
            fprintf(stderr, "kvlm: option %s: expected 1 or more tokens\n", a);
            *bad = true;
        }
        return true;
    }
    int ignored;
    if (!serve && cli_opt_int(argc, argv, i, "-b", "--batch-size", &ignored, bad)) return true; /* the prompt goes in one call */
    if (serve && cli_opt_int(argc, argv, i, "-np", "--parallel", &ll->parallel, bad)) {
        if (!*bad && ll->parallel < 1) {
            fprintf(stderr, "kvlm: option %s: expected 1 or more\n", a);
            *bad = true;
        }
        return true;
    }
    if (cli_is(a, NULL, "--no-mmap")) { ll->no_mmap = true; return true; }
    if (cli_is(a, NULL, "--mlock")) { ll->mlock = true; return true; }
    if (!serve && (cli_is(a, "-v", "--verbose") || cli_is(a, NULL, "--log-verbose"))) { ll->verbose = true; return true; }
    if (cli_is(a, NULL, "--version")) {
        printf("kvlm %s\n", kvlm_version());
        exit(0);
    }
    /* what kvlm always does, or never does */
    if (cli_is(a, NULL, "--no-warmup") || cli_is(a, NULL, "--no-context-shift") ||
        (serve && (cli_is(a, "-cb", "--cont-batching") || cli_is(a, NULL, "--metrics"))) ||
        (run && cli_is(a, "-no-cnv", "--no-conversation")) || (run && cli_is(a, NULL, "--prompt-cache-all")) ||
        ((run || chat) && cli_is(a, NULL, "--no-escape")))
        return true;
    if ((run || chat) && cli_is(a, "-e", "--escape")) { ll->escape = true; return true; }
    if ((run || chat) && cli_is(a, NULL, "--ignore-eos")) { ll->ignore_eos = true; return true; }
    if (run && cli_is(a, "-cnv", "--conversation")) { ll->conversation = true; return true; }
    if ((run || chat) && cli_opt_str(argc, argv, i, "-r", "--reverse-prompt", &v, bad)) {
        if (*bad) return true;
        if (!*v || ll->n_reverse == CLI_MAX_REVERSE) {
            fprintf(stderr, "kvlm: option %s: %s\n", a, *v ? "at most 8 of them" : "an empty text");
            *bad = true;
        } else ll->reverse[ll->n_reverse++] = v;
        return true;
    }
    return false;
}

int cli_llama_finish(const char *cmd, cli_llama *ll, kvlm_ctx_params *cp, kvlm_model_params *mp) {
    if (cp && ll->n_gpu_layers >= 0) {
        /* kvlm runs the whole model on one device: any layer on the GPU puts it there */
        if (ll->n_gpu_layers == 0) cp->device = KVLM_DEVICE_CPU;
        else if (kvlm_cuda_device_count() > 0) cp->device = KVLM_DEVICE_CUDA;
        else {
            /* as llama.cpp does in a build without GPU offload: said, and on the CPU */
            fprintf(stderr, "kvlm %s: warning: -ngl %d: no CUDA device (or a build without CUDA): running on the "
                    "CPU\n", cmd, ll->n_gpu_layers);
            cp->device = KVLM_DEVICE_CPU;
        }
    }
    if (cp && ll->ubatch > 0) cp->n_batch = ll->ubatch;
    if (cp && ll->parallel > 0) {
        /* llama-server's slots: -c is shared among them, each holding -c / -np tokens */
        cp->n_seq_max = ll->parallel;
        if (cp->n_ctx > 0) {
            if (cp->n_ctx / ll->parallel < 8)
                return cli_fail(cmd, "-np %d -c %d: each sequence would hold fewer than 8 tokens", ll->parallel,
                                cp->n_ctx);
            cp->n_ctx /= ll->parallel;
        }
    }
    if (mp) {
        mp->no_mmap = ll->no_mmap;
        mp->mlock = ll->mlock;
    }
    if (ll->verbose && kvlm_log_get_level() > KVLM_LOG_INFO) kvlm_log_set_level(KVLM_LOG_INFO);
    if (ll->escape)
        for (int k = 0; k < ll->n_reverse; k++) cli_unescape((char *)ll->reverse[k]);
    return 0;
}

char *cli_unescape(char *s) {
    char *w = s;
    for (const char *r = s; *r; r++) {
        if (*r != '\\' || !r[1]) { *w++ = *r; continue; }
        char c = r[1];
        static const char pairs[] = "n\nr\rt\t''\"\"\\\\"; /* escape letter, then what it stands for */
        const char *map = strchr(pairs, c);
        if (map && (map - pairs) % 2 == 0) {
            *w++ = map[1];
            r++;
        } else if (c == 'x' && isxdigit((unsigned char)r[2]) && isxdigit((unsigned char)r[3])) {
            char hex[3] = {r[2], r[3], 0};
            *w++ = (char)strtol(hex, NULL, 16);
            r += 3;
        } else *w++ = *r; /* a backslash kept, the next character read as it is */
    }
    *w = 0;
    return s;
}
