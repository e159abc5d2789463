/* fuzz/replay: a main() for the harnesses in the normal build (no libFuzzer):
 * runs every file of the folders given (the seed corpus, the regression
 * inputs of bugs fuzzing found) through LLVMFuzzerTestOneInput once. A
 * harness aborts on a broken property; a fixed crash stays fixed. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int replay_file(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) { perror(path); return -1; }
    size_t cap = 1 << 16, n = 0, got;
    uint8_t *buf = malloc(cap);
    while (buf && (got = fread(buf + n, 1, cap - n, fp)) > 0)
        if ((n += got) == cap) buf = realloc(buf, cap *= 2);
    fclose(fp);
    if (!buf) return -1;
    uint8_t *exact = malloc(n ? n : 1); /* exactly n bytes, as libFuzzer gives them */
    memcpy(exact, buf, n);
    free(buf);
    printf("replay: %s (%zu bytes)\n", path, n);
    fflush(stdout);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

int main(int argc, char **argv) {
    LLVMFuzzerInitialize(&argc, &argv);
    int total = 0;
    for (int a = 1; a < argc; a++) {
        DIR *d = opendir(argv[a]);
        if (!d) { printf("replay: %s: no such folder, skipped\n", argv[a]); continue; }
        char **names = NULL;
        size_t n = 0;
        struct dirent *e;
        while ((e = readdir(d)))
            if (e->d_name[0] != '.') {
                names = realloc(names, (n + 1) * sizeof *names);
                names[n++] = strdup(e->d_name);
            }
        closedir(d);
        if (n) qsort(names, n, sizeof *names, by_name);
        for (size_t i = 0; i < n; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[a], names[i]);
            if (replay_file(path)) return 1;
            total++;
            free(names[i]);
        }
        free(names);
    }
    printf("replay: %d inputs, no crash\n", total);
    if (total == 0) { fprintf(stderr, "replay: NO INPUTS FOUND: skipped\n"); return 77; }
    return 0;
}
