/* fuzz/fuzz_session: the session-file decoder (kv/session): the input is a
 * session file, loaded into an empty sequence of a small store for a prompt
 * that repeats the tokens the file claims (so its stored blocks are read and
 * checked). With KVLM_FUZZ_SEEDS=DIR set, writes a real session file there. */
#include "fuzz_common.h"
#include "fuzz_kvstore.h"
#include "kvlm.h"

static fuzz_file file;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "off", 0);
    const char *dir = getenv("KVLM_FUZZ_SEEDS");
    if (dir && *dir) {
        kv_store *s = fuzz_store();
        int32_t toks[10] = {5, 9, 2, 7, 1, 1, 3, 8, 4, 6};
        fuzz_store_fill(s, toks, 10);
        char path[1024];
        snprintf(path, sizeof path, "%s/session-10-tokens.bin", dir);
        kvlm_error err = {0};
        if (kv_session_save(s, 0, path, &err)) { fprintf(stderr, "fuzz_session: %s\n", err.msg); abort(); }
        kv_store_free(s);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* the prompt: the file's saved tokens (up to 32, from offset 72), then one more */
    int32_t toks[33];
    int n = 0;
    uint64_t n_saved = 0;
    if (size >= 72) memcpy(&n_saved, data + 48, 8);
    for (; n < 32 && (uint64_t)n < n_saved && 72 + 4 * (size_t)n + 4 <= size; n++) memcpy(&toks[n], data + 72 + 4 * n, 4);
    toks[n++] = 11;
    fuzz_file_set(&file, data, size);
    kv_store *s = fuzz_store();
    kvlm_error err = {0};
    int got = kv_session_load(s, 0, toks, n, file.path, &err);
    if (got > n - 1 || (got > 0 && got % FZ_BS)) { fprintf(stderr, "session load returned %d for %d tokens\n", got, n); abort(); }
    if (getenv("KVLM_FUZZ_VERBOSE")) fprintf(stderr, "fuzz_session: %d of %d tokens attached\n", got, n);
    if (got > 0) kv_store_release(s, 0);
    kv_store_free(s);
    return 0;
}
