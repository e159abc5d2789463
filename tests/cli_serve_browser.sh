#!/usr/bin/env bash
# tests/cli_serve_browser: the web page at / in a real browser (Debian's headless
# chromium driven by playwright-core, tests/web/browser.mjs): a message sent from the
# chat box streams its answer in, and the KV cache view follows the request; then the
# same with the server behind --api-key and the key given to the page as #key=KEY.
set -uo pipefail
# The server on one thread, and the test alone on the machine (RUN_SERIAL in
# CMakeLists.txt), and a 1,500-token answer: stories260K makes 400 tokens in ~35 ms, and
# a browser starved of CPU beside the fuzzers and the soak saw only its end.
source "$(dirname "$0")/web/serve_lib.sh"
CHROMIUM="${KVLM_CHROMIUM:-/usr/bin/chromium}"
[ -x "$CHROMIUM" ] || skip "$CHROMIUM not found (bash scripts/setup.sh installs Debian's chromium)"
start_server -t 1
echo "server at $URL"
KVLM_URL="$URL" KVLM_CHROMIUM="$CHROMIUM" node "$WEB_DIR/browser.mjs" || { finish 1; }
stop_server
start_server -t 1 --api-key page-test-key
echo "server at $URL (with an API key)"
KVLM_URL="$URL" KVLM_CHROMIUM="$CHROMIUM" KVLM_PAGE_KEY=page-test-key node "$WEB_DIR/browser.mjs"
finish $?
