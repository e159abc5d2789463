#!/usr/bin/env bash
# tests/cli_kv_redis_trust: the Redis tier's trust options and fault lines
# end to end, through `kvlm run` and `kvlm serve` (python3 stdlib), against
# redis-servers started here on loopback ports with TLS (certificates made
# here with openssl) and ACL users:
#  - over rediss:// with AUTH (password from --kv-redis-password-file, from
#    KVLM_REDIS_PASSWORD, and in the URL, which warns once) and a client
#    certificate, `kvlm run`'s greedy output equals the output without any
#    tier, and a second run gets its prompt's blocks from Redis (cached > 0
#    in the stats line); the password never shows;
#  - an unusable tier (nothing listening, another CA, a wrong password, a
#    database the server lacks, redis-cluster:// at a plain Redis, redis://
#    at a Redis Cluster node) warns once, with why, and the run exits 0
#    with the same output;
#  - a hostile endpoint (every command answered with an array of 2^31-1
#    elements, or a string of 2^31-1 bytes) delays `kvlm serve`'s start by
#    no more than the tier's timeout, and is said once;
#  - under `kvlm serve`: Redis killed then restarted, SIGSTOPped then
#    SIGCONTed, refusing writes (maxmemory 1mb, noeviction), a missing
#    database made to exist, and redis-cluster:// at a plain Redis that is
#    then a cluster node: each fault is one line when it starts and one when
#    it ends, with its cost; requests answer right throughout.
# Bounded in time; every process started is stopped.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
for t in redis-server redis-cli openssl; do
  command -v $t >/dev/null || { echo "*** SKIP: $t not installed (scripts/setup.sh installs it) ***"; exit 77; }
done
exec timeout 300 python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import json, os, re, shutil, signal, socket, subprocess, sys, tempfile, threading, time

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
failures = 0
procs = []
tmp = tempfile.mkdtemp(prefix="kvlm-rtrust-")
T0 = time.time()

def check(cond, name, detail=""):
    global failures
    if cond:
        print("ok   " + name, flush=True)
    else:
        failures += 1
        print("FAIL %s %s" % (name, detail[-800:]), flush=True)

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def cleanup():
    for p in procs:
        if p.poll() is None:
            if p.args and "redis-server" in str(p.args[0]):
                p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)

def sh(cmd):
    return subprocess.run(cmd, shell=True, cwd=tmp, capture_output=True, text=True, timeout=60)

# ---- certificates: a CA, another CA, one certificate for the server and the client ----
ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
r = sh("openssl req -x509 -new %s -keyout ca.key -out ca.crt -days 2 -subj /CN=kvlm-test-ca && "
       "openssl req -x509 -new %s -keyout ca2.key -out ca2.crt -days 2 -subj /CN=kvlm-other-ca && "
       "openssl req -new %s -keyout cert.key -out cert.csr -subj /CN=localhost && "
       "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' >san.ext && "
       "openssl x509 -req -in cert.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out cert.crt -days 2 -extfile san.ext"
       % (ec, ec, ec))
if r.returncode:
    print("FAIL: openssl: %s" % r.stderr)
    sys.exit(1)
CA, CA2, CERT, KEY = (os.path.join(tmp, f) for f in ("ca.crt", "ca2.crt", "cert.crt", "cert.key"))
PWFILE = os.path.join(tmp, "pw")
with open(PWFILE, "w") as f:
    f.write("secret\n")

def redis(port, tls_port=None, extra=(), name="r"):
    """A redis-server (ACL user alice/secret, default user defpass) on port
    (0: none) and tls_port; returns it once it answers."""
    d = os.path.join(tmp, "%s%d" % (name, port or tls_port))
    os.makedirs(d, exist_ok=True)
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", d, "--user", "alice", "on", ">secret", "~*", "+@all", "--requirepass", "defpass"]
    if tls_port:
        args += ["--tls-port", str(tls_port), "--tls-cert-file", CERT, "--tls-key-file", KEY, "--tls-ca-cert-file", CA]
    p = subprocess.Popen(args + list(extra), stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "log"), "a"))
    procs.append(p)
    for _ in range(200):
        if rcli(port or tls_port, "PING", tls=not port) == "PONG":
            return p
        if p.poll() is not None:
            break
        time.sleep(0.05)
    print("FAIL: redis-server on %s did not start" % (port or tls_port))
    cleanup()
    sys.exit(1)

def rcli(port, *args, tls=False):
    cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(port), "-a", "defpass", "--no-auth-warning"]
    if tls:
        cmd += ["--tls", "--cacert", CA, "--cert", CERT, "--key", KEY]
    try:
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=10).stdout.strip()
    except subprocess.TimeoutExpired:
        return ""

TLS = ["--kv-redis-tls-ca", CA, "--kv-redis-tls-cert", CERT, "--kv-redis-tls-key", KEY]
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
          "friends. One day, she saw a big red ball")

def run(*extra, env=None):
    """`kvlm run` greedy: (exit status, stdout, stderr)."""
    e = dict(os.environ)
    e.pop("KVLM_REDIS_PASSWORD", None)
    e.update(env or {})
    r = subprocess.run([kvlm, "run", "-m", model, "-p", PROMPT, "-n", "24", "--temp", "0", "-t", "1", "-c", "256"]
                       + list(extra), capture_output=True, text=True, timeout=120, env=e)
    return r.returncode, r.stdout, r.stderr

def cached(err):
    m = re.search(r"cached: (\d+) tokens", err)
    return int(m.group(1)) if m else 0

def lines(err, what):
    return [l for l in err.splitlines() if what in l]

try:
    port, tport = free_port(), free_port()
    red = redis(port, tport, ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    rc, want, err = run()
    check(rc == 0 and want.startswith(PROMPT), "kvlm run without a tier", err)

    # ---- TLS + AUTH: same output; the second run's prompt comes from Redis ----
    url = "rediss://alice@127.0.0.1:%d" % tport
    rc, out, err = run("--kv-redis", url, "--kv-redis-password-file", PWFILE, *TLS)
    check(rc == 0 and out == want and "redis tier" not in err, "rediss:// + AUTH (password file) + client cert: "
          "the output without a tier, no fault said", err)
    for _ in range(3):  # (a 200 ms timeout on a loaded machine may miss once)
        rc, out, err2 = run("--kv-redis", url, "--kv-redis-password-file", PWFILE, *TLS)
        if cached(err2) > 0:
            break
    print("     second run: %s" % err2.strip().splitlines()[-1])
    check(rc == 0 and out == want and cached(err2) > 0, "a second run gets its prompt's blocks from Redis over TLS",
          "cached %d" % cached(err2))
    for _ in range(3):
        rc, out, err = run("--kv-redis", url, *TLS, env={"KVLM_REDIS_PASSWORD": "secret"})
        if cached(err) > 0:
            break
    check(rc == 0 and out == want and cached(err) > 0, "KVLM_REDIS_PASSWORD", err)
    for _ in range(3):
        rc, out, err = run("--kv-redis", "rediss://alice:secret@127.0.0.1:%d" % tport, *TLS)
        if cached(err) > 0:
            break
    check(rc == 0 and out == want and cached(err) > 0 and len(lines(err, "visible")) == 1,
          "a password in the URL works and warns once that it shows in the process list", err)
    rc, out, err = run("--kv-redis", "rediss://alice:hunter2@127.0.0.1:%d" % tport, *TLS)
    check(rc == 0 and out == want and len(lines(err, "AUTH failed: WRONGPASS")) == 1 and "hunter2" not in err,
          "a wrong password: one line, never the password, the same output, exit 0", err)
    rc, out, err = run("--kv-redis", url, "--kv-redis-password-file", PWFILE, "--kv-redis-tls-ca", CA2,
                       "--kv-redis-tls-cert", CERT, "--kv-redis-tls-key", KEY)
    check(rc == 0 and out == want and len(lines(err, "TLS handshake failed: certificate verify failed")) == 1,
          "another CA: refused, one line, exit 0", err)
    rc, out, err = run("--kv-redis", "redis://alice:secret@127.0.0.1:%d" % tport)
    check(rc == 0 and out == want and len(lines(err, "use rediss://")) == 1, "redis:// at a TLS port: said", err)
    rc, out, err = run("--kv-redis", "redis://127.0.0.1:1")
    check(rc == 0 and out == want and len(lines(err, "redis tier 127.0.0.1:1: down: connect: Connection refused")) == 1,
          "kvlm run with nothing listening warns and exits 0", err)
    with open(PWFILE + "2", "w") as f:
        f.write("\n")
    rc, out, err = run("--kv-redis", url, "--kv-redis-password-file", PWFILE + "2", *TLS)
    check(rc == 1 and "empty" in err, "an empty password file is an error", err)

    # ---- the wrong database, the wrong mode ----
    rc, out, err = run("--kv-redis", "redis://alice@127.0.0.1:%d/99" % port, env={"KVLM_REDIS_PASSWORD": "secret"})
    check(rc == 0 and out == want and len(lines(err, "SELECT 99 refused: ERR DB index is out of range")) == 1,
          "/99: the server's refusal said once", err)
    rc, out, err = run("--kv-redis", "redis-cluster://alice@127.0.0.1:%d" % port, env={"KVLM_REDIS_PASSWORD": "secret"})
    check(rc == 0 and out == want and len(lines(err, "cluster support disabled")) == 1,
          "redis-cluster:// at a plain Redis: CLUSTER SLOTS's refusal said once", err)
    cport = free_port()
    while cport + 10000 > 65535:
        cport = free_port()
    cnode = redis(cport, extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                "--cluster-require-full-coverage", "no"], name="c")
    rcli(cport, "CLUSTER", "ADDSLOTSRANGE", "0", "8191")  # half the slots: the rest are not served
    rc, out, err = run("--kv-redis", "redis://alice@127.0.0.1:%d" % cport, env={"KVLM_REDIS_PASSWORD": "secret"})
    check(rc == 0 and out == want and len(lines(err, "a Redis Cluster node? (use redis-cluster://")) == 1,
          "redis:// at a Redis Cluster node: said once", err)

    # ---- hostile endpoints: kvlm serve starts at once ----
    hostile = os.path.join(tmp, "hostile.py")
    with open(hostile, "w") as f:
        f.write(r'''
import socket, sys, threading
ans = {"array": b"*2147483647\r\n", "bulk": b"$2147483647\r\n"}[sys.argv[1]]
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
def serve(c):
    try:
        while c.recv(65536):
            c.sendall(ans)
    except OSError:
        pass
while True:
    c = s.accept()[0]
    threading.Thread(target=serve, args=(c,), daemon=True).start()
''')

    def serve_start(*extra, stderr_path=None):
        """kvlm serve: (process, port, seconds to its listening line)."""
        t0 = time.time()
        err = open(stderr_path, "w") if stderr_path else subprocess.DEVNULL
        p = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-c", "256", "-t", "1"] + list(extra),
                             stdout=subprocess.PIPE, stderr=err, text=True,
                             env=dict(os.environ, KVLM_REDIS_PASSWORD="secret"))
        procs.append(p)
        m = re.search(r"127\.0\.0\.1:(\d+)", p.stdout.readline())
        return p, int(m.group(1)) if m else 0, time.time() - t0

    p, _, base = serve_start()
    serve_http.stop(p)
    for kind in ("array", "bulk"):
        for scheme in ("redis", "redis-cluster"):
            h = subprocess.Popen([sys.executable, hostile, kind], stdout=subprocess.PIPE, text=True)
            procs.append(h)
            hport = int(h.stdout.readline())
            path = os.path.join(tmp, "hostile-%s-%s.err" % (kind, scheme))
            p, sport, dt = serve_start("--kv-redis", "%s://127.0.0.1:%d" % (scheme, hport), stderr_path=path)
            ok = sport and serve_http.request(sport, "GET", "/health")[0] == 200
            serve_http.stop(p)
            h.kill()
            h.wait()
            err = open(path).read()
            print("     %s://, answers %s: listening after %.3f s (%.3f s without a tier)" % (scheme, kind, dt, base))
            check(ok and dt - base < 0.2 + 1.0 and len(lines(err, "reply refused")) == 1,
                  "a hostile %s:// endpoint (%s) delays kvlm serve's start by at most the timeout, said once"
                  % (scheme, kind), err)

    # ---- faults under kvlm serve: one line when each starts, one when it ends ----
    def complete(sport, prompt, n=8):
        st, j = serve_http.request(sport, "POST", "/v1/completions",
                                   {"prompt": prompt, "max_tokens": n, "temperature": 0}, timeout=60)
        return j["choices"][0]["text"] if st == 200 else "error %d" % st

    # (prompts that differ from their first block on: each one's blocks are new to Redis)
    def fresh(tag, n):
        return ["%s %d: %s" % (tag, i, PROMPT) for i in range(n)]
    def log():
        return open(path).read()
    def wait_for(what, n, limit=10):
        t0 = time.time()
        while len(lines(log(), what)) < n and time.time() - t0 < limit:
            time.sleep(0.05)
        return len(lines(log(), what))
    prompts = fresh("Tom", 4)
    path = os.path.join(tmp, "faults.err")
    s, sport, _ = serve_start("--kv-redis", "redis://alice@127.0.0.1:%d" % port, stderr_path=path)
    if not sport:
        check(False, "kvlm serve with the tier", log())
        raise SystemExit(1)
    ref = [complete(sport, q) for q in prompts]

    # killed, then restarted on the same port
    red.kill()
    red.wait()
    got = [complete(sport, q) for q in fresh("Ann", 4)]
    check(all(not g.startswith("error") for g in got), "redis killed: requests answer")
    wait_for("down:", 1, 3)
    red = redis(port, tport, ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
    wait_for("reachable again", 1)
    got = [complete(sport, q) for q in prompts]
    err = log()
    check(got == ref and len(lines(err, "down:")) == 1 and len(lines(err, "reachable again after")) == 1 and
          re.search(r"down: [^\n]*\n(?:[^\n]*\n)*?[^\n]*reachable again after [0-9.]+ s \(\d+ reads missed, "
                    r"\d+ writes dropped\)", err),  # (the server's request lines in between)
          "killed then restarted: one line when it went down, one when it came back, with its cost", err)

    # hung (SIGSTOP, long enough for the stats poll to see it), then SIGCONT
    red.send_signal(signal.SIGSTOP)
    t0 = time.time()
    got = [complete(sport, q) for q in fresh("Sue", 4)]
    slow = time.time() - t0
    wait_for("not answering:", 1, 3)
    red.send_signal(signal.SIGCONT)
    wait_for("reachable again", 2)
    err = log()
    check(all(not g.startswith("error") for g in got) and len(lines(err, "not answering:")) == 1 and
          len(lines(err, "reachable again after")) == 2,
          "SIGSTOP then SIGCONT: one line when it hung, one when it answered (4 requests took %.2f s)" % slow, err)

    # refusing writes: maxmemory 1mb, noeviction (every SET refused), then room again
    rcli(port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    rcli(port, "CONFIG", "SET", "maxmemory", "1mb")
    got = [complete(sport, q) for q in fresh("Max", 6)]
    wait_for("refusing writes", 1, 5)
    rcli(port, "CONFIG", "SET", "maxmemory", "64mb")
    rcli(port, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    t0, k = time.time(), 0
    while not lines(log(), "accepting writes again") and time.time() - t0 < 10:
        complete(sport, fresh("Kim %d" % k, 1)[0])
        k += 1
        time.sleep(0.2)
    err = log()
    m = re.search(r"accepting writes again after [0-9.]+ s \((\d+) writes refused\)", err)
    check(all(not g.startswith("error") for g in got) and
          len(lines(err, "refusing writes: OOM command not allowed")) == 1 and m and int(m.group(1)) > 1 and
          len(lines(err, "accepting writes again")) == 1,
          "maxmemory 1mb + noeviction: one line when writes are refused, one when they are taken again", err)
    serve_http.stop(s)
    for l in lines(log(), "redis tier"):
        print("     | " + l)

    # a database the server lacks, then made to exist (restarted with more)
    path = os.path.join(tmp, "db.err")
    s, sport, _ = serve_start("--kv-redis", "redis://alice@127.0.0.1:%d/20" % port, stderr_path=path)
    got = [complete(sport, q) for q in prompts[:2]]
    wait_for("SELECT 20", 1, 3)
    red.kill()
    red.wait()
    red = redis(port, tport, ["--databases", "32"])
    wait_for("reachable again", 1)
    err = log()
    # (restarting it is a fault of its own between them: down, said too)
    check(got == ref[:2] and len(lines(err, "SELECT 20 refused: ERR DB index is out of range")) == 1 and
          len(lines(err, "reachable again after")) == 1,
          "/20 on a server of 16 databases, then of 32: said when refused, and when it is back", err)
    serve_http.stop(s)
    for l in lines(log(), "redis tier"):
        print("     | " + l)

    # redis-cluster:// at a plain Redis, then a cluster node (all slots) on its port
    qport = free_port()
    while qport + 10000 > 65535:
        qport = free_port()
    plain = redis(qport, name="q")
    path = os.path.join(tmp, "mode.err")
    s, sport, _ = serve_start("--kv-redis", "redis-cluster://alice@127.0.0.1:%d" % qport, stderr_path=path)
    got = [complete(sport, q) for q in prompts[:2]]
    wait_for("cluster support disabled", 1, 3)
    plain.kill()
    plain.wait()
    node = redis(qport, extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"], name="q")
    rcli(qport, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
    wait_for("cluster slot map read after", 1)
    got += [complete(sport, q) for q in prompts[:2]]
    err = log()
    check(got == ref[:2] * 2 and len(lines(err, "not a cluster node: CLUSTER SLOTS answered 'ERR This instance has "
                                            "cluster support disabled'")) == 1 and
          re.search(r"cluster slot map read after [0-9.]+ s \(\d+ reads missed, \d+ writes dropped\)", err),
          "redis-cluster:// at a plain Redis, then at a cluster: said when refused, and when the map came", err)
    serve_http.stop(s)
    for l in lines(log(), "redis tier"):
        print("     | " + l)
    print("     %.1f s in all" % (time.time() - T0))
finally:
    cleanup()
print("cli_kv_redis_trust: %s" % ("all passed" if failures == 0 else "%d failed" % failures))
sys.exit(1 if failures else 0)
PY
