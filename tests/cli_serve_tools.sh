#!/usr/bin/env bash
# tests/cli_serve_tools: tool calls and reasoning through kvlm serve on stories260K with real chat
# templates, driven by the official `openai` npm client (tests/web/tools_client.mjs): tool_choice
# required, a named function, parallel calls, streamed deltas against the whole answer, a call and
# its result and the answer after it, auto's lazy grammar (Llama 3.1's template: an answer that opens
# with "{" is held to a call from there), the 400s; every call's arguments valid
# against its tool's schema (Python's jsonschema, an independent validator); reasoning_content
# split on DeepSeek R1's template (the prompt opens <think>) and Qwen 3's.
set -uo pipefail
source "$(dirname "$0")/web/serve_lib.sh"
TEMPLATES="${KVLM_TEMPLATES:-$(cd "$(dirname "$0")/../.." && pwd)/shared/chat-templates}"
[ -d "$TEMPLATES" ] || skip "no chat templates at $TEMPLATES"
/usr/bin/python3 -c 'import jsonschema' 2>/dev/null || skip "python3-jsonschema missing (scripts/setup.sh)"
rc=0
for kind in hermes llama3 r1 qwen3; do
  case $kind in
    hermes) file=Qwen-Qwen2.5-7B-Instruct.jinja ;;
    llama3) file=meta-llama-Llama-3.1-8B-Instruct.jinja ;;
    r1) file=deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja ;;
    qwen3) file=Qwen-Qwen3-0.6B.jinja ;;
  esac
  start_server --max-seqs 8 --chat-template-file "$TEMPLATES/$file"
  echo "== $kind: $file at $URL"
  KVLM_URL="$URL" KVLM_TEMPLATE=$kind KVLM_CALLS="$tmp/calls-$kind.json" node "$WEB_DIR/tools_client.mjs" || rc=1
  if ! kill -0 "$server_pid" 2>/dev/null; then echo "FAIL: kvlm serve died: $(tail -20 "$tmp/serve.err")"; rc=1; fi
  stop_server
  if grep -q "Sanitizer\|runtime error" "$tmp/serve.err"; then echo "FAIL: $(tail -40 "$tmp/serve.err")"; rc=1; fi
done
# every call made, against its tool's schema
/usr/bin/python3 - "$tmp/calls-hermes.json" "$tmp/calls-llama3.json" <<'PY' || rc=1
import json, sys
import jsonschema
d = json.load(open(sys.argv[1]))
d["calls"] += json.load(open(sys.argv[2]))["calls"]
schemas = {t["function"]["name"]: t["function"]["parameters"] for t in d["tools"]}
bad = 0
for name, args in d["calls"]:
    try:
        jsonschema.validate(json.loads(args), schemas[name])
    except Exception as e:  # noqa: BLE001
        bad += 1
        print("FAIL %s(%s): %s" % (name, args, e))
print("%d calls, %d valid against their schemas" % (len(d["calls"]), len(d["calls"]) - bad))
sys.exit(1 if bad or not d["calls"] else 0)
PY
exit $rc
