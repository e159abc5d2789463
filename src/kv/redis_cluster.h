/* kv/redis_cluster: the Redis tier over a Redis Cluster (redis-cluster:// and
 * rediss-cluster:// URLs): the slot map, the nodes, redirections. */
#ifndef KVLM_KV_REDIS_CLUSTER_H
#define KVLM_KV_REDIS_CLUSTER_H
#include "kv/tier_redis.h"

/* The cluster tier over u's seed nodes (u->cluster). It owns auth (freed
 * with it, or here on failure); every node presents it. A cluster that does
 * not answer yet is not an error: its map is asked for again until it does. */
kv_tier *redis_cluster_open(const redis_url *u, int timeout_ms, redis_auth *auth, kvlm_error *err);
#endif
