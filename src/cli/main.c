/* cli/main: the `kvlm` command: dispatches to its subcommands. */
#include <stdio.h>
#include <string.h>
#include "cli/cli.h"
#include "cli/llama_flags.h"

static void usage(FILE *f) {
    fprintf(f,
            "kvlm: LLM inference on the CPU, built around its KV cache\n\n"
            "usage: kvlm COMMAND [options]   (kvlm COMMAND --help for each)\n\n"
            "commands:\n"
            "  run        generate text from a prompt\n"
            "  chat       a conversation in the terminal, kept in the KV cache between turns\n"
            "  inspect    list a model file's metadata and tensors\n"
            "  tokenize   print the token ids of a text\n"
            "  embed      print the embeddings of texts (vectors for retrieval)\n"
            "  grammar    print the GBNF grammar a JSON schema becomes (structured output), or check one\n"
            "  template   render a chat template (Jinja) with a conversation, as transformers does\n"
            "  convert    write a model (GGUF or llama2.c) as GGUF, optionally quantized\n"
            "  synth      write a random-weight model of any shape (for tests and benchmarks)\n"
            "  logits     print the next-token logits after each token of a prompt\n"
            "  plan       KV cache memory for a context and batch; what fits a budget\n"
            "  perplexity perplexity of a text file (as llama.cpp computes it)\n"
            "  serve      an OpenAI-compatible HTTP server batching many requests in one KV cache\n\n"
            "kvlm --version: the version and the git revision it was built from.\n"
            "run, chat, serve and perplexity take llama.cpp's names for their options too (-ngl, -fa, -ctk,\n"
            "-np, -s, -r, -cnv, ...: docs/cli.md); a llama.cpp flag kvlm lacks is named as such.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 1;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("kvlm %s\n", kvlm_version());
        return 0;
    }
    struct { const char *name; int (*fn)(int, char **); } cmds[] = {
        {"run", cmd_run}, {"chat", cmd_chat}, {"inspect", cmd_inspect}, {"tokenize", cmd_tokenize}, {"embed", cmd_embed}, {"grammar", cmd_grammar}, {"template", cmd_template},
        {"convert", cmd_convert}, {"synth", cmd_synth}, {"logits", cmd_logits}, {"plan", cmd_plan}, {"perplexity", cmd_perplexity}, {"serve", cmd_serve},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        if (!strcmp(cmd, cmds[i].name)) {
            cli_set_command(cmds[i].name);
            return cmds[i].fn(argc - 1, argv + 1);
        }
    fprintf(stderr, "kvlm: unknown command '%s'\n", cmd);
    usage(stderr);
    return 1;
}
