#!/usr/bin/env bash
# tests/cli_soak: `kvlm serve` under a bounded soak with faults (loopback only,
# python3 stdlib and redis-server). For KVLM_SOAK_SECONDS (default 60; 30 in
# the sanitizer build; 1800 for the long local run) eight clients send mixed
# requests, completions and chat, streamed and whole, with random hang-ups
# (mid-stream, before a whole answer) and half-closes, while a ninth keeps
# stalled connections open (half a header, half a body). The server runs with
# a KV pool small enough to preempt, a host tier, a disk tier on a 1.5 MB tmpfs
# (full: writes fail with ENOSPC; a size-capped folder where tmpfs cannot be
# mounted) and a Redis tier whose server is killed (SIGKILL), restarted, and
# frozen (SIGSTOP) for a while. The blocks are signed (--kv-key) and, beside
# the load, a forger rewrites block files and Redis values with other
# payloads sealed under a guessed key, and a planter puts FIFOs and symbolic
# links at blocks' names in the disk folder. Checked: every answered request equals its
# reference (computed one at a time before the load); RSS stays within 5% over
# the calm second half of the run, after the faults (Release build); every KV
# block and swap slot comes back; the
# server's figures add up against the clients' (requests, finish reasons,
# tokens, errors); the server stops cleanly.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
if ! command -v redis-server >/dev/null; then echo "SKIP: redis-server not found (scripts/setup.sh installs it)"; exit 77; fi
if [ -n "${KVLM_TEST_QUICK:-}" ]; then SECS=${KVLM_SOAK_SECONDS:-30}; else SECS=${KVLM_SOAK_SECONDS:-60}; fi
exec timeout $((SECS + 180)) python3 - "$KVLM" "$MODEL" "$SECS" <<'PY'
import hashlib, hmac, json, os, random, re, shutil, signal, socket, subprocess, sys, tempfile, threading, time

kvlm, model, SECS = sys.argv[1], sys.argv[2], float(sys.argv[3])
quick = bool(os.environ.get("KVLM_TEST_QUICK"))
failures = 0
def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[:600]), flush=True)
    failures += not cond

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

tmp = tempfile.mkdtemp(prefix="kvlm-soak-")
disk = os.path.join(tmp, "disk"); os.mkdir(disk)
mounted = False
if os.geteuid() == 0:
    mounted = subprocess.call(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", disk],
                              stderr=subprocess.DEVNULL) == 0
print("disk tier: %s" % ("a 1.5 MB tmpfs (full: writes fail with ENOSPC)" if mounted else
                         "a folder capped at 1.5 MB (tmpfs cannot be mounted here: no ENOSPC)"), flush=True)

rport = free_port()
def start_redis():
    return subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
def redis_up():
    try:
        s = socket.create_connection(("127.0.0.1", rport), timeout=0.5); s.sendall(b"PING\r\n")
        ok = s.recv(16).startswith(b"+PONG"); s.close(); return ok
    except OSError:
        return False
redis = start_redis()
t0 = time.time()
while not redis_up() and time.time() - t0 < 10: time.sleep(0.05)

keyfile = os.path.join(tmp, "kv.key")
with open(keyfile, "w") as f: f.write("soak-secret-%010d\n" % os.getpid())  # 22 bytes whatever the pid (16 at least)
os.chmod(keyfile, 0o600)
# a pool of 48 blocks of 16 tokens for up to 8 sequences of up to ~200 tokens: preemption
args = [kvlm, "serve", "-m", model, "--port", "0", "-c", "512", "-t", "1", "--max-seqs", "8", "--kv-key", keyfile,
        "--kv-mem", str(48 * 10240), "--kv-host-size", "1MiB", "--kv-disk", disk,
        "--kv-disk-size", "64MiB" if mounted else "1536KiB", "--kv-redis", "redis://127.0.0.1:%d" % rport,
        "--header-timeout", "3", "--body-timeout", "3", "--timeout", "20"]
proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "server.log"), "w"), text=True)
line = proc.stdout.readline()
m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", line)
if not m:
    print("FAIL: no listening line: %r" % line); print(open(os.path.join(tmp, "server.log")).read()[-2000:])
    proc.kill(); redis.kill(); sys.exit(1)
port = int(m.group(1))

# ---- a small HTTP/1.1 client on raw sockets (hang-ups and half-closes need the socket)
class Resp:
    def __init__(self): self.status, self.headers, self.body = None, {}, b""

def read_response(f, on_event=None):
    """Status (1xx skipped), headers, body (Content-Length or chunked). on_event(n) is called
    after each SSE event of a stream; it returns False to hang up (the response is then None)."""
    r = Resp()
    while True:
        st = f.readline()
        if not st: raise OSError("closed before the status line")
        r.status = int(st.split()[1])
        hdrs = {}
        while True:
            h = f.readline()
            if h in (b"\r\n", b""): break
            k, v = h.decode().split(":", 1); hdrs[k.strip().lower()] = v.strip()
        if r.status >= 200: break
    r.headers = hdrs
    if hdrs.get("transfer-encoding") == "chunked":
        events = 0
        while True:
            n = int(f.readline().strip(), 16)
            if n == 0: f.readline(); break
            chunk = f.read(n); f.readline(); r.body += chunk
            if on_event is not None:
                events += chunk.count(b"\n\ndata: ") + chunk.startswith(b"data: ")
                if not on_event(events): return None
    else:
        r.body = f.read(int(hdrs.get("content-length", "0")))
    return r

def request(path, body, half_close=False, hang=None, timeout=60):
    """hang: None, ("events", k) to close after k SSE events, ("delay", s) to close after s seconds."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        if half_close: s.shutdown(socket.SHUT_WR)
        if hang and hang[0] == "delay":
            time.sleep(hang[1]); return None
        f = s.makefile("rb")
        on_event = (lambda n: n < hang[1]) if hang else None
        return read_response(f, on_event)
    finally:
        s.close()

def get(path):
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
        return read_response(s.makefile("rb"))
    finally:
        s.close()

def status(): return json.loads(get("/kvlm/status").body)

def metrics():
    out = {}
    for l in get("/metrics").body.decode().splitlines():
        if l.startswith("#") or not l.strip(): continue
        k, v = l.rsplit(" ", 1); out[k] = float(v)
    return out

def settled_metrics():
    """/metrics once the engine's figures have caught up: the server answers a request
    within an engine step and publishes its counts at the step's end, so a read right
    after an answer can miss it. Two reads 0.3 s apart with nothing running, equal."""
    prev = None
    for _ in range(50):
        cur = metrics()
        if prev is not None and cur.get("kvlm_requests_running") == 0 and cur.get("kvlm_requests_waiting") == 0 \
                and cur.get("kvlm_requests_total") == prev.get("kvlm_requests_total"):
            return cur
        prev = cur
        time.sleep(0.3)
    return cur

def answer(path, r):
    """(text, finish_reason, completion_tokens) of a whole or streamed answer."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        text, fin, toks, done = "", None, None, False
        for l in r.body.split(b"\n"):
            if not l.startswith(b"data: "): continue
            if l == b"data: [DONE]": done = True; continue
            o = json.loads(l[6:])
            if "error" in o: return ("ERROR " + o["error"]["message"], None, None)
            if o.get("usage"): toks = o["usage"]["completion_tokens"]
            for c in o["choices"]:
                text += c["delta"].get("content", "") if "delta" in c else c["text"]
                fin = c["finish_reason"] or fin
        return (text, fin, toks) if done else ("NO [DONE]", None, None)
    o = json.loads(r.body)
    c = o["choices"][0]
    return (c["message"]["content"] if "message" in c else c["text"], c["finish_reason"], o["usage"]["completion_tokens"])

# ---- references, one request at a time before the load
stems = ["Once upon a time, there was a little girl named Lily. She loved to",
         "Once upon a time, there was a little boy named Tim. He had a big red",
         "One day, a cat and a dog went to the park. The cat",
         "Tom and Sue found a box in the garden. Inside the box"]
combos = []
for i, stem in enumerate(stems):
    for tail in ("", " and then"):
        for mt in (24, 120):
            combos.append(("/v1/completions", {"prompt": stem + tail, "max_tokens": mt, "temperature": 0}))
        combos.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": stem + tail}],
                                                "max_tokens": 80, "temperature": 0}))
# prompts of their own (150-250 words): blocks no other prompt shares, more than the
# host tier and the disk's filesystem hold
words = ("the a little big red blue dog cat girl boy tree park ball sun moon happy sad ran jumped saw "
         "played with and then she he it was very good friend mom dad toy box car bird fish").split()
wr = random.Random(7)
for i in range(40):
    combos.append(("/v1/completions", {"prompt": " ".join(wr.choice(words) for _ in range(wr.randint(150, 250))),
                                       "max_tokens": 16, "temperature": 0}))
refs = {}
for k, (path, body) in enumerate(combos):
    r = request(path, body)
    refs[k] = answer(path, r) if r and r.status == 200 else None
check(all(refs.values()), "%d references answered" % len(refs), refs)
m_ref = settled_metrics()

# ---- the load
deadline = time.time() + SECS
lock = threading.Lock()
tally = {"ok": 0, "half_ok": 0, "hung": 0, "bad": 0, "http_err": 0, "tokens": 0, "max_hung_tokens": 0}
bad_examples = []

def worker(seed):
    rng = random.Random(seed)
    while time.time() < deadline:
        k = rng.randrange(len(combos)); path, body = combos[k]
        body = dict(body); stream = rng.random() < 0.5
        if stream: body["stream"] = True; body["stream_options"] = {"include_usage": True}
        x = rng.random()
        hang = half = None
        if x < 0.15: hang = ("events", rng.randint(1, 8)) if stream else ("delay", rng.uniform(0.02, 0.3))
        elif x < 0.25: half = True
        try:
            r = request(path, body, half_close=bool(half), hang=hang)
        except OSError as e:
            with lock: tally["bad"] += 1; bad_examples.append(("oserror", k, str(e), "stream" if stream else "whole", "half" if half else hang))
            continue
        with lock:
            if hang and r is None:
                tally["hung"] += 1; tally["max_hung_tokens"] += body["max_tokens"]; continue
            if r is None or r.status != 200:
                tally["http_err"] += 1; bad_examples.append(("status", k, r and r.status, r and r.body[:200])); continue
            got = answer(path, r)
            if got != refs[k]:
                tally["bad"] += 1; bad_examples.append(("differs", k, got, refs[k])); continue
            tally["half_ok" if half else "ok"] += 1; tally["tokens"] += got[2]

stalls = {"opened": 0, "closed_by_server": 0}
def staller():
    conns = []
    rng = random.Random(99)
    while time.time() < deadline:
        while len(conns) < 24:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if rng.random() < 0.5: s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
                else: s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 400\r\n\r\n{\"prompt\": \"Once")
                s.setblocking(False); conns.append(s); stalls["opened"] += 1
            except OSError:
                break
        time.sleep(0.2)
        for s in conns[:]:
            try:
                d = s.recv(4096)
                if d == b"" or d: stalls["closed_by_server"] += 1; s.close(); conns.remove(s)
            except BlockingIOError:
                pass
            except OSError:
                stalls["closed_by_server"] += 1; s.close(); conns.remove(s)
    for s in conns: s.close()

rss = []
def rss_kb():
    with open("/proc/%d/status" % proc.pid) as f:
        for l in f:
            if l.startswith("VmRSS:"): return int(l.split()[1])
def sampler():
    while time.time() < deadline:
        rss.append((time.time(), rss_kb())); time.sleep(0.5)

faults = []
def fault_injector():
    global redis
    # in the first half: a stopped Redis lets its tier's write queue fill (up
    # to 4096 blocks, by design), and the heap keeps that high-water mark, so
    # the RSS check looks at the second half, where only a leak would grow it
    plan = [(0.10, "kill"), (0.20, "restart"), (0.28, "stop"), (0.36, "cont")]
    start = time.time()
    for frac, what in plan:
        while time.time() < start + frac * SECS: time.sleep(0.05)
        if what == "kill": redis.kill(); redis.wait()
        elif what == "restart": redis = start_redis()
        elif what == "stop": redis.send_signal(signal.SIGSTOP)
        else: redis.send_signal(signal.SIGCONT)
        faults.append((round(time.time() - start, 1), what))

def forged(blob):
    """Another payload, sealed as someone without the key would (HMAC under a guess)."""
    if not blob or len(blob) < 120 or blob[:8] != b"KVLMBLK1": return None
    off, pay = int.from_bytes(blob[12:16], "little"), int.from_bytes(blob[80:88], "little")
    body = bytearray(blob[:off + pay])
    for i in range(off + 1, off + pay, 2): body[i] ^= 0x04
    return bytes(body) + hmac.new(b"a guess", bytes(body), hashlib.sha256).digest()

attacks = {"files_forged": 0, "redis_forged": 0, "fifos": 0, "links": 0}
def block_files():
    return [os.path.join(a, f) for a, _, fs in os.walk(disk) for f in fs if f.endswith(".kvb")]
def forger():
    rng = random.Random(5)
    while time.time() < deadline:
        time.sleep(0.2)
        fs = block_files()
        for path in rng.sample(fs, min(6, len(fs))):
            try:  # (the planter's FIFOs: opened without blocking, as kvlm does)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f: fake = forged(f.read()) if os.path.isfile(path) else None
                if fake:
                    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK)
                    with os.fdopen(fd, "wb") as f: f.write(fake)
                    attacks["files_forged"] += 1
            except OSError:
                pass
        try:  # a few Redis values (the server may be down or frozen: bounded by the timeout)
            r = socket.create_connection(("127.0.0.1", rport), timeout=0.5); rf = r.makefile("rb")
            r.sendall(b"*2\r\n$4\r\nKEYS\r\n$10\r\nkvlm:blk:*\r\n")
            n = int(rf.readline()[1:]); names = []
            for _ in range(n): rf.readline(); names.append(rf.readline()[:-2])
            for name in rng.sample(names, min(3, len(names))):
                r.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
                ln = int(rf.readline()[1:])
                if ln < 0: continue
                fake = forged(rf.read(ln + 2)[:-2])
                if fake:
                    r.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(fake), fake))
                    rf.readline(); attacks["redis_forged"] += 1
            r.close()
        except (OSError, ValueError):
            pass
def planter():
    rng = random.Random(6)
    while time.time() < deadline:
        time.sleep(0.3)
        fs = block_files()
        for path in rng.sample(fs, min(3, len(fs))):
            try:
                os.unlink(path)
                if rng.random() < 0.5: os.mkfifo(path); attacks["fifos"] += 1
                else: os.symlink("/dev/zero", path); attacks["links"] += 1
            except OSError:
                pass

t_start = time.time()
threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
threads += [threading.Thread(target=staller), threading.Thread(target=sampler), threading.Thread(target=fault_injector),
            threading.Thread(target=forger), threading.Thread(target=planter)]
for t in threads: t.start()
for t in threads: t.join(timeout=SECS + 90)
check(not any(t.is_alive() for t in threads), "every client finished (none hung)")
print("soak: %.0f s, %s; stalled connections %s; faults %s; attacks %s" % (time.time() - t_start, tally, stalls,
      faults, attacks), flush=True)

# ---- settle, then the checks
t0 = time.time()
while time.time() - t0 < 10:
    st = status()
    if st["running"] == 0 and st["waiting"] == 0: break
    time.sleep(0.1)
m = settled_metrics()
d = lambda k: m.get(k, 0) - m_ref.get(k, 0)
answered = tally["ok"] + tally["half_ok"]
check(tally["bad"] == 0 and tally["http_err"] == 0, "every answered request equals its reference (%d answered, %d half-closed)"
      % (answered, tally["half_ok"]), bad_examples[:3])
check(answered >= 50 and tally["hung"] >= 5 and tally["half_ok"] >= 5, "the load ran (answers, hang-ups, half-closes)", tally)
check(st["blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0 and st["swap_blocks_used"] == 0
      and st["blocks_free"] + st["blocks_cached"] == st["n_blocks"],
      "every KV block and swap slot back (%d free + %d cached of %d)" % (st["blocks_free"], st["blocks_cached"], st["n_blocks"]), st)
fin = {r: d('kvlm_completions_finished_total{reason="%s"}' % r) for r in ("stop", "length", "cancelled", "error", "kv_cache_full")}
ended_ok = fin["stop"] + fin["length"] + fin["kv_cache_full"]
print("server: %d requests, finished %s, %d generated tokens, %d preemptions (%d swapped, %d recomputed), %d http errors"
      % (d("kvlm_requests_total"), fin, d("kvlm_generated_tokens_total"), d("kvlm_preemptions_total"),
         d("kvlm_swaps_out_total"), d("kvlm_recomputes_total"), d("kvlm_http_errors_total")), flush=True)
check(d("kvlm_requests_total") == answered + tally["hung"], "requests: the server's %d = %d answered + %d hung up"
      % (d("kvlm_requests_total"), answered, tally["hung"]))
check(sum(fin.values()) == d("kvlm_requests_total") and fin["error"] == 0, "finish reasons add up to the requests", fin)
check(answered <= ended_ok <= answered + tally["hung"] and fin["cancelled"] <= tally["hung"],
      "finished whole %d: between the %d answered and those plus the %d hung up; cancelled %d <= hung up"
      % (ended_ok, answered, tally["hung"], fin["cancelled"]))
gen = d("kvlm_generated_tokens_total")
check(tally["tokens"] <= gen <= tally["tokens"] + tally["max_hung_tokens"],
      "generated tokens: the answers' %d <= server's %d <= that plus the hung-up requests' budgets %d"
      % (tally["tokens"], gen, tally["max_hung_tokens"]))
check(d("kvlm_http_errors_total") == tally["http_err"], "http errors: server %d, clients %d"
      % (d("kvlm_http_errors_total"), tally["http_err"]))
check(d("kvlm_preemptions_total") > 0, "the pool preempted (%d)" % d("kvlm_preemptions_total"))
tiers = {}
for k, v in m.items():
    mm = re.fullmatch(r'kvlm_kv_tier_(\w+)\{tier="(\w+)"\}', k)
    if mm: tiers.setdefault(mm.group(2), {})[mm.group(1)] = int(v)
for t in ("host", "disk", "redis"): print("tier %-5s %s" % (t, tiers.get(t)), flush=True)
red, dk = tiers.get("redis", {}), tiers.get("disk", {})
check(red.get("writes_total", 0) > 0 and red.get("dropped_writes_total", 0) + red.get("errors_total", 0) > 0,
      "the Redis tier wrote, and dropped writes while its server was down")
if mounted:
    check(dk.get("errors_total", 0) > 0 and dk.get("writes_total", 0) > 0 and dk.get("hits_total", 0) > 0,
          "the full disk tier met ENOSPC and went on writing and hitting")
# (which attacked blocks are read again depends on the load: the sum, not each)
met = dk.get("corrupt_total", 0) + dk.get("forged_total", 0) + red.get("forged_total", 0)
check(attacks["files_forged"] + attacks["redis_forged"] > 0 and attacks["fifos"] + attacks["links"] > 0 and met > 0,
      "forged blocks and planted FIFOs and links met the tiers, counted, none used (%s; disk corrupt %d, forged %d; "
      "redis forged %d)" % (attacks, dk.get("corrupt_total", 0), dk.get("forged_total", 0), red.get("forged_total", 0)))
# RSS: over the second half of the run (the faults and their queues are behind)
if rss:
    t_w = t_start + SECS / 2
    base = [v for t, v in rss if t >= t_w][:4]
    base = max(base) if base else rss[0][1]
    peak = max(v for t, v in rss if t >= t_w) if any(t >= t_w for t, v in rss) else base
    grow = (peak - base) / base
    print("RSS: %d KiB at half time, peak %d KiB after it (%+.1f%%); first %d KiB" % (base, peak, 100 * grow, rss[0][1]), flush=True)
    if not quick: check(grow <= 0.05, "RSS over the second half within 5%")
check(proc.poll() is None, "server alive")
redis.send_signal(signal.SIGCONT)
proc.terminate()
try:
    rc = proc.wait(30)
except subprocess.TimeoutExpired:
    proc.kill(); rc = None
check(rc == 0, "server stopped cleanly (exit %r)" % rc)
redis.kill(); redis.wait()
if failures: print(open(os.path.join(tmp, "server.log")).read()[-3000:])
if mounted: subprocess.call(["umount", disk])
shutil.rmtree(tmp, ignore_errors=True)
print("%d FAILURES" % failures if failures else "all checks passed")
sys.exit(1 if failures else 0)
PY
