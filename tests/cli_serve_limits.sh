#!/usr/bin/env bash
# tests/cli_serve_limits: input a client controls, past what the parsers take, on
# stories260K through `kvlm serve` and through the CLI (python3 stdlib): a GBNF grammar of
# 5,000 and 50,000 nested groups, a body nested past JSON's 2,048 levels, a schema past
# its 64 levels, a pattern past its 64 groups, each refused with a 400 (or, from `kvlm
# grammar --grammar-file`, one line) that names the limit, and the server still answers
# the next request; the deepest schema the limits allow is answered. A pattern ^(a*)*$
# works; a $ref cycle that could never end gets the same message from the server and from
# `kvlm grammar`, and a recursive tree schema works in both; logit_bias keys other than
# decimal digits (" 12", "12 ", "+12", "1e1", "0x10") get a 400, and -l the same; `kvlm
# run` refuses the sampling values the server refuses, with the same words after the name.
# Under ulimit -s 512 (a thread's default stack then), the deepest schema is still answered:
# the HTTP thread has a stack of its own size.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout -k 5 240 /usr/bin/python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import json, os, re, subprocess, sys, tempfile
kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
sys.setrecursionlimit(10000)  # json.dumps of the deep schemas below
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[:400]), flush=True)
    failures += not cond

tmp = tempfile.mkdtemp()
def cli(args, stdin=""):
    """(exit status, stderr's last line) of kvlm ARGS"""
    r = subprocess.run([kvlm] + args, capture_output=True, text=True, timeout=60, input=stdin)
    return r.returncode, (r.stderr.strip().splitlines() or [""])[-1], r.stdout

def deep_grammar(n):
    return "root ::= " + "(" * n + '"a"' + ")" * n + "\n"

# ---- kvlm grammar --grammar-file: one line naming the limit, no crash ----
for n in (5000, 50000):
    path = os.path.join(tmp, "deep%d.gbnf" % n)
    open(path, "w").write(deep_grammar(n))
    rc, err, _ = cli(["grammar", "--grammar-file", path])
    check(rc == 1 and "line 1, column 266: groups nested deeper than 256 levels" in err,
          "kvlm grammar --grammar-file: %d nested groups refused by the limit (%s)" % (n, err), (rc, err))

proc, port = serve_http.start(kvlm, model, ["-t", "1"])
if not port:
    sys.exit(1)
def post(path, body=None, raw=None):
    try:
        return serve_http.request(port, "POST", path, body, raw=raw, timeout=60)
    except Exception as e:  # the server died
        return 0, {"exception": repr(e)}
def alive(after):
    st, j = post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    check(st == 200 and j["choices"][0]["text"], "the server answers the next request (after %s)" % after, j)
def refused(st, j, param, want, what):
    e = j.get("error", {}) if isinstance(j, dict) else {}
    check(st == 400 and e.get("param") == param and want in e.get("message", ""),
          "%s: 400 (%s)" % (what, e.get("message", "")[:120]), (st, j))

# ---- deep grammars, on both endpoints ----
for path in ("/v1/completions", "/v1/chat/completions"):
    for n in (5000, 50000):
        body = {"max_tokens": 4, "grammar": deep_grammar(n)}
        body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Once"})
        st, j = post(path, body)
        refused(st, j, "grammar", "groups nested deeper than 256 levels", "%s: a grammar of %d nested groups" % (path, n))
        alive("%d nested groups" % n)

# ---- a body past JSON's limit (jansson: values 2,048 levels deep) ----
for n in (2047, 50000):
    raw = ('{"prompt": "x", "stop": ' + "[" * n + "1" + "]" * n + "}").encode()
    st, j = post("/v1/completions", raw=raw)
    e = j.get("error", {}) if isinstance(j, dict) else {}
    check(st == 400 and e.get("code") == "invalid_json" and "maximum parsing depth reached" in e.get("message", ""),
          "a body nested %d deep: 400 (%s)" % (n + 2, e.get("message", "")[:100]), (st, j))
alive("a deep body")

def with_schema(schema, **kw):
    return dict({"prompt": "Once", "max_tokens": 24, "response_format": {"type": "json_schema",
                 "json_schema": {"name": "s", "schema": schema}}}, **kw)
def nested(n, inner, wrap):
    s = inner
    for _ in range(n):
        s = wrap(s)
    return s

# ---- a deep schema, a deep pattern ----
st, j = post("/v1/completions", with_schema(nested(1000, {}, lambda s: {"type": "array", "items": s})))
refused(st, j, "response_format", "subschemas nested deeper than 64 levels", "a schema of 1000 nested items")
st, j = post("/v1/completions", with_schema({"anyOf": [nested(65, {"type": "null"}, lambda s: {"anyOf": [s]})]}))
refused(st, j, "response_format", "subschemas nested deeper than 64 levels", "a schema of 66 nested anyOf")
st, j = post("/v1/completions", with_schema({"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000}))
refused(st, j, "response_format", "'pattern': groups nested deeper than 64 levels", "a pattern of 5000 nested groups")
alive("a deep schema and pattern")
# the deepest the limits allow: 64 levels of properties over a const as deep as the body may be
const = nested(1915, 1, lambda s: [s])
deepest = nested(64, {"const": const}, lambda s: {"type": "object", "properties": {"a": s}, "required": ["a"]})
st, j = post("/v1/completions", with_schema(deepest, max_tokens=2))
check(st == 200, "64 levels of properties over a const, 2,048 levels of JSON in all: answered", (st, str(j)[:300]))

# ---- ^(a*)*$: a star over what can be empty ----
schema = {"type": "string", "pattern": "^(a*)*$"}
texts = []
for seed in range(4):
    st, j = post("/v1/completions", with_schema(schema, n=4, seed=seed, temperature=1, max_tokens=12))
    check(st == 200, "^(a*)*$ (seed %d) is taken" % seed, j)
    if st == 200:
        texts += [c["text"] for c in j["choices"] if c["finish_reason"] == "stop"]
check(texts and all(re.fullmatch(r'\s*"a*"', t) for t in texts),
      "^(a*)*$: each of the %d answers that ended is a string of a's" % len(texts), texts)
rc, err, out = cli(["run", "-m", model, "-p", "Once", "-n", "12", "--seed", "1", "-t", "1", "--json-schema", json.dumps(schema)])
check(rc == 0, "kvlm run --json-schema '^(a*)*$' runs", err)

# ---- a $ref cycle: the same message from both; a tree: works in both ----
cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
st, j = post("/v1/completions", with_schema(cycle))
msg = j.get("error", {}).get("message", "") if isinstance(j, dict) else ""
rc, err, _ = cli(["grammar", "--json-schema", json.dumps(cycle)])
want = "json_schema at #/$defs/a: '$ref' '#/$defs/a' comes back to itself"
check(st == 400 and rc == 1 and want in msg and msg.split("': ", 1)[-1] == err.split(": ", 1)[-1],
      "a $ref cycle: the server and kvlm grammar refuse it alike (%s)" % err, (msg, err))
rc2, err2, _ = cli(["run", "-m", model, "-n", "4", "--json-schema", json.dumps(cycle)])
check(rc2 == 1 and err2.split(": ", 1)[-1] == err.split(": ", 1)[-1], "kvlm run refuses it alike", err2)
tree = {"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                                              "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                       "maxItems": 2}},
                           "required": ["name"]}}, "$ref": "#/$defs/node"}
st, j = post("/v1/completions", with_schema(tree, n=4, seed=1, temperature=1, max_tokens=40))
ended = [c["text"] for c in j.get("choices", []) if c["finish_reason"] == "stop"] if st == 200 else []
def is_tree(v):
    return (isinstance(v, dict) and isinstance(v.get("name"), str) and set(v) <= {"name", "kids"}
            and all(is_tree(k) for k in v.get("kids", [])))
check(st == 200 and all(is_tree(json.loads(t)) for t in ended),
      "a recursive tree schema is answered (%d of 4 ended, each a tree)" % len(ended), j)
rc, err, out = cli(["run", "-m", model, "-p", "Once", "-n", "40", "--seed", "1", "-t", "1", "--json-schema", json.dumps(tree)])
check(rc == 0, "kvlm run --json-schema takes the tree", err)

# ---- logit_bias keys: decimal digits only ----
for key in (" 12", "12 ", "+12", "1e1", "0x10", "-1", "012", "", "12.0"):
    st, j = post("/v1/completions", {"prompt": "Once", "max_tokens": 2, "logit_bias": {key: 1}})
    refused(st, j, "logit_bias", "key '%s'" % key, "logit_bias key %r" % key)
st, j = post("/v1/completions", {"prompt": "Once", "max_tokens": 2, "logit_bias": {"12": 1, "0": -1}})
check(st == 200, "logit_bias keys '12' and '0' are taken", j)
for arg in (" 12+1", "+12+1", "1e1+1", "0x10+1", "012+1", "12+0x10", "12"):
    rc, err, _ = cli(["run", "-m", model, "-n", "2", "-l", arg])
    check(rc == 1 and "decimal digits" in err, "kvlm run -l %r is refused (%s)" % (arg, err), err)
rc, err, _ = cli(["run", "-m", model, "-n", "2", "-l", "12+1", "-l", "3-inf"])
check(rc == 0, "kvlm run -l 12+1 -l 3-inf runs", err)

# ---- the sampling values: kvlm run and chat refuse what the server refuses, in the same words ----
cases = [("temperature", "--temp", -1), ("temperature", "--temp", 2.5), ("top_p", "--top-p", 5),
         ("top_p", "--top-p", -0.5), ("min_p", "--min-p", 2), ("top_k", "--top-k", -3)]
for field, opt, v in cases:
    st, j = post("/v1/completions", {"prompt": "Once", "max_tokens": 2, field: v})
    smsg = j.get("error", {}).get("message", "") if isinstance(j, dict) else ""
    rc, err, _ = cli(["run", "-m", model, "-n", "2", opt, str(v)])
    said = smsg.split("' ", 1)[-1]  # "'top_p' must be between 0 and 1" -> "must be between 0 and 1"
    check(st == 400 and rc == 1 and said.startswith("must be") and err == "kvlm run: %s %g: %s" % (opt, v, said),
          "%s %g: the server and kvlm run refuse it alike (%s | %s)" % (opt, v, smsg, err), (smsg, err))
rc, err, _ = cli(["chat", "-m", model, "--top-p", "5"], stdin="Hi\n")
check(rc == 1 and err == "kvlm chat: --top-p 5: must be between 0 and 1", "kvlm chat --top-p 5 is refused alike", err)
rc, err, _ = cli(["run", "-m", model, "-n", "2", "--temp", "2", "--top-p", "1", "--min-p", "0", "--top-k", "-1"])
check(rc == 0, "the ranges' ends are taken (--temp 2 --top-p 1 --min-p 0 --top-k -1)", err)

alive("everything above")
check(serve_http.stop(proc) == 0, "the server exits cleanly")

# ---- the HTTP thread's stack is its own size, not ulimit -s's: the deepest body under a 512 KiB limit ----
small = subprocess.Popen(["bash", "-c", 'ulimit -s 512 && exec "$0" serve -m "$1" --port 0 -t 1', kvlm, model],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", small.stdout.readline())
port = int(m.group(1)) if m else 0
st, j = post("/v1/completions", with_schema(deepest, max_tokens=2)) if port else (0, {})
check(st == 200, "under ulimit -s 512, the deepest schema the limits allow is answered", (st, str(j)[:200]))
check(serve_http.stop(small) == 0, "that server exits cleanly")
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
