#!/usr/bin/env bash
# tests/cli_toolcall_roundtrip: the tool-call parsers against the real chat
# templates in ../shared/chat-templates: an assistant turn with calls, content
# and reasoning rendered by Python's jinja2 as Hugging Face renders it, parsed
# back by test_chat_parse --roundtrip with the syntax kvlm picks for the
# template, must give the same calls, content and reasoning, and streaming
# every prefix must add up to the whole parse (tests/helpers/toolcall_roundtrip.py).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
BIN="$(dirname "$KVLM")/test_chat_parse"
TEMPLATES="${KVLM_TEMPLATES:-$(dirname "$0")/../../shared/chat-templates}"
PY=/usr/bin/python3
if [ ! -x "$PY" ] || ! "$PY" -c 'import jinja2' 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 with jinja2 (Debian python3-jinja2, scripts/setup.sh) is missing" >&2
  exit 77
fi
if [ ! -d "$TEMPLATES" ]; then
  echo "SKIP: no chat templates at $TEMPLATES" >&2
  exit 77
fi
if [ ! -x "$BIN" ]; then
  echo "SKIP: $BIN is not built" >&2
  exit 77
fi
exec "$PY" "$(dirname "$0")/helpers/toolcall_roundtrip.py" "$BIN" "$TEMPLATES"
