#!/usr/bin/python3
"""llama_ref: an independent, slow, float64 reference of the llama / qwen2 / qwen3 /
phi3 forward pass, tokenizer and greedy decoding, used to cross-check kvlm; and of
embeddings: decoders' final-norm hidden states, the bert and nomic-bert encoders,
BERT's WordPiece tokenizer, pooling (none, mean, cls, last) and L2 normalisation.

Reads GGUF v2/v3 (F32, F16, Q8_0 tensors) and llama2.c version-0 checkpoints
(.bin, with a tokenizer.bin). Depends on numpy only. No KV cache: every
step recomputes the whole sequence, which is what makes it a reference.

Usage:
  llama_ref.py MODEL [--tokenizer TOK.bin] (--prompt TEXT | --ids "1 2 3")
               [--n N] [--logits] [--act-q8] [--compare FILE... [--tol X]]
    --n N      greedy-generate N tokens (argmax) and print prompt + generation,
               like `kvlm run -p TEXT -n N --temp 0` (stops at EOS; invalid
               UTF-8 from byte tokens is printed as U+FFFD)
    --logits   print, per input position, the next-token logits (%.6g)
    --act-q8   round activations to Q8_0 blocks before each product with a
               Q8_0 weight, as kvlm's integer kernels do (off by default: the
               plain reference is the exact product of the stored weights)
    --embed    print the input's embedding (%.9g; pooling none: one line per
               token), as `kvlm embed --ids` does: the hidden states (a
               decoder's final norm's output, an encoder's last layer's)
               pooled by --pooling (default: {arch}.pooling_type, else last
               for a decoder and cls for an encoder) and L2-normalised unless
               --no-normalize; --dimensions N keeps the first N values first
    --compare-embed FILE [--tol X]
               compare FILE's vectors (kvlm embed's text output) with ours:
               error of a vector = max_i |file_i - ref_i| / max_i |ref_i|;
               exit 1 above X
    --wordpiece TEXT
               print the token ids of TEXT as BERT's tokenizer ([CLS] ...
               [SEP]) gives them from the file's WordPiece vocabulary (what
               `kvlm tokenize` must give)
    --compare FILE... [--tol X]
               instead of printing logits, compare them with each FILE (another
               engine's --logits output) and exit 1 if an error exceeds X.
               Error of a row = max_i |file_i - ref_i| / max(max_i |ref_i|, 1e-2):
               float32 rounding in a dot product is proportional to the size
               of the terms summed, not to the result, so a logit near zero
               carries the same absolute error as the row's largest one; a
               per-element relative error would be meaningless there.
"""
import argparse
import struct
import sys

import numpy as np

# --------------------------------------------------------------------------
# GGUF reader

GGUF_MAGIC = b"GGUF"
# value type id -> struct format for the scalar types
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
                 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGML_F32, GGML_F16, GGML_Q8_0, GGML_MXFP4 = 0, 1, 8, 39
# OCP microscaling MXFP4: 32 FP4 (E2M1: sign, 2 exponent bits, 1 mantissa bit)
# values sharing one E8M0 scale 2^(e - 127); the block is the scale byte, then
# element j's code in the low nibble of byte j and element j + 16's in its high one
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
Q8_0_BLOCK = 32  # values per block; a block is fp16 d + 32 int8


class Reader:
    """Little-endian cursor over a bytes object."""

    def __init__(self, buf, pos=0):
        self.buf, self.pos = buf, pos

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def bytes(self, n):
        if self.pos + n > len(self.buf):
            raise ValueError("truncated file")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def gguf_str(self):
        return self.bytes(self.take("<Q"))

    def gguf_value(self, vtype):
        if vtype in _GGUF_SCALARS:
            return self.take(_GGUF_SCALARS[vtype])
        if vtype == GGUF_STRING:
            return self.gguf_str().decode("utf-8", errors="surrogateescape")
        if vtype == GGUF_ARRAY:
            etype = self.take("<I")
            n = self.take("<Q")
            if etype in _GGUF_SCALARS:  # numeric arrays: read in one go
                fmt = _GGUF_SCALARS[etype]
                size = struct.calcsize(fmt)
                arr = np.frombuffer(self.bytes(n * size), dtype=np.dtype(fmt))
                return arr.tolist()
            return [self.gguf_value(etype) for _ in range(n)]
        raise ValueError("unknown GGUF value type %d" % vtype)


def read_gguf(path):
    """Returns (metadata dict, {name: float64 numpy array}, {name: GGML type}).

    A tensor with dims ne = [ne0, ne1, ...] (ne0 = row length, innermost)
    becomes an array of shape (..., ne1, ne0)."""
    with open(path, "rb") as f:
        buf = f.read()
    r = Reader(buf)
    if r.bytes(4) != GGUF_MAGIC:
        raise ValueError("%s: not a GGUF file" % path)
    version = r.take("<I")
    if version not in (2, 3):
        raise ValueError("%s: GGUF version %d not supported" % (path, version))
    n_tensors = r.take("<Q")
    n_kv = r.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = r.gguf_str().decode("utf-8")
        meta[key] = r.gguf_value(r.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = r.gguf_str().decode("utf-8")
        n_dims = r.take("<I")
        ne = [r.take("<Q") for _ in range(n_dims)]
        ttype = r.take("<I")
        offset = r.take("<Q")
        infos.append((name, ne, ttype, offset))
    align = int(meta.get("general.alignment", 32))
    data_start = (r.pos + align - 1) // align * align
    tensors, types = {}, {}
    for name, ne, ttype, offset in infos:
        types[name] = ttype
        n = int(np.prod(ne)) if ne else 1
        start = data_start + offset
        if ttype == GGML_F32:
            a = np.frombuffer(buf, dtype="<f4", count=n, offset=start)
        elif ttype == GGML_F16:
            a = np.frombuffer(buf, dtype="<f2", count=n, offset=start)
        elif ttype == GGML_Q8_0:
            if n % Q8_0_BLOCK:
                raise ValueError("%s: Q8_0 size %d not a multiple of 32" % (name, n))
            blk = np.dtype([("d", "<f2"), ("q", "i1", (Q8_0_BLOCK,))])
            b = np.frombuffer(buf, dtype=blk, count=n // Q8_0_BLOCK, offset=start)
            a = (b["d"].astype(np.float64)[:, None] * b["q"].astype(np.float64))
        elif ttype == GGML_MXFP4:
            if n % 32:
                raise ValueError("%s: MXFP4 size %d not a multiple of 32" % (name, n))
            blk = np.dtype([("e", "u1"), ("q", "u1", (16,))])
            b = np.frombuffer(buf, dtype=blk, count=n // 32, offset=start)
            codes = np.concatenate([b["q"] & 15, b["q"] >> 4], axis=1)
            a = E2M1[codes] * np.ldexp(1.0, b["e"].astype(np.int64) - 127)[:, None]
        else:
            raise ValueError("%s: tensor type %d not supported" % (name, ttype))
        tensors[name] = a.astype(np.float64).reshape(list(reversed(ne)))
    return meta, tensors, types


# --------------------------------------------------------------------------
# Model: hyper-parameters + weights in one plain structure

class Model:
    arch = "llama"      # "llama" (RoPE on consecutive pairs), "qwen2", "qwen3" or "phi3" (NeoX)
    dim = hidden = n_layers = n_heads = n_kv_heads = vocab = ctx = 0
    local_plain_rope = False  # olmo2 (OLMo 3) only: local layers rotate without YaRN
    head_dim = rope_dim = 0
    eps = 1e-5
    rope_base = 10000.0
    rope_freqs = None   # Llama 3.1's per-pair RoPE factors (rope_freqs.weight), or None
    rope_scale = 1.0    # linear RoPE scaling (rope.scaling.type linear): every angle divided
    yarn_rope = None    # llama / qwen2 YaRN: (factor, original context, beta_fast, beta_slow)
    # OLMo 3 (olmo2 with attention.sliding_window): per layer, whether it is local (the query at p
    # sees keys k with p - window < k <= p), turned by plain RoPE at base_local, no scaling
    window, local, base_local = 0, (), 10000.0
    rope_mag = 1.0      # phi3 LongRoPE: rope.scaling.attn_factor, the magnitude of the rotated q and k
    # granite's multipliers: embeddings, each branch's output, q.k (None: 1/sqrt(head_dim)), logits divided
    embed_mult, residual_mult, attn_scale, logit_div = 1.0, 1.0, None, 1.0
    bos, eos = 1, 2
    # weights: tok_emb [vocab, dim], out_norm [dim], out [vocab, dim],
    # layers: list of dicts with attn_norm, wq, wk, wv, wo, (bq, bk, bv),
    #         ffn_norm, w1, w2, w3 (matrices as [out, in]); phi3 layers have
    #         wqkv (rows Q, K, V) instead of wq, wk, wv and w13 (rows: gate,
    #         then up) instead of w1, w3 -- used fused, outputs split after
    tok_emb = out_norm = out = None
    out_type = GGML_F32
    layers = ()  # each layer's "types": {weight: GGML type} (absent = F32)
    act_q8 = False  # emulate kvlm's rounding of activations for Q8_0 weights


def load_phi3_layer(m, t, types, p):
    """phi3: fused attn_qkv [q_dim + 2 kv_dim, dim] and ffn_up [2 hidden, dim]
    (gate rows first, as Hugging Face's gate_up_proj.chunk(2)); no biases."""
    q_dim, kv_dim = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    wqkv, w13 = t[p + "attn_qkv.weight"], t[p + "ffn_up.weight"]
    if wqkv.shape != (q_dim + 2 * kv_dim, m.dim):
        raise ValueError("%sattn_qkv.weight: shape %s" % (p, wqkv.shape))
    if w13.shape != (2 * m.hidden, m.dim):
        raise ValueError("%sffn_up.weight: shape %s" % (p, w13.shape))
    L = {"attn_norm": t[p + "attn_norm.weight"], "wqkv": wqkv,
         "wo": t[p + "attn_output.weight"], "ffn_norm": t[p + "ffn_norm.weight"],
         "w13": w13, "w2": t[p + "ffn_down.weight"], "bq": None}
    L["types"] = {k: types[p + n] for k, n in (
        ("wqkv", "attn_qkv.weight"), ("wo", "attn_output.weight"),
        ("w13", "ffn_up.weight"), ("w2", "ffn_down.weight"))}
    return L


def load_deepseek2(m, meta, t, types):
    """deepseek2 (DeepSeek-V2/V3): multi-head latent attention and a
    mixture of experts. Kept as the file has it: the reference decompresses
    keys and values per head (no absorption), so it checks kvlm's absorbed
    latent path. Expert tensors [n_expert, rows, n_in]."""
    a = "deepseek2"
    m.yarn = None
    stype, factor = meta.get(a + ".rope.scaling.type", "none"), float(meta.get(a + ".rope.scaling.factor", 1.0))
    if stype == "yarn" and factor != 1.0:
        m.yarn = (factor, int(meta[a + ".rope.scaling.original_context_length"]),
                  float(meta.get(a + ".rope.scaling.yarn_log_multiplier", 0.0)),
                  float(meta.get(a + ".rope.scaling.yarn_beta_fast", 32.0)),
                  float(meta.get(a + ".rope.scaling.yarn_beta_slow", 1.0)))
    elif stype != "none" and factor != 1.0:
        raise ValueError("deepseek2 with RoPE scaling %r not supported" % stype)
    m.q_lora = int(meta.get(a + ".attention.q_lora_rank", 0))
    m.kv_lora = int(meta[a + ".attention.kv_lora_rank"])
    m.v_dim = int(meta.get(a + ".attention.value_length", m.head_dim - m.rope_dim))
    m.n_expert = int(meta.get(a + ".expert_count", 0))
    m.n_used = int(meta.get(a + ".expert_used_count", 0))
    m.n_dense = int(meta.get(a + ".leading_dense_block_count", m.n_layers)) if m.n_expert else m.n_layers
    m.w_scale = float(meta.get(a + ".expert_weights_scale", 1.0))
    m.w_norm = bool(meta.get(a + ".expert_weights_norm", False))
    m.gating = int(meta.get(a + ".expert_gating_func", 1))
    for i in range(m.n_layers):
        p = "blk.%d." % i
        L = {"bq": None, "types": {}}
        for key, name in (("attn_norm", "attn_norm.weight"), ("wq", "attn_q.weight"),
                          ("wq_a", "attn_q_a.weight"), ("q_a_norm", "attn_q_a_norm.weight"),
                          ("wq_b", "attn_q_b.weight"), ("wkv_a", "attn_kv_a_mqa.weight"),
                          ("kv_a_norm", "attn_kv_a_norm.weight"), ("wkv_b", "attn_kv_b.weight"),
                          ("wo", "attn_output.weight"), ("ffn_norm", "ffn_norm.weight"),
                          ("w1", "ffn_gate.weight"), ("w2", "ffn_down.weight"), ("w3", "ffn_up.weight"),
                          ("router", "ffn_gate_inp.weight"), ("probs_b", "exp_probs_b.bias"),
                          ("g_exps", "ffn_gate_exps.weight"), ("u_exps", "ffn_up_exps.weight"),
                          ("d_exps", "ffn_down_exps.weight"), ("g_sh", "ffn_gate_shexp.weight"),
                          ("u_sh", "ffn_up_shexp.weight"), ("d_sh", "ffn_down_shexp.weight")):
            if p + name in t:
                L[key] = t[p + name]
                L["types"][key] = types[p + name]
        m.layers.append(L)


def rope_yarn(x, positions, rope_dim, base, yarn):
    """YaRN on consecutive pairs (2i, 2i+1), written from the YaRN paper's
    definition as llama.cpp applies it (ext_factor 1): per pair, the angle
    pos * base^(-2i/d) extrapolated where its wavelength is short against the
    original context (pair index below the beta_fast bound), interpolated
    (angle / factor) above the beta_slow bound, a linear ramp between. The
    rotation's magnitude stays 1 for deepseek2 (its attention factor cancels
    YaRN's 1 + 0.1 ln factor); the attention scale carries mscale^2."""
    factor, orig, _, beta_fast, beta_slow = yarn
    half = rope_dim // 2
    i = np.arange(half)
    extrap = positions[:, None] * base ** (-2.0 * i / rope_dim)
    def corr(n_rot):  # the pair index whose wavelength makes n_rot turns over the original context
        return rope_dim * np.log(orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))
    lo, hi = max(0.0, np.floor(corr(beta_fast))), min(rope_dim - 1.0, np.ceil(corr(beta_slow)))
    mix = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
    theta = extrap / factor * (1 - mix) + extrap * mix
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x = x.copy()
    a, b = x[..., 0:rope_dim:2].copy(), x[..., 1:rope_dim:2].copy()
    x[..., 0:rope_dim:2] = a * cos - b * sin
    x[..., 1:rope_dim:2] = a * sin + b * cos
    return x


def forward_deepseek2(m, ids):
    """Naive MLA: per head, k = [W_UK c ; k_pe], v = W_UV c, full softmax
    attention with scale 1/sqrt(key_length); then the dense or MoE FFN."""
    T, H = len(ids), m.n_heads
    nope, rd, R, V = m.head_dim - m.rope_dim, m.rope_dim, m.kv_lora, m.v_dim
    pos = np.arange(T, dtype=np.float64)
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    x = m.tok_emb[np.asarray(ids)]
    if m.yarn:
        rot = lambda v: rope_yarn(v, pos, rd, m.rope_base, m.yarn)
        mscale = 1.0 + m.yarn[2] * np.log(m.yarn[0])
    else:
        rot = lambda v: rope(v, pos, rd, m.rope_base, False)
        mscale = 1.0
    for li, L in enumerate(m.layers):
        ty = L["types"]
        h = rmsnorm(x, L["attn_norm"], m.eps)
        if "wq_a" in L:
            qa = rmsnorm(matmul(m, h, L["wq_a"], ty.get("wq_a")), L["q_a_norm"], m.eps)
            q = matmul(m, qa, L["wq_b"], ty.get("wq_b"))
        else:
            q = matmul(m, h, L["wq"], ty.get("wq"))
        q = q.reshape(T, H, m.head_dim)
        kva = matmul(m, h, L["wkv_a"], ty.get("wkv_a"))
        c = rmsnorm(kva[:, :R], L["kv_a_norm"], m.eps)
        k_pe = rot(kva[:, None, R:])[:, 0, :]
        q_pe = rot(q[:, :, nope:])
        kv = (c @ L["wkv_b"].T).reshape(T, H, nope + V)  # decompressed: per head nope keys, then values
        att = np.empty((T, H, V))
        for hh in range(H):
            k = np.concatenate([kv[:, hh, :nope], k_pe], axis=1)
            qh = np.concatenate([q[:, hh, :nope], q_pe[:, hh, :]], axis=1)
            s = qh @ k.T * (mscale * mscale / np.sqrt(m.head_dim)) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh, :] = s @ kv[:, hh, nope:]
        x = x + matmul(m, att.reshape(T, H * V), L["wo"], ty.get("wo"))
        h = rmsnorm(x, L["ffn_norm"], m.eps)
        if li < m.n_dense:
            g = silu(matmul(m, h, L["w1"], ty.get("w1"))) * matmul(m, h, L["w3"], ty.get("w3"))
            x = x + matmul(m, g, L["w2"], ty.get("w2"))
            continue
        x = x + moe_ffn(m, L, h)
    return matmul(m, rmsnorm(x, m.out_norm, m.eps), m.out, m.out_type)


def moe_ffn(m, L, h):
    """A mixture of experts over the normed rows h: the router's softmax (or
    sigmoid) over every expert, the top m.n_used by probability (plus a
    selection bias, V3), their weights renormalised (m.w_norm) and scaled,
    each chosen expert's SwiGLU FFN; then the shared experts, if any."""
    ty = L["types"]
    logits = matmul(m, h, L["router"], ty.get("router"))
    if "router_b" in L:  # gpt-oss: softmax over the top k of the biased logits = these probabilities renormalised
        logits = logits + L["router_b"]
    if m.gating == 2:
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    sel = probs + (L["probs_b"] if "probs_b" in L else 0.0)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-sel[t], kind="stable")[:m.n_used]
        w = probs[t, top]
        if m.w_norm:
            w = w / w.sum()
        w = w * m.w_scale
        for e, we in zip(top, w):
            ht = h[t:t + 1]
            if "router_b" in L:  # gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) and the experts' biases
                gt = matmul(m, ht, L["g_exps"][e], ty.get("g_exps")) + L["g_exps_b"][e]
                ut = matmul(m, ht, L["u_exps"][e], ty.get("u_exps")) + L["u_exps_b"][e]
                gt, ut = np.minimum(gt, 7.0), np.clip(ut, -7.0, 7.0)
                g = gt / (1.0 + np.exp(-1.702 * gt)) * (ut + 1.0)
                out[t] += we * (matmul(m, g, L["d_exps"][e], ty.get("d_exps"))[0] + L["d_exps_b"][e])
                continue
            g = silu(matmul(m, ht, L["g_exps"][e], ty.get("g_exps"))) * matmul(m, ht, L["u_exps"][e], ty.get("u_exps"))
            out[t] += we * matmul(m, g, L["d_exps"][e], ty.get("d_exps"))[0]
    if "g_sh" in L:
        g = silu(matmul(m, h, L["g_sh"], ty.get("g_sh"))) * matmul(m, h, L["u_sh"], ty.get("u_sh"))
        sh = matmul(m, g, L["d_sh"], ty.get("d_sh"))
        if "sh_gate" in L:  # qwen2moe: sigmoid(h . w) per token
            sh = sh / (1.0 + np.exp(-(h @ np.asarray(L["sh_gate"], dtype=np.float64))))[:, None]
        out += sh
    return out


def load_gguf(path):
    meta, t, types = read_gguf(path)
    m = Model()
    m.arch = meta.get("general.architecture", "llama")
    if m.arch not in ("llama", "smollm3", "granite", "granitemoe", "olmo2", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3",
                      "deepseek2", "gpt-oss", "bert", "nomic-bert"):
        raise ValueError("architecture %r not supported" % m.arch)
    a = m.arch
    m.dim = int(meta[a + ".embedding_length"])
    m.n_layers = int(meta[a + ".block_count"])
    m.hidden = int(meta[a + ".feed_forward_length"])
    m.n_heads = int(meta[a + ".attention.head_count"])
    m.n_kv_heads = int(meta.get(a + ".attention.head_count_kv", m.n_heads))
    m.eps = float(meta.get(a + ".attention.layer_norm_rms_epsilon", 1e-5))
    m.rope_base = float(meta.get(a + ".rope.freq_base", 10000.0))
    m.head_dim = int(meta.get(a + ".attention.key_length", m.dim // m.n_heads))
    m.rope_dim = int(meta.get(a + ".rope.dimension_count", m.head_dim))
    m.ctx = int(meta.get(a + ".context_length", 2048))
    m.pooling = int(meta[a + ".pooling_type"]) if a + ".pooling_type" in meta else None
    if a in ("bert", "nomic-bert"):
        load_bert(m, meta, t)
        return m, (WordPiece(meta) if meta.get("tokenizer.ggml.model") == "bert" else None)
    if a in ("granite", "granitemoe"):  # llama.cpp's key names; 0 or absent: none
        m.embed_mult = float(meta.get(a + ".embedding_scale", 0.0)) or 1.0
        m.residual_mult = float(meta.get(a + ".residual_scale", 0.0)) or 1.0
        m.logit_div = float(meta.get(a + ".logit_scale", 0.0)) or 1.0
        m.attn_scale = float(meta.get(a + ".attention.scale", 0.0)) or None
    m.tok_emb = t["token_embd.weight"]
    m.vocab = m.tok_emb.shape[0]
    m.out_norm = t["output_norm.weight"]
    out_name = "output.weight" if "output.weight" in t else "token_embd.weight"
    m.out, m.out_type = t[out_name], types[out_name]  # absent: tied embeddings
    m.rope_freqs = t.get("rope_freqs.weight")  # Llama 3.1's RoPE factors, or None
    if "rope_factors_long.weight" in t:  # phi3 LongRoPE: which set serves is the caller's (use_longrope)
        m.longrope = (t["rope_factors_long.weight"], t["rope_factors_short.weight"],
                      int(meta.get(a + ".rope.scaling.original_context_length", m.ctx)),
                      float(meta.get(a + ".rope.scaling.attn_factor", 1.0)))
    if a != "deepseek2":  # linear scaling divides every angle; other types are refused
        stype = meta.get(a + ".rope.scaling.type", b"none")
        stype = stype.decode() if isinstance(stype, bytes) else stype
        if stype not in ("none", "linear", "yarn") or (stype == "yarn" and a not in ("llama", "smollm3", "qwen2", "qwen3", "qwen3moe", "olmo2", "gpt-oss")):
            raise ValueError("RoPE scaling %r not supported" % stype)
        m.rope_scale = float(meta.get(a + ".rope.scaling.factor", 1.0)) if stype == "linear" else 1.0
        if stype == "yarn" and float(meta.get(a + ".rope.scaling.factor", 1.0)) != 1.0:
            m.yarn_rope = (float(meta[a + ".rope.scaling.factor"]), int(meta[a + ".rope.scaling.original_context_length"]),
                           float(meta.get(a + ".rope.scaling.yarn_beta_fast", 32.0)),
                           float(meta.get(a + ".rope.scaling.yarn_beta_slow", 1.0)))
    m.window = int(meta.get(a + ".attention.sliding_window", 0)) if a in ("olmo2", "gpt-oss") else 0
    m.local_plain_rope = a == "olmo2"  # OLMo 3's local layers rotate without YaRN; gpt-oss's as the global ones
    if m.window and a == "gpt-oss":  # even layers local (llama.cpp's swa pattern 2, Hugging Face's layer_types)
        m.local = [i % 2 == 0 for i in range(m.n_layers)]
        m.base_local = m.rope_base
    elif m.window:  # OLMo 3: three local layers to one global, or llama.cpp's converter's bool per layer
        pat = meta.get(a + ".attention.sliding_window_pattern", 4)
        m.local = [bool(v) for v in pat] if isinstance(pat, list) else [(i + 1) % int(pat) != 0 for i in range(m.n_layers)]
        m.base_local = float(meta.get(a + ".rope.freq_base_swa", m.rope_base))
    else:
        m.local = [False] * m.n_layers
    m.layers = []
    if m.arch == "deepseek2":
        load_deepseek2(m, meta, t, types)
    for i in range(m.n_layers):
        p = "blk.%d." % i
        if m.arch == "deepseek2":
            break
        if m.arch == "phi3":
            m.layers.append(load_phi3_layer(m, t, types, p))
            continue
        L = {"attn_norm": t.get(p + "attn_norm.weight"),  # OLMo 2: none, norms after instead
             "wq": t[p + "attn_q.weight"], "wk": t[p + "attn_k.weight"],
             "wv": t[p + "attn_v.weight"], "wo": t[p + "attn_output.weight"],
             "ffn_norm": t.get(p + "ffn_norm.weight"),
             "post_attn": t.get(p + "post_attention_norm.weight"), "post_ffn": t.get(p + "post_ffw_norm.weight")}
        if a == "gpt-oss":  # its FFN's norm under that name; the output's bias; a sink logit per head
            L["ffn_norm"], L["post_attn"] = L["post_attn"], None
            L["bo"], L["sinks"] = t[p + "attn_output.bias"], t[p + "attn_sinks.weight"]
        ffn = (("w1", "ffn_gate.weight"), ("w2", "ffn_down.weight"), ("w3", "ffn_up.weight"))
        if p + "ffn_gate_inp.weight" in t:  # experts (Mixtral, qwen3moe): softmax top-k, renormalised
            ffn = (("router", "ffn_gate_inp.weight"), ("g_exps", "ffn_gate_exps.weight"),
                   ("u_exps", "ffn_up_exps.weight"), ("d_exps", "ffn_down_exps.weight"))
            m.gating, m.n_used, m.w_norm, m.w_scale = 1, int(meta[a + ".expert_used_count"]), True, 1.0
            if a == "gpt-oss":  # biases on the router and on each expert's three products
                for k, n in (("router_b", "ffn_gate_inp.bias"), ("g_exps_b", "ffn_gate_exps.bias"),
                             ("u_exps_b", "ffn_up_exps.bias"), ("d_exps_b", "ffn_down_exps.bias")):
                    L[k] = t[p + n]
            if a == "qwen2moe":  # the top probabilities as they are, and a shared expert behind a sigmoid gate
                m.w_norm = False
                ffn += (("g_sh", "ffn_gate_shexp.weight"), ("u_sh", "ffn_up_shexp.weight"),
                        ("d_sh", "ffn_down_shexp.weight"), ("sh_gate", "ffn_gate_inp_shexp.weight"))
            elif a == "granitemoe" and p + "ffn_gate_shexp.weight" in t:  # Granite MoE Shared: added ungated
                ffn += (("g_sh", "ffn_gate_shexp.weight"), ("u_sh", "ffn_up_shexp.weight"),
                        ("d_sh", "ffn_down_shexp.weight"))
        for k, n in ffn:
            L[k] = t[p + n]
        for b in ("q", "k", "v"):
            L["b" + b] = t.get(p + "attn_%s.bias" % b)
        if m.arch in ("qwen3", "qwen3moe"):  # an RMSNorm over each head of q and of k, before RoPE
            L["q_norm"], L["k_norm"] = t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"]
        if m.arch == "olmo2":  # an RMSNorm over all of q, and over all of k, before RoPE
            L["q_norm_all"], L["k_norm_all"] = t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"]
        L["types"] = {k: types[p + n] for k, n in (
            ("wq", "attn_q.weight"), ("wk", "attn_k.weight"), ("wv", "attn_v.weight"),
            ("wo", "attn_output.weight")) + ffn}
        m.layers.append(L)
    m.bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    m.eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    tok = None
    if "tokenizer.ggml.tokens" in meta:
        tok = Tokenizer([s.encode("utf-8", errors="surrogateescape")
                         for s in meta["tokenizer.ggml.tokens"]],
                        meta.get("tokenizer.ggml.scores"),
                        space="\u2581".encode("utf-8"), bos=m.bos, eos=m.eos)
    return m, tok


def load_llama2c(path):
    with open(path, "rb") as f:
        buf = f.read()
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = \
        struct.unpack_from("<7i", buf, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    m = Model()
    m.dim, m.hidden, m.n_layers = dim, hidden, n_layers
    m.n_heads, m.n_kv_heads, m.vocab, m.ctx = n_heads, n_kv_heads, vocab, seq_len
    m.head_dim = m.rope_dim = dim // n_heads
    kv_dim = n_kv_heads * m.head_dim
    w = np.frombuffer(buf, dtype="<f4", offset=7 * 4).astype(np.float64)
    pos = [0]

    def take(*shape):
        n = int(np.prod(shape))
        a = w[pos[0]:pos[0] + n]
        if a.size != n:
            raise ValueError("%s: truncated checkpoint" % path)
        pos[0] += n
        return a.reshape(shape)

    m.tok_emb = take(vocab, dim)
    rms_att = take(n_layers, dim)
    wq = take(n_layers, dim, dim)
    wk = take(n_layers, kv_dim, dim)
    wv = take(n_layers, kv_dim, dim)
    wo = take(n_layers, dim, dim)
    rms_ffn = take(n_layers, dim)
    w1 = take(n_layers, hidden, dim)
    w2 = take(n_layers, dim, hidden)
    w3 = take(n_layers, hidden, dim)
    m.out_norm = take(dim)
    take(seq_len * m.head_dim // 2)  # freq_cis_real (unused)
    take(seq_len * m.head_dim // 2)  # freq_cis_imag (unused)
    m.out = m.tok_emb if shared else take(vocab, dim)
    m.layers = [{"attn_norm": rms_att[i], "wq": wq[i], "wk": wk[i], "wv": wv[i],
                 "wo": wo[i], "ffn_norm": rms_ffn[i], "w1": w1[i], "w2": w2[i],
                 "w3": w3[i], "bq": None, "bk": None, "bv": None, "types": {}}
                for i in range(n_layers)]
    return m


def load_llama2c_tokenizer(path, vocab):
    with open(path, "rb") as f:
        r = Reader(f.read())
    r.take("<i")  # max token length
    pieces, scores = [], []
    for _ in range(vocab):
        scores.append(r.take("<f"))
        pieces.append(r.bytes(r.take("<i")))
    return Tokenizer(pieces, scores, space=b" ", bos=1, eos=2)


# --------------------------------------------------------------------------
# Forward pass (float64, full recompute)

def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, rope_dim, base, neox, freqs=None, scale=1.0, yarn=None, mag=1.0):
    """x: [T, n_heads, head_dim]; rotates the first rope_dim dims of each head.
    freqs: rope_freqs.weight (Llama 3.1's scaling), each pair's angle divided
    by its factor, as llama.cpp's rope takes them (freq_factors); scale: a
    linear rope.scaling.factor, every angle divided by it. yarn: (factor,
    original context, beta_fast, beta_slow): the YaRN paper's angles (pair i
    extrapolated below the beta_fast bound, interpolated / factor above the
    beta_slow one, a linear ramp between) and its magnitude 1 + 0.1 ln factor
    on the rotated values, as Hugging Face's Qwen2 applies them to cos and sin.
    mag: a magnitude on cos and sin (LongRoPE's attention factor)."""
    half = rope_dim // 2
    i = np.arange(half)
    theta = positions[:, None] * base ** (-2.0 * i / rope_dim) / scale
    if yarn is not None:
        factor, orig, beta_fast, beta_slow = yarn
        def corr(n_rot):
            return rope_dim * np.log(orig / (n_rot * 2 * np.pi)) / (2 * np.log(base))
        lo, hi = max(0.0, np.floor(corr(beta_fast))), min(rope_dim - 1.0, np.ceil(corr(beta_slow)))
        mix = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
        theta = theta / factor * (1 - mix) + theta * mix
        mag = mag * (1.0 + 0.1 * np.log(factor))
    if freqs is not None:
        theta = theta / np.asarray(freqs, dtype=np.float64)[None, :half]
    cos, sin = mag * np.cos(theta)[:, None, :], mag * np.sin(theta)[:, None, :]
    x = x.copy()
    if neox:  # pairs (i, i + rope_dim/2)
        a, b = x[..., :half].copy(), x[..., half:rope_dim].copy()
        x[..., :half] = a * cos - b * sin
        x[..., half:rope_dim] = a * sin + b * cos
    else:     # pairs (2i, 2i+1)
        a, b = x[..., 0:rope_dim:2].copy(), x[..., 1:rope_dim:2].copy()
        x[..., 0:rope_dim:2] = a * cos - b * sin
        x[..., 1:rope_dim:2] = a * sin + b * cos
    return x


def silu(x):
    return x / (1.0 + np.exp(-x))


def quantize_act_q8(x):
    """kvlm multiplies Q8_0 weights by activations rounded to blocks of 32
    int8 with a float scale d = amax/127, q = round-half-even(x * 127/amax).
    This is that rounding, for the optional emulation (--act-q8)."""
    b = x.reshape(-1, Q8_0_BLOCK).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
    q = np.round(b * inv.astype(np.float32))  # numpy rounds half to even
    return ((amax / np.float32(127)).astype(np.float64) * q).reshape(x.shape)


def matmul(m, x, w, wtype):
    """x @ w^T, w stored [out, in]."""
    if m.act_q8 and wtype in (GGML_Q8_0, GGML_MXFP4):
        x = quantize_act_q8(x)
    return x @ w.T


def forward(m, ids, hidden=False):
    """Returns logits [T, vocab] for the token sequence ids (positions 0..T-1);
    hidden: the final norm's output [T, dim] instead (what embeddings pool)."""
    if m.arch in ("bert", "nomic-bert"):
        return forward_bert(m, ids)
    if m.arch == "deepseek2":
        if hidden:
            raise ValueError("deepseek2: no hidden states here")
        return forward_deepseek2(m, ids)
    T = len(ids)
    hd = m.head_dim
    group = m.n_heads // m.n_kv_heads
    pos = np.arange(T, dtype=np.float64)
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    x = m.tok_emb[np.asarray(ids)] * m.embed_mult
    for li, L in enumerate(m.layers):
        h = rmsnorm(x, L["attn_norm"], m.eps) if L.get("attn_norm") is not None else x
        ty = L["types"]
        if "wqkv" in L:  # phi3: one product, its output columns split
            qkv = matmul(m, h, L["wqkv"], ty.get("wqkv"))
            nq, nkv = m.n_heads * hd, m.n_kv_heads * hd
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        else:
            q = matmul(m, h, L["wq"], ty.get("wq"))
            k = matmul(m, h, L["wk"], ty.get("wk"))
            v = matmul(m, h, L["wv"], ty.get("wv"))
        if L["bq"] is not None:
            q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
        if "q_norm_all" in L:
            q, k = rmsnorm(q, L["q_norm_all"], m.eps), rmsnorm(k, L["k_norm_all"], m.eps)
        q = q.reshape(T, m.n_heads, hd)
        k = k.reshape(T, m.n_kv_heads, hd)
        v = v.reshape(T, m.n_kv_heads, hd)
        if "q_norm" in L:
            q, k = rmsnorm(q, L["q_norm"], m.eps), rmsnorm(k, L["k_norm"], m.eps)
        neox = m.arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "phi3", "olmo2", "gpt-oss")
        local = li < len(m.local) and m.local[li]
        if local and m.local_plain_rope:  # OLMo 3's local layers: plain RoPE (no YaRN), their own base, a window
            q = rope(q, pos, m.rope_dim, m.base_local, neox)
            k = rope(k, pos, m.rope_dim, m.base_local, neox)
        elif not (m.arch == "smollm3" and (li + 1) % 4 == 0):  # SmolLM3: every fourth layer has no RoPE
            q = rope(q, pos, m.rope_dim, m.rope_base, neox, m.rope_freqs, m.rope_scale, m.yarn_rope, m.rope_mag)
            k = rope(k, pos, m.rope_dim, m.rope_base, neox, m.rope_freqs, m.rope_scale, m.yarn_rope, m.rope_mag)
        lmask = mask
        if local:
            lmask = mask + np.where(pos[:, None] - pos[None, :] >= m.window, -np.inf, 0.0)
        att = np.empty((T, m.n_heads, hd))
        for hh in range(m.n_heads):
            kh = hh // group
            s = q[:, hh, :] @ k[:, kh, :].T * (m.attn_scale or 1 / np.sqrt(hd)) + lmask
            mx = s.max(axis=1, keepdims=True)
            sink = float(L["sinks"][hh]) if L.get("sinks") is not None else None
            if sink is not None:  # gpt-oss: a logit in the softmax with no value (raw, not scaled)
                mx = np.maximum(mx, sink)
            s = np.exp(s - mx)
            den = s.sum(axis=1, keepdims=True) + (np.exp(sink - mx) if sink is not None else 0.0)
            att[:, hh, :] = (s / den) @ v[:, kh, :]
        o = m.residual_mult * matmul(m, att.reshape(T, m.n_heads * hd), L["wo"], ty.get("wo"))
        if L.get("bo") is not None:
            o = o + L["bo"]
        x = x + (rmsnorm(o, L["post_attn"], m.eps) if L.get("post_attn") is not None else o)
        h = rmsnorm(x, L["ffn_norm"], m.eps) if L.get("ffn_norm") is not None else x
        if "router" in L:
            x = x + m.residual_mult * moe_ffn(m, L, h)
            continue
        if "w13" in L:  # phi3: gate = first half of the fused output, up = second
            gu = matmul(m, h, L["w13"], ty.get("w13"))
            g = silu(gu[:, :m.hidden]) * gu[:, m.hidden:]
        else:
            g = silu(matmul(m, h, L["w1"], ty.get("w1"))) * matmul(m, h, L["w3"], ty.get("w3"))
        o = m.residual_mult * matmul(m, g, L["w2"], ty.get("w2"))
        x = x + (rmsnorm(o, L["post_ffn"], m.eps) if L.get("post_ffn") is not None else o)
    if hidden:
        return rmsnorm(x, m.out_norm, m.eps)
    return matmul(m, rmsnorm(x, m.out_norm, m.eps), m.out, m.out_type) / m.logit_div


# --------------------------------------------------------------------------
# Encoders (bert, nomic-bert) and embeddings

def load_bert(m, meta, t):
    """bert / nomic-bert as llama.cpp's converter writes them (no KV cache,
    attention in both directions, LayerNorms after attention and FFN)."""
    a = m.arch
    m.eps = float(meta.get(a + ".attention.layer_norm_epsilon", 1e-12))
    m.rope_base = float(meta.get(a + ".rope.freq_base", 10000.0))
    m.head_dim = m.dim // m.n_heads
    m.tok_emb = t["token_embd.weight"]
    m.vocab = m.tok_emb.shape[0]
    m.type_emb = t["token_types.weight"]
    m.pos_emb = t.get("position_embd.weight")  # bert; nomic-bert turns q and k instead
    m.emb_norm = (t["token_embd_norm.weight"], t["token_embd_norm.bias"])
    m.layers = []
    for i in range(m.n_layers):
        p = "blk.%d." % i
        L = {"wo": t[p + "attn_output.weight"], "bo": t.get(p + "attn_output.bias"),
             "ln1": (t[p + "attn_output_norm.weight"], t[p + "attn_output_norm.bias"]),
             "ln2": (t[p + "layer_output_norm.weight"], t[p + "layer_output_norm.bias"]),
             "up": t[p + "ffn_up.weight"], "b_up": t.get(p + "ffn_up.bias"),
             "gate": t.get(p + "ffn_gate.weight"),
             "down": t[p + "ffn_down.weight"], "b_down": t.get(p + "ffn_down.bias")}
        if p + "attn_qkv.weight" in t:  # rows: Q, then K, then V
            L["wq"], L["wk"], L["wv"] = np.split(t[p + "attn_qkv.weight"], 3, axis=0)
            L["bq"] = L["bk"] = L["bv"] = None
        else:
            for k in "qkv":
                L["w" + k], L["b" + k] = t[p + "attn_%s.weight" % k], t[p + "attn_%s.bias" % k]
        m.layers.append(L)


def layernorm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


_erf = np.frompyfunc(__import__("math").erf, 1, 1)


def gelu_erf(x):
    """Hugging Face's "gelu": x * Phi(x), with the exact erf."""
    return 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)).astype(np.float64))


def forward_bert(m, ids):
    """The last layer's output [T, dim] for one whole input."""
    T, hd, H = len(ids), m.head_dim, m.n_heads
    pos = np.arange(T, dtype=np.float64)
    x = m.tok_emb[np.asarray(ids)] + m.type_emb[0]
    if m.pos_emb is not None:
        x = x + m.pos_emb[:T]
    x = layernorm(x, *m.emb_norm, m.eps)
    for L in m.layers:
        q, k, v = x @ L["wq"].T, x @ L["wk"].T, x @ L["wv"].T
        if L["bq"] is not None:
            q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
        q, k, v = q.reshape(T, H, hd), k.reshape(T, H, hd), v.reshape(T, H, hd)
        if m.pos_emb is None:
            q, k = rope(q, pos, hd, m.rope_base, True), rope(k, pos, hd, m.rope_base, True)
        att = np.empty((T, H, hd))
        for h in range(H):
            sc = q[:, h, :] @ k[:, h, :].T / np.sqrt(hd)
            sc = np.exp(sc - sc.max(axis=1, keepdims=True))
            att[:, h, :] = (sc / sc.sum(axis=1, keepdims=True)) @ v[:, h, :]
        o = att.reshape(T, H * hd) @ L["wo"].T
        if L["bo"] is not None:
            o = o + L["bo"]
        x = layernorm(x + o, *L["ln1"], m.eps)
        if L["gate"] is not None:  # nomic-bert: SwiGLU
            f = (silu(x @ L["gate"].T) * (x @ L["up"].T)) @ L["down"].T
        else:
            f = gelu_erf(x @ L["up"].T + L["b_up"]) @ L["down"].T + L["b_down"]
        x = layernorm(x + f, *L["ln2"], m.eps)
    return x


POOLINGS = {"none": 0, "mean": 1, "cls": 2, "last": 3}


def embed(m, ids, pooling=None, normalize=True, dims=0):
    """The input's embedding rows: one (or T for pooling none) vector(s)."""
    h = forward(m, ids, hidden=True)
    if pooling is None:
        pooling = m.pooling if m.pooling is not None else (2 if m.arch in ("bert", "nomic-bert") else 3)
    rows = {0: h, 1: h.mean(axis=0, keepdims=True), 2: h[:1], 3: h[-1:]}[pooling]
    if dims:
        rows = rows[:, :dims]
    if normalize:
        n = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
        rows = rows / np.where(n > 0, n, 1.0)
    return rows


def compare_embed(ref, path, tol):
    """One line "PATH: ok: ..." or "PATH: FAIL: ..."; 0 if ok. Error of a
    vector: max |got - ref| over its largest |ref|."""
    print("%s: " % path, end="")
    try:
        with open(path) as f:
            rows = [np.array([float(v) for v in line.split()]) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        print("FAIL: cannot read vectors from %s: %s" % (path, e))
        return 1
    if len(rows) != ref.shape[0] or any(r.shape != (ref.shape[1],) for r in rows):
        print("FAIL: shape %d x %s, expected %d x %d" % (len(rows), sorted({r.size for r in rows}), *ref.shape))
        return 1
    got = np.stack(rows)
    err = np.abs(got - ref).max(axis=1) / np.maximum(np.abs(ref).max(axis=1), 1e-30)
    worst = int(np.argmax(err))
    ok = bool(np.all(np.isfinite(got))) and err[worst] <= tol
    print("%s: max relative error %.3g (vector %d of %d, bound %.3g)" % (
        "ok" if ok else "FAIL", err[worst], worst, len(rows), tol))
    return 0 if ok else 1


class WordPiece:
    """BERT's tokenizer (Hugging Face's fast BertNormalizer, BertPreTokenizer,
    WordPiece) over a GGUF vocabulary in llama.cpp's form: a word's first
    piece is stored with U+2581 before it, a continuation ("##x") bare."""

    WHITE_SPACE = set(chr(c) for c in list(range(9, 14)) + [0x20, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B)) +
                      [0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

    def __init__(self, meta):
        import unicodedata
        self.ud = unicodedata
        toks = meta["tokenizer.ggml.tokens"]
        self.ids = {}
        for i, tk in enumerate(toks):
            self.ids[tk] = i  # a duplicate maps to its last id
        self.unk = int(meta.get("tokenizer.ggml.unknown_token_id", 100))
        self.cls = int(meta.get("tokenizer.ggml.bos_token_id", meta.get("tokenizer.ggml.cls_token_id", 101)))
        self.sep = int(meta.get("tokenizer.ggml.seperator_token_id", 102))
        self.lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
        self.strip = bool(meta.get("tokenizer.ggml.normalizer.strip_accents", self.lower))

    def is_punct(self, c):
        o = ord(c)
        return 33 <= o <= 47 or 58 <= o <= 64 or 91 <= o <= 96 or 123 <= o <= 126 or self.ud.category(c).startswith("P")

    @staticmethod
    def is_cjk(o):
        return (0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2A6DF or 0x2A700 <= o <= 0x2B73F or
                0x2B740 <= o <= 0x2B81F or 0x2B820 <= o <= 0x2CEAF or 0xF900 <= o <= 0xFAFF or 0x2F800 <= o <= 0x2FA1F)

    def encode(self, text):
        out = []
        for c in text:  # clean: controls dropped (tab, newline, return are whitespace), whitespace a space
            o = ord(c)
            if o == 0 or o == 0xFFFD or (c not in "\t\n\r" and self.ud.category(c).startswith("C")):
                continue
            out.append(" " if c in self.WHITE_SPACE else " %s " % c if self.is_cjk(o) else c)
        s = "".join(out)
        if self.strip:
            s = "".join(c for c in self.ud.normalize("NFD", s) if self.ud.category(c) != "Mn")
        if self.lower:
            s = "".join(c.lower() for c in s)  # per character: no final-sigma context
        words, cur = [], ""
        for c in s:
            if c in self.WHITE_SPACE:
                if cur:
                    words.append(cur)
                cur = ""
            elif self.is_punct(c):
                if cur:
                    words.append(cur)
                words.append(c)
                cur = ""
            else:
                cur += c
        if cur:
            words.append(cur)
        ids = [self.cls]
        for w in words:
            if len(w) > 100:
                ids.append(self.unk)
                continue
            pieces, start = [], 0
            while start < len(w):
                end, found = len(w), None
                while end > start:
                    sub = ("\u2581" if start == 0 else "") + w[start:end]
                    if sub in self.ids:
                        found = self.ids[sub]
                        break
                    end -= 1
                if found is None:
                    pieces = [self.unk]
                    break
                pieces.append(found)
                start = end
            ids.extend(pieces)
        return ids + [self.sep]


# --------------------------------------------------------------------------
# SentencePiece-style tokenizer (scores, greedy best-pair merging)

class Tokenizer:
    """pieces: list of bytes; space: how the vocabulary spells ' '
    (U+2581 in GGUF, ' ' in llama2.c's tokenizer.bin)."""

    def __init__(self, pieces, scores, space, bos, eos):
        self.pieces = pieces
        self.scores = list(scores) if scores is not None else [0.0] * len(pieces)
        self.space, self.bos, self.eos = space, bos, eos
        self.ids = {}
        for i, p in enumerate(pieces):
            self.ids.setdefault(p, i)  # first occurrence wins on duplicates

    def encode(self, text, bos=True):
        out = [self.bos] if bos else []
        if not text:
            return out
        text = (" " + text).replace(" ", self.space.decode("utf-8"))
        # Symbols are spans of text, one UTF-8 character each to start with.
        # Merging works on the text (as SentencePiece does), so a character
        # that is no token alone can still be part of a merged one ("\u2581h"
        # in a vocabulary without a bare "\u2581").
        syms = [ch.encode("utf-8") for ch in text]
        while True:
            best, best_i = None, -1
            for i in range(len(syms) - 1):
                j = self.ids.get(syms[i] + syms[i + 1])
                if j is not None and (best is None or self.scores[j] > self.scores[best]):
                    best, best_i = j, i
            if best is None:
                break
            syms[best_i:best_i + 2] = [syms[best_i] + syms[best_i + 1]]
        # What is still no token falls back to <0xHH> byte tokens (or <unk>).
        for sym in syms:
            if sym in self.ids:
                out.append(self.ids[sym])
            else:
                out.extend(self.ids.get(b"<0x%02X>" % byte, 0) for byte in sym)
        return out

    def piece_bytes(self, prev, tok):
        p = self.pieces[tok]
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            try:
                return bytes([int(p[3:5], 16)])
            except ValueError:
                pass
        p = p.replace(self.space, b" ")
        if prev == self.bos and p.startswith(b" "):
            p = p[1:]
        return p

    def decode(self, ids):
        out, prev = b"", None
        for t in ids:
            if t != self.bos:
                out += self.piece_bytes(prev, t)
            prev = t
        return out


# --------------------------------------------------------------------------
# CLI

def compare_logits(ref, path, tol):
    """Prints one line "PATH: ok: ..." or "PATH: FAIL: ..."; returns 0 if ok."""
    print("%s: " % path, end="")
    try:
        with open(path) as f:
            rows = [np.array([float(v) for v in line.split()]) for line in f
                    if line.strip()]
    except (OSError, ValueError) as e:
        print("FAIL: cannot read logits from %s: %s" % (path, e))
        return 1
    if len(rows) != ref.shape[0] or any(r.shape != (ref.shape[1],) for r in rows):
        print("FAIL: shape %d x %s, expected %d x %d" % (
            len(rows), sorted({r.size for r in rows}), ref.shape[0], ref.shape[1]))
        return 1
    got = np.stack(rows)
    if not np.all(np.isfinite(got)):
        print("FAIL: non-finite logits")
        return 1
    scale = np.maximum(np.abs(ref).max(axis=1), 1e-2)
    err = (np.abs(got - ref).max(axis=1) / scale)
    worst = int(np.argmax(err))
    agree = int(np.sum(got.argmax(axis=1) == ref.argmax(axis=1)))
    ok = err[worst] <= tol
    print("%s: max error %.3g (row %d, bound %.3g), argmax agrees %d/%d, |logit| <= %.3g" % (
        "ok" if ok else "FAIL", err[worst], worst, tol, agree, len(rows), scale.max()))
    return 0 if ok else 1


def use_longrope(m, n_ctx):
    """phi3 LongRoPE: the long factors for a context longer than the original
    one, else the short ones (llama.cpp's choice by context size; Hugging Face
    chooses by the sequence's length), and the attention factor on both."""
    if getattr(m, "longrope", None) is None:
        return
    long_f, short_f, orig, attn = m.longrope
    m.rope_freqs = long_f if n_ctx > orig else short_f
    m.rope_mag = attn


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokenizer", help="llama2.c tokenizer.bin (for .bin models)")
    g = ap.add_mutually_exclusive_group(required="--wordpiece" not in argv)
    g.add_argument("--prompt")
    g.add_argument("--ids", help='token ids, e.g. "1 403 407"')
    ap.add_argument("--n", type=int, help="greedy-generate N tokens")
    ap.add_argument("--logits", action="store_true", help="print next-token logits")
    ap.add_argument("--act-q8", action="store_true",
                    help="round activations to Q8_0 blocks before products with "
                         "Q8_0 weights, as kvlm's integer kernels do")
    ap.add_argument("--compare", metavar="FILE", nargs="+",
                    help="compare each FILE's logits with ours")
    ap.add_argument("--tol", type=float, default=1e-4, help="bound for --compare")
    ap.add_argument("--ctx", type=int, help="the context kvlm ran with (default: the trained one); "
                                            "chooses LongRoPE's long or short factors")
    ap.add_argument("--embed", action="store_true", help="print the input's embedding")
    ap.add_argument("--pooling", choices=sorted(POOLINGS), help="pooling instead of the file's")
    ap.add_argument("--no-normalize", action="store_true", help="the pooled vector as it is")
    ap.add_argument("--dimensions", type=int, default=0, help="the first N values of each vector")
    ap.add_argument("--compare-embed", metavar="FILE", help="compare FILE's vectors with ours")
    ap.add_argument("--wordpiece", metavar="TEXT", help="print TEXT's tokens by BERT's WordPiece")
    ap.add_argument("--no-window", action="store_true",
                    help="every layer global (for a test that the window shows in the logits)")
    args = ap.parse_args(argv)

    with open(args.model, "rb") as f:
        is_gguf = f.read(4) == GGUF_MAGIC
    if is_gguf:
        m, tok = load_gguf(args.model)
    else:
        m = load_llama2c(args.model)
        tok = load_llama2c_tokenizer(args.tokenizer, m.vocab) if args.tokenizer else None
    m.act_q8 = args.act_q8
    if args.no_window:
        m.local = [False] * m.n_layers
    use_longrope(m, args.ctx if args.ctx else m.ctx)
    if args.tokenizer and is_gguf:
        tok = load_llama2c_tokenizer(args.tokenizer, m.vocab)
    if args.wordpiece is not None:
        if not isinstance(tok, WordPiece):
            sys.exit("llama_ref: --wordpiece needs a model with a WordPiece (bert) vocabulary")
        print(" ".join(str(i) for i in tok.encode(args.wordpiece)))
        return 0
    if args.prompt is not None and isinstance(tok, WordPiece):
        ids = tok.encode(args.prompt)
    elif args.prompt is not None:
        if tok is None:
            sys.exit("llama_ref: --prompt needs a tokenizer (--tokenizer for .bin)")
        ids = tok.encode(args.prompt)
    else:
        ids = [int(s) for s in args.ids.replace(",", " ").split()]
    if any(not 0 <= t < m.vocab for t in ids):
        sys.exit("llama_ref: token id out of range (vocab %d)" % m.vocab)

    out = sys.stdout.buffer
    if args.embed or args.compare_embed:
        rows = embed(m, ids, POOLINGS.get(args.pooling), not args.no_normalize, args.dimensions)
        if args.compare_embed:
            return compare_embed(rows, args.compare_embed, args.tol)
        for row in rows:
            out.write((" ".join("%.9g" % v for v in row) + "\n").encode())
        out.flush()
        return 0
    if args.compare:
        ref = forward(m, ids)
        return max(compare_logits(ref, f, args.tol) for f in args.compare)
    if args.logits:
        for row in forward(m, ids):
            out.write((" ".join("%.6g" % v for v in row) + "\n").encode())
    if args.n is not None:
        if tok is None:
            sys.exit("llama_ref: --n needs a tokenizer to print text")
        text = args.prompt.encode("utf-8") if args.prompt is not None else tok.decode(ids)
        seq = list(ids)
        for _ in range(args.n):
            if len(seq) > m.ctx:  # the logits of at most ctx tokens
                break
            nxt = int(np.argmax(forward(m, seq)[-1]))
            if nxt == m.eos:
                break
            text += tok.piece_bytes(seq[-1], nxt)
            seq.append(nxt)
        # byte tokens can leave invalid UTF-8: shown as U+FFFD, as kvlm does
        out.write(text.decode("utf-8", errors="replace").encode("utf-8") + b"\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
