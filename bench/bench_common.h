/* bench/bench_common: random-weight models of real shapes for the benchmarks,
 * written once to $KVLM_BENCH_DIR (default /tmp/kvlm-bench) and reused. */
#ifndef KVLM_BENCH_COMMON_H
#define KVLM_BENCH_COMMON_H
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include "kvlm.h"

typedef struct { const char *name; int dim, hidden, layers, heads, kv, vocab, n_ctx; } bench_shape;

/* Path of the model of shape s with 2-D weights of type wtype ("f32",
 * "q8_0", ...), written first if absent. Exits on failure. */
static inline const char *bench_model_path(const bench_shape *s, const char *wtype, char *buf, size_t cap) {
    const char *dir = getenv("KVLM_BENCH_DIR") ? getenv("KVLM_BENCH_DIR") : "/tmp/kvlm-bench";
    mkdir(dir, 0755);
    snprintf(buf, cap, "%s/%s-%s-c%d.gguf", dir, s->name, wtype, s->n_ctx);
    struct stat st;
    if (stat(buf, &st) == 0) return buf;
    kvlm_synth_params p = {0};
    p.arch = KVLM_ARCH_LLAMA;
    p.dim = s->dim; p.hidden_dim = s->hidden; p.n_layers = s->layers;
    p.n_heads = s->heads; p.n_kv_heads = s->kv; p.vocab_size = s->vocab; p.n_ctx = s->n_ctx;
    p.type = kvlm_type_from_name(wtype);
    p.seed = 1;
    kvlm_error err = {0};
    fprintf(stderr, "  (writing %s ...)\n", buf);
    if (kvlm_model_synth(&p, buf, &err)) { fprintf(stderr, "synth: %s\n", err.msg); exit(1); }
    return buf;
}

static inline kvlm_model *bench_load(const char *path) {
    kvlm_error err = {0};
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    return m;
}
#endif
