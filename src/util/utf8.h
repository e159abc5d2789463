/* util/utf8: strict UTF-8 decoding and encoding for the tokenizers, the grammar
 * and the server (invalid bytes are reported, never skipped, so callers can
 * fall back to raw bytes). */
#ifndef KVLM_UTIL_UTF8_H
#define KVLM_UTIL_UTF8_H
#include <stddef.h>
#include <stdint.h>

/* Decodes the sequence at s (n > 0 bytes available). Returns its length (1-4)
 * and sets *cp, or 0 when the bytes there are not valid UTF-8 (stray
 * continuation byte, overlong form, surrogate, above U+10FFFF, truncated). */
int util_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp);
/* Writes cp (<= U+10FFFF) as UTF-8 into out[4]; returns the byte count. */
int util_utf8_encode(uint32_t cp, char *out);
#endif
