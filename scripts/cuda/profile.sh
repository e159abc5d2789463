#!/usr/bin/env bash
# Per-kernel time of decode steps on the GPU (Nsight Compute), from a bundle
# made by scripts/cuda/bundle.sh, for synthesized models of the TinyLlama and
# Llama-2-7B shapes: which kernels a step spends its time in, and at what
# DRAM rate each runs.
#   bash scripts/cuda/profile.sh BUNDLE_DIR [MODEL_TAG ...]   (tl_f16 tl_q8_0 tl_q4_k l7_f16 ...)
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
shift
here="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/kvlm-cuda-out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
NCU="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
S=/tmp/kvlm-bench
mkdir -p "$S"
TL="--dim 2048 --hidden 5632 --layers 22 --heads 32 --kv-heads 4 --vocab 32000 --ctx 4096"
L7="--dim 4096 --hidden 11008 --layers 8 --heads 32 --kv-heads 32 --vocab 32000 --ctx 4096"
tags="${*:-tl_f16 tl_q8_0 tl_q4_k}"
for tag in $tags; do
    shape=${tag%%_*} type=${tag#*_}
    [ "$shape" = tl ] && args=$TL || args=$L7
    [ -f "$S/$tag.gguf" ] || "$B/bin/kvlm" synth "$S/$tag.gguf" $args --type "$type" >/dev/null &
done
wait
for tag in $tags; do
    layers=22; [ "${tag%%_*}" = l7 ] && layers=8
    # the prefill pass and ~8 decode steps skipped, ~4 steps profiled
    per=$((layers * 16 + 8))
    KVLM_CUDA_GRAPHS=0 timeout 300 "$NCU" --clock-control none --cache-control none --print-units base \
        --launch-skip $((8 * per)) --launch-count $((5 * per)) \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --page raw \
        --log-file "$OUT/ncu_$tag.csv" \
        "$B/bin/kvlm" run -m "$S/$tag.gguf" -p "Once upon a time" -n 40 --temp 0 --device cuda >/dev/null 2>&1
    echo "== $tag: one decode step, kernel by kernel (ncu) =="
    python3 "$here/profile.py" "$OUT/ncu_$tag.csv"
done
