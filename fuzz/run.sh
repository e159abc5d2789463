#!/usr/bin/env bash
# fuzz/run.sh [SECONDS]: builds the libFuzzer harnesses (build-fuzz, clang,
# -DKVLM_FUZZ=ON) and runs each for SECONDS (default 10) over a copy of its
# seed corpus and regression inputs; prints executions and coverage per
# harness; exits non-zero on a crash (the input is kept, its path printed).
# Env: FUZZ_ONLY="gguf tok" runs some harnesses; KVLM_FUZZ_BUILD the build
# folder; FUZZ_JOBS parallel compile jobs (2); FUZZ_KEEP=DIR keeps the grown
# corpora and logs there.
set -euo pipefail
secs=${1:-10}
src=$(cd "$(dirname "$0")/.." && pwd)
bdir=${KVLM_FUZZ_BUILD:-$src/build-fuzz}
if ! command -v clang >/dev/null; then
  echo "fuzz/run.sh: clang not found (Debian: apt-get install clang)" >&2
  exit 77
fi
names=()
if [ -n "${FUZZ_ONLY:-}" ]; then
  read -r -a names <<<"$FUZZ_ONLY"
else
  for f in "$src"/fuzz/fuzz_*.c; do n=$(basename "$f" .c); names+=("${n#fuzz_}"); done
fi
t0=$(date +%s)
mkdir -p "$bdir"
if [ ! -f "$bdir/CMakeCache.txt" ]; then
  CC=clang cmake -S "$src" -B "$bdir" -DCMAKE_BUILD_TYPE=None -DCMAKE_C_FLAGS=-O1 -DKVLM_FUZZ=ON -DKVLM_TESTS=OFF -DKVLM_REDIS=OFF \
    -DKVLM_CUDA=OFF >"$bdir/configure.log" 2>&1 || { cat "$bdir/configure.log"; exit 1; }
fi
targets=()
for n in "${names[@]}"; do targets+=("fuzz_$n"); done
cmake --build "$bdir" -j"${FUZZ_JOBS:-2}" --target "${targets[@]}" >"$bdir/build.log" 2>&1 ||
  { tail -40 "$bdir/build.log"; echo "fuzz/run.sh: build failed" >&2; exit 1; }
t1=$(date +%s)
echo "fuzz/run.sh: built ${#names[@]} harnesses in $((t1 - t0)) s; $secs s each"
work=${FUZZ_KEEP:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${FUZZ_KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
export KVLM_MODELS=${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-$src/../shared/models}}
fail=0
for n in "${names[@]}"; do
  mkdir -p "$work/$n" "$work/artifacts"
  cp "$src/fuzz/corpus/$n/"* "$work/$n/" 2>/dev/null || true
  [ -d "$src/fuzz/regressions/$n" ] && cp "$src/fuzz/regressions/$n/"* "$work/$n/" 2>/dev/null
  opts=(-max_total_time="$secs" -print_final_stats=1 -timeout=20 -rss_limit_mb=3072 -max_len=65536
        -artifact_prefix="$work/artifacts/$n-")
  [ -f "$src/fuzz/$n.dict" ] && opts+=(-dict="$src/fuzz/$n.dict")
  rc=0
  "$bdir/fuzz_$n" "${opts[@]}" "$work/$n" >"$work/$n.log" 2>&1 || rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$work/$n.log" | tail -1 | awk '{print $2}' || true)
  last=$(grep -E '^#[0-9]+' "$work/$n.log" | tail -1 || true)
  cov=$(grep -o 'cov: [0-9]*' <<<"$last" | awk '{print $2}' || true)
  ft=$(grep -o 'ft: [0-9]*' <<<"$last" | awk '{print $2}' || true)
  corp=$(grep -o 'corp: [0-9]*' <<<"$last" | awk '{print $2}' || true)
  printf 'fuzz_%-10s %9s execs  cov %5s  ft %6s  corpus %5s  %s\n' "$n" "${execs:-?}" "${cov:-?}" "${ft:-?}" \
    "${corp:-?}" "$([ $rc = 0 ] && echo ok || echo "CRASH (rc $rc)")"
  if [ $rc != 0 ]; then
    fail=1
    grep -E -A25 'ERROR: |runtime error|==ERROR|deadly signal|abort' "$work/$n.log" | head -60
    ls "$work/artifacts/$n-"* 2>/dev/null | while read -r a; do
      keep="$src/fuzz/artifacts"; mkdir -p "$keep"; cp "$a" "$keep/"; echo "input kept: $keep/$(basename "$a")"
    done
  fi
done
echo "fuzz/run.sh: $(( $(date +%s) - t0 )) s in all"
exit $fail
