#!/usr/bin/env bash
# cli_template: `kvlm template` against Python's jinja2 rendering as Hugging Face
# transformers does (tests/helpers/template_oracle.py): every real template of
# ../shared/chat-templates x 21 conversations (system or not, multi-turn, tools
# with JSON-schema parameters, tool calls with object and string arguments, tool
# results, reasoning_content, add_generation_prompt and enable_thinking both
# ways, non-ASCII, empty content, content as parts), byte-identical or failing
# in both (a raise_exception with the same message), and ~290 small templates
# over every corner of the language (tests/helpers/jinja_snippets.py). Then the
# command itself: the text exactly (no newline added), a template error's
# message and exit 1, --now and $KVLM_TEMPLATE_NOW, -m on a model directory
# (its template, BOS and EOS), --repeat's timing. KVLM_TEST_QUICK=1: half the
# conversations.
#
# Env: KVLM_BIN, KVLM_TEMPLATES (default ../shared/chat-templates).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
py=/usr/bin/python3
bin=${KVLM_BIN:-$root/build/kvlm}
templates=${KVLM_TEMPLATES:-$root/../shared/chat-templates}
models=${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-$root/../shared/models}}

if [ ! -x "$bin" ]; then echo "FAIL: kvlm binary not found at '$bin' (set KVLM_BIN)"; exit 1; fi
if ! "$py" -c 'import jinja2' 2>/dev/null; then
    echo "SKIP: jinja2 not available to $py (apt-get install python3-jinja2)"; exit 77
fi
if [ ! -d "$templates" ]; then echo "SKIP: $templates not found (set KVLM_TEMPLATES)"; exit 77; fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
pass() { passed=$((passed + 1)); echo "PASS: $*"; }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# ---- the oracle ----
quick=()
if [ -n "${KVLM_TEST_QUICK:-}" ]; then quick=(--quick); fi
if timeout -k 5 600 "$py" "$here/helpers/template_oracle.py" "$bin" "$templates" --snippets "${quick[@]}"; then
    pass "every template and snippet renders as jinja2 renders it"
else
    fail "the oracle found mismatches (above)"
fi

# ---- the command ----
export TZ=UTC
printf 'a{{ x }}' > "$tmp/t.jinja"
printf '{"x": "b\\u00e9"}' > "$tmp/c.json"
if "$bin" template "$tmp/t.jinja" "$tmp/c.json" > "$tmp/out" && [ "$(od -An -c "$tmp/out" | tr -d ' \n')" = "ab303251" ]; then
    pass "the text exactly, no newline added"
else
    fail "text: $(od -An -c "$tmp/out")"
fi

printf '{%% if messages[0].role == "system" %%}{{ raise_exception("System role not supported") }}{%% endif %%}' > "$tmp/r.jinja"
printf '{"messages": [{"role": "system", "content": "x"}]}' > "$tmp/r.json"
out=$("$bin" template "$tmp/r.jinja" "$tmp/r.json" 2>"$tmp/err"); rc=$?
if [ $rc -eq 1 ] && [ -z "$out" ] && grep -q "^kvlm template: System role not supported$" "$tmp/err"; then
    pass "raise_exception: its message, exit 1"
else
    fail "raise_exception: rc $rc, stdout '$out', stderr '$(cat "$tmp/err")'"
fi

printf 'one\n{{ x|nosuchfilter }}' > "$tmp/e.jinja"
"$bin" template "$tmp/e.jinja" "$tmp/c.json" > /dev/null 2>"$tmp/err"; rc=$?
if [ $rc -eq 1 ] && grep -q "line 2: no filter named 'nosuchfilter'" "$tmp/err"; then
    pass "a template error names the line"
else
    fail "template error: rc $rc, '$(cat "$tmp/err")'"
fi

printf '{{ strftime_now("%%Y-%%m-%%d %%H:%%M") }}' > "$tmp/d.jinja"
a=$("$bin" template --now 1700000000 "$tmp/d.jinja" "$tmp/c.json")
b=$(KVLM_TEMPLATE_NOW=1700000000 "$bin" template "$tmp/d.jinja" "$tmp/c.json")
if [ "$a" = "2023-11-14 22:13" ] && [ "$b" = "$a" ]; then
    pass "--now and \$KVLM_TEMPLATE_NOW pin strftime_now"
else
    fail "--now: '$a', env: '$b'"
fi

if "$bin" template --help | grep -- "--now EPOCH" >/dev/null && ! "$bin" template "$tmp/t.jinja" 2>/dev/null &&
   ! "$bin" template "$tmp/t.jinja" "$tmp/missing.json" 2>/dev/null; then
    pass "--help; a missing case is an error"
else
    fail "--help or missing arguments"
fi

# the timing figure: Qwen3's template, 8 messages (a tool call each way) and 3 tools
"$py" -c "import json, sys; sys.path.insert(0, sys.argv[1]); import template_oracle as t; \
print(json.dumps(dict(t.cases())['long_with_tools']))" "$here/helpers" > "$tmp/bench.json"
"$bin" template --repeat 200 "$templates/Qwen-Qwen3-0.6B.jinja" "$tmp/bench.json" > /dev/null 2>"$tmp/err"
if grep -q "200 renders, .* us per render" "$tmp/err"; then
    pass "--repeat: $(cat "$tmp/err")"
else
    fail "--repeat: '$(cat "$tmp/err")'"
fi

# -m: a model directory's own template, its BOS and EOS tokens unless the case gives them
if "$py" -c 'import numpy' 2>/dev/null && [ -f "$models/stories260K.gguf" ]; then
    "$py" "$root/scripts/hf_export.py" "$models/stories260K.gguf" "$tmp/hf" --vocab-only \
        --template '{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}' >/dev/null
    printf '{"messages": [{"role": "user", "content": "hi"}]}' > "$tmp/m.json"
    printf '{"messages": [{"role": "user", "content": "hi"}], "bos_token": "B", "eos_token": "E"}' > "$tmp/m2.json"
    a=$("$bin" template -m "$tmp/hf" "$tmp/m.json" 2>/dev/null)
    b=$("$bin" template -m "$tmp/hf" "$tmp/m2.json" 2>/dev/null)
    if [ "$a" = "<s>[user]hi</s>" ] && [ "$b" = "B[user]hiE" ]; then
        pass "-m DIR: the directory's template, its BOS and EOS"
    else
        fail "-m DIR: '$a' / '$b'"
    fi
    if ! "$bin" template -m "$tmp/hf" --name tool_use "$tmp/m.json" 2>"$tmp/err" && grep -q "no chat template named 'tool_use'" "$tmp/err"; then
        pass "--name: a template the model lacks is named"
    else
        fail "--name: '$(cat "$tmp/err")'"
    fi
else
    echo "SKIP (part): -m needs numpy and $models/stories260K.gguf"
fi

echo "cli_template: $passed passed, $failed failed"
[ $failed -eq 0 ]
