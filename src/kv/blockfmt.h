/* kv/blockfmt: a KV block's key and its serialized form, the same in every
 * process, on every machine and across restarts (tiers and session files
 * hold blocks in this form).
 *
 * Key (version 1): XXH3-128 of this byte string, integers little-endian:
 *   u32 format version (1)
 *   16  model fingerprint (kv_model_fingerprint)
 *   u32 key element type, u32 value element type (KVLM_CACHE_*)
 *   u32 block size (tokens)
 *   16  parent block's key (16 zero bytes for a sequence's first block)
 *   block size x i32 token ids
 *   (a pool of a layer group other than 0 only) u32 the layer group
 *       (kv_params.layer_group: 1, gemma's local layers, whose pool is
 *       apart from the global layers'; group 0's keys are as before it)
 *   (signed deployments only) 16  the signing key's id
 * The 16 key bytes are XXH3-128's canonical (big-endian) form.
 *
 * Model fingerprint: XXH3-128 of "kvlm-model-v1", the architecture and every
 * config field (u32 / f32 bits), then per tensor (embedding, each layer's in
 * a fixed order, output norm, output): its name, GGUF type, rows and row
 * length, and samples of its bytes (the first and last 64 and 64 at each
 * eighth in between), so two random-weight models of one shape but another
 * seed differ; then, for a context whose keys are rotated by scaled RoPE,
 * "rope-freqs" and its rope_dim/2 factors (f32 bits). Computed once per
 * context; reads ~1 KiB per tensor.
 *
 * Serialized block (version 1), little-endian:
 *   offset size
 *    0      8  magic "KVLMBLK1"
 *    8      4  format version (1)
 *   12      4  header bytes (88 + 4 x tokens: where the payload starts)
 *   16     16  key
 *   32     16  model fingerprint
 *   48      4  key type      52  4  value type
 *   56      4  block size    60  4  layers
 *   64      4  KV heads      68  4  head dim
 *   72      4  tokens (= block size: only full blocks are stored)
 *   76      4  flags: bit 0 = values inside keys (a latent MLA cache,
 *                 docs/mla.md: no V regions); other bits 0
 *   80      8  payload bytes
 *   88   4 x n token ids (i32)
 *   then the payload: the block's bytes exactly as the pool lays them out
 *        (kv/paged.h: per layer and KV head a K then a V region, in the cache
 *        element types: a q8_0 cache moves about half of f16's bytes)
 *   then 8  XXH3-64 (seed 0) of everything before it, or, in a block signed
 *           with the deployment's key (flags bit 1), 32 HMAC-SHA-256 of it.
 * A reader checks every field against what it expects (key, model, types,
 * geometry, tokens, sizes) and the checksum: any mismatch is a miss.
 *
 * Signed blocks (kv_blockauth: `--kv-key`): XXH3 catches accidental damage
 * only; anyone who can write a tier can also recompute it. With a key, every
 * block is sealed with HMAC-SHA-256 under it (OpenSSL) and a reader accepts
 * only blocks whose MAC it can verify: a block forged without the key is a
 * miss (kv_blockfmt_why_forged). A signed deployment's block keys also hash
 * the key's id (16 bytes of HMAC(key, "kvlm kv key id 1")), so its blocks
 * never share names with an unsigned deployment's or another key's. */
#ifndef KVLM_KV_BLOCKFMT_H
#define KVLM_KV_BLOCKFMT_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kv/tier.h"
#include "kvlm.h"

#define KV_BLOCKFMT_VERSION 1
#define KV_BLOCKFMT_FIXED 88 /* header bytes before the token ids */
#define KV_BLOCKFMT_FLAG_V_IN_K 1u
#define KV_BLOCKFMT_FLAG_SIGNED 2u

/* A deployment's block-signing key, ready to use from any thread. */
typedef struct kv_blockauth kv_blockauth;
kv_blockauth *kv_blockauth_create(const void *key, size_t len, kvlm_error *err);
void kv_blockauth_free(kv_blockauth *a);

/* What a pool's blocks are: everything a key or a stored block depends on. */
typedef struct {
    kv_key model;
    int k_type, v_type, block_size, n_layers, n_kv_heads, head_dim;
    size_t payload_bytes; /* one block's bytes (kv_block_bytes) */
    bool v_in_k;          /* a latent (MLA) cache: no V regions; header flags bit 0 */
    const kv_blockauth *auth; /* NULL: sealed with XXH3-64; else signed with this key (flags bit 1) */
    int layer_group;      /* kv_params.layer_group: in the key when not 0 (not in the stored header) */
} kv_blockfmt;

/* The key of a full block of f->block_size tokens after parent (NULL: the first). */
void kv_block_key(const kv_blockfmt *f, const kv_key *parent, const int32_t *tokens, kv_key *out);
/* Bytes of a serialized block, and where its payload starts. */
size_t kv_blockfmt_bytes(const kv_blockfmt *f);
size_t kv_blockfmt_payload_offset(const kv_blockfmt *f);
/* Writes the header and token ids into out (kv_blockfmt_bytes long); the
 * caller puts the payload at out + payload_offset, then seals (checksum). */
void kv_blockfmt_begin(const kv_blockfmt *f, const kv_key *key, const int32_t *tokens, uint8_t *out);
void kv_blockfmt_seal(const kv_blockfmt *f, uint8_t *out);
/* Checks a stored block against what the reader expects: returns its
 * payload, or NULL and *why (a static description; kv_blockfmt_why_forged
 * for a block of the right shape whose signature fails, or that carries none
 * where f signs). */
const uint8_t *kv_blockfmt_check(const kv_blockfmt *f, const kv_key *key, const int32_t *tokens, const uint8_t *data,
                                 size_t len, const char **why);
extern const char kv_blockfmt_why_forged[];
/* Reads a stored block's header fields without expecting anything (for
 * sessions and tools): false if it is not a version-1 block header. */
bool kv_blockfmt_peek(const uint8_t *data, size_t len, kv_blockfmt *f, kv_key *key, int *n_tokens);

struct kvlm_model;
/* The model fingerprint described above; rope_freqs: the RoPE factors the
 * context rotates its keys by (model_rope_freqs), which, when not NULL, are
 * hashed too: Llama 3.1's, linear, YaRN and LongRoPE's long or short factors
 * make other keys from the same weights. */
void kv_model_fingerprint(const struct kvlm_model *m, const float *rope_freqs, kv_key *out);
#endif
