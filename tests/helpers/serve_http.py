"""tests/helpers/serve_http: the HTTP client side the `kvlm serve` script tests
share (python3 stdlib only): start a server on a free port, stop it, one
request, one streamed completion."""
import http.client
import json
import re
import signal
import subprocess


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


def request(port, method, path, body=None):
    """(status, the JSON answer, or its text when it is not JSON)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"})
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
