#!/usr/bin/env bash
# tests/cli_serve_truth: answers that say what happened, over HTTP: a
# completion the KV pool cannot hold ends with finish_reason "kv_cache_full"
# (and the server logs why); frequency/presence penalties (negative: repeats
# encouraged) change greedy text;
# OpenAI fields the server does not implement are refused with a 400 naming
# them unless they ask for nothing; unknown fields are ignored (and logged;
# --strict-params refuses them: tests/cli_serve_compat.sh).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout 120 python3 - "$KVLM" "$MODEL" <<'PY'
import http.client, json, re, subprocess, sys, tempfile

kvlm, model = sys.argv[1], sys.argv[2]
log = tempfile.TemporaryFile(mode="w+")
# 2 blocks of 16 tokens (20 KiB each) under a context of 512: one sequence outgrows the pool
proc = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-c", "512", "--max-seqs", "1",
                         "--kv-mem", "40KiB", "-t", "2"], stdout=subprocess.PIPE, stderr=log, text=True)
m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", proc.stdout.readline())
if not m:
    proc.kill(); log.seek(0)
    print("FAIL: no listening line; stderr: " + log.read()); sys.exit(1)
port = int(m.group(1))
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)))
    failures += not cond

def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    j = json.loads(r.read())
    c.close()
    return r.status, j

base = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
st, j = post("/v1/completions", base)
fin = j["choices"][0]["finish_reason"] if st == 200 else None
check(st == 200 and fin == "kv_cache_full" and j["usage"]["completion_tokens"] < 200,
      "a completion the pool cannot hold ends with kv_cache_full (%s after %s tokens)" %
      (fin, j.get("usage", {}).get("completion_tokens")), j)
short = dict(base, max_tokens=24)  # within the pool: 5 prompt tokens + 24 < 32
st, j = post("/v1/completions", short)
check(st == 200 and j["choices"][0]["finish_reason"] == "length", "max_tokens still ends with length", j)
plain = j["choices"][0]["text"]
st, j = post("/v1/completions", dict(short, frequency_penalty=-2.0, presence_penalty=-2.0))
check(st == 200 and j["choices"][0]["text"] != plain, "penalties change greedy text (%r vs %r)" %
      (j.get("choices", [{}])[0].get("text"), plain), j)
for key, val in [("tools", []), ("tool_choice", "none"), ("response_format", {"type": "text"}), ("logit_bias", {}),
                 ("echo", False), ("best_of", 1), ("suffix", None), ("user", "u1"), ("echo", True),
                 ("repeat_penalty", 1.1), ("nonsense", 1), ("metadata", {"k": "v"})]:
    path = "/v1/chat/completions" if key in ("tools", "tool_choice", "response_format") else "/v1/completions"
    body = dict(short, **{key: val})
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, key: val}
    st, j = post(path, body)
    check(st == 200, "%s=%s is accepted" % (key, json.dumps(val)), j)
for key, val in [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
                 ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
                 ("grammar", "root ::= x"), ("logit_bias", {"5": 1000}),
                 ("best_of", 3), ("suffix", "end"), ("frequency_penalty", 3), ("repeat_penalty", 101)]:
    chat = key in ("tools", "tool_choice", "response_format")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, key: val} if chat else dict(short, **{key: val})
    st, j = post("/v1/chat/completions" if chat else "/v1/completions", body)
    err = j.get("error", {}) if isinstance(j, dict) else {}
    check(st == 400 and err.get("param") == key and key in err.get("message", ""),
          "%s=%s is refused with a 400 naming it (%s)" % (key, json.dumps(val), err.get("message")), j)
proc.terminate()
proc.wait(timeout=20)
log.seek(0)
text = log.read()
check("kv_cache_full" in text and "cannot hold it" in text, "the server logged why the completion ended", text[-500:])
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
