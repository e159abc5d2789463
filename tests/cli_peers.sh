#!/usr/bin/env bash
# tests/cli_peers: the kvlm side of bench/peers.sh (no peers needed, a tiny random-weight model):
#   - KVLM_SIMD caps kvlm's kernels: scalar, avx2 and unset each named on `kvlm run -v`'s device
#     line as the CPU allows; an unknown value is warned about and the CPU's best used;
#   - bench/peers.py --engines kvlm measures pp, tg, decode at depth (f16, q8_0) and streams
#     through kvlm serve: a number in kvlm's column of every row, "—" in the peers' and the
#     ratios; the server it started is gone afterwards;
#   - bench/peers.sh refuses a bad --isa, a peers folder inside the repo, and --isa avx2 with
#     a peers build made for the native ISA (a stand-in folder).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
command -v python3 >/dev/null || { echo "SKIP: python3 not found"; exit 77; }
exec timeout -k 5 300 python3 - "$(cd "$(dirname "$KVLM")" && pwd)/$(basename "$KVLM")" "$ROOT" <<'PY'
import os, re, shutil, subprocess, sys, tempfile

kvlm, root = sys.argv[1], sys.argv[2]
failures = 0
def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[-800:]), flush=True)
    failures += 0 if cond else 1

tmp = tempfile.mkdtemp(prefix="kvlm_peers_")
env0 = {k: v for k, v in os.environ.items() if k != "KVLM_SIMD"}
model = os.path.join(tmp, "tiny.gguf")
subprocess.run([kvlm, "synth", model, "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                "--hidden", "192", "--vocab", "512", "--type", "q8_0"], check=True, capture_output=True, timeout=60)

# the CPU's levels, as ops/cpu.c detects them
flags = set()
with open("/proc/cpuinfo") as f:
    for line in f:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
avx2 = {"avx2", "fma", "f16c"} <= flags
vnni = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
best = "AVX-512 VNNI" if vnni else "AVX2" if avx2 else "scalar"

def device(simd):
    env = dict(env0)
    if simd is not None:
        env["KVLM_SIMD"] = simd
    p = subprocess.run([kvlm, "run", "-m", model, "-n", "4", "-c", "64", "-v", "-p", "a b c"], env=env,
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"cpu: ([^,]+), \d+ threads", p.stderr)
    return p.returncode, m.group(1) if m else None, p.stderr

for simd, want in ((None, best), ("native", best), ("scalar", "scalar"), ("avx2", "AVX2" if avx2 else "scalar"),
                   ("avx512", best)):
    rc, got, err = device(simd)
    check(rc == 0 and got == want, f"KVLM_SIMD={simd}: cpu: {want}", (rc, got, err[-300:]))
rc, got, err = device("sse9")
check(rc == 0 and got == best and "KVLM_SIMD=sse9: not one of scalar, avx2, avx512, native" in err,
      "KVLM_SIMD=sse9: warned, the CPU's best", (rc, got, err[-300:]))

# peers.py, kvlm alone on the tiny shape: every part
models = os.path.join(tmp, "models")
cmd = [sys.executable, os.path.join(root, "bench", "peers.py"), "--kvlm", kvlm, "--engines", "kvlm",
       "--models", models, "--shapes", "tiny", "--types", "q8_0", "--runs", "1", "--pp", "32", "--tg", "8",
       "--depths", "96", "--streams", "2", "--stream-tokens", "4", "--timeout", "120"]
p = subprocess.run(cmd, env=env0, capture_output=True, text=True, timeout=240)
out = p.stdout
check(p.returncode == 0, "peers.py --engines kvlm exits 0", p.stderr[-800:])
check(out.startswith("CPU: ") and "pinned ISA: native" in out and f"kvlm's kernels: {best}" in out,
      "peers.py: the CPU, the ISA pinned, kvlm's level", out[:400])
rows = {}
for line in out.splitlines():
    f = [x.strip() for x in line.strip().strip("|").split("|")]
    if line.startswith("| Q8_0"):
        rows[" ".join(f[1:-6])] = f[-6:]
want = ["pp32", "tg8", "f16 96", "q8_0 96", "2"]
check(sorted(rows) == sorted(want), "peers.py: the rows pp, tg, depth per cache, streams", (rows, out))
for k, v in rows.items():
    ok = v[0] == "—" and v[1] == "—" and re.fullmatch(r"\d+\.\d", v[2]) and float(v[2]) > 0 and v[3] == v[4] == "—" \
        and v[5] == "1"
    check(bool(ok), f"peers.py row {k}: kvlm's tokens/s, no peer, 1 run", v)
check("notes:" not in out, "peers.py: no measurement failed", out)
check("- kvlm server: `" in out and " serve -m " in out, "peers.py: prints the commands it ran", out[-600:])
ps = subprocess.run(["pgrep", "-f", f"{kvlm} serve -m {models}"], capture_output=True, text=True)
check(ps.stdout.strip() == "", "peers.py: its kvlm serve is gone", ps.stdout)

# peers.sh refusals
sh = os.path.join(root, "bench", "peers.sh")
def peers_sh(*args):
    env = dict(env0, KVLM_BIN=kvlm)
    return subprocess.run(["bash", sh, *args], env=env, capture_output=True, text=True, timeout=60)
p = peers_sh("--isa", "avx9")
check(p.returncode == 2 and "--isa native or avx2" in p.stderr, "peers.sh --isa avx9 refused", p.stderr)
p = peers_sh("--peers", os.path.join(root, "peers-build"))
check(p.returncode == 2 and "outside the repo" in p.stderr, "peers.sh: a peers folder in the repo refused", p.stderr)
fake = os.path.join(tmp, "peers")
for peer in ("llama.cpp", "ik_llama.cpp"):
    b = os.path.join(fake, peer, "build")
    os.makedirs(os.path.join(b, "bin"))
    for t in ("llama-bench", "llama-batched-bench", "llama-server"):
        path = os.path.join(b, "bin", t)
        with open(path, "w") as f:
            f.write("#!/bin/sh\nexit 1\n")
        os.chmod(path, 0o755)
    with open(os.path.join(b, "CMakeCache.txt"), "w") as f:
        f.write("GGML_NATIVE:BOOL=ON\n")
p = peers_sh("--peers", fake, "--isa", "avx2")
check(p.returncode == 1 and "--avx2-only" in p.stderr, "peers.sh --isa avx2 refuses a native peers build", p.stderr)

shutil.rmtree(tmp, ignore_errors=True)
print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
PY
