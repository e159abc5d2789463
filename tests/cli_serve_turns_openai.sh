#!/usr/bin/env bash
# tests/cli_serve_turns_openai: the many-turn chats of cli_serve_turns through the
# official `openai` npm client (tests/web/chat_turns.mjs), every turn streamed and
# its answer sent back as the client got it, on stories4M_hd64 and on a random model
# of stories110M's shape (kvlm synth, 32,000 tokens): from turn 2 on at least 95% of
# each prompt comes from the prefix cache; answers equal cold runs (stories4M every
# turn; the random model its first and last). KVLM_TEST_QUICK=1 (the sanitizer
# build): 3 turns on a short system message (every full block of the previous
# turn cached, not 95%).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories4M_hd64.gguf"
WEB_DIR="$(cd "$(dirname "$0")" && pwd)/web"
[ -f "$MODEL" ] || { echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; }
command -v node >/dev/null || { echo "SKIP: node not found (bash scripts/setup.sh installs nodejs)"; exit 77; }
[ -d "$WEB_DIR/node_modules/openai" ] ||
  { echo "SKIP: $WEB_DIR/node_modules missing (bash scripts/setup.sh runs npm ci --prefix tests/web)"; exit 77; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$KVLM" synth "$tmp/synth110M.gguf" --dim 768 --layers 12 --heads 12 --hidden 2048 --vocab 32000 --ctx 4096 \
  --type q8_0 >"$tmp/synth.log" 2>&1 || { echo "FAIL: kvlm synth: $(cat "$tmp/synth.log")"; exit 1; }
export KVLM_BIN="$KVLM" TURNS=8 RULES4M=60 RULES110M=40
[ "${KVLM_TEST_QUICK:-0}" = 1 ] && export TURNS=3 RULES4M=8 RULES110M=8 MIN_SHARE=0
rc=0
KVLM_MODEL="$MODEL" LABEL=stories4M KV_MEM=64MiB RULES=$RULES4M timeout 600 node "$WEB_DIR/chat_turns.mjs" || rc=1
KVLM_MODEL="$tmp/synth110M.gguf" LABEL=synth110M KV_MEM=160MiB RULES=$RULES110M MAX_TOKENS=32 NEAR_TIE=0.1 BAN=3 \
  COLD=ends timeout 600 node "$WEB_DIR/chat_turns.mjs" || rc=1
exit "$rc"
