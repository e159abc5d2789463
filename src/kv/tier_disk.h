/* kv/tier_disk: the disk tier's extras beside kv_tier_disk_open (kv/tier.h):
 * where a block's file lives, and hooks for tests and benchmarks. */
#ifndef KVLM_KV_TIER_DISK_H
#define KVLM_KV_TIER_DISK_H
#include <stdbool.h>
#include <stddef.h>
#include "kv/tier.h"

/* DIR/<first 2 hex digits>/<32 hex digits>.kvb; false if it does not fit in cap. */
bool kv_tier_disk_path(const char *dir, const kv_key *key, char *out, size_t cap);

/* Test hooks; they do nothing on a tier that is not a disk tier. */
/* Bounds of the put queue (the defaults are 1024 blocks and 256 MiB). */
void kv_tier_disk_set_queue_limits(kv_tier *t, int max_blocks, size_t max_bytes);
/* A paused writer leaves the queue as it is, so a test can fill it; flush and
 * close resume it first. */
void kv_tier_disk_pause_writer(kv_tier *t, bool paused);
/* The longest get and contains wait for the reader thread (default 2000 ms). */
void kv_tier_disk_set_read_deadline(kv_tier *t, int ms);
/* The reader thread's next job first sleeps ms, as on a disk that hangs. */
void kv_tier_disk_stall_reader(kv_tier *t, int ms);
#endif
