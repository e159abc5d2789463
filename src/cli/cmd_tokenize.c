/* cli/cmd_tokenize: `kvlm tokenize`: token ids of a text, on one line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

int cmd_tokenize(int argc, char **argv) {
    const char *model_path = NULL, *tok_path = NULL, *text = NULL, *file = NULL;
    bool no_bos = false, special = false, pieces = false;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm tokenize -m MODEL [--no-bos] [--special] [--pieces] (TEXT | -f FILE)\n\n"
                   "Prints the token ids of TEXT on one line, separated by spaces. Works on\n"
                   "vocabulary-only GGUF files too.\n"
                   "  --no-bos    do not add BOS even if the model asks for it\n"
                   "  --special   recognise special tokens written in the text\n"
                   "  --pieces    print id:'piece' pairs instead of bare ids\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &file, &bad)) {}
        else if (cli_is(argv[i], NULL, "--no-bos")) no_bos = true;
        else if (cli_is(argv[i], NULL, "--special")) special = true;
        else if (cli_is(argv[i], NULL, "--pieces")) pieces = true;
        else if (argv[i][0] == '-' && argv[i][1]) return cli_fail("tokenize", "unknown option '%s'", argv[i]);
        else if (!text) text = argv[i];
        else return cli_fail("tokenize", "give the text as one argument (quote it)");
        if (bad) return 1;
    }
    if (!model_path) return cli_fail("tokenize", "no model given (-m FILE)");
    if (!text && !file) return cli_fail("tokenize", "no text given");
    size_t len = text ? strlen(text) : 0;
    char *buf = NULL;
    if (file) {
        if (text) return cli_fail("tokenize", "give either TEXT or -f FILE");
        buf = cli_read_file("tokenize", file, &len);
        if (!buf) return 1;
        text = buf;
    }
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.vocab_only = true;
    mp.tokenizer_path = tok_path;
    kvlm_model *m = kvlm_model_load(model_path, &mp, &err);
    if (!m) { free(buf); return cli_fail("tokenize", "%s", err.msg); }
    bool bos = !no_bos && kvlm_add_bos(m);
    int n = kvlm_tokenize(m, text, len, bos, special, NULL, 0, &err);
    int32_t *ids = n >= 0 ? malloc(((size_t)n + 1) * sizeof *ids) : NULL;
    int rc = 0;
    if (n < 0) rc = cli_fail("tokenize", "%s", err.msg);
    else if (!ids) rc = cli_fail("tokenize", "out of memory");
    else {
        kvlm_tokenize(m, text, len, bos, special, ids, n, &err);
        for (int i = 0; i < n; i++) {
            if (pieces) {
                char piece[256];
                int pl = kvlm_token_to_text(m, ids[i], piece, sizeof piece - 1);
                printf("%s%d:'%.*s'", i ? " " : "", ids[i], pl > 0 ? pl : 0, piece);
            } else printf("%s%d", i ? " " : "", ids[i]);
        }
        printf("\n");
    }
    free(ids);
    free(buf);
    kvlm_model_free(m);
    return rc;
}
