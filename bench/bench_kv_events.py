#!/usr/bin/python3
"""bench/bench_kv_events: what `kvlm serve --kv-events` costs, over loopback.

Serves stories260K (the smallest model: the engine's steps are shortest there,
so the per-step cost of collecting and queueing events weighs most) with a
KV pool small enough that blocks are evicted and re-stored all the time, and
runs the same load of greedy completions (3 shared prefixes, distinct
suffixes, 8 clients) without and with --kv-events (a subscriber in this
process receiving every message), alternating A/B rounds. Prints generated
tokens/s of each, events and batches per second published, and the ratio of
throughput with events to without (1.0 = free). Needs Debian's python3-zmq
and python3-msgpack (hence /usr/bin/python3).

usage: /usr/bin/python3 bench/bench_kv_events.py [--kvlm build/kvlm] [--model M.gguf]
                                                 [--rounds 3] [--requests 480] [--kv-mem 480KiB]
"""
import argparse, http.client, json, os, re, subprocess, sys, threading, time
import msgpack, zmq


def serve(args, events_port):
    cmd = [args.kvlm, "serve", "-m", args.model, "--port", "0", "-c", "256", "--max-seqs", "8",
           "--kv-mem", args.kv_mem, "-t", str(args.threads)]
    if events_port:
        cmd += ["--kv-events", "tcp://127.0.0.1:%d" % events_port]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    m = re.search(r":(\d+)\n$", p.stdout.readline())
    if not m:
        sys.exit("bench_kv_events: kvlm serve did not start")
    return p, int(m.group(1))


def load(port, n, seed):
    prefixes = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ",
                "Tom and his dog went to the big forest to look for a hidden treasure. ",
                "One day, a small bird sat on the branch of a tall tree and sang a happy song. "]
    prompts = [prefixes[i % 3] + "Then friend %d came by on day %d." % (i, seed) for i in range(n)]
    gen = [0]
    lock = threading.Lock()

    def client(k):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for i in range(k, n, 8):
            c.request("POST", "/v1/completions", json.dumps({"prompt": prompts[i], "max_tokens": 32, "temperature": 0}),
                      {"Content-Type": "application/json"})
            r = json.loads(c.getresponse().read())
            with lock:
                gen[0] += r["usage"]["completion_tokens"]
        c.close()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in ts: t.start()
    for t in ts: t.join()
    return gen[0], time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models = os.environ.get("KVLM_MODELS", "../shared/models")
    ap.add_argument("--kvlm", default=os.environ.get("KVLM_BIN", "build/kvlm"))
    ap.add_argument("--model", default=os.path.join(models, "stories260K.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=480)
    ap.add_argument("--kv-mem", default="480KiB")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    zctx = zmq.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    zport = sub.bind_to_random_port("tcp://127.0.0.1")
    got = {"batches": 0, "events": 0, "bytes": 0}
    payloads = []
    stop = threading.Event()

    # Only receives while a round runs (the machine may have 2 cores): the
    # payloads are decoded and counted between rounds.
    def receive():
        while not stop.is_set():
            if sub.poll(50):
                payloads.append(sub.recv_multipart()[2])

    def count():
        while payloads:
            p = payloads.pop(0)
            got["batches"] += 1
            got["bytes"] += len(p)
            for ev in msgpack.unpackb(p)[1]:
                got["events"] += len(ev[1]) if ev[0] != "AllBlocksCleared" else 1

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    rates = {False: [], True: []}
    ev_rate, batch_rate = [], []
    for r in range(args.rounds):
        for with_events in (False, True):
            p, port = serve(args, zport if with_events else 0)
            if with_events:
                mon.poll(10000)
                time.sleep(0.2)
            load(port, 16, 1000 + r)  # warm-up: page faults, first blocks
            time.sleep(0.1)
            count()
            b0, e0 = got["batches"], got["events"]
            n, dt = load(port, args.requests, r)
            time.sleep(0.2)
            count()
            rates[with_events].append(n / dt)
            if with_events:
                ev_rate.append((got["events"] - e0) / dt)
                batch_rate.append((got["batches"] - b0) / dt)
            p.terminate()
            p.wait()
            print("round %d %-16s %8.1f generated tokens/s%s" % (
                r + 1, "--kv-events" if with_events else "no events", n / dt,
                "  %.0f events/s in %.0f batches/s" % (ev_rate[-1], batch_rate[-1]) if with_events else ""))
    stop.set()
    rx.join()
    best = {k: max(v) for k, v in rates.items()}
    print("best of %d: %.1f tokens/s without events, %.1f with; %.0f events/s, %.0f batches/s (%.0f bytes a batch)"
          % (args.rounds, best[False], best[True], max(ev_rate), max(batch_rate),
             got["bytes"] / max(got["batches"], 1)))
    print("throughput with --kv-events / without: %.3f" % (best[True] / best[False]))
    sub.close(0); mon.close(0); zctx.term()


if __name__ == "__main__":
    main()
