/* util/mem: large, long-lived buffers mapped on their own, 2 MiB aligned on
 * transparent huge pages, where one TLB entry covers what takes 512 with
 * 4 KiB pages.
 * - Written once, read every step (packed weights): the matmul streams ~100
 *   MB of them per token.
 * - Filled as the work goes (the KV pool): every page faulted in when it is
 *   made (populate). Otherwise each block a step touches for the first time
 *   costs the step ~150 page faults in its critical path. Attention reads a
 *   4 KiB region per block, layer and head, each on a page of its own with
 *   4 KiB pages: at long contexts a step would walk the page tables for
 *   nearly every one (docs/attention.md). The kernel may have to compact
 *   memory to find huge pages, which makes creating a pool slower; where it
 *   has none, the buffer is on 4 KiB pages. */
#include "util/mem.h"
#include <stdint.h>
#include <sys/mman.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#define BIG_ALIGN ((size_t)2 << 20)

static size_t round_up(size_t n) { return (n + BIG_ALIGN - 1) & ~(BIG_ALIGN - 1); }

void *util_big_alloc(size_t bytes, bool populate) {
    if (bytes == 0) return NULL;
    size_t len = round_up(bytes), span = len + BIG_ALIGN;
    if (len < bytes || span < len) return NULL;
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    /* keep the 2 MiB-aligned part, give back the ends */
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + BIG_ALIGN - 1) & ~(uintptr_t)(BIG_ALIGN - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + span > p + len) munmap(p + len, (size_t)(raw + span - (p + len)));
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE); /* advice only: 4 KiB pages if refused */
#endif
    if (populate) /* every page faulted in now, not in the middle of a step */
        for (size_t off = 0; off < len; off += 4096) ((volatile uint8_t *)p)[off] = 0;
    return p;
}

void util_big_free(void *p, size_t bytes) {
    if (p) munmap(p, round_up(bytes));
}

void util_mem_trim(void) {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
}
