#!/usr/bin/env bash
# tests/cli_errors: the kvlm command on bad input: a wrong path, truncated and
# corrupt files, a prompt longer than the context, bad options. Each must give
# one clear line on stderr and a non-zero exit, never a crash (signal).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0

# expect_error NAME PATTERN CMD...: non-zero exit below 128, stderr matches PATTERN.
expect_error() {
  local name="$1" pattern="$2"; shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ] && grep -qiE "$pattern" "$tmp/err"; then
    pass=$((pass + 1)); echo "ok   $name: $(head -c 200 "$tmp/err" | head -1)"
  else
    fail=$((fail + 1)); echo "FAIL $name (exit $rc): $(cat "$tmp/err")"
  fi
}
expect_ok() {
  local name="$1"; shift
  if "$@" >"$tmp/out" 2>"$tmp/err"; then pass=$((pass + 1)); echo "ok   $name"
  else fail=$((fail + 1)); echo "FAIL $name: $(cat "$tmp/err")"; fi
}

expect_error "no args" "usage" "$KVLM"
expect_error "unknown command" "unknown command" "$KVLM" frobnicate
expect_error "missing model" "cannot open .*nope.gguf" "$KVLM" run -m "$tmp/nope.gguf" -p hi
expect_error "bad option value" "not an integer" "$KVLM" run -m x -n abc
expect_error "unknown option" "unknown option" "$KVLM" run --bogus
for sub in run inspect tokenize convert synth logits plan perplexity; do
  expect_ok "$sub --help" "$KVLM" "$sub" --help
done
printf 'GGUF' >"$tmp/short.gguf"
expect_error "4-byte gguf" "gguf|short|truncated" "$KVLM" run -m "$tmp/short.gguf"
printf 'not a model at all, just some text that is long enough' >"$tmp/text.bin"
expect_error "text file" "not a GGUF|llama2.c|format" "$KVLM" run -m "$tmp/text.bin"

if [ -f "$MODELS/stories260K.gguf" ]; then
  G="$MODELS/stories260K.gguf"
  head -c 600000 "$G" >"$tmp/trunc.gguf"
  expect_error "truncated gguf" "past the end|truncated|too short|end of" "$KVLM" run -m "$tmp/trunc.gguf" -p hi
  head -c 100 "$G" >"$tmp/trunc100.gguf"
  expect_error "gguf cut in its header" "past the end|truncated|too short|end of|more than a file" "$KVLM" inspect "$tmp/trunc100.gguf"
  # Flip the tensor-count field to something absurd.
  cp "$G" "$tmp/absurd.gguf"; chmod u+w "$tmp/absurd.gguf"
  printf '\xff\xff\xff\xff\xff\xff\xff\x7f' | dd of="$tmp/absurd.gguf" bs=1 seek=8 conv=notrunc 2>/dev/null
  expect_error "absurd tensor count" "tensor|count|past the end" "$KVLM" inspect "$tmp/absurd.gguf"
  long="$(for i in $(seq 1 3000); do printf 'the cat sat. '; done)"
  expect_error "prompt longer than context" "longer than the context" "$KVLM" run -m "$G" -p "$long" -c 512 -n 4
  expect_ok "inspect" "$KVLM" inspect "$G"
  grep -q "blk.0.attn_q.weight" "$tmp/out" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL inspect lists tensors"; }
  expect_ok "run greedy" "$KVLM" run -m "$G" -p "Once upon a time" -n 20 --temp 0
  grep -q "^Once upon a time, there was a little girl named Lily" "$tmp/out" && pass=$((pass + 1)) ||
    { fail=$((fail + 1)); echo "FAIL run output: $(cat "$tmp/out")"; }
  grep -qE "prompt tokens: 5 \| prefill: [0-9.]+ tokens/s \| decode: [0-9.]+ tokens/s.*KV cache: [0-9]+ bytes" "$tmp/err" &&
    pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL stats line: $(cat "$tmp/err")"; }
  expect_ok "run no-kv-cache" "$KVLM" run -m "$G" -p "Once upon a time" -n 20 --temp 0 --no-kv-cache
  grep -q "^Once upon a time, there was a little girl named Lily" "$tmp/out" && pass=$((pass + 1)) ||
    { fail=$((fail + 1)); echo "FAIL no-kv-cache output"; }
  # Quantized KV caches: names checked, q4_kc only for keys, text still sensible.
  expect_error "unknown cache type" "unknown cache type 'q3_x'" "$KVLM" run -m "$G" --cache-type-k q3_x
  expect_error "q4_kc for values" "keys only" "$KVLM" perplexity -m "$G" -f "$G" --cache-type-v q4_kc
  expect_ok "run q4_kc/q4_0 cache" "$KVLM" run -m "$G" -p "Once upon a time" -n 20 --temp 0 --cache-type-k q4_kc --cache-type-v q4_0
  grep -q "KV cache: 5760 bytes" "$tmp/err" && pass=$((pass + 1)) ||
    { fail=$((fail + 1)); echo "FAIL q4_kc/q4_0 KV bytes (24 tokens x 240): $(cat "$tmp/err")"; }
  # Same seed, same text.
  "$KVLM" run -m "$G" -p "Once" -n 40 --temp 1 --seed 7 >"$tmp/a" 2>/dev/null
  "$KVLM" run -m "$G" -p "Once" -n 40 --temp 1 --seed 7 >"$tmp/b" 2>/dev/null
  cmp -s "$tmp/a" "$tmp/b" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL same seed, different text"; }
else
  echo "SKIP: $MODELS/stories260K.gguf not found (set KVLM_MODELS)"
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
