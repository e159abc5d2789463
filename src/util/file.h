/* util/file: a whole small file read into memory (tokenizers, chat
 * templates, PEM keys, request bodies given as files). */
#ifndef KVLM_UTIL_FILE_H
#define KVLM_UTIL_FILE_H
#include <stddef.h>
#include "kvlm.h"

/* The whole of the file at path, NUL-terminated (*len: its bytes, without
 * the NUL; may be NULL), in a malloc'd buffer; NULL with err set (the path
 * and errno's text when it cannot be opened, KVLM_EIO; KVLM_EINVAL when it
 * is larger than max bytes). */
char *util_read_file(const char *path, size_t max, size_t *len, kvlm_error *err);
#endif
