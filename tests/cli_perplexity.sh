#!/usr/bin/env bash
# tests/cli_perplexity: `kvlm perplexity` agrees with llama.cpp's perplexity
# tool on stories260K (-c 512 --chunks 60): 3.8694 on TinyStories text and
# 135.7153 on WikiText-2 (llama.cpp, f16 cache), within 1%.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
CORPORA="${KVLM_CORPORA:-${KVLM_CORPORA_DEFAULT:-../shared/corpora}}"
pass=0 fail=0
check() { # name file expected
  local out ppl
  if [ ! -f "$MODELS/stories260K.gguf" ] || [ ! -f "$CORPORA/$2" ]; then
    echo "SKIP: $MODELS/stories260K.gguf or $CORPORA/$2 not found"; return
  fi
  out="$("$KVLM" perplexity -m "$MODELS/stories260K.gguf" -f "$CORPORA/$2" -c 512 --chunks 60 2>/dev/null)"
  ppl="$(printf '%s\n' "$out" | sed -n 's/^Final estimate: PPL = \([0-9.]*\) +\/- [0-9.]*$/\1/p')"
  if [ -n "$ppl" ] && awk -v a="$ppl" -v b="$3" 'BEGIN { d = (a - b) / b; exit !(d < 0.01 && d > -0.01) }'; then
    pass=$((pass + 1)); echo "ok   $1: PPL $ppl (llama.cpp $3)"
  else
    fail=$((fail + 1)); echo "FAIL $1: got '${ppl:-no Final estimate line}', llama.cpp $3"
  fi
}
check tinystories tinystories-valid-head.txt 3.8694
check wikitext wiki.test.raw 135.7153
# Too short a text for the context is a clear error.
printf 'Once upon a time.' >"${TMPDIR:-/tmp}/kvlm-short-$$.txt"
if [ -f "$MODELS/stories260K.gguf" ]; then
  msg="$("$KVLM" perplexity -m "$MODELS/stories260K.gguf" -f "${TMPDIR:-/tmp}/kvlm-short-$$.txt" -c 512 2>&1)"
  if [ $? -ne 0 ] && printf '%s' "$msg" | grep -q "needs at least"; then
    pass=$((pass + 1)); echo "ok   short text refused"
  else fail=$((fail + 1)); echo "FAIL short text"; fi
fi
rm -f "${TMPDIR:-/tmp}/kvlm-short-$$.txt"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
