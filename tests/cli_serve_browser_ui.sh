#!/usr/bin/env bash
# tests/cli_serve_browser_ui: the web page's chat controls in a real browser (Debian's headless
# chromium driven by playwright-core, tests/web/browser_ui.mjs): system prompt and sampling
# settings in the request, regenerate, edit, markdown rendered and sanitised, conversations
# kept in localStorage, and the prefill progress bar during a long prompt.
set -uo pipefail
# The same slow random model as cli_serve_browser.sh (6 layers of 768, a 32,000-token
# vocabulary, Q8_0), on one thread with 64-token engine steps: a ~1,450-token prompt takes
# ~0.6 s to read in ~23 steps, each published in /kvlm/status, which the page polls every 5 ms.
source "$(dirname "$0")/web/serve_lib.sh"
CHROMIUM="${KVLM_CHROMIUM:-/usr/bin/chromium}"
[ -x "$CHROMIUM" ] || skip "$CHROMIUM not found (bash scripts/setup.sh installs Debian's chromium)"
MODEL="$tmp/browser.gguf"
"$KVLM" synth "$MODEL" --dim 768 --layers 6 --heads 12 --hidden 2048 --vocab 32000 --ctx 2048 --type q8_0 \
  --seed 7 >/dev/null || { echo "FAIL: kvlm synth"; exit 1; }
start_server -t 1 --batch-tokens 64
echo "server at $URL"
KVLM_URL="$URL" KVLM_CHROMIUM="$CHROMIUM" node "$WEB_DIR/browser_ui.mjs"
finish $?
