#!/usr/bin/env bash
# tests/cli_serve: `kvlm serve` end to end over loopback (python3 stdlib only):
# 32 concurrent streaming greedy requests each equal to that prompt run alone
# (with a KV budget small enough to force preemption), 128 connections at once
# (streamed and whole, 16 sequence slots), n > 1, stop strings,
# chat, logprobs, every bad-input case with its status and OpenAI-style error,
# a request under sinks eviction running far past the context (as `kvlm run`),
# a client hanging up mid-stream (its request cancelled, blocks freed),
# churn (24 clients, a third hanging up at random points), a
# stalled upload closed by the timeout; then /health and a normal request
# still work and SIGTERM stops the server cleanly.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 0; fi
exec python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import http.client, json, os, random, re, signal, socket, subprocess, sys, threading, time

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
quick = bool(os.environ.get("KVLM_TEST_QUICK"))
# 24 blocks of 16 tokens (20 KiB each): far fewer than 12-32 requests of ~50 tokens need at once
proc, port = serve_http.start(kvlm, model, ["-c", "512", "--max-seqs", "16", "--kv-mem", "240KiB", "--timeout", "2",
                                            "-t", "2"])
if not port:
    print("FAIL: no listening line")
    sys.exit(1)
failures = 0

def check(cond, name, detail=""):
    global failures
    if cond:
        print("ok   " + name)
    else:
        failures += 1
        print("FAIL %s %s" % (name, detail))

def request(method, path, body=None, raw=None, timeout=60):
    return serve_http.request(port, method, path, body, raw, timeout)

def stream(path, body):
    """Returns (texts per choice, finish reasons, events, saw [DONE])."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.status
    texts, finish, events, done = {}, {}, [], False
    for raw in r:
        line = raw.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        ev = json.loads(line[6:])
        events.append(ev)
        for ch in ev.get("choices", []):
            i = ch["index"]
            piece = ch["delta"].get("content", "") if "delta" in ch else ch["text"]
            texts[i] = texts.get(i, "") + (piece or "")
            if ch.get("finish_reason"):
                finish[i] = ch["finish_reason"]
    c.close()
    return texts, finish, events, done

def status():
    return request("GET", "/kvlm/status")[1]

def metric(name):
    text = request("GET", "/metrics")[1]
    m = re.search(r"^%s (\S+)$" % name, text, re.M)
    return float(m.group(1)) if m else None

# ---- bad command lines: one clear line, exit 1
for args, pat in [(["--chat-template", "bogus", "--port", "0"], "unknown chat template"),
                  (["--port", "70000"], "--port must be"),
                  (["--port", str(port)], "cannot listen"),
                  (["--kv-mem", "lots", "--port", "0"], "bad size"),
                  (["--kv-evict", "lru", "--port", "0"], "unknown --kv-evict 'lru'"),
                  (["--kv-evict", "sinks", "-c", "128", "--kv-budget", "300", "--port", "0"], "beyond the context"),
                  (["--kv-evict", "h2o", "--h2o-heavy", "2", "--port", "0"], "--h2o-heavy must be within 0..1"),
                  (["--kv-sinks", "-1", "--port", "0"], "must be >= 0"),
                  (["--kv-evict", "sinks", "-c", "128", "--kv-budget", "64", "--kv-sinks", "64", "--port", "0"],
                   "below the budget")]:
    r = subprocess.run([kvlm, "serve", "-m", model] + args, capture_output=True, text=True, timeout=30)
    check(r.returncode == 1 and pat in r.stderr and not r.stdout, "kvlm serve %s: %s" % (" ".join(args), pat), r.stderr)

# ---- --alias names the model; --chat-template forces a family
p2 = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "--alias", "storyteller", "--chat-template", "chatml",
                       "-c", "256", "--max-seqs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
m2 = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", p2.stdout.readline())
if m2:
    port, port1 = int(m2.group(1)), port
    st, models = request("GET", "/v1/models")
    check(st == 200 and models["data"][0]["id"] == "storyteller", "--alias sets the model id", models)
    st, r = request("POST", "/v1/chat/completions", {"model": "storyteller", "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 4})
    check(st == 200 and r["chat_template"] == "chatml" and r["usage"]["prompt_tokens"] > 10,
          "--chat-template chatml renders the chat with ChatML", r)
    st, r = request("POST", "/v1/completions", {"model": "stories260K", "prompt": "x"})
    check(st == 404, "the file name is not the id once aliased")
    port = port1
else:
    check(False, "second server started")
p2.send_signal(signal.SIGTERM)
check(p2.wait(timeout=15) == 0, "second server stops on SIGTERM")

# ---- under sinks eviction a request runs past the context, to max_tokens, as `kvlm run` does
evict_args = ["-c", "128", "--kv-budget", "64", "--kv-evict", "sinks"]
p3 = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "--max-seqs", "2", "-t", "2"] + evict_args,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
m3 = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", p3.stdout.readline())
if m3:
    port, port1 = int(m3.group(1)), port
    st, r = request("POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0})
    check(st == 200 and r["usage"]["completion_tokens"] == 300 and r["choices"][0]["finish_reason"] == "length",
          "sinks, budget 64, context 128: 300 tokens, finish_reason length", r if st != 200 else r["usage"])
    run = subprocess.run([kvlm, "run", "-m", model, "-p", "Once upon a time", "-n", "300", "--temp", "0", "-t", "2"] + evict_args,
                         capture_output=True, text=True, timeout=60)
    check(st == 200 and run.stdout == "Once upon a time" + r["choices"][0]["text"] + "\n",
          "the same text as kvlm run with the same options", run.stderr)
    port = port1
else:
    check(False, "server under eviction started", p3.stderr.read())
p3.send_signal(signal.SIGTERM)
check(p3.wait(timeout=15) == 0, "the eviction server stops on SIGTERM")

# ---- plain endpoints
check(request("GET", "/health") == (200, {"status": "ok"}), "GET /health")
st, models = request("GET", "/v1/models")
check(st == 200 and models["data"][0]["id"] == "stories260K", "GET /v1/models names the file without extension", models)
st, page = request("GET", "/")
check(st == 200 and "<html" in page.lower(), "GET / serves the web page")

# ---- 32 concurrent streaming greedy requests == each alone
R = 12 if quick else 32
names = ["Lily", "Tom", "Sue", "Ben", "Max", "Anna", "A cat", "The dog"]
acts = ["went to the park", "saw a big tree", "wanted to play", "was very happy"]
prompts = ["%s %s." % (names[i % 8], acts[(i // 8) % 4]) for i in range(R)]
params = {"max_tokens": 40, "temperature": 0}
alone = []
for p in prompts:
    st, r = request("POST", "/v1/completions", dict(params, prompt=p))
    assert st == 200, r
    alone.append((r["choices"][0]["text"], r["choices"][0]["finish_reason"]))
pre0 = metric("kvlm_preemptions_total")
results = [None] * R
go = threading.Barrier(R)  # all at once: a staggered start can finish each before the next arrives
def worker(i):
    try:
        go.wait(timeout=30)
        results[i] = stream("/v1/completions", dict(params, prompt=prompts[i]))
    except Exception as e:  # reported below
        results[i] = e
threads = [threading.Thread(target=worker, args=(i,)) for i in range(R)]
for t in threads: t.start()
for t in threads: t.join()
same = sum(1 for i in range(R) if not isinstance(results[i], Exception) and results[i][3]
           and results[i][0].get(0) == alone[i][0] and results[i][1].get(0) == alone[i][1])
check(same == R, "%d concurrent streams equal each prompt alone (%d/%d)" % (R, same, R),
      [(prompts[i], results[i], alone[i]) for i in range(R) if isinstance(results[i], Exception) or results[i][0].get(0) != alone[i][0]][:2])
pre = metric("kvlm_preemptions_total") - pre0
print("     preemptions during the concurrent run: %d" % pre)
check(pre > 0, "the small KV budget forced preemptions")
sw = {k: metric(k) for k in ["kvlm_swaps_out_total", "kvlm_swaps_in_total", "kvlm_recomputes_total", "kvlm_swap_bytes_total"]}
print("     of which swapped: %d out, %d in, %d bytes; recomputed: %d" % (sw["kvlm_swaps_out_total"],
      sw["kvlm_swaps_in_total"], sw["kvlm_swap_bytes_total"], sw["kvlm_recomputes_total"]))
check(sw["kvlm_swaps_out_total"] + sw["kvlm_recomputes_total"] == metric("kvlm_preemptions_total"),
      "every preemption is a swap or a recompute (/metrics)")
def settled(timeout=5):
    """The status once no request runs or waits: the snapshot is published at the end of each engine
    step, and a client can read a request's last event before the step that sent it ends."""
    t0 = time.time()
    s = status()
    while (s["running"] or s["waiting"] or s["blocks_used"]) and time.time() - t0 < timeout:
        time.sleep(0.02)
        s = status()
    return s
s = settled()
check(s["blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0, "every block back after the run", s)

# ---- many more connections than sequence slots (16), half streamed, half whole: one
# polling thread suspends each while it waits and the engine resumes it
M = 48 if quick else 128
many = [None] * M
def many_worker(i):
    try:
        if i % 2:
            t, f, _, done = stream("/v1/completions", dict(params, prompt=prompts[i % R]))
            many[i] = (t.get(0), f.get(0)) if done else None
        else:
            st, r = request("POST", "/v1/completions", dict(params, prompt=prompts[i % R]))
            many[i] = (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) if st == 200 else r
    except Exception as e:  # reported below
        many[i] = e
threads = [threading.Thread(target=many_worker, args=(i,)) for i in range(M)]
for t in threads: t.start()
for t in threads: t.join()
same = sum(1 for i in range(M) if many[i] == alone[i % R])
check(same == M, "%d connections at once, streamed and whole, each equal to its prompt alone (%d/%d)" % (M, same, M),
      [(i, many[i]) for i in range(M) if many[i] != alone[i % R]][:2])

# ---- n > 1, stop strings, chat, logprobs, usage
st, r = request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 40, "temperature": 0, "n": 3})
check(st == 200 and len(r["choices"]) == 3 and all(c["text"] == alone[0][0] for c in r["choices"]),
      "n=3 greedy: three copies of the alone text", r)
stop = alone[0][0][8:11]
st, r = request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 40, "temperature": 0, "stop": [stop, "zzzz"]})
want = alone[0][0][:alone[0][0].index(stop)]
check(st == 200 and r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop",
      "stop string %r cuts the text" % stop, r)
texts, finish, _, done = stream("/v1/completions", {"prompt": prompts[0], "max_tokens": 40, "temperature": 0, "stop": stop})
check(done and texts.get(0) == want and finish.get(0) == "stop", "streamed stop string: nothing past it is sent", texts)
st, r = request("POST", "/v1/completions", {"prompt": prompts[1], "max_tokens": 16, "temperature": 0.9, "seed": 7, "n": 2,
                                             "top_p": 0.9, "top_k": 40, "min_p": 0.05, "logprobs": 3})
lp = r["choices"][0]["logprobs"] if st == 200 else None
check(st == 200 and len(lp["tokens"]) == 16 and len(lp["top_logprobs"][0]) <= 3 and all(x <= 0 for x in lp["token_logprobs"]),
      "sampled n=2 with logprobs", r)
st2, r2 = request("POST", "/v1/completions", {"prompt": prompts[1], "max_tokens": 16, "temperature": 0.9, "seed": 7, "n": 2,
                                               "top_p": 0.9, "top_k": 40, "min_p": 0.05})
check(st2 == 200 and [c["text"] for c in r2["choices"]] == [c["text"] for c in r["choices"]], "the same seed gives the same text")
st, r = request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 8, "temperature": 0})
check(st == 200 and r["usage"]["prompt_tokens"] > 0 and r["usage"]["completion_tokens"] == 8 and
      "cached_tokens" in r["usage"]["prompt_tokens_details"], "usage with cached prompt tokens", r.get("usage"))
chat = {"messages": [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12, "temperature": 0}
st, r = request("POST", "/v1/chat/completions", chat)
check(st == 200 and r["object"] == "chat.completion" and r["chat_template"] == "plain" and
      r["choices"][0]["message"]["role"] == "assistant", "chat completion names its (plain) template", r)
texts, finish, events, done = stream("/v1/chat/completions", chat)
check(done and texts.get(0) == r["choices"][0]["message"]["content"] and events[0]["choices"][0]["delta"].get("role") == "assistant",
      "streamed chat equals the whole answer", texts)
st, r = request("POST", "/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=2))
check(st == 200 and len(r["choices"][0]["logprobs"]["content"]) == 12, "chat logprobs")

# ---- bad input: status and OpenAI-style error
def bad(name, status_want, path, body=None, raw=None, param=None, code=None):
    st, r = request("POST", path, body=body, raw=raw)
    e = r.get("error") if isinstance(r, dict) else None
    ok = st == status_want and e and isinstance(e.get("message"), str) and e.get("type")
    if ok and param is not None: ok = e.get("param") == param
    if ok and code is not None: ok = e.get("code") == code
    check(ok, "%s -> %d" % (name, status_want), (st, r))
C, CH = "/v1/completions", "/v1/chat/completions"
bad("malformed JSON", 400, C, raw=b'{"prompt": "x", ', code="invalid_json")
bad("empty body", 400, C, raw=b"")
bad("not an object", 400, C, raw=b"[1, 2]")
bad("prompt of wrong type", 400, C, {"prompt": 5}, param="prompt")
bad("missing prompt", 400, C, {"max_tokens": 5}, param="prompt")
bad("max_tokens a string", 400, C, {"prompt": "x", "max_tokens": "ten"}, param="max_tokens")
bad("temperature a string", 400, C, {"prompt": "x", "temperature": "hot"}, param="temperature")
bad("temperature out of range", 400, C, {"prompt": "x", "temperature": 7}, param="temperature")
bad("stream not a bool", 400, C, {"prompt": "x", "stream": "yes"}, param="stream")
bad("stop of wrong type", 400, C, {"prompt": "x", "stop": 5}, param="stop")
bad("n = 0", 400, C, {"prompt": "x", "n": 0}, param="n")
bad("n beyond the sequences", 400, C, {"prompt": "x", "n": 100}, param="n")
bad("messages not an array", 400, CH, {"messages": "hi"}, param="messages")
bad("message without role", 400, CH, {"messages": [{"content": "hi"}]}, param="messages")
bad("unknown role", 400, CH, {"messages": [{"role": "wizard", "content": "hi"}]}, param="messages")
bad("unknown model", 404, C, {"model": "gpt-4", "prompt": "x"}, param="model", code="model_not_found")
bad("model not a string", 400, C, {"model": 3, "prompt": "x"}, param="model")
bad("prompt beyond the context", 400, C, {"prompt": "the cat sat on the mat " * 200}, code="context_length_exceeded")
bad("max_tokens = 0", 400, C, {"prompt": "x", "max_tokens": 0}, param="max_tokens")
bad("max_tokens < 0", 400, C, {"prompt": "x", "max_tokens": -5}, param="max_tokens")
bad("invalid UTF-8", 400, C, raw=b'{"prompt": "caf\xc3\x28 \xff"}', code="invalid_encoding")
bad("token id outside the vocabulary", 400, C, {"prompt": [1, 99999]}, param="prompt")
st, r = request("GET", "/v1/nothing")
check(st == 404 and "error" in r, "unknown endpoint -> 404")
st, r = request("GET", C)
check(st == 405 and "error" in r, "GET on a POST endpoint -> 405")
# oversized body: refused from its Content-Length, before it is sent
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000000\r\n\r\n")
resp = b""
try:
    while b"}}" not in resp:
        d = s.recv(65536)
        if not d: break
        resp += d
except OSError:
    pass
s.close()
check(resp.startswith(b"HTTP/1.1 413") and b'"error"' in resp, "oversized body -> 413", resp[:200])
# ... and one that says nothing of its size (chunked) is cut off at the limit
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
resp = b""
try:
    chunk = b"x" * 65536
    for _ in range(40):
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
except OSError:
    pass
try:
    while True:
        d = s.recv(65536)
        if not d: break
        resp += d
except OSError:
    pass
s.close()
check(resp.startswith(b"HTTP/1.1 413") or resp == b"", "chunked oversized body -> 413 or closed", resp[:100])

# ---- a client that hangs up mid-stream: its request is cancelled, its blocks freed
gen0 = settled()["generated_tokens"]
s = socket.create_connection(("127.0.0.1", port), timeout=10)
body = json.dumps({"prompt": "Once upon a time", "max_tokens": 360, "temperature": 0, "stream": True}).encode()
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
got = b""
while b"data: " not in got:
    got += s.recv(4096)
t0 = time.time()
mid = status()
while mid["blocks_used"] == 0 and time.time() - t0 < 5:  # the snapshot follows each engine step
    time.sleep(0.01)
    mid = status()
s.close()
t0 = time.time()
while time.time() - t0 < 5:
    s2 = status()
    if s2["running"] == 0 and s2["waiting"] == 0 and s2["blocks_used"] == 0:
        break
    time.sleep(0.02)
gen = s2["generated_tokens"] - gen0
check(mid["blocks_used"] > 0 and s2["blocks_used"] == 0 and s2["running"] == 0 and gen < 350,
      "hang-up mid-stream cancels the request (blocks %d while streaming, %d after; %d of 360 tokens made)" %
      (mid["blocks_used"], s2["blocks_used"], gen), (mid, s2))

# ... and one that hangs up while waiting for a whole (non-streamed) answer
gen0 = settled()["generated_tokens"]
s = socket.create_connection(("127.0.0.1", port), timeout=10)
body = json.dumps({"prompt": "Once upon a time", "max_tokens": 360, "temperature": 0}).encode()
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
t0 = time.time()
mid = status()
while mid["blocks_used"] == 0 and time.time() - t0 < 5:
    time.sleep(0.005)
    mid = status()
s.close()
t0 = time.time()
while time.time() - t0 < 5:
    s2 = status()
    if s2["running"] == 0 and s2["waiting"] == 0 and s2["blocks_used"] == 0:
        break
    time.sleep(0.02)
gen = s2["generated_tokens"] - gen0
check(mid["blocks_used"] > 0 and s2["blocks_used"] == 0 and gen < 350,
      "hang-up before a whole answer cancels it (%d of 360 tokens made)" % gen, (mid, s2))

# ---- churn: 24 clients for 3 s, streamed and whole, a third hanging up at random points
# (before the first token, mid-answer): every other answer is whole, and every block comes back
def churn_one(rng):
    stream_ = rng.random() < 0.5
    body = json.dumps({"prompt": "Once upon a time %d" % rng.randrange(1000), "max_tokens": rng.randrange(1, 120),
                       "temperature": 0, "stream": stream_}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
              b"Connection: close\r\n\r\n%s" % (len(body), body))
    mode = rng.random()
    if mode < 0.15:
        time.sleep(rng.random() * 0.03)
        s.close()
        return "hung"
    got = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        got += d
        if mode < 0.33 and len(got) > 300:
            s.close()
            return "hung"
    s.close()
    head, _, rest = got.partition(b"\r\n\r\n")
    if not stream_ and b"Transfer-Encoding: chunked" in head: # kept alive (slower than the keep-alive interval)
        body_, rest = rest, b""
        while body_:
            n, _, body_ = body_.partition(b"\r\n")
            n = int(n, 16)
            rest, body_ = rest + body_[:n], body_[n + 2:]
            if n == 0:
                break
    if stream_:
        whole = b"data: [DONE]" in rest and b'"finish_reason":"' in rest
    else:
        try:
            whole = len(json.loads(rest)["choices"]) == 1
        except ValueError:
            whole = False
    whole = whole and head.startswith(b"HTTP/1.1 200")
    return "ok" if whole else "bad"
churn = {"ok": 0, "hung": 0, "bad": 0, "exc": []}
churn_lock = threading.Lock()
def churn_worker(seed):
    rng = random.Random(seed)
    end = time.time() + 3
    while time.time() < end:
        try:
            r = churn_one(rng)
        except Exception as e:  # reported below
            r = "bad"
            churn["exc"].append(repr(e))
        with churn_lock:
            churn[r] += 1
threads = [threading.Thread(target=churn_worker, args=(i,)) for i in range(24)]
for t in threads: t.start()
for t in threads: t.join()
s2 = settled()
check(churn["bad"] == 0 and churn["ok"] > 0 and churn["hung"] > 0 and s2["blocks_used"] == 0 and s2["running"] == 0,
      "churn: %d answers whole, %d hang-ups, %d bad; every block back" % (churn["ok"], churn["hung"], churn["bad"]),
      (churn["exc"][:3], s2))

# ---- a stalled client: half a body, then silence; the timeout closes it, others carry on
s = socket.create_connection(("127.0.0.1", port), timeout=10)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": \"Once")
t0 = time.time()
check(request("GET", "/health")[0] == 200, "health answers while a client stalls")
try:
    closed = s.recv(4096)
except OSError:
    closed = b""
waited = time.time() - t0
s.close()
check(waited < 8 and not closed.startswith(b"HTTP/1.1 200"), "stalled upload closed after %.1f s (--timeout 2)" % waited, closed[:100])
# a slow client: one byte at a time, each within the timeout, still gets its answer
s = socket.create_connection(("127.0.0.1", port), timeout=10)
body = json.dumps({"prompt": prompts[0], "max_tokens": 40, "temperature": 0}).encode()
msg = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
for i in range(0, len(msg), 40):
    s.sendall(msg[i:i + 40])
    time.sleep(0.01)
resp = b""
while True:
    d = s.recv(65536)
    if not d: break
    resp += d
s.close()
check(resp.startswith(b"HTTP/1.1 200") and json.loads(resp.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == alone[0][0],
      "a slow client gets its answer", resp[:200])

# ---- after all that: health, a normal request, metrics, status
check(request("GET", "/health")[0] == 200, "health after the bad input")
st, r = request("POST", "/v1/completions", dict(params, prompt=prompts[2]))
check(st == 200 and r["choices"][0]["text"] == alone[2][0], "a normal request after the bad input")
text = request("GET", "/metrics")[1]
names_m = ["kvlm_kv_blocks_used", "kvlm_kv_blocks_free", "kvlm_kv_blocks_cached", "kvlm_prefix_cache_hit_rate",
           "kvlm_requests_running", "kvlm_requests_waiting", "kvlm_preemptions_total", "kvlm_generated_tokens_total",
           "kvlm_tokens_per_second", "kvlm_time_to_first_token_seconds_bucket", "kvlm_time_per_output_token_seconds_count"]
missing = [n for n in names_m if not re.search(r"^%s[ {]" % n, text, re.M)]
check(not missing, "metrics in Prometheus text format", missing)
check(metric("kvlm_prefix_cache_hit_rate") > 0, "repeated prompts hit the prefix cache")
s = status()
keys = ["model", "block_size", "n_blocks", "blocks_used", "blocks_cached", "blocks_free", "blocks_shared", "block_bytes",
        "kv_bytes_used", "kv_bytes_total", "prefix_hits", "prefix_misses", "prefix_hit_rate", "running", "waiting",
        "preemptions", "tokens_per_second", "requests", "swaps_out", "swaps_in", "recomputes", "swap_bytes",
        "swap_blocks", "swap_blocks_used"]
check(all(k in s for k in keys) and s["n_blocks"] == 24 and s["kv_bytes_total"] == 24 * s["block_bytes"], "/kvlm/status shape", s)

# ---- SIGTERM with requests in flight: they end with an error, the server exits cleanly
inflight = {}
def long_request(kind):
    body = {"prompt": "Once upon a time", "max_tokens": 360, "temperature": 0}
    try:
        inflight[kind] = stream(C, body) if kind == "stream" else request("POST", C, body)
    except Exception as e:
        inflight[kind] = e
ts = [threading.Thread(target=long_request, args=(k,)) for k in ("stream", "whole")]
for t in ts: t.start()
t0 = time.time()
while status()["running"] < 2 and time.time() - t0 < 5:
    time.sleep(0.005)
proc.send_signal(signal.SIGTERM)
for t in ts: t.join(timeout=15)
w, st_ = inflight.get("whole"), inflight.get("stream")
check(isinstance(w, tuple) and w[0] == 503 and "error" in w[1], "SIGTERM: a waiting request gets 503", w)
check(isinstance(st_, tuple) and st_[3] and any("error" in ev for ev in st_[2]), "SIGTERM: a stream ends with an error event and [DONE]",
      st_ if not isinstance(st_, tuple) else st_[2][-1:])
try:
    rc = proc.wait(timeout=15)
except subprocess.TimeoutExpired:
    proc.kill()
    rc = "hung"
check(rc == 0, "SIGTERM stops the server (exit %s)" % rc, proc.stderr.read()[-2000:])
print("%d failure(s)" % failures)
sys.exit(1 if failures else 0)
PY
