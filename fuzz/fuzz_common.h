/* fuzz/fuzz_common: what the harnesses share: the shared models folder, and a
 * memfd that turns the fuzzer's bytes into a path for readers that take one. */
#ifndef KVLM_FUZZ_COMMON_H
#define KVLM_FUZZ_COMMON_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "kvlm.h"

#ifndef KVLM_SOURCE_DIR
#define KVLM_SOURCE_DIR "."
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The shared models: $KVLM_MODELS, ctest's default, or ../shared/models
 * beside the source tree. */
static inline const char *fuzz_models_dir(void) {
    const char *d = getenv("KVLM_MODELS");
    if (!d || !*d) d = getenv("KVLM_MODELS_DEFAULT");
    return d && *d ? d : KVLM_SOURCE_DIR "/../shared/models";
}

/* path <- models dir + "/" + name; false (and a loud note, once per name) if absent. */
static inline int fuzz_model_path(const char *name, char *path, size_t cap) {
    snprintf(path, cap, "%s/%s", fuzz_models_dir(), name);
    if (access(path, R_OK) == 0) return 1;
    fprintf(stderr, "fuzz: %s not found (set KVLM_MODELS); using a vocabulary built in memory\n", path);
    return 0;
}

/* A synthetic model (kvlm synth) in a temporary file, loaded, the file
 * removed (a load maps what it needs). NULL on failure, said on stderr. */
static inline kvlm_model *fuzz_synth_model(const kvlm_synth_params *sp, const kvlm_model_params *mp) {
    const char *tmp = getenv("TMPDIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/kvlm-fuzz-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0) { perror(path); return NULL; }
    close(fd);
    kvlm_error err = {0};
    kvlm_model *m = NULL;
    if (kvlm_model_synth(sp, path, &err) || !(m = kvlm_model_load(path, mp, &err)))
        fprintf(stderr, "fuzz: synthetic model: %s\n", err.msg);
    unlink(path);
    return m;
}

/* A memory file holding exactly these bytes; *path names it. */
typedef struct { int fd; char path[64]; } fuzz_file;

static inline int fuzz_file_set(fuzz_file *f, const void *data, size_t size) {
    if (f->fd <= 0) {
        f->fd = memfd_create("kvlm-fuzz", 0);
        if (f->fd < 0) { perror("memfd_create"); abort(); }
        snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
    }
    if (ftruncate(f->fd, 0) != 0) abort();
    size_t off = 0;
    while (off < size) {
        ssize_t w = pwrite(f->fd, (const char *)data + off, size - off, (off_t)off);
        if (w <= 0) abort();
        off += (size_t)w;
    }
    return 0;
}
#endif
