/* kv/tier_pending: TEMPORARY until the disk and Redis tiers (branches wt-disk
 * and wt-redis) are merged: opening them fails with a clear error. Delete
 * this file when src/kv/tier_disk.c and src/kv/tier_redis.c arrive. */
#include "kv/tier.h"
#include "util/error.h"

kv_tier *kv_tier_disk_open(const char *dir, uint64_t max_bytes, kvlm_error *err) {
    (void)dir, (void)max_bytes;
    util_err_set(err, KVLM_EUNSUPPORTED, "the disk KV tier is not built yet (--kv-disk)");
    return NULL;
}

kv_tier *kv_tier_redis_open(const char *url, int timeout_ms, kvlm_error *err) {
    (void)url, (void)timeout_ms;
    util_err_set(err, KVLM_EUNSUPPORTED, "the Redis KV tier is not built yet (--kv-redis)");
    return NULL;
}
