#!/usr/bin/env bash
# tests/cli_tokenize: `kvlm tokenize --no-bos` on the vocabulary-only GGUF files
# reproduces ../shared/models/vocab/*.out for every string in the matching
# *.inp (strings separated by a line "__ggml_vocab_test__").
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
PY="$(command -v python3 || true)"
if [ -z "$PY" ]; then echo "SKIP: python3 not found"; echo "0 passed, 0 failed"; exit 0; fi
found=0
for inp in "$MODELS"/vocab/*.inp; do
  [ -f "$inp" ] || continue
  found=1
done
if [ "$found" -eq 0 ]; then echo "SKIP: no $MODELS/vocab/*.inp"; echo "0 passed, 0 failed"; exit 0; fi
"$PY" - "$KVLM" "$MODELS"/vocab/*.inp <<'PYEOF'
import subprocess, sys
kvlm, files = sys.argv[1], sys.argv[2:]
passed = failed = 0
for inp in files:
    model = inp[:-len(".inp")]
    raw = open(inp, "rb").read().decode("utf-8")
    strings = raw.split("\n__ggml_vocab_test__\n")
    if strings and strings[-1] == "":
        strings = strings[:-1]
    expected = open(model + ".out", encoding="utf-8").read().split("\n")
    for i, text in enumerate(strings):
        # Through stdin: the strings hold newlines, tabs and leading dashes.
        r = subprocess.run([kvlm, "tokenize", "-m", model, "--no-bos", "-f", "/dev/stdin"],
                           input=text.encode("utf-8"), capture_output=True)
        got = r.stdout.decode().strip()
        want = expected[i].strip() if i < len(expected) else None
        if r.returncode == 0 and got == want:
            passed += 1
        else:
            failed += 1
            print(f"FAIL {model.split('/')[-1]} string {i} {text!r}: got {got!r}, want {want!r} {r.stderr.decode().strip()}")
    print(f"ok   {model.split('/')[-1]}: {len(strings)} strings")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PYEOF
