#!/usr/bin/env bash
# tests/cli_serve_memory: what `kvlm serve` holds for peers that do not read
# stays within the totals docs/serving.md ("Memory bounds per peer") and
# docs/kv-events.md ("Memory bounds") give, and goes back when they leave.
# One server (stories260K, --kv-events with --kv-events-replay, a replay ring
# of 1,000 batches filled by a steady load of completions), its RSS read from
# /proc/PID/status:
#   - 600 replay peers (ZeroMQ DEALERs with a 4 KiB receive buffer) each ask
#     for the whole ring and read nothing: RSS grows by the connections' own
#     cost and at most the replay socket's byte cap beyond it; a peer that
#     reads gets a complete replay meanwhile; RSS comes back once they close;
#   - 32 streams of completions with logprobs whose clients read nothing,
#     and one stream far larger than the kernel takes: RSS within the cap on
#     unsent answers (--max-unsent), the large stream reset and its request
#     cancelled, a streaming client that reads answered in full meanwhile;
#   - 200 request bodies of 900 KiB that stop short of their 1 MiB: RSS
#     within --max-body-total, the rest refused with 503;
#   - 200 PUB subscribers that read nothing: at most 64 are kept, RSS within
#     the PUB socket's cap, a subscriber that reads goes on receiving.
# It fails on a server that copies a replay into every peer's queue (RSS grows
# by the ring for each peer and stays after they leave) or keeps a stream's
# whole text and logprobs. Debian's python3-zmq and python3-msgpack, hence /usr/bin/python3.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
PY=/usr/bin/python3
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
if ! "$PY" -c 'import zmq, msgpack' 2>/dev/null; then
  echo "SKIP: $PY lacks zmq or msgpack (scripts/setup.sh installs python3-zmq, python3-msgpack)"; exit 77
fi
if ldd "$KVLM" 2>/dev/null | grep libasan >/dev/null; then # (not grep -q: ldd cut short by SIGPIPE fails the pipe under pipefail)
  echo "SKIP: $KVLM is a sanitizer build (its quarantine and shadow memory are not the server's bounds)"; exit 77
fi
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt 2048 ]; then ulimit -n 4096 2>/dev/null || true; fi
exec "$PY" - "$KVLM" "$MODEL" <<'PY'
import http.client, json, random, re, signal, socket, subprocess, sys, threading, time
import msgpack, zmq

kvlm, model = sys.argv[1], sys.argv[2]
failures = 0
MiB, KiB = 1 << 20, 1 << 10

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)))
    failures += 0 if cond else 1

# The documented bounds, with the defaults (docs/kv-events.md, docs/serving.md)
REPLAY_BYTES = 16 * MiB    # replay messages in the ROUTER's queues, all peers
MAX_REPLAYS = 64           # replays in progress
MAX_PEERS = 1024           # connections to the replay socket
PUB_BYTES = 32 * MiB       # what the PUB socket's queues hold, all subscribers
MAX_SUBSCRIBERS = 64
ZMQ_CONN = 48 * KiB        # one ZeroMQ connection's own memory (measured: about 28 KiB)
UNSENT = 16 * MiB          # --max-unsent, as given below (the default is 64 MiB)
BODIES = 64 * MiB          # --max-body-total
MHD_CONN = 32 * KiB        # libmicrohttpd's memory per connection
SLACK = 8 * MiB            # the allocator's and the interpreter's noise

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
pub_port, rep_port = free_port(), free_port()
proc = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-t", "1", "--max-seqs", "48", "-c", "1024",
                         "--max-unsent", "16MiB", "--kv-events", "tcp://*:%d" % pub_port,
                         "--kv-events-replay", "tcp://127.0.0.1:%d" % rep_port, "--kv-events-buffer", "500"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
line = proc.stdout.readline()
m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", line)
if not m:
    print("FAIL: no listening line, got %r; stderr: %s" % (line, proc.stderr.read()))
    sys.exit(1)
port = int(m.group(1))

def rss():
    for l in open("/proc/%d/status" % proc.pid):
        if l.startswith("VmRSS:"):
            return int(l.split()[1]) * KiB
def mib(b): return "%.1f MiB" % (b / MiB)
def sample(secs, peak=0):
    t = time.time()
    while time.time() - t < secs:
        peak = max(peak, rss()); time.sleep(0.1)
    return peak
def settle(secs, target=None):  # the lowest RSS over a while: what stays once the peers left
    low, t = rss(), time.time()     # (target: back under it is enough: a loaded machine's reaping takes longer)
    while time.time() - t < secs and (target is None or low > target):
        time.sleep(0.2); low = min(low, rss())
    return low

def request(method, path, body=None, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse(); text = r.read().decode(); c.close()
    return r.status, text
def metric(name, labels=None):
    _, text = request("GET", "/metrics")
    for m in re.finditer(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), text, re.M):
        if labels is None or labels in (m.group(1) or ""):
            return float(m.group(2))
    return None

# A steady load: short prompts, long sampled completions, 16 at once (each
# engine step that fills a block is a batch of events).
stop_load, pause_load = threading.Event(), threading.Event()
WORDS = "the a girl boy dog cat sun tree park ball red big happy sad ran jumped said mom dad friend".split()
def load(k):
    rnd = random.Random(k)
    while not stop_load.is_set():
        if pause_load.is_set():
            time.sleep(0.05); continue
        prompt = " ".join(rnd.choice(WORDS) for _ in range(300 if k < 2 else 8))
        try:
            request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 256, "temperature": 1})
        except OSError:
            pass
loaders = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(16)]
for t in loaders: t.start()
t0 = time.time()
while (metric("kvlm_kv_event_batches_buffered") or 0) < 500 and time.time() - t0 < 60:
    time.sleep(0.2)
check((metric("kvlm_kv_event_batches_buffered") or 0) >= 500, "the replay ring holds 500 batches (%.1f s of load)" % (time.time() - t0))
base = settle(1)
print("     base RSS %s" % mib(base))
zctx = zmq.Context()
END = b"\xff" * 8

# ---- A: 600 replay peers that ask for everything and read nothing ----------------------
peers = []
for i in range(600):
    d = zctx.socket(zmq.DEALER)
    for opt, v in ((zmq.RCVHWM, 1), (zmq.RCVBUF, 4096), (zmq.RECONNECT_IVL, 60000), (zmq.LINGER, 0)):
        d.setsockopt(opt, v)
    d.connect("tcp://127.0.0.1:%d" % rep_port)
    peers.append(d)
t = time.time()
while (metric("kvlm_kv_event_replay_peers") or 0) < 600 and time.time() - t < 10:
    time.sleep(0.2)
idle = sample(1)
per_conn = (idle - base) / 600
check(per_conn <= ZMQ_CONN, "600 idle replay peers cost %s of RSS, %.1f KiB each (bound %d KiB)"
      % (mib(idle - base), per_conn / KiB, ZMQ_CONN // KiB))
for d in peers:
    d.send_multipart([b"", (0).to_bytes(8, "big")])
peak = sample(2)
good = zctx.socket(zmq.DEALER)
good.connect("tcp://127.0.0.1:%d" % rep_port)
good.send_multipart([b"", (0).to_bytes(8, "big")])
seqs, end, bad = [], False, 0
while good.poll(10000):
    fr = good.recv_multipart()
    if len(fr) != 3 or fr[0] != b"" or len(fr[1]) != 8: bad += 1; continue
    if fr[1] == END: end = fr[2] == b""; break
    seqs.append(int.from_bytes(fr[1], "big"))
    b = msgpack.unpackb(fr[2])
    if not (isinstance(b, list) and len(b) == 3): bad += 1
check(end and not bad and len(seqs) >= 450 and seqs == list(range(seqs[0], seqs[0] + len(seqs))),
      "meanwhile a peer that reads gets a complete replay: %d batches %s..%s, consecutive, then the end mark"
      % (len(seqs), seqs[:1], seqs[-1:]), (end, bad, len(seqs)))
peak = sample(1, peak)
bound = REPLAY_BYTES + SLACK
check(peak - idle <= bound, "600 peers asked for the ring (%s of it): RSS %s at most, %s over the idle peers' "
      "(bound %s: the replay cap and slack)" % ("%d batches" % len(seqs), mib(peak), mib(peak - idle), mib(bound)))
rb, act, npeers = metric("kvlm_kv_event_replay_bytes"), metric("kvlm_kv_event_replays_active"), metric("kvlm_kv_event_replay_peers")
check(rb is not None and rb <= REPLAY_BYTES and act is not None and act <= MAX_REPLAYS and npeers is not None and npeers <= MAX_PEERS,
      "replay bytes queued %s <= %s, replays in progress %s <= %d, peers %s" % (rb, REPLAY_BYTES, act, MAX_REPLAYS, npeers))
dropped = metric("kvlm_kv_event_replays_dropped_total")
check(dropped is not None and dropped > 0, "the replays abandoned are counted (%s)" % dropped)
for d in peers: d.close(0)
good.close(0)
after = settle(6, base + SLACK)
check(after - base <= SLACK, "after they close: RSS %s, %s over %s before (bound %s)" % (mib(after), mib(after - base), mib(base), mib(SLACK)))

# ---- B: streams whose clients read nothing -------------------------------------------------
def stream_request(body, rcvbuf=4096):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(data) + data)
    return s
pause_load.set()  # the sequence slots go to the streams below
base_b = settle(0.5)
socks = [stream_request({"prompt": "Once upon a time", "max_tokens": 1000, "logprobs": 20, "stream": True, "temperature": 1})
         for _ in range(32)]
result = {}
def good_stream():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 64, "stream": True,
                                                     "temperature": 0}), {"Content-Type": "application/json"})
    r = c.getresponse(); text = r.read().decode(); c.close()
    result["good"] = (r.status, text.count("data: "), text.rstrip().endswith("data: [DONE]"))
gt = threading.Thread(target=good_stream); gt.start()
peak = sample(4)
gt.join(30)
st, n, done = result.get("good", (None, 0, False))
check(st == 200 and done and n >= 2, "meanwhile a streaming client that reads gets its whole answer (%d events)" % n, result)
bound = UNSENT + SLACK
check(peak - base_b <= bound, "32 non-reading streams (logprobs 20): RSS %s at most, %s over %s before (bound %s: "
      "--max-unsent and slack)" % (mib(peak), mib(peak - base_b), mib(base_b), mib(bound)))
for s in socks: s.close()
# one stream far larger than the kernel takes (48 choices a step, logprobs 20), read by no one: reset
# past its share of --max-unsent (a sixteenth: 1 MiB here)
cut0 = metric("kvlm_http_answers_cut_total") or 0
cancelled0 = metric("kvlm_completions_finished_total", 'reason="cancelled"') or 0
big = stream_request({"prompt": "Once upon a time", "max_tokens": 1000, "n": 48, "logprobs": 20, "stream": True,
                      "temperature": 1})
t, cut = time.time(), cut0
peak = 0
while time.time() - t < 15 and cut == cut0:
    peak = max(peak, rss()); time.sleep(0.3)
    cut = metric("kvlm_http_answers_cut_total") or cut0
cancelled = 0
for _ in range(20):
    cancelled = metric("kvlm_completions_finished_total", 'reason="cancelled"') or 0
    if cancelled > cancelled0: break
    time.sleep(0.25)
check(cut > cut0 and cancelled > cancelled0, "a stream read by no one is reset past its cap (%.1f s) and its request "
      "cancelled (%d choices)" % (time.time() - t, cancelled - cancelled0), (cut, cancelled))
check(peak - base_b <= bound, "meanwhile RSS %s at most (bound %s over %s)" % (mib(peak), mib(bound), mib(base_b)))
big.close()
after = settle(6, base_b + SLACK)
check(after - base_b <= SLACK, "after the streams: RSS %s, %s over %s before (bound %s)" % (mib(after), mib(after - base_b), mib(base_b), mib(SLACK)))


# ---- D: request bodies sent most of the way, then nothing ----------------------------------
base_d = settle(0.5)
ups = []
for i in range(200):
    u = socket.socket()
    u.connect(("127.0.0.1", port))
    u.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1048576\r\n\r\n" + b" " * (900 * KiB))
    ups.append(u)
peak = sample(1.5)
held, refused = metric("kvlm_http_body_bytes"), metric("kvlm_http_bodies_refused_total")
check(held is not None and held <= BODIES and refused is not None and refused > 0,
      "200 bodies of 900 KiB that stop short: %s bytes held (at most %d), %s refused with 503" % (held, BODIES, refused))
bound = BODIES + 200 * MHD_CONN + SLACK
check(peak - base_d <= bound, "meanwhile RSS %s at most, %s over %s before (bound %s)"
      % (mib(peak), mib(peak - base_d), mib(base_d), mib(bound)))
st, _ = request("GET", "/health")
check(st == 200, "the server answers meanwhile (/health %s)" % st)
for u in ups: u.close()
after = settle(6, base_d + SLACK)
st, _ = request("POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4})
check(st == 200 and after - base_d <= SLACK, "after they close: a completion answered (%s), RSS %s, %s over %s before "
      "(bound %s)" % (st, mib(after), mib(after - base_d), mib(base_d), mib(SLACK)))
pause_load.clear()

# ---- C: PUB subscribers that read nothing ---------------------------------------------------
goodsub = zctx.socket(zmq.SUB)
goodsub.setsockopt(zmq.SUBSCRIBE, b"")
goodsub.connect("tcp://127.0.0.1:%d" % pub_port)
got, stop_rx = [], threading.Event()
def rx():
    while not stop_rx.is_set():
        if goodsub.poll(100):
            got.append(int.from_bytes(goodsub.recv_multipart()[1], "big"))
rt = threading.Thread(target=rx, daemon=True); rt.start()
base_c = settle(0.5)
subs = []
for i in range(200):
    d = zctx.socket(zmq.SUB)
    for opt, v in ((zmq.RCVHWM, 1), (zmq.RCVBUF, 4096), (zmq.RECONNECT_IVL, 60000), (zmq.LINGER, 0)):
        d.setsockopt(opt, v)
    d.setsockopt(zmq.SUBSCRIBE, b"")
    d.connect("tcp://127.0.0.1:%d" % pub_port)
    subs.append(d)
n0 = len(got)
peak = sample(4)
nsub, refused = metric("kvlm_kv_events_subscribers"), metric("kvlm_kv_events_subscribers_refused_total")
check(nsub is not None and nsub <= MAX_SUBSCRIBERS and refused is not None and refused >= 200 + 1 - MAX_SUBSCRIBERS,
      "201 subscribers: %s kept (at most %d), %s refused" % (nsub, MAX_SUBSCRIBERS, refused))
bound = PUB_BYTES + MAX_SUBSCRIBERS * ZMQ_CONN + SLACK
check(peak - base_c <= bound, "200 non-reading subscribers: RSS %s at most, %s over %s before (bound %s)"
      % (mib(peak), mib(peak - base_c), mib(base_c), mib(bound)))
pb = metric("kvlm_kv_events_pub_bytes")
check(pb is not None and pb <= PUB_BYTES, "the PUB socket's queues hold %s bytes (cap %d)" % (pb, PUB_BYTES))
with_gaps = got[n0:]
check(len(with_gaps) >= 10 and with_gaps == list(range(with_gaps[0], with_gaps[0] + len(with_gaps))),
      "the subscriber that reads got %d batches meanwhile, consecutive" % len(with_gaps), with_gaps[:5])
for d in subs: d.close(0)
stop_rx.set(); rt.join()
goodsub.close(0)
# ZeroMQ's I/O thread frees the subscribers' queues (8 MB of them here) into its own malloc arena, which
# glibc does not always give back at once: 4 MiB more slack here (the tree before kept 52 MiB)
SLACK_SUB = SLACK + 4 * MiB
after = settle(6, base_c + SLACK_SUB)
check(after - base_c <= SLACK_SUB, "after the subscribers: RSS %s, %s over %s before (bound %s)" % (mib(after), mib(after - base_c), mib(base_c), mib(SLACK_SUB)))

stop_load.set()
proc.send_signal(signal.SIGTERM)
try:
    proc.wait(timeout=20)
except subprocess.TimeoutExpired:
    proc.kill()
check(proc.returncode == 0, "SIGTERM stops the server", proc.returncode)
zctx.term()
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
