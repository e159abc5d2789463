#!/usr/bin/env bash
# tests/cli_spec: `kvlm run --spec` end to end: greedy text with prompt lookup
# and with a q4_0 draft of the same model equals the text without
# speculation (stories260K, stories4M_hd64; f16, q8_0 and q4_kc caches; h2o
# and sinks eviction; the context's end; each model drafting for the other
# in its pool; a draft past its context under eviction, in a window; drafts
# of another shape or windows under windowed llama and gemma2 models;
# --draft-p-min), acceptance figures on stderr, a draft of another
# vocabulary refused by name.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
if [ ! -f "$MODELS/stories260K.gguf" ]; then echo "SKIP: $MODELS/stories260K.gguf not found (set KVLM_MODELS)"; exit 77; fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
# the sanitizer build (KVLM_TEST_QUICK): every case once with lookup and the
# draft; the other lookup settings and stories4M_hd64's cache variants in the Release build only
quick="${KVLM_TEST_QUICK:-}"
P="Lily had a red ball. She liked to play with the red ball in the park. One day, Lily lost the red ball. She looked for the red ball"

same() { # name, options...: greedy text with and without --spec lookup / --draft
  local name="$1"; shift
  "$KVLM" run -t 2 --temp 0 -n 150 -p "$P" "$@" >"$tmp/plain.txt" 2>"$tmp/plain.err" || { bad "$name: plain run: $(cat "$tmp/plain.err")"; return; }
  for spec in "--spec lookup --draft-n 2" "--spec lookup" "--spec lookup --draft-n 12 --spec-ngram 4" "--draft $tmp/draft.gguf --draft-n 4"; do
    case "$spec" in *draft.gguf*) [ -f "$tmp/draft.gguf" ] || continue;; esac
    case "$quick:$spec" in ?*:*--draft-n\ [12]*) continue;; esac
    # shellcheck disable=SC2086
    "$KVLM" run -t 2 --temp 0 -n 150 -p "$P" "$@" $spec >"$tmp/spec.txt" 2>"$tmp/spec.err" || { bad "$name $spec: $(cat "$tmp/spec.err")"; continue; }
    if cmp -s "$tmp/plain.txt" "$tmp/spec.txt" && grep -q 'drafts accepted' "$tmp/spec.err"; then
      ok "$name $spec: same text ($(sed -n 's/.*| spec \(.*\)$/\1/p' "$tmp/spec.err"))"
    else bad "$name $spec: text differs or no figures"; diff "$tmp/plain.txt" "$tmp/spec.txt" | head -5; fi
  done
}

for model in stories260K.gguf stories4M_hd64.gguf; do
  M="$MODELS/$model"
  [ -f "$M" ] || { echo "SKIP part: $M not found"; continue; }
  rm -f "$tmp/draft.gguf"
  "$KVLM" convert "$M" "$tmp/draft.gguf" --type q4_0 >/dev/null 2>&1 || bad "$model: convert to q4_0"
  same "$model" -m "$M"
  [ -n "$quick" ] && [ "$model" != stories260K.gguf ] && continue
  same "$model q8_0 cache" -m "$M" --cache-type-k q8_0 --cache-type-v q8_0
  same "$model q4_kc keys" -m "$M" --cache-type-k q4_kc
  same "$model h2o" -m "$M" --kv-budget 96 --kv-evict h2o
  same "$model sinks" -m "$M" --kv-budget 80 --kv-evict sinks
  same "$model context end" -m "$M" -c 80
done

# past the context under eviction: the draft's cache in the model's pool
# does not evict, and drafts from a window of the text's last half context,
# started afresh each time it fills (stderr counts the moves); the same text
M="$MODELS/stories260K.gguf"
rm -f "$tmp/draft.gguf"
"$KVLM" convert "$M" "$tmp/draft.gguf" --type q4_0 >/dev/null 2>&1 || bad "stories260K: convert to q4_0"
"$KVLM" run -t 2 --temp 0 -n 300 -p "$P" -m "$M" -c 64 --kv-budget 48 --kv-evict sinks >"$tmp/plain.txt" 2>/dev/null
"$KVLM" run -t 2 --temp 0 -n 300 -p "$P" -m "$M" -c 64 --kv-budget 48 --kv-evict sinks --draft "$tmp/draft.gguf" >"$tmp/spec.txt" 2>"$tmp/spec.err"
moved="$(sed -n 's/.*draft window moved \([0-9]*\) times.*/\1/p' "$tmp/spec.err")"
if cmp -s "$tmp/plain.txt" "$tmp/spec.txt" && [ "${moved:-0}" -ge 5 ]; then
  ok "sinks past a context of 64, a q4_0 draft in the pool: same text, its window moved $moved times ($(sed -n 's/.*| spec \(.*\) | sinks.*/\1/p' "$tmp/spec.err"))"
else bad "sinks past the context with a draft: text differs or no window ($(tail -1 "$tmp/spec.err"))"; fi

# a draft model of another cache shape in the model's pool: smaller per
# token (stories260K drafting for stories4M_hd64, 64 of its tokens a block)
# and larger (the other way round, 3 of its tokens a block)
if [ -f "$MODELS/stories4M_hd64.gguf" ]; then
  cp "$MODELS/stories260K.gguf" "$tmp/draft.gguf"
  same "stories4M_hd64, stories260K drafting" -m "$MODELS/stories4M_hd64.gguf"
  # --draft-p-min: the drafts end where the draft is unsure; the same text,
  # fewer drafts, more of them kept
  for pm in 0 0.7; do
    "$KVLM" run -t 2 --temp 0 -n 150 -p "$P" -m "$MODELS/stories4M_hd64.gguf" --draft "$tmp/draft.gguf" --draft-n 8 \
      --draft-p-min $pm >"$tmp/pm$pm.txt" 2>"$tmp/pm$pm.err"
  done
  "$KVLM" run -t 2 --temp 0 -n 150 -p "$P" -m "$MODELS/stories4M_hd64.gguf" >"$tmp/plain.txt" 2>/dev/null
  d0="$(sed -n 's/.* \([0-9]*\)\/\([0-9]*\) drafts accepted (\([0-9]*\)%).*/\2 \3/p' "$tmp/pm0.err")"
  d7="$(sed -n 's/.* \([0-9]*\)\/\([0-9]*\) drafts accepted (\([0-9]*\)%).*/\2 \3/p' "$tmp/pm0.7.err")"
  read -r n0 r0 <<<"$d0"; read -r n7 r7 <<<"$d7"
  if cmp -s "$tmp/plain.txt" "$tmp/pm0.txt" && cmp -s "$tmp/plain.txt" "$tmp/pm0.7.txt" && [ "${n7:-0}" -gt 0 ] &&
     [ "${n7:-0}" -lt "${n0:-0}" ] && [ "${r7:-0}" -gt "${r0:-100}" ]; then
    ok "--draft-p-min 0.7: same text, $n7 drafts checked ($r7% kept) against $n0 ($r0%) without"
  else bad "--draft-p-min: text differs or no fewer drafts ($(tail -1 "$tmp/pm0.err"); $(tail -1 "$tmp/pm0.7.err"))"; fi
  cp "$MODELS/stories4M_hd64.gguf" "$tmp/draft.gguf"
  same "stories260K, stories4M_hd64 drafting" -m "$MODELS/stories260K.gguf"
  where="$("$KVLM" run -t 2 --temp 0 -n 20 -p "$P" -m "$MODELS/stories260K.gguf" --draft "$tmp/draft.gguf" 2>&1 >/dev/null | tail -1)"
  case "$where" in *"draft cache in the model's pool (3 tokens a block, keys f16)"*)
    ok "the larger draft's cache is reported in the model's pool, 3 tokens a block";;
  *) bad "where the larger draft's cache is: $where";; esac
  where="$("$KVLM" run -t 2 --temp 0 -n 20 -p "$P" -m "$MODELS/stories4M_hd64.gguf" --cache-type-k q4_kc --draft "$tmp/draft.gguf" 2>&1 >/dev/null | tail -1)"
  case "$where" in *"draft cache in the model's pool (14 tokens a block, keys q8_0)"*)
    ok "with q4_kc keys the draft's cache is in the model's pool, q8_0 keys, 14 tokens a block";;
  *) bad "where the draft's cache is with q4_kc keys: $where";; esac
fi

# other cache shapes, random weights: a window of 8 on every layer (blocks
# before the window go back while drafts are held), gemma2's local store
# beside the global one, deepseek2's latent rows
"$KVLM" synth "$tmp/swa.gguf" --arch llama --dim 64 --layers 2 --heads 4 --kv-heads 2 --hidden 128 --sliding-window 8 --seed 5 >/dev/null 2>&1
"$KVLM" synth "$tmp/gemma2.gguf" --arch gemma2 --dim 64 --layers 4 --heads 4 --kv-heads 2 --hidden 128 --sliding-window 8 --tied --seed 6 >/dev/null 2>&1
"$KVLM" synth "$tmp/ds2.gguf" --arch deepseek2 --dim 128 --heads 4 --head-dim 48 --kv-lora 64 --rope-dim 16 --hidden 256 --layers 3 --seed 7 >/dev/null 2>&1
for model in swa gemma2 ds2; do
  [ -f "$tmp/$model.gguf" ] || { bad "$model: synth"; continue; }
  rm -f "$tmp/draft.gguf"
  "$KVLM" convert "$tmp/$model.gguf" "$tmp/draft.gguf" --type q4_0 >/dev/null 2>&1 || bad "$model: convert to q4_0"
  same "$model (random weights)" -m "$tmp/$model.gguf" --block-size 4
done

# a windowed model takes a draft of another shape or other windows into its
# pool, as a guest that keeps all its blocks: a llama with a window on every
# layer, a smaller llama and gemma2 (its own local windows) drafting; gemma2
# (its local layers in a store of their own), the smaller llama drafting
"$KVLM" synth "$tmp/small.gguf" --arch llama --dim 32 --layers 1 --heads 2 --kv-heads 1 --hidden 64 --seed 9 >/dev/null 2>&1
for pair in swa:small swa:gemma2 gemma2:small; do
  t="${pair%%:*}" d="${pair##*:}"
  [ -f "$tmp/$d.gguf" ] && [ -f "$tmp/$t.gguf" ] || { bad "$pair: synth"; continue; }
  "$KVLM" run -t 2 --temp 0 -n 150 -p "$P" -m "$tmp/$t.gguf" --block-size 4 >"$tmp/plain.txt" 2>/dev/null
  "$KVLM" run -t 2 --temp 0 -n 150 -p "$P" -m "$tmp/$t.gguf" --block-size 4 --draft "$tmp/$d.gguf" >"$tmp/spec.txt" 2>"$tmp/spec.err"
  where="$(tail -1 "$tmp/spec.err")"
  case "$where" in *"draft cache in the model's pool"*)
    if cmp -s "$tmp/plain.txt" "$tmp/spec.txt"; then ok "$t, $d drafting in the model's pool: same text"
    else bad "$t, $d drafting: text differs"; fi;;
  *) bad "$t, $d drafting: where its cache is: $where";; esac
done

M="$MODELS/stories260K.gguf"
"$KVLM" synth "$tmp/other.gguf" --dim 64 --layers 1 --heads 4 --kv-heads 4 --hidden 128 --vocab 300 --type f32 >/dev/null 2>&1
out="$("$KVLM" run -m "$M" -p "Hi" -n 5 --draft "$tmp/other.gguf" 2>&1)"
[ $? -ne 0 ] && printf '%s' "$out" | grep -q "vocabulary" && ok "a draft of another vocabulary is refused: $(printf '%s' "$out" | tail -1)" || bad "other vocabulary: $out"
out="$("$KVLM" run -m "$M" -p "Hi" -n 5 --spec guess 2>&1)"
[ $? -ne 0 ] && printf '%s' "$out" | grep -q "expected lookup, draft or none" && ok "unknown --spec refused" || bad "--spec guess: $out"
out="$("$KVLM" run -m "$M" -p "Hi" -n 5 --draft "$M" --draft-p-min 1.5 2>&1)"
[ $? -ne 0 ] && printf '%s' "$out" | grep -q "expected 0 <= P < 1" && ok "--draft-p-min 1.5 refused" || bad "--draft-p-min 1.5: $out"
out="$("$KVLM" run -m "$M" -p "Hi" -n 5 --spec lookup --draft-p-min 0.5 2>&1)"
[ $? -ne 0 ] && printf '%s' "$out" | grep -q "goes with --draft" && ok "--draft-p-min without a draft model refused" || bad "--draft-p-min with lookup: $out"
out="$("$KVLM" run -m "$M" -p "Hi" -n 5 --spec draft 2>&1)"
[ $? -ne 0 ] && printf '%s' "$out" | grep -q "needs --draft" && ok "--spec draft without a model refused" || bad "--spec draft: $out"
# sampling runs (its distribution is test_spec's)
"$KVLM" run -m "$M" -p "$P" -n 100 --temp 0.8 --seed 3 --spec lookup >"$tmp/s.txt" 2>"$tmp/s.err" && [ -s "$tmp/s.txt" ] &&
  ok "sampling with lookup: $(sed -n 's/.*| spec \(.*\)$/\1/p' "$tmp/s.err")" || bad "sampling: $(cat "$tmp/s.err")"

# a model that copies its context (bench/copy_model.py sets an induction
# circuit into random weights): on a passage and its beginning again, the
# text equals plain decoding's, and lookup's drafts must mostly be kept
# (a lookup that drafted the wrong tokens, or rolled back too much, would
# keep few); the q4_0 copy drafts too
COPY="$(cd "$(dirname "$0")/.." && pwd)/bench/copy_model.py"
if /usr/bin/python3 -c 'import numpy' 2>/dev/null && [ -f "$COPY" ]; then
  "$KVLM" synth "$tmp/rand.gguf" --dim 384 --hidden 256 --layers 2 --heads 6 --vocab 2000 --ctx 2048 --seed 9 >/dev/null 2>&1
  if /usr/bin/python3 "$COPY" "$tmp/rand.gguf" "$tmp/copy.gguf" >"$tmp/copy.err" 2>&1; then
    E="Spot saw the shiny car and said, Wow, Kitty, your car is so bright and clean! Kitty smiled and replied, Thank you, Spot. I polish it every day. After playing with the car, they felt thirsty. They found a small pond with clear water."
    printf '%s\n\n%s' "$E" "${E:0:40}" >"$tmp/edit.txt"
    rm -f "$tmp/draft.gguf"
    "$KVLM" convert "$tmp/copy.gguf" "$tmp/draft.gguf" --type q4_0 >/dev/null 2>&1 || bad "copy model: convert to q4_0"
    "$KVLM" run -m "$tmp/copy.gguf" -f "$tmp/edit.txt" -c 1024 -t 2 --temp 0 -n 120 >"$tmp/plain.txt" 2>/dev/null
    for spec in "--spec lookup" "--draft $tmp/draft.gguf --draft-n 4"; do
      # shellcheck disable=SC2086
      "$KVLM" run -m "$tmp/copy.gguf" -f "$tmp/edit.txt" -c 1024 -t 2 --temp 0 -n 120 $spec >"$tmp/spec.txt" 2>"$tmp/spec.err"
      rate="$(sed -n 's/.*drafts accepted (\([0-9]*\)%).*/\1/p' "$tmp/spec.err")"
      if cmp -s "$tmp/plain.txt" "$tmp/spec.txt" && [ "${rate:-0}" -ge 80 ]; then
        ok "copy model $spec: same text, $(sed -n 's/.*| spec \(.*\)$/\1/p' "$tmp/spec.err")"
      else bad "copy model $spec: text differs or few drafts kept ($(tail -1 "$tmp/spec.err"))"; fi
    done
  else bad "bench/copy_model.py: $(tail -1 "$tmp/copy.err")"; fi
else echo "SKIP part: /usr/bin/python3 with numpy or bench/copy_model.py missing: no copy-model check"; fi

echo "cli_spec: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
