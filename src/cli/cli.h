/* cli/cli: shared pieces of the `kvlm` subcommands: option parsing helpers
 * and the subcommand entry points. */
#ifndef KVLM_CLI_H
#define KVLM_CLI_H
#include <stdbool.h>
#include <stdint.h>
#include "kvlm.h"

int cmd_run(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
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
/* Prints "kvlm CMD: message" to stderr; returns 1. */
int cli_fail(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parses "512MiB", "2GiB", "1.5GB", "100k" or plain bytes; 0 on success. */
int cli_parse_size(const char *s, size_t *out);
/* Reads a whole file as text (NUL-terminated); NULL with a message on error. */
char *cli_read_file(const char *cmd, const char *path, size_t *len);
#endif
