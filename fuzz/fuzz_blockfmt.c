/* fuzz/fuzz_blockfmt: the tiers' stored-block decoder (kv/blockfmt): the
 * input is a stored block, read without expectations (peek) and checked
 * against the small store's format (the key made from the block's own
 * tokens) and against the format its header states; a block that passes is
 * sealed again from its parts and must come out byte for byte the same;
 * and against the same format signed with a key (--kv-key): a block that
 * verifies there must reseal to itself too. With KVLM_FUZZ_SEEDS=DIR set,
 * writes a real stored block there, and the same block signed. */
#include "fuzz_common.h"
#include "fuzz_kvstore.h"
#include "kv/blockfmt.h"
#include "kvlm.h"

static kv_blockfmt fmt, sfmt; /* the small store's, and signed */
static kv_blockauth *auth;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("KVLM_LOG", "off", 0);
    kv_store *s = fuzz_store();
    fmt = *kv_get_blockfmt(kv_store_pool(s));
    static const char secret[] = "the fuzzer's block-signing key";
    if (!(auth = kv_blockauth_create(secret, sizeof secret - 1, NULL))) abort();
    sfmt = fmt;
    sfmt.auth = auth;
    const char *dir = getenv("KVLM_FUZZ_SEEDS");
    if (dir && *dir) {
        int32_t toks[FZ_BS] = {3, 1, 4, 1};
        fuzz_store_fill(s, toks, FZ_BS);
        int nb;
        const int32_t *blocks = kv_seq_blocks(kv_store_pool(s), 0, &nb);
        kv_key key;
        kv_block_key(&fmt, NULL, toks, &key);
        size_t n = kv_blockfmt_bytes(&fmt);
        uint8_t *b = malloc(n);
        kv_blockfmt_begin(&fmt, &key, toks, b);
        kv_block_read(kv_store_pool(s), blocks[0], b + kv_blockfmt_payload_offset(&fmt));
        kv_blockfmt_seal(&fmt, b);
        char path[1024];
        snprintf(path, sizeof path, "%s/block-4-tokens.bin", dir);
        FILE *fp = fopen(path, "wb");
        if (!fp || fwrite(b, 1, n, fp) != n || fclose(fp)) abort();
        free(b);
        kv_block_key(&sfmt, NULL, toks, &key);
        n = kv_blockfmt_bytes(&sfmt);
        b = malloc(n);
        kv_blockfmt_begin(&sfmt, &key, toks, b);
        kv_block_read(kv_store_pool(s), blocks[0], b + kv_blockfmt_payload_offset(&sfmt));
        kv_blockfmt_seal(&sfmt, b);
        snprintf(path, sizeof path, "%s/block-4-tokens-signed.bin", dir);
        fp = fopen(path, "wb");
        if (!fp || fwrite(b, 1, n, fp) != n || fclose(fp)) abort();
        free(b);
    }
    kv_store_free(s);
    return 0;
}

/* A block that passed check, rebuilt from its parts: the same bytes. */
static void reseal(const kv_blockfmt *f, const kv_key *key, const int32_t *toks, const uint8_t *data, size_t size,
                   const uint8_t *payload) {
    uint8_t *b = malloc(size);
    kv_blockfmt_begin(f, key, toks, b);
    memcpy(b + kv_blockfmt_payload_offset(f), payload, f->payload_bytes);
    kv_blockfmt_seal(f, b);
    if (memcmp(b, data, size)) { fprintf(stderr, "a checked block does not seal back to itself\n"); abort(); }
    free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *why = NULL;
    kv_key key;
    /* against the store's format: tokens from where the header puts them */
    int32_t toks[FZ_BS] = {0};
    for (int i = 0; i < FZ_BS && KV_BLOCKFMT_FIXED + 4 * (size_t)i + 4 <= size; i++)
        memcpy(&toks[i], data + KV_BLOCKFMT_FIXED + 4 * i, 4);
    kv_block_key(&fmt, NULL, toks, &key);
    const uint8_t *p = kv_blockfmt_check(&fmt, &key, toks, data, size, &why);
    if (p) {
        if (p != data + kv_blockfmt_payload_offset(&fmt) || size != kv_blockfmt_bytes(&fmt)) abort();
        reseal(&fmt, &key, toks, data, size, p);
    } else if (!why) abort(); /* a refusal says why */
    /* signed (block keys hash the key's id too) */
    kv_block_key(&sfmt, NULL, toks, &key);
    why = NULL;
    p = kv_blockfmt_check(&sfmt, &key, toks, data, size, &why);
    if (p) reseal(&sfmt, &key, toks, data, size, p);
    else if (!why) abort();
    /* against what the header states (bounded: a reader's own format is never this large) */
    kv_blockfmt f;
    int n_tok;
    if (!kv_blockfmt_peek(data, size, &f, &key, &n_tok)) return 0;
    if (f.block_size <= 0 || f.block_size > 4096 || f.payload_bytes > size) return 0;
    int32_t *t = calloc((size_t)f.block_size, sizeof *t);
    size_t have = size > KV_BLOCKFMT_FIXED ? (size - KV_BLOCKFMT_FIXED) / 4 : 0;
    for (size_t i = 0; i < (size_t)f.block_size && i < have; i++) memcpy(&t[i], data + KV_BLOCKFMT_FIXED + 4 * i, 4);
    why = NULL;
    p = kv_blockfmt_check(&f, &key, t, data, size, &why);
    if (p) reseal(&f, &key, t, data, size, p);
    else if (!why) abort();
    free(t);
    return 0;
}
