#!/usr/bin/env bash
# The CUDA backend's checks on a machine with an NVIDIA GPU, from a bundle
# built elsewhere (scripts/cuda_bundle.sh makes it: binaries, the libraries
# they need, the shared models and corpora), so the GPU machine needs no
# packages: the tests (test_cuda), the same under compute-sanitizer, the
# server with 32 concurrent greedy requests, and the benchmarks.
#   bash scripts/cuda_check.sh BUNDLE_DIR [test] [sanitize] [serve] [bench] [bench7b]
# Logs go to $OUT (or /tmp/kvlm-cuda-out).
set -uo pipefail
B="$(cd "${1:?bundle dir}" && pwd)"
shift
OUT="${OUT:-/tmp/kvlm-cuda-out}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export KVLM_MODELS="$B/models" KVLM_CORPORA="$B/corpora"
stages="${*:-test sanitize serve bench}"
has() { [[ " $stages " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
missing="$(ldd "$B"/bin/* 2>/dev/null | grep 'not found' | sort -u)"
[ -n "$missing" ] && echo "missing libraries: $missing"

S=/tmp/kvlm-bench
mkdir -p "$S"
TL="--dim 2048 --hidden 5632 --layers 22 --heads 32 --kv-heads 4 --vocab 32000 --ctx 4096"
L7="--dim 4096 --hidden 11008 --layers 8 --heads 32 --kv-heads 32 --vocab 32000 --ctx 4096"
synth_pid=
if has bench || has bench7b; then
    (
        for t in f16 q8_0 q4_k; do
            [ -f "$S/tl_$t.gguf" ] || "$B/bin/kvlm" synth "$S/tl_$t.gguf" $TL --type $t >/dev/null &
            if has bench7b; then [ -f "$S/l7_$t.gguf" ] || "$B/bin/kvlm" synth "$S/l7_$t.gguf" $L7 --type $t >/dev/null & fi
        done
        wait
    ) &
    synth_pid=$!
fi

if has test; then
    echo "== test_cuda =="
    timeout 300 "$B/bin/test_cuda" 2>&1 | tee "$OUT/test_cuda.log"
    echo "test_cuda exit: ${PIPESTATUS[0]}"
    echo "== kvlm run --device cuda (greedy, stories260K) =="
    timeout 60 "$B/bin/kvlm" run -m "$B/models/stories260K.gguf" -p "Once upon a time" -n 60 --temp 0 --device cuda 2>&1 | tail -4
    timeout 60 "$B/bin/kvlm" perplexity -m "$B/models/stories4M_hd64.gguf" -f "$B/corpora/tinystories-valid-head.txt" -c 256 --chunks 20 --device cuda 2>&1 | tail -2
    timeout 120 "$B/bin/kvlm" perplexity -m "$B/models/stories4M_hd64.gguf" -f "$B/corpora/tinystories-valid-head.txt" -c 256 --chunks 20 2>&1 | tail -2
fi

if has sanitize; then
    echo "== compute-sanitizer (memcheck, quick tests) =="
    CS="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
    KVLM_TEST_QUICK=1 timeout 400 "$CS" --tool memcheck --leak-check full --error-exitcode 9 "$B/bin/test_cuda" \
        >"$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer exit: $?"
    grep -E "ERROR SUMMARY|LEAK SUMMARY|PASSED|FAILED|SKIP" "$OUT/sanitizer.log" | tail -6
fi

if has serve; then
    echo "== kvlm serve --device cuda: 32 concurrent greedy requests equal each alone =="
    python3 "$B/serve_check.py" "$B/bin/kvlm" "$B/models/stories4M_hd64.gguf" 2>&1 | tail -8
fi

if has bench || has bench7b; then
    echo "== bench_cuda attn =="
    timeout 120 "$B/bin/bench_cuda" attn 2>&1 | tee "$OUT/bench_attn.log"
    [ -n "$synth_pid" ] && wait "$synth_pid"
    for t in f16 q8_0 q4_k; do
        echo "== bench_cuda model TinyLlama-1.1B shape, $t =="
        timeout 150 "$B/bin/bench_cuda" model "$S/tl_$t.gguf" --ctx 1024 2>&1 | tee -a "$OUT/bench_model.log"
    done
    if has bench7b; then
        for t in f16 q8_0 q4_k; do
            echo "== bench_cuda model Llama-2-7B shape (8 of its 32 layers), $t =="
            timeout 150 "$B/bin/bench_cuda" model "$S/l7_$t.gguf" --ctx 768 --batches 1,16,64 2>&1 | tee -a "$OUT/bench_model.log"
        done
    fi
fi
