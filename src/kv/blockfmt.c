/* kv/blockfmt: block keys (XXH3-128 over a versioned byte string), the
 * serialized block (header, token ids, payload, XXH3-64 or HMAC-SHA-256),
 * the signing key and the model fingerprint; the layout is documented in
 * blockfmt.h and docs/kv-tiers.md. */
#include "kv/blockfmt.h"
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
/* XXH3_state_t on the stack: its layout is that of the installed libxxhash */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
#include "dtype/dtype.h"
#include "model/model.h"
#include "util/error.h"

static const uint8_t k_magic[8] = {'K', 'V', 'L', 'M', 'B', 'L', 'K', '1'};
const char kv_blockfmt_why_forged[] = "its signature does not verify: forged, or written without this deployment's key";

#define MAC_BYTES 32 /* HMAC-SHA-256 */

/* ---- the signing key ---- */

struct kv_blockauth {
    EVP_MAC *mac;
    EVP_MAC_CTX *keyed; /* HMAC-SHA-256 initialised with the key; each use works on a copy */
    uint8_t id[16];     /* hashed into signed deployments' block keys */
};

void kv_blockauth_free(kv_blockauth *a) {
    if (!a) return;
    EVP_MAC_CTX_free(a->keyed);
    EVP_MAC_free(a->mac);
    free(a);
}

/* HMAC of n bytes under a's key into out[32]; false only if OpenSSL fails. */
static bool mac_of(const kv_blockauth *a, const uint8_t *d, size_t n, uint8_t out[MAC_BYTES]) {
    EVP_MAC_CTX *c = EVP_MAC_CTX_dup(a->keyed);
    size_t len = 0;
    bool ok = c && EVP_MAC_update(c, d, n) && EVP_MAC_final(c, out, &len, MAC_BYTES) && len == MAC_BYTES;
    EVP_MAC_CTX_free(c);
    if (!ok) memset(out, 0, MAC_BYTES);
    return ok;
}

kv_blockauth *kv_blockauth_create(const void *key, size_t len, kvlm_error *err) {
    if (!key || len < KVLM_KV_MAC_KEY_MIN) {
        util_err_set(err, KVLM_EINVAL, "a KV block-signing key of %zu bytes is too short: give at least %d random "
                     "bytes (e.g. head -c 32 /dev/urandom | base64 > FILE)", key ? len : 0, KVLM_KV_MAC_KEY_MIN);
        return NULL;
    }
    kv_blockauth *a = calloc(1, sizeof *a);
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_construct_end()};
    uint8_t id[MAC_BYTES];
    static const char id_tag[] = "kvlm kv key id 1";
    if (!a || !(a->mac = EVP_MAC_fetch(NULL, "HMAC", NULL)) || !(a->keyed = EVP_MAC_CTX_new(a->mac)) ||
        !EVP_MAC_init(a->keyed, key, len, params) || !mac_of(a, (const uint8_t *)id_tag, sizeof id_tag - 1, id)) {
        unsigned long e = ERR_get_error();
        char msg[256] = "out of memory";
        if (e) ERR_error_string_n(e, msg, sizeof msg);
        util_err_set(err, KVLM_ENOMEM, "cannot set up HMAC-SHA-256 for the KV block-signing key: %s", msg);
        kv_blockauth_free(a);
        return NULL;
    }
    memcpy(a->id, id, sizeof a->id);
    OPENSSL_cleanse(id, sizeof id);
    return a;
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }

static void key_from_hash(XXH128_hash_t h, kv_key *out) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    memcpy(out->b, c.digest, 16);
}

void kv_block_key(const kv_blockfmt *f, const kv_key *parent, const int32_t *tokens, kv_key *out) {
    /* version, model, types, block size, parent: 48 bytes, then the tokens */
    uint8_t head[48];
    put32(head, KV_BLOCKFMT_VERSION);
    memcpy(head + 4, f->model.b, 16);
    put32(head + 20, (uint32_t)f->k_type);
    put32(head + 24, (uint32_t)f->v_type);
    put32(head + 28, (uint32_t)f->block_size);
    if (parent) memcpy(head + 32, parent->b, 16);
    else memset(head + 32, 0, 16);
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, head, sizeof head);
    uint8_t buf[256];
    for (int i = 0; i < f->block_size;) { /* little-endian whatever the host */
        int n = 0;
        for (; n < 64 && i < f->block_size; n++, i++) put32(buf + 4 * n, (uint32_t)tokens[i]);
        XXH3_128bits_update(&st, buf, (size_t)n * 4);
    }
    if (f->auth) XXH3_128bits_update(&st, f->auth->id, sizeof f->auth->id);
    key_from_hash(XXH3_128bits_digest(&st), out);
}

static size_t seal_bytes(const kv_blockfmt *f) { return f->auth ? MAC_BYTES : 8; }
size_t kv_blockfmt_payload_offset(const kv_blockfmt *f) { return KV_BLOCKFMT_FIXED + 4 * (size_t)f->block_size; }
size_t kv_blockfmt_bytes(const kv_blockfmt *f) { return kv_blockfmt_payload_offset(f) + f->payload_bytes + seal_bytes(f); }

void kv_blockfmt_begin(const kv_blockfmt *f, const kv_key *key, const int32_t *tokens, uint8_t *out) {
    memcpy(out, k_magic, 8);
    put32(out + 8, KV_BLOCKFMT_VERSION);
    put32(out + 12, (uint32_t)kv_blockfmt_payload_offset(f));
    memcpy(out + 16, key->b, 16);
    memcpy(out + 32, f->model.b, 16);
    put32(out + 48, (uint32_t)f->k_type);
    put32(out + 52, (uint32_t)f->v_type);
    put32(out + 56, (uint32_t)f->block_size);
    put32(out + 60, (uint32_t)f->n_layers);
    put32(out + 64, (uint32_t)f->n_kv_heads);
    put32(out + 68, (uint32_t)f->head_dim);
    put32(out + 72, (uint32_t)f->block_size);
    put32(out + 76, (f->v_in_k ? KV_BLOCKFMT_FLAG_V_IN_K : 0u) | (f->auth ? KV_BLOCKFMT_FLAG_SIGNED : 0u));
    put64(out + 80, (uint64_t)f->payload_bytes);
    for (int i = 0; i < f->block_size; i++) put32(out + KV_BLOCKFMT_FIXED + 4 * (size_t)i, (uint32_t)tokens[i]);
}

void kv_blockfmt_seal(const kv_blockfmt *f, uint8_t *out) {
    size_t n = kv_blockfmt_bytes(f) - seal_bytes(f);
    if (f->auth) mac_of(f->auth, out, n, out + n); /* (a failure leaves zeros: no reader accepts them) */
    else put64(out + n, XXH3_64bits(out, n));
}

bool kv_blockfmt_peek(const uint8_t *d, size_t len, kv_blockfmt *f, kv_key *key, int *n_tokens) {
    if (len < KV_BLOCKFMT_FIXED || memcmp(d, k_magic, 8) || get32(d + 8) != KV_BLOCKFMT_VERSION) return false;
    memset(f, 0, sizeof *f);
    memcpy(key->b, d + 16, 16);
    memcpy(f->model.b, d + 32, 16);
    f->k_type = (int)get32(d + 48);
    f->v_type = (int)get32(d + 52);
    f->block_size = (int)get32(d + 56);
    f->n_layers = (int)get32(d + 60);
    f->n_kv_heads = (int)get32(d + 64);
    f->head_dim = (int)get32(d + 68);
    *n_tokens = (int)get32(d + 72);
    f->payload_bytes = (size_t)get64(d + 80);
    f->v_in_k = get32(d + 76) & KV_BLOCKFMT_FLAG_V_IN_K;
    return true;
}

const uint8_t *kv_blockfmt_check(const kv_blockfmt *f, const kv_key *key, const int32_t *tokens, const uint8_t *d,
                                 size_t len, const char **why) {
    size_t off = kv_blockfmt_payload_offset(f);
    const char *w = NULL;
    if (len != kv_blockfmt_bytes(f)) w = "wrong length";
    else if (memcmp(d, k_magic, 8)) w = "bad magic";
    else if (get32(d + 8) != KV_BLOCKFMT_VERSION) w = "another format version";
    else if (get32(d + 12) != off || get64(d + 80) != f->payload_bytes) w = "wrong sizes in the header";
    else if (memcmp(d + 16, key->b, 16)) w = "another key";
    else if (memcmp(d + 32, f->model.b, 16)) w = "another model";
    else if (get32(d + 48) != (uint32_t)f->k_type || get32(d + 52) != (uint32_t)f->v_type) w = "other element types";
    else if (get32(d + 56) != (uint32_t)f->block_size || get32(d + 60) != (uint32_t)f->n_layers ||
             get32(d + 64) != (uint32_t)f->n_kv_heads || get32(d + 68) != (uint32_t)f->head_dim ||
             get32(d + 72) != (uint32_t)f->block_size ||
             (get32(d + 76) & ~KV_BLOCKFMT_FLAG_SIGNED) != (f->v_in_k ? KV_BLOCKFMT_FLAG_V_IN_K : 0u))
        w = "another cache geometry";
    else if (f->auth) {
        uint8_t mac[MAC_BYTES];
        /* constant time: a forger learns nothing from how fast a guess fails */
        if (!(get32(d + 76) & KV_BLOCKFMT_FLAG_SIGNED) || !mac_of(f->auth, d, len - MAC_BYTES, mac) ||
            CRYPTO_memcmp(mac, d + len - MAC_BYTES, MAC_BYTES) != 0)
            w = kv_blockfmt_why_forged;
    } else if (get32(d + 76) & KV_BLOCKFMT_FLAG_SIGNED) w = "signed, and this reader has no key (--kv-key)";
    else if (get64(d + len - 8) != XXH3_64bits(d, len - 8)) w = "checksum mismatch";
    if (!w)
        for (int i = 0; i < f->block_size && !w; i++)
            if (get32(d + KV_BLOCKFMT_FIXED + 4 * (size_t)i) != (uint32_t)tokens[i]) w = "other tokens";
    if (why) *why = w;
    return w ? NULL : d + off;
}

/* ---- the model fingerprint ---- */

static void hash_tensor(XXH3_state_t *st, const model_tensor *t, const char *fallback_name) {
    const char *name = t->name ? t->name : fallback_name;
    uint8_t b[24];
    XXH3_128bits_update(st, name, strlen(name) + 1);
    put32(b, t->data ? 1u : 0u);
    put32(b + 4, (uint32_t)t->type);
    put64(b + 8, (uint64_t)t->n_out);
    put64(b + 16, (uint64_t)t->n_in);
    XXH3_128bits_update(st, b, sizeof b);
    if (!t->data) return;
    size_t bytes = dt_row_size(t->type, (int)t->n_in) * (size_t)t->n_out;
    const uint8_t *p = t->data;
    if (bytes <= 640) { XXH3_128bits_update(st, p, bytes); return; }
    /* the first and last 64 bytes and 64 at each eighth in between */
    for (int i = 0; i <= 8; i++) {
        size_t at = i == 8 ? bytes - 64 : bytes / 8 * (size_t)i;
        XXH3_128bits_update(st, p + at, 64);
    }
}

/* A tag, then n 4-byte values (floats by their bits), little-endian. */
static void mix_words(XXH3_state_t *st, const char *tag, const void *words, int n) {
    XXH3_128bits_update(st, tag, strlen(tag));
    for (int i = 0; i < n; i++) {
        uint32_t u;
        uint8_t b[4];
        memcpy(&u, (const uint8_t *)words + 4 * (size_t)i, 4);
        put32(b, u);
        XXH3_128bits_update(st, b, 4);
    }
}

void kv_model_fingerprint(const struct kvlm_model *m, const float *rope_freqs, kv_key *out) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, "kvlm-model-v1", 13);
    const kvlm_config *c = &m->cfg;
    uint32_t f[15];
    uint32_t rb, eps;
    memcpy(&rb, &c->rope_base, 4);
    memcpy(&eps, &c->norm_eps, 4);
    uint32_t v[] = {(uint32_t)c->arch, (uint32_t)c->dim, (uint32_t)c->hidden_dim, (uint32_t)c->n_layers,
                    (uint32_t)c->n_heads, (uint32_t)c->n_kv_heads, (uint32_t)c->head_dim, (uint32_t)c->vocab_size,
                    (uint32_t)c->n_ctx_train, (uint32_t)c->rope_dim, rb, c->rope_neox ? 1u : 0u, eps,
                    (uint32_t)c->weight_type};
    size_t n = sizeof v / sizeof v[0];
    for (size_t i = 0; i < n; i++) put32((uint8_t *)&f[i], v[i]);
    XXH3_128bits_update(&st, f, n * 4);
    XXH3_128bits_update(&st, m->arch_name, strnlen(m->arch_name, sizeof m->arch_name));
    hash_tensor(&st, &m->tok_embd, "token_embd");
    for (int l = 0; m->layers && l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        const model_tensor *ts[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->bq, &L->bk, &L->bv,
                                    &L->ffn_norm, &L->w_gate, &L->w_down, &L->w_up};
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) hash_tensor(&st, ts[i], "layer");
        if (c->n_expert > 0 && c->arch != KVLM_ARCH_DEEPSEEK2) { /* Mixtral's, qwen3moe's experts (dense: unchanged) */
            const model_tensor *ex[] = {&L->ffn_gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps, &L->q_norm,
                                        &L->k_norm, &L->ffn_gate_inp_shexp, &L->gate_shexp};
            for (size_t i = 0; i < sizeof ex / sizeof ex[0]; i++) hash_tensor(&st, ex[i], "moe");
        }
        if (c->arch == KVLM_ARCH_DEEPSEEK2) { /* its attention's tensors and latent shape (other models: unchanged) */
            const model_tensor *ds[] = {&L->wq_a, &L->q_a_norm, &L->wq_b, &L->wkv_a, &L->kv_a_norm, &L->wkv_b,
                                        &L->wk_b, &L->wv_b};
            for (size_t i = 0; i < sizeof ds / sizeof ds[0]; i++) hash_tensor(&st, ds[i], "mla");
            uint8_t b[20];
            uint32_t yf, ym;
            memcpy(&yf, &c->yarn_factor, 4);
            memcpy(&ym, &c->yarn_log_mul, 4);
            put32(b, (uint32_t)c->q_lora_rank);
            put32(b + 4, (uint32_t)c->kv_lora_rank);
            put32(b + 8, (uint32_t)c->v_head_dim);
            put32(b + 12, yf); /* YaRN changes every rotated key */
            put32(b + 16, ym ^ (uint32_t)c->yarn_orig_ctx);
            XXH3_128bits_update(&st, b, sizeof b);
        }
    }
    hash_tensor(&st, &m->output_norm, "output_norm");
    hash_tensor(&st, &m->output, "output");
    if (c->embed_mult > 0 || c->residual_mult > 0) { /* granite's multipliers change every key and value */
        const float mult[2] = {c->embed_mult, c->residual_mult};
        mix_words(&st, "multipliers", mult, 2);
    }
    if (c->no_rope_period > 0) mix_words(&st, "no-rope", &c->no_rope_period, 1); /* smollm3's layers without RoPE */
    if (rope_freqs) mix_words(&st, "rope-freqs", rope_freqs, c->rope_dim / 2); /* the keys' rotation */
    /* (models without these keep the fingerprint they had) */
    key_from_hash(XXH3_128bits_digest(&st), out);
}
