#!/usr/bin/env bash
# tests/cli_layers: the layer rules (../shared/DESIGN.md, the README's source tree) held on every
# #include of src/ ("x.h", or <layer/x.h>) by tests/helpers/layers.py: a layer includes only its own
# headers, those of the layers above it and include/kvlm.h; server/ and cli/ go through
# include/kvlm.h (and util/); every folder of src/ is a layer; only model/, tok/, server/ and cli/
# include jansson (the engine, the KV store, the kernels and util/ parse no JSON). Then the check is
# shown to fail: one violation of each rule planted in a copy of src/ is found.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
command -v python3 >/dev/null || { echo "SKIP: python3 not found"; exit 77; }
rc=0
python3 "$root/tests/helpers/layers.py" "$root/src" || rc=1
python3 "$root/tests/helpers/layers.py" "$root/src" --self-test || rc=1
[ "$rc" = 0 ] && echo PASS || echo FAIL
exit "$rc"
