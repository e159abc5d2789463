/* kv/no_redis: the Redis tier in a build without it (-DKVLM_REDIS=OFF: no
 * hiredis): asking for one is an error that says how to get it. */
#include "kv/tier.h"
#include "util/error.h"

kv_tier *kv_tier_redis_open(const char *url, const kv_redis_opts *o, kvlm_error *err) {
    (void)o;
    util_err_set(err, KVLM_EUNSUPPORTED, "the Redis tier (%.64s): this kvlm was built without it (-DKVLM_REDIS=OFF); "
                 "rebuild with -DKVLM_REDIS=ON (Debian: libhiredis-dev)", url ? url : "");
    return NULL;
}
