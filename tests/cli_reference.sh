#!/usr/bin/env bash
# cli_reference: cross-checks the `kvlm` command against the independent
# numpy reference (scripts/ref/llama_ref.py): greedy text on stories260K in
# both file formats, and next-token logits on stories260K and on random-weight
# GGUF models of many shapes written by `kvlm synth`.
#
# Env: KVLM_BIN (the kvlm binary), KVLM_MODELS or KVLM_MODELS_DEFAULT (models
# folder), KVLM_PYTHON (an interpreter with numpy; default /usr/bin/python3).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
ref="$root/scripts/ref/llama_ref.py"
py=${KVLM_PYTHON:-/usr/bin/python3}
bin=${KVLM_BIN:-$root/build/kvlm}
models=${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-$root/../shared/models}}

if [ ! -x "$bin" ]; then
    echo "FAIL: kvlm binary not found at '$bin' (set KVLM_BIN)"
    exit 1
fi
if ! "$py" -c 'import numpy' 2>/dev/null; then
    echo "SKIP: numpy not available to $py (apt-get install python3-numpy, or set KVLM_PYTHON)"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
pass() { passed=$((passed + 1)); echo "PASS: $*"; }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# ---- (a) greedy text: kvlm run --temp 0 == reference, byte for byte ---------
# check_text LABEL PROMPT MODEL [TOKENIZER]
check_text() {
    local label=$1 prompt=$2 model=$3 tok=${4:-}
    local kargs=() rargs=()
    if [ -n "$tok" ]; then kargs=(--tokenizer "$tok"); rargs=(--tokenizer "$tok"); fi
    # the reference computes in f32, its keys and values too (kvlm's default cache is f16)
    local cmd=("$bin" run -m "$model" "${kargs[@]}" -p "$prompt" -n 40 --temp 0 --cache-type-k f32 --cache-type-v f32)
    if ! "$py" "$ref" "$model" "${rargs[@]}" --prompt "$prompt" --n 40 > "$tmp/want.txt"; then
        fail "$label: reference failed on prompt '$prompt'"; return
    fi
    if ! "${cmd[@]}" > "$tmp/got.txt" 2>/dev/null; then
        fail "$label: kvlm run exited with an error on prompt '$prompt'"
        echo "    command: ${cmd[*]}"
        return
    fi
    if cmp -s "$tmp/want.txt" "$tmp/got.txt"; then
        pass "$label: text of prompt '$prompt' ($(wc -c < "$tmp/want.txt") bytes)"
    else
        fail "$label: text of prompt '$prompt' differs"
        echo "    command: ${cmd[*]}"
        echo "    want: $(cat -v "$tmp/want.txt")"
        echo "    got:  $(cat -v "$tmp/got.txt")"
    fi
}

# ---- (b) logits: kvlm logits == reference within a bound --------------------
# check_logits LABEL MODEL IDS BOUND [KVLM-LOGITS-ARGS...]  (REF_CTX=N: the reference
# takes the context N that the args give kvlm, which chooses LongRoPE's factors)
# Runs `kvlm logits` twice: one prefill of all ids, and --decode (one token at
# a time, reading keys and values back from the KV cache); compares both.
# The error of a row is max|kvlm - ref| / max(max|ref|, 1e-2) (see llama_ref.py
# --compare): float32 rounding of a dot product scales with the terms summed,
# so it is measured against the row's largest logit, not element by element
# (per element, a logit near zero would show a huge "relative" error).
# Bounds:
#  f32, f16 weights: 1e-4. The reference uses the very same stored values
#    (f16 widens exactly), so only float32 vs float64 arithmetic differs:
#    emulating float32 in numpy on these shapes gives 1e-7..2e-5, and %.6g
#    printing adds <= 5e-6; 1e-4 keeps headroom while a real mistake (RoPE
#    pairing, head mapping, bias, norm, layout) shows as O(0.1..1).
#  q8_0 weights: 6e-2. kvlm's integer kernels also round the activations to
#    8-bit blocks (by design, src/ops/ops.h), each rounding worth up to 1/254
#    of its block's largest value. Measured on 32 models of the q8_0 shape
#    below (llama and qwen2, 16 seeds each): 0.016..0.030; the bound is twice
#    the largest. Emulating that rounding in the reference (llama_ref.py
#    --act-q8) reproduces kvlm to 2e-6 on most models, but not on all: where a
#    float32 and a float64 value fall on two sides of a rounding edge, one
#    int8 flips and the flip cascades through later roundings (5e-3..2e-2),
#    so it cannot give a tighter bound that holds; the plain product of the
#    stored weights is the reference here.
check_logits() {
    local label=$1 model=$2 ids=$3 bound=$4
    shift 4
    local files=() mode line
    for mode in prefill decode; do
        local cmd=("$bin" logits -m "$model" --ids "$ids" --cache-type-k f32 --cache-type-v f32 "$@")
        [ "$mode" = decode ] && cmd+=(--decode)
        if ! "${cmd[@]}" > "$tmp/logits-$mode.txt" 2> "$tmp/logits.err"; then
            fail "$label ($mode): kvlm logits exited with an error: $(head -c 300 "$tmp/logits.err")"
            echo "    command: ${cmd[*]}"
        else
            files+=("$tmp/logits-$mode.txt")
        fi
    done
    [ ${#files[@]} -gt 0 ] || return 0
    # one reference run, one result line per file ("ok: ..." or "FAIL: ...")
    local seen=0
    while IFS= read -r line; do
        case $line in
            "$tmp"/logits-*) seen=$((seen + 1)) ;;
            *) echo "    reference: $line"; continue ;;
        esac
        mode=$(basename "${line%%:*}" .txt)
        mode=${mode#logits-}
        line=${line#*: }
        case $line in
            ok:*) pass "$label ($mode): logits ${line#ok: }" ;;
            *) fail "$label ($mode): logits ${line#FAIL: }"
               echo "    command: $bin logits -m $model --ids '$ids' $*$([ "$mode" = decode ] && echo ' --decode')" ;;
        esac
    done < <("$py" "$ref" "$model" --ids "$ids" ${REF_CTX:+--ctx "$REF_CTX"} ${REF_ACT_Q8:+--act-q8} --compare "${files[@]}" --tol "$bound" 2>&1 || true)
    if [ "$seen" -ne ${#files[@]} ]; then
        fail "$label: the reference gave $seen results for ${#files[@]} files (see its errors above)"
    fi
}

ids_a="1 403 407 261 378 432 317 336 313 415 417 436 426 13 29 261 2 5 100 200"
ids_b="1 72 101 108 108 111 32 119 111 114 108 100 3 4 255 128 64 32 16 8 1 9"

gguf="$models/stories260K.gguf"
cbin="$models/stories260K.bin"
tok="$models/tok512.bin"
if [ -f "$gguf" ] && [ -f "$cbin" ] && [ -f "$tok" ]; then
    for prompt in "Once upon a time" "The little dog" "Lily and Ben went to the park" \
                  'Tom said, "Look! A big fish?" and ran.'; do
        check_text "stories260K.gguf" "$prompt" "$gguf"
        check_text "stories260K.bin" "$prompt" "$cbin" "$tok"
    done
    check_logits "stories260K.gguf" "$gguf" "$ids_a" 1e-4
    check_logits "stories260K.gguf" "$gguf" "$ids_b" 1e-4
    check_logits "stories260K.bin" "$cbin" "$ids_b" 1e-4 --tokenizer "$tok"
else
    echo "SKIP: stories260K.gguf / stories260K.bin / tok512.bin not all in $models (set KVLM_MODELS)"
fi

# ---- random-weight models of many shapes --------------------------------------
# synth_check LABEL BOUND SYNTH-ARGS...
synth_check() {
    local label=$1 bound=$2
    shift 2
    local model="$tmp/$label.gguf"
    if ! "$bin" synth "$model" "$@" > "$tmp/synth.log" 2>&1; then
        fail "$label: kvlm synth $* failed: $(head -c 300 "$tmp/synth.log")"
        return
    fi
    check_logits "$label" "$model" "$ids_b" "$bound"
}
common=(--layers 2 --vocab 384 --ctx 64)
# Greedy text on random weights too: another vocabulary (letters, byte
# fallback) and the qwen2 and phi3 paths. Random logits have gaps far above float error.
for arch in llama smollm3 granite olmo2 qwen2 qwen3 qwen3moe phi3 gpt-oss; do
    model="$tmp/text-$arch.gguf"
    if "$bin" synth "$model" --arch "$arch" --dim 128 --heads 8 --kv-heads 2 --hidden 256 \
            --type f32 --seed 5 "${common[@]}" > "$tmp/synth.log" 2>&1; then
        check_text "synth-$arch" "the cat sat on the mat" "$model"
    else
        fail "synth-$arch: kvlm synth failed: $(head -c 300 "$tmp/synth.log")"
    fi
done

#           label                  bound  shape
synth_check mha-hd8-f32            1e-4 --arch llama --dim 64  --heads 8 --kv-heads 8 --hidden 160 --type f32 --seed 1 "${common[@]}"
synth_check gqa82-hd16-f32         1e-4 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 2 "${common[@]}"
synth_check mqa81-hd32-f32         1e-4 --arch llama --dim 256 --heads 8 --kv-heads 1 --hidden 512 --type f32 --seed 3 "${common[@]}"
synth_check mha-hd64-f32           1e-4 --arch llama --dim 256 --heads 4 --kv-heads 4 --hidden 384 --type f32 --seed 4 "${common[@]}"
synth_check qwen2-gqa82-hd16-f32   1e-4 --arch qwen2 --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 5 "${common[@]}"
synth_check qwen2-gqa42-hd64-f32   1e-4 --arch qwen2 --dim 256 --heads 4 --kv-heads 2 --hidden 512 --type f32 --seed 6 "${common[@]}"
synth_check hd32x4-tied-base5e5    1e-4 --arch llama --dim 64  --heads 4 --kv-heads 2 --head-dim 32 --hidden 160 --tied --rope-base 500000 --type f32 --seed 10 --layers 3 --vocab 300 --ctx 64
synth_check qwen2-63-tied-f16      1e-4 --arch qwen2 --dim 96  --heads 6 --kv-heads 3 --hidden 160 --tied --type f16 --seed 11 --layers 3 --vocab 300 --ctx 64
# Llama 3.1's RoPE scaling (rope_freqs.weight, factor 4 from an original
# context of 16): the slow pairs' angles divided, as the reference reads the tensor
synth_check llama3-rope-gqa82-f32  1e-4 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 31 --rope-llama3 4 "${common[@]}"
# linear RoPE scaling (rope.scaling.type linear, factor 4): every angle divided
synth_check linear4-gqa82-f32      1e-4 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 32 --rope-linear 4 "${common[@]}"
# YaRN on llama and qwen2 (Qwen2.5's 128k kind; factor 4 from an original context of 16): ramped
# angles and the rotation's magnitude 1 + 0.1 ln 4, which kvlm takes into the attention scale
synth_check yarn4-gqa82-f32        1e-4 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 33 --yarn 4 "${common[@]}"
synth_check qwen2-yarn4-gqa42-f32  1e-4 --arch qwen2 --dim 256 --heads 4 --kv-heads 2 --hidden 512 --type f32 --seed 34 --yarn 4 "${common[@]}"
synth_check gqa82-hd16-f16         1e-4 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f16 --seed 7 "${common[@]}"
synth_check gqa82-hd16-q8_0        6e-2 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type q8_0 --seed 8 "${common[@]}"
synth_check qwen2-gqa82-hd16-q8_0  6e-2 --arch qwen2 --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type q8_0 --seed 9 "${common[@]}"
# qwen3: no biases, an RMSNorm over each head of q and k before RoPE, a head
# dimension of its own (64 here, with dim 128 and 4 heads: q is 256 wide, as
# Qwen3-0.6B's 16 x 128 is to its 1024), tied embeddings, YaRN
synth_check qwen3-gqa42-hd64-f32   1e-4 --arch qwen3 --dim 128 --heads 4 --kv-heads 2 --head-dim 64 --hidden 256 --type f32 --seed 17 "${common[@]}"
synth_check qwen3-mqa81-hd16-tied  1e-4 --arch qwen3 --dim 128 --heads 8 --kv-heads 1 --hidden 256 --tied --type f16 --seed 18 --layers 3 --vocab 300 --ctx 64
synth_check qwen3-gqa42-hd64-q8_0  6e-2 --arch qwen3 --dim 128 --heads 4 --kv-heads 2 --head-dim 64 --hidden 256 --type q8_0 --seed 19 "${common[@]}"
synth_check qwen3-yarn4-gqa42-f32  1e-4 --arch qwen3 --dim 128 --heads 4 --kv-heads 2 --head-dim 64 --hidden 256 --type f32 --seed 20 --yarn 4 "${common[@]}"
# smollm3: llama's layout with no RoPE in every fourth layer (5 layers: the
# fourth is NoPE), and tied f16
synth_check smollm3-gqa82-l5-f32   1e-4 --arch smollm3 --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 70 --layers 5 --vocab 384 --ctx 64
synth_check smollm3-gqa42-tied-f16 1e-4 --arch smollm3 --dim 128 --heads 4 --kv-heads 2 --hidden 256 --tied --type f16 --seed 71 --layers 4 --vocab 300 --ctx 64
# with YaRN (SmolLM3's long context): its magnitude only where q and k turn
synth_check smollm3-yarn4-l4-f32   1e-4 --arch smollm3 --dim 128 --heads 8 --kv-heads 2 --hidden 256 --type f32 --seed 72 --layers 4 --vocab 384 --ctx 64 --yarn 4
# granite: llama's layout, embeddings x12, each branch x0.22 before the
# residual, q.k x 1/head_dim, logits / 8 (Granite 3's kind: synth's defaults)
synth_check granite-gqa42-f32      1e-4 --arch granite --dim 128 --heads 4 --kv-heads 2 --hidden 256 --type f32 --seed 80 "${common[@]}"
synth_check granite-mqa81-tied-f16 1e-4 --arch granite --dim 128 --heads 8 --kv-heads 1 --hidden 256 --tied --type f16 --seed 81 --layers 3 --vocab 300 --ctx 64
# olmo2: no norm before attention or FFN, one after each, q and k normed
# across all their heads before RoPE (NeoX)
synth_check olmo2-gqa42-f32        1e-4 --arch olmo2 --dim 128 --heads 4 --kv-heads 2 --hidden 256 --type f32 --seed 90 "${common[@]}"
synth_check olmo2-mha-hd16-f16     1e-4 --arch olmo2 --dim 128 --heads 8 --kv-heads 8 --hidden 192 --type f16 --seed 91 --layers 3 --vocab 300 --ctx 64
# OLMo 3 (olmo2 with a window): three local layers to one global, window 4 over the 22 ids; with
# YaRN (factor 4 from 16) on the global layers only, the local ones plain (llama.cpp's converter writes
# the pattern as a bool per layer, which synth does too)
synth_check olmo3-l8-w4-f32        1e-4 --arch olmo2 --dim 128 --heads 4 --kv-heads 2 --hidden 192 --sliding-window 4 --type f32 --seed 92 --layers 8 --vocab 384 --ctx 64
synth_check olmo3-yarn4-w4-f16     1e-4 --arch olmo2 --dim 128 --heads 8 --kv-heads 2 --hidden 128 --sliding-window 4 --yarn 4 --type f16 --seed 93 --layers 4 --vocab 300 --ctx 64
# a mixture of experts in every layer: Mixtral's (llama with expert_count,
# each expert the FFN's width) and qwen3moe (qwen3's attention, experts of
# their own width); a softmax over every expert, the top k, renormalised
synth_check mixtral-4x2-gqa42-f32  1e-4 --arch llama --dim 128 --heads 4 --kv-heads 2 --hidden 192 --experts 4 --experts-used 2 --type f32 --seed 60 "${common[@]}"
synth_check mixtral-8x2-f16        1e-4 --arch llama --dim 128 --heads 8 --kv-heads 2 --hidden 128 --experts 8 --experts-used 2 --type f16 --seed 62 --layers 3 --vocab 300 --ctx 64
synth_check qwen3moe-8x3-hd64-f32  1e-4 --arch qwen3moe --dim 128 --heads 4 --kv-heads 2 --head-dim 64 --hidden 256 --experts 8 --experts-used 3 --expert-ff 96 --type f32 --seed 61 "${common[@]}"
synth_check qwen3moe-16x4-tied-f16 1e-4 --arch qwen3moe --dim 128 --heads 4 --kv-heads 1 --hidden 256 --experts 16 --experts-used 4 --expert-ff 64 --tied --type f16 --seed 63 "${common[@]}"
# qwen2moe: qwen2's attention (biases), the top experts' probabilities not
# renormalised, and a shared expert scaled by sigmoid(x . w)
synth_check qwen2moe-8x2-f32       1e-4 --arch qwen2moe --dim 128 --heads 4 --kv-heads 2 --hidden 192 --experts 8 --experts-used 2 --expert-ff 64 --type f32 --seed 95 "${common[@]}"
synth_check qwen2moe-4x2-tied-f16  1e-4 --arch qwen2moe --dim 128 --heads 8 --kv-heads 8 --hidden 128 --experts 4 --experts-used 2 --expert-ff 32 --tied --type f16 --seed 96 --layers 3 --vocab 300 --ctx 64
# granitemoe: granite's four multipliers (the experts' sum scaled as a branch)
# around Mixtral's experts, and Granite MoE Shared's shared expert (two
# experts wide here), added ungated
synth_check granitemoe-4x2-gqa42-f32     1e-4 --arch granitemoe --dim 128 --heads 4 --kv-heads 2 --hidden 96 --experts 4 --experts-used 2 --type f32 --seed 97 "${common[@]}"
synth_check granitemoe-8x2-shared-f16    1e-4 --arch granitemoe --dim 128 --heads 8 --kv-heads 2 --hidden 64 --experts 8 --experts-used 2 --experts-shared 2 --tied --type f16 --seed 98 --layers 3 --vocab 300 --ctx 64
# gpt-oss: biases on q, k, v and the output, a sink logit per head, even
# layers local (window 8 over the 22 ids), a biased router (softmax over the
# top k) and biased experts with the clamped SwiGLU (synth's gate and up
# biases reach past the clamps at 7); with YaRN (factor 4) on every layer;
# MXFP4 experts (and attention) as gpt-oss's files hold them. The clamped
# SwiGLU's (up + 1), up to 8, amplifies the 8-bit activations' rounding past
# the q8_0 bound (0.19 of the largest logit against the plain reference), so
# the reference rounds them as kvlm does (--act-q8: 2e-6 here; the bound
# leaves room for a flipped int8's cascade, see above)
synth_check gpt-oss-8x2-w8-f32     1e-4 --arch gpt-oss --dim 128 --heads 8 --kv-heads 2 --hidden 192 --experts 8 --experts-used 2 --expert-ff 96 --sliding-window 8 --type f32 --seed 99 --layers 4 --vocab 384 --ctx 64
synth_check gpt-oss-4x2-hd64-yarn4-f16 1e-4 --arch gpt-oss --dim 128 --heads 4 --kv-heads 1 --head-dim 64 --hidden 128 --experts 4 --experts-used 2 --expert-ff 64 --sliding-window 8 --yarn 4 --type f16 --seed 100 --layers 3 --vocab 300 --ctx 64
REF_ACT_Q8=1 synth_check gpt-oss-8x4-mxfp4 3e-2 --arch gpt-oss --dim 128 --heads 8 --kv-heads 2 --hidden 128 --experts 8 --experts-used 4 --expert-ff 64 --sliding-window 8 --type mxfp4 --seed 101 --layers 2 --vocab 384 --ctx 64
# convert writes the experts back (3-D, stacked) and their keys: the same logits
for name in mixtral-4x2-gqa42-f32 qwen3moe-8x3-hd64-f32 qwen2moe-8x2-f32 granitemoe-8x2-shared-f16 gpt-oss-8x2-w8-f32; do
    model="$tmp/$name.gguf"
    [ -f "$model" ] || continue
    if "$bin" convert "$model" "$tmp/back.gguf" > /dev/null 2>&1 &&
       "$bin" logits -m "$model" --ids "$ids_b" > "$tmp/a.txt" 2>/dev/null &&
       "$bin" logits -m "$tmp/back.gguf" --ids "$ids_b" > "$tmp/b.txt" 2>/dev/null && cmp -s "$tmp/a.txt" "$tmp/b.txt"; then
        pass "$name: convert keeps the experts (the same logits)"
    else fail "$name: convert lost the experts or their keys"; fi
done
# phi3: fused attn_qkv and gate+up ffn_up (kvlm splits them into row views at
# load; the reference multiplies by the fused matrices and splits the outputs)
synth_check phi3-gqa42-hd32-f32    1e-4 --arch phi3  --dim 128 --heads 4 --kv-heads 2 --hidden 256 --type f32 --seed 12 "${common[@]}"
synth_check phi3-gqa82-hd16-f16    1e-4 --arch phi3  --dim 128 --heads 8 --kv-heads 2 --hidden 192 --type f16 --seed 13 --tied --layers 3 --vocab 300 --ctx 64
synth_check phi3-gqa42-hd32-q8_0   6e-2 --arch phi3  --dim 128 --heads 4 --kv-heads 2 --hidden 256 --type q8_0 --seed 14 "${common[@]}"
# LongRoPE (the 128k Phi-3 and Phi-3.5; factor 2 from an original context of
# 32): the long factors in a context of 64 (the trained one), the short ones in
# a context of 32, and the attention factor on q and k in both (the 22 ids
# reach past position 16, where the sets part; the reference reads the tensors)
model="$tmp/phi3-longrope2.gguf"
if "$bin" synth "$model" --arch phi3 --dim 128 --heads 4 --kv-heads 2 --hidden 256 --type f32 --seed 15 \
        --longrope 2 "${common[@]}" > "$tmp/synth.log" 2>&1; then
    check_logits phi3-longrope2-long "$model" "$ids_b" 1e-4
    REF_CTX=32 check_logits phi3-longrope2-short "$model" "$ids_b" 1e-4 --ctx 32
else
    fail "phi3-longrope2: kvlm synth failed: $(head -c 300 "$tmp/synth.log")"
fi
# Phi-4-mini's kind: LongRoPE on a partial rotation (48 of a head's 64
# dimensions turn); the magnitude scales the turned dimensions only
model="$tmp/phi3-longrope2-rd48.gguf"
if "$bin" synth "$model" --arch phi3 --dim 128 --heads 2 --kv-heads 1 --hidden 256 --type f32 --seed 16 \
        --longrope 2 --rope-dim 48 "${common[@]}" > "$tmp/synth.log" 2>&1; then
    check_logits phi3-longrope2-rd48-long "$model" "$ids_b" 1e-4
    REF_CTX=32 check_logits phi3-longrope2-rd48-short "$model" "$ids_b" 1e-4 --ctx 32
else
    fail "phi3-longrope2-rd48: kvlm synth failed: $(head -c 300 "$tmp/synth.log")"
fi

# phi3 as `kvlm plan` and `inspect` show it: the architecture, the fused
# tensors, and the KV cache per token (2 layers x 2 KV heads x 32 head dim x
# (2 + 2) bytes of the default f16 cache = 512 bytes, the same as a llama of
# that shape: fusing changes the weights' layout, not the cache)
model="$tmp/phi3-gqa42-hd32-f32.gguf"
if [ -f "$model" ]; then
    plan=$("$bin" plan -m "$model" 2>&1 || true)
    if grep -q "^  phi3: 2 layers, dim 128, 4 heads (2 KV heads, head dim 32)" <<< "$plan" &&
       grep -q "^KV per token: *512 bytes" <<< "$plan"; then
        pass "phi3: kvlm plan shows the architecture and 512 bytes of KV per token"
    else
        fail "phi3: kvlm plan output unexpected:"; echo "$plan" | head -5 | sed 's/^/    /'
    fi
    insp=$("$bin" inspect "$model" 2>&1 || true)
    if grep -q 'general.architecture *= "phi3"' <<< "$insp" &&
       grep -q "blk.0.attn_qkv.weight *f32 *128 x 256 " <<< "$insp" &&
       grep -q "blk.0.ffn_up.weight *f32 *128 x 512 " <<< "$insp" &&
       ! grep -q "attn_q.weight\|ffn_gate.weight" <<< "$insp"; then
        pass "phi3: kvlm inspect shows the architecture and the fused tensors"
    else
        fail "phi3: kvlm inspect output unexpected"; echo "$insp" | grep "arch\|blk.0" | sed 's/^/    /'
    fi
fi

# deepseek2 (docs/mla.md): kvlm attends in the latent space (queries and
# outputs absorbed through attn_kv_b, one latent row per token cached); the
# reference decompresses keys and values per head and attends naively. Dense
# first layer, then experts (softmax top-2 of 4 + 1 shared; sigmoid with a
# selection bias); q_lora on and off; f32 and q8_0 weights.
ds=(--arch deepseek2 --dim 128 --heads 4 --head-dim 48 --kv-lora 64 --rope-dim 16 --hidden 256 --layers 3 --vocab 384 --ctx 64)
synth_check deepseek2-f32            1e-4 "${ds[@]}" --type f32 --seed 21
synth_check deepseek2-qlora-f32      1e-4 "${ds[@]}" --q-lora 96 --type f32 --seed 22
synth_check deepseek2-sigmoid-f32    1e-4 "${ds[@]}" --q-lora 64 --experts 6 --experts-used 3 --experts-shared 2 --gating sigmoid --type f32 --seed 23
synth_check deepseek2-f16            1e-4 "${ds[@]}" --type f16 --seed 24
synth_check deepseek2-qlora-q8_0     6e-2 "${ds[@]}" --q-lora 96 --type q8_0 --seed 25
synth_check deepseek2-q8_0           6e-2 "${ds[@]}" --type q8_0 --seed 26
# YaRN (DeepSeek-V2's RoPE scaling): factor 40 from an original context of
# 4096 / 40 = 102 tokens, log multiplier 0.0707 (attention scale x 1.59)
synth_check deepseek2-yarn-f32       1e-4 "${ds[@]}" --ctx 4096 --yarn 40 --q-lora 96 --type f32 --seed 27
# kvlm plan: the latent cache per token (3 layers x (64 + 16) x 2 bytes of
# the default f16 = 480 bytes) next to MHA of the same model (3 layers x 4
# heads x (48 + 32) x 2 = 1920 bytes)
model="$tmp/deepseek2-f32.gguf"
if [ -f "$model" ]; then
    plan=$("$bin" plan -m "$model" 2>&1 || true)
    if grep -q "^KV per token: *480 bytes  (MLA: 3 layers x (64 latent + 16 RoPE)" <<< "$plan" &&
       grep -q "^MHA of this model: *1920 bytes per token .*: 4.0x the MLA cache" <<< "$plan"; then
        pass "deepseek2: kvlm plan shows 480 bytes of latent cache per token against 1920 for MHA"
    else
        fail "deepseek2: kvlm plan output unexpected:"; echo "$plan" | head -6 | sed 's/^/    /'
    fi
fi

# ---- sliding-window attention and gemma (scripts/ref/swa_ref.py) --------------
# gemma2 (local layers 0, 2: window 8; soft-caps small enough to bite), gemma3
# (five local layers with RoPE base 10000, one global with 1e6; q/k norms) and
# a llama with every layer local (Mistral-style), over 64 tokens: eight
# windows, so keys leave the window many times, in prefill and in decode.
ids_w=$(seq 3 7 450 | head -64 | tr '\n' ' ')
ref_llama=$ref
ref="$root/scripts/ref/swa_ref.py"
ids_b_saved=$ids_b
ids_b=$ids_w
swa=(--dim 64 --heads 4 --kv-heads 2 --hidden 128 --vocab 460 --ctx 128 --sliding-window 8)
synth_check gemma2-w8-f32          1e-4 --arch gemma2 --layers 4 --attn-softcap 2 --final-softcap 3 --tied --type f32 --seed 21 "${swa[@]}"
synth_check gemma2-w8-f16          1e-4 --arch gemma2 --layers 3 --tied --type f16 --seed 22 "${swa[@]}"
synth_check gemma3-w8-f32          1e-4 --arch gemma3 --layers 6 --rope-base 1000000 --tied --type f32 --seed 23 "${swa[@]}"
# Gemma 3 4B and larger: linear scaling (factor 8) on the global layers only
synth_check gemma3-w8-linear8-f32  1e-4 --arch gemma3 --layers 6 --rope-base 1000000 --rope-linear 8 --tied --type f32 --seed 23 "${swa[@]}"
synth_check mistral-w8-f32         1e-4 --arch llama  --layers 2 --type f32 --seed 24 "${swa[@]}"
ids_b=$ids_b_saved
# the window matters: the reference without it disagrees with kvlm
model="$tmp/mistral-w8-f32.gguf"
if [ -f "$model" ]; then
    "$bin" logits -m "$model" --ids "$ids_w" --cache-type-k f32 --cache-type-v f32 > "$tmp/w.txt" 2>/dev/null || true
    if ! "$py" "$ref" "$model" --ids "$ids_w" --no-window --compare "$tmp/w.txt" --tol 1e-4 > /dev/null 2>&1; then
        pass "mistral-w8: the reference without the window disagrees (the mask is exercised)"
    else
        fail "mistral-w8: the reference without the window agrees too"
    fi
fi
ref=$ref_llama
model="$tmp/gemma3-w8-f32.gguf"
if [ -f "$model" ]; then
    # steps of one token (-ub 1): the pool's cap is the window in blocks plus the one filling
    plan=$("$bin" plan -m "$model" --ctx 128 --block-size 4 -ub 1 2>&1 || true)
    if grep -q "^  gemma3: 6 layers" <<< "$plan" &&
       grep -q "^sliding window: *8 tokens on 5 of 6 layers: their cache holds at most 12 tokens" <<< "$plan" &&
       grep -q "^  KV per token: *128 bytes global + 640 bytes local" <<< "$plan"; then
        pass "gemma3: kvlm plan shows the window, the local layers' cap and both parts of the cache per token"
    else
        fail "gemma3: kvlm plan output unexpected:"; echo "$plan" | head -9 | sed 's/^/    /'
    fi
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
