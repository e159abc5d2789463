#!/usr/bin/env bash
# tests/cli_evict: bounded KV caches end to end on stories260K (trained
# context 512): `kvlm perplexity --stream` with a budget of 128 (sinks stays
# close to the full cache inside the trained context and below it beyond;
# every policy finite; CSV and SVG written), and `kvlm run` past the context
# under sinks and h2o, stopping with a reason under none.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
CORPORA="${KVLM_CORPORA:-${KVLM_CORPORA_DEFAULT:-../shared/corpora}}"
M="$MODELS/stories260K.gguf" T="$CORPORA/tinystories-valid-head.txt"
if [ ! -f "$M" ] || [ ! -f "$T" ]; then echo "SKIP: $M or $T not found"; exit 0; fi
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }

n_tok=1024; [ -n "${KVLM_TEST_QUICK:-}" ] && n_tok=640 # sanitizer builds
"$KVLM" perplexity --stream -t 1 -m "$M" -f "$T" --tokens $n_tok --kv-budget 128 --stride 128 \
  --csv "$tmp/ppl.csv" --svg "$tmp/ppl.svg" >"$tmp/table.txt" 2>"$tmp/err.txt" || bad "perplexity --stream failed: $(cat "$tmp/err.txt")"
cat "$tmp/table.txt"
# columns: start,end,none,window,sinks,h2o
if awk -F, -v n=$((n_tok / 128)) 'NR > 1 { for (i = 3; i <= 6; i++) if (!($i > 1 && $i < 50)) exit 1 } END { exit NR != n + 1 }' "$tmp/ppl.csv"; then
  ok "$((n_tok / 128)) stretches, every policy finite"; else bad "CSV: $(cat "$tmp/ppl.csv")"; fi
if awk -F, 'NR >= 3 && NR <= 5 { d = ($5 - $3) / $3; if (!(d < 0.1 && d > -0.1)) exit 1 }' "$tmp/ppl.csv"; then
  ok "sinks within 10% of the full cache on positions 128-511 (evicting from 128 on)"; else bad "sinks vs full cache at 128-511"; fi
if awk -F, 'NR > 5 { if (!($5 < $3)) exit 1 }' "$tmp/ppl.csv"; then
  ok "past the trained context sinks stays below the full cache"; else bad "sinks vs full cache past 512"; fi
[ "$(grep -c '<polyline' "$tmp/ppl.svg")" -eq 4 ] && ok "SVG: one line per policy" || bad "SVG lines"

out="$("$KVLM" run -t 1 -m "$M" -c 256 --kv-budget 128 --kv-evict sinks -n 1000 --seed 7 2>&1 >/dev/null)"
n="$(printf '%s' "$out" | sed -n 's/.*(\([0-9]*\) tokens).*/\1/p')"
if [ "${n:-0}" -gt 256 ] && printf '%s' "$out" | grep -q 'sinks: [0-9]* tokens kept, [1-9][0-9]* evicted'; then
  ok "run: $n tokens under sinks past a context of 256"; else bad "run under sinks: $out"; fi
out="$("$KVLM" run -t 1 -m "$M" -c 256 --kv-budget 64 --kv-evict h2o -n 400 --seed 7 2>&1 >/dev/null)"
printf '%s' "$out" | grep -q 'h2o: [0-9]* tokens kept, [1-9][0-9]* evicted' && ok "run under h2o" || bad "run under h2o: $out"
out="$("$KVLM" run -t 1 -m "$M" --kv-budget 100 -n 300 --seed 7 2>&1 >/dev/null)"
printf '%s' "$out" | grep -q 'stopped: KV budget full' && ok "none stops at the budget with a reason" || bad "none: $out"
out="$("$KVLM" run -t 1 -m "$M" --kv-evict lru 2>&1)"
[ $? -ne 0 ] && printf '%s' "$out" | grep -q "unknown --kv-evict 'lru'" && ok "unknown policy refused" || bad "unknown policy: $out"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
