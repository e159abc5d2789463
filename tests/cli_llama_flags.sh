#!/usr/bin/env bash
# tests/cli_llama_flags: twenty command lines from llama.cpp's READMEs (b4747: README.md,
# examples/main/README.md, examples/server/README.md), each run with its llama-cli /
# llama-server / llama-perplexity replaced by kvlm run / serve / perplexity and nothing
# else changed: the model paths they name (model.gguf, models/7B/ggml-model.gguf, ...)
# are links to stories260K.gguf in a scratch folder, grammars/json.gbnf and file.txt are
# files there. Where kvlm has every feature the line uses, it runs (the output checked);
# where it lacks one, it exits 1 saying "llama.cpp's FLAG is not supported by kvlm", never
# "unknown option". Servers get "--port N" (a free port) appended, or their 8080 changed,
# so the test never depends on port 8080 being free; each is stopped within seconds.
# Then the aliases mean what kvlm's own names mean (the same text, greedy and seeded),
# -n -1 / -2 / 0 as llama.cpp has them, --draft N a count, -s -1 random, --version, and
# `run --temp -1 --top-p 5` refused by the server's own check.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
CORPORA="${KVLM_CORPORA:-${KVLM_CORPORA_DEFAULT:-../shared/corpora}}"
MODEL="$MODELS/stories260K.gguf"
TEXT="$CORPORA/tinystories-valid-head.txt"
[ -f "$MODEL" ] || { echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; }
[ -f "$TEXT" ] || { echo "SKIP: $TEXT not found (set KVLM_CORPORA)"; exit 77; }
exec timeout -k 5 240 python3 - "$(cd "$(dirname "$KVLM")" && pwd)/$(basename "$KVLM")" \
  "$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")" "$TEXT" <<'PY'
import json, os, re, shlex, signal, socket, subprocess, sys, tempfile, time, urllib.request

kvlm, model, text_path = sys.argv[1], sys.argv[2], sys.argv[3]
# the sanitizer build (each process starts in about a second there): the lines whose code another
# line runs too are left out (said), the parsing of every one is still checked
quick = bool(os.environ.get("KVLM_TEST_QUICK"))
failures = 0
def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)[-600:]), flush=True)
    failures += 0 if cond else 1

work = tempfile.mkdtemp(prefix="kvlm_llama_flags_")
os.chdir(work)
for p in ["model.gguf", "draft.gguf", "my_model.gguf", "models/gemma-1.1-7b-it.Q4_K_M.gguf",
          "models/7B/ggml-model.gguf"]:
    os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    os.symlink(model, p)
os.makedirs("grammars", exist_ok=True)
# a JSON object grammar of our own (GBNF), under the name the README uses
GBNF = r'''root   ::= object
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
value  ::= object | array | string | number | ("true" | "false" | "null") ws
array  ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" [a-zA-Z0-9 ]* "\"" ws
number ::= ("-"? [0-9]+) ws
ws     ::= [ ]?
'''
open("grammars/json.gbnf", "w").write(GBNF)
open("grammar.gbnf", "w").write(GBNF)
with open(text_path, encoding="utf-8", errors="replace") as f:
    open("file.txt", "w").write(f.read(12000))  # a few chunks of 512 tokens

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port

TOOLS = {"llama-cli": "run", "./llama-cli": "run", "llama-server": "serve", "./llama-server": "serve",
         "llama-perplexity": "perplexity"}

def kvlm_argv(line):
    words = shlex.split(line)
    argv = [kvlm, TOOLS[words[0]]] + words[1:]
    if argv[1] == "serve":
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(free_port())
        else:
            argv += ["--port", str(free_port())]
    return argv

def run(line, stdin=""):
    p = subprocess.run(kvlm_argv(line), input=stdin, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr

def post(port, path, body):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())

def serve(line, ask=lambda port: post(port, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                                   "temperature": 0})["choices"][0]["text"]):
    """Starts the server; (its start lines on stderr, /health status, what ask(port) got: a completion's
    text by default); stopped."""
    argv = kvlm_argv(line)
    port = int(argv[argv.index("--port") + 1])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    listening = p.stdout.readline()
    health, completion, err = None, None, ""
    try:
        if "listening on" in listening:
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=30) as r:
                health = r.status
            completion = ask(port)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
    return listening, health, completion, err

def unsupported(line, flag):
    rc, out, err = run(line)
    pat = "llama.cpp's %s is not supported by kvlm" % flag
    check(rc == 1 and pat in err and "unknown option" not in err, "%s  ->  names %s" % (line, flag), err)

greedy_ref = subprocess.run([kvlm, "run", "-m", model, "-p", "Once upon a time", "-n", "24", "--temp", "0"],
                            capture_output=True, text=True).stdout

# ---- README.md: llama-cli
rc, out, err = run("llama-cli -m model.gguf")
check(rc == 0 and len(out) > 20 and "prompt tokens:" in err, "llama-cli -m model.gguf  ->  runs (from BOS)", err)
rc, out, err = run("llama-cli -m model.gguf -cnv --chat-template chatml", "Hello there.\n")
check(rc == 0 and "[turn 1:" in err and out.strip(), "llama-cli -m model.gguf -cnv --chat-template chatml  ->  a chat turn",
      err)
unsupported("llama-cli -m model.gguf -cnv --in-prefix 'User: ' --reverse-prompt 'User:'", "--in-prefix")
rc, out, err = run('llama-cli -m model.gguf -p "I believe the meaning of life is" -n 128 -no-cnv')
m = re.search(r"decode: [0-9.]+ tokens/s \((\d+) tokens\)", err)
check(rc == 0 and out.startswith("I believe the meaning of life is") and m and int(m.group(1)) <= 128,
      "llama-cli ... -p ... -n 128 -no-cnv  ->  at most 128 tokens after the prompt", err)
prompt = "Request: schedule a call at 8pm; Command:"
rc, out, err = run("llama-cli -m model.gguf -n 256 --grammar-file grammars/json.gbnf -p '%s'" % prompt)
check(rc == 0 and out.startswith(prompt) and out[len(prompt):].lstrip().startswith("{"),
      "llama-cli ... --grammar-file grammars/json.gbnf  ->  a JSON object follows the prompt", (out[:200], err))

# ---- README.md: llama-server, llama-perplexity
for line, want in [("llama-server -m model.gguf --port 8080", "context 2048, 16 sequences"),
                   ("llama-server -m model.gguf -c 16384 -np 4", "context 4096, 4 sequences"),
                   ("llama-server -m model.gguf -md draft.gguf", "draft model draft.gguf")]:
    if quick and "-np" not in line:
        print("skip %s in the quick run" % line)
        continue
    listening, health, completion, err = serve(line)
    check(health == 200 and completion and want in err,
          "%s  ->  serves (/health 200, a completion; '%s')" % (line, want), (listening, err))
unsupported("llama-server -m model.gguf --embedding --pooling cls -ub 8192", "--pooling")
# llama-server's --embedding is kvlm serve's --embeddings: POST /v1/embeddings answers
_, _, vec, err = serve("llama-server -m model.gguf --embedding",
                       lambda port: post(port, "/v1/embeddings", {"input": "Once upon a time"})["data"][0]["embedding"])
check(vec and len(vec) > 8, "llama-server -m model.gguf --embedding  ->  POST /v1/embeddings answers", err[-300:])
unsupported("llama-server -m model.gguf --reranking", "--reranking")
unsupported("llama-server -m model.gguf --grammar-file grammar.gbnf", "--grammar-file")
if quick:
    print("skip llama-perplexity -m model.gguf -f file.txt in the quick run")
else:
    rc, out, err = run("llama-perplexity -m model.gguf -f file.txt")
    check(rc == 0 and re.search(r"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+", out),
          "llama-perplexity -m model.gguf -f file.txt  ->  Final estimate: PPL = ...", (out[-200:], err))

# ---- examples/main/README.md
rc, out, err = run('./llama-cli -m models/gemma-1.1-7b-it.Q4_K_M.gguf --prompt "Once upon a time"')
check(rc == 0 and out.startswith("Once upon a time") and len(out) > 40, "./llama-cli ... --prompt 'Once upon a time'", err)
rc, out, err = run("./llama-cli -m models/gemma-1.1-7b-it.Q4_K_M.gguf -cnv --chat-template gemma", "Hi.\nAnd then?\n")
check(rc == 0 and err.count("[turn ") == 2, "./llama-cli ... -cnv --chat-template gemma  ->  two chat turns", err)
if quick:
    print("skip ./llama-cli ... --ignore-eos -n -1 (2046 tokens) in the quick run")
else:
    rc, out, err = run("./llama-cli -m models/gemma-1.1-7b-it.Q4_K_M.gguf --ignore-eos -n -1")
    m = re.search(r"decode: [0-9.]+ tokens/s \((\d+) tokens\)", err)
    check(rc == 0 and "stopped: context full" in err and m and int(m.group(1)) > 2000,
          "./llama-cli ... --ignore-eos -n -1  ->  on to the end of the context (no end of text)", err)
unsupported('./llama-cli -r "User:" --in-prefix " "', "--in-prefix")
unsupported('./llama-cli -r "User:" --in-prefix " " --in-suffix "Assistant:"', "--in-prefix")

# ---- examples/server/README.md
for line, want in [("./llama-server -m models/7B/ggml-model.gguf -c 2048", "context 2048"),
                   # the Docker example's arguments (-ngl 99: the GPU where there is one, else the CPU, said)
                   ("llama-server -m models/7B/ggml-model.gguf -c 512 --host 0.0.0.0 --port 8080 --n-gpu-layers 99",
                    "context 512")]:
    if quick and "--n-gpu-layers" not in line:
        print("skip %s in the quick run" % line)
        continue
    listening, health, completion, err = serve(line)
    check(health == 200 and completion and want in err, "%s  ->  serves ('%s')" % (line, want), (listening, err))
rc, out, err = run("llama-server --jinja -fa -hf bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M")
check(rc == 1 and re.search(r"llama\.cpp's (--jinja|-hf) is not supported by kvlm", err) and "unknown option" not in err,
      "llama-server --jinja -fa -hf ...  ->  names --jinja or -hf", err)
unsupported("./llama-server -m my_model.gguf -c 8192 --path ./examples/server/public_legacy", "--path")

# ---- the aliases mean what kvlm's names mean
def out_of(args):
    p = subprocess.run([kvlm, "run", "-m", model, "-p", "Once upon a time", "-n", "24"] + args,
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr
llama = ["-s", "42", "--temp", "0.9", "-ctk", "q8_0", "-ctv", "q8_0", "--ctx-size", "256", "-fa", "-b", "2048",
         "-ub", "64", "-ngl", "0", "--no-mmap", "--mlock", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
         "--repeat-penalty", "1.1", "--repeat-last-n", "32", "--no-warmup", "-t", "1"]
kvlm_names = ["--seed", "42", "--temp", "0.9", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--ctx", "256",
              "--device", "cpu", "--presence-penalty", "0.5", "--frequency-penalty", "0.3", "--repeat-penalty", "1.1",
              "--repeat-last-n", "32", "-t", "1"]
a, b = out_of(llama), out_of(kvlm_names)
check(a[0] == 0 and a[1] == b[1] and len(a[1]) > 20, "llama.cpp's names give kvlm's text (seeded sampling)", (a, b))
# examples/main/README.md's sampling examples (DRY, XTC, the stages' order), and what kvlm lacks
for extra in (["--dry-multiplier", "0.8", "--dry-base", "1.75", "--dry-allowed-length", "2", "--dry-penalty-last-n", "-1",
               "--dry-sequence-breaker", "\u2014", "--dry-sequence-breaker", "##"],
              ["--xtc-probability", "0.5", "--xtc-threshold", "0.1"],
              ["--sampling-seq", "mx", "--min-p", "0.02", "--xtc-probability", "0.5"],
              ["--typical", "0.9", "--samplers", "penalties;dry;top_k;typ_p;top_p;min_p;xtc;temperature",
               "--repeat-last-n", "-1"]):
    rc, out, err = out_of(["-s", "3"] + extra)
    check(rc == 0 and out.startswith("Once upon a time") and len(out) > 20, "run " + " ".join(extra), err)
rc, out, err = out_of(["--mirostat", "2", "--mirostat-lr", "0.05", "--mirostat-ent", "3.0"])
check(rc == 1 and "llama.cpp's --mirostat is not supported by kvlm run" in err, "--mirostat: named as not supported", err)
rc, out, err = out_of(["--samplers", "top_k;bogus"])
check(rc == 1 and "'bogus' is not a stage" in err, "--samplers with an unknown stage refused", err)
rc, out, err = out_of(["--predict", "8", "--temp", "0", "-r", "there"])
check(rc == 0 and "stopped: reverse prompt (-r)" in err and out.strip() == "Once upon a time, there",
      "-r stops after its text in what is generated", (out, err))
rc, out, err = out_of(["-n", "0"])
check(rc == 0 and "-n 0, nothing generated" in err and out.strip() == "Once upon a time", "-n 0 generates nothing, said",
      err)
rc, out, err = out_of(["-n", "-2", "--ignore-eos", "-c", "64", "--kv-evict", "sinks"])
check(rc == 0 and "stopped: context full (-n -2)" in err, "-n -2 stops when the context is full, evicting or not", err)
rc, out, err = out_of(["-n", "-3"])
check(rc == 1 and "-n -3" in err, "-n -3 refused", err)
rc, out, err = out_of(["--spec", "lookup", "--draft", "16", "--temp", "0"])
check(rc == 0 and out == greedy_ref and "spec lookup" in err,
      "--draft 16 is a draft count, not a file (lookup decoding, the greedy text)", (out, greedy_ref, err))
rc, out, err = out_of(["--spec", "lookup", "--draft-max", "8", "--draft-min", "5", "--temp", "0"])
check(rc == 0 and out == greedy_ref and "spec lookup" in err, "--draft-max 8 --draft-min 5: the greedy text",
      (out, greedy_ref, err))
rc, out, err = out_of(["-s", "-1"])
check(rc == 0 and len(out) > 20, "-s -1: a random seed", err)
rc, out, err = out_of(["--temp", "-1", "--top-p", "5"])
check(rc == 1 and "--temp -1: must be between 0 and 2" in err, "run --temp -1 --top-p 5 refused (kvlm_sampler_params_check)",
      err)
rc, out, err = out_of(["--top-p", "5"])
check(rc == 1 and "--top-p 5: must be between 0 and 1" in err, "run --top-p 5 refused", err)
rc, out, err = out_of(["--presence-penalty", "3"])
check(rc == 1 and "--presence-penalty 3" in err, "run --presence-penalty 3 refused by the same check", err)
p = subprocess.run([kvlm, "--version"], capture_output=True, text=True)
p2 = subprocess.run([kvlm, "serve", "--version"], capture_output=True, text=True)
check(p.returncode == 0 and re.fullmatch(r"kvlm \d+\.\d+\.\d+ \((git [0-9a-f]+(-dirty)?|unknown revision)\)\n", p.stdout)
      and p2.stdout == p.stdout, "--version: %s" % p.stdout.strip(), (p.stdout, p2.stdout))
rc, out, err = out_of(["--tempp", "0.5"])
check(rc == 1 and "unknown option '--tempp'" in err, "a typo is still an unknown option", err)

subprocess.run(["rm", "-rf", work])
print("%d failed" % failures)
sys.exit(1 if failures else 0)
PY
