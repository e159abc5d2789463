#!/usr/bin/env bash
# tests/cli_serve_slowloris: `kvlm serve` cannot be locked out by slow clients (loopback
# only, python3 stdlib, about 40 s). 1,300 slow connections from 127.0.0.2-6 (a third
# idle, a third trickling header bytes every 2 s, a third trickling the body every 2 s)
# against a per-address cap of 250: the extra 50 are refused, 1,250 stay open, and a
# normal client's /health and short-completion latency (p50/p99) with them open is
# printed beside the same figures without them and must stay under 2 s (the server started
# with a soft fd limit of 1024 raises it to its hard limit to hold them); every slow
# connection is closed by its header or body deadline (not before, at most 2.5 s after).
# Then, with the server's descriptor limit at 300 and 400 idle connections, accept()
# fails: the server must not spin or crash, and serves /health again once the
# deadline frees descriptors.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
ulimit -n "$(ulimit -Hn)" 2>/dev/null
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt 3000 ]; then
  echo "SKIP: the fd limit is $(ulimit -n); this test needs 3000 (ulimit -n)"; exit 77
fi
exec timeout -k 5 240 python3 - "$KVLM" "$MODEL" <<'PY'
import asyncio, http.client, json, os, re, resource, socket, subprocess, sys, threading, time

kvlm, model = sys.argv[1], sys.argv[2]
HEADER_T, BODY_T, PER_IP, ADDRS, PER_ADDR = 10, 12, 250, ["127.0.0.%d" % i for i in range(2, 7)], 260
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)), flush=True)
    failures += 0 if cond else 1

def start(args, preexec=None):
    proc = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-t", "1"] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    line = proc.stdout.readline()
    m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", line)
    if not m:
        print("FAIL: no listening line, got %r; stderr: %s" % (line, proc.stderr.read()))
        sys.exit(1)
    return proc, int(m.group(1))

def get(port, path, body=None, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if body is None: c.request("GET", path)
    else: c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    return r.status

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs))) - 1))]

def latencies(port, n_health=200, n_cmpl=20):
    """A normal client from 127.0.0.1: a fresh connection per request."""
    h, c, bad = [], [], 0
    for _ in range(n_health):
        t = time.monotonic(); st = get(port, "/health"); h.append(time.monotonic() - t); bad += st != 200
    for _ in range(n_cmpl):
        t = time.monotonic()
        st = get(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        c.append(time.monotonic() - t); bad += st != 200
    return h, c, bad

def show(label, h, c):
    print("%-22s /health p50 %6.1f ms  p99 %6.1f ms | completion (8 tokens) p50 %6.1f ms  p99 %6.1f ms"
          % (label, 1e3 * pct(h, 50), 1e3 * pct(h, 99), 1e3 * pct(c, 50), 1e3 * pct(c, 99)), flush=True)

# ---- part 1: 1,300 slow connections against the deadlines and the per-address cap. The
# server starts with a soft fd limit of 1024 (its hard limit is ours, >= 3000): it must raise
# it itself to hold 1,250 connections.
def soft_1024():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
proc, port = start(["--header-timeout", str(HEADER_T), "--body-timeout", str(BODY_T), "--timeout", "60",
                    "--max-conns-per-ip", str(PER_IP)], soft_1024)
h0, c0, bad0 = latencies(port)
check(bad0 == 0, "baseline requests all 200", bad0)

class Slow:
    def __init__(self, addr, kind):
        self.addr, self.kind = addr, kind
        # the server's deadline runs from a moment between t_lo and t_basis (accept, or the headers in)
        self.t_lo = self.t_open = self.t_basis = self.t_closed = None
        self.refused = False

async def slow_conn(sc):
    sc.t_lo = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(sc.addr, 0))
    except OSError as e:
        sc.t_closed = -1.0; sc.err = str(e); return
    sc.t_open = sc.t_basis = time.monotonic()
    if sc.kind == "body":  # whole headers now, then the body a byte every 2 s
        sc.t_lo = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        sc.t_basis = time.monotonic()
    payload = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200 if sc.kind == "header" else b"{" + b" " * 500

    async def trickle():
        i = 0
        while True:
            await asyncio.sleep(2)
            writer.write(payload[i:i + 1]); i += 1
            await writer.drain()
    t = asyncio.ensure_future(trickle()) if sc.kind != "idle" else None
    try:
        while await reader.read(65536):
            pass
    except OSError:
        pass
    sc.t_closed = time.monotonic()
    if t: t.cancel()
    writer.close()

async def part1():
    kinds = ["idle", "header", "body"]
    conns = [Slow(a, kinds[i % 3]) for a in ADDRS for i in range(PER_ADDR)]
    tasks = [asyncio.ensure_future(slow_conn(sc)) for sc in conns]
    # the server refuses the connections past the cap as it accepts them; on a loaded machine
    # (the sanitizer build on 2 cores) some still wait in the listen backlog after a second, so
    # wait for the refusals, up to a point well before the first deadline
    t_wait = time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        refused = [sc for sc in conns if sc.t_closed is not None]
        settled = sum(1 for sc in conns if sc.t_open or sc.t_closed is not None) == len(conns)
        if (settled and len(refused) >= len(ADDRS) * (PER_ADDR - PER_IP)) or time.monotonic() - t_wait > HEADER_T - 4:
            break
    await asyncio.sleep(0.25)
    t_open = time.monotonic()
    refused = [sc for sc in conns if sc.t_closed is not None]
    for sc in refused: sc.refused = True
    per_addr = {a: sum(1 for sc in conns if sc.addr == a and sc.t_closed is None and sc.t_open) for a in ADDRS}
    n_open = sum(per_addr.values())
    print("slow connections: %d attempted, %d open, %d refused at once; open per address %s"
          % (len(conns), n_open, len(refused), per_addr), flush=True)
    check(n_open >= 1000, "at least 1000 slow connections open", n_open)
    check(all(v <= PER_IP for v in per_addr.values()), "per-address cap %d holds" % PER_IP, per_addr)
    check(len(refused) >= len(ADDRS) * (PER_ADDR - PER_IP), "connections past the per-address cap refused",
          len(refused))
    h1, c1, bad1 = await asyncio.get_event_loop().run_in_executor(None, latencies, port)
    still = sum(1 for sc in conns if sc.t_closed is None and sc.t_open)
    print("measured in %.1f s with %d of them still open" % (time.monotonic() - t_open, still), flush=True)
    check(bad1 == 0, "loaded requests all 200", bad1)
    check(still >= 1000, "the measurement ran with >= 1000 slow connections open", still)
    await asyncio.wait(tasks, timeout=BODY_T + 6)
    return conns, h1, c1

conns, h1, c1 = asyncio.get_event_loop().run_until_complete(part1())
show("no slow connections:", h0, c0)
show("1,250 slow open:", h1, c1)
check(pct(h1, 99) < 2.0 and pct(c1, 99) < 2.0, "normal client p99 < 2 s with the slow connections open")
late, early, open_left = [], [], 0
for sc in conns:
    if not sc.t_open or sc.t_closed == -1.0: continue
    if sc.t_closed is None: open_left += 1; continue
    if sc.refused: continue  # refused by the cap
    T = BODY_T if sc.kind == "body" else HEADER_T
    if sc.t_closed < sc.t_lo + T: early.append((sc.kind, round(sc.t_closed - sc.t_lo - T, 2)))
    if sc.t_closed > sc.t_basis + T + 2.5: late.append((sc.kind, round(sc.t_closed - sc.t_basis - T, 2)))
lag = sorted(sc.t_closed - sc.t_lo - (BODY_T if sc.kind == "body" else HEADER_T) for sc in conns
             if sc.t_open and sc.t_closed and not sc.refused)
print("closed after their deadline by: min %.2f s, median %.2f s, max %.2f s (%d connections)"
      % (lag[0], lag[len(lag) // 2], lag[-1], len(lag)), flush=True)
check(open_left == 0, "every slow connection closed", open_left)
check(not early, "none closed before its deadline", early[:5])
check(not late, "each closed within 2.5 s of its deadline (header %d s, body %d s)" % (HEADER_T, BODY_T), late[:5])
check(get(port, "/health") == 200, "/health after the slow connections")
check(proc.poll() is None, "server alive")
proc.terminate()
try:
    rc = proc.wait(10)
except subprocess.TimeoutExpired:
    proc.kill(); rc = -9
err = proc.stderr.read()
check(rc == 0 and "Sanitizer" not in err, "server stopped cleanly", (rc, err[-500:]))

# ---- part 2: out of descriptors (accept fails): no spin, no crash, served again after the deadline
def low_fds():
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
proc, port = start(["--header-timeout", "3", "--timeout", "60", "--max-conns", "2000", "--max-conns-per-ip", "0"],
                   low_fds)
idle = []
for i in range(400):
    s = socket.socket(); s.bind(("127.0.0.2", 0)); s.settimeout(5)
    s.connect(("127.0.0.1", port)); idle.append(s)
time.sleep(1.0)
def cpu(pid):
    f = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
c0_, t0_ = cpu(proc.pid), time.monotonic()
time.sleep(1.5)
busy = (cpu(proc.pid) - c0_) / (time.monotonic() - t0_)
print("out of descriptors: server CPU %.0f%% of a core over 1.5 s" % (100 * busy), flush=True)
check(busy < 0.3, "no busy loop while accept() fails", busy)
t = time.monotonic()
try:
    st = get(port, "/health", timeout=20)
except OSError as e:
    st = str(e)
print("/health answered %.1f s after the descriptors ran out" % (time.monotonic() - t), flush=True)
check(st == 200, "/health served once the deadline frees descriptors", st)
check(proc.poll() is None, "server alive after running out of descriptors")
for s in idle: s.close()
proc.terminate()
try:
    rc = proc.wait(10)
except subprocess.TimeoutExpired:
    proc.kill(); rc = -9
err = proc.stderr.read()
check(rc == 0 and "Sanitizer" not in err, "server stopped cleanly", (rc, err[-500:]))
print("PASS" if not failures else "%d FAILURES" % failures)
sys.exit(1 if failures else 0)
PY
