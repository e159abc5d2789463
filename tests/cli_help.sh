#!/usr/bin/env bash
# tests/cli_help: the chat template families are one list (tok/chat.c's table, read
# through kvlm_chat_family_names): `kvlm chat --help`, `kvlm serve --help` and the
# unknown-template message print it, and the docs that name the families
# (docs/serving.md's --chat-template list, docs/hf-checkpoints.md's warning) name the
# same ones in the same order. A family added to the table fails this until the docs
# follow.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
SRC="$(cd "$(dirname "$0")/.." && pwd)"
exec python3 - "$KVLM" "$MODELS/stories260K.gguf" "$SRC" <<'PY'
import os, re, subprocess, sys

kvlm, model, src = sys.argv[1:4]
failures = 0
def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)[-400:]), flush=True)
    failures += 0 if cond else 1

def names(text):
    """'chatml, llama2, ... or plain' -> the list"""
    return [n.strip() for n in re.split(r",| or ", text) if n.strip()]

def help_list(cmd):
    out = subprocess.run([kvlm, cmd, "--help"], capture_output=True, text=True).stdout
    m = re.search(r"The families:\n\s+([^\n]+)\n", out)
    return names(m.group(1)) if m else None

chat, serve = help_list("chat"), help_list("serve")
check(chat is not None and len(chat) >= 5 and "plain" in chat, "kvlm chat --help lists the families: %s" % chat)
check(serve == chat, "kvlm serve --help lists the same", serve)
if os.path.exists(model):
    p = subprocess.run([kvlm, "chat", "-m", model, "--chat-template", "bogus"], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    m = re.search(r"the built-in families: ([^)]+)\)", p.stderr)
    check(m is not None and names(m.group(1)) == chat, "an unknown template's message lists the same", p.stderr)
serving = open(os.path.join(src, "docs/serving.md")).read()
m = re.search(r"`--chat-template ([a-z0-9|.-]+)`", serving)
check(m is not None and m.group(1).split("|") == chat, "docs/serving.md's --chat-template list is the same",
      m and m.group(1))
hf = open(os.path.join(src, "docs/hf-checkpoints.md")).read()
m = re.search(r"none kvlm knows \(([^)]+)\)", hf)
check(m is not None and names(m.group(1)) == chat, "docs/hf-checkpoints.md's list is the same", m and m.group(1))
print("%d failed" % failures)
sys.exit(1 if failures else 0)
PY
