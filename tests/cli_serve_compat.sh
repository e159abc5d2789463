#!/usr/bin/env bash
# tests/cli_serve_compat: kvlm serve as a drop-in for vLLM and llama-server.
# The request bodies their documented examples send are answered with
# OpenAI's fields; unknown fields (top-level and in stream_options) are
# ignored and logged once per name, and refused under --strict-params; each
# of their fields does what they define (against kvlm's own greedy runs);
# array prompts, /v1/models/{id}, random ids, system_fingerprint,
# continuous usage, echo, prompt logprobs, fill-in-the-middle with a model
# that has FIM tokens (a copy of stories260K given the GGUF keys); one log
# line per request (text and JSON), throughput and preemption lines; a
# prefill counts as running with its progress in /kvlm/status; /metrics:
# kvlm's names pass promtool, every series vLLM's dashboard and
# docs/grafana/kvlm.json query is there, and the figures add up.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
SRC="$(cd "$(dirname "$0")/.." && pwd)"
exec timeout 300 python3 - "$KVLM" "$MODEL" "$SRC" <<'PY'
import http.client, json, os, re, shutil, signal, struct, subprocess, sys, tempfile, threading, time

kvlm, model, src = sys.argv[1:4]
quick = bool(os.environ.get("KVLM_TEST_QUICK"))
tmp = tempfile.mkdtemp(prefix="kvlm_compat_")
failures = 0
procs = []

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)[:600]))
    failures += not cond

def start(*extra, model_path=model):
    log = open(os.path.join(tmp, "log%d.txt" % len(procs)), "w+")
    p = subprocess.Popen([kvlm, "serve", "-m", model_path, "--port", "0", "-t", "2"] + list(extra),
                         stdout=subprocess.PIPE, stderr=log, text=True)
    m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", p.stdout.readline())
    procs.append(p)
    if not m:
        p.kill(); log.seek(0)
        print("FAIL: no listening line; stderr: " + log.read()); sys.exit(1)
    return p, int(m.group(1)), log

stops = []
def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = -1
    stops.append(rc)
    return rc

def call(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text

def stream(port, path, body):
    """(status, [chunk objects])"""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    chunks = []
    for raw in r:
        line = raw.decode().rstrip("\r\n")
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            chunks.append(json.loads(line[6:]))
    c.close()
    return r.status, chunks

ID = re.compile(r"(chatcmpl|cmpl)-[0-9a-f]{32}")
def openai_shape(j, chat, n=1):
    """The fields OpenAI's API defines for a whole answer."""
    try:
        ok = (ID.fullmatch(j["id"]) and j["id"].startswith("chatcmpl-" if chat else "cmpl-")
              and j["object"] == ("chat.completion" if chat else "text_completion") and isinstance(j["created"], int)
              and j["model"] == "stories260K" and re.fullmatch(r"fp_[0-9a-f]{10}", j["system_fingerprint"])
              and len(j["choices"]) == n and all(ch["index"] == i for i, ch in enumerate(j["choices"]))
              and all(ch["finish_reason"] in ("stop", "length") and "logprobs" in ch for ch in j["choices"])
              and all((ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)) if chat
                      else isinstance(ch["text"], str) for ch in j["choices"])
              and j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"] + j["usage"]["completion_tokens"])
        return bool(ok)
    except (KeyError, TypeError):
        return False

def text(j, i=0):
    ch = j["choices"][i]
    return ch["message"]["content"] if "message" in ch else ch["text"]

# ---- server A: defaults, a throughput line every 0.25 s, a log of its own ----
pA, A, logA = start("--max-seqs", "8", "--log-interval", "0.25", "-c", "2048")
msgs = [{"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": "Tell me about Lily."}]

# The bodies their documentation shows (vLLM's sampling parameters as extra fields; llama-server's
# /completion fields and its web page's chat body), each answered with OpenAI's fields.
examples = [
    ("vLLM completions", "/v1/completions", {"model": "stories260K", "prompt": "San Francisco is a", "max_tokens": 7,
        "temperature": 0}),
    ("vLLM completions with its sampling parameters", "/v1/completions",
        {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "top_p": 0.95,
         "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "presence_penalty": 0.1, "frequency_penalty": 0.1,
         "seed": 7, "min_tokens": 4, "ignore_eos": False, "stop_token_ids": [13], "skip_special_tokens": True,
         "include_stop_str_in_output": False, "spaces_between_special_tokens": True, "use_beam_search": False,
         "length_penalty": 1.0, "truncate_prompt_tokens": None, "best_of": 1, "user": "u-1"}),
    ("vLLM chat with extra_body", "/v1/chat/completions",
        {"model": "stories260K", "messages": msgs, "max_tokens": 12, "temperature": 0.7, "top_k": 50,
         "repetition_penalty": 1.1, "add_generation_prompt": True, "echo": False, "chat_template_kwargs": {},
         "max_completion_tokens": 12, "metadata": {"trace": "x"}, "seed": 3}),
    ("llama-server /completion fields on /v1/completions", "/v1/completions",
        {"prompt": "Building a website can be done in 10 simple steps:", "n_predict": 12, "cache_prompt": True,
         "temperature": 0.8, "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
         "xtc_probability": 0, "xtc_threshold": 0.1, "typical_p": 1, "repeat_last_n": 64, "repeat_penalty": 1.1,
         "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0.8, "dry_base": 1.75,
         "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
         "mirostat": 0, "mirostat_tau": 5, "mirostat_eta": 0.1, "n_probs": 0, "min_keep": 0, "seed": -1,
         "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
         "id_slot": -1, "t_max_predict_ms": 0, "return_tokens": False}),
    ("llama-server web page's chat body", "/v1/chat/completions",
        {"messages": msgs, "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8,
         "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1,
         "xtc_probability": 0, "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0,
         "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
         "dry_penalty_last_n": -1, "max_tokens": 10, "timings_per_token": False}),
]
for name, path, body in examples:
    st, j = call(A, "POST", path, body)
    check(st == 200 and openai_shape(j, "chat" in path), name + ": 200 with OpenAI's fields", (st, j))
st, j = call(A, "POST", "/v1/completions", examples[3][2])
check(st == 200 and j["usage"]["completion_tokens"] == 12, "n_predict gives the tokens' count (12)", j)
st, chunks = stream(A, "/v1/chat/completions", dict(examples[4][2], max_tokens=6))
check(st == 200 and chunks and all(ID.fullmatch(c["id"]) and c["system_fingerprint"] for c in chunks)
      and len({c["id"] for c in chunks}) == 1, "the web page's streamed body: chunks with one id", chunks[:2])

# unknown fields: ignored, logged once per name (nested ones too)
for _ in range(3):
    st, j = call(A, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "bogus_field": 1, "another_one": {"x": 1}})
    check(st == 200, "unknown fields are ignored", j)
st, chunks = stream(A, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                            "stream_options": {"include_usage": True, "bogus_key": 1}})
check(st == 200 and chunks[-1].get("usage", {}).get("completion_tokens") == 2, "stream_options.bogus_key is ignored", chunks)
st, j = call(A, "POST", "/tokenize", {"prompt": "Hi", "bogus_field": 1})
check(st == 200, "/tokenize ignores it too", j)

# array prompts: prompt i's choice k is choice i * n + k, each what the prompt gives alone
prompts = ["Once upon a time", "Lily and Tom", "The dog"]
st, j = call(A, "POST", "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 8, "temperature": 0})
alone = [call(A, "POST", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})[1] for p in prompts]
check(st == 200 and openai_shape(j, False, 6) and all(text(j, i * 2 + k) == text(alone[i]) for i in range(3) for k in range(2))
      and j["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone),
      "an array of 3 prompts, n 2: 6 choices numbered as OpenAI does, each the prompt's own", j)
toks = [call(A, "POST", "/tokenize", {"prompt": p})[1]["tokens"] for p in prompts[:2]]
st, j = call(A, "POST", "/v1/completions", {"prompt": toks, "max_tokens": 8, "temperature": 0})
check(st == 200 and [text(j, 0), text(j, 1)] == [text(alone[0]), text(alone[1])], "an array of token-id prompts", j)
st, chunks = stream(A, "/v1/completions", {"prompt": prompts[:2], "max_tokens": 4, "temperature": 0})
got = {}
for c in chunks:
    for ch in c["choices"]:
        got[ch["index"]] = got.get(ch["index"], "") + ch["text"]
check(got == {0: text(alone[0])[:len(got.get(0, ""))], 1: text(alone[1])[:len(got.get(1, ""))]} and len(got) == 2
      and all(got.values()), "array prompts streamed: each index its prompt's text", got)

# /v1/models/{id}, ids, fingerprint
st, j = call(A, "GET", "/v1/models/stories260K")
check(st == 200 and j["id"] == "stories260K" and j["object"] == "model", "GET /v1/models/{id}", j)
st, j = call(A, "GET", "/v1/models/gpt-4")
check(st == 404 and j["error"]["code"] == "model_not_found" and j["error"]["type"] == "invalid_request_error",
      "another id: OpenAI's 404", j)
ids = [call(A, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})[1] for _ in range(4)]
check(len({x["id"] for x in ids}) == 4 and len({x["system_fingerprint"] for x in ids}) == 1,
      "random ids, one system_fingerprint", [(x["id"], x["system_fingerprint"]) for x in ids])

# stream_options.continuous_usage_stats: usage in every chunk
st, chunks = stream(A, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                                            "stream_options": {"continuous_usage_stats": True, "include_usage": True}})
comp = [c["usage"]["completion_tokens"] for c in chunks if "usage" in c]
check(st == 200 and len(comp) == len(chunks) and comp == sorted(comp) and comp[-1] == 6,
      "continuous_usage_stats: usage in every chunk, rising to 6", comp)

# greedy reference texts
base = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
st, ref = call(A, "POST", "/v1/completions", base)
ref_text = text(ref)

# echo (with logprobs: the prompt's tokens first, the first without a logprob)
st, j = call(A, "POST", "/v1/completions", dict(base, echo=True, logprobs=2))
lp = j["choices"][0]["logprobs"] if st == 200 else {}
n_prompt = ref["usage"]["prompt_tokens"]
check(st == 200 and text(j) == base["prompt"] + ref_text and lp["token_logprobs"][0] is None
      and lp["top_logprobs"][0] is None and len(lp["tokens"]) == n_prompt + 24
      and all(isinstance(x, float) for x in lp["token_logprobs"][1:]) and len(lp["top_logprobs"][1]) == 2,
      "echo: the prompt, then the text; its tokens' logprobs first (the first none)", j)
st, j = call(A, "POST", "/v1/chat/completions", {"messages": msgs + [{"role": "assistant", "content": "Lily was"}],
                                                 "echo": True, "max_tokens": 4, "temperature": 0})
check(st == 200 and text(j).startswith("Lily was"), "chat echo: the assistant's last message begins the answer", j)

# vLLM's prompt_logprobs
st, j = call(A, "POST", "/v1/completions", dict(base, max_tokens=2, prompt_logprobs=3))
plp = j["choices"][0].get("prompt_logprobs") if st == 200 else None
check(st == 200 and plp and plp[0] is None and len(plp) == n_prompt
      and all(any(v["rank"] >= 1 and v["logprob"] <= 0 and "decoded_token" in v for v in e.values()) for e in plp[1:])
      and all(3 <= len(e) <= 4 for e in plp[1:]) and j["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "prompt_logprobs: one entry a prompt token (the first none), the token and its 3 alternatives", plp)

# stop_token_ids, include_stop_str_in_output, min_tokens, ignore_eos, cache_prompt, skip_special_tokens
full = call(A, "POST", "/tokenize", {"prompt": base["prompt"] + ref_text})[1]["tokens"]
gen = full[ref["usage"]["prompt_tokens"]:]  # the text's tokens (greedy text retokenizes as it was made)
k = next(i for i in range(3, len(gen)) if gen[i] not in gen[:i])
stop_id = gen[k]
st, j = call(A, "POST", "/v1/completions", dict(base, stop_token_ids=[stop_id]))
check(st == 200 and j["choices"][0]["finish_reason"] == "stop" and j["choices"][0]["stop_reason"] == stop_id
      and j["usage"]["completion_tokens"] == k + 1 and ref_text.startswith(text(j)) and len(gen) == 24,
      "stop_token_ids: the token given, then stop_reason %d" % stop_id, j)
word = "girl" if "girl" in ref_text else ref_text.split()[3]
st, j1 = call(A, "POST", "/v1/completions", dict(base, stop=[word]))
st, j2 = call(A, "POST", "/v1/completions", dict(base, stop=[word], include_stop_str_in_output=True))
check(text(j1) == ref_text[:ref_text.index(word)] and text(j2) == ref_text[:ref_text.index(word) + len(word)]
      and j1["choices"][0]["stop_reason"] == word, "include_stop_str_in_output keeps the stop string", (j1, j2))
comma = ref_text.index(",") if "," in ref_text else -1
st, j = call(A, "POST", "/v1/completions", dict(base, stop=[","], min_tokens=6))
check(comma >= 0 and st == 200 and j["usage"]["completion_tokens"] >= 6 and len(text(j)) > comma,
      "min_tokens: a stop string in the first tokens does not end it", (ref_text, j))
eos = {"2": 100}  # stories260K's end token, all but forced
st, j1 = call(A, "POST", "/v1/completions", dict(base, max_tokens=5, logit_bias=eos))
st, j2 = call(A, "POST", "/v1/completions", dict(base, max_tokens=5, logit_bias=eos, ignore_eos=True))
st, j3 = call(A, "POST", "/v1/completions", dict(base, max_tokens=5, logit_bias=eos, min_tokens=3))
check(j1["usage"]["completion_tokens"] == 0 and j1["choices"][0]["finish_reason"] == "stop"
      and j2["usage"]["completion_tokens"] == 5 and j2["choices"][0]["finish_reason"] == "length"
      and j3["usage"]["completion_tokens"] == 3, "ignore_eos and min_tokens hold off the end token", (j1, j2, j3))
st, j = call(A, "POST", "/v1/completions", dict(base, max_tokens=3, logit_bias={"0": 100}, skip_special_tokens=False))
st2, j2 = call(A, "POST", "/v1/completions", dict(base, max_tokens=3, logit_bias={"0": 100}))
check(text(j) == "<unk>" * 3 and text(j2) == "", "skip_special_tokens false: control tokens' text", (j, j2))
long_prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog."
call(A, "POST", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
st, j1 = call(A, "POST", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
st, j2 = call(A, "POST", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1, "cache_prompt": False})
check(j1["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 and j2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "cache_prompt false: the prompt computed afresh", (j1["usage"], j2["usage"]))
st, j = call(A, "POST", "/v1/completions", {"prompt": "Hi", "max_completion_tokens": 3})
check(st == 200 and j["usage"]["completion_tokens"] == 3, "max_completion_tokens on /v1/completions", j)

# sampling fields reach the sampler: greedy text changes with each penalty, and the two repetition penalties differ
outs = {}
for name, extra in [("none", {}), ("repetition_penalty", {"repetition_penalty": 1.8}),
                    ("repeat_penalty", {"repeat_penalty": 1.8, "repeat_last_n": 8}),
                    ("dry", {"dry_multiplier": 3, "dry_allowed_length": 1}),
                    ("frequency_penalty", {"frequency_penalty": 2})]:
    st, j = call(A, "POST", "/v1/completions", dict(base, max_tokens=60, **extra))
    outs[name] = text(j) if st == 200 else None
check(len(set(outs.values())) == len(outs) and None not in outs.values(),
      "each penalty changes greedy text, vLLM's and llama.cpp's repetition penalties differently", outs)
st, j = call(A, "POST", "/v1/completions", dict(base, temperature=1, top_k=0, samplers=["top_k", "xtc", "temperature"],
                                                xtc_probability=1, xtc_threshold=0.05, seed=5))
check(st == 200, "samplers as names, with xtc", j)
for bad, param in [({"samplers": ["top_k", "mirostat"]}, "samplers"), ({"samplers": "kz"}, "samplers"),
                   ({"typical_p": 2}, "typical_p"), ({"repetition_penalty": -1}, "repetition_penalty"),
                   ({"repeat_last_n": -2}, "repeat_last_n"), ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
                   ({"stop_token_ids": [600]}, "stop_token_ids"), ({"dry_sequence_breakers": []}, "dry_sequence_breakers"),
                   ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"n_predict": 0}, "n_predict"),
                   ({"suffix": " the end"}, "suffix"), ({"xtc_threshold": 1.5}, "xtc_threshold")]:
    st, j = call(A, "POST", "/v1/completions", dict(base, **bad))
    err = j.get("error", {}) if isinstance(j, dict) else {}
    check(st == 400 and err.get("param") == param, "%s is refused naming '%s' (%s)" % (json.dumps(bad), param,
                                                                                      err.get("message")), j)

# a prefill counts as running (/metrics and /kvlm/status) with its progress: small steps make it long
big = " ".join(["Lily and Tom went to the park and played with a big red ball."] * (40 if quick else 85))  # 1871 tokens: within the context of 2048
pB, B, logB = start("--batch-tokens", "4", "-c", "2048", "--log-interval", "0")
seen = {}
for attempt in range(3):
    done = threading.Event()
    def watch():
        while not done.is_set() and "prefill" not in seen:
            st, s = call(B, "GET", "/kvlm/status")
            run = re.search(r'^vllm:num_requests_running\{[^}]*\} (\S+)', call(B, "GET", "/metrics")[1], re.M)
            for r in s.get("requests", []) if isinstance(s, dict) else []:
                if r["state"] == "prefill" and r.get("prefill") and s["running"] >= 1 and run and float(run.group(1)) >= 1:
                    seen["prefill"] = r["prefill"]
    w = threading.Thread(target=watch)
    w.start()
    st, j = call(B, "POST", "/v1/completions", {"prompt": big, "max_tokens": 1})
    done.set()
    w.join()
    if "prefill" in seen:
        break
p = seen.get("prefill")
check(p and 0 <= p["done"] < p["total"] and p["total"] == j["usage"]["prompt_tokens"],
      "a prefill: running in /metrics and /kvlm/status, its tokens done of total (%s)" % p, seen)
stop(pB)

# preemption is logged; the log has one line per request
pC, C, logC = start("--max-seqs", "2", "--kv-mem", "50KiB", "-c", "512", "--log-interval", "0")
th = [threading.Thread(target=call, args=(C, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 60,
                                                                          "temperature": 0})) for _ in range(2)]
[t.start() for t in th]
[t.join() for t in th]
stop(pC)
logC.seek(0)
lc = logC.read()
check("preempted by" in lc, "a preemption is logged", lc[-800:])

# ---- the metrics: kvlm's names pass promtool; every series the dashboards query is there; figures add up ----
st, mt = call(A, "GET", "/metrics")
names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", mt, re.M))
promtool = shutil.which("promtool")
if promtool:
    own = "\n".join(l for l in mt.splitlines() if "vllm:" not in l) + "\n"
    r = subprocess.run([promtool, "check", "metrics"], input=own, capture_output=True, text=True)
    check(r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(),
          "promtool check metrics: kvlm's names are clean", r.stdout + r.stderr)
else:
    print("SKIP: promtool not found (Debian's prometheus package): the lint of kvlm's names")
# what vLLM's published dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries
vllm_dashboard = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
                  "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                  "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
                  "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
                  "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
                  "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                  "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
                  "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                  "vllm:request_max_num_generation_tokens_sum"]
missing = [n for n in vllm_dashboard if n not in names]
check(not missing, "every series vLLM's dashboard queries is in /metrics (%d)" % len(vllm_dashboard), missing)
for n in ["vllm:inter_token_latency_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
          "vllm:num_preemptions_total", "vllm:request_params_n_bucket", "vllm:request_params_max_tokens_bucket",
          "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]:
    check(n in names, "%s is in /metrics" % n)
dash = json.load(open(os.path.join(src, "docs/grafana/kvlm.json")))
exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
funcs = {"histogram_quantile", "sum", "by", "rate", "increase", "le", "model_name", "tier", "reason", "finished_reason",
         "__rate_interval", "avg"}
queried = {w for e in exprs for w in re.findall(r"[a-zA-Z_][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"', "", e))} - funcs
mt_tier = call(A, "GET", "/metrics")[1]
missing = sorted(n for n in queried if n not in names)
# tier series appear with a tier: checked on server D below
missing_no_tier = [n for n in missing if not n.startswith("kvlm_kv_tier_")]
check(len(exprs) > 40 and not missing_no_tier, "every series docs/grafana/kvlm.json queries is in /metrics", missing_no_tier)
def sample(name, labels=""):
    m = re.search(r"^%s(\{[^}]*%s[^}]*\})? (\S+)$" % (re.escape(name), re.escape(labels)), mt, re.M)
    return float(m.group(2)) if m else None
n_req = sample("vllm:e2e_request_latency_seconds_count")
fin = sum(float(x) for x in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", mt, re.M))
gen_total = sample("vllm:generation_tokens_total")
check(n_req and n_req == sample("vllm:request_queue_time_seconds_count") == sample("vllm:request_prompt_tokens_count")
      and fin >= n_req and sample("vllm:request_generation_tokens_sum") == gen_total
      and sample("vllm:e2e_request_latency_seconds_bucket", 'le="+Inf"') == n_req,
      "the figures add up: %s requests, %s completions, %s tokens" % (n_req, fin, gen_total), mt[:300])

# ---- server A's log: one line per request, each unknown name once, the throughput line ----
stop(pA)
logA.seek(0)
la = logA.read()
req_lines = [l for l in la.splitlines() if " request " in l and "POST /v1/" in l]
check(la.count("'bogus_field'") == 1 and la.count("'another_one'") == 1 and la.count("'stream_options.bogus_key'") == 1
      and la.count("'spaces_between_special_tokens'") == 1, "each unknown field is logged once", la[:1500])
check(re.search(r"INFO  throughput: prompt [\d.]+ tokens/s, generation [\d.]+ tokens/s, running \d+", la),
      "a throughput line while busy", la[-500:])
check(any(re.search(r"request cmpl-[0-9a-f]{32} POST /v1/completions 127\.0\.0\.1 200 prompt=\d+ cached=\d+ generated=\d+ "
                    r"ttft=[\d.]+ms .*e2e=[\d.]+ms finish=(stop|length)", l) for l in req_lines),
      "a request's line: id, endpoint, client, status, tokens, TTFT, finish", req_lines[:2])
check(any(" 400 " in l and "error=" in l for l in req_lines), "a refused request's line: 400 and the error", "")

# ---- server D: --strict-params, --log-format json, a host tier; FIM with a model that has FIM tokens ----
def gguf_with_fim(path, out, ids):
    """A copy of the GGUF with tokenizer.ggml.fim_{pre,suf,mid}_token_id added (uint32)."""
    b = open(path, "rb").read()
    pos = 4
    ver, nt, nkv = struct.unpack_from("<IQQ", b, pos)
    pos += 20
    def skip_val(t, pos):
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if t == 8:
            n, = struct.unpack_from("<Q", b, pos)
            return pos + 8 + n
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, pos)
            pos += 12
            for _ in range(n):
                pos = skip_val(et, pos)
            return pos
        return pos + sizes[t]
    for _ in range(nkv):
        n, = struct.unpack_from("<Q", b, pos)
        key = b[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        t, = struct.unpack_from("<I", b, pos)
        if key == "general.alignment":
            align, = struct.unpack_from("<I", b, pos + 4)
        pos = skip_val(t, pos + 4)
    kv_end = pos
    for _ in range(nt):
        n, = struct.unpack_from("<Q", b, pos)
        pos += 8 + n
        nd, = struct.unpack_from("<I", b, pos)
        pos += 4 + 8 * nd + 4 + 8
    align = locals().get("align", 32)
    data = (pos + align - 1) // align * align
    extra = b""
    for name, i in zip(("pre", "suf", "mid"), ids):
        k = ("tokenizer.ggml.fim_%s_token_id" % name).encode()
        extra += struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, i)
    head = b[:4] + struct.pack("<IQQ", ver, nt, nkv + 3) + b[24:kv_end] + extra + b[kv_end:pos]
    head += b"\0" * ((-len(head)) % align)
    open(out, "wb").write(head + b[data:])
fim_model = os.path.join(tmp, "stories260K-fim.gguf")
fim_ids = (3 + ord("{"), 3 + ord("|"), 3 + ord("}"))  # byte tokens <0x7B> <0x7C> <0x7D>: three tokens of their own
gguf_with_fim(model, fim_model, fim_ids)
pD, D, logD = start("--strict-params", "--log-format", "json", "--log-interval", "0.2", "--kv-host-size", "8MiB",
                    "--kv-mem", "400KiB", "-c", "512", model_path=fim_model)
st, j = call(D, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "bogus_field": 1})
check(st == 400 and j["error"]["code"] == "unknown_parameter" and j["error"]["param"] == "bogus_field"
      and "Unrecognized request argument supplied: 'bogus_field'" in j["error"]["message"], "--strict-params: 400", j)
st, j = call(D, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stream_options": {"bogus_key": 1}})
check(st == 400 and j["error"]["param"] == "stream_options" and "stream_options.bogus_key" in j["error"]["message"],
      "--strict-params: a nested unknown key too", j)
st, j = call(D, "POST", "/tokenize", {"prompt": "x", "bogus": 1})
check(st == 400 and j["error"]["code"] == "unknown_parameter", "--strict-params: /tokenize too", j)
pre = call(D, "POST", "/tokenize", {"prompt": "Once upon", "add_special_tokens": False})[1]["tokens"]
suf = call(D, "POST", "/tokenize", {"prompt": " the end", "add_special_tokens": False})[1]["tokens"]
st, j1 = call(D, "POST", "/v1/completions", {"prompt": "Once upon", "suffix": " the end", "max_tokens": 12, "temperature": 0})
st2, j2 = call(D, "POST", "/v1/completions", {"prompt": [1, fim_ids[0]] + pre + [fim_ids[1]] + suf + [fim_ids[2]],
                                               "max_tokens": 12, "temperature": 0})
check(st == 200 and st2 == 200 and text(j1) == text(j2) and j1["usage"]["prompt_tokens"] == len(pre) + len(suf) + 4,
      "suffix: the fill-in-the-middle prompt [BOS] PRE prefix SUF suffix MID", (j1, j2))
# fill the pool and its host tier, so every kvlm series (the tiers' too) is there
for i in range(12):
    call(D, "POST", "/v1/completions", {"prompt": "Story %d: " % i + long_prompt, "max_tokens": 24})
mt = call(D, "GET", "/metrics")[1]
names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", mt, re.M))
check(not [n for n in missing if n not in names], "the dashboard's tier series with a host tier", [n for n in missing if n not in names])
if promtool:
    own = "\n".join(l for l in mt.splitlines() if "vllm:" not in l) + "\n"
    r = subprocess.run([promtool, "check", "metrics"], input=own, capture_output=True, text=True)
    check(r.returncode == 0 and not (r.stdout + r.stderr).strip(), "promtool: with tiers too", r.stdout + r.stderr)
st, j = call(D, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 400, "n": 4, "ignore_eos": True})
time.sleep(0.3)
stop(pD)
logD.seek(0)
lines = logD.read().splitlines()
objs = []
for l in lines:
    try:
        objs.append(json.loads(l))
    except ValueError:
        objs.append(None)
check(lines and all(o is not None and "time" in o and "level" in o for o in objs), "--log-format json: every line parses",
      [l for l, o in zip(lines, objs) if o is None][:3])
reqs = [o for o in objs if o and o.get("event") == "request"]
posts = [o for o in reqs if o["method"] == "POST" and o["endpoint"].startswith("/v1/")]
check(len(posts) == 17 and all(set(o) >= {"id", "endpoint", "client", "status", "prompt_tokens", "cached_tokens",
                                          "generated_tokens", "e2e_s"} for o in posts if o["status"] == 200)
      and sum(o["status"] == 400 for o in posts) == 2 and all("error" in o for o in posts if o["status"] == 400)
      and all("ttft_s" in o and "tpot_s" in o and o["finish_reason"] for o in posts if o["status"] == 200),
      "one JSON line per completion request (15 answered, 2 refused)", [(o["status"], o.get("ttft_s"), o.get("finish_reason"), o.get("tpot_s")) for o in posts])
check(any(o and o.get("event") == "throughput" for o in objs), "a JSON throughput line", "")
logs = ""
for name in sorted(os.listdir(tmp)):
    if name.startswith("log"):
        logs += open(os.path.join(tmp, name), errors="replace").read()
check(stops == [0] * len(stops) and "Sanitizer" not in logs and "runtime error" not in logs,
      "every server stopped cleanly (%s)" % stops, [l for l in logs.splitlines() if "Sanitizer" in l or "runtime error" in l][:5])
shutil.rmtree(tmp, ignore_errors=True)
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
