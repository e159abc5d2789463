#!/usr/bin/env bash
# tests/cli_kv_trust: what someone who can write to a KV tier, or plant files
# beside it, can and cannot do to `kvlm serve` (docs/kv-tiers.md, "Trust"):
#  forged blocks: every block on disk and in Redis rewritten with another
#    payload and a recomputed checksum. Without --kv-key the forgery is used
#    (the documented trust boundary: answers change, nothing is counted);
#    with it each forged block is counted (forged_total), removed, recomputed
#    and every answer equals its reference; the server warns at start when a
#    shared tier has no key;
#  planted files: FIFOs and symbolic links at blocks' names in the disk
#    folder are misses (counted as corrupt, removed), never a stalled engine:
#    requests complete, SIGTERM stops the server within its bound; a file
#    longer than a block is counted and removed, and the block written again;
#  sessions: `--session` at a FIFO is a clear error at once, a temporary
#    left by a save that was killed is removed by the next run.
# Everything is bounded in time and every process started is stopped.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
# Debian's python3 (python3-xxhash: the forger recomputes the blocks' checksums)
PY=/usr/bin/python3
if ! "$PY" -c "import xxhash" 2>/dev/null; then echo "SKIP: $PY has no xxhash module (scripts/setup.sh: python3-xxhash)"; exit 77; fi
exec timeout 400 "$PY" - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import hashlib, hmac, json, os, random, shutil, signal, socket, stat, subprocess, sys, tempfile, time
import xxhash

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
failures = 0
procs = []
tmp = tempfile.mkdtemp(prefix="kvlm-trust-")
BS = 16

def check(cond, name, detail=""):
    global failures
    if cond:
        print("ok   " + name)
    else:
        failures += 1
        print("FAIL %s %s" % (name, detail))

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def start(*extra):
    p, p.port = serve_http.start(kvlm, model, ["-c", "512", "-t", "2", "--max-seqs", "4"] + list(extra))
    procs.append(p)
    if not p.port:
        print("FAIL: no listening line")
        cleanup()
        sys.exit(1)
    return p

def stop(p):
    """SIGTERM; (exit status, seconds it took, its stderr)."""
    t0 = time.time()
    rc = serve_http.stop(p)
    return rc, time.time() - t0, p.stderr.read()

def cleanup():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)

def complete(port, prompt, n=12):
    st, j = serve_http.request(port, "POST", "/v1/completions",
                               {"prompt": prompt, "max_tokens": n, "temperature": 0}, timeout=60)
    assert st == 200, (st, j)
    return j["choices"][0]["text"], j["usage"]["prompt_tokens_details"]["cached_tokens"]

def tier(port, name):
    for t in serve_http.request(port, "GET", "/kvlm/status")[1].get("tiers", []):
        if t["name"] == name:
            return t
    return None

# ---- a forger: another payload, sealed again as well as one can without the key ----
def forge(blob, guess=b"an attacker's guess at the key"):
    if len(blob) < 88 or blob[:8] != b"KVLMBLK1":
        return None
    off = int.from_bytes(blob[12:16], "little")
    pay = int.from_bytes(blob[80:88], "little")
    signed = int.from_bytes(blob[76:80], "little") & 2
    body = bytearray(blob[:off + pay])
    for i in range(off, off + pay, 2):  # f16 values: flip a bit of each exponent
        body[i + 1] ^= 0x04
    if signed:
        return bytes(body) + hmac.new(guess, bytes(body), hashlib.sha256).digest()
    return bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")

def authentic(blob, secret):
    body = blob[:-32]
    return hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).digest(), blob[-32:])

def block_files(d):
    return [os.path.join(a, f) for a, _, fs in os.walk(d) for f in fs if f.endswith(".kvb")]

def forge_dir(d):
    n = 0
    for path in block_files(d):
        with open(path, "rb") as fh:
            fake = forge(fh.read())
        if fake:
            with open(path, "wb") as fh:
                fh.write(fake)
            n += 1
    return n

# ---- a minimal RESP client (the forger's side of Redis) ----
class Resp:
    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.f = self.s.makefile("rb")
    def cmd(self, *args):
        out = b"*%d\r\n" % len(args)
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.s.sendall(out)
        return self.read()
    def read(self):
        line = self.f.readline()
        t, rest = line[:1], line[1:-2]
        if t in (b"+", b"-"):
            return rest.decode()
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if t == b"*":
            return [self.read() for _ in range(int(rest))]
        raise ValueError(line)

rng = random.Random(11)
prompts = [[1] + [rng.randrange(3, 512) for _ in range(160)] for _ in range(6)]  # 10 full blocks each

try:
    key = os.path.join(tmp, "key")
    secret = b"kvlm-trust-test-%016x" % rng.getrandbits(64)
    with open(key, "wb") as fh:
        fh.write(secret + b"\n")  # the trailing newline is not part of the key
    os.chmod(key, 0o600)

    cold = start()
    want = [complete(cold.port, p)[0] for p in prompts]
    stop(cold)

    # ---- forged blocks on disk ----
    for keyed in (False, True):
        d = os.path.join(tmp, "disk-" + ("key" if keyed else "nokey"))
        kopt = ["--kv-key", key] if keyed else []
        a = start("--kv-disk", d, *kopt)
        for p in prompts:
            complete(a.port, p)
        stop(a)  # the cached blocks go to disk
        n = forge_dir(d)
        b = start("--kv-disk", d, *kopt)
        got = [complete(b.port, p) for p in prompts]
        t = tier(b.port, "disk")
        wrong = sum(g[0] != w for g, w in zip(got, want))
        cached = sum(g[1] for g in got)
        print("     disk, %s: %d blocks forged; %d of %d answers wrong, %d tokens from disk, corrupt %d, forged %d"
              % ("--kv-key" if keyed else "no key", n, wrong, len(prompts), cached, t["corrupt_total"], t["forged_total"]))
        check(n >= 6 * 10, "disk (%s): every prompt's blocks were on disk to forge" % ("key" if keyed else "no key"), n)
        if not keyed:
            # the trust boundary: whoever writes the tier decides the outputs
            check(wrong >= 1 and cached > 0 and t["corrupt_total"] == 0 and t["forged_total"] == 0,
                  "disk, no key: a forged block with a fixed checksum is used, as docs/kv-tiers.md says")
        else:
            check(wrong == 0, "disk, --kv-key: every answer equals its reference")
            check(cached == 0 and t["forged_total"] >= len(prompts) and t["promoted_total"] == 0,
                  "disk, --kv-key: each forged block is counted and none is used", json.dumps(t))
            rc, took, err = stop(b)
            check("not authentic" in err, "disk, --kv-key: the first forged block is logged", err[-400:])
            blobs = [open(f, "rb").read() for f in block_files(d)]
            check(len(blobs) >= 60 and all(authentic(x, secret) for x in blobs),
                  "disk, --kv-key: the forged files were replaced by signed blocks", len(blobs))
            # the recomputed blocks were written back, signed: a third server uses them
            c = start("--kv-disk", d, *kopt)
            got = [complete(c.port, p) for p in prompts]
            check([g[0] for g in got] == want and sum(g[1] for g in got) == 6 * 10 * BS,
                  "disk, --kv-key: the blocks written again are used, answers equal", sum(g[1] for g in got))
            stop(c)
            continue
        stop(b)

    # ---- forged blocks in Redis ----
    if not shutil.which("redis-server"):
        print("SKIP redis part: redis-server not installed (scripts/setup.sh)")
    else:
        rport = free_port()
        red = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        procs.append(red)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", rport), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        url = "redis://127.0.0.1:%d" % rport
        for keyed in (False, True):
            kopt = ["--kv-key", key] if keyed else []
            r = Resp(rport)
            r.cmd("FLUSHALL")
            a = start("--kv-redis", url, *kopt)
            for p in prompts:
                complete(a.port, p)
            time.sleep(1.0)  # write-through is asynchronous
            rc, took, err_a = stop(a)
            if not keyed:
                check("not signed" in err_a, "redis, no key: the server warns at start that the shared tier is unsigned",
                      err_a[-300:])
            else:
                check("not signed" not in err_a, "redis, --kv-key: no warning")
            names = r.cmd("KEYS", "kvlm:blk:*")
            n = 0
            for name in names:
                fake = forge(r.cmd("GET", name))
                if fake:
                    r.cmd("SET", name, fake)
                    n += 1
            b = start("--kv-redis", url, *kopt)
            got = [complete(b.port, p) for p in prompts]
            t = tier(b.port, "redis")
            wrong = sum(g[0] != w for g, w in zip(got, want))
            cached = sum(g[1] for g in got)
            print("     redis, %s: %d blocks forged; %d of %d answers wrong, %d tokens from redis, corrupt %d, forged %d"
                  % ("--kv-key" if keyed else "no key", n, wrong, len(prompts), cached, t["corrupt_total"],
                     t["forged_total"]))
            if not keyed:
                check(n >= 60 and wrong >= 1 and cached > 0 and t["corrupt_total"] == 0,
                      "redis, no key: the forgery is used (the documented trust boundary)")
            else:
                check(n >= 60 and wrong == 0 and cached == 0 and t["forged_total"] >= len(prompts),
                      "redis, --kv-key: each forged block counted, none used, every answer equals", json.dumps(t))
                time.sleep(1.0)  # the drops and the new writes go through the writer
                vals = [r.cmd("GET", name) for name in r.cmd("KEYS", "kvlm:blk:*")]
                check(len(vals) >= 60 and all(authentic(v, secret) for v in vals),
                      "redis, --kv-key: the forged values were replaced by signed blocks", len(vals))
            stop(b)

    # ---- planted files in the disk folder ----
    d = os.path.join(tmp, "disk-key")  # holds every prompt's blocks, signed
    files = block_files(d)
    fifos, links = files[0::3], files[1::3]
    for f in fifos:
        os.unlink(f)
        os.mkfifo(f)
    for f in links:
        os.unlink(f)
        os.symlink("/dev/zero", f)
    big = files[2]
    big_size = os.path.getsize(big)
    with open(big, "ab") as fh:
        fh.write(b"\0" * 4096)
    s = start("--kv-disk", d, "--kv-key", key)
    t0 = time.time()
    got = [complete(s.port, p) for p in prompts]
    took = time.time() - t0
    t = tier(s.port, "disk")
    health = serve_http.request(s.port, "GET", "/health")[0]
    print("     %d FIFOs, %d symbolic links and a long file planted: %d requests in %.2f s, corrupt %d"
          % (len(fifos), len(links), len(prompts), took, t["corrupt_total"]))
    check([g[0] for g in got] == want and took < 30, "planted FIFOs and links: every request completes, answers equal")
    check(t["corrupt_total"] >= len(prompts) and health == 200, "each planted file is counted as corrupt; /health is ok")
    check(all(not stat.S_ISFIFO(os.lstat(f).st_mode) for f in fifos if os.path.lexists(f)) and
          all(not os.path.islink(f) for f in links if os.path.lexists(f)),
          "the FIFOs and links are gone (removed, or blocks written over them)")
    rc, took, err = stop(s)
    print("     SIGTERM with the planted folder: exit %d after %.2f s" % (rc, took))
    check(rc == 0 and took < 30, "SIGTERM stops the server within 30 s", "rc %d, %.1f s" % (rc, took))
    check(not os.path.exists(big) or os.path.getsize(big) == big_size,
          "the long file was removed (or its block written again at its size)")

    # ---- sessions ----
    fifo = os.path.join(tmp, "session.fifo")
    os.mkfifo(fifo)
    t0 = time.time()
    r = subprocess.run([kvlm, "run", "-m", model, "-p", "Once upon a time", "-n", "4", "--session", fifo],
                       capture_output=True, text=True, timeout=60)
    print("     --session at a FIFO: exit %d after %.2f s: %s" % (r.returncode, time.time() - t0, r.stderr.strip()[-160:]))
    check(r.returncode != 0 and "FIFO" in r.stderr and time.time() - t0 < 20, "--session at a FIFO: a clear error at once")
    sess = os.path.join(tmp, "chat.kvs")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone
    stale = "%s.tmp.%d" % (sess, dead.pid)
    with open(stale, "wb") as fh:
        fh.write(b"half a session")
    r = subprocess.run([kvlm, "run", "-m", model, "-p", "Once upon a time", "-n", "4", "--session", sess],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and not os.path.exists(stale) and os.path.exists(sess),
          "a temporary left by a killed save is removed by the next run", r.stderr[-300:])
finally:
    cleanup()
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
