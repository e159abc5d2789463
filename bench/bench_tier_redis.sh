#!/usr/bin/env bash
# bench/bench_tier_redis.sh: starts a redis-server on a free loopback port,
# runs bench_tier_redis and redis-benchmark (SET/GET of the same sizes, one
# connection, 8 pipelined, random keys: what the tier's writer and a reader
# do) against
# it in the same run, prints the tier's MB/s as a ratio of redis-benchmark's,
# and stops the server.
# usage: bench/bench_tier_redis.sh [build dir (default build)] [MB per size (default 256)]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
mb=${2:-256}
sizes=(720896 45056)
bin=$build/bench_tier_redis
for tool in redis-server redis-benchmark redis-cli; do
  command -v $tool >/dev/null || { echo "$tool missing (scripts/setup.sh installs redis-server, redis-tools)" >&2; exit 1; }
done
[ -x "$bin" ] || { echo "$bin missing: cmake --build $build --target bench_tier_redis" >&2; exit 1; }

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d /tmp/kvlm-bench-redis.XXXXXX)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  --daemonize no --loglevel warning >"$dir/redis.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for i in $(seq 100); do
  redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG && break
  [ "$i" = 100 ] && { echo "redis-server did not answer within 10 s" >&2; cat "$dir/redis.log" >&2; exit 1; }
  sleep 0.1
done
echo "redis-server $(redis-server --version | grep -o 'v=[0-9.]*') on 127.0.0.1:$port; $(nproc) cores (shared: timings are noisy)"

# Each side runs twice per size on an emptied server, alternating, and the
# better run counts (a fresh server's first writes pay for its page faults).
# redis-benchmark's SETs get -r: random keys, so they store new values as
# the tier's do (without -r every SET overwrites one key, about 3x faster);
# its GETs read one stored key of the same size over and over.
flush() { redis-cli -h 127.0.0.1 -p "$port" flushall >/dev/null; }
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a + 0 > b + 0) ? a : b }'; }
for size in "${sizes[@]}"; do
  n=$(( mb * 1000000 / size ))
  tput=0 tget=0 set_rps=0 get_rps=0
  for run in 1 2; do
    flush
    rb=$(redis-benchmark -h 127.0.0.1 -p "$port" -c 1 -P 8 -t set -d "$size" -n "$n" -r 1000000000 -q 2>&1 | tr '\r' '\n')
    echo "\$ redis-benchmark -c 1 -P 8 -t set -d $size -n $n -r 1000000000 -q"
    echo "$rb" | grep -E '^SET: [0-9.]+ requests per second' | tail -1
    # GET reads one key of this size (no -r: random keys would mostly miss)
    redis-benchmark -h 127.0.0.1 -p "$port" -t set -d "$size" -n 1 -q >/dev/null 2>&1
    rb=$rb$'\n'$(redis-benchmark -h 127.0.0.1 -p "$port" -c 1 -P 8 -t get -d "$size" -n "$n" -q 2>&1 | tr '\r' '\n')
    echo "\$ redis-benchmark -c 1 -P 8 -t get -d $size -n $n -q"
    echo "$rb" | grep -E '^GET: [0-9.]+ requests per second' | tail -1
    set_rps=$(best "$set_rps" "$(echo "$rb" | grep -o 'SET: [0-9.]* requests' | tail -1 | awk '{print $2}')")
    get_rps=$(best "$get_rps" "$(echo "$rb" | grep -o 'GET: [0-9.]* requests' | tail -1 | awk '{print $2}')")
    flush
    echo "\$ bench_tier_redis redis://127.0.0.1:$port -n $n -s $size -b 8"
    out=$("$bin" "redis://127.0.0.1:$port" -n "$n" -s "$size" -b 8)
    echo "$out" | grep -v '^TIER'
    read -r _ _ p g <<<"$(echo "$out" | grep "^TIER $size ")"
    tput=$(best "$tput" "$p")
    tget=$(best "$tget" "$g")
  done
  flush
  awk -v s="$size" -v sr="$set_rps" -v gr="$get_rps" -v tp="$tput" -v tg="$tget" 'BEGIN {
    rs = sr * s / 1e6; rg = gr * s / 1e6;
    printf "=> size %d (best of 2): tier put %.1f MB/s vs redis-benchmark SET %.1f MB/s: ratio %.2f; tier get %.1f MB/s vs GET %.1f MB/s: ratio %.2f\n",
      s, tp, rs, tp / rs, tg, rg, tg / rg }'
  echo
done
