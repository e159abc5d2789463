#!/usr/bin/python3
"""tests/helpers/toolcall_roundtrip: the tool-call parsers against the chat
templates themselves. For every template in a folder, an assistant message
with tool calls (several, nested arguments, non-ASCII strings), content and
reasoning is rendered with Python's jinja2 exactly as Hugging Face renders it;
the text the assistant's turn adds to the generation prompt is what the model
would have written. kvlm parses it (test_chat_parse --roundtrip) with the
syntax it picks for that template, and the calls (names, arguments as JSON
values, order, ids where the template writes them), the content and the
reasoning must come back as they went in. test_chat_parse also parses every
prefix of each text as a stream would and checks that the deltas add up to
the whole parse.

usage: toolcall_roundtrip.py TEST_CHAT_PARSE_BINARY TEMPLATES_DIR [--verbose]
exit 0: every rendered case came back identical; 1: a mismatch (listed)."""
import datetime
import json
import os
import subprocess
import sys
import tempfile

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: json.dumps with ensure_ascii off by default
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return datetime.datetime(2025, 3, 14, 9, 26).strftime(fmt)


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    # DeepSeek V4's template names a from_json filter (Hugging Face has none;
    # it is used only on string arguments, which these cases do not pass, but
    # jinja2 refuses to compile a template that names an unknown filter)
    env.filters["from_json"] = json.loads
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather at a place",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "A city"},
            "days": {"type": "integer", "description": "How many days"},
            "details": {"type": "object", "description": "What to add", "properties": {
                "wind": {"type": "boolean"}, "hours": {"type": "array", "items": {"type": "integer"}}}},
        }, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Searches the documents",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to look for"},
            "filters": {"type": "object", "description": "Filters"},
            "limit": {"type": "number", "description": "Most results"},
            "exact": {"type": "boolean", "description": "Exact match"},
        }, "required": ["query"]}}},
]

# Command R+'s template reads every object parameter's additionalProperties
TOOLS_ALT = json.loads(json.dumps(TOOLS))
for _t in TOOLS_ALT:
    for _p in _t["function"]["parameters"]["properties"].values():
        if _p["type"] == "object":
            _p["additionalProperties"] = {}

CALLS = [
    ("get_weather", {"city": "Zürich", "days": 3, "details": {"wind": True, "hours": [6, 12, 18]}}),
    ("search_docs", {"query": "café \"crème\" — 東京\nsecond line", "filters": {"lang": ["fr", "ja"],
                     "nested": {"deep": [1, {"x": None}], "t": "ok"}}, "limit": 2.5, "exact": False}),
]
IDS = ["Abc123xyz", "Q9w8e7r6t"]  # Mistral's templates want 9 alphanumerics
REASONING = "The user wants the weather first; then the documents."
CONTENT = "Let me check both for you."
ANSWER = "It is sunny in Zürich — 22 °C."
ENDS = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|END_OF_TURN_TOKEN|>", "<|call|>", "<|return|>", "<|end|>",
        "<｜end▁of▁sentence｜>", "<turn|>", "<|message_sep|>", "</s>", "<|endoftext|>", "<sep>"]


_compiled = {}


def render(env, src, messages, gen, extra):
    t = _compiled.get(src)
    if t is None:
        t = _compiled[src] = env.from_string(src)
    ctx = dict(messages=messages, tools=extra.get("tools", TOOLS), add_generation_prompt=gen, bos_token="<s>", eos_token="</s>",
               functions=json.dumps([t["function"] for t in TOOLS]), datetime="2025-03-14")
    ctx.update({k: v for k, v in extra.items() if k != "tools"})
    return t.render(**ctx)


def assistant(calls, content, reasoning, string_args, with_ids):
    m = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
        m["thinking"] = reasoning  # gpt-oss's name for it
    if calls:
        m["tool_calls"] = [{"id": IDS[k] if with_ids else "call_%d" % k, "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False) if string_args else a}}
                           for k, (n, a) in enumerate(calls)]
    return m


# a generation prompt that ends with one of these has closed the reasoning
CLOSERS = ["</think>", "<|END_THINKING|>", "<channel|>", "[/THINK]", "</seed:think>"]
# where an assistant's turn ends (what follows belongs to the next turn)
TURN_ENDS = ["<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>", "<turn|>",
             "<|return|>", "<|call|>", "<|START_OF_TURN_TOKEN|>", "<|im_start|>", "<|start_header_id|>"]


def split_turn(prefix, header, full, reasoning):
    """(prompt tail, the turn's text) from the generation prompt (header: what
    add_generation_prompt adds) and the conversation rendered with the
    assistant's turn; raises when no model would write this turn after that
    generation prompt."""
    k = 0
    while k < min(len(prefix), len(full)) and prefix[k] == full[k]:
        k += 1
    lt = full.rfind("<", 0, k)  # not inside a marker
    if lt >= 0 and full.find(">", lt, k) < 0:
        k = lt
    rest = prefix[k:]
    tail = prefix
    h = full.find(header, max(0, k - len(header))) if header.strip() else -1
    if rest.strip() and 0 <= h <= k:
        # the template writes something after the conversation (Command R+'s
        # closing instructions) that the rendered turn comes before
        k, rest = h + len(header), ""
    if rest.strip():
        closes = any(c in rest for c in CLOSERS)
        if closes and reasoning is not None and reasoning in full[k:]:
            raise RuntimeError("the generation prompt closes the reasoning this turn has (%r)" % rest)
        if not closes:
            if reasoning is None:
                raise RuntimeError("the generation prompt ends with %r, the turn does not" % rest)
            tail = prefix[:k]
    text = full[k:]
    cut = min([text.find(e) for e in TURN_ENDS if e in text] or [len(text)])
    text = text[:cut]
    while True:
        s = text.rstrip()
        for e in ENDS:
            if s.endswith(e):
                s = s[:-len(e)]
                break
        else:
            break
        text = s
    return tail, text.rstrip()


def turn_text(env, src, calls, content, reasoning, extra):
    """The assistant turn's text after the generation prompt, trying the
    message shapes templates want (arguments as objects or strings, content
    '' or None, one call where several are refused): the first shape that
    renders the most calls."""
    user = {"role": "user", "content": "What is the weather in Zürich, and what do the documents say?"}
    last, best = None, None
    for ncalls in ([len(calls)] if len(calls) < 2 else [len(calls), 1]):
        for string_args in (False, True):
            for c in ([content] if content else ["", None]):
                msgs = [user, assistant(calls[:ncalls], c, reasoning, string_args, True)]
                try:
                    prefix = render(env, src, [user], True, extra)
                    bare = render(env, src, [user], False, extra)
                    j = 0
                    while j < min(len(prefix), len(bare)) and prefix[j] == bare[j]:
                        j += 1
                    full = render(env, src, msgs, False, extra)
                    tail, text = split_turn(prefix, prefix[j:], full, reasoning)
                except Exception as e:  # noqa: BLE001 (the template refused this shape)
                    last = e
                    continue
                score = sum(n in text for n, _ in calls[:ncalls])
                if best is None or score > best[0]:
                    best = (score, tail, text, calls[:ncalls])
    if best is None:
        raise RuntimeError("the template renders no such turn: %s" % last)
    return best[1], best[2], best[3]


def cases_for(env, name, src):
    """(case, expectation) pairs for one template."""
    out = []
    extra_sets = [{}]
    try:
        render(env, src, [{"role": "user", "content": "hi"}], True, {})
    except Exception:  # noqa: BLE001
        extra_sets = [{"tools": TOOLS_ALT}]
    if "enable_thinking" in src or "thinking" in src:
        extra_sets.append(dict(extra_sets[0], enable_thinking=True, thinking=True))
    shapes = [("calls", CALLS, None, None), ("calls+content", CALLS, CONTENT, None),
              ("calls+reasoning", CALLS, None, REASONING), ("answer+reasoning", [], ANSWER, REASONING)]
    for extra in extra_sets:
        for shape, calls, content, reasoning in shapes:
            try:
                prefix, text, calls_used = turn_text(env, src, calls, content, reasoning, extra)
            except Exception as e:  # noqa: BLE001
                out.append(({"skip": "%s: %s" % (shape, e)}, None))
                continue
            # what the template put in the turn is what must come back
            exp_calls = []
            for k, (n, a) in enumerate(calls_used):
                if n in text:
                    # an id the format writes before the arguments comes back
                    # (Mistral's [CALL_ID], Kimi's functions.name:k); one after
                    # them is too late for a stream and is made anew
                    i, kimi = text.find(IDS[k]), "functions.%s:%d" % (n, k)
                    first_arg = text.find(next(iter(a)), text.find(n))
                    exp_id = IDS[k] if 0 <= i < first_arg else kimi if kimi in text else None
                    exp_calls.append({"name": n, "arguments": a, "id": exp_id})
            exp = {"calls": exp_calls,
                   "content": content if content and content in text else None,
                   "reasoning": reasoning if reasoning and reasoning in text else None}
            if content and "<|channel|>analysis<|message|>" + content in text:
                # gpt-oss's template writes a calling turn's content as its analysis
                exp["content"], exp["reasoning"] = None, content
            tag = "%s %s%s" % (name, shape, " thinking" if "thinking" in extra else "")
            out.append(({"id": tag, "template": src, "prompt_tail": prefix[-200:], "text": text,
                         "tools": extra.get("tools", TOOLS)}, exp))
    return out


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    binary, folder = sys.argv[1], sys.argv[2]
    verbose = "--verbose" in sys.argv
    env = make_env()
    cases, exps = [], []
    skipped = {}
    for fn in sorted(os.listdir(folder)):
        if not fn.endswith(".jinja"):
            continue
        src = open(os.path.join(folder, fn), encoding="utf-8").read()
        name = fn[:-6]
        for case, exp in cases_for(env, name, src):
            if "skip" in case:
                skipped.setdefault(name, []).append(case["skip"])
                continue
            cases.append(case)
            exps.append(exp)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False)
        path = f.name
    try:
        r = subprocess.run([binary, "--roundtrip", path], capture_output=True, text=True, timeout=600)
    finally:
        if os.environ.get("KEEP_CASES"): print("cases:", path)
        else: os.unlink(path)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
        print("FAIL: %s --roundtrip exited %d" % (binary, r.returncode))
        return 1
    results = json.loads(r.stdout)
    bad = 0
    per_template = {}
    n_calls = 0
    for case, exp, res in zip(cases, exps, results):
        msg = res["message"]
        got_calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]), "id": c["id"]}
                     for c in msg.get("tool_calls") or []]
        problems = []
        if len(got_calls) != len(exp["calls"]):
            problems.append("%d calls, expected %d" % (len(got_calls), len(exp["calls"])))
        for g, e in zip(got_calls, exp["calls"]):
            if g["name"] != e["name"]:
                problems.append("name %r, expected %r" % (g["name"], e["name"]))
            if g["arguments"] != e["arguments"]:
                problems.append("arguments %s, expected %s" % (json.dumps(g["arguments"], ensure_ascii=False),
                                                                json.dumps(e["arguments"], ensure_ascii=False)))
            if e["id"] and g["id"] != e["id"]:
                problems.append("id %r, expected %r" % (g["id"], e["id"]))
        content = (msg.get("content") or "").strip() or None  # blanks around it are the format's
        if content != exp["content"]:
            problems.append("content %r, expected %r" % (content, exp["content"]))
        reasoning = msg.get("reasoning_content") or None
        if reasoning != exp["reasoning"]:
            problems.append("reasoning %r, expected %r" % (reasoning, exp["reasoning"]))
        if res.get("stream_error"):
            problems.append("streaming: " + res["stream_error"])
        t = case["id"].split(" ")[0]
        pt = per_template.setdefault(t, {"syntax": res["syntax"], "cases": 0, "calls": 0, "bad": 0, "reasoning": 0})
        pt["cases"] += 1
        pt["calls"] += len(exp["calls"])
        pt["reasoning"] += exp["reasoning"] is not None
        n_calls += len(exp["calls"])
        if problems:
            bad += 1
            pt["bad"] += 1
            print("MISMATCH %s [%s]:\n  text: %r\n  %s" % (case["id"], res["syntax"], case["text"][:600],
                                                         "\n  ".join(problems)))
        elif verbose:
            print("ok %s [%s]" % (case["id"], res["syntax"]))
    for t in sorted(set(list(per_template) + list(skipped))):
        pt = per_template.get(t)
        line = "%-48s" % t
        if pt:
            line += " %-16s %2d cases %2d calls %d reasoning %s" % (pt["syntax"], pt["cases"], pt["calls"],
                                                                    pt["reasoning"], "MISMATCH" if pt["bad"] else "ok")
        if t in skipped and verbose:
            line += "  (not rendered: %s)" % "; ".join(sorted(set(s[:80] for s in skipped[t])))
        print(line)
    n_with_calls = sum(1 for pt in per_template.values() if pt["calls"])
    print("%d templates, %d with calls rendered, %d cases, %d calls, %d mismatches" %
          (len(set(list(per_template) + list(skipped))), n_with_calls, len(cases), n_calls, bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
