#!/usr/bin/env bash
# tests/cli_cluster_failover: a hung instance under load, through
# scripts/cluster.sh's HAProxy (3 `kvlm serve` of stories260K, no Redis,
# --keepalive 1: the instances send keep-alive bytes every second and HAProxy's
# "timeout server" is 3 s; docs/cluster.md, "When an instance hangs"):
#  - healthy requests longer than "timeout server" are not cut: two whole
#    answers of 4-16 s (whitespace before their JSON; sized from the speed
#    measured, and made longer if they were not longer than timeout server +
#    1 s) and a stream queued behind them (": keep-alive" comments until its
#    first token), all answered whole by their own instance, the stream's
#    text equal to one plain instance's;
#  - one instance stopped (SIGSTOP, then every thread of it seen stopped)
#    while it holds 13 requests, streamed and whole, long and short, one body
#    bigger than HAProxy's buffer: every one ends within the bound the docs
#    state (timeout server after the stop, after it was sent or after its
#    last byte, plus its own time elsewhere, plus 2.5 s of slack): those
#    whose answer had begun are cut, those that had received nothing (sent to
#    it within the keep-alive interval before the stop, or after it) are sent
#    again to another instance and answer exactly as one plain instance, the
#    one too big to be kept for a retry gets HAProxy's 504;
#  - the stopped instance is marked down within 5 s (HAProxy's stats socket),
#    its sessions then go elsewhere at once; SIGCONT: up again within 4 s and
#    serving its sessions;
#  - scripts/cluster.sh status --dir DIR (no --port) checks the cluster's own port.
# Bounded (240 s; 17-35 s on 2 busy cores); every process started is stopped.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
here=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
for t in haproxy curl; do
  command -v $t >/dev/null || { echo "SKIP: $t not installed (scripts/setup.sh installs it)"; exit 77; }
done
exec timeout 240 python3 - "$KVLM" "$MODEL" "$here/scripts/cluster.sh" <<'PY'
import http.client, json, os, random, re, shutil, signal, socket, subprocess, sys, tempfile, threading, time

kvlm, model, launcher = sys.argv[1:4]
K, TS = 1.0, 3.0     # keep-alive interval; HAProxy's timeout server (3 K)
SLACK = 2.5          # for a loaded machine: timers, scheduling
DOWN_MAX, UP_MAX = 5.0, 4.0
failures = 0
tmp = tempfile.mkdtemp(prefix="kvlm-failover-")
run = os.path.join(tmp, "run")
T0 = time.time()

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)[:1500]), flush=True)
    failures += not cond

def ports_free(ports):
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            socks.append(s)
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()

rng = random.Random(os.getpid())
while True: # below the ephemeral range (see tests/cli_cluster.sh)
    base = rng.randrange(20000, 22600)
    if ports_free([base + i for i in range(4)]):
        break
LB = base
# two sequences at a time, so requests wait in an instance's queue; sinks
# eviction, so a request may run to any max_tokens (a long answer from a small model)
SERVE = ["-c", "256", "-t", "1", "--max-seqs", "2", "--kv-evict", "sinks", "--kv-budget", "128"]

def launcher_run(*args, timeout=120):
    r = subprocess.run(["bash", launcher] + list(args), capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr

def sse_text(raw):
    """(text, ended with [DONE], keep-alive comments) of an SSE body"""
    text, done = "", False
    for l in raw.decode("utf-8", "replace").split("\n"):
        if l == "data: [DONE]":
            done = True
        elif l.startswith("data: "):
            j = json.loads(l[6:])
            if j.get("choices"):
                text += j["choices"][0]["text"]
    return text, done, raw.count(b": keep-alive\n\n")

def call(rec, port, body, session=None, pad=0):
    """One request; rec gets t_send, t_head, status, server, raw, outcome (complete, cut: the answer began and
    did not end, exc ...: none came), t_end."""
    rec["t_send"] = time.time()
    h = {"Content-Type": "application/json"}
    if session:
        h["X-Session-Id"] = session
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body).encode() + b" " * pad, headers=h)
        r = c.getresponse()
        rec.update(t_head=time.time(), status=r.status, server=r.getheader("X-Kvlm-Server"))
        if body.get("stream") and r.status == 200:
            raw = b""
            while True:
                try:
                    d = r.read1(65536)
                except http.client.IncompleteRead as e:
                    d = b""
                if not d:
                    break
                raw += d
                rec["t_last_data"] = time.time() # what was on its way is read after its server hung
                if "t_first_data" not in rec and b"data: " in raw:
                    rec["t_first_data"] = time.time()
            rec.update(raw=raw, outcome="complete" if raw.endswith(b"data: [DONE]\n\n") else "cut")
        else:
            rec.update(raw=r.read(), outcome="complete")
    except http.client.IncompleteRead:
        rec["outcome"] = "cut"
    except Exception as e:
        rec["outcome"] = "exc " + type(e).__name__
    finally:
        rec["t_end"] = time.time()
        c.close()

def text_of(rec):
    if rec.get("outcome") != "complete" or rec.get("status") != 200:
        return None
    if b"data: " in rec["raw"][:64] or rec["raw"].startswith(b":"):
        t, done, _ = sse_text(rec["raw"])
        return t if done else None
    return json.loads(rec["raw"])["choices"][0]["text"]

def stats():
    """{server: status} from HAProxy's stats socket"""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(os.path.join(run, "haproxy.sock"))
    s.sendall(b"show stat\n")
    d = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        d += c
    s.close()
    out = {}
    for l in d.decode().splitlines()[1:]:
        f = l.split(",")
        if len(f) > 17 and f[0] == "kvlm" and f[1] not in ("FRONTEND", "BACKEND"):
            out[f[1]] = f[17]
    return out

words = "the cat dog ran sun big red ball tree happy girl boy park played jumped saw little bird sky blue".split()
def text(n, seed):
    r = random.Random(seed)
    return " ".join(r.choice(words) for _ in range(n))
prompts = [text(12 + i, 500 + i) for i in range(14)]
SHORT = 32

plain = None
try:
    # ---- one plain instance: the speed here, reference answers ----
    plain = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0"] + SERVE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", plain.stdout.readline())
    assert m, "the plain instance did not start"
    pp = int(m.group(1))
    rec = {}
    call(rec, pp, {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0})
    rate = 1500 / max(rec["t_end"] - rec["t_send"], 1e-3)
    N_LONG = int(min(max(rate * 4, 1000), 500000))  # about 4 s alone; two at once on one instance take longer
    ref = {}
    for p in prompts:
        rec = {}
        call(rec, pp, {"prompt": p, "max_tokens": SHORT, "temperature": 0})
        ref[p] = text_of(rec)
    assert all(ref.values()), "no reference answers"
    plain.send_signal(signal.SIGTERM)
    plain.wait(timeout=30)
    print("reference answers (%.1f s); %.0f tokens/s here: long answers of %d tokens" % (time.time() - T0, rate, N_LONG),
          flush=True)

    # ---- the cluster ----
    rc, out = launcher_run("start", "--dir", run, "--port", str(base), "--redis", "0", "--keepalive", str(K),
                           "--model", model, "--kvlm-bin", kvlm, "--", *SERVE)
    check(rc == 0, "scripts/cluster.sh start: 3 kvlm, HAProxy, keep-alive every 1 s", out)
    if rc != 0:
        raise SystemExit(1)
    cfg = open(os.path.join(run, "haproxy.cfg")).read()
    check(re.search(r"^\s*timeout server 3000ms$", cfg, re.M) and "response-timeout" in cfg,
          "haproxy.cfg: timeout server 3 s (3 K), retry-on response-timeout")
    rc, out = launcher_run("status", "--dir", run)
    check(rc == 0 and ("balancer: http://127.0.0.1:%d up" % base) in out and out.count(" UP ") == 3,
          "scripts/cluster.sh status --dir DIR: the cluster's own port, its 3 servers UP", out)
    pids = dict(l.split() for l in open(os.path.join(run, "pids")))

    # sessions of each instance (consistent hashing of X-Session-Id)
    sessions = {"k1": [], "k2": [], "k3": []}
    for i in range(400):
        rec = {}
        call(rec, LB, {"prompt": "hi", "max_tokens": 1}, "s%d" % i)
        if rec.get("server") in sessions:
            sessions[rec["server"]].append("s%d" % i)
        if len(sessions["k1"]) >= 16 and len(sessions["k2"]) >= 2:
            break
    check(len(sessions["k1"]) >= 16 and len(sessions["k2"]) >= 2, "sessions that hash to k1 and k2",
          {k: len(v) for k, v in sessions.items()})

    # ---- healthy requests longer than timeout server: not cut ----
    home = "k2"
    for attempt in range(3): # the speed measured alone may be off under load: longer until they are long enough
        long_body = {"prompt": "Once upon a time", "max_tokens": N_LONG, "temperature": 0}
        recs = [{}, {}, {}]
        ths = [threading.Thread(target=call, args=(recs[0], LB, long_body, sessions[home][0])),
               threading.Thread(target=call, args=(recs[1], LB, long_body, sessions[home][1]))]
        for t in ths:
            t.start()
        time.sleep(0.3) # the two long ones hold the instance's 2 sequences: the stream waits behind them
        ths.append(threading.Thread(target=call, args=(recs[2], LB, {"prompt": prompts[0], "max_tokens": SHORT,
                                                                  "temperature": 0, "stream": True}, sessions[home][0])))
        ths[-1].start()
        for t in ths:
            t.join(120)
        l1, l2, st = recs
        durs = [r["t_end"] - r["t_send"] for r in (l1, l2)]
        wait = st.get("t_first_data", st["t_end"]) - st["t_send"]
        print("long whole answers of %d tokens: %.1f and %.1f s; the stream behind them: first token after %.1f s, "
              "%d keep-alive comments" % (N_LONG, durs[0], durs[1], wait, sse_text(st.get("raw", b""))[2]), flush=True)
        fast = min(durs) <= TS + 1 or wait <= TS + 1
        # about 6 s for two at once on one instance, here (the stop below comes 2 s after two begin)
        N_LONG = int(min(max(N_LONG * 6 / max(min(durs), 0.1), 1000), 2000000))
        if not fast or attempt == 2 or any(r.get("outcome") != "complete" for r in recs):
            break
    for name, r in (("first", l1), ("second", l2)):
        j = json.loads(r["raw"]) if r.get("outcome") == "complete" and r.get("status") == 200 else {}
        check(j.get("usage", {}).get("completion_tokens") == long_body["max_tokens"] and r["server"] == home and
              r["raw"].startswith(b"\n"), "the %s long whole answer: whole, from its own instance, whitespace first" % name,
              (r.get("status"), r.get("outcome"), r.get("server"), r.get("raw", b"")[:120]))
    check(min(durs) > TS + 1, "... and both took longer than timeout server + 1 s (else this shows nothing)", durs)
    check(text_of(st) == ref[prompts[0]] and st["server"] == home and sse_text(st["raw"])[2] >= 2,
          "the stream queued behind them: keep-alive comments, then the same text as one plain instance",
          (st.get("outcome"), st.get("server"), st.get("raw", b"")[:200]))
    check(wait > TS + 1, "... and it waited longer than timeout server + 1 s for its first token", wait)

    # ---- one instance stopped while it holds requests ----
    victim = "k1"
    vs = iter(sessions[victim])
    vpid = int(pids["kvlm-%d" % (base + 1)])
    reqs, ths = [], []
    def go(name, body, pad=0):
        r = {"name": name, "ref": ref.get(body["prompt"]) if body["max_tokens"] == SHORT else None}
        reqs.append(r)
        t = threading.Thread(target=call, args=(r, LB, body, next(vs), pad))
        ths.append(t)
        t.start()
        return r
    states, stop_poll = [], threading.Event()
    def poll():
        while not stop_poll.is_set():
            try:
                states.append((time.time(), stats()))
            except OSError:
                pass
            time.sleep(0.05)
    poller = threading.Thread(target=poll)
    poller.start()
    long_body = {"prompt": "Once upon a time", "max_tokens": N_LONG, "temperature": 0}
    t_long = time.time()
    go("long stream", dict(long_body, stream=True))
    go("long whole", long_body)
    time.sleep(K + 0.7) # the long whole answer has had its first keep-alive byte (at K)
    for i in range(4): # queued behind the long ones, not a byte sent yet
        go("whole, sent 0.3 s before the stop", {"prompt": prompts[1 + i], "max_tokens": SHORT, "temperature": 0})
    go("stream, sent 0.3 s before the stop", {"prompt": prompts[5], "max_tokens": SHORT, "temperature": 0, "stream": True})
    time.sleep(0.3)
    os.kill(vpid, signal.SIGSTOP)
    t_stop = time.time()
    def all_stopped(pid): # every thread in state T (a signal's stop is not instant on a loaded machine)
        try:
            return all(open("/proc/%d/task/%s/stat" % (pid, t)).read().rsplit(")", 1)[1].split()[0] == "T"
                       for t in os.listdir("/proc/%d/task" % pid))
        except OSError:
            return False
    while not all_stopped(vpid) and time.time() < t_stop + 5:
        time.sleep(0.001)
    stop_lag = time.time() - t_stop
    for i in range(3):
        go("whole, sent after the stop", {"prompt": prompts[6 + i], "max_tokens": SHORT, "temperature": 0})
    go("stream, sent after the stop", {"prompt": prompts[9], "max_tokens": SHORT, "temperature": 0, "stream": True})
    go("whole, a 40 KB body, after the stop", {"prompt": prompts[10], "max_tokens": SHORT, "temperature": 0}, pad=40000)
    go("whole, a 100 KB body, after the stop", {"prompt": prompts[11], "max_tokens": SHORT, "temperature": 0}, pad=100000)
    # 15 s from the stop, or longer for a stream still draining what was on its way (its client reads slower
    # than the server wrote: a loaded machine), until nothing has come for timeout server + slack; 60 s at most
    quiet = lambda r: time.time() - max(t_stop, r.get("t_last_data", 0)) > TS + SLACK
    while time.time() < t_stop + 60 and any(t.is_alive() for t in ths):
        if time.time() >= t_stop + 15 and all(quiet(r) for r, t in zip(reqs, ths) if t.is_alive()):
            break
        time.sleep(0.05)
    stuck = [r["name"] for r, t in zip(reqs, ths) if t.is_alive()]
    check(not stuck, "every request in flight on the stopped instance ended within 15 s of the stop "
          "(or of its last byte)", stuck)
    # the balancer: down, then its sessions elsewhere at once
    t_down = next((t for t, s in states if t >= t_stop and s.get(victim, "").startswith("DOWN")), None)
    if t_down is None:
        while time.time() < t_stop + DOWN_MAX + 1 and t_down is None:
            time.sleep(0.1)
            t_down = next((t for t, s in states if t >= t_stop and s.get(victim, "").startswith("DOWN")), None)
    after = []
    for i in range(3):
        r = {}
        call(r, LB, {"prompt": prompts[12], "max_tokens": SHORT, "temperature": 0}, sessions[victim][i])
        after.append(r)
    os.kill(vpid, signal.SIGCONT)
    t_cont = time.time()
    for t in ths:
        t.join(60)
    t_up = None
    while time.time() < t_cont + UP_MAX + 2 and t_up is None:
        time.sleep(0.05)
        t_up = next((t for t, s in states if t >= t_cont and s.get(victim, "").startswith("UP")), None)
    back = {}
    if t_up:
        call(back, LB, {"prompt": prompts[13], "max_tokens": SHORT, "temperature": 0}, sessions[victim][0])
    stop_poll.set()
    poller.join()

    print("SIGSTOP %.1f s after the long requests began (all its threads stopped %.3f s after the signal); each request, "
          "times from the stop:" % (t_stop - t_long, stop_lag), flush=True)
    at = lambda r, k: "%+5.2f" % (r[k] - t_stop) if r.get(k) else "  -  "
    for r in reqs:
        print("  %-38s sent %s  head %s  last byte %s  ended %s  %s %s from %s" % (
            r["name"], at(r, "t_send"), at(r, "t_head"), at(r, "t_last_data"), at(r, "t_end"), r.get("status", "-"),
            r.get("outcome"), r.get("server")), flush=True)
    print("%s DOWN %s after the stop; UP %s after SIGCONT" % (
        victim, "%.2f s" % (t_down - t_stop) if t_down else "never", "%.2f s" % (t_up - t_cont) if t_up else "never"),
        flush=True)
    # from the stop, from when it was sent, or (a stream whose client reads slower than it is written) from
    # the last byte that was on its way when the instance stopped, whichever is last
    since = lambda r: max(r["t_send"], t_stop, r.get("t_last_data", 0))
    late = [(r["name"], round(r["t_end"] - since(r), 2)) for r in reqs if r["t_end"] - since(r) > TS + SLACK]
    check(not late, "every one ended within timeout server (3 s) + 2.5 s of the stop, its sending or its last byte", late)
    for r in reqs:
        # what the docs say: an answer that had begun is cut; one that had not is sent again elsewhere;
        # one too big for HAProxy's buffer is not kept for a retry: 504
        big = "100 KB" in r["name"]
        begun = r["name"].startswith("long") or r["name"].startswith("stream, sent 0.3")
        cut = r.get("status") == 200 and r.get("server") == victim and r.get("outcome") == "cut" and r["t_end"] > t_stop
        retried = r.get("status") == 200 and r.get("server") not in (None, victim) and text_of(r) == r["ref"]
        if big:
            ok, want = r.get("status") == 504 and r.get("server") is None, "HAProxy's 504, not retried"
        elif begun:
            ok, want = cut, "its answer had begun: cut"
        elif r["t_send"] < t_stop - (K - 0.2):
            # queued, sent "0.3 s" before the stop but, on a loaded machine, nearly K before: its first
            # keep-alive byte may have begun its answer
            ok, want = retried or cut, "sent again elsewhere (the same answer), or cut if its answer had begun"
        else: # less than K old at the stop, or sent after it: nothing of it can have been sent
            ok, want = retried, "nothing received: sent again elsewhere, the same answer as one plain instance"
        check(ok, "%s: %s" % (r["name"], want), {k: r.get(k) for k in ("status", "outcome", "server")})
    check(t_down is not None and t_down - t_stop <= DOWN_MAX, "the stopped instance is marked DOWN within %g s" % DOWN_MAX,
          t_down and t_down - t_stop)
    check(all(r.get("status") == 200 and r.get("server") != victim and text_of(r) == ref[prompts[12]] and
              r["t_end"] - r["t_send"] < 2 for r in after),
          "once it is down its sessions are answered elsewhere at once, right",
          [(r.get("status"), r.get("server"), round(r["t_end"] - r["t_send"], 2)) for r in after])
    check(t_up is not None and t_up - t_cont <= UP_MAX, "SIGCONT: UP again within %g s" % UP_MAX, t_up and t_up - t_cont)
    check(back.get("server") == victim and text_of(back) == ref[prompts[13]],
          "and its sessions come back to it, answered right", {k: back.get(k) for k in ("status", "outcome", "server")})
    log = open(os.path.join(run, "haproxy.log"), errors="replace").read()
    retried = len(re.findall(r" \d+/\d+/\d+/\d+/\+\d+ \d+/\d+ \"POST", log))
    check(retried >= 9 and re.search(r"kvlm/k1 .* 504 .* sH-- ", log), "HAProxy's log: the retries (+1) and the 504 (sH--)",
          retried)
finally:
    if plain and plain.poll() is None:
        plain.kill()
        plain.wait()
    if os.path.exists(os.path.join(run, "pids")):
        for l in open(os.path.join(run, "pids")):
            try:
                os.kill(int(l.split()[1]), signal.SIGCONT)
            except (OSError, ValueError):
                pass
    t0 = time.time()
    rc, out = launcher_run("stop", "--dir", run, timeout=90)
    check(rc == 0 and not os.path.exists(os.path.join(run, "pids")), "scripts/cluster.sh stop (%.1f s)" % (time.time() - t0), out)
    shutil.rmtree(tmp, ignore_errors=True)
print("total %.1f s" % (time.time() - T0))
sys.exit(1 if failures else 0)
PY
