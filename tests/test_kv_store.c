/* tests/test_kv_store: the kv facade and its tiers: block keys built from the
 * documented byte string, stored blocks whose every damage is detected, model
 * fingerprints, the admission probe, and a randomized run of the store over a
 * small pool with a host tier behind a wrapper that corrupts, truncates and
 * loses blocks (every damaged one detected, counted and recomputed; the
 * pool's invariants hold; every sequence reads back its own data); and the
 * engine through a host tier giving logits identical to a cold run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include "helpers/testutil.h"
#include "kv/blockfmt.h"
#include "kv/store.h"
#include "kv/tier_host.h"

static void le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The key as docs/kv-tiers.md spells it, built here independently. */
static void spec_key(const kv_blockfmt *f, const kv_key *parent, const int32_t *tokens, kv_key *out) {
    uint8_t buf[48 + 4 * 64 + 4];
    le32(buf, 1);
    memcpy(buf + 4, f->model.b, 16);
    le32(buf + 20, (uint32_t)f->k_type);
    le32(buf + 24, (uint32_t)f->v_type);
    le32(buf + 28, (uint32_t)f->block_size);
    memset(buf + 32, 0, 16);
    if (parent) memcpy(buf + 32, parent->b, 16);
    for (int i = 0; i < f->block_size; i++) le32(buf + 48 + 4 * i, (uint32_t)tokens[i]);
    size_t n = 48 + 4 * (size_t)f->block_size;
    if (f->layer_group) { /* only a pool of another layer group than 0 hashes it */
        le32(buf + n, (uint32_t)f->layer_group);
        n += 4;
    }
    XXH128_hash_t h = XXH3_128bits(buf, n);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    memcpy(out->b, c.digest, 16);
}

static kv_blockfmt small_fmt(void) {
    kv_blockfmt f = {{{0}}, KVLM_CACHE_F16, KVLM_CACHE_Q8_0, 16, 2, 2, 32, 1000, false, NULL, 0};
    for (int i = 0; i < 16; i++) f.model.b[i] = (uint8_t)(i * 7 + 1);
    return f;
}

static void test_key_spec(void **state) {
    (void)state;
    kv_blockfmt f = small_fmt();
    int32_t t[16];
    for (int i = 0; i < 16; i++) t[i] = 1000 * i - 7;
    kv_key k1, k2, s1, s2;
    kv_block_key(&f, NULL, t, &k1);
    spec_key(&f, NULL, t, &s1);
    assert_memory_equal(k1.b, s1.b, 16);
    kv_block_key(&f, &k1, t, &k2); /* chained on its parent */
    spec_key(&f, &k1, t, &s2);
    assert_memory_equal(k2.b, s2.b, 16);
    assert_memory_not_equal(k1.b, k2.b, 16);
    /* every input is part of the key */
    kv_blockfmt g = f;
    kv_key o;
    g.model.b[15] ^= 1;
    kv_block_key(&g, NULL, t, &o);
    assert_memory_not_equal(o.b, k1.b, 16);
    g = f;
    g.v_type = KVLM_CACHE_F16;
    kv_block_key(&g, NULL, t, &o);
    assert_memory_not_equal(o.b, k1.b, 16);
    /* the local layers' pool (layer group 1): its own keys, group 0's as they were */
    g = f;
    g.layer_group = KV_LAYER_GROUP_LOCAL;
    kv_block_key(&g, NULL, t, &o);
    spec_key(&g, NULL, t, &s2);
    assert_memory_equal(o.b, s2.b, 16);
    assert_memory_not_equal(o.b, k1.b, 16);
    t[15]++;
    kv_block_key(&f, NULL, t, &o);
    assert_memory_not_equal(o.b, k1.b, 16);
    char hex[KV_KEY_HEX];
    kv_key_hex(&k1, hex);
    assert_true(kv_key_parse(hex, &o));
    assert_memory_equal(o.b, k1.b, 16);
}

static void test_blockfmt_damage(void **state) {
    (void)state;
    kv_blockfmt f = small_fmt();
    int32_t t[16];
    for (int i = 0; i < 16; i++) t[i] = i + 3;
    kv_key key;
    kv_block_key(&f, NULL, t, &key);
    size_t n = kv_blockfmt_bytes(&f), off = kv_blockfmt_payload_offset(&f);
    assert_int_equal(n, 88 + 64 + 1000 + 8);
    uint8_t *blob = malloc(n), *bad = malloc(n);
    kv_blockfmt_begin(&f, &key, t, blob);
    for (size_t i = 0; i < f.payload_bytes; i++) blob[off + i] = (uint8_t)(i * 31);
    kv_blockfmt_seal(&f, blob);
    const char *why = NULL;
    const uint8_t *pl = kv_blockfmt_check(&f, &key, t, blob, n, &why);
    assert_ptr_equal(pl, blob + off);
    /* every single flipped byte, anywhere, is detected */
    int detected = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(bad, blob, n);
        bad[i] ^= 0x20;
        detected += kv_blockfmt_check(&f, &key, t, bad, n, &why) == NULL;
    }
    assert_int_equal(detected, (int)n);
    /* truncated, another key, other tokens, another model */
    assert_null(kv_blockfmt_check(&f, &key, t, blob, n - 1, &why));
    kv_key other = key;
    other.b[0] ^= 1;
    assert_null(kv_blockfmt_check(&f, &other, t, blob, n, &why));
    assert_string_equal(why, "another key");
    t[3]++;
    assert_null(kv_blockfmt_check(&f, &key, t, blob, n, &why));
    t[3]--;
    kv_blockfmt g = f;
    g.model.b[2] ^= 4;
    assert_null(kv_blockfmt_check(&g, &key, t, blob, n, &why));
    kv_blockfmt pk;
    kv_key pkey;
    int ntok;
    assert_true(kv_blockfmt_peek(blob, n, &pk, &pkey, &ntok));
    assert_int_equal(ntok, 16);
    assert_int_equal(pk.v_type, KVLM_CACHE_Q8_0);
    assert_int_equal(pk.payload_bytes, 1000);
    printf("  %d of %zu single-byte flips detected\n", detected, n);
    free(blob);
    free(bad);
}

/* Signed blocks (--kv-key): what XXH3 cannot do. A block re-sealed by
 * someone without the key (a new checksum, or a MAC under a guessed key)
 * fails as forged; the key's id names the blocks, so signed and unsigned
 * deployments, or two keys, never share a block name. */
static void test_blockfmt_signed(void **state) {
    (void)state;
    kvlm_error err = {0};
    const char *secret = "correct horse battery staple", *guess = "correct horse battery stapler";
    kv_blockauth *a = kv_blockauth_create(secret, strlen(secret), &err), *b = kv_blockauth_create(guess, strlen(guess), &err);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(kv_blockauth_create("short", 5, &err));
    assert_non_null(strstr(err.msg, "at least 16"));
    kv_blockfmt f = small_fmt(), fs = f, fb = f;
    fs.auth = a;
    fb.auth = b;
    int32_t t[16];
    for (int i = 0; i < 16; i++) t[i] = 5 * i + 1;
    kv_key key, ukey, bkey;
    kv_block_key(&fs, NULL, t, &key);
    kv_block_key(&f, NULL, t, &ukey);
    kv_block_key(&fb, NULL, t, &bkey);
    assert_memory_not_equal(key.b, ukey.b, 16);
    assert_memory_not_equal(key.b, bkey.b, 16);
    size_t n = kv_blockfmt_bytes(&fs), off = kv_blockfmt_payload_offset(&fs);
    assert_int_equal(n, kv_blockfmt_bytes(&f) + 24); /* a 32-byte MAC in place of the 8-byte checksum */
    uint8_t *blob = malloc(n), *bad = malloc(n);
    kv_blockfmt_begin(&fs, &key, t, blob);
    for (size_t i = 0; i < fs.payload_bytes; i++) blob[off + i] = (uint8_t)(i * 13);
    kv_blockfmt_seal(&fs, blob);
    const char *why = NULL;
    assert_ptr_equal(kv_blockfmt_check(&fs, &key, t, blob, n, &why), blob + off);
    /* every flipped byte is detected; in the payload and the MAC, as forged */
    int detected = 0, forged = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(bad, blob, n);
        bad[i] ^= 0x01;
        if (!kv_blockfmt_check(&fs, &key, t, bad, n, &why)) detected++;
        forged += why == kv_blockfmt_why_forged;
    }
    assert_int_equal(detected, (int)n);
    assert_true(forged >= (int)(fs.payload_bytes + 32));
    /* a forger rewrites the payload and seals it as best it can */
    memcpy(bad, blob, n);
    for (size_t i = 0; i < fs.payload_bytes; i++) bad[off + i] = 0x3c;
    kv_blockfmt_seal(&fb, bad); /* a MAC under a guessed key */
    assert_null(kv_blockfmt_check(&fs, &key, t, bad, n, &why));
    assert_ptr_equal(why, kv_blockfmt_why_forged);
    memcpy(bad, blob, n);
    bad[76] &= (uint8_t)~KV_BLOCKFMT_FLAG_SIGNED; /* claims to be unsigned */
    assert_null(kv_blockfmt_check(&fs, &key, t, bad, n, &why));
    assert_ptr_equal(why, kv_blockfmt_why_forged);
    /* the same bytes are no block to a reader without the key, nor to another key's */
    assert_null(kv_blockfmt_check(&f, &key, t, blob, n, &why));
    assert_null(kv_blockfmt_check(&fb, &key, t, blob, n, &why));
    assert_ptr_equal(why, kv_blockfmt_why_forged);
    /* and an unsigned block under the signed name is not one either */
    size_t un = kv_blockfmt_bytes(&f);
    kv_blockfmt_begin(&f, &key, t, bad);
    kv_blockfmt_seal(&f, bad);
    assert_null(kv_blockfmt_check(&fs, &key, t, bad, un, &why));
    printf("  signed block: %d of %zu flips detected, %d as forged\n", detected, n, forged);
    free(blob);
    free(bad);
    kv_blockauth_free(a);
    kv_blockauth_free(b);
}

static kvlm_model *synth(uint64_t seed, const char **path_out) {
    kvlm_synth_params sp = {0};
    sp.arch = KVLM_ARCH_LLAMA;
    sp.dim = 64;
    sp.hidden_dim = 160;
    sp.n_layers = 2;
    sp.n_heads = 4;
    sp.n_kv_heads = 2;
    sp.vocab_size = 300;
    sp.n_ctx = 512;
    sp.type = kvlm_type_from_name("f32");
    sp.seed = seed;
    const char *path = tu_tmp_path(".gguf");
    kvlm_error err = {0};
    if (kvlm_model_synth(&sp, path, &err)) fail_msg("synth: %s", err.msg);
    kvlm_model *m = kvlm_model_load(path, NULL, &err);
    if (!m) fail_msg("load: %s", err.msg);
    if (path_out) *path_out = path;
    return m;
}

static void test_fingerprint(void **state) {
    (void)state;
    const char *path;
    kvlm_model *a = synth(1, &path), *b = synth(2, NULL);
    kvlm_error err = {0};
    kvlm_model *a2 = kvlm_model_load(path, NULL, &err);
    assert_non_null(a2);
    kv_key fa, fb, fa2;
    kv_model_fingerprint(a, NULL, &fa);
    kv_model_fingerprint(b, NULL, &fb);
    kv_model_fingerprint(a2, NULL, &fa2);
    assert_memory_equal(fa.b, fa2.b, 16);     /* the same file: the same model */
    assert_memory_not_equal(fa.b, fb.b, 16);  /* one shape, another seed: another model */
    /* keys turned by other RoPE factors (LongRoPE's long or short set, chosen
     * by the context's size; Llama 3.1's; YaRN's) are other keys */
    const kvlm_config *c = kvlm_model_config(a);
    float f1[16], f2[16];
    for (int i = 0; i < c->rope_dim / 2; i++) f1[i] = f2[i] = 1.0f + (float)i;
    f2[c->rope_dim / 2 - 1] += 0.5f;
    kv_key g1, g2, g1b;
    kv_model_fingerprint(a, f1, &g1);
    kv_model_fingerprint(a, f2, &g2);
    kv_model_fingerprint(a2, f1, &g1b);
    assert_memory_equal(g1.b, g1b.b, 16);
    assert_memory_not_equal(g1.b, fa.b, 16);
    assert_memory_not_equal(g1.b, g2.b, 16);
    kvlm_model_free(a);
    kvlm_model_free(a2);
    kvlm_model_free(b);
}

/* ---- a tier that damages what it returns ---- */

typedef struct {
    kv_tier base;
    kv_tier *inner;
    uint64_t rng;
    int corrupted, truncated, lost; /* injected */
    /* forging: every block returned gets another payload, re-sealed as
     * someone who can write the tier would: a fresh checksum, or a MAC under
     * forge_auth (a key that is not the store's) */
    bool forge;
    const kv_blockauth *forge_auth;
    int forged;
} faulty_tier;

static unsigned next_rand(faulty_tier *f) {
    f->rng = f->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(f->rng >> 33);
}

static bool f_put(kv_tier *t, const kv_key *k, const void *d, size_t n) {
    return kv_tier_put(((faulty_tier *)t)->inner, k, d, n);
}
static int f_get(kv_tier *t, int n, const kv_key *k, void *const *bufs, size_t cap, size_t *lens) {
    faulty_tier *f = (faulty_tier *)t;
    int lead = kv_tier_get(f->inner, n, k, bufs, cap, lens);
    for (int i = 0; f->forge && i < lead; i++) {
        kv_blockfmt g;
        kv_key key;
        int ntok;
        uint8_t *d = bufs[i];
        if (!kv_blockfmt_peek(d, lens[i], &g, &key, &ntok)) continue;
        g.auth = f->forge_auth;
        size_t off = kv_blockfmt_payload_offset(&g);
        for (size_t j = 0; j < g.payload_bytes; j++) d[off + j] ^= 0x40; /* every float's exponent */
        kv_blockfmt_seal(&g, d);
        f->forged++;
    }
    for (int i = 0; !f->forge && i < lead; i++) {
        unsigned r = next_rand(f) % 16;
        if (r == 0) { /* a flipped byte anywhere */
            ((uint8_t *)bufs[i])[next_rand(f) % lens[i]] ^= (uint8_t)(1u << (next_rand(f) % 8));
            f->corrupted++;
        } else if (r == 1 && lens[i] > 1) { /* a torn write (a byte at least is left: none reads as a miss) */
            lens[i] -= 1 + next_rand(f) % (lens[i] - 1);
            f->truncated++;
        } else if (r == 2) { /* gone */
            lens[i] = 0;
            f->lost++;
            return i;
        }
    }
    return lead;
}
static int f_contains(kv_tier *t, int n, const kv_key *k) { return kv_tier_contains(((faulty_tier *)t)->inner, n, k); }
static void f_drop(kv_tier *t, const kv_key *k) { kv_tier_drop(((faulty_tier *)t)->inner, k); }
static void f_flush(kv_tier *t) { kv_tier_flush(((faulty_tier *)t)->inner); }
static void f_stats(kv_tier *t, kv_tier_stats *o) { kv_tier_stats_get(((faulty_tier *)t)->inner, o); }
static void f_close(kv_tier *t) { kv_tier_close(((faulty_tier *)t)->inner); free(t); }
static const kv_tier_ops k_faulty = {"faulty", f_put, f_get, f_contains, f_drop, f_flush, f_stats, f_close};

static faulty_tier *faulty_open(uint64_t bytes) {
    faulty_tier *f = calloc(1, sizeof *f);
    kvlm_error err = {0};
    f->base.ops = &k_faulty;
    f->inner = kv_tier_host_open(bytes, &err);
    assert_non_null(f->inner);
    f->rng = 7;
    return f;
}

/* ---- the randomized store ---- */

enum { HD = 4, NL = 2, NH = 2 };

static void write_tokens(kv_store *s, int seq, const int32_t *toks, int n) {
    int len = kv_store_seq_len(s, seq);
    float k[HD], v[HD];
    for (int i = 0; i < n; i++)
        for (int l = 0; l < NL; l++)
            for (int h = 0; h < NH; h++) {
                for (int d = 0; d < HD; d++) {
                    k[d] = (float)toks[i] + 0.25f * l + 0.0625f * h;
                    v[d] = -k[d];
                }
                kv_store_write_row(s, l, seq, len + i, h, k, v);
            }
    kv_store_commit(s, seq, toks, n);
}

static void check_contents(kv_store *s, int max_seqs) {
    kv_cache *c = kv_store_pool(s);
    const kv_params *p = kv_get_params(c);
    for (int q = 0; q < max_seqs; q++) {
        int len = kv_seq_len(c, q), nb;
        const int32_t *blocks = kv_seq_blocks(c, q, &nb);
        const int32_t *toks = kv_seq_tokens(c, q);
        for (int pos = 0; pos < len; pos++)
            for (int l = 0; l < NL; l++)
                for (int h = 0; h < NH; h++) {
                    float want = (float)toks[pos] + 0.25f * l + 0.0625f * h;
                    const float *k = (const float *)kv_block_k(c, blocks[pos / p->block_size], l, h) + (pos % p->block_size) * HD;
                    const float *v = (const float *)kv_block_v(c, blocks[pos / p->block_size], l, h) + (pos % p->block_size) * HD;
                    if (k[0] != want || v[HD - 1] != -want)
                        fail_msg("seq %d pos %d layer %d head %d: read %g, wrote %g", q, pos, l, h, k[0], want);
                }
    }
}

static size_t g_swap_bytes; /* make_store: the swap space */
static int g_roles = KV_TIER_DEMOTE; /* make_store: the tiers' roles */

static kv_store *make_store(int n_blocks, int bs, int max_seqs, kv_tier **tiers, int n_tiers) {
    kv_store_params sp = {0};
    sp.swap_bytes = g_swap_bytes;
    kv_params p = {NL, NH, HD, bs, n_blocks, max_seqs, 4096, 1234, true, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    sp.pool = p;
    for (int t = 0; t < n_tiers; t++) {
        sp.tiers[t] = tiers[t];
        sp.roles[t] = g_roles;
    }
    sp.n_tiers = n_tiers;
    kvlm_error err = {0};
    kv_store *s = kv_store_create(&sp, &err);
    if (!s) fail_msg("store: %s", err.msg);
    return s;
}

/* A pool of 5 blocks of 4 tokens over a host tier, and two 17-token
 * prompts that each fill it. */
static kv_store *ab_store(int32_t *a, int32_t *b) {
    kvlm_error err = {0};
    kv_tier *host = kv_tier_host_open(1 << 20, &err);
    for (int i = 0; i < 17; i++) { a[i] = i + 1; b[i] = 100 + i; }
    return make_store(5, 4, 2, &host, 1);
}

static void test_probe_and_promotion(void **state) {
    (void)state;
    kvlm_error err = {0};
    int32_t a[17], b[17];
    kv_store *s = ab_store(a, b);
    assert_int_equal(kv_store_reserve(s, 0, 17, &err), KVLM_OK);
    write_tokens(s, 0, a, 17);
    kv_store_release(s, 0);  /* 4 full blocks cached, in RAM */
    kv_store_probe pr;
    kv_store_probe_prefix(s, a, 17, 17, &pr);
    assert_int_equal(pr.ram_tokens, 16);
    assert_int_equal(pr.cached_tokens, 16);
    assert_int_equal(pr.blocks_needed, 1);
    kv_stats st0, st1;
    kv_store_stats(s, &st0);
    kv_store_probe_prefix(s, a, 17, 17, &pr); /* twice: no side effects */
    kv_store_stats(s, &st1);
    assert_int_equal(st0.hits, st1.hits);
    assert_int_equal(st0.misses, st1.misses);
    /* another prompt takes every block: a's four are demoted to the host tier */
    assert_int_equal(kv_store_reserve(s, 1, 17, &err), KVLM_OK);
    write_tokens(s, 1, b, 17);
    kv_store_release(s, 1);
    kv_store_probe_prefix(s, a, 17, 17, &pr);
    assert_int_equal(pr.ram_tokens, 0);
    assert_int_equal(pr.tier_tokens[0], 16);
    assert_int_equal(pr.cached_tokens, 16);
    assert_int_equal(kv_store_match_prefix(s, 0, a, 17), 16); /* promoted */
    kv_store_tier_stats ts;
    assert_int_equal(kv_store_tier_stats_get(s, &ts, 1), 1);
    assert_int_equal(ts.promoted, 4);
    assert_true(ts.demoted >= 4);
    assert_int_equal(kv_store_reserve(s, 0, 1, &err), KVLM_OK);
    write_tokens(s, 0, a + 16, 1);
    check_contents(s, 2);
    assert_null(kv_check(kv_store_pool(s)));
    kv_store_free(s);
}

/* The store over a tier someone rewrites: without a key the forged blocks
 * are used (the trust boundary docs/kv-tiers.md states); with one, each is
 * counted as forged, dropped and recomputed, and the sequence reads back
 * what was written. */
static void test_forged_tier(void **state) {
    (void)state;
    kvlm_error err = {0};
    const char *secret = "a per-deployment secret of some length", *other = "what an attacker guesses";
    for (int signed_ = 0; signed_ < 2; signed_++) {
        faulty_tier *f = faulty_open(1 << 20);
        kv_blockauth *guess = kv_blockauth_create(other, strlen(other), &err);
        f->forge = true;
        f->forge_auth = signed_ ? guess : NULL;
        kv_store_params sp = {0};
        kv_params p = {NL, NH, HD, 4, 5, 2, 4096, 1234, true, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
        sp.pool = p;
        sp.tiers[0] = &f->base;
        sp.roles[0] = KV_TIER_DEMOTE;
        sp.n_tiers = 1;
        sp.auth = signed_ ? kv_blockauth_create(secret, strlen(secret), &err) : NULL;
        kv_store *s = kv_store_create(&sp, &err);
        assert_non_null(s);
        int32_t a[17], b[17];
        for (int i = 0; i < 17; i++) { a[i] = i + 1; b[i] = 100 + i; }
        assert_int_equal(kv_store_reserve(s, 0, 17, &err), KVLM_OK);
        write_tokens(s, 0, a, 17);
        kv_store_release(s, 0);
        assert_int_equal(kv_store_reserve(s, 1, 17, &err), KVLM_OK);
        write_tokens(s, 1, b, 17); /* pushes a's blocks down to the tier */
        kv_store_release(s, 1);
        int got = kv_store_match_prefix(s, 0, a, 17);
        kv_store_tier_stats ts;
        kv_store_tier_stats_get(s, &ts, 1);
        printf("  %s: %d blocks forged in the tier, %d tokens taken from it, %llu counted forged, %llu corrupt\n",
               signed_ ? "signed" : "unsigned", f->forged, got, (unsigned long long)ts.st.forged,
               (unsigned long long)ts.st.corrupt);
        assert_true(f->forged >= 1);
        if (!signed_) {
            /* accepted: the tier's writer decided these keys */
            assert_int_equal(got, 16);
            assert_int_equal(ts.st.corrupt + ts.st.forged, 0);
            kv_cache *c = kv_store_pool(s);
            int nb;
            const int32_t *blocks = kv_seq_blocks(c, 0, &nb);
            assert_true(((const float *)kv_block_k(c, blocks[0], 0, 0))[0] != (float)a[0]);
        } else {
            assert_int_equal(got, 0);
            assert_int_equal(ts.st.forged, (uint64_t)f->forged); /* each one counted and dropped */
            assert_int_equal(ts.promoted, 0);
            assert_int_equal(kv_store_reserve(s, 0, 17, &err), KVLM_OK);
            write_tokens(s, 0, a, 17); /* recomputed */
            check_contents(s, 2);
        }
        kv_store_free(s);
        kv_blockauth_free(guess);
    }
}

/* KV events for the host tier: what a listener rebuilds from them equals
 * what the tier holds after every request, each stored event names the
 * parent and tokens its key is made of, and nothing is stored twice or
 * removed unknown, while prompts that share prefixes push blocks out of a
 * pool of 5 and a tier of 6 and bring them back. */
typedef struct {
    const kv_blockfmt *f;
    kv_key keys[256];
    int n, stored, removed, bs;
    char bad[160];
} tier_log;

static int log_find(const tier_log *L, const kv_key *k) {
    for (int i = 0; i < L->n; i++)
        if (!memcmp(L->keys[i].b, k->b, 16)) return i;
    return -1;
}

static void on_tier_event(void *user, int what, const kv_key *key, const kv_key *parent, const int32_t *tokens,
                          int n_tokens) {
    tier_log *L = user;
    int at = log_find(L, key);
    if (what == KV_INDEX_ADDED) {
        kv_key want;
        kv_block_key(L->f, parent, tokens, &want);
        if (at >= 0) snprintf(L->bad, sizeof L->bad, "stored twice");
        else if (memcmp(want.b, key->b, 16) || n_tokens != L->bs)
            snprintf(L->bad, sizeof L->bad, "a stored event's parent and tokens do not make its key");
        else if (L->n < 256) L->keys[L->n++] = *key;
        L->stored++;
    } else {
        if (at < 0) snprintf(L->bad, sizeof L->bad, "removed unknown");
        else L->keys[at] = L->keys[--L->n];
        L->removed++;
    }
}

static void test_host_tier_events(void **state) {
    (void)state;
    kvlm_error err = {0};
    kv_params probe = {NL, NH, HD, 4, 5, 2, 4096, 1234, true, KVLM_CACHE_F32, KVLM_CACHE_F32, NULL, {{0}}, false, NULL, 0};
    kv_cache *pc = kv_create(&probe, &err);
    assert_non_null(pc);
    size_t blob = kv_blockfmt_bytes(kv_get_blockfmt(pc));
    kv_free(pc);
    kv_tier *host = kv_tier_host_open(6 * blob, &err);
    kv_store *s = make_store(5, 4, 2, &host, 1);
    tier_log L = {.f = kv_get_blockfmt(kv_store_pool(s)), .bs = 4};
    kv_store_set_tier_listener(s, on_tier_event, &L);
    int32_t prompts[8][17];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 17; j++) prompts[i][j] = j < 8 ? (i % 3) * 1000 + j : i * 100 + j;
    uint64_t rng = 11;
    int promoted = 0;
    for (int round = 0; round < 80; round++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        const int32_t *p = prompts[(rng >> 33) % 8];
        int seq = round % 2;
        int have = kv_store_match_prefix(s, seq, p, 17);
        promoted += have;
        assert_int_equal(kv_store_reserve(s, seq, 17 - have, &err), KVLM_OK);
        write_tokens(s, seq, p + have, 17 - have);
        kv_store_release(s, seq);
        if (L.bad[0]) fail_msg("round %d: %s", round, L.bad);
        kv_key held[256];
        int n = kv_store_tier_blocks(s, held, 256);
        assert_int_equal(n, L.n);
        for (int i = 0; i < n; i++)
            if (log_find(&L, &held[i]) < 0) fail_msg("round %d: the tier holds a block no event told", round);
    }
    print_message("  %d stored, %d removed, %d held; %d tokens matched from the pool or the tier\n", L.stored,
                  L.removed, L.n, promoted);
    assert_true(L.removed > 0 && L.stored > 6 && promoted > 0);
    kv_store_set_tier_listener(s, NULL, NULL);
    assert_int_equal(kv_store_tier_blocks(s, NULL, 0), 0); /* unwatched: a later listener starts afresh */
    kv_store_free(s);
}

/* A block pushed out of the pool while the tier still holds its key (it was
 * computed again, not brought back) is neither read nor written again. */
static void test_demote_known(void **state) {
    (void)state;
    kvlm_error err = {0};
    int32_t a[17], b[17];
    kv_store *s = ab_store(a, b);
    kv_store_tier_stats ts;
    uint64_t demoted[4], writes[4];
    for (int round = 0; round < 4; round++) { /* a, b, a, b: each computed from scratch, pushing the other out */
        const int32_t *x = round % 2 ? b : a;
        assert_int_equal(kv_store_reserve(s, 0, 17, &err), KVLM_OK);
        write_tokens(s, 0, x, 17);
        kv_store_release(s, 0);
        kv_store_tier_stats_get(s, &ts, 1);
        demoted[round] = ts.demoted;
        writes[round] = ts.st.writes;
    }
    /* round 1 pushes a's 4 blocks out (written), round 2 b's (written),
     * round 3 a's again: the tier has them */
    assert_true(demoted[1] >= 4 && demoted[2] >= demoted[1] + 4);
    assert_int_equal(demoted[3], demoted[2]);
    assert_int_equal(writes[3], writes[2]);
    kv_store_probe pr;
    kv_store_probe_prefix(s, a, 17, 17, &pr);
    assert_int_equal(pr.tier_tokens[0], 16); /* still there, and still good */
    assert_int_equal(kv_store_match_prefix(s, 0, a, 17), 16);
    check_contents(s, 2);
    kv_store_free(s);
}

static void test_randomized_tiers(void **state) {
    (void)state;
    int max_seqs = 8, iters = tu_quick() ? 3000 : 20000;
    faulty_tier *ft = faulty_open(64 * 1024);
    kv_tier *tiers[1] = {&ft->base};
    kv_store *s = make_store(40, 4, max_seqs, tiers, 1);
    kvlm_error err = {0};
    uint64_t rng = 42;
    int ok_ops = 0, full = 0, probe_short = 0;
    for (int it = 0; it < iters; it++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        unsigned r = (unsigned)(rng >> 33);
        int q = (int)(r % (unsigned)max_seqs), op = (int)((r >> 8) % 10);
        if (op < 5) {
            int n = 1 + (int)((r >> 12) % 9);
            int32_t toks[9];
            for (int i = 0; i < n; i++) toks[i] = (int32_t)((r >> (i + 3)) % 3);
            if (kv_store_reserve(s, q, n, &err) == KVLM_OK) { write_tokens(s, q, toks, n); ok_ops++; }
            else { assert_true(err.code == KVLM_EFULL || err.code == KVLM_ERANGE); full++; }
        } else if (op < 7) {
            int d = (int)((r >> 16) % (unsigned)max_seqs);
            assert_int_equal(kv_store_fork(s, q, d, &err), KVLM_OK);
        } else if (op < 9) {
            kv_store_release(s, q);
        } else { /* a new request reusing a prefix, from RAM or the tier */
            kv_store_release(s, q);
            int32_t toks[24];
            for (int i = 0; i < 24; i++) toks[i] = (int32_t)((r >> (i % 20)) % 2);
            kv_store_probe pr;
            kv_store_probe_prefix(s, toks, 24, 24, &pr);
            int got = kv_store_match_prefix(s, q, toks, 24);
            assert_true(got % 4 == 0 && got < 24);
            assert_true(got <= pr.cached_tokens); /* damage or a full pool can only shorten it */
            probe_short += got < pr.cached_tokens;
            if (kv_store_reserve(s, q, 24 - got, &err) == KVLM_OK) write_tokens(s, q, toks + got, 24 - got);
        }
        const char *bad = kv_check(kv_store_pool(s));
        if (bad) fail_msg("after op %d: %s", it, bad);
        if (it % 64 == 0) check_contents(s, max_seqs);
    }
    check_contents(s, max_seqs);
    kv_store_tier_stats ts;
    kv_store_tier_stats_get(s, &ts, 1);
    printf("  %d appends, %d refused; tier: %llu demoted, %llu promoted, %d corrupted + %d truncated injected, "
           "%llu detected, %d lost; %d lookups shorter than probed\n",
           ok_ops, full, (unsigned long long)ts.demoted, (unsigned long long)ts.promoted, ft->corrupted,
           ft->truncated, (unsigned long long)ts.st.corrupt, ft->lost, probe_short);
    /* every damaged block was detected and counted (and its data never used:
     * check_contents above) */
    assert_int_equal(ts.st.corrupt, (uint64_t)(ft->corrupted + ft->truncated));
    assert_true(ts.promoted > 0 && ts.demoted > 0 && ft->corrupted > 0 && ft->truncated > 0 && ft->lost > 0);
    for (int q = 0; q < max_seqs; q++) kv_store_release(s, q);
    assert_null(kv_check(kv_store_pool(s)));
    kv_store_free(s);
}

/* Swap: sequences moved out to a swap space and back, among appends, forks
 * (shared blocks), releases and prefix reuse: kv_check's invariants hold
 * after every operation, swapped-in contents equal what was written, and the
 * swap space's accounting returns to zero. With a tier (a durable one that
 * flips bytes, tears and loses blocks), a swap space of 4 blocks sends most
 * swaps there: every damaged or lost block is caught (KVLM_EIO, counted),
 * never swapped in. */
static void randomized_swap(bool tier) {
    enum { MAXQ = 8 };
    int iters = tu_quick() ? 3000 : 20000, slots = tier ? 4 : 24;
    g_swap_bytes = 0;
    kv_store *probe = make_store(1, 4, 1, NULL, 0);
    g_swap_bytes = (size_t)slots * kv_store_block_bytes(probe);
    kv_store_free(probe);
    faulty_tier *ft = tier ? faulty_open(1 << 20) : NULL;
    kv_tier *tiers[1] = {ft ? &ft->base : NULL};
    g_roles = KV_TIER_DURABLE;
    kv_store *s = make_store(40, 4, MAXQ, tiers, tier ? 1 : 0);
    g_roles = KV_TIER_DEMOTE;
    g_swap_bytes = 0;
    int lost = 0;
    kvlm_error err = {0};
    kv_swap *out[MAXQ] = {0};
    int32_t out_tokens[MAXQ] = {0};
    uint64_t rng = 7;
    int outs = 0, ins = 0, no_room = 0, pool_full = 0;
    for (int it = 0; it < iters; it++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        unsigned r = (unsigned)(rng >> 33);
        int q = (int)(r % MAXQ), op = (int)((r >> 8) % 12);
        if (op < 5) {
            int n = 1 + (int)((r >> 12) % 9);
            int32_t toks[9];
            for (int i = 0; i < n; i++) toks[i] = (int32_t)((r >> (i + 3)) % 3);
            if (kv_store_reserve(s, q, n, &err) == KVLM_OK) write_tokens(s, q, toks, n);
        } else if (op < 6) {
            assert_int_equal(kv_store_fork(s, q, (int)((r >> 16) % MAXQ), &err), KVLM_OK);
        } else if (op < 7) {
            kv_store_release(s, q);
        } else if (op < 8) { /* a new request reusing a prefix */
            kv_store_release(s, q);
            int32_t toks[24];
            for (int i = 0; i < 24; i++) toks[i] = (int32_t)((r >> (i % 20)) % 2);
            int got = kv_store_match_prefix(s, q, toks, 24);
            if (kv_store_reserve(s, q, 24 - got, &err) == KVLM_OK) write_tokens(s, q, toks + got, 24 - got);
        } else if (op < 10) { /* swap q out into a free handle */
            int h = (int)((r >> 16) % MAXQ);
            if (out[h] || kv_store_seq_len(s, q) == 0) continue;
            size_t bytes = kv_store_swap_bytes(s, q);
            bool fits = kv_store_swap_fits(s, q);
            int len = kv_store_seq_len(s, q);
            int rc = kv_store_swap_out(s, q, &out[h], &err);
            if (!fits || (tier && rc == KVLM_EFULL)) { /* a tier's put may be dropped */
                assert_int_equal(rc, KVLM_EFULL);
                assert_null(out[h]);
                no_room++;
                continue;
            }
            assert_int_equal(rc, KVLM_OK);
            assert_true(bytes >= (size_t)kv_swap_blocks(out[h]) * kv_store_block_bytes(s));
            assert_int_equal(kv_store_seq_len(s, q), 0);
            assert_int_equal(kv_swap_tokens(out[h]), len);
            out_tokens[h] = len;
            outs++;
        } else { /* swap a handle back into an empty sequence (any id) */
            int h = (int)((r >> 16) % MAXQ);
            if (!out[h]) continue;
            kv_store_release(s, q);
            int rc = kv_store_swap_in(s, q, out[h], &err);
            if (rc == KVLM_EFULL) { pool_full++; continue; }
            if (rc == KVLM_EIO) { /* damaged or lost in the tier: the handle is gone */
                assert_true(tier);
                assert_int_equal(kv_store_seq_len(s, q), 0);
                out[h] = NULL;
                lost++;
                continue;
            }
            assert_int_equal(rc, KVLM_OK);
            assert_int_equal(kv_store_seq_len(s, q), out_tokens[h]);
            out[h] = NULL;
            ins++;
            /* it grows on from there */
            int32_t t = (int32_t)(r % 3);
            if (kv_store_reserve(s, q, 1, &err) == KVLM_OK) write_tokens(s, q, &t, 1);
        }
        const char *bad = kv_check(kv_store_pool(s));
        if (bad) fail_msg("after op %d: %s", it, bad);
        if (it % 32 == 0) check_contents(s, MAXQ);
    }
    check_contents(s, MAXQ);
    kv_store_swap_stats sw;
    kv_store_swap_stats_get(s, &sw);
    printf("  %s: %d swaps out (%llu to the tier), %d in (%llu from it), %d lost or damaged there, %d refused, "
           "%d waited (pool full); %llu bytes out, %llu in\n", tier ? "swap space of 4 blocks + a faulty tier" :
           "swap space of 24 blocks", outs, (unsigned long long)sw.disk_swaps_out, ins,
           (unsigned long long)sw.disk_swaps_in, lost, no_room, pool_full, (unsigned long long)sw.bytes_out,
           (unsigned long long)sw.bytes_in);
    assert_true(outs > 100 && ins > 100);
    assert_int_equal(sw.swaps_out, (uint64_t)outs);
    assert_int_equal(sw.swaps_in, (uint64_t)ins);
    assert_int_equal(sw.disk_lost, (uint64_t)lost);
    if (tier) {
        assert_true(sw.disk_swaps_out > 20 && sw.disk_swaps_in > 20 && lost > 0); /* 3,000 steps in quick runs */
        kv_store_tier_stats ts;
        kv_store_tier_stats_get(s, &ts, 1);
        /* every injected flip or tear was caught by its check */
        assert_int_equal(ts.st.corrupt, (uint64_t)(ft->corrupted + ft->truncated));
    } else {
        assert_true(no_room > 0);
    }
    for (int h = 0; h < MAXQ; h++) kv_store_swap_drop(s, out[h]);
    kv_store_swap_stats_get(s, &sw);
    assert_int_equal(sw.slots_used, 0);
    assert_int_equal(sw.disk_blocks_used, 0);
    assert_int_equal(sw.slots, (uint64_t)slots);
    for (int q = 0; q < MAXQ; q++) kv_store_release(s, q);
    assert_null(kv_check(kv_store_pool(s)));
    kv_stats st;
    kv_store_stats(s, &st);
    assert_int_equal(st.used, 0);
    kv_store_free(s);
}

static void test_randomized_swap(void **state) {
    (void)state;
    randomized_swap(false);
}
static void test_randomized_swap_tier(void **state) {
    (void)state;
    randomized_swap(true);
}

/* ---- the engine through a host tier ---- */

static float *run_prompt(kvlm_ctx *ctx, const int32_t *ids, int n, int *reused) {
    *reused = kvlm_seq_reuse_prefix(ctx, 0, ids, n);
    int8_t want[512];
    memset(want, 0, sizeof want);
    want[n - *reused - 1] = 1;
    kvlm_batch b = {n - *reused, ids + *reused, NULL, want, NULL};
    kvlm_error err = {0};
    if (kvlm_decode(ctx, &b, &err)) fail_msg("decode: %s", err.msg);
    float *out = malloc(300 * sizeof(float));
    memcpy(out, kvlm_get_logits(ctx, 0), 300 * sizeof(float));
    kvlm_seq_free(ctx, 0);
    return out;
}

static void test_engine_host_tier(void **state) {
    (void)state;
    kvlm_model *m = synth(5, NULL);
    int32_t a[200], b[200];
    for (int i = 0; i < 200; i++) { a[i] = 3 + (i * 37) % 290; b[i] = 3 + (i * 53 + 11) % 290; }
    const char *types[] = {"f16", "q8_0", "q4_kc"};
    for (int ti = 0; ti < 3; ti++) {
        kvlm_ctx_params cp = kvlm_ctx_default_params();
        cp.n_threads = 2;
        cp.n_ctx = 256;
        cp.block_size = 16;
        cp.kv_blocks = 14; /* one prompt's 13 blocks: the second evicts the first */
        cp.cache_type_k = kvlm_cache_type_from_name(types[ti]);
        cp.cache_type_v = ti == 2 ? KVLM_CACHE_Q8_0 : cp.cache_type_k;
        kvlm_error err = {0};
        kvlm_ctx *cold = kvlm_ctx_create(m, &cp, &err);
        assert_non_null(cold);
        int r;
        float *want = run_prompt(cold, a, 200, &r);
        kvlm_ctx_free(cold);
        cp.kv_host_size = 16 << 20;
        kvlm_ctx *ctx = kvlm_ctx_create(m, &cp, &err);
        assert_non_null(ctx);
        free(run_prompt(ctx, a, 200, &r));
        free(run_prompt(ctx, b, 200, &r)); /* pushes a's blocks down to the host tier */
        kvlm_prefix_probe pr;
        kvlm_seq_probe_prefix(ctx, a, 200, 200, &pr);
        kvlm_kv_stats st0, st1;
        kvlm_kv_stats_get(ctx, &st0);
        float *got = run_prompt(ctx, a, 200, &r);
        kvlm_kv_stats_get(ctx, &st1);
        kvlm_kv_tier_stats ts;
        assert_int_equal(kvlm_kv_tier_stats_get(ctx, &ts, 1), 1);
        printf("  %s cache: probe %d cached (%d in RAM, %d in host), reused %d, computed %llu, promoted %llu\n",
               types[ti], pr.cached_tokens, pr.ram_tokens, pr.tier_tokens[0], r,
               (unsigned long long)(st1.tokens_computed - st0.tokens_computed), (unsigned long long)ts.promoted);
        assert_int_equal(r, 192);
        assert_int_equal(pr.cached_tokens, 192);
        assert_true(ts.promoted > 0);
        assert_int_equal(st1.tokens_computed - st0.tokens_computed, 8);
        assert_memory_equal(got, want, 300 * sizeof(float)); /* bit-identical to the cold run */
        free(want);
        free(got);
        kvlm_ctx_free(ctx);
    }
    kvlm_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_spec),
        cmocka_unit_test(test_blockfmt_damage),
        cmocka_unit_test(test_blockfmt_signed),
        cmocka_unit_test(test_fingerprint),
        cmocka_unit_test(test_probe_and_promotion),
        cmocka_unit_test(test_forged_tier),
        cmocka_unit_test(test_demote_known), cmocka_unit_test(test_randomized_tiers),
        cmocka_unit_test(test_host_tier_events),
        cmocka_unit_test(test_randomized_swap),
        cmocka_unit_test(test_randomized_swap_tier),
        cmocka_unit_test(test_engine_host_tier),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
