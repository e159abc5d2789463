/* util/mem: large, long-lived buffers mapped on their own.
 * - Written once, read every step (packed weights): on transparent huge
 *   pages, 2 MiB aligned, where one TLB entry covers what takes 512 with
 *   4 KiB pages (the matmul streams ~100 MB of them per token).
 * - Filled as the work goes (the KV pool): every page faulted in when it is
 *   made. Otherwise each block a step touches for the first time costs the
 *   step ~150 page faults in its critical path (kvlm serve at 16 streams:
 *   about 5% of tokens/s). Huge pages there would need the kernel to compact
 *   memory at creation (3.4 s per GiB on the development VM), so 4 KiB. */
#include "util/mem.h"
#include <stdint.h>
#include <sys/mman.h>

#define BIG_ALIGN ((size_t)2 << 20)

static size_t round_up(size_t n) { return (n + BIG_ALIGN - 1) & ~(BIG_ALIGN - 1); }

void *util_big_alloc(size_t bytes, bool populate) {
    if (bytes == 0) return NULL;
    size_t len = round_up(bytes), span = len + BIG_ALIGN;
    if (len < bytes || span < len) return NULL;
    if (populate) { /* every page faulted in now, in one call, not in the middle of a step */
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    /* keep the 2 MiB-aligned part, give back the ends */
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + BIG_ALIGN - 1) & ~(uintptr_t)(BIG_ALIGN - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + span > p + len) munmap(p + len, (size_t)(raw + span - (p + len)));
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE); /* advice only: 4 KiB pages if refused */
#endif
    return p;
}

void util_big_free(void *p, size_t bytes) {
    if (p) munmap(p, round_up(bytes));
}
