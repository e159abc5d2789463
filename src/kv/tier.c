/* kv/tier: what every tier shares: key spelling, the counters and the
 * readers' corruption count. The tiers themselves are kv/tier_disk.c and kv/tier_redis.c. */
#include "kv/tier.h"
#include "util/timing.h"
#include <stdatomic.h>
#include <string.h>

void kv_key_hex(const kv_key *k, char out[KV_KEY_HEX]) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = digits[k->b[i] >> 4];
        out[2 * i + 1] = digits[k->b[i] & 15];
    }
    out[32] = 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

bool kv_key_parse(const char *s, kv_key *k) {
    if (!s || strlen(s) != 32) return false;
    for (int i = 0; i < 16; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        k->b[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

static void counters_get(const kv_tier *t, kv_tier_stats *out) {
    const kv_tier_counters *n = &t->n;
    out->hits = atomic_load(&n->hits);
    out->misses = atomic_load(&n->misses);
    out->writes = atomic_load(&n->writes);
    out->write_bytes = atomic_load(&n->write_bytes);
    out->dropped_writes = atomic_load(&n->dropped);
    out->errors = atomic_load(&n->errors);
    out->reads = atomic_load(&n->reads);
    out->read_seconds = (double)atomic_load(&n->read_ns) / 1e9;
    out->evicted = atomic_load(&n->evicted);
    out->up = atomic_load(&n->up);
}

void kv_tier_stats_get(kv_tier *t, kv_tier_stats *out) {
    memset(out, 0, sizeof *out);
    counters_get(t, out);
    t->ops->stats(t, out);
    out->corrupt += atomic_load(&t->corrupt);
    out->forged += atomic_load(&t->forged);
}

void kv_tier_note_corrupt(kv_tier *t) { atomic_fetch_add(&t->corrupt, 1); }
void kv_tier_note_forged(kv_tier *t) { atomic_fetch_add(&t->forged, 1); }

void kv_tier_note_read(kv_tier *t, int found, int n, double t0) {
    atomic_fetch_add(&t->n.reads, 1);
    atomic_fetch_add(&t->n.hits, (uint64_t)found);
    atomic_fetch_add(&t->n.misses, (uint64_t)(n - found));
    atomic_fetch_add(&t->n.read_ns, (uint64_t)((util_now_s() - t0) * 1e9));
}
