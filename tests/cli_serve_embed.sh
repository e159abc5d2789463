#!/usr/bin/env bash
# tests/cli_serve_embed: `kvlm serve --embeddings`'s POST /v1/embeddings on random-weight
# models `kvlm synth` writes (a llama as a decoder embedder, a bert encoder), python3 stdlib:
# every input shape (a string, strings, token ids, arrays of them) gives the vectors `kvlm
# embed` gives alone; base64 decodes to the same floats; dimensions; usage; 16 requests at
# once beside a completion; /metrics counts them; errors in OpenAI's shape (400, 404, 405,
# 415, 501 without --embeddings, an encoder's completions refused); then the official openai
# npm client (tests/web/openai_embed.mjs) when tests/web/node_modules is there.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$KVLM" synth "$tmp/llama-embed.gguf" --arch llama --dim 64 --heads 4 --kv-heads 2 --hidden 128 --layers 2 \
    --vocab 300 --ctx 128 --type f32 --seed 9 --pooling mean > /dev/null || { echo "FAIL: synth"; exit 1; }
"$KVLM" synth "$tmp/bert-embed.gguf" --arch bert --dim 64 --heads 4 --hidden 128 --layers 2 --vocab 300 \
    --ctx 64 --type f32 --seed 10 > /dev/null || { echo "FAIL: synth bert"; exit 1; }
timeout 240 python3 - "$KVLM" "$tmp" "$here/helpers" <<'PY'
import base64, http.client, json, struct, subprocess, sys, threading

kvlm, tmp = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[:500]), flush=True)
    failures += not cond

def call(port, method, path, body=None, ctype="application/json"):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    c.request(method, path, body=data, headers={"Content-Type": ctype} if data is not None else {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text

def alone(model, args):
    out = subprocess.run([kvlm, "embed", "-m", model, "-t", "1"] + args, capture_output=True, text=True, check=True).stdout
    return [float(x) for x in out.split()]

def close(got, want, tol=1e-6):
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= tol * max(abs(b) for b in want)

def ntok(model, text):
    return len(subprocess.run([kvlm, "tokenize", "-m", model, text], capture_output=True, text=True).stdout.split())

llama, bert = tmp + "/llama-embed.gguf", tmp + "/bert-embed.gguf"

# ---- without --embeddings: 501 ----------------------------------------------------------
proc, port = serve_http.start(kvlm, llama, ["-t", "1"])
st, r = call(port, "POST", "/v1/embeddings", {"input": "x"})
check(st == 501 and "--embeddings" in r["error"]["message"] and r["error"]["code"] == "not_supported",
      "without --embeddings: 501 saying to start with --embeddings", (st, r))
check(serve_http.stop(proc) == 0, "the server stops cleanly")

# ---- a decoder embedder -----------------------------------------------------------------
proc, port = serve_http.start(kvlm, llama, ["-t", "2", "--embeddings", "--max-seqs", "8"])
texts = ["The quick brown fox", "jumps over the lazy dog", "a b c d e f g h"]
st, r = call(port, "POST", "/v1/embeddings", {"input": texts[0], "model": "llama-embed", "user": "u1"})
ok = st == 200 and r["object"] == "list" and r["model"] == "llama-embed" and len(r["data"]) == 1
ok = ok and r["data"][0]["object"] == "embedding" and r["data"][0]["index"] == 0
check(ok and close(r["data"][0]["embedding"], alone(llama, ["-p", texts[0]])),
      "a string: OpenAI's shape, the vector kvlm embed gives", (st, str(r)[:300]))
check(ok and r["usage"] == {"prompt_tokens": ntok(llama, texts[0]), "total_tokens": ntok(llama, texts[0])},
      "usage: the input's tokens (BOS included)", r.get("usage"))
norm = sum(v * v for v in r["data"][0]["embedding"]) ** 0.5 if ok else 0
check(abs(norm - 1) < 1e-6, "the vector has unit length", norm)
st, r = call(port, "POST", "/v1/embeddings", {"input": texts})
check(st == 200 and [d["index"] for d in r["data"]] == [0, 1, 2] and
      all(close(r["data"][i]["embedding"], alone(llama, ["-p", texts[i]])) for i in range(3)) and
      r["usage"]["prompt_tokens"] == sum(ntok(llama, t) for t in texts),
      "an array of strings: each vector in order, usage summed", (st, str(r)[:300]))
ids = [5, 17, 42, 99, 7, 250]
st, r = call(port, "POST", "/v1/embeddings", {"input": ids})
check(st == 200 and close(r["data"][0]["embedding"], alone(llama, ["--ids", " ".join(map(str, ids))])) and
      r["usage"]["prompt_tokens"] == 6, "token ids: as kvlm embed --ids (no BOS added)", (st, str(r)[:300]))
st, r = call(port, "POST", "/v1/embeddings", {"input": [ids, [8, 9]]})
check(st == 200 and len(r["data"]) == 2 and close(r["data"][1]["embedding"], alone(llama, ["--ids", "8 9"])),
      "arrays of token ids", (st, str(r)[:300]))
st, f = call(port, "POST", "/v1/embeddings", {"input": texts, "encoding_format": "float"})
st2, b = call(port, "POST", "/v1/embeddings", {"input": texts, "encoding_format": "base64"})
dec = [list(struct.unpack("<%df" % (len(base64.b64decode(d["embedding"])) // 4), base64.b64decode(d["embedding"])))
       for d in b["data"]] if st2 == 200 else []
check(st == st2 == 200 and len(dec) == 3 and all(dec[i] == [struct.unpack("<f", struct.pack("<f", v))[0]
                                                            for v in f["data"][i]["embedding"]] for i in range(3)),
      "base64: little-endian float32, the very floats of the float format", (st, st2))
st, r = call(port, "POST", "/v1/embeddings", {"input": texts[1], "dimensions": 16})
v = r["data"][0]["embedding"] if st == 200 else []
check(st == 200 and len(v) == 16 and abs(sum(x * x for x in v) - 1) < 1e-5 and
      close(v, alone(llama, ["-p", texts[1], "--dimensions", "16"])), "dimensions 16: the first 16, normalised", (st, r))

# 16 requests at once (and a completion among them): each as alone
results, lock = {}, threading.Lock()
inputs = ["request %d: %s" % (i, "xy " * (i % 5)) for i in range(16)]
def one(i):
    s, rr = call(port, "POST", "/v1/embeddings", {"input": inputs[i]})
    with lock:
        results[i] = (s, rr)
ths = [threading.Thread(target=one, args=(i,)) for i in range(16)]
comp = []
ths.append(threading.Thread(target=lambda: comp.append(call(port, "POST", "/v1/completions",
                                                            {"prompt": "hello", "max_tokens": 8, "temperature": 0}))))
for t in ths: t.start()
for t in ths: t.join()
check(all(results[i][0] == 200 for i in range(16)) and
      all(close(results[i][1]["data"][0]["embedding"], alone(llama, ["-p", inputs[i]])) for i in (0, 7, 15)),
      "16 requests at once: each vector as alone")
check(comp and comp[0][0] == 200 and comp[0][1]["choices"][0]["finish_reason"] in ("stop", "length"),
      "a completion among them: answered", comp)
st, m = call(port, "GET", "/metrics")
n_emb = [l for l in m.splitlines() if l.startswith("kvlm_embeddings_total ")] if st == 200 else []
check(n_emb and float(n_emb[0].split()[1]) == 1 + 3 + 1 + 2 + 3 + 3 + 1 + 16,
      "/metrics: kvlm_embeddings_total counts every input embedded (30)", n_emb)

too_long = list(range(3, 140))
bad = [({"input": ""}, 400, "input", "invalid_value"),
       ({"input": []}, 400, "input", "invalid_value"),
       ({"input": [[]]}, 400, "input", "invalid_value"),
       ({}, 400, "input", "missing_required_parameter"),
       ({"input": 5}, 400, "input", "invalid_type"),
       ({"input": [1.5]}, 400, "input", "invalid_type"),
       ({"input": [1, 99999]}, 400, "input", "invalid_value"),
       ({"input": too_long}, 400, "input", "context_length_exceeded"),
       ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", "invalid_value"),
       ({"input": "x", "dimensions": 0}, 400, "dimensions", "invalid_value"),
       ({"input": "x", "dimensions": 65}, 400, "dimensions", "invalid_value"),
       ({"input": "x", "bogus": 1}, 400, "bogus", "unknown_parameter"),
       ({"input": "x", "model": "other"}, 404, "model", "model_not_found"),
       ({"input": "x", "user": 7}, 400, "user", "invalid_type")]
for body, status, param, code in bad:
    st, r = call(port, "POST", "/v1/embeddings", body)
    e = r.get("error", {}) if isinstance(r, dict) else {}
    check(st == status and e.get("param") == param and e.get("code") == code and e.get("message"),
          "%s: %d %s" % (json.dumps(body)[:60], status, code), (st, r))
st, r = call(port, "GET", "/v1/embeddings")
check(st == 405, "GET: 405", (st, r))
st, r = call(port, "POST", "/v1/embeddings", "{nope")
check(st == 400 and r["error"]["code"] == "invalid_json", "not JSON: 400", (st, r))
st, r = call(port, "POST", "/v1/embeddings", {"input": "x"}, "text/plain")
check(st == 415, "not application/json: 415", (st, r))
check(serve_http.stop(proc) == 0, "the server stops cleanly")

# ---- an encoder -----------------------------------------------------------------------
p = subprocess.run([kvlm, "serve", "-m", bert, "--port", "0"], capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "--embeddings" in p.stderr, "an encoder without --embeddings: refused at start", p.stderr)
proc, port = serve_http.start(kvlm, bert, ["-t", "2", "--embeddings"])
st, r = call(port, "POST", "/v1/embeddings", {"input": ["Hello, World!", "naïve café"]})
check(st == 200 and all(close(r["data"][i]["embedding"], alone(bert, ["-p", t]))
                        for i, t in enumerate(["Hello, World!", "naïve café"])) and
      r["usage"]["prompt_tokens"] == ntok(bert, "Hello, World!") + ntok(bert, "naïve café"),
      "bert: vectors as kvlm embed; usage counts [CLS] and [SEP]", (st, str(r)[:300]))
st, r = call(port, "POST", "/v1/completions", {"prompt": "x"})
check(st == 501 and "encoder" in r["error"]["message"], "bert: completions 501", (st, r))
check(serve_http.stop(proc) == 0, "the server stops cleanly")
sys.exit(1 if failures else 0)
PY
rc=$?
[ "$rc" -eq 0 ] || exit "$rc"

# ---- the official openai npm client ------------------------------------------------------
WEB_DIR="$here/web"
if ! command -v node > /dev/null || [ ! -d "$WEB_DIR/node_modules/openai" ]; then
    echo "SKIP (openai client part): node or $WEB_DIR/node_modules missing (bash scripts/setup.sh runs npm ci)"
    exit 0
fi
"$KVLM" serve -m "$tmp/llama-embed.gguf" --host 127.0.0.1 --port 0 -t 2 --embeddings --max-seqs 16 \
    > "$tmp/serve.out" 2> "$tmp/serve.err" &
pid=$!
URL=""
for _ in $(seq 300); do
    URL="$(sed -n 's/^kvlm serve: listening on //p' "$tmp/serve.out")"
    [ -n "$URL" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
if [ -z "$URL" ]; then echo "FAIL: kvlm serve did not start: $(cat "$tmp/serve.err")"; kill "$pid" 2>/dev/null; exit 1; fi
KVLM_URL="$URL" KVLM_MODEL="$tmp/llama-embed.gguf" timeout 120 node "$WEB_DIR/openai_embed.mjs"
rc=$?
kill -TERM "$pid" 2>/dev/null
wait "$pid" 2>/dev/null || { echo "FAIL: kvlm serve exited with an error: $(tail -5 "$tmp/serve.err")"; rc=1; }
if grep -q "Sanitizer\|runtime error" "$tmp/serve.err"; then echo "FAIL: sanitizer report: $(tail -20 "$tmp/serve.err")"; rc=1; fi
exit "$rc"
