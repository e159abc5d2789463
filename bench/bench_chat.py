#!/usr/bin/env python3
"""bench/bench_chat: a conversation through `kvlm chat` (the earlier turns kept in the
KV cache) against the same conversation prefilled whole at every turn (`kvlm run` on the
rendered conversation, what a client of an engine without prefix reuse pays), greedy,
in one script. Prints per turn the prompt's tokens, the tokens each prefilled and the
prefill time each reported (time to first token), the ratio, and whether the answers are
the same.

  python3 bench/bench_chat.py [--kvlm build/kvlm] [--model FILE] [--turns 8] [-n 48] [-t 2]

Without --model it writes a random-weight model of the stories110M shape (12 layers of
768, Q8_0 weights, context 2048) to /tmp/kvlm-bench/chat110m.gguf. The conversation is
rendered as ChatML (--chat-template chatml), by kvlm chat and by this script for kvlm run.
"""
import argparse, os, re, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("--kvlm", default="build/kvlm")
ap.add_argument("--model")
ap.add_argument("--turns", type=int, default=8)
ap.add_argument("-n", type=int, default=48)
ap.add_argument("-t", type=int, default=2)
a = ap.parse_args()

model = a.model
if not model:
    os.makedirs("/tmp/kvlm-bench", exist_ok=True)
    model = "/tmp/kvlm-bench/chat110m.gguf"
    if not os.path.exists(model):
        subprocess.run([a.kvlm, "synth", model, "--dim", "768", "--layers", "12", "--heads", "12", "--kv-heads", "12",
                        "--hidden", "2048", "--vocab", "4096", "--ctx", "2048", "--type", "q8_0"], check=True,
                       capture_output=True)

users = ["Here is a paragraph I wrote about my garden, with the roses by the fence, the beans along the wall "
         "and the old apple tree in the corner that my grandfather planted: please read it carefully. %d" % k
         for k in range(a.turns)]
common = ["-m", model, "--temp", "0", "-t", str(a.t), "-n", str(a.n)]
p = subprocess.run([a.kvlm, "chat", "--chat-template", "chatml"] + common, input="".join(u + "\n" for u in users), capture_output=True, text=True)
if p.returncode:
    sys.exit("kvlm chat failed: " + p.stderr[-500:])
chat_out = p.stdout  # each answer followed by a newline (an answer may hold newlines of its own)
turns = [tuple(float(x) for x in m.groups()) for m in re.finditer(
    r"\[turn \d+: (\d+) prompt tokens, (\d+) from the cache, (\d+) prefilled \(([\d.]+) tokens/s\)", p.stderr)]

convo, tot_chat, tot_run, tok_chat, tok_run, run_out = "", 0.0, 0.0, 0, 0, ""
print("turn  prompt  chat: prefilled    ms | run: prefilled    ms | ratio")
for k, u in enumerate(users):
    convo += "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n" % u
    r = subprocess.run([a.kvlm, "run", "--special", "-p", convo] + common, capture_output=True, text=True)
    m = re.search(r"prompt tokens: (\d+) \| prefill: ([\d.]+) tokens/s", r.stderr)
    out = r.stdout.rstrip("\n")
    # the answer follows the echoed prompt's last "assistant\n" (the echo may differ from the
    # text where the vocabulary falls back to bytes)
    at = out.rfind("assistant\n")
    got = out[at + len("assistant\n"):] if at >= 0 else None
    n_run, rate_run = int(m.group(1)), float(m.group(2))
    n, cached, pre, rate = turns[k]
    ms_chat, ms_run = 1e3 * pre / rate, 1e3 * n_run / rate_run
    run_out += (got or "") + "\n"
    tot_chat, tot_run, tok_chat, tok_run = tot_chat + ms_chat, tot_run + ms_run, tok_chat + int(pre), tok_run + n_run
    print("%4d  %6d  %15d %5.1f | %14d %5.1f | %5.1fx" % (k + 1, n, pre, ms_chat, n_run, ms_run, ms_run / ms_chat))
    convo += (got or "").strip(" \n") + "<|im_end|>\n"
same = run_out == chat_out
print("total: chat prefilled %d tokens in %.1f ms, run %d in %.1f ms: %.2fx fewer tokens, %.2fx less prefill time; "
      "answers %s" % (tok_chat, tot_chat, tok_run, tot_run, tok_run / tok_chat, tot_run / tot_chat,
                      "the same" if same else "DIFFER"))
sys.exit(0 if same else 1)
