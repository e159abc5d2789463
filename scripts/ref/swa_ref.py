#!/usr/bin/python3
"""swa_ref: an independent, slow, float64 reference of sliding-window
attention and of the Gemma 2 / Gemma 3 (text) forward pass, a sibling of
llama_ref.py (whose GGUF reader, RoPE and CLI conventions it reuses).

What it models, from the published descriptions (Hugging Face's Gemma2 /
Gemma3 modelling code and llama.cpp's graphs), not from kvlm's C code:
  - window W: the query at position p sees keys k with p - W < k <= p
    (masked when p - k >= W, llama.cpp's is_masked_swa / HF's mask).
  - llama with llama.attention.sliding_window: every layer local.
  - gemma2: layer l local when l is even (HF: not layer_idx % 2), window
    gemma2.attention.sliding_window; x = embedding * sqrt(dim); per layer
      h = x + post_attention_norm(attn(attn_norm(x)))
      x = h + post_ffw_norm(down(gelu_tanh(gate(n)) * up(n))), n = ffn_norm(h)
    scores (q/sqrt(head_dim)).k soft-capped cap * tanh(s / cap) with
    gemma2.attn_logit_softcapping, logits with final_logit_softcapping;
    NeoX RoPE; norms' weights used as stored (the GGUF converter already
    added Gemma's +1).
  - gemma3: layer l global when (l + 1) % 6 == 0; local layers' RoPE base
    10000, global rope.freq_base; q and k RMS-normed per head (attn_q_norm,
    attn_k_norm) before RoPE; no soft-capping.

Usage: swa_ref.py MODEL --ids "1 2 3" [--logits] [--compare FILE... --tol X]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref as lr  # noqa: E402


class Cfg:
    pass


def load(path):
    meta, t, _ = lr.read_gguf(path)
    a = meta["general.architecture"]
    if a not in ("llama", "gemma2", "gemma3"):
        raise ValueError("swa_ref: architecture %r (llama, gemma2, gemma3)" % a)
    m = Cfg()
    m.arch = a
    m.dim = int(meta[a + ".embedding_length"])
    m.n_layers = int(meta[a + ".block_count"])
    m.n_heads = int(meta[a + ".attention.head_count"])
    m.n_kv = int(meta.get(a + ".attention.head_count_kv", m.n_heads))
    m.hd = int(meta.get(a + ".attention.key_length", m.dim // m.n_heads))
    m.rope_dim = int(meta.get(a + ".rope.dimension_count", m.hd))
    m.eps = float(meta.get(a + ".attention.layer_norm_rms_epsilon", 1e-5))
    m.base = float(meta.get(a + ".rope.freq_base", 10000.0))
    gemma = a != "llama"
    m.window = int(meta.get(a + ".attention.sliding_window", {"gemma2": 4096, "gemma3": 512}.get(a, 0)))
    if a == "llama":
        m.local = [m.window > 0] * m.n_layers
    elif a == "gemma2":
        m.local = [l % 2 == 0 for l in range(m.n_layers)]
    else:
        m.local = [(l + 1) % 6 != 0 for l in range(m.n_layers)]
    m.local_base = 10000.0 if a == "gemma3" else m.base
    stype = meta.get(a + ".rope.scaling.type", b"none")
    stype = stype.decode() if isinstance(stype, bytes) else stype
    if stype not in ("none", "linear"):
        raise ValueError("swa_ref: RoPE scaling %r" % stype)
    # linear scaling: the global layers' angles divided (gemma3 4B+: factor 8); local layers keep theirs
    m.scale = float(meta.get(a + ".rope.scaling.factor", 1.0)) if stype == "linear" else 1.0
    m.attn_cap = float(meta.get(a + ".attn_logit_softcapping", 50.0)) if a == "gemma2" else 0.0
    m.final_cap = float(meta.get(a + ".final_logit_softcapping", 30.0)) if a == "gemma2" else 0.0
    m.emb = t["token_embd.weight"]
    m.out = t.get("output.weight", m.emb)
    m.out_norm = t["output_norm.weight"]
    m.neox = gemma
    m.gemma = gemma
    m.layers = []
    for l in range(m.n_layers):
        p = "blk.%d." % l
        L = {k: t[p + n + ".weight"] for k, n in (
            ("attn_norm", "attn_norm"), ("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"),
            ("wo", "attn_output"), ("ffn_norm", "ffn_norm"), ("w1", "ffn_gate"),
            ("w2", "ffn_down"), ("w3", "ffn_up"))}
        for k, n in (("post_attn", "post_attention_norm"), ("post_ffn", "post_ffw_norm"),
                     ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            L[k] = t.get(p + n + ".weight")
        m.layers.append(L)
    return m


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(m, ids):
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    qp, kp = np.arange(T)[:, None], np.arange(T)[None, :]
    causal = kp <= qp
    windowed = causal & (qp - kp < m.window) if m.window > 0 else causal
    x = m.emb[np.asarray(ids)].copy()
    if m.gemma:
        x *= np.sqrt(m.dim)
    g = m.n_heads // m.n_kv
    for l, L in enumerate(m.layers):
        h = lr.rmsnorm(x, L["attn_norm"], m.eps)
        q = (h @ L["wq"].T).reshape(T, m.n_heads, m.hd)
        k = (h @ L["wk"].T).reshape(T, m.n_kv, m.hd)
        v = (h @ L["wv"].T).reshape(T, m.n_kv, m.hd)
        if L["q_norm"] is not None:
            q = lr.rmsnorm(q, L["q_norm"], m.eps)
            k = lr.rmsnorm(k, L["k_norm"], m.eps)
        base = m.local_base if m.local[l] else m.base
        scale = 1.0 if m.local[l] and m.arch == "gemma3" else m.scale  # gemma3: local layers unscaled (llama.cpp)
        q = lr.rope(q, pos, m.rope_dim, base, m.neox, None, scale)
        k = lr.rope(k, pos, m.rope_dim, base, m.neox, None, scale)
        allowed = windowed if m.local[l] else causal
        att = np.empty((T, m.n_heads, m.hd))
        for hh in range(m.n_heads):
            s = q[:, hh, :] @ k[:, hh // g, :].T / np.sqrt(m.hd)
            if m.attn_cap > 0:
                s = m.attn_cap * np.tanh(s / m.attn_cap)
            s = np.where(allowed, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh, :] = s @ v[:, hh // g, :]
        o = att.reshape(T, -1) @ L["wo"].T
        if L["post_attn"] is not None:
            o = lr.rmsnorm(o, L["post_attn"], m.eps)
        x = x + o
        h = lr.rmsnorm(x, L["ffn_norm"], m.eps)
        act = gelu_tanh if m.gemma else lr.silu
        f = (act(h @ L["w1"].T) * (h @ L["w3"].T)) @ L["w2"].T
        if L["post_ffn"] is not None:
            f = lr.rmsnorm(f, L["post_ffn"], m.eps)
        x = x + f
    logits = lr.rmsnorm(x, m.out_norm, m.eps) @ m.out.T
    if m.final_cap > 0:
        logits = m.final_cap * np.tanh(logits / m.final_cap)
    return logits


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--logits", action="store_true")
    ap.add_argument("--no-window", action="store_true", help="ignore the window (to show it matters)")
    ap.add_argument("--compare", metavar="FILE", nargs="+")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args(argv)
    m = load(args.model)
    if args.no_window:
        m.window = 0
    ids = [int(s) for s in args.ids.replace(",", " ").split()]
    ref = forward(m, ids)
    if args.compare:
        return max(lr.compare_logits(ref, f, args.tol) for f in args.compare)
    if args.logits:
        out = sys.stdout
        for row in ref:
            out.write(" ".join("%.6g" % v for v in row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
