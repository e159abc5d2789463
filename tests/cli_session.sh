#!/usr/bin/env bash
# tests/cli_session: `kvlm run --session FILE`: a second run of the same
# prompt, and a longer prompt that starts with it, reuse the saved cache
# ("cached: N tokens") and print exactly what a run without a session prints;
# a damaged block in the file is recomputed (same output); a file of another
# cache type, another model, another format version or no session at all is
# a clear error, never a crash.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
M="$MODELS/stories260K.gguf"
M2="$MODELS/stories4M_hd64.gguf"
if [ ! -f "$M" ] || [ ! -f "$M2" ]; then echo "SKIP: $M or $M2 not found (set KVLM_MODELS)"; exit 77; fi
T=$(mktemp -d /tmp/kvlm-session.XXXXXX)
trap 'rm -rf "$T"' EXIT
fail=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fail=1; }
P="Once upon a time there was a little girl named Lily who loved to play outside in the park with her friends and her dog"
P2="$P. One day they found a big red ball under a tree and"
run() { timeout 60 "$KVLM" run -m "$M" -n 24 --temp 0 -t 2 "$@"; }

run -p "$P" >"$T/cold.txt" 2>/dev/null
run -p "$P2" >"$T/cold2.txt" 2>/dev/null
run -p "$P" --session "$T/s.ses" >"$T/a.txt" 2>"$T/a.err" || bad "first run with a new session file"
[ -s "$T/s.ses" ] && ok "the session is saved" || bad "no session file written"
cmp -s "$T/a.txt" "$T/cold.txt" && ok "first run prints what a run without a session prints" || bad "first run differs"
run -p "$P" --session "$T/s.ses" >"$T/b.txt" 2>"$T/b.err"
grep -q "cached: 32 tokens" "$T/b.err" && ok "second run reuses the saved blocks ($(grep -o 'cached: [0-9]* tokens' "$T/b.err"))" || bad "second run: $(cat "$T/b.err")"
cmp -s "$T/b.txt" "$T/cold.txt" && ok "and prints the same text" || bad "second run differs"
run -p "$P2" --session "$T/s.ses" >"$T/c.txt" 2>"$T/c.err"
grep -q "cached: [1-9]" "$T/c.err" && ok "a longer prompt starting with the saved one reuses it ($(grep -o 'cached: [0-9]* tokens' "$T/c.err"))" || bad "longer prompt: $(cat "$T/c.err")"
cmp -s "$T/c.txt" "$T/cold2.txt" && ok "and prints what it prints without a session" || bad "longer prompt differs"

# a flipped byte in the first stored block: warned, recomputed, same text
run -p "$P" --session "$T/d.ses" >/dev/null 2>&1
python3 - "$T/d.ses" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
n = int.from_bytes(b[48:56], "little")
first = 72 + 4 * n          # the first stored block
b[first + 500] ^= 0x40
open(p, "wb").write(b)
PY
run -p "$P" --session "$T/d.ses" >"$T/d.txt" 2>"$T/d.err"
grep -q "damaged" "$T/d.err" && ! grep -q "cached:" "$T/d.err" && ok "a damaged block is detected and recomputed" || bad "damaged block: $(cat "$T/d.err")"
cmp -s "$T/d.txt" "$T/cold.txt" && ok "and the text is the same" || bad "damaged block: text differs"

expect_error() { # name, pattern, args...
  local name=$1 pat=$2; shift 2
  timeout 60 "$KVLM" run -n 4 --temp 0 -t 2 "$@" >"$T/e.txt" 2>"$T/e.err"
  local rc=$?
  if [ $rc -eq 1 ] && grep -q "$pat" "$T/e.err"; then ok "$name: $(grep -o "kvlm run: .*" "$T/e.err" | head -1)"
  else bad "$name (rc $rc): $(cat "$T/e.err")"; fi
}
cp "$T/s.ses" "$T/s2.ses"
expect_error "another cache type" "q8_0" -m "$M" -p "$P" --session "$T/s2.ses" --cache-type-k q8_0
expect_error "another model" "another model" -m "$M2" -p "$P" --session "$T/s2.ses"
printf 'not a session' >"$T/junk.ses"
expect_error "not a session file" "not a kvlm session file" -m "$M" -p "$P" --session "$T/junk.ses"
python3 -c "import sys; b=bytearray(open(sys.argv[1],'rb').read()); b[8]=9; open(sys.argv[1],'wb').write(b)" "$T/s2.ses"
expect_error "another format version" "format version 9" -m "$M" -p "$P" --session "$T/s2.ses"
head -c 80 "$T/s.ses" >"$T/short.ses"
expect_error "a truncated file" "truncated" -m "$M" -p "$P" --session "$T/short.ses"
exit $fail
