/* server/kv_events: `--kv-events`: the KV pool's prefix-index changes
 * published in vLLM's KV-events wire format (ZeroMQ PUB, msgpack; see
 * docs/kv-events.md) so prefix-aware routers (llm-d, Dynamo) can track what
 * this engine holds. The engine thread only copies events into a per-step
 * batch and queues it; a publisher thread encodes and sends. */
#ifndef KVLM_SERVER_KV_EVENTS_H
#define KVLM_SERVER_KV_EVENTS_H
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

typedef struct srv_kv_events srv_kv_events;

/* Most events queued and not yet sent: a step that would exceed it drops
 * its batch (counted; its sequence number is skipped, so subscribers see the
 * gap) rather than block the engine. */
#define SRV_KV_EVENTS_MAX_QUEUED 100000

typedef struct {
    /* tcp://HOST:PORT, ipc://PATH ...; bound when it holds '*' or '::' or is
     * ipc:// or inproc:// (vLLM's rule), else connected to a subscriber
     * that binds */
    const char *endpoint;
    const char *topic;  /* the first frame of every message (NULL: "") */
    const char *medium; /* the pool's: "CPU" or "GPU" (NULL: "CPU") */
    const char *host_medium; /* the host tier's (KVLM_KV_MEDIUM_HOST; NULL: "HOST") */
    int block_size;
    /* vLLM's replay socket (NULL: none): a ZeroMQ ROUTER bound here resends
     * the last `buffer` batches sent, from a sequence number on */
    const char *replay;
    int buffer; /* batches kept for replay (0: SRV_KV_EVENTS_BUFFER) */
    size_t buffer_bytes; /* and at most these payload bytes (0: SRV_KV_EVENTS_BUFFER_BYTES) */
    /* Memory bounds (docs/kv-events.md, "Memory bounds"; 0: the defaults below) */
    size_t pub_bytes;    /* held by the PUB socket's queues, all subscribers (SRV_KV_EVENTS_PUB_BYTES) */
    int max_subscribers; /* connections to a PUB socket that binds (SRV_KV_EVENTS_MAX_SUBSCRIBERS) */
    size_t replay_bytes; /* replay messages in the ROUTER's queues, all peers (SRV_KV_EVENTS_REPLAY_BYTES) */
    int max_replays;     /* peers with a replay in progress (SRV_KV_EVENTS_MAX_REPLAYS) */
    int max_peers;       /* connections to the replay socket (SRV_KV_EVENTS_MAX_PEERS) */
    double stall_s;      /* a replay peer that takes nothing queued for this long is cut (SRV_KV_EVENTS_STALL_S) */
} srv_kv_events_params;

/* vLLM's buffer_steps; the most --kv-events-buffer takes */
#define SRV_KV_EVENTS_BUFFER 10000
#define SRV_KV_EVENTS_BUFFER_MAX 1000000
/* the replay ring's bytes: the oldest batches go first past it (a batch of
 * 100,000 prompt tokens is about half a megabyte) */
#define SRV_KV_EVENTS_BUFFER_BYTES ((size_t)64 << 20)

/* What ZeroMQ may hold for peers, in total (not per peer). Counted in bytes
 * as payload plus SRV_KV_EVENTS_FRAME_COST per frame queued; a payload that
 * several queues (or the ring) hold is counted once. */
#define SRV_KV_EVENTS_FRAME_COST 64 /* a zmq_msg_t in a pipe */
#define SRV_KV_EVENTS_PUB_BYTES ((size_t)32 << 20)
#define SRV_KV_EVENTS_MAX_SUBSCRIBERS 64
#define SRV_KV_EVENTS_PUB_HWM 100000 /* vLLM's; the byte cap binds first for a subscriber that lags */
#define SRV_KV_EVENTS_REPLAY_BYTES ((size_t)16 << 20)
#define SRV_KV_EVENTS_REPLAY_HWM 64 /* messages in one replay peer's queue; the rest wait as its cursor */
#define SRV_KV_EVENTS_MAX_REPLAYS 64
#define SRV_KV_EVENTS_MAX_PEERS 1024
#define SRV_KV_EVENTS_REPLAY_QUEUE 4 /* requests a peer may have waiting behind its replay */
#define SRV_KV_EVENTS_STALL_S 10.0
#define SRV_KV_EVENTS_SNDBUF (256 << 10) /* the kernel's send buffer per connection (SO_SNDBUF) */

/* Queues AllBlocksCleared as the first batch (seq 0): a restarted engine
 * holds nothing. */
srv_kv_events *srv_kv_events_start(const srv_kv_events_params *p, kvlm_error *err);
/* The sink to install with kvlm_ctx_set_kv_event_sink (its flush ends a batch). */
kvlm_kv_event_sink srv_kv_events_sink(srv_kv_events *e);
/* Once the engine thread has stopped: queues AllBlocksCleared, sends what is
 * queued (waiting at most a second for slow subscribers), closes, frees. */
void srv_kv_events_stop(srv_kv_events *e);

typedef struct {
    uint64_t batches, events;     /* sent */
    uint64_t dropped_batches, dropped_events; /* queue full, or the PUB socket's byte cap reached */
    uint64_t queued;              /* events waiting now */
    uint64_t replays, replayed;   /* replay requests answered (end mark sent), batches resent */
    uint64_t buffered;            /* batches held for replay now */
    uint64_t pub_bytes;           /* held by the PUB socket's queues now */
    uint64_t subscribers;         /* connected to the PUB socket now */
    uint64_t subscribers_refused; /* connections past max_subscribers, closed at once */
    uint64_t subscribers_cut;     /* disconnected at the byte cap: the one with the most unsent */
    uint64_t replay_bytes;        /* replay messages in the ROUTER's queues now */
    uint64_t replay_peers;        /* connected to the replay socket now */
    uint64_t replays_active;      /* replays in progress now */
    uint64_t replays_dropped;     /* replays (or waiting requests) abandoned: a cap, a stall, a peer gone */
    uint64_t replay_peers_refused; /* connections past max_peers, closed at once */
    uint64_t replay_peers_cut;    /* disconnected: stalled with messages queued, or oldest at the byte cap */
} srv_kv_events_stats;
void srv_kv_events_stats_get(srv_kv_events *e, srv_kv_events_stats *st);

/* The msgpack payload of one batch (the third frame): [ts, [event...], 0],
 * consecutive events merged as vLLM does (a run of stored blocks that chain
 * into one BlockStored, a run of removals into one BlockRemoved). kind 0 is
 * AllBlocksCleared. media: the names of KVLM_KV_MEDIUM_POOL and _HOST. Returns
 * a malloc'ed buffer (*len bytes), NULL out of memory. */
uint8_t *srv_kv_events_encode(const kvlm_kv_event *ev, int n, double ts, int block_size, const char *const media[2],
                              size_t *len);
/* The 64-bit integer a block key travels as: its last 8 bytes, big-endian
 * (XXH3-128's low half; what llm-d takes from a byte-string hash too). */
uint64_t srv_kv_hash64(const uint8_t key[16]);
#endif
