#!/usr/bin/env bash
# tests/cli_serve_spec: `kvlm serve --spec lookup` end to end (python3 stdlib
# only): 32 concurrent streaming greedy requests with repetitive prompts, in a
# pool small enough to force preemption, each equal to `kvlm run` of that
# prompt without speculation; drafts were checked and kept (/metrics); n > 1
# and sampling work; bad --spec refused (--draft: tests/cli_serve_draft.sh).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec /usr/bin/python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import subprocess, sys

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
failures = 0
def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " %s" % (detail,)))
    failures += 0 if cond else 1

r = subprocess.run([kvlm, "serve", "-m", model, "--port", "0", "--spec", "guess"], capture_output=True, text=True, timeout=30)
check(r.returncode == 1 and "expected lookup, draft or none" in r.stderr, "serve --spec guess refused", r.stderr)

# 40 blocks of 16 tokens: 32 requests of ~60-160 tokens need far more at once
proc, port = serve_http.start(kvlm, model, ["-c", "512", "--max-seqs", "16", "--kv-mem", "400KiB", "-t", "2",
                                             "--spec", "lookup", "--draft-n", "6"])
if not port:
    print("FAIL: no listening line")
    sys.exit(1)

def request(method, path, body=None): return serve_http.request(port, method, path, body)
def stream(body): return serve_http.stream(port, body)

names = ["Lily", "Tom", "Sue", "Max", "Ben", "Mia", "Sam", "Zoe"]
things = ["red ball", "big dog", "little cat", "blue box"]
prompts = ["%s had a %s. %s liked the %s. One day %s lost the %s. %s looked for the %s" %
           (n, t, n, t, n, t, n, t) for n in names for t in things][:32]
max_tokens = [60 + 13 * (i % 8) for i in range(32)]
alone = [serve_http.run_alone(kvlm, model, p, n) for p, n in zip(prompts, max_tokens)]
results = serve_http.stream_all(port, [{"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0}
                                       for i in range(32)])
same = sum(1 for i in range(32) if results[i][0] is not None and results[i][0] == alone[i])
bad = [(prompts[i], results[i][0], alone[i]) for i in range(32) if results[i][0] != alone[i]][:2]
check(same == 32, "32 concurrent streams with lookup speculation equal kvlm run of each prompt alone (%d/32)" % same, bad)

metric = serve_http.metrics(port)
drafted, kept, pre = metric("kvlm_spec_draft_tokens_total"), metric("kvlm_spec_accepted_tokens_total"), metric("kvlm_preemptions_total")
check(drafted > 0 and kept > 0 and kept <= drafted, "drafts checked and kept: %d of %d (%.0f%%), %d preemptions" %
      (kept, drafted, 100.0 * kept / max(drafted, 1), pre))

st, r = request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 40, "temperature": 0, "n": 3})
check(st == 200 and len(r["choices"]) == 3 and all(c["text"] == alone[0][:len(c["text"])] and len(c["text"]) > 0 for c in r["choices"]),
      "n = 3 greedy: three copies of the text alone", r)
st, r = request("POST", "/v1/completions", {"prompt": prompts[1], "max_tokens": 50, "temperature": 0.9, "seed": 5, "n": 2})
check(st == 200 and r["usage"]["completion_tokens"] > 0, "sampling with speculation answers", r)

# logit_bias under speculation: the drafts are checked against the biased distribution,
# so the text is kvlm run's with the same bias (-l) and no speculation
st, tk = request("POST", "/tokenize", {"prompt": alone[0], "add_special_tokens": False})
common = max(set(tk["tokens"]), key=tk["tokens"].count) if st == 200 else 0
for bias in (-100, 100):
    st, r = request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 40, "temperature": 0,
                                                "logit_bias": {str(common): bias}})
    want = serve_http.run_alone(kvlm, model, prompts[0], 40, ["-l", "%d%+d" % (common, bias)])
    got = r["choices"][0]["text"] if st == 200 else None
    check(got == want and got != alone[0][:len(got or "")], "logit_bias {%d: %d} with speculation: kvlm run -l %d%+d's "
          "text, not the unbiased one" % (common, bias, common, bias), (got, want))
st, r = request("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}})
check(st == 400 and r["error"]["param"] == "logit_bias", "a logit_bias token outside the vocabulary is refused", r)
st, r = request("POST", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}})
check(st == 400 and r["error"]["param"] == "logit_bias", "a logit_bias over 100 is refused", r)

check(serve_http.stop(proc) == 0, "server stops on SIGTERM")

# Windowed caches (random weights, window 8, blocks of 4): a llama with every
# layer local and gemma2's local store beside its global one. 8 concurrent
# requests with lookup speculation equal the plain server's answers asked one
# at a time (drafts are held past the window and rolled back).
import os, tempfile
tmp = tempfile.mkdtemp()
shapes = {"windowed llama": ["--arch", "llama", "--layers", "2", "--seed", "5"],
          "gemma2": ["--arch", "gemma2", "--layers", "4", "--tied", "--seed", "9"]}
def serve(path, extra):
    global port
    p, port = serve_http.start(kvlm, path, ["--block-size", "4", "-t", "1"] + extra)
    return p
for name, args in shapes.items():
    path = os.path.join(tmp, name.replace(" ", "_") + ".gguf")
    subprocess.run([kvlm, "synth", path, "--dim", "64", "--heads", "4", "--kv-heads", "2", "--hidden", "128",
                    "--sliding-window", "8"] + args, capture_output=True, timeout=60)
    asks = ["once upon a time %d the cat sat on the mat and the cat" % i for i in range(8)]
    body = lambda q: {"prompt": q, "max_tokens": 80, "temperature": 0}
    p = serve(path, [])
    plain = [request("POST", "/v1/completions", body(q))[1]["choices"][0]["text"] for q in asks] if port else []
    serve_http.stop(p)
    p = serve(path, ["--spec", "lookup"])
    got = serve_http.complete_all(port, [body(q) for q in asks])
    metric = serve_http.metrics(port) if port else (lambda name: -1)
    serve_http.stop(p)
    same = sum(1 for i in range(8) if plain and got[i] == plain[i] and got[i])
    check(same == 8, "%s: 8 concurrent answers with lookup speculation equal the plain server's (%d/8; %d drafts kept)" %
          (name, same, metric("kvlm_spec_accepted_tokens_total")), (got[:1], plain[:1]))
print("cli_serve_spec: %s" % ("all passed" if failures == 0 else "%d failed" % failures))
sys.exit(1 if failures else 0)
PY
