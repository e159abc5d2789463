#!/usr/bin/env bash
# tests/cli_layers: the layer rules (docs/architecture.md, ../shared/DESIGN.md) held on every
# #include of src/ ("x.h", or <layer/x.h>) by tests/helpers/layers.py: a layer includes only its own
# headers, those of the layers above it and include/kvlm.h; server/ and cli/ go through
# include/kvlm.h (and util/); every folder of src/ is a layer; only model/, tok/, server/ and cli/
# include jansson (the engine, the KV store, the kernels and util/ parse no JSON). Then the check is
# shown to fail: one violation of each rule planted in a copy of src/ is found. And the build's split:
# examples/generate.c, linked against the core library alone (libkvlm-core.a: no server/), needs no
# HTTP, ZeroMQ or msgpack library and writes what `kvlm run --temp 0` writes.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
command -v python3 >/dev/null || { echo "SKIP: python3 not found"; exit 77; }
rc=0
python3 "$root/tests/helpers/layers.py" "$root/src" || rc=1
python3 "$root/tests/helpers/layers.py" "$root/src" --self-test || rc=1
bin="${KVLM_BIN:-$root/build/kvlm}"
ex="$(dirname "$bin")/example_generate"
models="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-$root/../shared/models}}"
if [ ! -x "$ex" ] || ! command -v readelf >/dev/null; then
  echo "SKIP (core link): $ex or readelf missing"
else
  needed="$(readelf -d "$ex" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
  if grep -E 'microhttpd|zmq|msgpack|libkvlm' <<<"$needed" >/dev/null; then
    echo "FAIL the core library's example links a server library: $needed"; rc=1
  else
    echo "ok    examples/generate.c against the core library needs only: $needed"
  fi
  if [ -f "$models/stories260K.gguf" ]; then
    want="$("$bin" run -m "$models/stories260K.gguf" -p "Once upon a time" -n 24 --temp 0 2>/dev/null)"
    got="$("$ex" "$models/stories260K.gguf" "Once upon a time" 24 2>/dev/null)"
    if [ -n "$want" ] && [ "$got" = "$want" ]; then echo "ok    example_generate writes what kvlm run --temp 0 writes"
    else echo "FAIL example_generate: '$got', kvlm run: '$want'"; rc=1; fi
  else
    echo "SKIP (core run): $models/stories260K.gguf missing"
  fi
fi
[ "$rc" = 0 ] && echo PASS || echo FAIL
exit "$rc"
