#!/usr/bin/env bash
# tests/cli_serve_browser: the web page at / in a real browser (Debian's headless
# chromium driven by playwright-core, tests/web/browser.mjs): a message sent from the
# chat box streams its answer in, and the KV cache view follows the request.
set -uo pipefail
source "$(dirname "$0")/web/serve_lib.sh"
CHROMIUM="${KVLM_CHROMIUM:-/usr/bin/chromium}"
[ -x "$CHROMIUM" ] || skip "$CHROMIUM not found (bash scripts/setup.sh installs Debian's chromium)"
start_server
echo "server at $URL"
KVLM_URL="$URL" KVLM_CHROMIUM="$CHROMIUM" node "$WEB_DIR/browser.mjs"
finish $?
