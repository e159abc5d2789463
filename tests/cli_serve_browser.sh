#!/usr/bin/env bash
# tests/cli_serve_browser: the web page at / in a real browser (Debian's headless
# chromium driven by playwright-core, tests/web/browser.mjs): a message sent from the
# chat box streams its answer in, and the KV cache view follows the request; then the
# same with the server behind --api-key and the key given to the page as #key=KEY.
set -uo pipefail
# The server on one thread and a model slow enough for a browser to watch, with other tests
# beside it: stories260K made its 1,500-token answer in 0.18 s, and the page (a busy browser
# on 2 cores) often saw only its end. A random model of 6 layers of 768 and a 32,000-token
# vocabulary (Q8_0) takes ~3 ms a token alone: a 600-token answer lasts 2 s or more (its
# greedy text, for this seed and question, runs the whole 600).
source "$(dirname "$0")/web/serve_lib.sh"
CHROMIUM="${KVLM_CHROMIUM:-/usr/bin/chromium}"
[ -x "$CHROMIUM" ] || skip "$CHROMIUM not found (bash scripts/setup.sh installs Debian's chromium)"
MODEL="$tmp/browser.gguf"
"$KVLM" synth "$MODEL" --dim 768 --layers 6 --heads 12 --hidden 2048 --vocab 32000 --ctx 2048 --type q8_0 \
  --seed 7 >/dev/null || { echo "FAIL: kvlm synth"; exit 1; }
export KVLM_PAGE_MODEL=browser KVLM_PAGE_TOKENS=600
[ -n "${KVLM_TEST_QUICK:-}" ] && KVLM_PAGE_TOKENS=200 # the sanitizer build: ~5 times slower a token
start_server -t 1
echo "server at $URL"
KVLM_URL="$URL" KVLM_CHROMIUM="$CHROMIUM" node "$WEB_DIR/browser.mjs" || { finish 1; }
stop_server
start_server -t 1 --api-key page-test-key
echo "server at $URL (with an API key)"
KVLM_URL="$URL" KVLM_CHROMIUM="$CHROMIUM" KVLM_PAGE_KEY=page-test-key node "$WEB_DIR/browser.mjs"
finish $?
