/* kv/tier_host: a KV tier in this process's memory, capped in bytes with an
 * LRU (the store's first tier: cheaper than disk; for tests too). */
#ifndef KVLM_KV_TIER_HOST_H
#define KVLM_KV_TIER_HOST_H
#include <stdint.h>
#include "kv/tier.h"

kv_tier *kv_tier_host_open(uint64_t max_bytes, kvlm_error *err);
#endif
