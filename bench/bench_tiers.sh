#!/usr/bin/env bash
# bench/bench_tiers.sh: time to first token with a cached 2,048-token prefix
# (bench_tiers: recompute, RAM hit, disk hit with the page cache dropped,
# Redis hit) on the stories110M and TinyLlama-1.1B shapes, with a
# redis-server started on a free loopback port, and in the same run what
# `dd` (O_DIRECT, 1 MiB blocks) and `redis-benchmark` (GET of one block's
# size) reach on this machine, for the tiers' MB/s to compare against.
# usage: bench/bench_tiers.sh [build dir] [threads (default 2)] [shape: both|tinyllama|stories110m] [runs (3)]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
threads=${2:-2}
shape=${3:-both}
runs=${4:-3}
bin=$build/bench_tiers
[ -x "$bin" ] || { echo "$bin missing: cmake --build $build --target bench_tiers" >&2; exit 1; }
for tool in redis-server redis-cli redis-benchmark; do
  command -v $tool >/dev/null || { echo "$tool missing (scripts/setup.sh)" >&2; exit 1; }
done
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d /tmp/kvlm-bench-tiers.XXXXXX)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" --maxmemory 2gb \
  --maxmemory-policy allkeys-lru --daemonize no --loglevel warning >"$dir/redis.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for i in $(seq 100); do
  redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG && break
  [ "$i" = 100 ] && { echo "redis-server did not answer within 10 s" >&2; exit 1; }
  sleep 0.1
done
echo "$(nproc) cores (shared with other work: timings are noisy); redis-server on 127.0.0.1:$port"
"$bin" "$threads" "$shape" "$dir/disk" "redis://127.0.0.1:$port/0" "$runs"
echo
echo "same machine, same run:"
dd if=/dev/urandom of="$dir/dd.bin" bs=1M count=256 status=none
sync
echo "\$ dd if=dd.bin of=/dev/null bs=1M iflag=direct   (256 MiB, page cache bypassed)"
dd if="$dir/dd.bin" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
rm -f "$dir/dd.bin"
for size in 360448 589824; do
  redis-benchmark -h 127.0.0.1 -p "$port" -t set -d "$size" -n 1 -q >/dev/null 2>&1
  echo "\$ redis-benchmark -c 1 -P 8 -t get -d $size -n 400 -q"
  redis-benchmark -h 127.0.0.1 -p "$port" -c 1 -P 8 -t get -d "$size" -n 400 -q 2>&1 | tr '\r' '\n' | grep -E '^GET: [0-9.]+ requests' | tail -1 |
    awk -v s="$size" '{ printf "%s  = %.0f MB/s\n", $0, $2 * s / 1e6 }'
done
