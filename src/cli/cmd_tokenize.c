/* cli/cmd_tokenize: `kvlm tokenize`: token ids of a text, on one line, or the
 * pre-tokenizer's chunks of it (--chunks). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "cli/cli.h"

/* One chunk as a double-quoted line: backslash, quote, control bytes and
 * bytes that do not form UTF-8 are escaped (\n, \t, \xHH, ...). */
static void print_chunk(const char *s, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t l = c < 0x80 ? 1 : c >= 0xC2 && c < 0xE0 ? 2 : c >= 0xE0 && c < 0xF0 ? 3 : c >= 0xF0 && c < 0xF5 ? 4 : 0;
        for (size_t k = 1; k < l; k++)
            if (i + k >= n || ((unsigned char)s[i + k] & 0xC0) != 0x80) l = 0;
        if (l > 1) { fwrite(s + i, 1, l, stdout); i += l; continue; }
        if (c == '\\' || c == '"') printf("\\%c", c);
        else if (c == '\n') fputs("\\n", stdout);
        else if (c == '\r') fputs("\\r", stdout);
        else if (c == '\t') fputs("\\t", stdout);
        else if (c < 0x20 || c >= 0x7F) printf("\\x%02x", c);
        else putchar(c);
        i++;
    }
    puts("\"");
}

/* --chunks: the pre-tokenizer's chunks, one per line. */
static int show_chunks(const kvlm_model *m, const char *pre, const char *text, size_t len) {
    kvlm_error err = {0};
    int n = kvlm_pretokenize(m, pre, text, len, NULL, 0, &err);
    if (n < 0) return cli_fail("tokenize", "%s", err.msg);
    size_t *ends = malloc(((size_t)n + 1) * sizeof *ends);
    if (!ends) return cli_fail("tokenize", "out of memory");
    n = kvlm_pretokenize(m, pre, text, len, ends, n, &err);
    size_t start = 0;
    for (int i = 0; i < n; i++) {
        print_chunk(text + start, ends[i] - start);
        start = ends[i];
    }
    free(ends);
    return n < 0 ? cli_fail("tokenize", "%s", err.msg) : 0;
}

int cmd_tokenize(int argc, char **argv) {
    const char *model_path = NULL, *tok_path = NULL, *text = NULL, *file = NULL, *pre = NULL;
    bool no_bos = false, special = false, pieces = false, chunks = false;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm tokenize -m MODEL [--no-bos] [--special] [--pieces] (TEXT | -f FILE)\n"
                   "       kvlm tokenize (-m MODEL | --pre NAME) --chunks (TEXT | -f FILE)\n\n"
                   "Prints the token ids of TEXT on one line, separated by spaces. Works on\n"
                   "vocabulary-only GGUF files too.\n"
                   "  --no-bos    do not add BOS even if the model asks for it\n"
                   "  --special   recognise special tokens written in the text\n"
                   "  --pieces    print id:'piece' pairs instead of bare ids\n"
                   "  --chunks    print the pre-tokenizer's chunks instead, one quoted chunk a line\n"
                   "              (\\n, \\t, \\\\, \\\" and \\xHH escaped)\n"
                   "  --pre NAME  with --chunks: that tokenizer.ggml.pre pre-tokenizer (no model\n"
                   "              needed; an unknown NAME lists the known ones)\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, "-m", "--model", &model_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, "-f", "--file", &file, &bad)) {}
        else if (cli_is(argv[i], NULL, "--no-bos")) no_bos = true;
        else if (cli_is(argv[i], NULL, "--special")) special = true;
        else if (cli_is(argv[i], NULL, "--pieces")) pieces = true;
        else if (cli_is(argv[i], NULL, "--chunks")) chunks = true;
        else if (cli_opt_str(argc, argv, &i, NULL, "--pre", &pre, &bad)) {}
        else if (argv[i][0] == '-' && argv[i][1]) return cli_fail("tokenize", "unknown option '%s'", argv[i]);
        else if (!text) text = argv[i];
        else return cli_fail("tokenize", "give the text as one argument (quote it)");
        if (bad) return 1;
    }
    if (pre && !chunks) return cli_fail("tokenize", "--pre goes with --chunks");
    if (!model_path && !pre) return cli_fail("tokenize", "no model given (-m FILE)");
    if (!text && !file) return cli_fail("tokenize", "no text given");
    size_t len = text ? strlen(text) : 0;
    char *buf = NULL;
    if (file) {
        if (text) return cli_fail("tokenize", "give either TEXT or -f FILE");
        buf = cli_read_file("tokenize", file, &len);
        if (!buf) return 1;
        text = buf;
    }
    if (chunks && !model_path) {
        int rc = show_chunks(NULL, pre, text, len);
        free(buf);
        return rc;
    }
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.vocab_only = true;
    mp.tokenizer_path = tok_path;
    kvlm_model *m = kvlm_model_load(model_path, &mp, &err);
    if (!m) { free(buf); return cli_fail("tokenize", "%s", err.msg); }
    if (chunks) {
        int rc = show_chunks(m, pre, text, len);
        free(buf);
        kvlm_model_free(m);
        return rc;
    }
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
