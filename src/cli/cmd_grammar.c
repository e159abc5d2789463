/* cli/cmd_grammar: `kvlm grammar`: the GBNF grammar structured output would
 * hold text to (a JSON schema's translation, or a grammar given), checked with
 * the limits the server applies; no model needed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

static void grammar_usage(FILE *f) {
    fprintf(f,
            "usage: kvlm grammar (--json | --json-schema S | --json-schema-file F | --grammar G | --grammar-file F)\n\n"
            "Prints the GBNF grammar that run, chat and serve would hold generated text to: a JSON\n"
            "schema's translation, or the grammar given. Either is compiled as a request's would be;\n"
            "a schema or grammar kvlm refuses prints why (for GBNF, the line and column), exit 1.\n\n"
            CLI_GRAMMAR_USAGE);
}

int cmd_grammar(int argc, char **argv) {
    cli_grammar_opts g = {0};
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) { grammar_usage(stdout); return 0; }
        else if (cli_opt_grammar(argc, argv, &i, &g, &bad)) {}
        else { fprintf(stderr, "kvlm grammar: unknown option '%s'\n", argv[i]); grammar_usage(stderr); return 1; }
        if (bad) return 1;
    }
    if (!g.n) { grammar_usage(stderr); return 1; }
    bool failed;
    kvlm_grammar *gr = cli_grammar("grammar", &g, NULL, &failed);
    if (gr) fputs(kvlm_grammar_gbnf(gr), stdout); /* what the server and run compile, from the same builder */
    kvlm_grammar_free(gr);
    return failed;
}
