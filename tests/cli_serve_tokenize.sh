#!/usr/bin/env bash
# tests/cli_serve_tokenize: `kvlm serve`'s /tokenize and /detokenize (vLLM's and
# llama.cpp's) on stories260K, python3 stdlib. /tokenize gives the tokens `kvlm tokenize`
# gives, and counts a prompt, or a chat, exactly as the completion endpoints' usage
# counts it (prompt_tokens); add_special_tokens false drops BOS; with_pieces and
# return_token_strs give each token's text; /detokenize gives the text back (UTF-8
# through byte tokens too); bad requests get 400/404/405/415 with OpenAI-style errors.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout 60 python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import http.client, json, subprocess, sys

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
proc, port = serve_http.start(kvlm, model, ["-c", "256", "-t", "1"])
if not port:
    proc.kill(); print("FAIL: no listening line"); sys.exit(1)
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[:400]), flush=True)
    failures += not cond

def call(method, path, body=None, ctype="application/json"):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    c.request(method, path, body=data, headers={"Content-Type": ctype} if data is not None else {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text

text = "Once upon a time, there was a little girl."
st, r = call("POST", "/tokenize", {"prompt": text})
cli = subprocess.run([kvlm, "tokenize", "-m", model, text], capture_output=True, text=True).stdout.split()
check(st == 200 and r["tokens"] == [int(x) for x in cli] and r["count"] == len(cli) and r["max_model_len"] == 256,
      "/tokenize gives kvlm tokenize's %d tokens, count and max_model_len" % len(cli), (st, r, cli))
st, c = call("POST", "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
check(st == 200 and c["usage"]["prompt_tokens"] == r["count"], "a completion counts the same prompt tokens", c)
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about cats."}]
st, rm = call("POST", "/tokenize", {"messages": msgs})
st2, cc = call("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0})
check(st == 200 and st2 == 200 and rm["count"] == cc["usage"]["prompt_tokens"] > r["count"] // 2,
      "a chat's messages: %s tokens, as the chat completion's usage counts them" % rm.get("count"), (rm, cc))
st, r2 = call("POST", "/tokenize", {"content": text, "add_special": False})
check(st == 200 and r2["tokens"] == r["tokens"][1:], "llama.cpp's field names; add_special false drops BOS", r2)
st, r3 = call("POST", "/tokenize", {"prompt": text, "add_special_tokens": False, "with_pieces": True,
                                    "return_token_strs": True})
ok = st == 200 and [t["id"] for t in r3["tokens"]] == r2["tokens"] and r3["token_strs"] == [t["piece"] for t in r3["tokens"]]
check(ok and "".join(r3["token_strs"]).replace("\u2581", " ").strip() == text,
      "with_pieces ([{id, piece}]) and return_token_strs: the pieces make the text", r3)
for t in [text, "h\u00e9llo w\u00f6rld \u2713 \U0001F600", "  two spaces, a\ttab\nand a newline"]:
    st, tk = call("POST", "/tokenize", {"prompt": t, "add_special_tokens": False})
    st2, dt = call("POST", "/detokenize", {"tokens": tk["tokens"]})
    check(st == st2 == 200 and dt["prompt"] == dt["content"] and dt["prompt"].lstrip(" ") == t.lstrip(" "),
          "/detokenize gives %r back (%d tokens)" % (t, len(tk["tokens"])), (tk, dt))
st, dt = call("POST", "/detokenize", {"tokens": []})
check(st == 200 and dt["prompt"] == "", "no tokens: the empty text", dt)
# a field kvlm does not use is ignored (as vLLM does; kvlm serve --strict-params refuses it: cli_serve_compat.sh)
st, tk = call("POST", "/tokenize", {"prompt": "x", "bogus": 1})
check(st == 200 and tk["count"] >= 1, "an unknown field is ignored", tk)

bad = [("GET", "/tokenize", None, "application/json", 405, None),
       ("POST", "/tokenize", "{not json", "application/json", 400, "invalid_json"),
       ("POST", "/tokenize", {"prompt": "x", "model": "other"}, "application/json", 404, "model_not_found"),
       ("POST", "/tokenize", {}, "application/json", 400, "missing_required_parameter"),
       ("POST", "/tokenize", {"prompt": "x", "messages": msgs}, "application/json", 400, "missing_required_parameter"),
       ("POST", "/tokenize", {"prompt": 5}, "application/json", 400, "invalid_type"),
       ("POST", "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "application/json", 400, None),
       ("POST", "/tokenize", {"prompt": "x"}, "text/plain", 415, "unsupported_media_type"),
       ("POST", "/tokenize", b'{"prompt": "\xff"}', "application/json", 400, "invalid_encoding"),
       ("POST", "/detokenize", {"tokens": [1, 99999]}, "application/json", 400, "invalid_value"),
       ("POST", "/detokenize", {"tokens": "1 2"}, "application/json", 400, "invalid_value"),
       ("POST", "/detokenize", {"tokens": [1.5]}, "application/json", 400, "invalid_value")]
for method, path, body, ctype, want, code in bad:
    st, r = call(method, path, body, ctype)
    err = r.get("error", {}) if isinstance(r, dict) else {}
    check(st == want and "message" in err and (code is None or err.get("code") == code),
          "%s %s %s: %d %s" % (method, path, (body if not isinstance(body, bytes) else body.decode("latin-1"))
                               if body is not None else "", want, code or ""), (st, r))
check(proc.poll() is None, "the server is still running")
serve_http.stop(proc)
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
