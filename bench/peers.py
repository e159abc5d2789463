#!/usr/bin/env python3
"""bench/peers: kvlm against llama.cpp and ik_llama.cpp: same machine, same run, same GGUFs (python3 stdlib).

Run it through bench/peers.sh, which builds the peers from ../shared/peers once (outside the repo) and
passes their folder here. Random-weight GGUFs (kvlm synth) of real shapes, written once to --models.
For each shape and weight type, alternating the three engines run by run (the first engine rotates),
medians of --runs runs:
  pp512, tg128      llama-bench -p 512 -n 128 -r 1 -fa 1 (ik_llama.cpp: also -rtr 1) against
                    kvlm run: a 512-token prompt with -n 0 (prefill tokens/s) and the BOS alone with
                    -n 128 --ignore-eos (decode tokens/s)
  decode at depth   llama-batched-bench -npp D -ntg 128 -npl 1 -fa (S_TG) against kvlm run with a
                    D-token prompt and -n 128 (decode tokens/s), f16 and q8_0 caches
  streams           llama-server -np S -c S*256 -fa against kvlm serve -np S -c S*256, all three up at
                    once and driven in turn by bench_serve.py's event-loop client: S streams, 2*S
                    greedy completions of --stream-tokens tokens (ignore_eos), aggregate tokens/s
Tokens/s for each, then kvlm's ratio to each peer (above 1: kvlm is faster).
--isa avx2 pins AVX2 on both sides: KVLM_SIMD=avx2 for kvlm, peers built with --avx2-only.
"""
import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402 (its client drives any OpenAI-compatible server)

SHAPES = {
    "stories110M": {"dim": 768, "layers": 12, "heads": 12, "kv-heads": 12, "hidden": 2048, "vocab": 32000},
    "tinyllama": {"dim": 2048, "layers": 22, "heads": 32, "kv-heads": 4, "hidden": 5632, "vocab": 32000},
    "tiny": {"dim": 256, "layers": 2, "heads": 4, "kv-heads": 2, "hidden": 512, "vocab": 512},  # smoke tests (q4_k too)
}
ENGINES = ("llama.cpp", "ik_llama.cpp", "kvlm")
CACHE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}


class Skip(Exception):
    """A measurement that could not be made (its message goes in the notes)."""


class Stop(Exception):
    """SIGTERM, SIGINT or the time budget: print what was measured."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, a):
        self.a = a
        self.t_end = time.monotonic() + a.budget if a.budget else None
        self.env = dict(os.environ)
        if a.isa == "avx2":
            self.env["KVLM_SIMD"] = "avx2"
        else:
            self.env.pop("KVLM_SIMD", None)
        self.commands = {}   # kind -> one command line as run (printed with the tables)
        self.notes = []
        self.res = {}        # key tuple -> {engine: [values]}
        self.servers = []

    # ---- helpers ------------------------------------------------------------------------------------
    def check_time(self):
        if self.t_end and time.monotonic() > self.t_end:
            raise Stop("time budget spent")

    def bin(self, peer, tool):
        return os.path.join(self.a.peers, peer, "build", "bin", tool)

    def show(self, kind, cmd):
        pin = "KVLM_SIMD=avx2 " if self.a.isa == "avx2" and cmd[0] == self.a.kvlm else ""
        self.commands.setdefault(kind, pin + " ".join(shlex.quote(c) for c in cmd))

    def run(self, kind, cmd, timeout=None):
        self.show(kind, cmd)
        try:
            p = subprocess.run(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=timeout or self.a.timeout, start_new_session=True,
                               cwd=self.a.models)   # ik_llama.cpp's tools write llama.log where they run
        except subprocess.TimeoutExpired:
            raise Skip(f"{kind}: no answer within {timeout or self.a.timeout} s")
        if p.returncode:
            raise Skip(f"{kind}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}")
        return p

    def model(self, shape, wtype):
        path = os.path.join(self.a.models, f"{shape}-{wtype}.gguf")
        if not os.path.exists(path):
            os.makedirs(self.a.models, exist_ok=True)
            cmd = [self.a.kvlm, "synth", path + ".tmp", "--ctx", "32768", "--type", wtype]
            for k, v in SHAPES[shape].items():
                cmd += [f"--{k}", str(v)]
            log(f"  writing {path}")
            self.run("kvlm synth", cmd, timeout=1800)
            os.replace(path + ".tmp", path)
        return path

    def prompt(self, n_tokens):
        """A file whose text is n_tokens tokens with BOS: one-letter words, each one token in the
        synth vocabulary (checked against kvlm's count)."""
        path = os.path.join(self.a.models, f"prompt-{n_tokens}.txt")
        if not os.path.exists(path):
            words = [chr(ord("a") + i % 26) for i in range(n_tokens - 1)]
            with open(path, "w") as f:
                f.write(" ".join(words))
        return path

    def add(self, key, engine, value):
        self.res.setdefault(key, {}).setdefault(engine, []).append(value)

    def order(self, r):
        e = list(self.a.engines)
        return e[r % len(e):] + e[:r % len(e)]

    def peer_fa(self, peer):
        # flash attention: llama.cpp b4747 takes -fa as a flag, ik_llama.cpp takes -fa 1, and -rtr
        return ["-fa"] if peer == "llama.cpp" else ["-fa", "1", "-rtr"]

    # ---- pp / tg ------------------------------------------------------------------------------------
    def pp_tg_peer(self, peer, model):
        cmd = [self.bin(peer, "llama-bench"), "-m", model, "-p", str(self.a.pp), "-n", str(self.a.tg),
               "-t", str(self.a.threads), "-r", "1", "-fa", "1", "-o", "json"]
        if peer == "ik_llama.cpp":
            cmd += ["-rtr", "1"]
        p = self.run(f"{peer} llama-bench", cmd)
        try:
            rows = json.loads(p.stdout)
        except ValueError:
            raise Skip(f"{peer} llama-bench: output is not JSON: {p.stdout[:200]!r}")
        pp = next((r["avg_ts"] for r in rows if r.get("n_prompt") and not r.get("n_gen")), None)
        tg = next((r["avg_ts"] for r in rows if r.get("n_gen") and not r.get("n_prompt")), None)
        return pp, tg

    def kvlm_run(self, kind, model, prompt, n, ctx, cache="f16"):
        cmd = [self.a.kvlm, "run", "-m", model, "-n", str(n), "-t", str(self.a.threads), "-c", str(ctx),
               "--cache-type-k", cache, "--cache-type-v", cache, "--ignore-eos"]
        if prompt:
            cmd += ["-f", prompt]
        p = self.run(kind, cmd)
        m = re.search(r"prompt tokens: (\d+) \| prefill: ([\d.]+) tokens/s \| decode: ([\d.]+) tokens/s", p.stderr)
        if not m:
            raise Skip(f"{kind}: no tokens/s line in {p.stderr[-300:]!r}")
        return int(m.group(1)), float(m.group(2)), float(m.group(3))

    def pp_tg_kvlm(self, model):
        n, pp, _ = self.kvlm_run("kvlm run (pp)", model, self.prompt(self.a.pp), 0, self.a.pp + self.a.tg + 64)
        if n != self.a.pp:
            raise Skip(f"kvlm run: the prompt is {n} tokens, not {self.a.pp}")
        _, _, tg = self.kvlm_run("kvlm run (tg)", model, None, self.a.tg, self.a.pp + self.a.tg + 64)
        return pp, tg

    def part_pp_tg(self, shape, wtype):
        model = self.model(shape, wtype)
        for r in range(self.a.runs):
            for e in self.order(r):
                self.check_time()
                try:
                    pp, tg = self.pp_tg_kvlm(model) if e == "kvlm" else self.pp_tg_peer(e, model)
                except Skip as x:
                    self.note(x)
                    continue
                log(f"  {shape} {wtype} run {r + 1}/{self.a.runs} {e}: pp{self.a.pp} {pp} tg{self.a.tg} {tg}")
                if pp is not None:
                    self.add(("pp", shape, wtype, f"pp{self.a.pp}"), e, pp)
                if tg is not None:
                    self.add(("pp", shape, wtype, f"tg{self.a.tg}"), e, tg)

    # ---- decode at depth ----------------------------------------------------------------------------
    def depth_peer(self, peer, model, depth, cache):
        cmd = [self.bin(peer, "llama-batched-bench"), "-m", model, "-c", str(depth + self.a.tg + 256),
               "-b", "2048", "-ub", "512", "-npp", str(depth), "-ntg", str(self.a.tg), "-npl", "1",
               "-t", str(self.a.threads), "-tb", str(self.a.threads), "-ctk", cache, "-ctv", cache]
        cmd += self.peer_fa(peer)
        p = self.run(f"{peer} llama-batched-bench", cmd)
        for line in (p.stdout + p.stderr).splitlines():
            f = [x.strip() for x in line.strip().strip("|").split("|")]
            if len(f) == 10 and f[0] == str(depth) and f[1] == str(self.a.tg):
                return float(f[7])   # S_TG t/s
        raise Skip(f"{peer} llama-batched-bench: no result row in {p.stdout[-300:]!r}")

    def part_depth(self, shape, wtype):
        model = self.model(shape, wtype)
        for cache in self.a.depth_caches:
            for depth in self.a.depths:
                for r in range(self.a.depth_runs):
                    for e in self.order(r):
                        self.check_time()
                        try:
                            if e == "kvlm":
                                n, _, v = self.kvlm_run("kvlm run (depth)", model, self.prompt(depth), self.a.tg,
                                                        depth + self.a.tg + 64, cache)
                                if n != depth:
                                    raise Skip(f"kvlm run: the prompt is {n} tokens, not {depth}")
                            else:
                                v = self.depth_peer(e, model, depth, cache)
                        except Skip as x:
                            self.note(x)
                            continue
                        log(f"  {shape} {wtype} cache {cache} at {depth} run {r + 1}/{self.a.depth_runs} {e}: {v}")
                        self.add(("depth", shape, wtype, cache, depth), e, v)

    # ---- streams through the servers ------------------------------------------------------------------
    def start_server(self, engine, model, n):
        ctx, port = str(n * 256), None
        if engine == "kvlm":
            cmd = [self.a.kvlm, "serve", "-m", model, "--host", "127.0.0.1", "--port", "0", "-np", str(n),
                   "-c", ctx, "-t", str(self.a.threads), "--cache-type-k", "f16", "--cache-type-v", "f16"]
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [self.bin(engine, "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port),
                   "-np", str(n), "-c", ctx, "-t", str(self.a.threads), "-tb", str(self.a.threads),
                   "-ctk", "f16", "-ctv", "f16"] + self.peer_fa(engine)
        self.show(f"{engine} server", cmd)
        srv = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, cwd=self.a.models)
        self.servers.append(srv)
        tail = []   # its output, read by a thread so that its pipe never fills
        threading.Thread(target=lambda: [tail.append(x) for x in srv.stdout], daemon=True).start()
        t0 = time.monotonic()
        while True:   # kvlm serve prints its port; llama-server answers /health 503 while it loads
            if engine == "kvlm" and port is None:
                m = next((re.match(r"kvlm serve: listening on http://[^:]+:(\d+)", x) for x in list(tail)
                          if x.startswith("kvlm serve: listening")), None)
                port = int(m.group(1)) if m else None
            if port is not None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
            if srv.poll() is not None or time.monotonic() - t0 > 300:
                raise Skip(f"{engine} server did not start: {''.join(tail[-5:])[-400:]!r}")
            time.sleep(0.2)
        return port

    def stop_servers(self):
        for srv in self.servers:
            if srv.poll() is None:
                try:
                    os.killpg(srv.pid, signal.SIGTERM)
                    srv.wait(timeout=15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(srv.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    srv.wait()
        self.servers = []

    def part_serve(self, shape, wtype):
        model, n = self.model(shape, wtype), self.a.streams
        extra = {"ignore_eos": True}
        ports = {}
        try:
            for e in self.a.engines:
                self.check_time()
                try:
                    ports[e] = self.start_server(e, model, n)
                    # warm-up: page the weights in, first request's allocations
                    bench_serve.run_level("127.0.0.1", ports[e], 1, 1, 8, 60, 10 ** 6, True, extra)
                except (Skip, RuntimeError, OSError) as x:
                    self.note(Skip(f"{e} server: {x}"))
            for r in range(self.a.runs):
                for e in self.order(r):
                    if e not in ports:
                        continue
                    self.check_time()
                    try:
                        res = bench_serve.run_level("127.0.0.1", ports[e], n, 2 * n, self.a.stream_tokens,
                                                    self.a.timeout, 10 ** 5 * (r + 1), True, extra)
                    except (RuntimeError, OSError) as x:
                        self.note(Skip(f"{e} server: {x}"))
                        continue
                    if res["requests"] < 2 * n:
                        self.note(Skip(f"{e} server: {res['requests']} of {2 * n} requests within {self.a.timeout} s"))
                    log(f"  {shape} {wtype} {n} streams run {r + 1}/{self.a.runs} {e}: {res['tps']:.1f} tokens/s"
                        f" ({res['tokens']} tokens, TPOT p50 {1000 * bench_serve.percentile(res['tpot'], 50):.1f} ms)")
                    self.add(("serve", shape, wtype, n), e, res["tps"])
        finally:
            self.stop_servers()

    def note(self, x):
        log(f"  ! {x}")
        if str(x) not in self.notes:
            self.notes.append(str(x))

    # ---- output ---------------------------------------------------------------------------------------
    def cells(self, key):
        got = self.res.get(key, {})
        med = {e: statistics.median(v) for e, v in got.items() if v}
        cols = [f"{med[e]:.1f}" if e in med else "—" for e in ENGINES]
        for peer in ENGINES[:2]:
            cols.append(f"{med['kvlm'] / med[peer]:.2f}" if "kvlm" in med and peer in med else "—")
        runs = max((len(v) for v in got.values()), default=0)
        return cols, runs

    def tables(self):
        out = []
        head = "| llama.cpp | ik_llama.cpp | kvlm | kvlm/llama.cpp | kvlm/ik |"
        rule = "| --- | --- | --- | --- | --- |"
        for shape in self.a.shapes:
            s = SHAPES[shape]
            desc = (f"dim {s['dim']}, {s['layers']} layers, {s['heads']} heads ({s['kv-heads']} KV), "
                    f"hidden {s['hidden']}, vocab {s['vocab']}")
            keys = [k for k in self.res if k[1] == shape]
            if not keys:
                continue
            out.append(f"\n### {shape} shape ({desc})\n")
            pp = [k for k in keys if k[0] == "pp"]
            if pp:
                out.append(f"tokens/s, medians of runs (n), {self.a.threads} threads, f16 cache\n")
                out.append("| weights | test " + head + " n |")
                out.append("| --- | --- " + rule + " --- |")
                for k in pp:
                    c, n = self.cells(k)
                    out.append(f"| {k[2].upper()} | {k[3]} | " + " | ".join(c) + f" | {n} |")
            dp = [k for k in keys if k[0] == "depth"]
            if dp:
                out.append(f"\ndecode tokens/s ({self.a.tg} tokens) after a prompt of the context's length\n")
                out.append("| weights | cache | context " + head + " n |")
                out.append("| --- | --- | --- " + rule + " --- |")
                for k in dp:
                    c, n = self.cells(k)
                    out.append(f"| {k[2].upper()} | {k[3]} | {k[4]} | " + " | ".join(c) + f" | {n} |")
            sv = [k for k in keys if k[0] == "serve"]
            if sv:
                out.append(f"\naggregate tokens/s through the servers (llama-server for the peers, kvlm serve), "
                           f"2 x streams greedy completions of {self.a.stream_tokens} tokens, f16 cache\n")
                out.append("| weights | streams " + head + " n |")
                out.append("| --- | --- " + rule + " --- |")
                for k in sv:
                    c, n = self.cells(k)
                    out.append(f"| {k[2].upper()} | {k[3]} | " + " | ".join(c) + f" | {n} |")
        return "\n".join(out)

    def header(self):
        cpu, flags = "?", []
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name") and cpu == "?":
                        cpu = line.split(":", 1)[1].strip()
                    if line.startswith("flags") and not flags:
                        flags = line.split(":", 1)[1].split()
        except OSError:
            pass
        isa = [x for x in flags if x in ("avx", "avx2", "fma", "f16c", "avx_vnni") or x.startswith("avx512")
               or x.startswith("amx")]
        peers = []
        for p in [e for e in ENGINES[:2] if e in self.a.engines]:
            cache = os.path.join(self.a.peers, p, "build", "CMakeCache.txt")
            opts = {}
            try:
                with open(cache) as f:
                    for line in f:
                        m = re.match(r"(GGML_NATIVE|GGML_AVX2|GGML_AVX512|GGML_AVX512_VNNI):BOOL=(\w+)", line)
                        if m:
                            opts[m.group(1)] = m.group(2)
            except OSError:
                pass
            if opts.get("GGML_NATIVE") == "ON":   # -march=native: the other switches are not used
                opts = {"GGML_NATIVE": "ON"}
            peers.append(f"{p}: " + " ".join(f"{k}={v}" for k, v in opts.items()))
        return [f"CPU: {cpu}, {os.cpu_count()} cores; ISA flags: {' '.join(isa)}",
                f"pinned ISA: {self.a.isa}" + (" (kvlm: KVLM_SIMD=avx2; peers: GGML_NATIVE=OFF, AVX2 only)"
                                               if self.a.isa == "avx2" else " (each engine's best)"),
                "peers' builds (" + self.a.peers + "): " + ("; ".join(peers) or "none measured")]

    def kvlm_level(self, model):
        try:
            p = self.run("kvlm run (level)", [self.a.kvlm, "run", "-m", model, "-n", "1", "-c", "64", "-v",
                                              "-t", str(self.a.threads)])
        except Skip as x:
            return f"? ({x})"
        m = re.search(r"cpu: ([^,]+),", p.stderr)
        return m.group(1) if m else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvlm", default="build/kvlm", help="the kvlm binary")
    ap.add_argument("--peers", default="", help="the folder bench/peers.sh built the peers in")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: kvlm with KVLM_SIMD=avx2 (the peers: a --avx2-only build, peers.sh checks)")
    ap.add_argument("--models", default=os.path.join(os.environ.get("KVLM_BENCH_DIR", "/tmp/kvlm-bench"), "peers"),
                    help="where the synth GGUFs and prompts are written once (default $KVLM_BENCH_DIR/peers)")
    ap.add_argument("--shapes", default="stories110M,tinyllama", help=", ".join(SHAPES))
    ap.add_argument("--types", default="q8_0,q4_0,q4_k,f16", help="weight types for pp/tg")
    ap.add_argument("--engines", default=",".join(ENGINES), help="a subset of " + ",".join(ENGINES))
    ap.add_argument("--parts", default="pp,depth,serve", help="pp (pp and tg), depth, serve")
    ap.add_argument("--runs", type=int, default=3, help="alternated runs per figure (the median is shown)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="-t for every engine (default: cores)")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the pp test")
    ap.add_argument("--tg", type=int, default=128, help="tokens generated by tg and at each depth")
    ap.add_argument("--depths", default="4096,16384", help="contexts decoded at")
    ap.add_argument("--depth-caches", default="f16,q8_0", help="K and V cache types at depth")
    ap.add_argument("--depth-types", default="q8_0", help="weight types decoded at depth")
    ap.add_argument("--depth-runs", type=int, default=0, help="default: --runs")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams (0: none)")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens per completion")
    ap.add_argument("--serve-types", default="q8_0", help="weight types served")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one command may take")
    ap.add_argument("--budget", type=float, default=0, help="no new measurement after this many seconds")
    a = ap.parse_args()
    for name in ("shapes", "types", "engines", "parts", "depth_caches", "depth_types", "serve_types"):
        setattr(a, name, [x for x in getattr(a, name).split(",") if x])
    a.depths = [int(x) for x in a.depths.split(",") if x]
    a.depth_runs = a.depth_runs or a.runs
    a.kvlm = os.path.abspath(a.kvlm) if os.sep in a.kvlm else a.kvlm   # the tools run in --models
    os.makedirs(a.models, exist_ok=True)
    bad = [s for s in a.shapes if s not in SHAPES] + [e for e in a.engines if e not in ENGINES]
    if bad:
        sys.exit(f"peers.py: unknown shape or engine: {', '.join(bad)} (shapes: {', '.join(SHAPES)})")
    if any(e != "kvlm" for e in a.engines) and not a.peers:
        sys.exit("peers.py: --peers DIR (bench/peers.sh builds them), or --engines kvlm")

    b = Bench(a)

    def on_signal(sig, frame):
        raise Stop(f"signal {sig}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopped = None
    lines = b.header()
    for line in lines:
        print(line, flush=True)
    try:
        if "kvlm" in a.engines:
            level = b.kvlm_level(b.model(a.shapes[0], a.types[0]))
            lines.append(f"kvlm's kernels: {level}")
            print(lines[-1], flush=True)
        for shape in a.shapes:
            if "pp" in a.parts:
                for t in a.types:
                    b.part_pp_tg(shape, t)
            if "depth" in a.parts:
                for t in a.depth_types:
                    b.part_depth(shape, t)
            if "serve" in a.parts and a.streams > 0:
                for t in a.serve_types:
                    b.part_serve(shape, t)
    except Stop as x:
        stopped = str(x)
    finally:
        b.stop_servers()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    print(b.tables())
    if stopped:
        print(f"\nstopped early ({stopped}): the tables hold what was measured")
    if b.notes:
        print("\nnotes:")
        for n in b.notes:
            print(f"- {n}")
    print("\ncommands (one of each kind, as run):")
    for k, v in b.commands.items():
        print(f"- {k}: `{v}`")


if __name__ == "__main__":
    main()
