#!/usr/bin/env bash
# tests/cli_serve_openai: kvlm serve on stories260K, driven by the official `openai`
# npm client (tests/web/openai_client.mjs): completions and chat, streaming and not,
# n > 1, stop strings, logprobs, usage, 32 concurrent streams vs `kvlm run` alone.
set -uo pipefail
source "$(dirname "$0")/web/serve_lib.sh"
start_server --max-seqs 32
echo "server at $URL"
KVLM_URL="$URL" KVLM_MODEL="$MODEL" node "$WEB_DIR/openai_client.mjs"
finish $?
