#!/usr/bin/env bash
# tests/cli_serve_slow_reader: a client that reads its answer a trickle at a time cannot
# hold its connection, or the kernel's memory, for good (loopback only, python3 stdlib,
# about 15 s). MHD's idle timeout (--timeout) is reset by every write the trickle lets
# through, and a socket MHD closes is left to the kernel, which delivers its queue for as
# long as the client reads; the send deadline (--send-timeout) is neither: an answer must
# be delivered S seconds after it is made, or the connection is reset. Against
# `--timeout 2 --send-timeout 6`, on stories260K:
#   - 4 clients read a 1.2 MB stream (n = 8, logprobs) 2 KiB every 0.25 s, and 4 read a
#     0.5 MB whole answer the same way: each is still receiving after the idle timeout
#     (a trickle, not silence), is cut off 5.5-21 s after its request (not before its
#     deadline; the end depends on when its answer was made, 1-2 s in on a quiet
#     machine; 46 s in a sanitizer build, KVLM_TEST_QUICK), and never gets the end of
#     its answer;
#   - one client that reads nothing is closed too;
#   - then no socket of the server's port holds answer bytes in the kernel (/proc/net/tcp);
#   - meanwhile and afterwards a normal client gets the same answers whole ([DONE], the
#     Content-Length's bytes, or a chunked JSON when the answer took longer than the
#     keep-alive interval) and /health, and the server is still running.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout -k 5 180 python3 - "$KVLM" "$MODEL" "$(cd "$(dirname "$0")" && pwd)/helpers" <<'PY'
import http.client, json, os, socket, sys, threading, time

kvlm, model = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import serve_http
IDLE_T, SEND_T = 2, 6
# how late after its deadline a reader may be cut off: its answer is made 1-2 s in here,
# up to half a minute in a sanitizer build on a loaded machine
LATE = 40 if os.environ.get("KVLM_TEST_QUICK") else 15
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)), flush=True)
    failures += 0 if cond else 1

proc, port = serve_http.start(kvlm, model, ["-t", "1", "--timeout", str(IDLE_T), "--send-timeout", str(SEND_T),
                                             "--max-seqs", "64"])
if not port:
    print("FAIL: no listening line")
    sys.exit(1)

def queued():
    """The server's sockets (its own or left to the kernel) that still hold answer bytes:
    (how many, bytes), from /proc/net/tcp's tx_queue."""
    n = total = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if int(cols[1].split(":")[1], 16) != port: continue
            tx = int(cols[4].split(":")[0], 16)
            if tx: n, total = n + 1, total + tx
    return n, total

def body(stream, seed):
    return json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "n": 8, "stream": stream, "logprobs": 5,
                       "temperature": 1, "seed": seed})

def request(stream, seed):
    b = body(stream, seed).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(b)) + b

def whole(stream, seed):
    """A normal client: the answer's size and whether it ended as it should."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v1/completions", body=body(stream, seed), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    cl = r.getheader("Content-Length") # none: made in more than the keep-alive interval (chunked)
    ok = r.status == 200 and (data.rstrip().endswith(b"data: [DONE]") if stream else
                              (len(data) == int(cl) if cl else r.getheader("Transfer-Encoding") == "chunked") and
                              json.loads(data)["choices"])
    return len(data), ok

def trickle(stream, seed, out, chunk=2048, every=0.25, read=True):
    """Reads chunk bytes every `every` s (or nothing) until the server closes; out gets
    (seconds to the close, bytes read, bytes read after the idle timeout, the end seen)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request(stream, seed))
    t0, got, late, tail, closed = time.monotonic(), 0, 0, b"", None
    s.settimeout(5)
    while time.monotonic() - t0 < SEND_T + LATE + 10:
        if not read:  # the socket's TCP state: established until the server's FIN or reset
            time.sleep(0.25)
            if s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1:
                closed = time.monotonic() - t0
                break
            continue
        try:
            d = s.recv(chunk)
        except socket.timeout:  # the answer is not made yet (a slow build): wait on
            continue
        except OSError:
            d = b""
        if not d:
            closed = time.monotonic() - t0
            break
        got += len(d)
        if time.monotonic() - t0 > IDLE_T + 1: late += len(d)
        tail = (tail + d)[-4096:]
        time.sleep(every)
    s.close()
    ended = tail.rstrip().endswith(b"data: [DONE]") if stream else tail.rstrip().endswith(b"}}")
    out.append((closed, got, late, ended))

size_s, ok_s = whole(True, 1)
size_w, ok_w = whole(False, 1)
check(ok_s and size_s > 600_000, "a normal client reads the stream whole (%d bytes, [DONE])" % size_s)
check(ok_w and size_w > 300_000, "a normal client reads the whole answer (%d bytes)" % size_w)

results = {True: [], False: []}
silent = []
threads = [threading.Thread(target=trickle, args=(st, 10 + i, results[st])) for st in (True, False) for i in range(4)]
threads.append(threading.Thread(target=trickle, args=(True, 99, silent), kwargs={"read": False}))
t_start = time.monotonic()
for t in threads: t.start()
time.sleep(1)
h = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
h.request("GET", "/health")
check(h.getresponse().status == 200, "/health answers with the slow readers open")
h.close()
size2, ok2 = whole(True, 2)
check(ok2, "a normal client's stream is whole with the slow readers open (%d bytes)" % size2)
time.sleep(max(0, IDLE_T + 3 - (time.monotonic() - t_start)))
n_q, b_q = queued()
print("%.0f s in: %d of the server's sockets hold %.1f MB of answers in the kernel" %
      (time.monotonic() - t_start, n_q, b_q / 1e6), flush=True)
for t in threads: t.join()
n_q, b_q = queued()
check(n_q == 0, "when they are cut off, no socket of the server's holds answer bytes (%d hold %d bytes)" % (n_q, b_q))

for st, name in ((True, "stream"), (False, "whole answer")):
    rs = results[st]
    closes = sorted(r[0] for r in rs if r[0] is not None)
    print("%s trickle readers: closed after %s s; bytes read %s; after the idle timeout %s" %
          (name, ["%.1f" % c for c in closes], [r[1] for r in rs], [r[2] for r in rs]), flush=True)
    check(len(rs) == 4 and len(closes) == 4, "every %s trickle reader is closed by the server" % name)
    check(all(r[2] > 0 for r in rs), "each %s trickle reader still received bytes after the idle timeout "
          "(%d s): a trickle, not silence" % (name, IDLE_T))
    check(all(SEND_T - 0.5 <= c <= SEND_T + LATE for c in closes),
          "each %s trickle reader is cut off %d-%d s after its request" % (name, SEND_T, SEND_T + LATE), closes)
    check(not any(r[3] for r in rs) and all(r[1] < (size_s if st else size_w) for r in rs),
          "no %s trickle reader got the end of its answer" % name)
check(len(silent) == 1 and silent[0][0] is not None and silent[0][0] <= SEND_T + LATE,
      "a client that reads nothing is closed (after %.1f s)" % (silent[0][0] if silent and silent[0][0] else -1))

size3, ok3 = whole(True, 1)
check(ok3, "afterwards a normal client reads the stream whole (%d bytes)" % size3)
check(proc.poll() is None, "the server is still running")
serve_http.stop(proc)
print("cli_serve_slow_reader: %s" % ("all passed" if not failures else "%d failed" % failures))
sys.exit(1 if failures else 0)
PY
