#!/usr/bin/env python3
"""bench/bench_chat_template: what rendering a model's own chat template costs a request,
against the request itself, in one script. For each template: the render alone (`kvlm
template --repeat`: the variables' JSON parsed, the template run) and, through `kvlm serve
--chat-template-file`, a chat request of 8 messages and 3 tools answered with one token,
its prompt new to the cache (cold) and seen before (warm: the prefix cache has all but its
last block), with `tools` and without (with them the server also builds the tool-call
grammar of `tool_choice: auto`). Prints medians and the render's share of each.

  python3 bench/bench_chat_template.py [--kvlm build/kvlm] [--model FILE] [-n 30] [-t 2]

Without --model it writes a random-weight model of the stories110M shape (12 layers of 768,
Q8_0, a 32,000-token vocabulary) to /tmp/kvlm-bench/tmpl110m-8k.gguf.
"""
import argparse, json, os, re, socket, statistics, subprocess, sys, tempfile, time, urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("--kvlm", default="build/kvlm")
ap.add_argument("--model")
ap.add_argument("--templates", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "chat-templates"))
ap.add_argument("-n", type=int, default=30)
ap.add_argument("-t", type=int, default=2)
a = ap.parse_args()

model = a.model
if not model:
    os.makedirs("/tmp/kvlm-bench", exist_ok=True)
    model = "/tmp/kvlm-bench/tmpl110m-8k.gguf"
    if not os.path.exists(model):
        subprocess.run([a.kvlm, "synth", model, "--dim", "768", "--layers", "12", "--heads", "12", "--kv-heads", "12",
                        "--hidden", "2048", "--vocab", "32000", "--ctx", "8192", "--type", "q8_0"], check=True,
                       capture_output=True)

tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": p, "required": list(p)}}} for n, d, p in [
    ("get_weather", "The weather at a place", {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}),
    ("search", "Search the web", {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}}),
    ("book", "Book a table", {"place": {"type": "string"}, "people": {"type": "integer"}, "at": {"type": "string"}})]]

def messages(tag):
    return [
        {"role": "system", "content": "You are a helpful assistant who plans days out. %s" % tag},
        {"role": "user", "content": "What is the weather in Paris tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "a1b2c3d4e", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "Tomorrow in Paris: 21 °C and a clear sky."},
        {"role": "user", "content": "Then find me a restaurant near the Seine for four people at eight."},
        {"role": "assistant", "content": "Shall I book one with a terrace, or inside?"},
        {"role": "user", "content": "A terrace, please."}]

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def post(port, body):
    r = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(r, timeout=600) as f:
            out = json.load(f)
    except urllib.error.HTTPError as e:
        sys.exit("bench_chat_template: %s: %s" % (e, e.read().decode()[:300]))
    return time.perf_counter() - t0, out

print("%-34s %9s | %12s %12s %12s %12s | %s" % ("template", "render", "cold, tools", "warm, tools", "cold", "warm",
                                                "render / warm with tools"))
tmp = tempfile.mkdtemp()
for name in ["Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct", "openai-gpt-oss-120b",
             "Mistral-Small-3.2-24B-Instruct-2506"]:
    path = os.path.join(a.templates, name + ".jinja")
    if not os.path.exists(path):
        print("%-34s (not found)" % name)
        continue
    case = os.path.join(tmp, "case.json")
    json.dump({"messages": messages("0"), "tools": tools, "add_generation_prompt": True, "bos_token": "<s>",
               "eos_token": "</s>"}, open(case, "w"))
    r = subprocess.run([a.kvlm, "template", path, case, "--repeat", "2000"], capture_output=True, text=True)
    m = re.search(r"([0-9.]+) us per render", r.stderr)
    if not m:
        print("%-34s render failed: %s" % (name, r.stderr.strip()[-200:]))
        continue
    render_us = float(m.group(1))
    port = free_port()
    srv = subprocess.Popen([a.kvlm, "serve", "-m", model, "--port", str(port), "-t", str(a.t), "--chat-template-file",
                            path, "--log-level", "warn"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    srv.stdout.readline()
    times = {}
    for with_tools in (True, False):
        cold, warm = [], []
        for i in range(a.n):
            body = {"messages": messages("%s-%d" % (with_tools, i)), "max_tokens": 1, "temperature": 0}
            if with_tools: body["tools"] = tools
            dt, _ = post(port, body)  # a new system message: the prompt is new to the cache
            cold.append(dt)
            dt, _ = post(port, body)  # the same again: all but its last block from the prefix cache
            warm.append(dt)
        times[with_tools] = (statistics.median(cold), statistics.median(warm))
    srv.terminate()
    srv.wait()
    ms = lambda s: "%9.2f ms" % (1e3 * s)
    print("%-34s %6.1f us | %12s %12s %12s %12s | %.2f%%" % (
        name[:34], render_us, ms(times[True][0]), ms(times[True][1]), ms(times[False][0]), ms(times[False][1]),
        100 * render_us * 1e-6 / times[True][1]))
