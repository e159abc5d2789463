#!/usr/bin/env bash
# tests/cli_serve_kv_events: `kvlm serve --kv-events` end to end (Debian's
# python3-zmq and python3-msgpack, hence /usr/bin/python3): a subscriber that
# listens, a server that connects to it, a load of requests sharing prefixes
# through a pool small enough to evict, over a host-memory tier small enough to
# evict too; the set of cached blocks rebuilt from the event stream alone
# equals /kvlm/status?blocks=1 for each medium (the pool's "CPU", the host
# tier's "HOST"), sequence numbers are
# consecutive, every message has vLLM's shape, the vllm:* metrics agree with
# kvlm's own, and a stop publishes AllBlocksCleared last. The replay socket
# (--kv-events-replay) resends every batch from a sequence number on, byte
# for byte as the stream carried it (batch 0 too, which a subscriber that
# joins as the server starts can miss), to DEALER and REQ clients.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
PY=/usr/bin/python3
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
if ! "$PY" -c 'import zmq, msgpack' 2>/dev/null; then
  echo "SKIP: $PY lacks zmq or msgpack (scripts/setup.sh installs python3-zmq, python3-msgpack)"; exit 77
fi
exec "$PY" - "$KVLM" "$MODEL" <<'PY'
import http.client, json, os, re, signal, subprocess, sys, threading, time
import msgpack, zmq

kvlm, model = sys.argv[1], sys.argv[2]
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)))
    failures += 0 if cond else 1

# The subscriber listens (a server given tcp://HOST:PORT connects, vLLM's rule),
# so nothing published after the connection is lost to a late join.
zctx = zmq.Context()
sub = zctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
port = sub.bind_to_random_port("tcp://127.0.0.1")
replay_url = "ipc:///tmp/kvlm-cli-kv-events-%d-replay" % os.getpid()
bad = subprocess.run([kvlm, "serve", "-m", model, "--port", "0", "--kv-events-replay", replay_url],
                     capture_output=True, text=True, timeout=60)
check(bad.returncode != 0 and "--kv-events-replay needs --kv-events" in bad.stderr,
      "--kv-events-replay alone is refused with a message", bad.stderr[-200:])
proc = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-c", "256", "--max-seqs", "8",
                         "--kv-mem", "480KiB", "--kv-host-size", "240KiB", "-t", "2",
                         "--kv-events", "tcp://127.0.0.1:%d" % port,
                         "--kv-events-replay", replay_url],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
line = proc.stdout.readline()
m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", line)
if not m:
    print("FAIL: no listening line, got %r; stderr: %s" % (line, proc.stderr.read()))
    sys.exit(1)
http_port = int(m.group(1))
check(mon.poll(10000), "the server's PUB socket connected to the subscriber")
time.sleep(0.3)  # its subscription reaches the publisher before any request

msgs, lock = [], threading.Lock()
stop_rx = threading.Event()
def receive():
    while not stop_rx.is_set():
        if sub.poll(50):
            parts = sub.recv_multipart()
            with lock:
                msgs.append(parts)
rx = threading.Thread(target=receive, daemon=True)
rx.start()

def request(method, path, body=None, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", http_port, timeout=timeout)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, (json.loads(text) if text.startswith("{") else text)

# Load: 3 shared prefixes x 16 suffixes, 8 clients at once; the pool (48 blocks of 10 KiB)
# holds far fewer than all the blocks, so cached ones are evicted and reused.
prefixes = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends every day. ",
            "Tom and his dog went to the big forest to look for a hidden treasure that the old man had told them about. ",
            "One day, a small bird sat on the branch of a tall tree and sang a happy song to the sun and the clouds. "]
prompts = [p + "Then %s came and said %d." % (["the cat", "a boy", "mom", "the king"][i % 4], i) for p in prefixes for i in range(16)]
errors = []
def client(k):
    for i in range(k, len(prompts), 8):
        st, r = request("POST", "/v1/completions", {"prompt": prompts[i], "max_tokens": 24, "temperature": 0})
        if st != 200:
            errors.append((st, r))
t0 = time.time()
threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
for t in threads: t.start()
for t in threads: t.join()
check(not errors, "%d requests answered (%.1f s)" % (len(prompts), time.time() - t0), errors[:2])

MEDIA = ("CPU", "HOST")
def replay():
    """The cached sets (per medium) from the events alone, and the checks on the stream."""
    with lock:
        got = list(msgs)
    cached, seqs, problems = {m: set() for m in MEDIA}, [], []
    n_stored, n_removed, n_cleared = dict.fromkeys(MEDIA, 0), dict.fromkeys(MEDIA, 0), 0
    for parts in got:
        if len(parts) != 3 or parts[0] != b"" or len(parts[1]) != 8:
            problems.append("frames %r" % [len(p) for p in parts]); continue
        seqs.append(int.from_bytes(parts[1], "big"))
        batch = msgpack.unpackb(parts[2])
        if not (isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0):
            problems.append("batch %r" % batch[:1]); continue
        for ev in batch[1]:
            if ev[0] == "BlockStored":
                hashes, parent, toks, bs, lora, medium, lora_name = ev[1:]
                if bs != 16 or len(toks) != 16 * len(hashes) or medium not in MEDIA or lora is not None or lora_name is not None:
                    problems.append("stored %r" % ev[:3]); continue
                if any(h in cached[medium] for h in hashes):
                    problems.append("stored twice in %s %r" % (medium, hashes))
                cached[medium].update(hashes); n_stored[medium] += len(hashes)
            elif ev[0] == "BlockRemoved":
                hashes, medium = ev[1:]
                if medium not in MEDIA or any(h not in cached[medium] for h in hashes):
                    problems.append("removed unknown %r from %r" % (hashes, medium)); continue
                cached[medium].difference_update(hashes); n_removed[medium] += len(hashes)
            elif ev == ["AllBlocksCleared"]:
                for m in MEDIA: cached[m].clear()
                n_cleared += 1
            else:
                problems.append("event %r" % ev[:1])
    return cached, seqs, problems, n_stored, n_removed, n_cleared

# The engine lists its blocks after its last step: poll until both views agree.
deadline, same = time.time() + 20, False
while time.time() < deadline:
    st, status = request("GET", "/kvlm/status?blocks=1")
    engine = {int(h[16:], 16) for h in status["cached_blocks"]}
    host = {int(h[16:], 16) for h in status["host_blocks"]}
    cached, seqs, problems, n_stored, n_removed, n_cleared = replay()
    if status["running"] == 0 and status["waiting"] == 0 and engine == cached["CPU"] and host == cached["HOST"]:
        same = True
        break
    time.sleep(0.1)
check(same, "the pool's blocks rebuilt from %d batches (%d stored, %d removed) equal /kvlm/status's %d cached blocks"
      % (len(seqs), n_stored["CPU"], n_removed["CPU"], len(engine)),
      "events-only %d, status-only %d" % (len(cached["CPU"] - engine), len(engine - cached["CPU"])))
check(same, "the host tier's blocks rebuilt from them (%d stored, %d removed) equal its %d listed blocks"
      % (n_stored["HOST"], n_removed["HOST"], len(host)),
      "events-only %d, status-only %d" % (len(cached["HOST"] - host), len(host - cached["HOST"])))
tiers = {t["name"]: t for t in status.get("tiers", [])}
check("host" in tiers and len(host) <= tiers["host"]["blocks"],
      "the host tier holds them (%s blocks)" % tiers.get("host", {}).get("blocks"), list(tiers))
check(len(engine) <= status["blocks_cached"] + status["blocks_used"] <= status["n_blocks"],
      "the listed blocks fit the pool")
check(not problems, "every message has vLLM's shape ([topic, seq, [ts, events, 0]], BlockStored of 8 fields)", problems[:3])
check(seqs and seqs[0] in (0, 1) and seqs == list(range(seqs[0], seqs[0] + len(seqs))),
      "sequence numbers consecutive from %s" % (seqs[:1],), seqs[:10])
check(n_removed["CPU"] > 0 and n_stored["CPU"] > len(engine), "blocks were evicted and re-stored (the pool was full)")
check(n_removed["HOST"] > 0 and n_stored["HOST"] > len(host), "the host tier pushed blocks out too (it was full)")

# Replay from 0 on a DEALER: every batch so far, as the stream sent it, then the end mark.
END = b"\xff" * 8
dealer = zctx.socket(zmq.DEALER)
dealer.connect(replay_url)
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replayed, end, shapes = [], None, []
while dealer.poll(5000):
    fr = dealer.recv_multipart()
    if len(fr) != 3 or fr[0] != b"" or len(fr[1]) != 8:
        shapes.append([len(x) for x in fr]); continue
    if fr[1] == END:
        end = fr; break
    replayed.append((int.from_bytes(fr[1], "big"), fr[2]))
with lock:
    stream = {int.from_bytes(p[1], "big"): p[2] for p in msgs}
rseqs = [q for q, _ in replayed]
check(end is not None and end[2] == b"" and not shapes, "a replay from 0 ends with the end mark (-1, empty)", shapes[:3])
check(rseqs == list(range(0, len(rseqs))) and rseqs and rseqs[-1] == seqs[-1],
      "it resends batches 0..%s, consecutive" % (rseqs[-1:] or "?"), rseqs[:5])
check(all(stream[q] == pl for q, pl in replayed if q in stream) and len([q for q in rseqs if q in stream]) == len(seqs),
      "each replayed batch equals the stream's, byte for byte (%d of them)" % len(seqs))
check(msgpack.unpackb(replayed[0][1])[1] == [["AllBlocksCleared"]] if replayed else False,
      "batch 0, AllBlocksCleared, comes back too (the stream's first was %s)" % seqs[:1])
# From the middle, and on a REQ socket past the end: the end mark alone.
mid = seqs[len(seqs) // 2]
dealer.send_multipart([b"", mid.to_bytes(8, "big")])
tail = []
while dealer.poll(5000):
    fr = dealer.recv_multipart()
    if fr[1] == END: break
    tail.append(int.from_bytes(fr[1], "big"))
check(tail == list(range(mid, seqs[-1] + 1)), "a replay from %d resends %d..%d" % (mid, mid, seqs[-1]), tail[:3])
req = zctx.socket(zmq.REQ)
req.connect(replay_url)
req.send((seqs[-1] + 1).to_bytes(8, "big"))
fr = req.recv_multipart() if req.poll(5000) else None
check(fr == [END, b""], "a REQ asking past the last batch gets the end mark alone", fr)
dealer.close(0); req.close(0)

_, text = request("GET", "/metrics")
def metric(name):
    m = re.search(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), text, re.M)
    return (float(m.group(2)), m.group(1) or "") if m else (None, "")
q, qlab = metric("vllm:prefix_cache_queries_total")
h, _ = metric("vllm:prefix_cache_hits_total")
u, _ = metric("vllm:kv_cache_usage_perc")
run, _ = metric("vllm:num_requests_running")
wait, _ = metric("vllm:num_requests_waiting")
check(None not in (q, h, u, run, wait) and 'model_name="stories260K"' in qlab, "the vllm:* series are there, with model_name", qlab)
check(h is not None and 0 < h <= q, "prefix cache hits %s <= queries %s (tokens)" % (h, q))
check(q == status["prompt_tokens"] and h == status["cached_tokens"], "they count the prompt and cached tokens /kvlm/status reports")
check(u is not None and 0 <= u <= 1, "kv_cache_usage_perc %s in [0, 1]" % u)
check(run == metric("kvlm_requests_running")[0] == 0 and wait == metric("kvlm_requests_waiting")[0] == 0,
      "running and waiting match kvlm's own (idle: 0)")
m = re.search(r'^vllm:cache_config_info\{([^}]*)\} 1$', text, re.M)
labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
check(labels.get("block_size") == "16" and labels.get("num_gpu_blocks") == str(status["n_blocks"])
      and labels.get("cache_dtype") == "f16", "vllm:cache_config_info carries the block size and pool", labels)
ev_total, _ = metric("kvlm_kv_events_total")
dropped, _ = metric("kvlm_kv_events_dropped_total")
check(dropped == 0 and ev_total is not None and ev_total >= sum(n_stored.values()) + sum(n_removed.values()),
      "kvlm_kv_events_total %s, none dropped" % ev_total)
check(metric("kvlm_kv_event_replays_total")[0] == 3 and
      metric("kvlm_kv_event_batches_replayed_total")[0] == len(replayed) + len(tail),
      "the replays are counted", (metric("kvlm_kv_event_replays_total"), len(replayed) + len(tail)))

# A clean stop: the last batch says the cache is gone.
last = seqs[-1]
proc.send_signal(signal.SIGTERM)
try:
    proc.wait(timeout=20)
except subprocess.TimeoutExpired:
    proc.kill()
check(proc.returncode == 0, "SIGTERM stops the server", proc.returncode)
deadline = time.time() + 5
while time.time() < deadline:
    with lock:
        tail = [p for p in msgs if int.from_bytes(p[1], "big") > last]
    if tail: break
    time.sleep(0.05)
check(tail and int.from_bytes(tail[-1][1], "big") == last + 1 and msgpack.unpackb(tail[-1][2])[1] == [["AllBlocksCleared"]],
      "the stop publishes AllBlocksCleared as batch %d" % (last + 1))
stop_rx.set()
rx.join()
sub.close(0); mon.close(0); zctx.term()
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
