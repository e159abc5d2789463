#!/usr/bin/env bash
# tests/cli_python: the Python package (python/kvlm, ctypes over libkvlm.so)
# under pytest (python/tests): greedy text as `kvlm run --temp 0` on
# stories260K and stories4M_hd64, streams equal to whole answers, OpenAI's
# fields, LLM.generate over 16 prompts equal to each alone, 8 threads at once,
# 200 create/close cycles with flat RSS, exception types, silence without
# verbose, Ctrl-C mid-generation, the C structures' layout against the
# compiler, the llama-cpp-python and vLLM example scripts, python -m
# kvlm.server. Debian's python3-pytest, hence /usr/bin/python3.
# In a sanitizer build the interpreter gets the sanitizer runtimes libkvlm.so
# links (read from ldd) preloaded, so that the library's memory errors and UB
# under Python's calls are caught; leak detection is off there (LeakSanitizer
# would report the interpreter's own allocations: the C tests check the
# library's leaks) and the RSS test is skipped (ASan's quarantine grows RSS).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
PY=/usr/bin/python3
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lib="$(dirname "$KVLM")/libkvlm.so"
if [ ! -f "$MODELS/stories260K.gguf" ]; then echo "SKIP: $MODELS/stories260K.gguf not found (set KVLM_MODELS)"; exit 77; fi
if ! "$PY" -c 'import pytest' 2>/dev/null; then
  echo "SKIP: $PY lacks pytest (scripts/setup.sh installs python3-pytest)"; exit 77
fi
if [ ! -f "$lib" ]; then echo "SKIP: $lib not built (-DKVLM_SHARED=ON, target kvlm_shared)"; exit 77; fi
deps=$(ldd "$lib" 2>/dev/null || true) # (read whole: grep -q would cut ldd short, SIGPIPE failing the pipe)
preload=""
while read -r name arrow path _; do
  case "$name" in libasan.so*|libubsan.so*) [ "$arrow" = "=>" ] && [ -f "$path" ] && preload="$preload${preload:+:}$path" ;; esac
done <<< "$deps"
case "$deps" in
  *libasan*)
    if [ -z "$preload" ]; then echo "SKIP: $lib is a sanitizer build whose runtime ldd does not name"; exit 77; fi
    export LD_PRELOAD="$preload" KVLM_PY_SANITIZER=1
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" ;;
esac
MODELS=$(cd "$MODELS" && pwd)
export KVLM_LIBRARY="$lib" KVLM_MODELS="$MODELS" KVLM_BIN="$KVLM" PYTHONDONTWRITEBYTECODE=1
cd "$root/python" && exec "$PY" -m pytest -q -rs -p no:cacheprovider tests
