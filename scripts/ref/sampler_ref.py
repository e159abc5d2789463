#!/usr/bin/python3
"""scripts/ref/sampler_ref: an independent NumPy reference of kvlm's sampler
over fixed logits: each sampling parameter as vLLM, llama.cpp or OpenAI
defines it, written from their definitions (not from kvlm's code), to check
tests/test_sampler against.

Usage: sampler_ref.py CASES.jsonl
Each line is a case: "logits" (V floats), "prompt" and "picked" (token ids
given to the sampler, the second as picked by it), "params" (kvlm_sampler_params'
fields), "breakers" and "eog" (token ids: DRY's breakers, the model's
end-of-generation tokens), and "kvlm": the distribution kvlm's sampler built
("ids", "probs"); "off": params that turn the feature under test off, which
must change the distribution (or null). Prints one line per case; exits 1 when any differs (other
tokens kept, or a probability off by more than 2e-5)."""
import json
import math
import sys

import numpy as np

DEFAULT_STAGES = ["penalties", "dry", "top_k", "typ_p", "temperature", "top_p", "min_p", "xtc"]


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x)
    if not np.isfinite(m):
        return np.full(len(x), 1.0 / len(x))
    e = np.exp(x - m)
    return e / e.sum()


def sort_desc(cands):
    """Candidates [(id, logit)] by logit, largest first (ties: the lower id)."""
    return sorted(cands, key=lambda c: (-c[1], c[0]))


def penalties(cands, case, P):
    hist = case["prompt"] + case["picked"]
    out = []
    rp, rln = P.get("repeat_penalty", 1.0), P.get("repeat_last_n", 64)
    recent = set(hist[-rln:]) if rln > 0 else set()  # llama.cpp: the last n tokens, each once
    rep = P.get("repetition_penalty", 1.0)
    seen = set(hist)  # vLLM: the prompt's tokens and the output's
    freq, pres = P.get("frequency_penalty", 0.0), P.get("presence_penalty", 0.0)
    counts = {}
    for t in case["picked"]:  # OpenAI: the output's tokens only
        counts[t] = counts.get(t, 0) + 1
    for t, l in cands:
        if rp != 1.0 and rp > 0 and t in recent:
            l = l / rp if l > 0 else l * rp
        if rep != 1.0 and rep > 0 and t in seen:
            l = l / rep if l > 0 else l * rep
        if t in counts:
            l -= freq * counts[t] + pres
        out.append((t, l))
    return out


def dry(cands, case, P):
    """llama.cpp's DRY by brute force: for every earlier position j, the
    longest run ending at j that equals the run ending the text, capped at the
    distance back to the latest breaker; the token after j would extend it."""
    mult, base = P.get("dry_multiplier", 0.0), P.get("dry_base", 1.75)
    allowed, last_n = P.get("dry_allowed_length", 2), P.get("dry_penalty_last_n", -1)
    if mult <= 0 or base < 1 or last_n == 0:
        return cands
    hist = case["prompt"] + case["picked"]
    w = hist[-(last_n if last_n > 0 else 65536):]
    W = len(w)
    if W <= allowed:
        return cands
    breakers = set(case["breakers"])
    limit = W
    for i in range(W):
        if w[W - 1 - i] in breakers:
            limit = i
            break
    if limit < allowed:
        return cands
    best = {}
    for j in range(W - 1):
        m = 0
        while m <= j and w[j - m] == w[W - 1 - m]:
            m += 1
        m = min(m, limit)
        if m >= allowed:
            best[w[j + 1]] = max(best.get(w[j + 1], 0), m)
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    out = []
    for t, l in cands:
        if t in best and t not in breakers:
            e = best[t] - allowed
            if max_exp > 0 and e > max_exp:
                e = max_exp
            l -= mult * base ** e
        out.append((t, l))
    return out


def top_k(cands, P):
    k = P.get("top_k", 0)
    c = sort_desc(cands)
    return c[:k] if 0 < k < len(c) else c


def typical(cands, P):
    """Meister et al.: tokens by |-log p - H| ascending until their mass exceeds p."""
    p = P.get("typical_p", 1.0)
    if not (0 < p < 1) or len(cands) < 2:
        return cands
    c = sort_desc(cands)
    probs = softmax([l for _, l in c])
    h = -sum(q * math.log(q) for q in probs if q > 0)
    order = sorted(range(len(c)), key=lambda i: (abs(-math.log(probs[i]) - h), i))
    cum, m = 0.0, len(c)
    for rank, i in enumerate(order):
        cum += probs[i]
        if cum > p:
            m = rank + 1
            break
    return [c[i] for i in order[:m]]


def top_p(cands, P):
    p = P.get("top_p", 1.0)
    if not (0 < p < 1):
        return cands
    c = sort_desc(cands)
    probs = softmax([l for _, l in c])
    cum = np.cumsum(probs)
    idx = np.nonzero(cum >= p)[0]
    return c[:idx[0] + 1] if len(idx) else c


def min_p(cands, P):
    p = P.get("min_p", 0.0)
    if not p > 0:
        return cands
    c = sort_desc(cands)
    probs = softmax([l for _, l in c])
    return [x for x, q in zip(c, probs) if q >= p * probs[0]] or c[:1]


def xtc(cands, P):
    """llama.cpp's XTC at probability 1: all tokens at or above the threshold
    but the least likely of them go, when there are two or more."""
    prob, thr = P.get("xtc_probability", 0.0), P.get("xtc_threshold", 0.1)
    if prob <= 0 or thr > 0.5 or len(cands) < 2:
        return cands
    assert prob >= 1.0, "the reference takes XTC at probability 0 or 1 only"
    c = sort_desc(cands)
    probs = softmax([l for _, l in c])
    above = int(np.sum(probs >= thr))
    return c[above - 1:] if above >= 2 else c


def distribution(case):
    P = case["params"]
    logits = [float(x) for x in case["logits"]]
    for t, b in zip(P.get("bias_ids", []), P.get("bias", [])):
        logits[t] += b
    banned = set()
    eog, stops = set(case["eog"]), set(P.get("stop_ids", []))
    if P.get("ignore_eos"):
        banned |= eog
    if len(case["picked"]) < P.get("min_tokens", 0):
        banned |= eog | stops
    cands = [(t, -math.inf if t in banned else l) for t, l in enumerate(logits)]
    stages = P.get("stages") or DEFAULT_STAGES
    if P.get("temperature", 1.0) <= 0:  # greedy: the penalties, then the largest
        for st in stages:
            if st == "penalties":
                cands = penalties(cands, case, P)
            elif st == "dry":
                cands = dry(cands, case, P)
        return {sort_desc(cands)[0][0]: 1.0}
    for st in stages:
        if st == "penalties":
            cands = penalties(cands, case, P)
        elif st == "dry":
            cands = dry(cands, case, P)
        elif st == "top_k":
            cands = top_k(cands, P)
        elif st == "typ_p":
            cands = typical(cands, P)
        elif st == "top_p":
            cands = top_p(cands, P)
        elif st == "min_p":
            cands = min_p(cands, P)
        elif st == "xtc":
            cands = xtc(cands, P)
        elif st == "temperature":
            cands = [(t, l / P["temperature"]) for t, l in cands]
    probs = softmax([l for _, l in cands])
    return {t: float(q) for (t, _), q in zip(cands, probs) if q > 0}


def main():
    bad = 0
    for line in open(sys.argv[1]):
        case = json.loads(line)
        ref = distribution(case)
        got = {t: p for t, p in zip(case["kvlm"]["ids"], case["kvlm"]["probs"]) if p > 0}
        why = ""
        if set(ref) != set(got):
            why = "tokens differ: only in reference %s, only in kvlm %s" % (
                sorted(set(ref) - set(got))[:10], sorted(set(got) - set(ref))[:10])
        else:
            err = max(abs(ref[t] - got[t]) for t in ref)
            if err > 2e-5:
                why = "probabilities differ by %.3g" % err
        if not why and case.get("off") is not None:  # the feature under test changes the distribution
            off = dict(case, params=dict(case["params"], **case["off"]))
            if distribution(off) == ref:
                why = "the distribution is the same with %s: the case tests nothing" % json.dumps(case["off"])
        print(("ok   " if not why else "FAIL ") + case["name"] + " (%d tokens)" % len(ref) + (": " + why if why else ""))
        bad += bool(why)
    print("%d cases differ" % bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
