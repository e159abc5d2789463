#!/usr/bin/env bash
# cli_hf: the `kvlm` command on Hugging Face model directories written by
# scripts/hf_export.py: `run -m DIR` gives the GGUF's greedy text, `convert
# DIR` gives the GGUF back (and quantizes as converting the GGUF does),
# gemma2 (window 8) gives the GGUF's logits at every position and converts with
# its keys, `inspect DIR` lists the safetensors, the chat template is matched or named
# in a warning, a missing shard is an error naming it, and the real
# vocabularies' reference tokenizations (vocab/*.inp, *.out) hold through
# tokenizer.json.
#
# Env: KVLM_BIN, KVLM_MODELS or KVLM_MODELS_DEFAULT.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
py=/usr/bin/python3
bin=${KVLM_BIN:-$root/build/kvlm}
models=${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-$root/../shared/models}}
export="$py $root/scripts/hf_export.py"

if [ ! -x "$bin" ]; then echo "FAIL: kvlm binary not found at '$bin' (set KVLM_BIN)"; exit 1; fi
if ! "$py" -c 'import numpy' 2>/dev/null; then
    echo "SKIP: numpy not available to $py (apt-get install python3-numpy)"; exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
pass() { passed=$((passed + 1)); echo "PASS: $*"; }
# inspect_has FILE PATTERN: kvlm inspect's listing of FILE matches PATTERN (read whole first: a
# `grep -q` that stops early would kill inspect by SIGPIPE, which pipefail makes a failure)
inspect_has() { local o; o=$("$bin" inspect "$1" 2>&1); grep -q "$2" <<< "$o"; }
# refused LABEL DIR CODE NEEDLE: a copy of directory DIR whose config.json Python's CODE changed (c: the
# config) is refused with a message holding NEEDLE
refused() {
    rm -rf "$tmp/bad" && cp -r "$2" "$tmp/bad"
    "$py" -c "import json,sys; c=json.load(open(sys.argv[1])); $3; json.dump(c, open(sys.argv[1], 'w'))" "$tmp/bad/config.json"
    local out
    if out=$("$bin" logits -m "$tmp/bad" --ids "1 2" 2>&1); then fail "$1: loaded"
    elif grep -qF "$4" <<< "$out"; then pass "$1: refused: $(tail -n 1 <<< "$out")"
    else fail "$1: got '$out'"; fi
}
# three_ways NAME: la, lb, lc: the logits of directory $tmp/NAME, of its GGUF $tmp/NAME.gguf and of the
# directory's convert $tmp/NAME.back.gguf; keys: the convert's keys
three_ways() {
    la=$("$bin" logits -m "$tmp/$1" --ids "$ids" 2>/dev/null)
    lb=$("$bin" logits -m "$tmp/$1.gguf" --ids "$ids" 2>/dev/null)
    "$bin" convert "$tmp/$1" "$tmp/$1.back.gguf" 2>/dev/null
    lc=$("$bin" logits -m "$tmp/$1.back.gguf" --ids "$ids" 2>/dev/null)
    keys=$("$bin" inspect "$tmp/$1.back.gguf" 2>&1)
}
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# gemma2: a window of 8, shorter than the texts and id lists below, tied embeddings
synth() { "$bin" synth "$1" --arch "$2" --dim 64 --hidden 96 --layers 2 --heads 4 --kv-heads 2 --vocab 700 \
    --type "$3" --seed 5 $([ "$2" = gemma2 ] && echo --sliding-window 8 --tied) \
    $([ "$2" = gemma3 ] && echo --sliding-window 8 --tied --layers 7 --rope-linear 8) \
    $([ "$2" = qwen3 ] && echo --head-dim 32) > /dev/null; }

# ---- run -m DIR == run -m GGUF -------------------------------------------------
for spec in qwen2:qwen2:bf16 qwen3:qwen3:bf16 phi3:phi3:f16 llama:llama:f32 llama:mistral:bf16 smollm3:smollm3:f16 granite:granite:f32 \
            gemma2:gemma2:bf16 gemma3:gemma3_text:bf16 olmo2:olmo2:f16; do
    IFS=: read -r arch fam type <<< "$spec"
    synth "$tmp/$fam.gguf" "$arch" "$type"
    $export "$tmp/$fam.gguf" "$tmp/$fam" --family "$fam" || { fail "$fam: export"; continue; }
    run=(run -p "once upon a time" -n 24 --temp 0 --cache-type-k f32 --cache-type-v f32)
    want=$("$bin" "${run[@]}" -m "$tmp/$fam.gguf" 2>/dev/null)
    # llama/mistral from HF: same logits to ~1e-7 (q.k summed in another
    # order); convert gives the very GGUF back, so compare through it there
    via=""
    case $arch in llama|smollm3|granite) via="'s convert" ;; esac
    if [ -n "$via" ]; then
        "$bin" convert "$tmp/$fam" "$tmp/$fam.back.gguf" 2>/dev/null || { fail "$fam: convert"; continue; }
        got=$("$bin" "${run[@]}" -m "$tmp/$fam.back.gguf" 2>/dev/null)
        got_dir=$("$bin" "${run[@]}" -m "$tmp/$fam" 2>/dev/null)
        if [ "$got_dir" = "$want" ]; then pass "$fam ($type): greedy text of the directory itself = the GGUF's"
        else fail "$fam ($type): run -m DIR: want '$want', got '$got_dir'"; fi
    else
        got=$("$bin" "${run[@]}" -m "$tmp/$fam" 2>/dev/null)
    fi
    if [ -n "$want" ] && [ "$got" = "$want" ]; then pass "$fam ($type): greedy text of the directory$via = the GGUF's"
    else fail "$fam ($type): text differs: want '$want', got '$got'"; fi
done

# qwen3 (head dim 32 with dim 64 and 4 heads): convert writes the per-head q and k norms back, and the
# directory, the GGUF it came from and its convert give the same logits
"$bin" convert "$tmp/qwen3" "$tmp/qwen3.back.gguf" 2>/dev/null
q3ids="1 300 17 402 599 3 88 650 260 261"
for m in qwen3 qwen3.gguf qwen3.back.gguf; do
    "$bin" logits -m "$tmp/$m" --ids "$q3ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/q3.$m.txt" 2>/dev/null
done
if inspect_has "$tmp/qwen3.back.gguf" "blk.1.attn_k_norm.weight *f32 *32 " &&
   [ -s "$tmp/q3.qwen3.txt" ] && cmp -s "$tmp/q3.qwen3.txt" "$tmp/q3.qwen3.gguf.txt" &&
   cmp -s "$tmp/q3.qwen3.back.gguf.txt" "$tmp/q3.qwen3.gguf.txt"; then
    pass "qwen3: convert DIR writes attn_q_norm/attn_k_norm; the directory's and the convert's logits = the GGUF's"
else fail "qwen3: convert or logits differ"; fi

# ---- Llama 3.1's RoPE scaling: rope_scaling llama3 in config.json = the GGUF's rope_freqs.weight ----
# (factor 4, low 1, high 4, from an original context of 64 / 4 = 16: what `synth --rope-llama3 4` computed)
ids="1 300 17 402 599 3 88 650 260 261 45 699 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22"
"$bin" synth "$tmp/l3.gguf" --arch llama --dim 64 --hidden 96 --layers 2 --heads 4 --kv-heads 2 --vocab 700 \
    --ctx 64 --type f32 --seed 6 --rope-llama3 4 > /dev/null
"$bin" synth "$tmp/l3plain.gguf" --arch llama --dim 64 --hidden 96 --layers 2 --heads 4 --kv-heads 2 --vocab 700 \
    --ctx 64 --type f32 --seed 6 > /dev/null
if $export "$tmp/l3.gguf" "$tmp/l3" --family llama --rope-llama3 4,1,4,16; then
    "$bin" logits -m "$tmp/l3" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/l3.dir.txt" 2>/dev/null
    "$bin" logits -m "$tmp/l3.gguf" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/l3.gguf.txt" 2>/dev/null
    "$bin" logits -m "$tmp/l3plain.gguf" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/l3.plain.txt" 2>/dev/null
    # HF's rotate_half layout sums q.k in another order: ~1e-5 apart, far from the unscaled model's
    maxdiff='import sys
a, b = ([[float(v) for v in l.split()] for l in open(f)] for f in sys.argv[1:3])
print(max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y)) if len(a) == len(b) and a else 1e9)'
    e_dir=$("$py" -c "$maxdiff" "$tmp/l3.dir.txt" "$tmp/l3.gguf.txt")
    e_plain=$("$py" -c "$maxdiff" "$tmp/l3.gguf.txt" "$tmp/l3.plain.txt")
    if "$py" -c "import sys; sys.exit(0 if $e_dir < 1e-4 and $e_plain > 1e-2 else 1)"; then
        pass "rope_scaling llama3: the directory's logits = the GGUF's (max diff $e_dir; without the scaling $e_plain)"
    else fail "rope_scaling llama3: directory vs GGUF $e_dir, GGUF vs unscaled $e_plain"; fi
    "$bin" convert "$tmp/l3" "$tmp/l3.back.gguf" 2>/dev/null
    "$bin" logits -m "$tmp/l3.back.gguf" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/l3.back.txt" 2>/dev/null
    if inspect_has "$tmp/l3.back.gguf" "rope_freqs.weight *f32 *8 " &&
       cmp -s "$tmp/l3.back.txt" "$tmp/l3.gguf.txt"; then
        pass "convert DIR with rope_scaling llama3: rope_freqs.weight in the GGUF, the same logits as the original"
    else fail "convert DIR with rope_scaling llama3: no rope_freqs.weight"; fi
else fail "llama3 rope: export"; fi
# linear (factor 4) on a llama, YaRN (factor 4 from 16 tokens) on a qwen2: the directory, the GGUF it came
# from and its convert give one set of logits, apart from the same weights unscaled
for spec in lin:llama:--rope-linear:linear yarn:qwen2:--yarn:yarn; do
    IFS=: read -r name arch opt kind <<< "$spec"
    for s in scaled plain; do
        "$bin" synth "$tmp/$name.$s.gguf" --arch "$arch" --dim 64 --hidden 96 --layers 2 --heads 4 --kv-heads 2 \
            --vocab 700 --ctx 64 --type f32 --seed 6 $([ $s = scaled ] && echo "$opt" 4) > /dev/null
        "$bin" logits -m "$tmp/$name.$s.gguf" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/$name.$s.txt" 2>/dev/null
    done
    if $export "$tmp/$name.scaled.gguf" "$tmp/$name" --family "$arch" && grep -q "\"rope_type\": \"$kind\"" "$tmp/$name/config.json"; then
        "$bin" logits -m "$tmp/$name" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/$name.dir.txt" 2>/dev/null
        "$bin" convert "$tmp/$name" "$tmp/$name.back.gguf" 2>/dev/null
        "$bin" logits -m "$tmp/$name.back.gguf" --ids "$ids" --cache-type-k f32 --cache-type-v f32 > "$tmp/$name.back.txt" 2>/dev/null
        e_dir=$("$py" -c "$maxdiff" "$tmp/$name.dir.txt" "$tmp/$name.scaled.txt")
        e_back=$("$py" -c "$maxdiff" "$tmp/$name.back.txt" "$tmp/$name.scaled.txt")
        e_plain=$("$py" -c "$maxdiff" "$tmp/$name.scaled.txt" "$tmp/$name.plain.txt")
        if "$py" -c "import sys; sys.exit(0 if $e_dir < 1e-4 and $e_back < 1e-4 and $e_plain > 1e-2 else 1)"; then
            pass "rope_scaling $kind ($arch): the directory's logits = the GGUF's (max diff $e_dir), its convert's ($e_back); unscaled $e_plain"
        else fail "rope_scaling $kind ($arch): directory vs GGUF $e_dir, convert $e_back, GGUF vs unscaled $e_plain"; fi
    else fail "$kind rope ($arch): export"; fi
done

# LongRoPE on a phi3 (factor 2 from 32 tokens: Phi-3.5's rope_scaling longrope): the directory, the GGUF and
# its convert give one set of logits in the trained context (long factors) and in one of 32 (short ones)
# (Phi-4-mini's kind: 24 of a head's 32 dimensions turn, partial_rotary_factor 0.75)
"$bin" synth "$tmp/lr.gguf" --arch phi3 --dim 64 --hidden 96 --layers 2 --heads 2 --kv-heads 1 --vocab 700 \
    --ctx 64 --type f32 --seed 6 --longrope 2 --rope-dim 24 > /dev/null
if $export "$tmp/lr.gguf" "$tmp/lr" --family phi3 && grep -q '"type": "longrope"' "$tmp/lr/config.json" &&
   grep -q '"partial_rotary_factor": 0.75' "$tmp/lr/config.json"; then
    "$bin" convert "$tmp/lr" "$tmp/lr.back.gguf" 2>/dev/null
    for c in 64 32; do
        for m in lr lr.gguf lr.back.gguf; do
            "$bin" logits -m "$tmp/$m" --ids "$ids" -c $c --cache-type-k f32 --cache-type-v f32 > "$tmp/lr.$m.$c.txt" 2>/dev/null
        done
        e_dir=$("$py" -c "$maxdiff" "$tmp/lr.lr.$c.txt" "$tmp/lr.lr.gguf.$c.txt")
        e_back=$("$py" -c "$maxdiff" "$tmp/lr.lr.back.gguf.$c.txt" "$tmp/lr.lr.gguf.$c.txt")
        if "$py" -c "import sys; sys.exit(0 if $e_dir < 1e-4 and $e_back < 1e-4 else 1)"; then
            pass "rope_scaling longrope (phi3, partial rotation), context $c: the directory's logits = the GGUF's (max diff $e_dir), its convert's ($e_back)"
        else fail "rope_scaling longrope (phi3), context $c: directory vs GGUF $e_dir, convert $e_back"; fi
    done
    e_set=$("$py" -c "$maxdiff" "$tmp/lr.lr.gguf.64.txt" "$tmp/lr.lr.gguf.32.txt")
    if "$py" -c "import sys; sys.exit(0 if $e_set > 1e-2 else 1)" &&
       inspect_has "$tmp/lr.back.gguf" "phi3.rope.scaling.attn_factor *= 1.09"; then
        pass "longrope: the long and the short factors part ($e_set); convert writes the attention factor"
    else fail "longrope: long vs short $e_set, or no attn_factor key in the convert"; fi
    # a short list of factors, a zero factor: refused with what is wrong, never run as plain RoPE
    refused "longrope, a short list of factors" "$tmp/lr" 'c["rope_scaling"]["short_factor"].pop()' \
        '"short_factor" must be an array of 12 numbers (rope dimension 24'
    refused "longrope, a zero factor" "$tmp/lr" 'c["rope_scaling"]["long_factor"][3] = 0' \
        'long_factor[3] is not a finite number above 0'
    refused "partial_rotary_factor 0.72 of 32 (23 dimensions)" "$tmp/lr" 'c["partial_rotary_factor"] = 0.72' \
        "leaves an even number of rotated dimensions"
else fail "longrope (phi3): export"; fi

# ---- mixtures of experts: Mixtral (block_sparse_moe, llama's rows; experts as wide as the FFN, 96) and
# Qwen3-MoE and Qwen2-MoE (mlp.experts, 48 wide; Qwen2-MoE's gated shared expert too), one tensor per
# expert in the directory, stacked at load; GraniteMoe's stored stacked ([experts, gate + up rows,
# hidden] input_linear, output_linear, router.layer; llama's rows, 96 wide), MoE Shared's shared_mlp
# too (two experts wide), in bf16: the GGUF's logits, and convert writes the stacks (and the shared
# expert) back
moeids="1 300 17 402 599 3 88 650 260 261 45 699 5 6 7 8"
for spec in llama:mixtral:0:f32 qwen3moe:qwen3_moe:0:f32 qwen2moe:qwen2_moe:0:f32 granitemoe:granitemoe:0:bf16 \
            granitemoe:granitemoeshared:2:bf16; do
    IFS=: read -r arch fam shared type <<< "$spec"
    "$bin" synth "$tmp/$fam.moe.gguf" --arch "$arch" --dim 64 --hidden 96 --layers 2 --heads 4 --kv-heads 2 --vocab 700 \
        --experts 4 --experts-used 2 --expert-ff 48 --experts-shared "$shared" --type "$type" --seed 8 > /dev/null
    if ! $export "$tmp/$fam.moe.gguf" "$tmp/$fam.moe" --family "$fam"; then fail "$fam: export"; continue; fi
    "$bin" convert "$tmp/$fam.moe" "$tmp/$fam.moe.back.gguf" 2>/dev/null
    for m in "$fam.moe" "$fam.moe.gguf" "$fam.moe.back.gguf"; do
        "$bin" logits -m "$tmp/$m" --ids "$moeids" --cache-type-k f32 --cache-type-v f32 > "$tmp/$m.txt" 2>/dev/null
    done
    e_dir=$("$py" -c "$maxdiff" "$tmp/$fam.moe.txt" "$tmp/$fam.moe.gguf.txt")
    width=$(case $arch in llama|granitemoe) echo 96 ;; *) echo 48 ;; esac)
    shexp=$("$bin" inspect "$tmp/$fam.moe.back.gguf" 2>&1 | grep -c "ffn_down_shexp.weight *$type *192 x 64")
    if "$py" -c "import sys; sys.exit(0 if $e_dir < 1e-4 else 1)" && cmp -s "$tmp/$fam.moe.back.gguf.txt" "$tmp/$fam.moe.gguf.txt" &&
       inspect_has "$tmp/$fam.moe.back.gguf" "blk.1.ffn_down_exps.weight *$type *$width x 64 x 4" &&
       { [ "$arch" != granitemoe ] || [ "$shexp" = "$shared" ]; }; then
        pass "$fam: $([ "$arch" = granitemoe ] && echo "stacked experts" || echo "one tensor per expert, stacked")$([ "$shared" = 0 ] || echo ' and the shared expert'): the GGUF's logits (max diff $e_dir); convert writes the stacks back"
    else fail "$fam: directory vs GGUF $e_dir, or convert lost the experts"; fi
done
# a GraniteMoe stack of the wrong shape is refused
refused "granitemoe, experts 80 wide in config.json and 96 stored" "$tmp/granitemoe.moe" "c['intermediate_size'] = 80" \
    "input_linear.weight: shape [4, 192, 64], expected [4, 160, 64]"
refused "qwen3_moe, norm_topk_prob false" "$tmp/qwen3_moe.moe" "c['norm_topk_prob'] = False" \
    "qwen3_moe with norm_topk_prob false is not supported"
# a bf16 shared-expert gate (Qwen2-MoE ships its 1 x hidden gate in bf16): read as f32 weights
rm -rf "$tmp/q2bf" && $export "$tmp/qwen2_moe.moe.gguf" "$tmp/q2bf" --family qwen2_moe --norm-dtype bf16 &&
    "$bin" logits -m "$tmp/q2bf" --ids "$moeids" --cache-type-k f32 --cache-type-v f32 > "$tmp/q2bf.txt" 2>/dev/null
e_bf=$("$py" -c "$maxdiff" "$tmp/q2bf.txt" "$tmp/qwen2_moe.moe.gguf.txt")
if "$py" -c "import sys; sys.exit(0 if 0 < $e_bf < 0.05 else 1)"; then pass "qwen2_moe: bf16 norms and shared-expert gate: within $e_bf of the f32 GGUF"
else fail "qwen2_moe with bf16 vectors: $e_bf from the GGUF"; fi

# ---- gemma2: every position's logits (20 ids, past the window) and convert's keys ---
ids="1 300 17 402 599 3 88 650 260 261 45 699 5 6 7 8 9 10 11 12"
la=$("$bin" logits -m "$tmp/gemma2" --ids "$ids" 2>/dev/null)
lb=$("$bin" logits -m "$tmp/gemma2.gguf" --ids "$ids" 2>/dev/null)
if [ "$(wc -l <<< "$la")" -eq 20 ] && [ "$la" = "$lb" ]; then pass "gemma2: logits at all 20 positions of the directory = the GGUF's"
else fail "gemma2: logits differ"; fi
"$bin" convert "$tmp/gemma2" "$tmp/gemma2.back.gguf" 2>/dev/null
keys=$("$bin" inspect "$tmp/gemma2.back.gguf" 2>&1)
if grep -q "gemma2.attention.sliding_window *= 8" <<< "$keys" && grep -q "gemma2.attn_logit_softcapping *= 50" <<< "$keys" &&
   grep -q "gemma2.final_logit_softcapping *= 30" <<< "$keys" && grep -q "blk.1.post_ffw_norm.weight" <<< "$keys"; then
    pass "convert gemma2 DIR: sliding_window, soft-caps and post norms in the GGUF"
else fail "convert gemma2 DIR: keys missing: $keys"; fi

# ---- gemma3_text (7 layers: layer 6 global, window 8, linear 8 on the global layer): every position's
# logits of 20 ids, and convert writes q/k norms and the linear scaling back (the same logits)
three_ways gemma3_text
if [ "$(wc -l <<< "$la")" -eq 20 ] && [ "$la" = "$lb" ] && [ "$lc" = "$lb" ] &&
   grep -q "blk.6.attn_q_norm.weight" <<< "$keys" && grep -q "gemma3.rope.scaling.factor *= 8" <<< "$keys"; then
    pass "gemma3_text: logits at all 20 positions of the directory and of its convert = the GGUF's; q/k norms, linear 8 kept"
else fail "gemma3_text: logits or keys differ"; fi
# Gemma 3 4B and larger ship as multimodal directories (model_type gemma3): the same model there, its
# tensors under language_model.model.* (Google's files) or model.language_model.* (newer Transformers),
# text_config listing only what differs from Gemma3TextConfig's defaults, a vision tower left unread
for names in google new; do
    if $export "$tmp/gemma3_text.gguf" "$tmp/g3mm-$names" --family gemma3 --lm-names "$names"; then
        lm=$("$bin" logits -m "$tmp/g3mm-$names" --ids "$ids" 2>&1)
        if [ "$lm" = "$lb" ]; then pass "gemma3 multimodal ($names names): the language model's logits = the GGUF's"
        else fail "gemma3 multimodal ($names names): $(head -c 300 <<< "$lm")"; fi
    else fail "gemma3 multimodal: export"; fi
done
refused "gemma3 multimodal without text_config" "$tmp/g3mm-google" "del c['text_config']" 'without a "text_config" object'
# Mistral Small 3.1 / 3.2 (mistral3): a mistral text model the same way (llama's rows: q.k summed in another
# order, so within 1e-4 of the GGUF; its convert gives the GGUF's logits exactly); a text model of another family refused
if $export "$tmp/llama.gguf" "$tmp/m3mm" --family mistral3; then
    "$bin" logits -m "$tmp/m3mm" --ids "$ids" > "$tmp/m3.dir.txt" 2>/dev/null
    "$bin" logits -m "$tmp/llama.gguf" --ids "$ids" > "$tmp/m3.gguf.txt" 2>/dev/null
    "$bin" convert "$tmp/m3mm" "$tmp/m3.back.gguf" 2>/dev/null
    "$bin" logits -m "$tmp/m3.back.gguf" --ids "$ids" > "$tmp/m3.back.txt" 2>/dev/null
    e_m3=$("$py" -c "$maxdiff" "$tmp/m3.dir.txt" "$tmp/m3.gguf.txt")
    if "$py" -c "import sys; sys.exit(0 if $e_m3 < 1e-4 else 1)" && cmp -s "$tmp/m3.back.txt" "$tmp/m3.gguf.txt"; then
        pass "mistral3 multimodal: the language model's logits = the GGUF's (max diff $e_m3), its convert's exactly"
    else fail "mistral3 multimodal: directory vs GGUF $e_m3, or its convert differs"; fi
    refused "mistral3 with a qwen2 text model" "$tmp/m3mm" "c['text_config']['model_type'] = 'qwen2'" \
        "mistral3's text_config.model_type \"qwen2\" is not read"
else fail "mistral3 multimodal: export"; fi
refused "gemma3_text, a layer_types of another pattern" "$tmp/gemma3_text" "c['layer_types'][0] = 'full_attention'" \
    'layer_types[0] is not "sliding_attention"'

# ---- OLMo 3 (olmo2 with windows: layer_types, three local layers to one global; YaRN 4 on the global
# layers only): the directory's logits at all 20 positions (window 8) = the GGUF's, convert writes the
# window, the pattern and YaRN back; a layer_types of no period is refused
"$bin" synth "$tmp/olmo3.gguf" --arch olmo2 --dim 64 --hidden 96 --layers 8 --heads 4 --kv-heads 2 --vocab 700 \
    --ctx 64 --sliding-window 8 --yarn 4 --type bf16 --seed 12 > /dev/null
if $export "$tmp/olmo3.gguf" "$tmp/olmo3" --family olmo3; then
    three_ways olmo3
    if [ "$(wc -l <<< "$la")" -eq 20 ] && [ "$la" = "$lb" ] && [ "$lc" = "$lb" ] &&
       grep -q "olmo2.attention.sliding_window *= 8" <<< "$keys" && grep -q "olmo2.attention.sliding_window_pattern" <<< "$keys" &&
       grep -q "olmo2.rope.scaling.factor *= 4" <<< "$keys"; then
        pass "olmo3: logits at all 20 positions of the directory and of its convert = the GGUF's; window, pattern, YaRN kept"
    else fail "olmo3: logits or keys differ"; fi
    refused "olmo3, a layer_types of no period" "$tmp/olmo3" "c['layer_types'][5] = 'full_attention'" \
        'layer_types[5] is not "sliding_attention"'
else fail "olmo3: export"; fi

# ---- convert --type q8_0: the same file contents as converting the GGUF ----------
"$bin" convert "$tmp/qwen2" "$tmp/a.gguf" --type q8_0 2>/dev/null
"$bin" convert "$tmp/qwen2.gguf" "$tmp/b.gguf" --type q8_0 2>/dev/null
la=$("$bin" logits -m "$tmp/a.gguf" --ids "1 300 17 402" 2>/dev/null | md5sum)
lb=$("$bin" logits -m "$tmp/b.gguf" --ids "1 300 17 402" 2>/dev/null | md5sum)
if [ "$la" = "$lb" ]; then pass "convert DIR --type q8_0: logits = converting the GGUF"; else fail "q8_0 conversions differ"; fi

# ---- inspect lists the safetensors ------------------------------------------------
out=$("$bin" inspect "$tmp/phi3" 2>&1)
if grep -q "model.layers.1.self_attn.qkv_proj.weight *f16 *64 x 128" <<< "$out"; then pass "inspect DIR lists the safetensors tensors"
else fail "inspect: $out"; fi

# ---- chat templates: the directory's own, rendered by Jinja (kvlm template -m) ---------
$export "$tmp/qwen2.gguf" "$tmp/t_odd" --template "{{ bos_token }}{% for m in messages %}### {{ m.role }}: {{ m.content }}{% endfor %}" > /dev/null
echo '{"messages": [{"role": "user", "content": "hi"}]}' > "$tmp/case.json"
out=$("$bin" template -m "$tmp/t_odd" "$tmp/case.json" 2>&1)
if [[ "$out" == *"### user: hi" ]]; then pass "tokenizer_config.json's template renders: $out"
else fail "tokenizer_config.json's template: '$out'"; fi

# the template in a file of its own, as newer Transformers save it: chat_template.jinja, or a
# processor's chat_template.json (Gemma 3's), read when tokenizer_config.json has none
for f in jinja json; do
    rm -rf "$tmp/t_$f" && cp -r "$tmp/t_odd" "$tmp/t_$f"
    "$py" -c "import json,sys; d=sys.argv[1]; c=json.load(open(d+'/tokenizer_config.json')); t=c.pop('chat_template')
json.dump(c, open(d+'/tokenizer_config.json', 'w'))
open(d+'/chat_template.'+sys.argv[2], 'w').write(t if sys.argv[2] == 'jinja' else json.dumps({'chat_template': t}))" "$tmp/t_$f" "$f"
    out=$("$bin" template -m "$tmp/t_$f" "$tmp/case.json" 2>&1)
    if [[ "$out" == *"### user: hi" ]]; then pass "a template in chat_template.$f is read and renders"
    else fail "chat_template.$f not read: '$out'"; fi
done

# ---- a missing shard --------------------------------------------------------------
$export "$tmp/qwen2.gguf" "$tmp/sh" --shards 2 > /dev/null
rm "$tmp/sh/model-00001-of-00002.safetensors"
if err=$("$bin" run -m "$tmp/sh" -p hi -n 1 2>&1); then fail "a directory missing a shard ran"
elif grep -q "model-00001-of-00002.safetensors" <<< "$err"; then pass "missing shard: $err"
else fail "missing shard error does not name it: $err"; fi

# ---- real vocabularies through tokenizer.json -----------------------------------------
for v in llama-spm gpt-2; do
    g="$models/vocab/ggml-vocab-$v.gguf"
    if [ ! -f "$g" ]; then echo "SKIP: $g not found"; continue; fi
    $export "$g" "$tmp/v-$v" --vocab-only > /dev/null
    if "$py" - "$bin" "$g.inp" "$tmp/v-$v" <<'PYEOF'
import subprocess, sys
kvlm, inp, model = sys.argv[1:4]
strings = open(inp, "rb").read().decode("utf-8").split("\n__ggml_vocab_test__\n")
if strings and strings[-1] == "":
    strings = strings[:-1]
expected = open(inp[:-4] + ".out", encoding="utf-8").read().split("\n")
bad = 0
for i, text in enumerate(strings):
    r = subprocess.run([kvlm, "tokenize", "-m", model, "--no-bos", "-f", "/dev/stdin"], input=text.encode(),
                       capture_output=True)
    if r.returncode or r.stdout.decode().strip() != expected[i].strip():
        bad += 1
        print("   string %d %r: got %r want %r %s" % (i, text, r.stdout.decode().strip(), expected[i].strip(),
                                                     r.stderr.decode().strip()))
print("   %d strings, %d differ" % (len(strings), bad))
sys.exit(1 if bad else 0)
PYEOF
    then pass "$v: tokenizer.json reproduces $(basename "$g").out"; else fail "$v: tokenizer.json tokenizes differently"; fi
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
