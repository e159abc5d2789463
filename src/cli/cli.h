/* cli/cli: shared pieces of the `kvlm` subcommands: option parsing helpers
 * and the subcommand entry points. */
#ifndef KVLM_CLI_H
#define KVLM_CLI_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"

int cmd_run(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_embed(int argc, char **argv);
int cmd_grammar(int argc, char **argv);
int cmd_template(int argc, char **argv);
int cmd_convert(int argc, char **argv);
int cmd_synth(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_serve(int argc, char **argv);

/* Option parsing: each returns true when argv[*i] is the named option and
 * consumes its value (argv[++*i]); on a missing/bad value it prints an error
 * and sets *bad. */
bool cli_opt_str(int argc, char **argv, int *i, const char *s, const char *l, const char **out, bool *bad);
bool cli_opt_int(int argc, char **argv, int *i, const char *s, const char *l, int *out, bool *bad);
bool cli_opt_u64(int argc, char **argv, int *i, const char *s, const char *l, uint64_t *out, bool *bad);
bool cli_opt_float(int argc, char **argv, int *i, const char *s, const char *l, float *out, bool *bad);
bool cli_is(const char *arg, const char *s, const char *l);
/* --cache-type-k / --cache-type-v NAME: a KV cache element type by name
 * (values: not q4_kc), with a clear error for anything else. */
bool cli_opt_cache_type(int argc, char **argv, int *i, const char *l, bool values, int *out, bool *bad);
/* The context and KV cache options of run, serve and perplexity: -c/--ctx,
 * -t/--threads, --kv-mem SIZE, --block-size, --cache-type-k/-v, --kv-budget,
 * --kv-evict NAME, --kv-sinks, --h2o-recent, --h2o-heavy, and the KV tiers
 * --kv-host-size SIZE, --kv-disk DIR, --kv-disk-size SIZE, --kv-redis URL
 * (with --kv-redis-password-file FILE, --kv-redis-tls-ca/-cert/-key FILE), the
 * block-signing key --kv-key FILE (or $KVLM_KV_KEY_FILE / $KVLM_KV_KEY), and
 * the swap space --kv-swap-size SIZE (sizes are parsed where they are read). cli_opt_ctx takes
 * argv[*i] if it is one of them (the two strings stay as given, for
 * cli_ctx_finish); cli_ctx_finish checks the ranges and converts kv_mem and
 * evict (either may be NULL) into cp, and reads the Redis password (the
 * file, else $KVLM_REDIS_PASSWORD; warns once of one in the URL); returns
 * 0, or 1 after an error.
 * CLI_CTX_USAGE is their help text. */
bool cli_opt_ctx(int argc, char **argv, int *i, kvlm_ctx_params *cp, const char **kv_mem, const char **evict, bool *bad);
int cli_ctx_finish(const char *cmd, kvlm_ctx_params *cp, const char *kv_mem, const char *evict);
#define CLI_CTX_USAGE \
    "  -c, --ctx N             context length (default: the model's trained context; --ctx-size)\n" \
    "  -t, --threads N         threads (default: one per core)\n" \
    "      --device D          cpu (default) or cuda: weights, KV cache and kernels on an NVIDIA GPU\n" \
    "                          (-dev: also llama.cpp's none and CUDA0)\n" \
    "      --kv-mem SIZE       KV cache pool (e.g. 512MiB; default: room for every sequence's budget)\n" \
    "      --block-size N      tokens per KV cache block (default 16)\n" \
    "  -ctk, --cache-type-k T  element type of cached keys: f16 (default), f32, bf16, q8_0, q4_0,\n" \
    "                          q4_kc (4-bit per channel over each block, KIVI-style)\n" \
    "  -ctv, --cache-type-v T  element type of cached values: f16 (default), f32, bf16, q8_0, q4_0\n" \
    "      --kv-budget N       most tokens a sequence keeps in its KV cache (default: the context)\n" \
    "      --kv-evict P        what goes when the budget is full: none (stop there; default),\n" \
    "                          window (the last N), sinks (the first S and the last N - S) or h2o\n" \
    "                          (the most recent and the most attended); with sinks, h2o or window\n" \
    "                          generation goes on indefinitely, past the context\n" \
    "      --kv-sinks S        first tokens kept under sinks (default 4)\n" \
    "      --h2o-recent R      most recent tokens kept under h2o (default: budget less heavy hitters)\n" \
    "      --h2o-heavy F       share of the kept tokens h2o picks by attention (default 0.5)\n" \
    "      --kv-host-size SIZE a host-memory tier for cached blocks dropped from the pool (e.g. 4GiB)\n" \
    "      --kv-disk DIR       a disk tier: cached blocks dropped from the pool are kept in DIR and\n" \
    "                          found again, also after a restart (docs/kv-tiers.md)\n" \
    "      --kv-disk-size SIZE its cap (default 20GiB)\n" \
    "      --kv-redis URL      redis://[USER@]HOST:PORT[/DB]: full blocks shared with every process using it;\n" \
    "                          redis-cluster://[USER@]HOST:PORT[,HOST:PORT...]: over a Redis Cluster's nodes;\n" \
    "                          rediss:// and rediss-cluster://: over TLS (docs/kv-tiers.md)\n" \
    "      --kv-redis-password-file FILE\n" \
    "                          Redis's AUTH password: FILE's first line (else $KVLM_REDIS_PASSWORD;\n" \
    "                          one in the URL works but shows in the process list)\n" \
    "      --kv-redis-tls-ca FILE  CA (PEM) that Redis's certificate must chain to (default: the system's)\n" \
    "      --kv-redis-tls-cert FILE, --kv-redis-tls-key FILE\n" \
    "                          a client certificate and its key (PEM) for rediss:// (Redis asks for one\n" \
    "                          by default: tls-auth-clients yes)\n" \
    "      --kv-swap-size SIZE host memory for preempted sequences' blocks (default: the pool's size;\n" \
    "                          0: none, preemption recomputes)\n" \
    "      --kv-key FILE       sign the blocks written to the disk and Redis tiers and to sessions with\n" \
    "                          this secret (every instance sharing a tier gives the same one) and use\n" \
    "                          only blocks whose signature verifies (also $KVLM_KV_KEY_FILE, or the\n" \
    "                          secret itself in $KVLM_KV_KEY; docs/kv-tiers.md)\n"
/* The sampling options of run and chat: --temp, --top-k, --top-p, --min-p,
 * --repeat-penalty, --repeat-last-n (-1: all), --presence-penalty,
 * --frequency-penalty, --typical, --dry-multiplier, --dry-base,
 * --dry-allowed-length, --dry-penalty-last-n, --dry-sequence-breaker
 * (repeated), --xtc-probability, --xtc-threshold, --samplers /
 * --sampling-seq, --seed (sets *seed_set; -1: random), -l/--logit-bias
 * (repeated; the biases and breakers live as long as the process: argv's).
 * The run sets sp->model once the model is loaded (DRY's breakers, --ignore-eos).
 * CLI_SAMPLER_USAGE is their help text. */
bool cli_opt_sampler(int argc, char **argv, int *i, kvlm_sampler_params *sp, bool *seed_set, bool *bad);
/* One more logit bias in sp (the same process-long store); -1 when full. */
int cli_sampler_add_bias(kvlm_sampler_params *sp, int32_t id, float bias);
/* The sampling values checked as the server checks a request's
 * (kvlm_sampler_params_check), named as the options are; vocab 0 before a
 * model is loaded (token ids then checked against it later). 1 after cli_fail. */
int cli_sampler_check(const char *cmd, const kvlm_sampler_params *sp, int vocab);
#define CLI_SAMPLER_USAGE \
    "      --temp T            temperature, 0..2; 0 = greedy (default 0.8)\n" \
    "      --top-k K           keep the K most likely tokens (default 40; 0 or -1 = off)\n" \
    "      --top-p P           nucleus sampling, 0..1 (default 0.95; 1 = off)\n" \
    "      --min-p P           drop tokens below P x the top probability, 0..1 (default 0.05; 0 = off)\n" \
    "      --repeat-penalty R  penalise recent tokens, 0..100 (default 1.0 = off)\n" \
    "      --repeat-last-n N   how many recent tokens the penalty sees, 0..65536 (default 64)\n" \
    "      --presence-penalty P  OpenAI's: subtract P from the logit of each token already generated, -2..2\n" \
    "      --frequency-penalty F  ... F times the times it was generated, -2..2 (both default 0 = off)\n" \
    "      --typical P         locally typical sampling, 0..1 (default 1 = off)\n" \
    "      --dry-multiplier M  DRY: penalise extending a repeated run, 0..100 (default 0 = off); with\n" \
    "                          --dry-base B (1.75), --dry-allowed-length N (2), --dry-penalty-last-n N (-1: all),\n" \
    "                          --dry-sequence-breaker S (repeatable; default \\n : \" *; none: no breaker)\n" \
    "      --xtc-probability P XTC: with probability P drop the top choices but the least of them, 0..1\n" \
    "                          (default 0 = off); --xtc-threshold T: those at or above T (0.1)\n" \
    "      --samplers S        the stages' order, llama.cpp's: names joined by ';' (penalties;dry;top_k;typ_p;\n" \
    "                          temperature;top_p;min_p;xtc), or --sampling-seq with one letter each (edkytpmx)\n" \
    "  -s, --seed S            random seed (default: time-based; -1 too); the same seed gives the same text\n" \
    "  -l, --logit-bias T+B    add B (-100..100) to token T's logit (T-B subtracts; 2-inf bans token 2); repeatable\n"
/* Structured output for run, chat and grammar: --json (any JSON object),
 * --json-schema TEXT, --json-schema-file FILE, --grammar TEXT, --grammar-file
 * FILE (GBNF); at most one. cli_grammar makes the grammar for model (NULL:
 * only checked) through kvlm_grammar_build, as the server does; NULL: none
 * asked, or *failed after cli_fail. */
typedef struct { bool json; const char *json_schema, *json_schema_file, *grammar, *grammar_file; int n; } cli_grammar_opts;
bool cli_opt_grammar(int argc, char **argv, int *i, cli_grammar_opts *g, bool *bad);
kvlm_grammar *cli_grammar(const char *cmd, const cli_grammar_opts *g, const kvlm_model *model, bool *failed);
#define CLI_GRAMMAR_USAGE \
    "      --json              the text generated is one JSON object (OpenAI's JSON mode)\n" \
    "      --json-schema S     ... one JSON value that JSON schema S describes (docs/structured-output.md)\n" \
    "      --json-schema-file F  the schema from file F\n" \
    "      --grammar G         the text generated follows GBNF grammar G (llama.cpp's format; rule root)\n" \
    "      --grammar-file F    the grammar from file F\n"
/* Prints "kvlm CMD: message" to stderr; returns 1. */
int cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parses "512MiB", "2GiB", "1.5GB", "100k" or plain bytes; 0 on success. */
int cli_parse_size(const char *s, size_t *out);
/* Reads a whole file as text (NUL-terminated); NULL with a message on error. */
char *cli_read_file(const char *cmd, const char *path, size_t *len);
/* The chat format (docs/chat-templates.md): --chat-template-file FILE (a
 * Jinja template), --chat-template NAME (a built-in family or one of the
 * model's named templates), else the model's own; answers read with the
 * tool-call parser named (NULL: the template's) and KVLM_REASONING_*
 * (docs/tool-calls.md). NULL after cli_fail. */
kvlm_chat *cli_chat(const char *cmd, const kvlm_model *model, const char *name, const char *file, const char *parser,
                    int reasoning);
/* --reasoning-format auto|none (deepseek: auto, as llama-server's); -1 after cli_fail. */
int cli_reasoning_format(const char *cmd, const char *s);
#define CLI_TOOLS_USAGE \
    "      --tool-call-parser P  how tool calls are read and held in answers (docs/tool-calls.md): hermes,\n" \
    "                          qwen3-coder, llama3, mistral, deepseek-r1, gpt-oss, ... (vLLM's names too);\n" \
    "                          default: picked from the chat template\n" \
    "      --reasoning-format F  auto (default: reasoning in reasoning_content) or none (left in content)\n"
/* (its %s: kvlm_chat_family_names(), the families' one list, tok/chat.c's) */
#define CLI_CHAT_USAGE \
    "      --chat-template T   a built-in family or one of the model's named templates (tool_use);\n" \
    "                          default: the model's own Jinja template. The families:\n" \
    "                          %s\n" \
    "      --chat-template-file F  a Jinja chat template from file F instead of the model's\n"
/* --draft FILE: the draft model; when its cache fits the model's pool
 * (kvlm_draft_shares_pool), the pool keeps sequences for it
 * (cp->n_seq_draft = n_seq_max) and *shared is set. NULL after cli_fail. */
kvlm_model *cli_load_draft(const char *cmd, const char *path, const kvlm_model *model, kvlm_ctx_params *cp,
                           bool *shared);
#endif
