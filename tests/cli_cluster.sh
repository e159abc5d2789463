#!/usr/bin/env bash
# tests/cli_cluster: kvlm as a cluster on loopback, started by
# scripts/cluster.sh: 3 `kvlm serve` instances sharing a 3-master Redis
# Cluster as their KV tier, HAProxy in front (X-Session-Id affinity by
# consistent hashing, /health checks, retries on another instance):
#  - a conversation of several turns with one X-Session-Id stays on one
#    instance, gets prefix hits (cached_tokens > 0) from turn 2, and answers
#    exactly as a single plain instance (temperature 0);
#  - a long prompt sent under a session pinned to another instance gets
#    cached tokens from the shared Redis tier, same answer;
#  - an instance killed (-9) under load: every request completes or fails
#    fast (bounded), the balancer routes around it; the conversation goes on
#    elsewhere with hits from Redis and the same answers;
#  - a Redis node killed: requests still complete with the same answers.
# Bounded in time (the whole test under 240 s; about 20 s on 2 idle cores);
# every process started is stopped.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
here=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
for t in haproxy redis-server redis-cli curl; do
  command -v $t >/dev/null || { echo "SKIP: $t not installed (scripts/setup.sh installs it)"; exit 77; }
done
exec timeout 240 python3 - "$KVLM" "$MODEL" "$here/scripts/cluster.sh" <<'PY'
import http.client, json, os, random, re, shutil, signal, socket, subprocess, sys, tempfile, threading, time

kvlm, model, launcher = sys.argv[1:4]
failures = 0
tmp = tempfile.mkdtemp(prefix="kvlm-cluster-")
run = os.path.join(tmp, "run")
T0 = time.time()

def check(cond, name, detail=""):
    global failures
    if cond:
        print("ok   " + name, flush=True)
    else:
        failures += 1
        print("FAIL %s %s" % (name, detail), flush=True)

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
# the balancer, 3 instances, 3 Redis nodes and their cluster bus ports, all
# below the kernel's ephemeral range (32768 and up by default): a port there
# can be taken between this check and the servers' start by any process's
# outgoing connection or port-0 listener (the other tests make many), which
# once kept a Redis node of an ASan run from starting
while True:
    base = rng.randrange(20000, 22600)
    if ports_free([base + i for i in range(4)] + [base + 100 + i for i in (1, 2, 3)] + [base + 10100 + i for i in (1, 2, 3)]):
        break
SERVE = ["-c", "512", "-t", "1", "--max-seqs", "4"]

def launcher_run(*args, timeout=120):
    r = subprocess.run(["bash", launcher] + list(args), capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr

def request(port, body, session=None, timeout=30):
    h = {"Content-Type": "application/json"}
    if session:
        h["X-Session-Id"] = session
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=h)
        r = c.getresponse()
        text = r.read().decode()
        return r.status, json.loads(text) if r.status == 200 else text, r.getheader("X-Kvlm-Server")
    finally:
        c.close()

def complete(port, prompt, session=None, n=24):
    st, j, srv = request(port, {"prompt": prompt, "max_tokens": n, "temperature": 0}, session)
    assert st == 200, (st, j)
    return j["choices"][0]["text"], j["usage"]["prompt_tokens_details"]["cached_tokens"], srv

def status(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/kvlm/status")
    j = json.loads(c.getresponse().read().decode())
    c.close()
    return j

def redis_tier(port):
    for t in status(port).get("tiers", []):
        if t["name"] == "redis":
            return t
    return None

LB = base
inst = {"k%d" % i: base + i for i in (1, 2, 3)}
words = "the cat dog ran sun big red ball tree happy girl boy park played jumped saw little bird sky blue".split()
def text(n, seed):
    r = random.Random(seed)
    return " ".join(r.choice(words) for _ in range(n))
turns = [text(60, 1)] + [" " + text(25, 10 + k) for k in range(4)]
long_prompt = text(150, 99)
load_prompts = [text(40 + 3 * i, 200 + i) for i in range(12)]
LOAD_TOKENS = 160   # long enough that the kill finds requests in flight
redis_prompts = [text(90, 300 + i) for i in range(4)]

plain = None
try:
    # ---- reference answers: one plain instance, no tier ----
    plain = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0"] + SERVE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", plain.stdout.readline())
    assert m, "the plain instance did not start"
    pp = int(m.group(1))
    ref_turns, prompt = [], ""
    for t in turns:
        prompt += t
        ans = complete(pp, prompt)[0]
        ref_turns.append(ans)
        prompt += ans
    ref_long = complete(pp, long_prompt)[0]
    after_prompt = "".join(t + a for t, a in list(zip(turns, ref_turns))[:3]) + " " + text(10, 77)
    ref_after = complete(pp, after_prompt)[0]
    ref_load = {p: complete(pp, p, n=LOAD_TOKENS)[0] for p in load_prompts}
    ref_redis = {p: complete(pp, p)[0] for p in redis_prompts}
    plain.send_signal(signal.SIGTERM)
    plain.wait(timeout=30)
    print("reference answers from one plain instance (%.1f s)" % (time.time() - T0), flush=True)

    # ---- the cluster ----
    rc, out = launcher_run("start", "--dir", run, "--port", str(base), "--model", model, "--kvlm-bin", kvlm, "--", *SERVE)
    check(rc == 0, "scripts/cluster.sh start: 3 Redis masters, 3 kvlm, HAProxy", out)
    if rc != 0:
        raise SystemExit(1)
    rc, out = launcher_run("status", "--dir", run, "--port", str(base))
    check(rc == 0 and out.count(": up") == 7, "scripts/cluster.sh status: 7 processes up", out)
    url = open(os.path.join(run, "redis-url")).read().strip()
    check(url.startswith("redis-cluster://"), "the instances use the Redis Cluster tier", url)
    print("cluster up (%.1f s): balancer :%d, instances %s, %s" % (time.time() - T0, LB, inst, url), flush=True)

    # ---- a conversation through the balancer ----
    prompt, servers, cached, same = "", [], [], True
    for k, t in enumerate(turns):
        prompt += t
        ans, c, srv = complete(LB, prompt, session="alice")
        servers.append(srv)
        cached.append(c)
        same = same and ans == ref_turns[k]
        prompt += ans
    print("conversation 'alice': served by %s, cached_tokens per turn %s" % (servers, cached), flush=True)
    check(len(set(servers)) == 1 and servers[0] in inst, "every turn of one session lands on one instance", servers)
    check(all(c > 0 for c in cached[1:]), "turns 2.. get prefix hits", cached)
    check(same, "the conversation's answers equal one plain instance's")
    home = servers[0]

    # ---- a session pinned elsewhere finds a long prompt in Redis ----
    other, probes = None, 0
    for i in range(64):
        probes += 1
        srv = request(LB, {"prompt": "hi", "max_tokens": 1, "temperature": 0}, "probe-%d" % i)[2]
        if srv != home:
            other = ("probe-%d" % i, srv)
            break
    check(other is not None, "a session id that hashes to another instance", "after %d probes" % probes)
    a1, c1, s1 = complete(LB, long_prompt, session="alice")
    # written through asynchronously: wait until the first instance's writes settle
    t_end, last = time.time() + 10, -1
    while time.time() < t_end:
        w = redis_tier(inst[home])["writes_total"]
        if w == last:
            break
        last = w
        time.sleep(0.3)
    hits0 = redis_tier(inst[other[1]])["hits_total"]
    a2, c2, s2 = complete(LB, long_prompt, session=other[0])
    hits1 = redis_tier(inst[other[1]])["hits_total"]
    print("long prompt: session alice on %s cached %d; session %s on %s cached %d (%d blocks from Redis)"
          % (s1, c1, other[0], s2, c2, hits1 - hits0), flush=True)
    check(s1 == home and s2 == other[1], "the two sessions are served by two instances", (s1, s2))
    check(c2 > 0 and hits1 > hits0, "the second instance gets the prompt's prefix from the shared Redis tier", (c2, hits1 - hits0))
    check(a1 == ref_long and a2 == ref_long, "both answers equal one plain instance's")

    # ---- an instance killed under load ----
    pids = dict(l.split() for l in open(os.path.join(run, "pids")))
    victim = "kvlm-%d" % inst[home]
    results, lock = [], threading.Lock()
    def worker(w):
        for i in range(w, len(load_prompts) * 2, 4):
            p = load_prompts[i % len(load_prompts)]
            t0 = time.time()
            try:
                st, j, srv = request(LB, {"prompt": p, "max_tokens": LOAD_TOKENS, "temperature": 0}, "load-%d" % i, timeout=30)
                ok = st == 200 and j["choices"][0]["text"] == ref_load[p]
                r = (st, ok, time.time() - t0, srv)
            except Exception as e:
                r = ("exc " + type(e).__name__, False, time.time() - t0, None)
            with lock:
                results.append(r)
    ths = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in ths:
        t.start()
    while True:
        with lock:
            if len(results) >= 4:
                break
        time.sleep(0.02)
    os.kill(int(pids[victim]), signal.SIGKILL)
    t_kill = time.time()
    for t in ths:
        t.join(60)
    hung = any(t.is_alive() for t in ths)
    slow = max(r[2] for r in results)
    bad = [r for r in results if r[0] == 200 and not r[1]]
    failed = [r for r in results if r[0] != 200]
    print("load: %d requests, %d ok, %d failed %s, slowest %.2f s; %s killed -9 mid-load"
          % (len(results), sum(1 for r in results if r[1]), len(failed), [r[0] for r in failed], slow, home), flush=True)
    check(not hung and len(results) == len(load_prompts) * 2, "no request hangs")
    check(slow < 20, "every request completes or fails within 20 s", slow)
    check(not bad, "every answer that came back is right", bad)
    check(len(failed) <= 4, "at most the requests in flight on the killed instance fail", failed)
    # after the kill: the balancer routes around it
    after = []
    for p in load_prompts[:6]:
        st, j, srv = request(LB, {"prompt": p, "max_tokens": LOAD_TOKENS, "temperature": 0}, "after-" + p[:10], timeout=30)
        after.append((st, srv, st == 200 and j["choices"][0]["text"] == ref_load[p]))
    check(all(a[0] == 200 and a[2] and a[1] != home for a in after), "after the kill every request is answered, elsewhere, right", after)
    # the conversation goes on elsewhere, its prefix found in Redis
    ans, c, srv = complete(LB, after_prompt, session="alice")
    print("alice after her instance died: served by %s, cached_tokens %d" % (srv, c), flush=True)
    check(srv != home and c > 0, "her next turn lands elsewhere and still gets hits (Redis)", (srv, c))
    check(ans == ref_after, "with the same answer as one plain instance")

    # ---- a Redis node killed ----
    rnode = [k for k in pids if k.startswith("redis-")][0]
    os.kill(int(pids[rnode]), signal.SIGKILL)
    ok, slowest = True, 0
    for rep in range(2):
        for p in redis_prompts:
            t0 = time.time()
            st, j, srv = request(LB, {"prompt": p, "max_tokens": 24, "temperature": 0}, "redis-%d" % rep, timeout=30)
            slowest = max(slowest, time.time() - t0)
            ok = ok and st == 200 and j["choices"][0]["text"] == ref_redis[p]
    print("Redis node %s killed: 8 requests, slowest %.2f s" % (rnode, slowest), flush=True)
    check(ok, "with a Redis node dead every request completes with the same answer")
    check(slowest < 10, "and none waits long", slowest)
    t_end = time.time() + 5 # its health checks: down after two failures, a second apart
    while True:
        rc, out = launcher_run("status", "--dir", run, "--port", str(base))
        if ("balancer: server %s DOWN" % home) in out or time.time() > t_end:
            break
        time.sleep(0.2)
    check(rc != 0 and out.count(": DOWN") == 2 and ("balancer: server %s DOWN" % home) in out,
          "scripts/cluster.sh status shows the two dead processes, and the balancer has the instance down", out)
finally:
    if plain and plain.poll() is None:
        plain.kill()
        plain.wait()
    t0 = time.time()
    rc, out = launcher_run("stop", "--dir", run, "--port", str(base), timeout=90)
    check(rc == 0, "scripts/cluster.sh stop", out)
    left = []
    if os.path.exists(os.path.join(run, "pids")):
        left.append("pids file")
    check(not left and time.time() - t0 < 60, "stopped cleanly in %.1f s" % (time.time() - t0), left)
    shutil.rmtree(tmp, ignore_errors=True)
print("total %.1f s" % (time.time() - T0))
sys.exit(1 if failures else 0)
PY
