#!/usr/bin/env bash
# bench/bench_spec_copy.sh: speculative decoding on the editing task with
# models that copy their context (bench/copy_model.py: random-weight models
# of real shapes with an induction circuit set into their first two layers),
# Q8_0 targets; drafts: prompt lookup, a q4_0 copy of the target, and a
# 2-layer copy model of the same width in q4_0. Models are made once into
# $KVLM_BENCH_DIR (default /tmp/kvlm-bench; the TinyLlama shape needs ~6 GB there).
# usage: bench/bench_spec_copy.sh [build dir] [threads (default 2)] [shapes: 42m,110m,tinyllama]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
threads=${2:-2}
shapes=${3:-42m,110m,tinyllama}
dir=${KVLM_BENCH_DIR:-/tmp/kvlm-bench}
mkdir -p "$dir"
for b in kvlm bench_spec; do
  [ -x "$build/$b" ] || { echo "$build/$b missing: cmake --build $build --target $b" >&2; exit 1; }
done
export KVLM_MODELS=${KVLM_MODELS:-$here/../shared/models} KVLM_CORPORA=${KVLM_CORPORA:-$here/../shared/corpora}

# make NAME TYPE SYNTH-ARGS...: a copy model NAME-copy-TYPE.gguf
make() {
  local name=$1 type=$2 out="$dir/$1-copy-$2.gguf"
  shift 2
  [ -s "$out" ] && { echo "$out"; return; }
  "$build/kvlm" synth "$dir/$name-f32.gguf" --vocab 32000 --ctx 4096 "$@" >&2
  /usr/bin/python3 "$here/bench/copy_model.py" "$dir/$name-f32.gguf" "$dir/$name-copy-f32.gguf" >&2
  "$build/kvlm" convert "$dir/$name-copy-f32.gguf" "$out" --type "$type" >&2
  rm -f "$dir/$name-f32.gguf" "$dir/$name-copy-f32.gguf"
  echo "$out"
}

args=()
IFS=, read -ra list <<<"$shapes"
for s in "${list[@]}"; do
  case $s in
  42m) args+=(--copy "$(make stories42M q8_0 --dim 512 --hidden 1376 --layers 8 --heads 8)"
              --draft "$(make stories42M-2l q4_0 --dim 512 --hidden 1376 --layers 2 --heads 8)") ;;
  110m) args+=(--copy "$(make stories110M q8_0 --dim 768 --hidden 2048 --layers 12 --heads 12)"
               --draft "$(make stories110M-2l q4_0 --dim 768 --hidden 2048 --layers 2 --heads 12)") ;;
  tinyllama) args+=(--copy "$(make tinyllama q8_0 --dim 2048 --hidden 5632 --layers 22 --heads 32 --kv-heads 4)"
                    --draft "$(make tinyllama-2l q4_0 --dim 2048 --hidden 5632 --layers 2 --heads 32 --kv-heads 4)") ;;
  *) echo "unknown shape $s (42m, 110m, tinyllama)" >&2; exit 1 ;;
  esac
done
exec "$build/bench_spec" "$threads" "${args[@]}"
