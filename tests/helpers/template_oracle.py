#!/usr/bin/python3
"""tests/helpers/template_oracle: every chat template of a folder rendered with
every case below by Jinja2 exactly as Hugging Face transformers renders it
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, its
tojson, raise_exception, strftime_now and the generation tag) and by
`kvlm template --batch`; each pair must be byte-identical, or both must fail
(and where the template called raise_exception, with the same message).

usage: template_oracle.py KVLM TEMPLATE_DIR [--now EPOCH] [--only NAME] [--dump DIR] [--quick]
Prints a summary line; exit 1 on any mismatch (the first few diffed).
"""
import argparse
import copy
import difflib
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class RaisedError(Exception):
    pass


def current_sandbox():
    """Jinja2 3.1.5 made the immutable sandbox refuse list.pop and list.clear
    (Debian bookworm's 3.1.2 lets them through): the oracle is today's Jinja2."""
    import jinja2.sandbox as sb
    from collections import abc
    sb._mutable_spec = tuple((t, s | {"pop", "clear"}) if t is abc.MutableSequence else (t, s)
                             for t, s in sb._mutable_spec)


def hf_environment(now):
    """transformers' _compile_jinja_template, with strftime_now pinned to `now`."""
    current_sandbox()

    class AssistantTracker(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        def _generation_support(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(now).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# ---- the conversations ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city, with \"quotes\" and a backslash \\ in it.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "object", "description": "Where", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "country": {"type": "string", "enum": ["CH", "FR", "JP"]}}, "required": ["city"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
        "days": {"type": "integer", "description": "Days ahead", "default": 10, "minimum": 0, "maximum": 14},
        "precision": {"type": "number", "description": "Rounding step", "default": 1.5},
        "scale": {"type": "number", "default": 1.0}},
        "required": ["location"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "description": "Search the web.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "What to look for"},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Filters"},
        "limit": {"type": ["integer", "null"], "description": "Most results"}},
        "required": ["query"]}}}
CALC = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

ARGS = {"location": {"city": "Zürich", "country": "CH"}, "unit": "celsius", "days": 3, "precision": 0.5}


def call(i, name, args, as_string=False, id_len9=True):
    cid = ("abc12345" + str(i))[:9] if id_len9 else "call_%d_xyz" % i
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}}


def cases():
    sys_msg = {"role": "system", "content": "You are a helpful assistant."}
    u = lambda t: {"role": "user", "content": t}
    a = lambda t: {"role": "assistant", "content": t}
    out = []

    def add(name, messages, **kw):
        c = {"messages": messages, "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
        c.update(kw)
        out.append((name, c))

    add("one_user", [u("Hello!")])
    add("system_multi_turn", [sys_msg, u("Hi"), a("Hello! How can I help?"), u("Tell me a joke.")])
    add("no_system_end_assistant", [u("Hi"), a("Hello."), u("What is 2+2?"), a("4")], add_generation_prompt=False)
    add("tools_query", [sys_msg, u("What's the weather in Zürich?")], tools=[WEATHER, SEARCH])
    add("tool_call_object_args", [u("Weather in Zürich, 3 days?"),
                                  {"role": "assistant", "content": "", "tool_calls": [call(1, "get_weather", ARGS)]},
                                  {"role": "tool", "tool_call_id": "abc123451", "name": "get_weather",
                                   "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
                                  a("It is 21.5 °C and clear.")], tools=[WEATHER], add_generation_prompt=False)
    add("tool_call_string_args", [sys_msg, u("Weather in Zürich?"),
                                  {"role": "assistant", "content": None,
                                   "tool_calls": [call(2, "get_weather", ARGS, as_string=True)]},
                                  {"role": "tool", "tool_call_id": "abc123452", "name": "get_weather",
                                   "content": "21.5 degrees"}], tools=[WEATHER, SEARCH])
    add("two_tool_calls", [u("Weather, and search news"),
                           {"role": "assistant", "content": "Let me check.",
                            "tool_calls": [call(3, "get_weather", {"location": {"city": "Tokyo"}}),
                                           call(4, "search", {"query": "news", "tags": ["world", "日本"], "limit": 10})]},
                           {"role": "tool", "tool_call_id": "abc123453", "name": "get_weather", "content": "Sunny"},
                           {"role": "tool", "tool_call_id": "abc123454", "name": "search",
                            "content": "[{\"title\": \"x\"}]"}], tools=[WEATHER, SEARCH, CALC])
    add("tool_ids_long", [u("Compute 2*21"),
                          {"role": "assistant", "content": "",
                           "tool_calls": [call(5, "calculate", {"expression": "2*21"}, id_len9=False)]},
                          {"role": "tool", "tool_call_id": "call_5_xyz", "name": "calculate", "content": "42"},
                          a("42.")], tools=[CALC], add_generation_prompt=False)
    add("reasoning_thinking_on", [u("Why is the sky blue?"),
                                  {"role": "assistant", "content": "Rayleigh scattering.",
                                   "reasoning_content": "Short wavelengths scatter more."},
                                  u("And sunsets?")], enable_thinking=True)
    add("thinking_off", [sys_msg, u("Quick answer: capital of France?")], enable_thinking=False)
    add("reasoning_last_assistant", [u("2+2?"),
                                     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4",
                                      "reasoning_content": "add them"}],
        add_generation_prompt=False, enable_thinking=True)
    add("non_ascii", [{"role": "system", "content": "Réponds en français. « guillemets » et 'apostrophes'."},
                      u("你好，世界！🌍🚀 Ünïcödé — \"quoted\" and back\\slash\\n and a\ttab\nnew line"),
                      a("こんにちは 😀 naïve café"), u("Ça va? 👍🏽")])
    add("empty_content", [sys_msg, u(""), a(""), u("still there?")])
    add("content_parts", [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                          {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                       {"type": "text", "text": "this: ✓ done"}]}])
    add("starts_with_assistant", [a("Welcome!"), u("Thanks"), a("Anything else?"), u("No.")],
        add_generation_prompt=False)
    add("reasoning_effort_high", [sys_msg, u("Plan a trip.")], reasoning_effort="high", tools=[SEARCH])
    add("long_with_tools", [sys_msg, u("Weather in Paris?"),
                            {"role": "assistant", "content": "",
                             "tool_calls": [call(6, "get_weather", {"location": {"city": "Paris", "country": "FR"}})]},
                            {"role": "tool", "tool_call_id": "abc123456", "name": "get_weather", "content": "18 C"},
                            a("18 °C in Paris."), u("And Tokyo?"),
                            {"role": "assistant", "content": "",
                             "reasoning_content": "Call the tool again.",
                             "tool_calls": [call(7, "get_weather", {"location": {"city": "Tokyo"}}, as_string=True)]},
                            {"role": "tool", "tool_call_id": "abc123457", "name": "get_weather", "content": "25 C"}],
        tools=[WEATHER, SEARCH, CALC], enable_thinking=True)
    add("gen_prompt_false_user_last", [u("Just this.")], add_generation_prompt=False)
    add("documents_and_no_param_tool", [sys_msg, u("Summarise the documents, then ping.")],
        documents=[{"title": "Doc A", "text": "Alpha \u00e9t\u00e9."}, {"title": "Doc B", "text": "Beta 2.0"}],
        tools=[{"type": "function", "function": {"name": "ping", "description": "No arguments.",
                                                 "parameters": {"type": "object", "properties": {}}}}])
    add("empty_args_tool_call", [u("ping"),
                                 {"role": "assistant", "content": None,
                                  "tool_calls": [call(8, "ping", {})]},
                                 {"role": "tool", "tool_call_id": "abc123458", "name": "ping", "content": ""}],
        tools=[{"type": "function", "function": {"name": "ping", "description": "No arguments.",
                                                 "parameters": {"type": "object", "properties": {}}}}])
    add("system_only", [sys_msg])
    return out


def render_py(env, tmpl, case):
    try:
        if isinstance(tmpl, Exception):
            raise tmpl
        return ("ok", tmpl.render(**copy.deepcopy(case)))  # a template may mutate (list.pop)
    except jinja2.exceptions.TemplateError as e:
        raised = type(e) is jinja2.exceptions.TemplateError  # raise_exception's exact class
        return ("raise" if raised else "fail", str(e))
    except Exception as e:  # TypeError, RecursionError, ... inside the template
        return ("fail", "%s: %s" % (type(e).__name__, e))


def snippets(o, env, tmp):
    """The small templates of jinja_snippets.py, each with its variables, in one kvlm process."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from jinja_snippets import SNIPPETS
    path = os.path.join(tmp, "snippets.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump([{"template": t, "vars": v} for t, v in SNIPPETS], f, ensure_ascii=False)
    p = subprocess.run([o.kvlm, "template", "--batch", "--now", str(o.now), path], capture_output=True, timeout=120,
                       env=dict(os.environ, TZ="UTC"))
    lines = p.stdout.decode("utf-8").split("\n")[:-1]
    bad, same, failed = [], 0, 0
    if len(lines) != len(SNIPPETS):
        return [("snippets", "-", "kvlm gave %d results for %d snippets: %s" % (len(lines), len(SNIPPETS), p.stderr))]
    for i, ((src, v), line) in enumerate(zip(SNIPPETS, lines)):
        k = json.loads(line)
        try:
            tmpl = env.from_string(src)
        except Exception as e:
            tmpl = e
        kind, text = render_py(env, tmpl, v)
        label = "#%d %r" % (i, src[:60])
        if kind == "ok" and k["ok"]:
            if k["text"] == text:
                same += 1
            else:
                bad.append(("snippet", label, "text differs:\n  jinja2: %r\n  kvlm:   %r" % (text, k["text"])))
        elif kind == "ok":
            bad.append(("snippet", label, "kvlm failed: %s (jinja2: %r)" % (k["error"], text)))
        elif k["ok"]:
            bad.append(("snippet", label, "jinja2 failed (%s), kvlm gave %r" % (text, k["text"])))
        elif kind == "raise" and k["error"] != text:
            bad.append(("snippet", label, "raise_exception message differs: %r / %r" % (text, k["error"])))
        else:
            failed += 1
            if o.verbose:
                print("both failed %s:\n  jinja2: %s\n  kvlm:   %s" % (label, text, k["error"]))
    print("snippet oracle: %d small templates: %d identical, %d failed in both, %d mismatches"
          % (len(SNIPPETS), same, failed, len(bad)))
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kvlm")
    ap.add_argument("templates")
    ap.add_argument("--now", type=int, default=1700000000)
    ap.add_argument("--only")
    ap.add_argument("--dump")
    ap.add_argument("--quick", action="store_true", help="half the cases")
    ap.add_argument("--show", type=int, default=5)
    ap.add_argument("--verbose", action="store_true", help="print every failure both gave")
    ap.add_argument("--snippets", action="store_true", help="also the small templates of jinja_snippets.py")
    o = ap.parse_args()
    os.environ["TZ"] = "UTC"
    env = hf_environment(o.now)
    all_cases = cases()
    if o.quick:
        all_cases = all_cases[::2]
    names = sorted(f for f in os.listdir(o.templates) if f.endswith(".jinja"))
    if o.only:
        names = [n for n in names if o.only in n]
    tmp = tempfile.mkdtemp(prefix="kvlm-oracle-")
    cases_path = os.path.join(tmp, "cases.json")
    with open(cases_path, "w", encoding="utf-8") as f:
        json.dump([c for _, c in all_cases], f, ensure_ascii=False)
    total = same = both_failed = raised = 0
    bad = []
    for name in names:
        path = os.path.join(o.templates, name)
        src = open(path, encoding="utf-8").read()
        try:
            tmpl = env.from_string(src)
        except Exception as e:  # the template does not compile: every case fails
            tmpl = e
        p = subprocess.run([o.kvlm, "template", "--batch", "--now", str(o.now), path, cases_path],
                           capture_output=True, timeout=120, env=dict(os.environ, TZ="UTC"))
        lines = p.stdout.decode("utf-8").split("\n")[:-1]
        if p.returncode != 0:  # the template did not parse
            lines = [json.dumps({"ok": False, "error": p.stderr.decode("utf-8", "replace").strip()})] * len(all_cases)
        if len(lines) != len(all_cases):
            bad.append((name, "-", "kvlm gave %d results for %d cases: %s" % (len(lines), len(all_cases), p.stderr)))
            continue
        for (cname, case), line in zip(all_cases, lines):
            total += 1
            k = json.loads(line)
            kind, text = render_py(env, tmpl, case)
            if o.dump:
                d = os.path.join(o.dump, name[:-6])
                os.makedirs(d, exist_ok=True)
                open(os.path.join(d, cname + ".py.txt"), "w").write(kind + "\n" + text)
                open(os.path.join(d, cname + ".kvlm.txt"), "w").write(
                    ("ok\n" + k["text"]) if k["ok"] else ("error\n" + k["error"]))
            if kind == "ok" and k["ok"]:
                if k["text"] == text:
                    same += 1
                else:
                    diff = "".join(difflib.unified_diff(text.splitlines(True), k["text"].splitlines(True),
                                                        "jinja2", "kvlm", n=1))
                    bad.append((name, cname, "text differs:\n" + diff[:3000]))
            elif kind == "ok":
                bad.append((name, cname, "kvlm failed: %s" % k["error"]))
            elif k["ok"]:
                bad.append((name, cname, "jinja2 failed (%s), kvlm rendered %d bytes" % (text, len(k["text"]))))
            elif kind == "raise" and not (text.startswith(k["error"]) and len(k["error"]) >= min(len(text), 500)):
                bad.append((name, cname, "raise_exception message differs:\n  jinja2: %r\n  kvlm:   %r"
                            % (text, k["error"])))
            else:
                both_failed += 1
                raised += kind == "raise"
                if o.verbose:
                    print("both failed %s / %s:\n  jinja2: %s\n  kvlm:   %s" % (name, cname, text, k["error"]))
    print("template oracle: %d templates x %d cases = %d renders: %d identical, %d failed in both "
          "(%d by raise_exception, same message), %d mismatches"
          % (len(names), len(all_cases), total, same, both_failed, raised, len(bad)))
    if o.snippets:
        bad += snippets(o, env, tmp)
    for name, cname, msg in bad[:o.show]:
        print("MISMATCH %s / %s: %s" % (name, cname, msg))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
