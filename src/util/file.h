/* util/file: a whole small file read into memory (tokenizers, chat
 * templates, PEM keys, request bodies given as files); a model file mapped
 * or read whole (util_map_file). */
#ifndef KVLM_UTIL_FILE_H
#define KVLM_UTIL_FILE_H
#include <stddef.h>
#include "kvlm.h"

/* The whole of the file at path, NUL-terminated (*len: its bytes, without
 * the NUL; may be NULL), in a malloc'd buffer; NULL with err set (the path
 * and errno's text when it cannot be opened, KVLM_EIO; KVLM_EINVAL when it
 * is larger than max bytes). */
char *util_read_file(const char *path, size_t max, size_t *len, kvlm_error *err);

/* How util_map_file holds a model file: mapped from the file (pages read as
 * they are touched, dropped and read again under memory pressure), or with
 * UTIL_MAP_READ read whole into anonymous memory (llama.cpp's --no-mmap);
 * UTIL_MAP_LOCK locks the pages in memory (--mlock; a failure to lock, past
 * RLIMIT_MEMLOCK, is a warning and the file stays usable, as llama.cpp has it). */
enum { UTIL_MAP_READ = 1, UTIL_MAP_LOCK = 2 };
/* size (> 0) bytes of the open file fd, read-only; release with munmap(p,
 * size). MAP_FAILED with errno set on failure. path: for the warning. */
void *util_map_file(int fd, size_t size, int flags, const char *path);
#endif
