#!/usr/bin/env bash
# bench/bench_tier_redis.sh: starts a redis-server on a free loopback port,
# runs bench_tier_redis and redis-benchmark (SET/GET of the same sizes, one
# connection, 8 pipelined, random keys: what the tier's writer and a reader
# do) against
# it in the same run, prints the tier's MB/s as a ratio of redis-benchmark's,
# and stops the server. Then the same tier over several nodes, for each node
# count in $NODES (default "3"): a Redis Cluster (redis-cluster://) and
# twemproxy (nutcracker, ketama) in front of as many plain servers
# (redis://...?proxy=1), against one server, same sizes and blocks: put/get
# MB/s (best of 2), then one node killed between the puts and the gets:
# blocks found and the slowest get. docs/cluster.md has the figures. With
# TLS=1, the same tier over rediss:// against redis:// on one server with
# both ports (certificates made here with openssl; AUTH as an ACL user on
# both), alternating, best of 2: the ratio TLS / plain (docs/kv-tiers.md).
# usage: bench/bench_tier_redis.sh [build dir (default build)] [MB per size (default 256)]
#   NODES="3 6" (NODES="": none) SKIP_SINGLE=1 (skip the redis-benchmark comparison) TLS=1
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
[ -n "${SKIP_SINGLE:-}" ] && sizes_single=() || sizes_single=("${sizes[@]}")
for size in "${sizes_single[@]}"; do
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

# ---- TLS: rediss:// against redis:// on one server ----
if [ -n "${TLS:-}" ]; then
  command -v openssl >/dev/null || { echo "openssl missing (scripts/setup.sh installs it)" >&2; exit 1; }
  ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
  (cd "$dir" && openssl req -x509 -new $ec -keyout ca.key -out ca.crt -days 1 -subj /CN=bench-ca &&
    openssl req -new $ec -keyout tls.key -out tls.csr -subj /CN=localhost &&
    printf 'subjectAltName=IP:127.0.0.1\n' >san.ext &&
    openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 1 -extfile san.ext) \
    >"$dir/openssl.log" 2>&1 || { cat "$dir/openssl.log" >&2; exit 1; }
  pport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  tport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  redis-server --port "$pport" --tls-port "$tport" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
    --tls-cert-file "$dir/tls.crt" --tls-key-file "$dir/tls.key" --tls-ca-cert-file "$dir/ca.crt" \
    --user bench on '>benchpw' '~*' '+@all' --daemonize no --loglevel warning >"$dir/tls-redis.log" 2>&1 &
  tpid=$!
  trap 'kill -9 $pid $tpid 2>/dev/null; wait $pid $tpid 2>/dev/null; rm -rf "$dir"' EXIT
  for i in $(seq 100); do
    redis-cli -h 127.0.0.1 -p "$pport" --user bench --pass benchpw --no-auth-warning ping 2>/dev/null | grep -q PONG && break
    [ "$i" = 100 ] && { echo "the TLS redis-server did not answer" >&2; cat "$dir/tls-redis.log" >&2; exit 1; }
    sleep 0.1
  done
  tflush() { redis-cli -h 127.0.0.1 -p "$pport" --user bench --pass benchpw --no-auth-warning flushall >/dev/null; }
  tls_opts=(--tls-ca "$dir/ca.crt" --tls-cert "$dir/tls.crt" --tls-key "$dir/tls.key")
  for size in "${sizes[@]}"; do
    n=$(( mb * 1000000 / size ))
    pp=0 pg=0 tp=0 tg=0
    for run in 1 2; do
      tflush
      out=$(KVLM_REDIS_PASSWORD=benchpw "$bin" "redis://bench@127.0.0.1:$pport" -n "$n" -s "$size" -b 8)
      read -r _ _ p g <<<"$(echo "$out" | grep "^TIER $size ")"
      pp=$(best "$pp" "$p"); pg=$(best "$pg" "$g")
      tflush
      out=$(KVLM_REDIS_PASSWORD=benchpw "$bin" "rediss://bench@127.0.0.1:$tport" -n "$n" -s "$size" -b 8 "${tls_opts[@]}")
      read -r _ _ p g <<<"$(echo "$out" | grep "^TIER $size ")"
      tp=$(best "$tp" "$p"); tg=$(best "$tg" "$g")
    done
    awk -v s="$size" -v pp="$pp" -v pg="$pg" -v tp="$tp" -v tg="$tg" 'BEGIN {
      printf "=> size %d (best of 2): put redis:// %.1f MB/s, rediss:// %.1f MB/s: ratio %.2f; get redis:// %.1f MB/s, rediss:// %.1f MB/s: ratio %.2f\n",
        s, pp, tp, tp / pp, pg, tg, tg / pg }'
  done
  tflush
  echo
fi

# ---- several nodes: Redis Cluster and twemproxy against one server ----
command -v nutcracker >/dev/null || { echo "nutcracker missing (scripts/setup.sh installs it): no twemproxy figures" >&2; }
pids=()
stop_all() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; { wait "$p"; } 2>/dev/null || true; done; pids=(); }
trap 'stop_all; kill -9 $pid ${tpid:-} 2>/dev/null; wait $pid ${tpid:-} 2>/dev/null; rm -rf "$dir"' EXIT
node() { # port [cluster]: a redis-server; its pid in $last
  local i
  mkdir -p "$dir/n$1"
  redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir/n$1" --daemonize no --loglevel warning \
    ${2:+--cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 --cluster-require-full-coverage no} \
    >"$dir/n$1.log" 2>&1 &
  last=$!; pids+=("$last")
  for i in $(seq 100); do redis-cli -p "$1" ping 2>/dev/null | grep -q PONG && return; sleep 0.1; done
  echo "redis-server on $1 did not start" >&2; exit 1
}
free_base() { python3 -c '
import random, socket
while True:
    b = random.randrange(20000, 40000)
    try:
        for p in list(range(b, b + 20)) + list(range(b + 10000, b + 10020)):
            s = socket.socket(); s.bind(("127.0.0.1", p)); s.close()
        print(b); break
    except OSError: pass'; }
# deploy KIND N: starts it; sets $url and $victim (the pid of the node to kill)
deploy() {
  local kind=$1 n=$2 base; base=$(free_base)
  case $kind in
    single) node "$base"; url="redis://127.0.0.1:$base"; victim=$last ;;
    cluster)
      local addrs=()
      for i in $(seq "$n"); do node $((base + i)) c; addrs+=("127.0.0.1:$((base + i))"); if [ "$i" = 1 ]; then victim=$last; fi; done
      redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 || { cat "$dir/create.log"; exit 1; }
      for i in $(seq 200); do
        ok=1; for a in "${addrs[@]}"; do redis-cli -p "${a#*:}" cluster info | grep -q cluster_state:ok || ok=0; done
        [ $ok = 1 ] && break; sleep 0.1
      done
      url="redis-cluster://$(IFS=,; echo "${addrs[*]}")" ;;
    twemproxy)
      { echo "kvlm:"; echo "  listen: 127.0.0.1:$base"; echo "  hash: fnv1a_64"; echo "  distribution: ketama"
        echo "  redis: true"; echo "  auto_eject_hosts: true"; echo "  server_retry_timeout: 2000"
        echo "  server_failure_limit: 1"; echo "  timeout: 2000"; echo "  servers:"; } >"$dir/nc.yml"
      for i in $(seq "$n"); do node $((base + i)); echo "   - 127.0.0.1:$((base + i)):1" >>"$dir/nc.yml"; if [ "$i" = 1 ]; then victim=$last; fi; done
      nutcracker -c "$dir/nc.yml" -o "$dir/nc.log" & pids+=($!)
      for i in $(seq 100); do redis-cli -p "$base" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
      url="redis://127.0.0.1:$base?proxy=1" ;;
  esac
}
[ -n "${NODES-3}" ] && printf '\n%-10s %5s %9s | %14s %14s | %s\n' deployment nodes "size" "put MB/s" "get MB/s" "one node killed: blocks found, slowest get"
for n in ${NODES-3}; do
  for kind in single cluster twemproxy; do
    [ $kind = twemproxy ] && ! command -v nutcracker >/dev/null && continue
    [ $kind = single ] && [ "$n" != "$(echo ${NODES-3} | cut -d' ' -f1)" ] && continue
    nn=$n; [ $kind = single ] && nn=1
    for size in "${sizes[@]}"; do
      blocks=$(( mb * 1000000 / size ))
      deploy $kind "$nn"
      tp=0 tg=0
      for run in 1 2; do
        out=$("$bin" "$url" -n "$blocks" -s "$size" -b 8)
        read -r _ _ p g <<<"$(echo "$out" | grep "^TIER $size ")"
        tp=$(best "$tp" "$p"); tg=$(best "$tg" "$g")
      done
      # a node killed after the puts (a fresh set of blocks)
      out=$("$bin" "$url" -n "$blocks" -s "$size" -b 8 -x "kill -9 $victim")
      read -r _ _ found total slow <<<"$(echo "$out" | grep "^FOUND $size ")"
      printf '%-10s %5s %9s | %14s %14s | %s/%s found, slowest get %s ms\n' $kind "$nn" "$size" "$tp" "$tg" "$found" "$total" "$slow"
      stop_all
    done
  done
done
