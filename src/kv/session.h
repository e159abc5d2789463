/* kv/session: a sequence saved to a file (its tokens and its full blocks in
 * kv/blockfmt's stored form) and brought back for a later prompt that starts
 * with those tokens, like llama.cpp's --prompt-cache.
 *
 * File (version 1), little-endian:
 *    0  8  magic "KVLMSES1"
 *    8  4  session format version (1)
 *   12  4  block format version (KV_BLOCKFMT_VERSION)
 *   16 16  model fingerprint
 *   32  4  key element type   36 4  value element type
 *   40  4  block size         44 4  flags: bit 0 = blocks signed (--kv-key); other bits 0
 *   48  8  tokens saved (n)   56 8  full blocks stored (b)
 *   64  8  bytes of one stored block
 *   72  4 x n  token ids (int32)
 *   then b stored blocks, each checked on loading like a tier's.
 *
 * Files: the session is written to "<path>.tmp.<pid>" and renamed over path,
 * so path only ever holds a whole file; temporaries that a process killed
 * mid-save left behind (their pid is gone) are removed by the next save or
 * load of the same path. Both open with O_NOFOLLOW | O_NONBLOCK and check
 * that what they opened is a regular file: a FIFO, a device or a symbolic
 * link at path is a clear error, never a process blocked in open(2). */
#ifndef KVLM_KV_SESSION_H
#define KVLM_KV_SESSION_H
#include <stdint.h>
#include "kv/store.h"

/* Writes sequence seq to path (a temporary name, then renamed). */
int kv_session_save(kv_store *s, int seq, const char *path, kvlm_error *err);
/* For an empty sequence about to take tokens[0..n): attaches the saved blocks
 * that match them, leaving at least one token to compute; returns the tokens
 * now cached (>= 0), or a negative KVLM_E* code with err set for a file of
 * another model, cache type, block size or format version, or not a session
 * file. A missing file is not an error (0). */
int kv_session_load(kv_store *s, int seq, const int32_t *tokens, int n, const char *path, kvlm_error *err);
#endif
