#!/usr/bin/python3
"""hf_export: writes a GGUF model (or vocabulary) as a Hugging Face model
directory, laid out as Hugging Face's own checkpoints are, for kvlm's tests
of its HF loader (tests/test_hf.c). NumPy only.

    hf_export.py IN.gguf OUTDIR [--family llama|mistral|mixtral|smollm3|granite|granitemoe|granitemoeshared|olmo2|olmo3|qwen2|qwen3|qwen3_moe|phi3|
                                          gemma2|gemma3_text|gemma3|mistral3 [--lm-names google|new]]
        [--shards N] [--norm-dtype f32|bf16|f16] [--merges string|list]
        [--pre bytelevel|llama3|qwen2|custom] [--template TEXT] [--no-pad]
        [--vocab-only]

Weights keep their GGUF type (F32, F16, BF16 -> the same safetensors dtype);
norms and biases are written in --norm-dtype. Llama and Mistral query/key
rows are put in Hugging Face's rotate-half order: the inverse of llama.cpp's
converter's permutation (HF row h*d + j*d/2 + i holds GGUF row h*d + 2i + j).
Gemma 2 keeps its rows (NeoX RoPE on both sides); its norms are stored as w
where GGUF holds 1 + w (Gemma's RMSNorm scales by 1 + w), and its four
norms per layer get Gemma's names.
The tokenizer becomes tokenizer.json: a SentencePiece ("llama") vocabulary
as the BPE model with byte_fallback and merges that Hugging Face's
SentencePiece converter would list (every split of a piece into two pieces,
ordered by the piece's score); a byte-level ("gpt2") one as BPE with a
ByteLevel pre-tokenizer (or a Split of Llama 3's / Qwen2's regex).
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                12: "<d"}
T_F32, T_F16, T_BF16 = 0, 1, 30
LLAMA3_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_RE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
            "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# a pattern kvlm has no name for: words, single digits, the rest one by one
CUSTOM_RE = " ?\\p{L}+|\\p{N}|\\s+|[^\\s\\p{L}\\p{N}]"
SPACE = "\u2581"


def read_gguf(path):
    buf = open(path, "rb").read()
    pos = [0]

    def take(fmt):
        v = struct.unpack_from(fmt, buf, pos[0])[0]
        pos[0] += struct.calcsize(fmt)
        return v

    def gstr():
        n = take("<Q")
        s = buf[pos[0]:pos[0] + n]
        pos[0] += n
        return s

    def value(t):
        if t in GGUF_SCALARS:
            return take(GGUF_SCALARS[t])
        if t == 8:
            return gstr()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        raise ValueError("GGUF value type %d" % t)

    if buf[:4] != b"GGUF":
        raise ValueError("%s: not GGUF" % path)
    pos[0] = 4
    take("<I")
    n_t, n_kv = take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        k = gstr().decode()
        meta[k] = value(take("<I"))
    infos = []
    for _ in range(n_t):
        name = gstr().decode()
        nd = take("<I")
        ne = [take("<Q") for _ in range(nd)]
        infos.append((name, ne, take("<I"), take("<Q")))
    align = meta.get("general.alignment", 32)
    start = (pos[0] + align - 1) // align * align
    tensors = {}
    for name, ne, t, off in infos:
        n = int(np.prod(ne))
        dt = {T_F32: "<f4", T_F16: "<f2", T_BF16: "<u2"}.get(t)
        if dt is None:
            raise ValueError("%s: GGUF type %d cannot be exported (f32, f16, bf16)" % (name, t))
        a = np.frombuffer(buf, dtype=dt, count=n, offset=start + off).reshape(list(reversed(ne)))
        tensors[name] = (a, t)
    return meta, tensors


def f32_to(a, dtype):
    """f32 array -> (array, safetensors dtype) in dtype; bf16 as raw u16 bits, rounded to nearest even."""
    a = np.asarray(a, dtype=np.float32)
    if dtype == "f32":
        return a, "F32"
    if dtype == "f16":
        return a.astype("<f2"), "F16"
    bits = a.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.astype("<u2"), "BF16"


def to_f32(a, t):
    if t == T_BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def write_safetensors(path, items, pad=True):
    """items: list of (name, array, dtype string)."""
    header, off, blobs = {}, 0, []
    for name, a, dt in items:
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    elif len(h) % 2 == 0:
        h += b" "  # odd: every tensor's data starts misaligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def rotate_half_rows(w, n_head):
    """GGUF's interleaved rows -> HF's rotate-half rows (inverse of llama.cpp's permute)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Gemma3TextConfig's defaults: a multimodal gemma3 config.json's text_config
# lists only the keys that differ from them, as Google's files do
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                        "query_pre_attn_scalar": 256, "sliding_window_pattern": 6, "tie_word_embeddings": True}
# MistralConfig's, for a mistral3 (Mistral Small 3.1) text_config
MISTRAL_TEXT_DEFAULTS = {"vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
                         "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                         "tie_word_embeddings": False}


def export_weights(meta, tensors, out, fam, args):
    arch = meta["general.architecture"].decode()
    # Gemma 3 4B and larger, Mistral Small 3.1: the text model inside Gemma3/Mistral3ForConditionalGeneration
    multimodal = {"gemma3": "gemma3_text", "mistral3": "mistral"}.get(fam)
    outer = fam
    if multimodal:
        fam = multimodal
    g = lambda k, d=None: meta.get("%s.%s" % (arch, k), d)
    n_layers, dim = g("block_count"), g("embedding_length")
    n_head = g("attention.head_count")
    n_kv = g("attention.head_count_kv", n_head)
    head_dim = g("attention.key_length", dim // n_head)
    items = []
    granite_moe = fam in ("granitemoe", "granitemoeshared")
    rot = fam in ("llama", "mistral", "mixtral", "smollm3", "granite") or granite_moe
    moe = fam in ("mixtral", "qwen3_moe", "qwen2_moe")
    gemma = fam in ("gemma2", "gemma3_text")

    def put(hf, gg, perm_heads=0, expert=None):
        a, t = tensors[gg]
        if expert is not None:  # one expert of a stacked (experts, rows, cols) tensor
            a = a[expert]
        if a.ndim == 1:
            v = to_f32(a, t)
            if gemma:  # exact for the values near 1 that norms hold (Sterbenz)
                v = (v - np.float32(1)).astype(np.float32)
            arr, dt = f32_to(v, args.norm_dtype)
        else:
            arr, dt = a, {T_F32: "F32", T_F16: "F16", T_BF16: "BF16"}[t]
            if perm_heads:
                arr = rotate_half_rows(arr, perm_heads)
        items.append((hf, arr, dt))

    put("model.embed_tokens.weight", "token_embd.weight")
    put("model.norm.weight", "output_norm.weight")
    tied = "output.weight" not in tensors
    if not tied:
        put("lm_head.weight", "output.weight")
    for l in range(n_layers):
        p, b = "model.layers.%d." % l, "blk.%d." % l
        if fam not in ("olmo2", "olmo3"):  # OLMo 2 and 3: no norm before attention or FFN
            put(p + "input_layernorm.weight", b + "attn_norm.weight")
        if fam == "phi3":
            put(p + "self_attn.qkv_proj.weight", b + "attn_qkv.weight")
            put(p + "mlp.gate_up_proj.weight", b + "ffn_up.weight")
        else:
            put(p + "self_attn.q_proj.weight", b + "attn_q.weight", n_head if rot else 0)
            put(p + "self_attn.k_proj.weight", b + "attn_k.weight", n_kv if rot else 0)
            put(p + "self_attn.v_proj.weight", b + "attn_v.weight")
            if not moe and not granite_moe:
                put(p + "mlp.gate_proj.weight", b + "ffn_gate.weight")
                put(p + "mlp.up_proj.weight", b + "ffn_up.weight")
        for x in "qkv":
            if b + "attn_%s.bias" % x in tensors:
                put(p + "self_attn.%s_proj.bias" % x, b + "attn_%s.bias" % x)
        put(p + "self_attn.o_proj.weight", b + "attn_output.weight")
        if fam in ("olmo2", "olmo3"):  # the norms after attention and FFN, under these names
            put(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight")
            put(p + "post_feedforward_layernorm.weight", b + "post_ffw_norm.weight")
        elif gemma:
            put(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight")
            put(p + "pre_feedforward_layernorm.weight", b + "ffn_norm.weight")
            put(p + "post_feedforward_layernorm.weight", b + "post_ffw_norm.weight")
        else:
            put(p + "post_attention_layernorm.weight", b + "ffn_norm.weight")
        if granite_moe:  # GraniteMoe: every expert's gate then up rows in one 3-D input_linear, down in output_linear
            raw = lambda n: tensors[b + n][0]
            dt = {T_F32: "F32", T_F16: "F16", T_BF16: "BF16"}[tensors[b + "ffn_gate_exps.weight"][1]]
            put(p + "block_sparse_moe.router.layer.weight", b + "ffn_gate_inp.weight")
            items.append((p + "block_sparse_moe.input_linear.weight",
                          np.concatenate([raw("ffn_gate_exps.weight"), raw("ffn_up_exps.weight")], axis=1), dt))
            items.append((p + "block_sparse_moe.output_linear.weight", raw("ffn_down_exps.weight"), dt))
            if b + "ffn_gate_shexp.weight" in tensors:  # MoE Shared: gate then up rows, as the experts'
                items.append((p + "shared_mlp.input_linear.weight",
                              np.concatenate([raw("ffn_gate_shexp.weight"), raw("ffn_up_shexp.weight")], axis=0), dt))
                put(p + "shared_mlp.output_linear.weight", b + "ffn_down_shexp.weight")
        elif moe:  # Mixtral's block_sparse_moe (w1 gate, w3 up, w2 down) or Qwen3-MoE's mlp.experts
            mx = fam == "mixtral"
            pre = p + ("block_sparse_moe." if mx else "mlp.")
            put(pre + "gate.weight", b + "ffn_gate_inp.weight")
            for e in range(tensors[b + "ffn_gate_exps.weight"][0].shape[0]):
                ep = pre + "experts.%d." % e
                put(ep + ("w1" if mx else "gate_proj") + ".weight", b + "ffn_gate_exps.weight", expert=e)
                put(ep + ("w3" if mx else "up_proj") + ".weight", b + "ffn_up_exps.weight", expert=e)
                put(ep + ("w2" if mx else "down_proj") + ".weight", b + "ffn_down_exps.weight", expert=e)
            if fam == "qwen2_moe":  # the shared expert and its gate (a 1 x hidden Linear)
                for hn, gn in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                    put(pre + "shared_expert.%s.weight" % hn, b + "ffn_%s_shexp.weight" % gn)
                a, t = tensors[b + "ffn_gate_inp_shexp.weight"]
                arr, dt = f32_to(to_f32(a, t), args.norm_dtype)  # a vector, as the norms: --norm-dtype
                items.append((pre + "shared_expert_gate.weight", arr.reshape(1, -1), dt))
        else:
            put(p + "mlp.down_proj.weight", b + "ffn_down.weight")
        if fam in ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmo3"):
            put(p + "self_attn.q_norm.weight", b + "attn_q_norm.weight")
            put(p + "self_attn.k_norm.weight", b + "attn_k_norm.weight")

    vocab = tensors["token_embd.weight"][0].shape[0]
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
                           "granitemoeshared": "GraniteMoeSharedForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "mixtral": "MixtralForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                           "gemma3_text": "Gemma3ForCausalLM"}[fam]],
        "model_type": fam,
        "hidden_size": dim,
        "intermediate_size": g("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "hidden_act": "silu",
        "max_position_embeddings": g("context_length", 2048),
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g("rope.freq_base", 10000.0),
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "vocab_size": vocab,
        "torch_dtype": {T_F32: "float32", T_F16: "float16", T_BF16: "bfloat16"}[tensors["blk.0.attn_output.weight"][1]],
    }
    if head_dim != dim // n_head:
        cfg["head_dim"] = head_dim
    rope_dim = g("rope.dimension_count", head_dim)
    if rope_dim != head_dim:  # Phi-4-mini's partial rotation
        cfg["partial_rotary_factor"] = rope_dim / head_dim
    if args.rope_llama3:  # the GGUF's rope_freqs.weight stands for these (the converter computed it from them)
        f, lo, hi, orig = (float(v) for v in args.rope_llama3.split(","))
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
                               "original_max_position_embeddings": int(orig)}
    stype = g("rope.scaling.type", b"none")
    stype = stype.decode() if isinstance(stype, bytes) else stype
    if stype == "linear":  # what llama.cpp's converter writes for HF's linear type
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor", 1.0))}
    elif stype == "yarn":  # Qwen2.5's form of it
        cfg["rope_scaling"] = {"rope_type": "yarn", "factor": float(g("rope.scaling.factor")),
                               "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                               "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0)),
                               "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0))}
    if fam == "mistral":
        cfg["sliding_window"] = 4096
    if fam == "granite" or granite_moe:  # GraniteConfig's multipliers (llama.cpp's GGUF keys hold them)
        cfg["embedding_multiplier"] = float(g("embedding_scale", 1.0))
        cfg["residual_multiplier"] = float(g("residual_scale", 1.0))
        cfg["attention_multiplier"] = float(g("attention.scale", head_dim ** -0.5))
        cfg["logits_scaling"] = float(g("logit_scale", 1.0))
    if fam == "olmo3":  # Olmo3Config: the window on the layers layer_types calls sliding_attention
        pat = g("attention.sliding_window_pattern", 4)
        local = [bool(v) for v in pat] if isinstance(pat, list) else [(i + 1) % pat != 0 for i in range(n_layers)]
        cfg["sliding_window"] = g("attention.sliding_window", 4096)
        cfg["layer_types"] = ["sliding_attention" if v else "full_attention" for v in local]
        if cfg["rope_scaling"] and cfg["rope_scaling"]["rope_type"] == "yarn":  # OLMo 3's configs state the factor
            cfg["rope_scaling"]["attention_factor"] = 1 + 0.1 * np.log(cfg["rope_scaling"]["factor"])
    if fam == "smollm3":  # SmolLM3Config: RoPE off in every fourth layer
        cfg["no_rope_layer_interval"] = 4
        cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(n_layers)]
        cfg["use_sliding_window"] = False
    if granite_moe:  # GraniteMoeConfig: the experts intermediate_size wide
        cfg["num_local_experts"] = g("expert_count")
        cfg["num_experts_per_tok"] = g("expert_used_count")
        if fam == "granitemoeshared":
            cfg["shared_intermediate_size"] = g("expert_shared_feed_forward_length", 0)
    if fam == "mixtral":
        cfg["num_local_experts"] = g("expert_count")
        cfg["num_experts_per_tok"] = g("expert_used_count")
    if fam in ("qwen2_moe", "qwen3_moe"):  # experts in every layer: Qwen3-MoE's renormalised, Qwen2-MoE's not
        cfg["num_experts"] = g("expert_count")
        cfg["num_experts_per_tok"] = g("expert_used_count")
        cfg["moe_intermediate_size"] = g("expert_feed_forward_length")
        cfg["norm_topk_prob"] = fam == "qwen3_moe"
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = []
        if fam == "qwen2_moe":  # and its gated shared expert
            cfg["shared_expert_intermediate_size"] = g("expert_shared_feed_forward_length")
            cfg["use_sliding_window"] = False
        else:
            cfg["head_dim"] = head_dim
    if fam == "qwen3":  # Qwen3Config writes these
        cfg["head_dim"] = head_dim
        cfg["attention_bias"] = False
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
    if fam == "qwen2":
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = 4096
    if fam == "phi3":
        cfg["sliding_window"] = 2047
        cfg["original_max_position_embeddings"] = cfg["max_position_embeddings"]
    if "rope_factors_long.weight" in tensors:  # phi3's LongRoPE, as Phi-3.5's config.json holds it
        lf, sf = (to_f32(*tensors["rope_factors_%s.weight" % k]).ravel() for k in ("long", "short"))
        cfg["rope_scaling"] = {"type": "longrope", "long_factor": [float(v) for v in lf],
                               "short_factor": [float(v) for v in sf]}
        # no attention_factor: Hugging Face derives it from these two, as the GGUF's converter did
        cfg["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
    if gemma:
        # Gemma2Config's keys; llama.cpp's converter copies them to these GGUF keys
        cfg["hidden_act"] = cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["head_dim"] = head_dim
        g3 = fam == "gemma3_text"
        if g3:  # Gemma3TextConfig: five local layers to one global, their own RoPE base
            period = g("attention.sliding_window_pattern", 6)
            cfg["sliding_window_pattern"] = period
            cfg["layer_types"] = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                  for i in range(n_layers)]
            cfg["rope_local_base_freq"] = 10000.0
        elif g("attention.sliding_window_pattern", 2) != 2:
            raise ValueError("gemma2: sliding_window_pattern %d has no Gemma2Config key (every other layer is "
                             "local)" % g("attention.sliding_window_pattern"))
        cfg["sliding_window"] = g("attention.sliding_window", 4096)
        cfg["cache_implementation"] = "hybrid"
        caps = {"attn_logit_softcapping": 0.0 if g3 else 50.0, "final_logit_softcapping": 0.0 if g3 else 30.0}
        for k, d in caps.items():
            v = g(k, d)
            cfg[k] = float(v) if v else None  # 0 in GGUF: none
        # llama.cpp derives the scale (27B: hidden_size / heads); HF states it
        cfg["query_pre_attn_scalar"] = dim // n_head if n_layers == (62 if g3 else 46) else head_dim
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if bos is not None and bos < vocab:
        cfg["bos_token_id"] = bos
    if eos is not None and eos < vocab:
        cfg["eos_token_id"] = eos
    if multimodal:  # text_config: what differs from the defaults, and what the shipped files list anyway
        keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "rope_scaling", "sliding_window", "head_dim")
        dflt = GEMMA3_TEXT_DEFAULTS if outer == "gemma3" else MISTRAL_TEXT_DEFAULTS
        text = {k: v for k, v in cfg.items() if k in keep or (k in dflt and v != dflt[k])}
        text["model_type"] = multimodal
        arch_name = {"gemma3": "Gemma3ForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}[outer]
        cfg = {"architectures": [arch_name], "model_type": outer, "text_config": text,
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8, "num_hidden_layers": 1},
               "mm_tokens_per_image": 256, "image_token_index": 262144, "torch_dtype": cfg["torch_dtype"]}
        google = args.lm_names == "google"
        named = []
        for name, a, dt in items:
            if name.startswith("model."):
                name = ("language_model.model." if google else "model.language_model.") + name[len("model."):]
            elif name == "lm_head.weight":
                name = "language_model.lm_head.weight" if google else name
            named.append((name, a, dt))
        # a vision tower and projector, which kvlm leaves unread
        v = np.zeros((8, 8), dtype=np.float32)
        named.append(("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", v, "F32"))
        named.append(("multi_modal_projector.mm_input_projection_weight", v, "F32"))
        items[:] = named
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    n = max(1, args.shards)
    if n == 1:
        write_safetensors(os.path.join(out, "model.safetensors"), items, pad=not args.no_pad)
        return
    chunks = [items[i::n] for i in range(n)]
    wm = {}
    for i, ch in enumerate(chunks):
        fn = "model-%05d-of-%05d.safetensors" % (i + 1, n)
        write_safetensors(os.path.join(out, fn), ch, pad=not args.no_pad)
        for name, _, _ in ch:
            wm[name] = fn
    total = sum(np.asarray(a).nbytes for _, a, _ in items)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}, f, indent=2)


def export_tokenizer(meta, out, args):
    model = meta["tokenizer.ggml.model"].decode()
    toks = [t.decode("utf-8", errors="surrogateescape") for t in meta["tokenizer.ggml.tokens"]]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(toks))
    scores = meta.get("tokenizer.ggml.scores", [0.0] * len(toks))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    ok = lambda i: i is not None and 0 <= i < len(toks)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": types[i] in (2, 3)} for i, t in enumerate(toks) if types[i] in (2, 3, 4)]
    vocab = {}
    for i, t in enumerate(toks):
        vocab.setdefault(t, i)
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added}
    if model == "llama":
        # SentencePiece -> BPE as transformers' SentencePieceExtractor does it
        merges = []
        for i, t in enumerate(toks):
            if types[i] != 1:
                continue
            local = []
            for k in range(1, len(t)):
                a, b = t[:k], t[k:]
                if a in vocab and b in vocab:
                    local.append((a, b, scores[i]))
            local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
            merges.extend(local)
        merges.sort(key=lambda x: x[2], reverse=True)
        space = meta.get("tokenizer.ggml.add_space_prefix", True)
        norms = ([{"type": "Prepend", "prepend": SPACE}] if space else []) + \
            [{"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]
        tj["normalizer"] = {"type": "Sequence", "normalizers": norms}
        tj["pre_tokenizer"] = None
        if args.family in ("gemma2", "gemma3_text") or meta.get("general.architecture") in (b"gemma2", b"gemma3"):
            # Gemma's tokenizer.json: a split on " ", after the normalizer made every space U+2581
            tj["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                                   "invert": False}
        tj["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
        byte_fallback = True
    elif model == "gpt2":
        merges = [tuple(m.decode("utf-8", errors="surrogateescape").split(" ", 1))
                  for m in meta.get("tokenizer.ggml.merges", [])]
        tj["normalizer"] = None
        bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        if args.pre == "bytelevel":
            tj["pre_tokenizer"] = bl
        else:
            if args.pre == "qwen2":
                tj["normalizer"] = {"type": "NFC"}
            pat = {"llama3": LLAMA3_RE, "qwen2": QWEN2_RE, "custom": CUSTOM_RE}[args.pre]
            tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
                dict(bl, use_regex=False)]}
        tj["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        byte_fallback = False
    else:
        raise ValueError("tokenizer model %s cannot be exported" % model)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
    if add_bos and ok(bos):
        tj["post_processor"] = {"type": "TemplateProcessing",
                                "single": [{"SpecialToken": {"id": toks[bos], "type_id": 0}},
                                           {"Sequence": {"id": "A", "type_id": 0}}],
                                "special_tokens": {toks[bos]: {"id": toks[bos], "ids": [bos], "tokens": [toks[bos]]}}}
    else:
        tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                "use_regex": False} if model == "gpt2" else None
    mlist = [[m[0], m[1]] for m in merges] if args.merges == "list" else ["%s %s" % (m[0], m[1]) for m in merges]
    tj["model"] = {"type": "BPE", "dropout": None, "unk_token": toks[unk] if ok(unk) else None,
                   "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": model == "llama",
                   "byte_fallback": byte_fallback, "ignore_merges": args.pre == "llama3", "vocab": vocab,
                   "merges": mlist}
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8", errors="surrogateescape") as f:
        json.dump(tj, f, ensure_ascii=False)
    tc = {"add_bos_token": add_bos, "add_eos_token": False, "model_max_length": 2048,
          "bos_token": toks[bos] if ok(bos) else None, "eos_token": toks[eos] if ok(eos) else None,
          "unk_token": toks[unk] if ok(unk) else None, "clean_up_tokenization_spaces": False}
    tmpl = args.template if args.template is not None else (
        meta["tokenizer.chat_template"].decode() if "tokenizer.chat_template" in meta else None)
    if tmpl:
        tc["chat_template"] = tmpl
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--family", default=None)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--norm-dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--merges", default="string", choices=["string", "list"])
    ap.add_argument("--pre", default="bytelevel", choices=["bytelevel", "llama3", "qwen2", "custom"])
    ap.add_argument("--template", default=None)
    ap.add_argument("--no-pad", action="store_true", help="leave the header unpadded (misaligned data)")
    ap.add_argument("--vocab-only", action="store_true")
    ap.add_argument("--lm-names", default="google", choices=["google", "new"],
                    help="gemma3: language_model.model.* as Google ships it, or model.language_model.* (newer Transformers)")
    ap.add_argument("--rope-llama3", default=None, metavar="FACTOR,LOW,HIGH,ORIG",
                    help="config.json's rope_scaling of type llama3 (what the GGUF's rope_freqs.weight was made from)")
    args = ap.parse_args(argv)
    meta, tensors = read_gguf(args.gguf)
    os.makedirs(args.out, exist_ok=True)
    if not args.vocab_only:
        fam = args.family or meta["general.architecture"].decode()
        export_weights(meta, tensors, args.out, fam, args)
    export_tokenizer(meta, args.out, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
