"""tests/helpers/chat_turns: a many-turn chat through `kvlm serve` with curl
(python3 stdlib + the curl command), as tests/cli_serve_turns.sh runs it:
each turn's prompt must come from the prefix cache (the answers sent back as
text are tokenized as the ids the server generated for them), and each answer
must equal a cold run (a fresh server) given the same prompt ids.

usage: chat_turns.py KVLM MODEL LABEL [--turns N] [--max-tokens N] [--rules N] [--min-share F] [--kv-mem SIZE]
                     [--near-tie D] [--extra] [--control] [--csv FILE] [--ban ID...]
  --rules N  the system message's length (60: about 1,750 tokens)
  --min-share F  the share of each prompt from turn 2 on that must be cached (default
             0.95; every full block of the previous turn must be, whatever F)
  --extra    also: n > 1, stop strings at and inside a token, an edited answer
  --control  also the same chat on a server that keeps no answers
             (--answer-ids-mem 0): its cache must break somewhere (the test can fail)
  --near-tie D  an answer may leave the cold run's where the cold run's top
             tokens were within D nats of each other (random-weight models: their
             greedy text flips at near-ties with float noise; default 0: none)
Prints one line per check ("ok ..." / "FAIL ..."), and per turn the prompt and
cached tokens; exits 1 on any failure."""
import atexit
import json
import re
import signal
import subprocess
import sys
import time

KVLM, MODEL, LABEL = sys.argv[1], sys.argv[2], sys.argv[3]
args = sys.argv[4:]


def opt(name, default, conv=int):
    """The value after the last `name` (a later one overrides)."""
    at = [i for i, a in enumerate(args) if a == name]
    return conv(args[at[-1] + 1]) if at else default


TURNS = opt("--turns", 8)
RULES = opt("--rules", 60)
MAX_TOKENS = opt("--max-tokens", 48)
CSV = opt("--csv", None, str)
NEAR_TIE = opt("--near-tie", 0.0, float)
MIN_SHARE = opt("--min-share", 0.95, float)
BAN = [int(a) for a in args[args.index("--ban") + 1:] if a.isdigit()] if "--ban" in args else []
SERVE = ["--chat-template", "chatml", "-c", "4096", "-t", "2", "--max-seqs", "4", "--kv-mem", opt("--kv-mem", "256MiB", str)]
failures = 0


T0 = time.time()


def check(cond, name, detail=""):
    global failures
    print("%5.1fs " % (time.time() - T0) + ("ok   " if cond else "FAIL ") + LABEL + ": " + name + ("" if cond else " " + str(detail)[:600]), flush=True)
    failures += not cond
    return cond


LIVE = []  # servers not stopped yet: killed when this script ends, however it ends
atexit.register(lambda: [p.kill() for p in LIVE if p.poll() is None])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


class Server:
    """`kvlm serve -m MODEL --port 0 ...` until stop()."""

    def __init__(self, extra=()):
        self.p = subprocess.Popen([KVLM, "serve", "-m", MODEL, "--port", "0"] + SERVE + list(extra),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        LIVE.append(self.p)
        m = re.fullmatch(r"kvlm serve: listening on (http://127\.0\.0\.1:\d+)\n", self.p.stdout.readline())
        if not m:
            self.p.kill()
            print("FAIL %s: no listening line: %s" % (LABEL, self.p.stderr.read()))
            sys.exit(1)
        self.url = m.group(1)

    def curl(self, path, body=None, stream=False):
        """One request with curl: the JSON answer, or a stream's events (a list of JSON objects)."""
        cmd = ["curl", "-sS", "--max-time", "120", "-N" if stream else "-f", self.url + path]
        if body is not None:
            cmd[1:1] = ["-H", "Content-Type: application/json", "--data-binary", "@-"]
        r = subprocess.run(cmd, input=json.dumps(body) if body is not None else None, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError("curl %s: %s %s" % (path, r.returncode, r.stderr))
        if path == "/metrics":
            return r.stdout
        if not stream:
            return json.loads(r.stdout)
        ev = [json.loads(line[6:]) for line in r.stdout.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]
        return ev

    def metric(self, name):
        m = re.search(r"^%s (\S+)$" % re.escape(name), self.curl("/metrics"), re.M)
        return float(m.group(1)) if m else None

    def stop(self):
        self.p.terminate()
        try:
            rc = self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = -1
        LIVE.remove(self.p)
        err = self.p.stderr.read()
        check(rc == 0 and "Sanitizer" not in err and "runtime error" not in err,
              "the server stopped cleanly", "status %s: %s" % (rc, err[-2000:]))


def sampling(body):
    body.update(max_tokens=MAX_TOKENS, temperature=0)
    if BAN:
        body["logit_bias"] = {str(i): -100 for i in BAN}
    return body


def chat(srv, msgs, stream, **kw):
    """One chat turn: (content, usage) of choice 0, or of every choice with n > 1 (lists)."""
    body = sampling({"messages": msgs})
    body.update(kw)
    if not stream:
        r = srv.curl("/v1/chat/completions", body)
        texts = [c["message"]["content"] for c in sorted(r["choices"], key=lambda c: c["index"])]
        usage = r["usage"]
    else:
        body.update(stream=True, stream_options={"include_usage": True})
        texts, usage = {}, None
        for e in srv.curl("/v1/chat/completions", body, stream=True):
            if "error" in e:
                raise RuntimeError(str(e))
            usage = e.get("usage") or usage
            for c in e.get("choices", []):
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        texts = [texts[i] for i in sorted(texts)]
    return (texts if kw.get("n", 1) > 1 else texts[0]), usage


# A long system message (about 1,750 tokens on either vocabulary with 60 rules) and short user
# messages: a turn adds fewer than 5% new tokens, so 95% of it can come from the cache.
WORDS = ("the little cat saw a big red ball in the garden and ran to get it while her friend the dog "
         "watched from under the old tree near the house where they lived with a kind girl named Lily").split()
SYSTEM = "You tell short stories to children. " + " ".join(
    "%s %s." % (" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(9)), "Story rule %d" % i) for i in range(RULES))
USERS = ["Tell me a story.", "What next?", "Who came?", "Why?", "Where to?", "And then?", "How did it end?",
         "One more."]


def conversation(srv, turns, tokenize=True):
    """turns turns (streamed every other one); per turn: prompt ids, prompt and cached tokens, answer."""
    msgs, out = [{"role": "system", "content": SYSTEM}], []
    for t in range(turns):
        msgs.append({"role": "user", "content": USERS[t % len(USERS)]})
        ids = srv.curl("/tokenize", {"messages": msgs})["tokens"] if tokenize else None
        content, usage = chat(srv, msgs, stream=t % 2 == 1)
        out.append({"ids": ids, "prompt": usage["prompt_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "answer": content,
                    "completion": usage["completion_tokens"]})
        msgs.append({"role": "assistant", "content": content})
    return msgs, out


def whole(r):
    """A turn's prompt and answer in full blocks of 16 tokens (the default; its last token was never fed)."""
    return (r["prompt"] + r["completion"] - 1) // 16 * 16


def report(name, turns):
    for k, r in enumerate(turns):
        print("  %s %s turn %d: %d prompt tokens, %d cached (%.1f%%)" % (LABEL, name, k + 1, r["prompt"], r["cached"],
                                                                       100.0 * r["cached"] / r["prompt"]))


def chatml(msgs):
    return "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"]) for m in msgs) + "<|im_start|>assistant\n"


# ---- the chat, warm -------------------------------------------------------------------
srv = Server()
msgs, turns = conversation(srv, TURNS)
report("kept", turns)
for k, r in enumerate(turns):
    check(len(r["ids"]) == r["prompt"], "turn %d: /tokenize gives the prompt's ids (%d)" % (k + 1, r["prompt"]),
          len(r["ids"]))
    text, want = srv.curl("/detokenize", {"tokens": r["ids"]})["content"], chatml(msgs[:2 * k + 2])
    # (a vocabulary without a token for "\u2581" before a character it cannot join, as kvlm synth's
    # before capitals and "<", spells the space as the bytes of "\u2581"; SentencePiece puts one first)
    text = text.replace("\u2581", " ")
    check(text in (want, " " + want), "turn %d: its ids spell the rendered prompt exactly" % (k + 1),
          (len(text), len(want)))
    if k:
        prev = turns[k - 1]
        check(r["cached"] >= MIN_SHARE * r["prompt"], "turn %d: %d of %d prompt tokens cached (>= %g%%)" %
              (k + 1, r["cached"], r["prompt"], 100 * MIN_SHARE))
        check(r["cached"] >= whole(prev), "turn %d: ... every full block of the previous turn's prompt and answer "
              "(%d)" % (k + 1, whole(prev)))
        prev = turns[k - 1]
        check(r["ids"][:len(prev["ids"])] == prev["ids"], "turn %d: the prompt begins with the previous turn's ids" %
              (k + 1))
want = TURNS * (TURNS - 1) // 2
want_tokens = sum(sum(t["completion"] for t in turns[:k]) for k in range(TURNS))
got, got_tokens = srv.metric("kvlm_chat_answer_reuse_total"), srv.metric("kvlm_chat_answer_reuse_tokens_total")
check(got == want and got_tokens == want_tokens, "/metrics: %d answers reused, %d tokens" % (want, want_tokens),
      (got, got_tokens))
st = srv.curl("/kvlm/status").get("chat_answers", {})
check(st.get("reused") == want and st.get("kept") == TURNS and 0 < st.get("bytes", 0) <= st.get("cap_bytes", 0),
      "/kvlm/status: chat_answers %s" % st, st)

# ---- an edited answer is not taken, nor any after it; the ones before it are -------------
edited = [dict(m) for m in msgs[:7]]  # system, u1, a1, u2, a2, u3, a3
edited[4]["content"] += " Yes."
before = srv.metric("kvlm_chat_answer_reuse_total")
chat(srv, edited, stream=False, max_tokens=4)
check(srv.metric("kvlm_chat_answer_reuse_total") - before == 1,
      "an edited answer (and the one after it) is tokenized as text; the one before it is reused",
      srv.metric("kvlm_chat_answer_reuse_total") - before)

if "--extra" in args:
    # n > 1: each choice's answer is kept with the prompt they share
    two = msgs[:2]
    texts, _ = chat(srv, two, stream=False, n=2, temperature=0.9, seed=7)
    for i, text in enumerate(texts):
        before = srv.metric("kvlm_chat_answer_reuse_total")
        _, u = chat(srv, two + [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}],
                    stream=True, max_tokens=4)
        check(srv.metric("kvlm_chat_answer_reuse_total") - before == 1 and
              u["prompt_tokens_details"]["cached_tokens"] >= MIN_SHARE * u["prompt_tokens"],
              "n = 2: choice %d's answer is reused (%d of %d cached)" %
              (i, u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]))
    # stop strings: the answer the client got ends where a stop string began; kept when that is
    # where a token ends (the ids before it spell it), not when it is inside one
    r = srv.curl("/v1/chat/completions", sampling({"messages": two, "logprobs": True}))
    toks = [e["token"] for e in r["choices"][0]["logprobs"]["content"]]
    text = r["choices"][0]["message"]["content"]
    # where each token's text begins in the answer (the detokenizer drops a space after BOS)
    starts, p = [], 0
    for tok in toks:
        starts.append(p)
        if text.startswith(tok, p):
            p += len(tok)
        elif tok.startswith(" ") and text.startswith(tok[1:], p):
            p += len(tok) - 1
        else:
            break
    for inside in (False, True):
        k = next((k for k in range(len(starts) // 2, len(starts))
                  if len(toks[k].strip()) >= 3 and text[starts[k]:].startswith(toks[k]) and
                  text.find(toks[k][1 if inside else 0:]) == starts[k] + (1 if inside else 0)), None)
        if k is None:
            check(False, "a token to stop at (inside: %s)" % inside, toks)
            continue
        stop = toks[k][1:] if inside else toks[k]
        unmatched = srv.metric("kvlm_chat_answers_unmatched_total")
        got, _ = chat(srv, two, stream=inside, stop=[stop])
        want_text = text[:starts[k] + (1 if inside else 0)]
        before = srv.metric("kvlm_chat_answer_reuse_total")
        chat(srv, two + [{"role": "assistant", "content": got}, {"role": "user", "content": "More."}], stream=False,
             max_tokens=4)
        reused = srv.metric("kvlm_chat_answer_reuse_total") - before
        missed = srv.metric("kvlm_chat_answers_unmatched_total") - unmatched
        check(got == want_text and reused == (0 if inside else 1) and missed == (1 if inside else 0),
              "stop %r %s a token: the answer is %s" % (stop, "inside" if inside else "at the start of",
                                                       "not kept" if inside else "kept up to it"),
              (got, want_text, reused, missed))
srv.stop()

# ---- answers from another process are not trusted -------------------------------------------
other = Server()
_, u = chat(other, msgs, stream=False, max_tokens=4)
check(other.metric("kvlm_chat_answer_reuse_total") == 0 and u["prompt_tokens_details"]["cached_tokens"] == 0,
      "another server process takes none of these answers as ids")
other.stop()

# ---- every answer equals a cold run given the same prompt ids -----------------------------
def parting(cold, warm):
    """Where the cold run's tokens leave the warm answer: (index, whether the warm answer's next
    token was one of the cold run's top tokens within NEAR_TIE nats of its choice), or None."""
    lp, p, prev_empty = cold["logprobs"], 0, False
    for i, tok in enumerate(lp["tokens"]):
        t = tok[1:] if prev_empty and tok.startswith(" ") else tok  # the detokenizer drops a space after BOS
        if not warm.startswith(t, p):
            chosen = lp["token_logprobs"][i]
            near = [a for a, v in lp["top_logprobs"][i].items() if a != tok and v >= chosen - NEAR_TIE and a and
                    warm.startswith(a[1:] if prev_empty and a.startswith(" ") else a, p)]
            return i, bool(near)
        p += len(t)
        prev_empty = tok == ""
    return None if p == len(warm) else (len(lp["tokens"]), False)


exact = 0
for k, r in enumerate(turns):
    cold = Server()
    c = cold.curl("/v1/completions", sampling({"prompt": r["ids"], "logprobs": 5}))
    cold.stop()
    check(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "turn %d: the cold run is cold" % (k + 1))
    same = c["choices"][0]["text"] == r["answer"]
    exact += same
    part = None if same else parting(c["choices"][0], r["answer"])
    check(same or (NEAR_TIE > 0 and part and part[1]),
          "turn %d: the answer equals a cold run on its prompt ids%s" %
          (k + 1, "" if same else " up to a near-tie at its token %s" % (part and part[0])),
          (c["choices"][0]["text"], r["answer"], part))
print("  %s: %d of %d answers equal their cold run exactly" % (LABEL, exact, TURNS))

# ---- without the answers kept, the cache breaks: the test can fail --------------------------
if "--control" in args:
    ctl = Server(["--answer-ids-mem", "0"])
    _, base = conversation(ctl, TURNS, tokenize=False)
    report("none kept", base)
    broken = [k + 1 for k in range(1, TURNS) if base[k]["cached"] < whole(base[k - 1])]
    check(broken, "with --answer-ids-mem 0 the cache breaks inside the previous answer at turns %s: the answers "
          "re-tokenize otherwise" % broken)
    check(ctl.metric("kvlm_chat_answer_reuse_total") is None, "... and /metrics has no reuse counters")
    ctl.stop()
    if CSV:
        with open(CSV, "w") as f:
            f.write("turn,prompt_kept,cached_kept,prompt_none,cached_none\n")
            for k in range(TURNS):
                f.write("%d,%d,%d,%d,%d\n" % (k + 1, turns[k]["prompt"], turns[k]["cached"], base[k]["prompt"],
                                               base[k]["cached"]))
sys.exit(1 if failures else 0)
