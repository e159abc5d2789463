/* cli/llama_flags: llama.cpp's command-line names in kvlm: the aliases of
 * kvlm's own options, the llama.cpp flags with a meaning of their own here
 * (-ngl, -fa, -np, -r, -cnv, --ignore-eos, ...), and the table of every flag
 * llama.cpp b4747 has, so one kvlm lacks is named as such. docs/cli.md. */
#ifndef KVLM_CLI_LLAMA_FLAGS_H
#define KVLM_CLI_LLAMA_FLAGS_H
#include <stdbool.h>
#include "kvlm.h"

/* The subcommand being parsed ("run", "serve", ...): llama.cpp's aliases
 * differ between its tools (-b is serve's --batch-tokens). Set by main. */
void cli_set_command(const char *cmd);
const char *cli_command(void);

/* The kvlm option that arg (a llama.cpp name: --ctx-size, -ctk, -s, ...)
 * stands for in the current command, or NULL. cli_is matches through it. */
const char *cli_llama_alias(const char *arg);

/* True when arg is one of llama.cpp's flags (common/arg.cpp of b4747, with
 * its aliases): prints "kvlm CMD: llama.cpp's ARG is not supported by kvlm
 * CMD" (and why, for some) so the user knows it is not a typo. */
bool cli_llama_unsupported(const char *cmd, const char *arg);

/* The draft options of run and serve: --draft FILE (kvlm's draft model) or
 * --draft N (llama.cpp's, a draft count: a value of digits only), -md /
 * --model-draft FILE (llama.cpp's draft model), --draft-n / --draft-max N. */
bool cli_opt_draft(int argc, char **argv, int *i, const char **path, int *n, bool *bad);

/* What llama.cpp's flags with a meaning of their own set; applied by the
 * command after parsing (cli_llama_finish). */
#define CLI_MAX_REVERSE 8
typedef struct cli_llama {
    int n_gpu_layers;      /* -ngl N: > 0 the CUDA device, 0 the CPU; -1 not given */
    int ubatch;            /* -ub N: kvlm_ctx_params.n_batch (0: not given) */
    int parallel;          /* -np N (serve): sequences at once, each -c / N tokens (0: not given) */
    bool no_mmap, mlock;   /* kvlm_model_params' */
    bool verbose;          /* -v: the model, device and cache described; library info lines */
    bool ignore_eos;       /* --ignore-eos (run, chat): kvlm_sampler_params.ignore_eos */
    bool escape;           /* -e: \n, \t, \\, \", \', \xHH in -p / each message (run, chat) */
    bool conversation;     /* -cnv (run): a conversation: kvlm chat */
    const char *reverse[CLI_MAX_REVERSE]; /* -r TEXT (run, chat): stop after it */
    int n_reverse;
} cli_llama;
void cli_llama_init(cli_llama *ll);
/* Takes argv[*i] if it is one of those flags (as cli_opt_* do). */
bool cli_opt_llama(int argc, char **argv, int *i, cli_llama *ll, bool *bad);
/* Applies ll to cp and mp (either may be NULL) and checks it; 1 after cli_fail. */
int cli_llama_finish(const char *cmd, cli_llama *ll, kvlm_ctx_params *cp, kvlm_model_params *mp);
/* -e: llama.cpp's escapes in s, in place: \n \r \t \' \" \\ and \xHH (two
 * hex digits); any other backslash stays as it is. Returns s. */
char *cli_unescape(char *s);
/* The help text of the llama.cpp flags every llama-like command takes. */
#define CLI_LLAMA_USAGE \
    "llama.cpp's names (docs/cli.md): --ctx-size, --predict, -ctk, -ctv, -s, -j, -md, --draft-max; and\n" \
    "  -ngl, --n-gpu-layers N   > 0: on the CUDA device (--device cuda; the CPU where there is none), 0: the CPU\n" \
    "  -fa, --flash-attn [on|off|auto]  accepted: kvlm's attention is always tiled (flash-style)\n" \
    "  -ub, --ubatch-size N    most tokens per forward pass (default 512)\n" \
    "      --no-mmap           read the model into memory instead of mapping the file\n" \
    "      --mlock             keep the model's memory from being paged out (ulimit -l permitting)\n" \
    "  -v, --verbose           describe the model, the device and the cache; the library's info lines\n" \
    "      --version           kvlm's version and git revision\n"
#endif
