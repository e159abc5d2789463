#!/usr/bin/python3
"""bench/copy_model: turns a random-weight f32 llama GGUF written by
`kvlm synth` into a model that copies its context, for speculative decoding's
editing benchmark (bench_spec --copy): no real model that copies its context
can be had offline here, and a random-weight model never does.

Usage: copy_model.py IN.gguf OUT.gguf [--seed S] [--check]

The weights are set by hand, as an induction circuit (Olsson et al. 2022):
- The embedding writes two random codes of the token: a 128-dimension one,
  c(t), that the output reads, and an 11-dimension one, k(t), for matching;
  plus a constant 1.
- Layer 0 has five positional heads. Their queries and keys come from the
  constant only, in the 8 rotated dimensions of the head: the key holds a
  fixed vector and the query the same vector turned back by d positions, so
  the score sum_i w_i cos(om_i (delta - d)) peaks at delta = d (weights w
  chosen for the widest margin over 2,048 positions). Head d copies k of the
  token d places back into a subspace of its own.
- Layer 1 has two induction heads (identical scores, each carrying half of
  c): position i asks, in the 56 unrotated dimensions, for a position j
  whose five previous tokens are i's last five, (k(t_i) .. k(t_i-4))
  against (k(t_j-1) .. k(t_j-5)), and copies c(t_j): the token that
  followed the same five tokens before.
- The output layer reads the copied code: logit(t) = c(t) . copied.
- Every other weight (all feed-forward layers, the other heads, every layer
  past 1) stays random, with its output projection scaled down so the
  circuit's signal survives: the model costs exactly as much to run as any
  model of its shape, and nothing in the engine knows its weights are
  special.

Where the text so far holds its last five tokens once, greedy decoding
continues what followed them; where they occur several times, it follows
one of them (or a blend), as a weak model loses its place in a text that
repeats itself.

--check runs the model's forward pass in NumPy on a short copy task and
exits 1 if it does not copy (a test of this script, not of the engine)."""
import struct
import sys

import numpy as np

GGUF_MAGIC = b"GGUF"
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
M, RD, NG = 128, 8, 5     # output code size, rotated dimensions per head, tokens matched
KM = (64 - RD) // NG      # match code size: NG of them fill a head's unrotated dimensions
EPS = 0.002               # scale of the random parts' output projections


class Gguf:
    """The parts of a GGUF this script needs: metadata values with the file
    offset of each scalar, and each tensor's shape, type and data offset."""

    def __init__(self, path):
        self.buf = bytearray(open(path, "rb").read())
        self.pos = 0
        if self.take_bytes(4) != GGUF_MAGIC:
            sys.exit("copy_model: %s is not a GGUF file" % path)
        self.take("<I")
        n_tensors, n_kv = self.take("<Q"), self.take("<Q")
        self.meta, self.meta_at = {}, {}
        for _ in range(n_kv):
            key = self.string()
            vtype = self.take("<I")
            self.meta_at[key] = (self.pos, vtype)
            self.meta[key] = self.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            ne = [self.take("<Q") for _ in range(self.take("<I"))]
            infos.append((name, ne, self.take("<I"), self.take("<Q")))
        align = int(self.meta.get("general.alignment", 32))
        start = (self.pos + align - 1) // align * align
        self.tensors = {n: (list(reversed(ne)), t, start + off) for n, ne, t, off in infos}

    def take_bytes(self, n):
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def take(self, fmt):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        return self.take_bytes(self.take("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype):
        if vtype in SCALARS:
            return self.take(SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype in SCALARS:
                self.pos += n * struct.calcsize(SCALARS[etype])
                return None
            return [self.value(etype) for _ in range(n)]
        sys.exit("copy_model: unknown GGUF value type %d" % vtype)

    def set_scalar(self, key, v):
        at, vtype = self.meta_at[key]
        struct.pack_into(SCALARS[vtype], self.buf, at, v)

    def put(self, name, a):
        shape, ttype, at = self.tensors[name]
        if ttype != 0:
            sys.exit("copy_model: %s is not f32 (write the input with kvlm synth --type f32)" % name)
        a = np.asarray(a, dtype="<f4")
        if list(a.shape) != shape:
            sys.exit("copy_model: %s: shape %s, expected %s" % (name, a.shape, shape))
        self.buf[at:at + a.nbytes] = a.tobytes()


def positional_weights(d, base, n_ctx=2048):
    """Weights w_i >= 0, sum 1, of the rotated pairs for a head that attends
    d places back: the widest margin S(d) - max S(delta != d) over the
    context, by random search (a few thousand tries suffice for 8 pairs)."""
    om = base ** (-np.arange(RD // 2) / (RD // 2))
    delta = np.arange(n_ctx + 1)
    cosines = np.cos(om[:, None] * (delta[None, :] - d))
    rng = np.random.default_rng(d)
    w = rng.random((4000, RD // 2)) ** 3
    w /= w.sum(1, keepdims=True)
    s = w @ cosines
    others = np.delete(s, d, axis=1).max(1)
    i = int(np.argmax(s[:, d] - others))
    return w[i], om, float(s[i, d] - others[i])


def build(g, seed):
    meta = g.meta
    arch = meta["general.architecture"]
    if arch != "llama":
        sys.exit("copy_model: a llama model is needed, not %s" % arch)
    dim = meta["llama.embedding_length"]
    n_layers = meta["llama.block_count"]
    H = meta["llama.attention.head_count"]
    H_kv = meta.get("llama.attention.head_count_kv", H)
    hidden = meta["llama.feed_forward_length"]
    hd = dim // H
    vocab = g.tensors["token_embd.weight"][0][0]
    base = float(meta.get("llama.rope.freq_base", 10000.0))
    need = 2 * M + (NG + 1) * KM + 1
    if hd != 64 or n_layers < 2 or H_kv < 2 or H < NG or dim < need:
        sys.exit("copy_model: needs head dim 64, 2 layers, %d heads, 2 KV heads and dim >= %d" % (NG, need))
    rng = np.random.default_rng(seed)
    # residual stream: A code (M) | P[0] key code of t_i, P[d] of t_i-d (KM each) | U 1 | D copied code (M)
    A = np.arange(0, M)
    P = [M + d * KM + np.arange(KM) for d in range(NG + 1)]
    U = M + (NG + 1) * KM
    D = U + 1 + np.arange(M)
    group = H // H_kv  # query heads per KV head

    def unit_rows(n, k):
        x = rng.standard_normal((n, k))
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    code, key = unit_rows(vocab, M), unit_rows(vocab, KM)
    emb = np.zeros((vocab, dim))
    emb[:, A], emb[:, P[0]], emb[:, U] = code, key, 1.0
    g.put("token_embd.weight", emb)

    def rand(rows, cols, scale=1.0):
        return rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))

    for li in range(n_layers):
        p = "blk.%d." % li
        wq, wk, wv = rand(H * hd, dim), rand(H_kv * hd, dim), rand(H_kv * hd, dim)
        wo = rand(dim, H * hd, EPS)
        if li == 0:
            # RMSNorm scales the input [code, key, 1] by sqrt(dim / 3)
            s = np.sqrt(dim / 3.0)
            # Query heads 0..NG-1 (on one KV head or more) share a key, kw on
            # each pair's first element; head d-1's query is turned back by d
            # positions and weighted so that its score is
            # 350 sum_i w_d,i cos(om_i (delta - d)): a margin of about
            # 0.055 * 350 = 19 over every other delta (4 pairs, base 10000).
            ws = [positional_weights(d, base)[0] for d in range(1, NG + 1)]
            om = base ** (-np.arange(RD // 2) / (RD // 2))
            kw = np.sqrt(np.mean(ws, axis=0))
            gq, gk = 700.0, 4.0
            for kvh in sorted({qh // group for qh in range(NG)}):
                wk[kvh * hd:(kvh + 1) * hd, :] = 0.0
                wk[kvh * hd + 2 * np.arange(RD // 2), U] = kw * gk / s
                wv[kvh * hd:(kvh + 1) * hd, :] = 0.0
                wv[kvh * hd + np.arange(KM), P[0]] = 1.0 / s  # value: key code of the attended token
            for qh in range(NG):
                d = qh + 1
                wq[qh * hd:(qh + 1) * hd, :] = 0.0
                a = ws[qh] / kw * gq / s
                wq[qh * hd + 2 * np.arange(RD // 2), U] = a * np.cos(-om * d)
                wq[qh * hd + 2 * np.arange(RD // 2) + 1, U] = a * np.sin(-om * d)
                wo[:, qh * hd:(qh + 1) * hd] = 0.0
                wo[P[d], qh * hd + np.arange(KM)] = 1.0
        elif li == 1:
            # input [code, key codes of t_i .. t_i-NG, 1]: scaled by sqrt(dim / (NG + 3))
            s = np.sqrt(dim / (NG + 3.0))
            # query (key codes of t_i .. t_i-NG+1) against key (of t_j-1 ..
            # t_j-NG): a full match scores NG, one wrong token about NG - 1
            gq, gk = 60.0, 4.0  # 30 per matching token
            for kvh in (0, 1):
                qh = kvh * group
                wq[qh * hd:(qh + 1) * hd, :] = 0.0
                wk[kvh * hd:(kvh + 1) * hd, :] = 0.0
                for d in range(NG):
                    wq[qh * hd + RD + d * KM + np.arange(KM), P[d]] = gq / s
                    wk[kvh * hd + RD + d * KM + np.arange(KM), P[d + 1]] = gk / s
                wv[kvh * hd:(kvh + 1) * hd, :] = 0.0
                wv[kvh * hd + np.arange(hd), A[kvh * hd:(kvh + 1) * hd]] = 1.0 / s
                wo[:, qh * hd:(qh + 1) * hd] = 0.0
                wo[D[kvh * hd:(kvh + 1) * hd], qh * hd + np.arange(hd)] = 1.0
        # the scale s above undoes RMSNorm's; the norms' own weights are 1
        g.put(p + "attn_norm.weight", np.ones(dim))
        g.put(p + "ffn_norm.weight", np.ones(dim))
        g.put(p + "attn_q.weight", wq)
        g.put(p + "attn_k.weight", wk)
        g.put(p + "attn_v.weight", wv)
        g.put(p + "attn_output.weight", wo)
        g.put(p + "ffn_gate.weight", rand(hidden, dim))
        g.put(p + "ffn_up.weight", rand(hidden, dim))
        g.put(p + "ffn_down.weight", rand(dim, hidden, EPS))
    g.put("output_norm.weight", np.ones(dim))
    out = np.zeros((vocab, dim))
    out[:, D] = code * 10.0 / np.sqrt(dim / (NG + 4.0))
    g.put("output.weight", out)
    g.set_scalar("llama.rope.dimension_count", RD)


def check(path):
    """NumPy forward pass (scripts/ref/llama_ref.py) on a copy task: 60
    random tokens, then their first 10 again; greedy decoding must go on
    with the next 20 of the passage."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "ref"))
    import llama_ref
    m = llama_ref.load_gguf(path)[0]
    rng = np.random.default_rng(7)
    passage = list(rng.integers(3, m.vocab, 60))
    ids = [1] + passage + passage[:10]
    got = []
    for _ in range(20):
        logits = llama_ref.forward(m, ids)[-1]
        ids.append(int(np.argmax(logits)))
        got.append(ids[-1])
    want = passage[10:30]
    same = sum(int(a == b) for a, b in zip(got, want))
    print("copy_model --check: %d of 20 tokens copied" % same)
    return same == 20


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 1
    g = Gguf(argv[1])
    build(g, seed)
    with open(argv[2], "wb") as f:
        f.write(g.buf)
    if "--check" in argv and not check(argv[2]):
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv)
