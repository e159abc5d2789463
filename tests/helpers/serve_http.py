"""tests/helpers/serve_http: the HTTP client side the `kvlm serve` script tests
share (python3 stdlib only): start a server on a free port, stop it, one
request, one streamed completion, many completions at once, the metrics, and `kvlm run`
alone as the reference."""
import http.client
import json
import re
import signal
import subprocess
import threading


def start(kvlm, model, extra):
    """`kvlm serve -m model --port 0 extra...`; returns (process, port), port 0
    (and the server's stderr printed) when it printed no listening line."""
    p = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0"] + list(extra), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", p.stdout.readline())
    if not m:
        print("no listening line; stderr: %s" % p.stderr.read())
    return p, int(m.group(1)) if m else 0


def stop(p):
    """SIGTERM, then its exit status (-1: killed after 60 s)."""
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        return -1


def request(port, method, path, body=None, raw=None, timeout=300):
    """(status, the JSON answer, or its text when it is not JSON); raw: bytes
    sent as they are instead of body as JSON."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data is not None else {})
    r = c.getresponse()
    text = r.read().decode("utf-8", "replace")
    c.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def stream(port, body):
    """A streamed /v1/completions: (its text, its finish reason)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    text, finish = "", None
    for raw in r:
        line = raw.decode().rstrip("\r\n")
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            ch = json.loads(line[6:])["choices"][0]
            text += ch.get("text") or ""
            finish = ch.get("finish_reason") or finish
    c.close()
    return text, finish


def stream_chat(port, body):
    """A streamed /v1/chat/completions of n choices: (each choice's text, each
    one's finish reason), by index."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/v1/chat/completions", body=json.dumps(dict(body, stream=True)),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    n = body.get("n", 1)
    texts, finish = [""] * n, [None] * n
    for raw in r:
        line = raw.decode().rstrip("\r\n")
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            for ch in json.loads(line[6:]).get("choices", []):
                texts[ch["index"]] += ch.get("delta", {}).get("content") or ""
                finish[ch["index"]] = ch.get("finish_reason") or finish[ch["index"]]
    c.close()
    return texts, finish


def at_once(fn, items, failed):
    """fn(item) for every item at once, a thread each: their results in order,
    failed(the exception) for one that raised."""
    results = [None] * len(items)

    def worker(i):
        try:
            results[i] = fn(items[i])
        except Exception as e:  # a failed request is a result the test checks
            results[i] = failed(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def stream_all(port, bodies):
    """The streamed completions of bodies, all at once: a list of (text,
    finish reason), (None, the exception's text) for one that failed."""
    return at_once(lambda b: stream(port, b), bodies, lambda e: (None, repr(e)))


def complete_all(port, bodies):
    """The /v1/completions of bodies, all at once, not streamed: each first
    choice's text, the exception's text for one that failed."""
    return at_once(lambda b: request(port, "POST", "/v1/completions", b)[1]["choices"][0]["text"], bodies, repr)


def metrics(port):
    """GET /metrics; returns a function from a metric's name to its value
    (-1 when it is not there)."""
    text = request(port, "GET", "/metrics")[1]

    def get(name):
        m = re.search(r"^%s (\S+)$" % name, text, re.M)
        return float(m.group(1)) if m else -1
    return get


def run_alone(kvlm, model, prompt, n, extra=()):
    """`kvlm run` greedy on the prompt alone (1 thread, context 512, and extra
    options): the text after the prompt, None when the output does not start with it."""
    r = subprocess.run([kvlm, "run", "-m", model, "-p", prompt, "-n", str(n), "--temp", "0", "-t", "1", "-c", "512"]
                       + list(extra), capture_output=True, text=True, timeout=120)
    return r.stdout[len(prompt):-1] if r.stdout.startswith(prompt) else None
