#!/usr/bin/env bash
# tests/cli_kv_tiers: KV tiers end to end through `kvlm serve` (python3 stdlib):
#  disk: a restarted server with the same --kv-disk finds a long prompt's
#    blocks (cached_tokens > 0) and answers exactly as a cold server; a
#    flipped byte, a truncated block file and a deleted one are each detected
#    (corrupt / missed, visible in /kvlm/status), recomputed, same answer;
#    kill -9 during heavy writes, three times, then the tier still works and
#    answers stay identical;
#  redis: two servers on one redis-server: a prompt sent to A is a hit on B
#    (written through) with the same answer; redis-server stopped mid-load:
#    every request completes with the right answer.
# Everything is bounded in time and every process started is stopped.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout 540 python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import http.client, json, os, random, re, shutil, socket, subprocess, sys, tempfile, threading, time

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
failures = 0
procs = []
tmp = tempfile.mkdtemp(prefix="kvlm-tiers-")

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

stop = serve_http.stop

def cleanup():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    shutil.rmtree(tmp, ignore_errors=True)

def request(port, method, path, body=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=json.dumps(body).encode() if body is not None else None,
              headers={"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    return r.status, json.loads(text)

def complete(port, prompt, n=16):
    st, j = request(port, "POST", "/v1/completions",
                    {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert st == 200, (st, j)
    return j["choices"][0]["text"], j["usage"]["prompt_tokens_details"]["cached_tokens"]

def tier(port, name):
    for t in request(port, "GET", "/kvlm/status")[1].get("tiers", []):
        if t["name"] == name:
            return t
    return None

rng = random.Random(7)
BS = 16
long_prompt = [1] + [rng.randrange(3, 512) for _ in range(319)]   # 19 full blocks before the last token
others = [[1] + [rng.randrange(3, 512) for _ in range(200)] for _ in range(12)]

try:
    # ---- cold answers ----
    cold = start()
    want, c0 = complete(cold.port, long_prompt)
    want_others = [complete(cold.port, p)[0] for p in others[:4]]
    stop(cold)
    check(c0 == 0, "cold server: nothing cached")

    # ---- disk: a restart finds the prompt ----
    disk = os.path.join(tmp, "disk")
    a = start("--kv-disk", disk, "--kv-disk-size", "64MiB")
    got, _ = complete(a.port, long_prompt)
    check(got == want, "first server with --kv-disk answers as the cold one")
    check(stop(a) == 0, "SIGTERM stops it cleanly (cached blocks written first)")
    files = [os.path.join(d, f) for d, _, fs in os.walk(disk) for f in fs if f.endswith(".kvb")]
    check(len(files) >= 19, "the prompt's blocks are on disk", "%d files" % len(files))

    # kvlm plan's tokens per tier agree with the block files' real size
    out = subprocess.run([kvlm, "plan", "-m", model, "--kv-disk-size", "1MiB"], capture_output=True, text=True,
                         timeout=60).stdout
    m = re.search(r"^\s*disk\s+\S+ \S+\s+(\d+) tokens", out, re.M)
    stored = os.path.getsize(files[0])
    check(m is not None and int(m.group(1)) == (1 << 20) // stored * BS,
          "kvlm plan: tokens a 1 MiB disk tier holds match the stored block size", "%r vs %d" % (m and m.group(1), stored))
    b = start("--kv-disk", disk, "--kv-disk-size", "64MiB")
    got, cached = complete(b.port, long_prompt)
    t = tier(b.port, "disk")
    print("     restart: cached_tokens %d, disk tier %s" % (cached, json.dumps(t)))
    check(cached == 19 * BS, "after a restart the whole prompt prefix comes from disk", "cached %d" % cached)
    check(got == want, "and the answer is identical to a cold run", repr((got, want)))
    check(t is not None and t["promoted_total"] >= 19, "the disk tier counts its promotions")
    stop(b)

    # Which file holds prompt block i: its header's tokens (docs/kv-tiers.md).
    def block_file(i):
        want_toks = long_prompt[i * BS:(i + 1) * BS]
        for d, _, fs in os.walk(disk):
            for f in fs:
                if not f.endswith(".kvb"):
                    continue
                path = os.path.join(d, f)
                with open(path, "rb") as fh:
                    head = fh.read(88 + 4 * BS)
                if len(head) < 88 + 4 * BS or head[:8] != b"KVLMBLK1":
                    continue
                toks = [int.from_bytes(head[88 + 4 * k:92 + 4 * k], "little", signed=True) for k in range(BS)]
                if toks == want_toks:
                    return path
        return None

    def damaged_round(i, how):
        path = block_file(i)
        if path is None:
            check(False, "%s: block %d's file found" % (how, i))
            return
        size = os.path.getsize(path)
        if how == "flip":
            with open(path, "r+b") as fh:
                fh.seek(size // 2)
                byte = fh.read(1)
                fh.seek(size // 2)
                fh.write(bytes([byte[0] ^ 0x10]))
        elif how == "truncate":
            os.truncate(path, size - 100)
        else:
            os.unlink(path)
        p = start("--kv-disk", disk, "--kv-disk-size", "64MiB")
        got, cached = complete(p.port, long_prompt)
        t = tier(p.port, "disk")
        print("     %s block %d: cached_tokens %d, corrupt %d, misses %d" % (how, i, cached, t["corrupt_total"], t["misses_total"]))
        check(cached == i * BS, "%s block %d: the prefix stops there" % (how, i), "cached %d" % cached)
        if how == "delete":
            check(t["corrupt_total"] == 0 and t["misses_total"] >= 1, "delete: counted as a miss")
        else:
            check(t["corrupt_total"] == 1, "%s: detected and counted in /kvlm/status" % how)
        check(got == want, "%s: recomputed, the answer is identical" % how)
        stop(p)  # the recomputed blocks go back to disk

    damaged_round(12, "flip")
    damaged_round(7, "truncate")
    damaged_round(3, "delete")
    p = start("--kv-disk", disk, "--kv-disk-size", "64MiB")
    got, cached = complete(p.port, long_prompt)
    check(cached == 19 * BS and got == want, "after the damage rounds the whole prefix is back on disk", "cached %d" % cached)
    stop(p)

    # ---- disk: kill -9 during heavy writes ----
    for round_ in range(3):
        # a pool of 24 blocks: each prompt pushes the previous ones to disk
        p = start("--kv-disk", disk, "--kv-disk-size", "64MiB", "--kv-mem", "480KiB")
        def load(k):
            r = random.Random(100 * round_ + k)
            try:  # fresh prompts until the server dies: every one demotes blocks to disk
                while True:
                    complete(p.port, [1] + [r.randrange(3, 512) for _ in range(200)], 4)
            except Exception:
                pass
        threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(6)]
        for th in threads:
            th.start()
        time.sleep(0.8 + 0.8 * rng.random())
        before = tier(p.port, "disk")
        p.kill()
        p.wait()
        for th in threads:
            th.join(timeout=30)
        print("     kill -9 round %d: %d blocks demoted to disk before the kill" % (round_ + 1, before["demoted_total"]))
    p = start("--kv-disk", disk, "--kv-disk-size", "64MiB", "--kv-mem", "480KiB")
    ok = True
    for k in range(4):
        got, _ = complete(p.port, others[k])
        ok = ok and got == want_others[k]
    got, cached = complete(p.port, long_prompt)
    t = tier(p.port, "disk")
    print("     after 3 x kill -9: cached_tokens %d on the long prompt, disk tier %s" % (cached, json.dumps(t)))
    check(ok and got == want, "after kill -9 x3 the disk tier works and every answer is identical")
    stop(p)

    # ---- redis ----
    if not shutil.which("redis-server"):
        print("SKIP redis part: redis-server not installed (scripts/setup.sh)")
    else:
        rport = free_port()
        rdir = os.path.join(tmp, "redis")
        os.makedirs(rdir)
        def start_redis():
            r = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", rdir, "--maxmemory", "64mb",
                                  "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            procs.append(r)
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", rport), timeout=0.2).close()
                    return r
                except OSError:
                    time.sleep(0.05)
            return r
        red = start_redis()
        url = "redis://127.0.0.1:%d/0" % rport
        A = start("--kv-redis", url)
        B = start("--kv-redis", url)
        got_a, _ = complete(A.port, long_prompt)
        time.sleep(1.0)  # write-through is asynchronous: within a second
        got_b, cached_b = complete(B.port, long_prompt)
        tb = tier(B.port, "redis")
        print("     redis: B cached_tokens %d, B's redis tier %s" % (cached_b, json.dumps(tb)))
        check(got_a == want and got_b == want, "A and B answer as the cold server")
        check(cached_b == 19 * BS, "B finds A's blocks in redis", "cached %d" % cached_b)
        # redis-server stopped in the middle of a load
        results = {}
        def load2(k):
            try:
                results[k] = complete((A if k % 2 else B).port, others[k % 4], 16)[0]
            except Exception as e:
                results[k] = "error: %s" % e
        threads = [threading.Thread(target=load2, args=(k,), daemon=True) for k in range(8)]
        for th in threads:
            th.start()
        time.sleep(0.2)
        red.terminate()
        red.wait(timeout=10)
        for th in threads:
            th.join(timeout=120)
        check(all(results.get(k) == want_others[k % 4] for k in range(8)),
              "redis-server stopped mid-load: every request completes with the right answer",
              repr([k for k in range(8) if results.get(k) != want_others[k % 4]]))
        got, _ = complete(A.port, long_prompt)
        check(got == want, "with redis down, answers stay right")
        check(stop(A) == 0 and stop(B) == 0, "both servers stop cleanly with redis down")
finally:
    cleanup()
print("cli_kv_tiers: %s" % ("all passed" if failures == 0 else "%d failed" % failures))
sys.exit(1 if failures else 0)
PY
