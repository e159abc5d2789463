#!/usr/bin/env python3
"""bench/bench_python: tokens/s of greedy decoding through the Python package
(kvlm.Llama, stream and whole, and kvlm.LLM.generate over 16 prompts) against
`kvlm run` on the same model in the same run: the ratio is what Python, ctypes
and the scheduler's per-step callback cost. One thread each, the best of
--rounds runs. With --batch N: LLM.generate over N prompts against the same N
requests sent at once to `kvlm serve` (the same thread count) over HTTP.

usage: /usr/bin/python3 bench/bench_python.py [--kvlm build/kvlm] [--model M.gguf] [--tokens 256] [--rounds 3]
                                              [--threads 1] [--batch 64]
"""
import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
import kvlm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvlm", default=str(ROOT / "build" / "kvlm"))
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "models" / "stories260K.gguf"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=0, help="LLM.generate over N prompts against kvlm serve")
    a = ap.parse_args()
    prompt = "Once upon a time"
    best_cli = 0.0
    for _ in range(a.rounds):
        r = subprocess.run([a.kvlm, "run", "-m", a.model, "-p", prompt, "-n", str(a.tokens), "--temp", "0", "-t", str(a.threads),
                            "--ignore-eos"], capture_output=True, text=True, check=True)
        best_cli = max(best_cli, float(re.search(r"decode: ([0-9.]+) tokens/s", r.stderr).group(1)))
    print(f"kvlm run: {best_cli:.1f} tokens/s (decode, {a.tokens} tokens)")
    llm = kvlm.Llama(a.model, n_threads=a.threads, n_ctx=0)
    results = {}
    for mode in ("whole", "stream"):
        best = 0.0
        for _ in range(a.rounds):
            t = time.perf_counter()
            if mode == "whole":
                n = llm.create_completion(prompt, max_tokens=a.tokens, temperature=0)["usage"]["completion_tokens"]
            else:
                # decode only, as kvlm run's figure: from the first token's chunk to the last
                n = -1
                for c in llm.create_completion(prompt, max_tokens=a.tokens, temperature=0, stream=True):
                    if n < 0:
                        t = time.perf_counter()
                    if c["choices"][0]["finish_reason"] is None:
                        n += 1
            best = max(best, n / (time.perf_counter() - t))
        results[mode] = best
        what = "whole answers, prefill and start included" if mode == "whole" else "streamed, decode only"
        print(f"kvlm.Llama {mode}: {best:.1f} tokens/s, {best / best_cli:.3f} of kvlm run ({what})")
    llm.close()
    with kvlm.LLM(a.model, n_threads=a.threads, max_num_seqs=16) as batch:
        prompts = [f"{prompt} {i}" for i in range(16)]
        sp = kvlm.SamplingParams(temperature=0, max_tokens=a.tokens // 4, ignore_eos=True)
        best = 0.0
        for _ in range(a.rounds):
            t = time.perf_counter()
            outs = batch.generate(prompts, sp)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        print(f"kvlm.LLM.generate, 16 prompts: {best:.1f} tokens/s, {best / best_cli:.2f}x kvlm run's one stream")
    if a.batch:
        against_server(a)


def against_server(a):
    import http.client
    import json
    import threading
    n = a.batch
    prompts = [f"Once upon a time {i}" for i in range(n)]
    max_tokens = a.tokens // 4
    with kvlm.LLM(a.model, n_threads=a.threads, max_num_seqs=n) as batch:
        sp = kvlm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        best_py = 0.0
        for _ in range(a.rounds):
            t = time.perf_counter()
            outs = batch.generate(prompts, sp)
            best_py = max(best_py, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    srv = subprocess.Popen([a.kvlm, "serve", "-m", a.model, "--host", "127.0.0.1", "--port", "0", "--max-seqs",
                            str(n), "-t", str(a.threads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    try:
        port = None
        for line in srv.stdout:
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        threading.Thread(target=lambda: [None for _ in srv.stdout], daemon=True).start()
        best_http = 0.0
        for _ in range(a.rounds):
            counts = [0] * n

            def one(i):
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                body = json.dumps({"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                                   "ignore_eos": True})
                c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                counts[i] = json.loads(c.getresponse().read())["usage"]["completion_tokens"]
            ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            t = time.perf_counter()
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            best_http = max(best_http, sum(counts) / (time.perf_counter() - t))
    finally:
        srv.terminate()
        srv.wait(30)
    print(f"kvlm.LLM.generate, {n} prompts: {best_py:.1f} tokens/s; kvlm serve, the same {n} requests at once "
          f"over HTTP: {best_http:.1f} tokens/s ({best_py / best_http:.2f}x)")


if __name__ == "__main__":
    main()
