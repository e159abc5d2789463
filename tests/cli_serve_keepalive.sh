#!/usr/bin/env bash
# tests/cli_serve_keepalive: `kvlm serve --keepalive-interval K` over raw
# loopback sockets (the bytes as sent): a stream queued behind a long answer
# gets ": keep-alive" SSE comments every K seconds until its first token, and
# its events are those of the same stream not queued; a whole answer slower
# than K is a chunked 200 whose body is newlines and then the JSON (parsed, it
# equals the same answer made alone), in HTTP/1.1 and 1.0; one faster than K
# keeps its Content-Length and no whitespace; a client that hangs up while its
# answer is kept alive has its request cancelled; a server stopped while it
# keeps one alive ends it with an OpenAI-shaped error in the body, and so does
# one that turns out larger than --max-unsent (answer_too_large); with
# --keepalive-interval 0 nothing is sent before the answer. Bounded (90 s).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout 90 python3 - "$KVLM" "$MODEL" <<'PY'
import json, re, signal, socket, subprocess, sys, threading, time

kvlm, model = sys.argv[1], sys.argv[2]
K = 0.5
# one sequence at a time, so a request waits behind another; sinks eviction, so
# a request may run to any max_tokens (a long answer from a small model)
SERVE = ["-c", "256", "-t", "1", "--max-seqs", "1", "--kv-evict", "sinks", "--kv-budget", "128"]
failures = 0
procs = []

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[:500]), flush=True)
    failures += not cond

def start(k, extra=()):
    p = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "--keepalive-interval", str(k)] + SERVE + list(extra),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", p.stdout.readline())
    if not m:
        print("FAIL: no listening line; stderr: %s" % p.stderr.read()[:400])
        sys.exit(1)
    return p, int(m.group(1))

def send(port, body, version="1.1"):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    b = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (version.encode(), len(b)) + b)
    return s

def read_all(s, t0):
    """(bytes, [(seconds since t0, chunk)]) until the server closes or the HTTP/1.1 answer ends"""
    out, at = b"", []
    while True:
        d = s.recv(65536)
        if not d:
            break
        out += d
        at.append((time.time() - t0, d))
        if out.endswith(b"\r\n0\r\n\r\n") or (b"Content-Length:" in out.split(b"\r\n\r\n")[0] and
                                              len(out.split(b"\r\n\r\n", 1)[1]) >= int(re.search(rb"Content-Length: (\d+)", out).group(1))):
            break
    s.close()
    return out, at

def first_bytes(s):
    """what arrives until the head and the first byte of the body are in"""
    got = b""
    while b"\r\n\r\n" not in got or not got.split(b"\r\n\r\n", 1)[1]:
        d = s.recv(4096)
        if not d:
            break
        got += d
    return got

def dechunk(body):
    out = b""
    while body:
        n, rest = body.split(b"\r\n", 1)
        n = int(n, 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out

def split(resp):
    head, body = resp.split(b"\r\n\r\n", 1)
    return head.decode(), dechunk(body) if b"Transfer-Encoding: chunked" in head else body

def strip_ids(o):
    o = dict(o)
    o.pop("id", None); o.pop("created", None)
    return o

def events(sse):
    """the data lines of an SSE body as a client reads them (comment lines skipped), without id and time"""
    return [l[6:] if l == "data: [DONE]" else strip_ids(json.loads(l[6:]))
            for l in sse.decode().split("\n") if l.startswith("data: ")]

def texts(evs):
    return "".join(e["choices"][0]["text"] for e in evs if e != "[DONE]" and e["choices"])

try:
    p, port = start(K)
    # a long answer: calibrated to last about 2.5 s here (at least 5 K)
    t0 = time.time()
    resp, _ = read_all(send(port, {"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0}), time.time())
    rate = 1000 / max(time.time() - t0, 1e-3)
    N = int(min(max(rate * 2.5, 500), 400000))
    print("about %.0f tokens/s here: long answers of %d tokens" % (rate, N), flush=True)
    short = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    longb = {"prompt": "Once upon a time", "max_tokens": N, "temperature": 0}

    # references, made alone (nothing to wait for)
    ref_short = json.loads(split(read_all(send(port, short), time.time())[0])[1])
    ref_stream = events(split(read_all(send(port, dict(short, stream=True)), time.time())[0])[1])
    check(ref_short["choices"][0]["text"] and texts(ref_stream) == ref_short["choices"][0]["text"],
          "references: a short answer, whole and streamed")

    # ---- a whole answer faster than K: unchanged
    t0 = time.time()
    resp, _ = read_all(send(port, short), t0)
    head, body = split(resp)
    check(time.time() - t0 < K and "Content-Length:" in head and body.startswith(b"{") and
          strip_ids(json.loads(body)) == strip_ids(ref_short),
          "a whole answer made within K: Content-Length, no whitespace, the same JSON", (time.time() - t0, head))

    # ---- a long whole answer, and behind it a stream and a short whole answer
    t0 = time.time()
    a = send(port, longb)
    time.sleep(0.05)
    b = send(port, dict(short, stream=True))
    time.sleep(0.05)
    c = send(port, short)
    res = {}
    ths = [threading.Thread(target=lambda k=k, s=s: res.__setitem__(k, read_all(s, t0))) for k, s in (("a", a), ("b", b), ("c", c))]
    for t in ths: t.start()
    for t in ths: t.join(60)
    (ra, at_a), (rb, at_b), (rc, at_c) = res["a"], res["b"], res["c"]
    dur = at_a[-1][0]
    ha, ba = split(ra)
    lead = len(ba) - len(ba.lstrip(b"\n"))
    ja = json.loads(ba)
    print("long whole answer: %.2f s, %d newlines before its JSON" % (dur, lead), flush=True)
    check("200 OK" in ha and "Transfer-Encoding: chunked" in ha and "Content-Length" not in ha and
          "application/json" in ha, "a whole answer slower than K: a chunked 200", ha)
    check(lead >= int(dur / K) - 2 and ba[lead:lead + 1] == b"{",
          "its body: a newline every K, then the JSON", (lead, dur, ba[:40]))
    check(ja["usage"]["completion_tokens"] == N and ja["choices"][0]["finish_reason"] == "length" and
          ja["choices"][0]["text"].startswith(ref_short["choices"][0]["text"]), "the JSON is the whole answer")
    # the stream waited behind it: comments, then its events
    hb, bb = split(rb)
    first_data = next(t for t, d in at_b if b"data: " in d)
    n_ka = bb.decode().split("data: ")[0].count(": keep-alive\n\n")
    print("queued stream: first event after %.2f s, %d keep-alive comments before it" % (first_data, n_ka), flush=True)
    check(bb.startswith(b": keep-alive\n\n") and n_ka >= int(first_data / K) - 2,
          "a stream waiting in the queue gets ': keep-alive' every K", (n_ka, first_data, bb[:80]))
    check(events(bb) == ref_stream, "its events are those of the same stream not queued")
    hc, bc = split(rc)
    jc = json.loads(bc)
    check("Transfer-Encoding: chunked" in hc and bc.startswith(b"\n") and strip_ids(jc) == strip_ids(ref_short),
          "a short whole answer queued past K: whitespace, then the same JSON as alone", (hc, bc[:40]))

    # ---- HTTP/1.0: no chunks, the body ends with the connection
    t0 = time.time()
    r10, _ = read_all(send(port, dict(longb, max_tokens=N // 2), version="1.0"), t0)
    h10, b10 = r10.split(b"\r\n\r\n", 1)
    check(b"Transfer-Encoding" not in h10 and b10.startswith(b"\n") and
          json.loads(b10)["usage"]["completion_tokens"] == N // 2,
          "HTTP/1.0: whitespace, then the JSON, ended by the close", h10)

    # ---- a client that hangs up while its answer is kept alive: cancelled
    s = send(port, longb)
    got = first_bytes(s)
    s.close()
    t0 = time.time()
    running = None
    while time.time() - t0 < 5:
        c2 = socket.create_connection(("127.0.0.1", port), timeout=10)
        c2.sendall(b"GET /kvlm/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        st = json.loads(split(read_all(c2, time.time())[0])[1])
        running = st["running"] + st["waiting"]
        if running == 0:
            break
        time.sleep(0.1)
    check(running == 0 and time.time() - t0 < 2, "a client gone while its answer is kept alive: cancelled",
          (running, time.time() - t0))

    # ---- the server stopped while an answer is kept alive: the error in the body
    s = send(port, dict(longb, max_tokens=N * 4))
    t0 = time.time()
    first = first_bytes(s)
    p.send_signal(signal.SIGTERM)
    rest, _ = read_all(s, t0)
    hs, bs = split(first + rest)
    js = json.loads(bs)
    check("200 OK" in hs and js.get("error", {}).get("type") == "server_error" and
          "shutting down" in js["error"]["message"] and set(js["error"]) == {"message", "type", "param", "code"},
          "stopped mid-answer: the 200's body is an OpenAI-shaped error", bs[:300])
    rc = p.wait(20)
    check(rc == 0, "the server stopped cleanly", p.stderr.read()[-2000:])

    # ---- an answer kept alive and then too big for --max-unsent: that error as its body
    p, port = start(K, ["--max-unsent", "32KiB"])
    resp, _ = read_all(send(port, dict(longb, logprobs=5)), time.time())
    hs, bs = split(resp)
    js = json.loads(bs)
    check("200 OK" in hs and bs.startswith(b"\n") and js.get("error", {}).get("code") == "answer_too_large",
          "kept alive, then larger than --max-unsent: the 200's body is the answer_too_large error", bs[:300])
    p.send_signal(signal.SIGTERM)
    rc = p.wait(20)
    check(rc == 0, "the server stopped cleanly", p.stderr.read()[-2000:])

    # ---- --keepalive-interval 0: nothing before the answer
    p, port = start(0)
    t0 = time.time()
    a = send(port, dict(longb, max_tokens=N * 4)) # past 2 K even when the machine got faster than measured
    time.sleep(0.05)
    b = send(port, dict(short, stream=True))
    res = {}
    ths = [threading.Thread(target=lambda k=k, s=s: res.__setitem__(k, read_all(s, t0))) for k, s in (("a", a), ("b", b))]
    for t in ths: t.start()
    for t in ths: t.join(60)
    ha, ba = split(res["a"][0])
    hb, bb = split(res["b"][0])
    check("Content-Length:" in ha and ba.startswith(b"{") and res["a"][1][0][0] > 2 * K,
          "off: a long whole answer comes whole, with its Content-Length", (ha, res["a"][1][0][0]))
    check(bb.startswith(b"data: ") and b"keep-alive" not in bb and events(bb) == ref_stream,
          "off: a queued stream gets no comment", bb[:60])
    p.send_signal(signal.SIGTERM)
    rc = p.wait(20)
    check(rc == 0, "the server stopped cleanly", p.stderr.read()[-2000:])

    # ---- bad values refused
    for v in ("-1", "x", "4000"):
        r = subprocess.run([kvlm, "serve", "-m", model, "--port", "0", "--keepalive-interval", v],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode != 0 and "--keepalive-interval" in r.stderr, "--keepalive-interval %s refused" % v, r.stderr)
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
sys.exit(1 if failures else 0)
PY
