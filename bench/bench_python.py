#!/usr/bin/env python3
"""bench/bench_python: tokens/s of greedy decoding through the Python package
(kvlm.Llama, stream and whole, and kvlm.LLM.generate over 16 prompts) against
`kvlm run` on the same model in the same run: the ratio is what Python, ctypes
and the scheduler's per-step callback cost. One thread each, the best of
--rounds runs.

usage: /usr/bin/python3 bench/bench_python.py [--kvlm build/kvlm] [--model M.gguf] [--tokens 256] [--rounds 3]
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
    a = ap.parse_args()
    prompt = "Once upon a time"
    best_cli = 0.0
    for _ in range(a.rounds):
        r = subprocess.run([a.kvlm, "run", "-m", a.model, "-p", prompt, "-n", str(a.tokens), "--temp", "0", "-t", "1",
                            "--ignore-eos"], capture_output=True, text=True, check=True)
        best_cli = max(best_cli, float(re.search(r"decode: ([0-9.]+) tokens/s", r.stderr).group(1)))
    print(f"kvlm run: {best_cli:.1f} tokens/s (decode, {a.tokens} tokens)")
    llm = kvlm.Llama(a.model, n_threads=1, n_ctx=0)
    results = {}
    for mode in ("whole", "stream"):
        best = 0.0
        for _ in range(a.rounds):
            t = time.perf_counter()
            if mode == "whole":
                n = llm.create_completion(prompt, max_tokens=a.tokens, temperature=0)["usage"]["completion_tokens"]
            else:
                n = 0
                for _c in llm.create_completion(prompt, max_tokens=a.tokens, temperature=0, stream=True):
                    n += 1
                n -= 1  # the last chunk carries the finish reason
            best = max(best, n / (time.perf_counter() - t))
        results[mode] = best
        # (includes the prompt's prefill, which kvlm run's decode figure leaves out: 5 tokens)
        print(f"kvlm.Llama {mode}: {best:.1f} tokens/s, {best / best_cli:.3f} of kvlm run")
    llm.close()
    with kvlm.LLM(a.model, n_threads=1, max_num_seqs=16) as batch:
        prompts = [f"{prompt} {i}" for i in range(16)]
        sp = kvlm.SamplingParams(temperature=0, max_tokens=a.tokens // 4, ignore_eos=True)
        best = 0.0
        for _ in range(a.rounds):
            t = time.perf_counter()
            outs = batch.generate(prompts, sp)
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        print(f"kvlm.LLM.generate, 16 prompts: {best:.1f} tokens/s, {best / best_cli:.2f}x kvlm run's one stream")


if __name__ == "__main__":
    main()
