/* util/mem: large, long-lived buffers mapped on their own, on transparent
 * huge pages: packed weights, and the KV pool faulted in when it is made;
 * giving freed heap memory back to the system. */
#ifndef KVLM_UTIL_MEM_H
#define KVLM_UTIL_MEM_H
#include <stdbool.h>
#include <stddef.h>
/* bytes of zeroed memory, 2 MiB aligned and advised to be transparent huge
 * pages, or NULL; free with util_big_free and the same size. populate: every
 * page faulted in now; else as written. */
void *util_big_alloc(size_t bytes, bool populate);
void util_big_free(void *p, size_t bytes);
/* Gives the system back what the allocator keeps of freed memory (glibc
 * keeps freed blocks, small or once-large, inside its heaps): after many
 * clients' buffers went. A no-op elsewhere. */
void util_mem_trim(void);
#endif
