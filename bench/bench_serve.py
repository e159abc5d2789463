#!/usr/bin/env python3
"""bench/bench_serve: HTTP load benchmark of `kvlm serve` on loopback (python3 stdlib only).

Starts `kvlm serve` itself on a random-weight model of a real shape (stories110M, Q8_0,
written once to $KVLM_BENCH_DIR, default /tmp/kvlm-bench), then runs streaming greedy
completions with distinct prompts at concurrency 1, 4, 16 and 64 and prints, per level,
aggregate generated tokens/s and time to first token / time per output token (p50, p99),
then the ratio of aggregate tokens/s at 16 streams to 1 stream against the 4x target.
Bounded: a fixed number of requests per level, and no new request after --seconds.

usage: python3 bench/bench_serve.py [--kvlm build/kvlm] [--model M.gguf] [--levels 1,4,16,64]
                                    [--max-tokens 64] [--rounds 2] [--seconds 60] [--threads T]
                                    [--cache-type f32|f16|q8_0|...] [--no-stream]
                                    [--serve-args "--draft D.gguf --draft-n 4"]
"""
import argparse
import http.client
import json
import math
import os
import selectors
import shlex
import socket
import subprocess
import sys
import threading
import time

WORDS = ("once upon a time little girl boy dog cat park ball tree sun happy sad big small red blue "
         "friend mom dad play run jump sing bird fish house garden rain snow cake toy box").split()


def prompt_for(i):
    """A distinct prompt per request (distinct first block, so no request rides on another's prefix)."""
    w = [WORDS[(i * 7 + k * 13 + i // len(WORDS)) % len(WORDS)] for k in range(8)]
    return f"Story {i}: " + " ".join(w)


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[max(0, math.ceil(p / 100 * len(xs)) - 1)]  # nearest rank


class Stream:
    """One request on a non-blocking socket: the HTTP/1.1 response read as it arrives (chunked or not),
    server-sent events counted as they complete."""

    def __init__(self, host, port, i, max_tokens, stream, extra=None):
        req = {"prompt": prompt_for(i), "max_tokens": max_tokens, "temperature": 0, "stream": stream, **(extra or {})}
        if stream:
            req["stream_options"] = {"include_usage": True}
        body = json.dumps(req).encode()
        self.out = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
        self.i, self.stream = i, stream
        self.sock = socket.create_connection((host, port))
        self.sock.setblocking(False)
        self.t0 = time.perf_counter()
        self.raw, self.body, self.events = b"", b"", b""
        self.head = None          # (status, chunked) once the headers are in
        self.ended = False        # the body is complete
        self.first = self.last = None
        self.chunks, self.usage, self.done = 0, None, False

    def feed(self, data, now):
        """Takes bytes read from the socket (b"" at end of file); True when the response is complete."""
        if not data:
            self.ended = True
        self.raw += data
        if self.head is None:
            k = self.raw.find(b"\r\n\r\n")
            if k < 0:
                if self.ended:
                    raise RuntimeError(f"request {self.i}: connection closed before the headers")
                return False
            lines = self.raw[:k].decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            chunked = any(l.lower().startswith("transfer-encoding:") and "chunked" in l.lower() for l in lines[1:])
            self.head = (status, chunked)
            self.raw = self.raw[k + 4:]
        if self.head[1]:  # de-chunk what is whole
            while True:
                k = self.raw.find(b"\r\n")
                if k < 0:
                    break
                size = int(self.raw[:k].split(b";")[0], 16)
                if size == 0:
                    self.ended = True
                    break
                if len(self.raw) < k + 2 + size + 2:
                    break
                self.body += self.raw[k + 2:k + 2 + size]
                self.raw = self.raw[k + 2 + size + 2:]
        else:
            self.body += self.raw
            self.raw = b""
        if self.head[0] != 200:
            if self.ended:
                raise RuntimeError(f"HTTP {self.head[0]}: {self.body[:300]!r}")
            return False
        if self.stream:
            self.events += self.body
            self.body = b""
            self.scan(now)
        return self.ended or self.done

    def scan(self, now):
        # the client shares the server's cores: it splits events itself and parses only the usage
        # event's JSON (a token event is one whose text field is not empty)
        *evs, self.events = self.events.split(b"\n\n")
        for ev in evs:
            data = ev.strip()
            if not data.startswith(b"data:"):
                continue
            data = data[5:].strip()
            if data == b"[DONE]":
                self.done = True
                break
            if b'"usage"' in data:
                obj = json.loads(data)
                self.usage = obj.get("usage") or self.usage
                has_text = any(c.get("text") for c in obj.get("choices", []))
            else:
                has_text = b'"text":""' not in data and b'"text":' in data
            if has_text:
                self.first = self.first if self.first is not None else now
                self.last = now
                self.chunks += 1

    def result(self):
        """(completion tokens, ttft s, tpot s or None); not streamed: (completion tokens, None, None)."""
        if not self.stream:
            return json.loads(self.body)["usage"]["completion_tokens"], None, None
        n = self.usage["completion_tokens"] if self.usage else self.chunks
        if self.first is None:
            raise RuntimeError(f"request {self.i}: no text streamed")
        return n, self.first - self.t0, (self.last - self.first) / (n - 1) if n > 1 else None


def run_level(host, port, conc, n_requests, max_tokens, seconds, first_id, stream=True, extra=None):
    """conc requests in flight at a time, n_requests in all, none started after the deadline; one thread
    drives every connection (an event loop, as vLLM's and SGLang's load generators do), so the client
    takes as little of the cores it shares with the server as it can. extra: more request fields (any
    OpenAI-compatible server: bench/peers.py points it at llama-server). Returns the level's figures."""
    sel = selectors.DefaultSelector()
    res = {"tokens": 0, "ttft": [], "tpot": [], "done": 0}
    t0 = time.perf_counter()
    deadline = t0 + seconds
    started = 0

    def start():
        nonlocal started
        s = Stream(host, port, first_id + started, max_tokens, stream, extra)
        started += 1
        sel.register(s.sock, selectors.EVENT_WRITE, s)

    try:
        while started < min(conc, n_requests):
            start()
        while sel.get_map():
            for key, ev in sel.select():
                s = key.data
                if ev & selectors.EVENT_WRITE:
                    n = s.sock.send(s.out)
                    s.out = s.out[n:]
                    if not s.out:
                        sel.modify(s.sock, selectors.EVENT_READ, s)
                    continue
                try:
                    data = s.sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError):
                    continue
                if not s.feed(data, time.perf_counter()):
                    continue
                sel.unregister(s.sock)
                s.sock.close()
                n, ttft, tpot = s.result()
                res["tokens"] += n
                res["done"] += 1
                if ttft is not None:
                    res["ttft"].append(ttft)
                if tpot is not None:
                    res["tpot"].append(tpot)
                if started < n_requests and time.perf_counter() <= deadline:
                    start()
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    wall = time.perf_counter() - t0
    return {"conc": conc, "requests": res["done"], "tokens": res["tokens"], "wall": wall,
            "tps": res["tokens"] / wall, "ttft": res["ttft"], "tpot": res["tpot"]}


def get_json(host, port, path):
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return json.loads(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvlm", default=os.environ.get("KVLM_BIN", "build/kvlm"))
    ap.add_argument("--model", help="model to serve (default: a stories110M-shape Q8_0 random-weight model)")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency (at least 4)")
    ap.add_argument("--seconds", type=float, default=60, help="no new request after this long in a level")
    ap.add_argument("--threads", type=int, default=0, help="kvlm serve -t (default: its own)")
    ap.add_argument("--kv-mem", default="1GiB")
    ap.add_argument("--cache-type", help="kvlm serve --cache-type-k and -v (default: its own)")
    ap.add_argument("--no-stream", action="store_true",
                    help="whole answers instead of streamed tokens (no TTFT / TPOT): the cost of streaming")
    ap.add_argument("--serve-args", default="", help="more kvlm serve options, e.g. \"--draft D.gguf\" or \"--spec lookup\"")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]

    model = a.model
    if not model:
        d = os.environ.get("KVLM_BENCH_DIR", "/tmp/kvlm-bench")
        os.makedirs(d, exist_ok=True)
        model = os.path.join(d, "stories110M-q8_0-c1024.gguf")
        if not os.path.exists(model):
            print(f"  (writing {model} ...)", file=sys.stderr)
            subprocess.run([a.kvlm, "synth", model + ".tmp", "--dim", "768", "--layers", "12", "--heads", "12",
                            "--kv-heads", "12", "--hidden", "2048", "--vocab", "32000", "--ctx", "1024",
                            "--type", "q8_0"], check=True, stdout=subprocess.DEVNULL)
            os.replace(model + ".tmp", model)

    cmd = [a.kvlm, "serve", "-m", model, "--host", "127.0.0.1", "--port", "0", "--max-seqs", str(max(levels)),
           "--kv-mem", a.kv_mem]
    if a.threads:
        cmd += ["-t", str(a.threads)]
    if a.cache_type:
        cmd += ["--cache-type-k", a.cache_type, "--cache-type-v", a.cache_type]
    cmd += shlex.split(a.serve_args)
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        if not line.startswith("kvlm serve: listening on http://"):
            srv.kill()
            sys.exit(f"kvlm serve did not start: {line!r} {srv.stderr.read()[-2000:]}")
        for pipe in (srv.stdout, srv.stderr):  # keep its pipes drained
            threading.Thread(target=pipe.read, daemon=True).start()
        host, port = line.strip().rsplit("//", 1)[1].rsplit(":", 1)
        port = int(port)
        print(f"kvlm serve {os.path.basename(model)} {a.serve_args} on {host}:{port}, {os.cpu_count()} cores, "
              f"{'whole' if a.no_stream else 'streaming'} greedy completions of {a.max_tokens} tokens, distinct prompts")
        run_level(host, port, 1, 1, 8, a.seconds, 10 ** 6)  # warm-up: page the weights in
        print(f"{'streams':>7} {'requests':>8} {'tokens':>7} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'preempt':>7}")
        res, next_id = {}, 0
        for c in levels:
            n = max(4, a.rounds * c)
            r = run_level(host, port, c, n, a.max_tokens, a.seconds, next_id, not a.no_stream)
            next_id += n
            st = get_json(host, port, "/kvlm/status")
            res[c] = r
            ms = lambda x: f"{1000 * x:7.1f}ms" if x == x else f"{'-':>9}"  # noqa: E731 (nan: not measured)
            print(f"{c:>7} {r['requests']:>8} {r['tokens']:>7} {r['tps']:>9.1f} {ms(percentile(r['ttft'], 50))} "
                  f"{ms(percentile(r['ttft'], 99))} {ms(percentile(r['tpot'], 50))} {ms(percentile(r['tpot'], 99))} "
                  f"{st.get('preemptions', 0):>7}", flush=True)
        if 1 in res and 16 in res:
            ratio = res[16]["tps"] / res[1]["tps"]
            print(f"aggregate tokens/s at 16 streams / 1 stream: {ratio:.2f}x (target >= 4x: "
                  f"{'met' if ratio >= 4 else 'NOT met'})")
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()


if __name__ == "__main__":
    main()
