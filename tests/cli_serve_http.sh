#!/usr/bin/env bash
# tests/cli_serve_http: HTTP details of `kvlm serve` over raw loopback sockets:
# duplicate or conflicting Content-Length headers are refused (400, and the
# connection closed: its framing cannot be trusted); one header still works;
# an IPv6 listening address (--host ::1) serves /health and a completion; a
# client that half-closes its sending side after a whole request (HTTP/1.1 and
# 1.0, whole and streamed answers) still gets its whole answer, equal to a
# normal client's.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout 60 python3 - "$KVLM" "$MODEL" <<'PY'
import json, re, socket, subprocess, sys

kvlm, model = sys.argv[1], sys.argv[2]
proc = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-c", "256", "-t", "1"],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
m = re.fullmatch(r"kvlm serve: listening on http://127\.0\.0\.1:(\d+)\n", proc.stdout.readline())
if not m:
    proc.kill(); print("FAIL: no listening line"); sys.exit(1)
port = int(m.group(1))
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[:400]))
    failures += not cond

def raw(data):
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(data)
    out = b""
    while True:
        d = s.recv(65536)
        if not d: break
        out += d
    s.close()
    return out

body = json.dumps({"prompt": "Once", "max_tokens": 4, "temperature": 0}).encode()
head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
for name, cls in [("duplicate", (len(body), len(body))), ("conflicting", (len(body), len(body) + 5)),
                  ("conflicting, shorter first", (2, len(body)))]:
    out = raw(head + b"".join(b"Content-Length: %d\r\n" % n for n in cls) + b"\r\n" + body)
    check(out.startswith(b"HTTP/1.1 400") and b"Content-Length headers" in out and b"Connection: close" in out,
          "%s Content-Length headers are refused with a 400 and the connection closed" % name, out)
out = raw(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
check(out.startswith(b"HTTP/1.1 200") and b'"finish_reason"' in out, "one Content-Length: answered", out)

# ---- half-close: the request, then shutdown(SHUT_WR), then read the answer to its end
def half_closed(data):
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    while True:
        d = s.recv(65536)
        if not d: break
        out += d
    s.close()
    return out

def answer_text(out):
    i = out.find(b"\r\n\r\n", out.find(b"HTTP/1.1 200") if b"HTTP/1.1 200" in out else out.find(b"HTTP/1.0 200"))
    try: return json.loads(out[i + 4:])["choices"][0]["text"]
    except Exception: return None

def dechunk(out):
    """The body of a chunked answer (an event may span chunks: a slow reader's writes join and split them)."""
    i = out.find(b"\r\n\r\n", out.find(b"HTTP/1.1 200"))
    if i < 0: return None
    body, i = b"", i + 4
    while True:
        j = out.find(b"\r\n", i)
        if j < 0: return None
        size = int(out[i:j].split(b";")[0], 16)
        if size == 0: return body
        body += out[j + 2:j + 2 + size]
        i = j + 2 + size + 2

def stream_text(out):
    body = dechunk(out)
    if body is None or b"data: [DONE]" not in body: return None
    return "".join(json.loads(l[6:])["choices"][0]["text"] for l in body.split(b"\n") if l.startswith(b"data: {"))

long_body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}).encode()
ref = answer_text(raw(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(long_body) + long_body))
check(ref and len(ref) > 200, "reference answer (200 tokens)", ref)
out = half_closed(head + b"Content-Length: %d\r\n\r\n" % len(long_body) + long_body)
check(answer_text(out) == ref, "HTTP/1.1, half-closed after the request: the whole answer (%d bytes)" % len(out), out[:300])
check(out.startswith(b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200") or out.startswith(b"HTTP/1.1 200"),
      "... after at most an interim 102", out[:120])
out = half_closed(head.replace(b"HTTP/1.1", b"HTTP/1.0") + b"Content-Length: %d\r\n\r\n" % len(long_body) + long_body)
check(re.match(rb"HTTP/1\.[01] 200", out) is not None and answer_text(out) == ref,
      "HTTP/1.0, half-closed: the whole answer, no 1xx",
      out[:300])
sbody = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
out = half_closed(head + b"Content-Length: %d\r\n\r\n" % len(sbody) + sbody)
check(stream_text(out) == ref, "streamed, half-closed: every event and [DONE], the same text", out[-300:])
proc.terminate()
proc.wait(timeout=20)

if not socket.has_ipv6:
    print("ok   (no IPv6 in this Python: the --host ::1 case not run)")
else:
    p6 = subprocess.Popen([kvlm, "serve", "-m", model, "--host", "::1", "--port", "0", "-c", "256", "-t", "1"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p6.stdout.readline()
    m6 = re.fullmatch(r"kvlm serve: listening on http://\[::1\]:(\d+)\n", line)
    check(m6 is not None, "--host ::1 listens (%r)" % line, p6.stderr.read() if not m6 and p6.poll() is not None else "")
    if m6:
        s = socket.create_connection(("::1", int(m6.group(1))), timeout=20)
        s.sendall(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        out = b""
        while True:
            d = s.recv(65536)
            if not d: break
            out += d
        s.close()
        check(out.startswith(b"HTTP/1.1 200") and b'"finish_reason"' in out, "a completion over IPv6 (::1)", out)
    p6.terminate()
    p6.wait(timeout=20)
print("%d failures" % failures)
sys.exit(1 if failures else 0)
PY
