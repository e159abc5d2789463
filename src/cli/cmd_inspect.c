/* cli/cmd_inspect: `kvlm inspect`: a model file's metadata and tensors. */
#include <stdio.h>
#include <stdlib.h>
#include "cli/cli.h"

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL, *tok_path = NULL;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm inspect MODEL [--tokenizer FILE]\n\n"
                   "Lists the metadata (key = value) and the tensors (name, type, shape, offset, bytes)\n"
                   "of a GGUF file, or the header and weights of a llama2.c checkpoint.\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {
            if (bad) return 1;
        } else if (argv[i][0] == '-') return cli_fail("inspect", "unknown option '%s'", argv[i]);
        else if (!path) path = argv[i];
        else return cli_fail("inspect", "more than one file given");
    }
    if (!path) return cli_fail("inspect", "no model file given (kvlm inspect MODEL)");
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.metadata_only = true;
    mp.tokenizer_path = tok_path;
    kvlm_model *m = kvlm_model_load(path, &mp, &err);
    if (!m) return cli_fail("inspect", "%s", err.msg);
    int n_meta = kvlm_model_n_meta(m), n_t = kvlm_model_n_tensors(m);
    printf("%s: %d metadata entries, %d tensors\n", path, n_meta, n_t);
    char key[1024], *val = malloc(4096);
    if (!val) { kvlm_model_free(m); return cli_fail("inspect", "out of memory"); }
    for (int i = 0; i < n_meta; i++)
        if (kvlm_model_meta(m, i, key, sizeof key, val, 4096)) printf("  %-44s = %s\n", key, val);
    free(val);
    size_t total = 0;
    for (int i = 0; i < n_t; i++) {
        kvlm_tensor_info t;
        if (!kvlm_model_tensor(m, i, &t)) continue;
        char shape[96];
        int off = 0;
        for (int d = 0; d < t.n_dims; d++)
            off += snprintf(shape + off, sizeof shape - (size_t)off, "%s%lld", d ? " x " : "", (long long)t.ne[d]);
        printf("  %-36s %-6s %-20s offset %-12llu %zu bytes\n", t.name, kvlm_type_name(t.type), shape,
               (unsigned long long)t.offset, t.nbytes);
        total += t.nbytes;
    }
    printf("%d tensors, %.2f MiB\n", n_t, (double)total / (1 << 20));
    kvlm_model_free(m);
    return 0;
}
