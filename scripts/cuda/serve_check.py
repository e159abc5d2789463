#!/usr/bin/env python3
"""kvlm serve --device cuda: 32 concurrent greedy completions, each equal to
the same request sent alone. Usage: serve_check.py KVLM MODEL"""
import json, socket, subprocess, sys, threading, time, urllib.request

kvlm, model = sys.argv[1], sys.argv[2]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
srv = subprocess.Popen([kvlm, "serve", "-m", model, "--port", str(port), "--device", "cuda",
                        "--max-seqs", "32", "-c", "512"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
base = f"http://127.0.0.1:{port}"
try:
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=1).read(); break
        except Exception:
            if srv.poll() is not None:
                sys.exit("server died: " + srv.stderr.read().decode()[-2000:])
            time.sleep(0.1)
    words = "Once upon a time there was a little girl named Lily who loved to play in the park with her dog".split()
    prompts = [" ".join(words[i % 7: i % 7 + 3 + i % 11]) for i in range(32)]

    def complete(p):
        body = json.dumps({"prompt": p, "max_tokens": 48, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]

    together = [None] * 32
    def worker(i): together[i] = complete(prompts[i])
    t0 = time.time()
    ths = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    [t.start() for t in ths]; [t.join() for t in ths]
    t_conc = time.time() - t0
    t0 = time.time()
    alone = [complete(p) for p in prompts]
    t_alone = time.time() - t0
    bad = [i for i in range(32) if together[i] != alone[i]]
    status = json.loads(urllib.request.urlopen(base + "/kvlm/status", timeout=5).read())
    print(f"32 concurrent: {t_conc:.2f} s; one at a time: {t_alone:.2f} s")
    print(f"sample: {prompts[0]!r} -> {together[0][:80]!r}")
    print("kv:", json.dumps(status.get("kv", status))[:300])
    if bad:
        for i in bad[:3]: print("DIFF", i, repr(together[i]), repr(alone[i]))
        sys.exit(f"FAILED: {len(bad)} of 32 concurrent answers differ from the same request alone")
    print("PASSED: 32 concurrent greedy requests through the GPU server equal each alone")
finally:
    srv.terminate()
    try: srv.wait(10)
    except Exception: srv.kill()
