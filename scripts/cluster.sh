#!/usr/bin/env bash
# scripts/cluster.sh: a local kvlm cluster on loopback ports: a Redis Cluster
# of R nodes (the shared KV tier), N `kvlm serve` instances using it
# (--kv-redis redis-cluster://...), and HAProxy in front (session affinity by
# X-Session-Id, health checks, failover). docs/cluster.md explains it.
#
# usage: scripts/cluster.sh start [options] [-- extra kvlm serve options]
#        scripts/cluster.sh stop|status [--dir DIR] [--port P]
#   --dir DIR       run directory: pids, logs, configs (default /tmp/kvlm-cluster)
#   --model PATH    model for kvlm serve (default ../shared/models/stories260K.gguf)
#   --kvlm N        kvlm instances (default 3; 0: Redis only)
#   --redis N       Redis Cluster masters (default 3, at least 3; 0: no tier)
#   --port P        the balancer's port; instances on P+1..P+N, Redis on
#                   P+101..P+100+R (and their cluster bus on +10000) (default 18080)
#   --kvlm-bin B    the kvlm binary (default build/kvlm)
#   --keepalive K   the instances' --keepalive-interval, seconds (default 2; 0 = off):
#                   HAProxy's "timeout server" is 3 K (600 s when off), so a hung
#                   instance fails or hands over its requests within 3 K
#   --timeout-server T  HAProxy's "timeout server" in seconds instead of 3 K
# Everything started is recorded in DIR/pids (name pid per line); stop sends
# SIGTERM, waits up to 10 s, then SIGKILL, and removes the pids file. The
# balancer's port is kept in DIR/port: status reads it unless --port is given.
# HAProxy's stats socket is DIR/haproxy.sock (show stat, show servers state).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-}
[ $# -gt 0 ] && shift
dir=/tmp/kvlm-cluster
model=$here/../shared/models/stories260K.gguf
n_kvlm=3 n_redis=3 port=18080 bin=$here/build/kvlm
keepalive=2 timeout_server="" port_given=""
extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --kvlm) n_kvlm=$2; shift 2 ;;
    --redis) n_redis=$2; shift 2 ;;
    --port) port=$2; port_given=1; shift 2 ;;
    --keepalive) keepalive=$2; shift 2 ;;
    --timeout-server) timeout_server=$2; shift 2 ;;
    --kvlm-bin) bin=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
pids=$dir/pids
say() { echo "cluster.sh: $*" >&2; }
die() { say "$*"; exit 1; }
# seconds (a decimal) to whole milliseconds; empty when not a number
to_ms() { python3 -c 'import sys; v = float(sys.argv[1]); assert 0 <= v <= 3600; print(round(v * 1000))' "$1" 2>/dev/null; }

# waits up to $1 seconds for command "${@:2}" to succeed
wait_for() {
  local t=$1; shift
  local end=$(( $(date +%s%N) / 1000000 + t * 1000 ))
  until "$@" >/dev/null 2>&1; do
    [ $(( $(date +%s%N) / 1000000 )) -ge $end ] && return 1
    sleep 0.1
  done
}
# running, not a zombie (a process killed from outside whose parent, this
# script's shell, is gone may wait unreaped where PID 1 does not reap)
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
record() { echo "$1 $2" >>"$pids"; }
redis_port() { echo $(( port + 100 + $1 )); }
kvlm_port() { echo $(( port + $1 )); }

start_redis_node() { # i
  local p; p=$(redis_port "$1")
  mkdir -p "$dir/redis-$p"
  redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes --cluster-config-file "nodes.conf" \
    --cluster-node-timeout 2000 --cluster-require-full-coverage no --cluster-allow-reads-when-down yes \
    --save '' --appendonly no --dir "$dir/redis-$p" --maxmemory 256mb --maxmemory-policy allkeys-lru \
    --daemonize no --loglevel warning >>"$dir/redis-$p/log" 2>&1 &
  record "redis-$p" $!
  wait_for 10 sh -c "redis-cli -p $p ping | grep -q PONG" ||
    die "redis on $p did not answer within 10 s; its log ends: $(tail -3 "$dir/redis-$p/log" 2>/dev/null | tr '\n' ' ')"
}

cluster_ok() { # every node says cluster_state:ok and knows all 16384 slots
  for i in $(seq "$n_redis"); do
    redis-cli -p "$(redis_port "$i")" cluster info 2>/dev/null | grep -q 'cluster_state:ok' || return 1
    redis-cli -p "$(redis_port "$i")" cluster info 2>/dev/null | grep -q 'cluster_slots_assigned:16384' || return 1
  done
}

start() {
  [ -s "$pids" ] && die "already running from $dir (scripts/cluster.sh stop --dir $dir)"
  local ka_ms ts_ms
  ka_ms=$(to_ms "$keepalive") || true
  [ -n "$ka_ms" ] || die "--keepalive $keepalive: expected seconds in 0..3600 (0 = off)"
  for o in "${extra[@]}"; do
    [ "$o" = --keepalive-interval ] && die "give the keep-alive interval as cluster.sh --keepalive K (HAProxy's timeout server follows it)"
  done
  if [ -n "$timeout_server" ]; then
    ts_ms=$(to_ms "$timeout_server") || true
    [ -n "$ts_ms" ] && [ "$ts_ms" -gt 0 ] || die "--timeout-server $timeout_server: expected seconds, more than 0"
  elif [ "$ka_ms" -gt 0 ]; then
    ts_ms=$(( 3 * ka_ms ))
  else
    ts_ms=600000 # no keep-alive bytes: a whole answer is silent until it is ready
  fi
  [ "$n_redis" = 0 ] || [ "$n_redis" -ge 3 ] || die "--redis: a Redis Cluster needs at least 3 masters"
  for t in redis-server redis-cli haproxy; do command -v $t >/dev/null || die "$t missing (scripts/setup.sh)"; done
  mkdir -p "$dir"
  : >"$pids"
  echo "$port" >"$dir/port"
  trap 'rc=$?; if [ $rc != 0 ]; then say "start failed: stopping what started"; stop; fi' EXIT
  local url="" nodes=()
  if [ "$n_redis" -gt 0 ]; then
    for i in $(seq "$n_redis"); do start_redis_node "$i"; nodes+=("127.0.0.1:$(redis_port "$i")"); done
    if [ ! -s "$dir/redis-$(redis_port 1)/nodes.conf" ] || ! redis-cli -p "$(redis_port 1)" cluster info | grep -q 'cluster_known_nodes:'"$n_redis"; then
      redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$dir/cluster-create.log" 2>&1 ||
        die "redis-cli --cluster create failed (see $dir/cluster-create.log)"
    fi
    wait_for 20 cluster_ok || die "the Redis Cluster did not reach cluster_state:ok within 20 s"
    url="redis-cluster://$(IFS=,; echo "${nodes[*]}")"
    echo "$url" >"$dir/redis-url"
    say "Redis Cluster: ${nodes[*]}"
  fi
  if [ "$n_kvlm" -gt 0 ]; then
    [ -x "$bin" ] || die "$bin missing (cmake --build build)"
    [ -f "$model" ] || die "$model missing (--model)"
    local servers=""
    for i in $(seq "$n_kvlm"); do
      local p; p=$(kvlm_port "$i")
      "$bin" serve -m "$model" --host 127.0.0.1 --port "$p" ${url:+--kv-redis "$url"} \
        --keepalive-interval "$keepalive" "${extra[@]}" >"$dir/kvlm-$p.log" 2>&1 &
      record "kvlm-$p" $!
      servers+="    server k$i 127.0.0.1:$p check"$'\n'
    done
    for i in $(seq "$n_kvlm"); do
      local p; p=$(kvlm_port "$i")
      wait_for 60 curl -sf "http://127.0.0.1:$p/health" || die "kvlm on $p did not answer /health within 60 s (see $dir/kvlm-$p.log)"
    done
    local sock=$dir/haproxy.sock stats=""
    rm -f "$sock"
    # a Unix socket's path has at most 107 bytes
    if [ ${#sock} -lt 100 ]; then stats="    stats socket $sock mode 600 level admin"
    else say "$sock is too long a path for a Unix socket: no stats socket"; fi
    python3 - "$here/scripts/cluster/haproxy.cfg.in" "$dir/haproxy.cfg" "127.0.0.1:$port" "$servers" "${ts_ms}ms" "$stats" <<'PY'
import sys
src, dst, bind, servers, tsrv, stats = sys.argv[1:]
t = open(src).read()
for k, v in (("@BIND@", bind), ("@SERVERS@", servers.rstrip("\n")), ("@TIMEOUT_SERVER@", tsrv), ("@STATS@", stats)):
    t = t.replace(k, v)
open(dst, "w").write(t)
PY
    haproxy -c -q -f "$dir/haproxy.cfg" >"$dir/haproxy-check.log" 2>&1 ||
      die "haproxy rejected $dir/haproxy.cfg: $(cat "$dir/haproxy-check.log")"
    haproxy -db -f "$dir/haproxy.cfg" >"$dir/haproxy.log" 2>&1 &
    record haproxy $!
    wait_for 10 curl -sf "http://127.0.0.1:$port/health" || die "haproxy on $port did not answer within 10 s"
    say "$n_kvlm kvlm instances on $(kvlm_port 1)..$(kvlm_port "$n_kvlm"), HAProxy on http://127.0.0.1:$port" \
      "(keep-alive every ${keepalive} s, timeout server $(( ts_ms / 1000 )).$(printf %03d $(( ts_ms % 1000 ))) s)"
  fi
  trap - EXIT
}

stop() {
  [ -f "$pids" ] || { say "nothing running from $dir"; return 0; }
  # the balancer first, then the instances (their clean stop flushes to Redis), then Redis
  local order
  order=$(awk '$1 == "haproxy" {print 0, $0; next} $1 ~ /^kvlm/ {print 1, $0; next} {print 2, $0}' "$pids" | sort -s -k1,1n | cut -d' ' -f2-)
  for phase in haproxy kvlm redis; do
    local these=()
    while read -r name pid; do
      [[ $name == $phase* ]] || continue
      alive "$pid" && kill -TERM "$pid" 2>/dev/null && these+=("$pid")
    done <<<"$order"
    local end=$(( $(date +%s) + 10 ))
    for pid in "${these[@]}"; do
      while alive "$pid" && [ "$(date +%s)" -lt $end ]; do sleep 0.1; done
      alive "$pid" && { say "pid $pid did not stop in 10 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
    done
  done
  rm -f "$pids"
  say "stopped (logs in $dir)"
}

status() {
  [ -f "$pids" ] || { echo "not running ($dir)"; return 3; }
  [ -z "$port_given" ] && [ -s "$dir/port" ] && port=$(cat "$dir/port")
  local bad=0
  while read -r name pid; do
    if alive "$pid"; then echo "$name pid $pid: up"; else echo "$name pid $pid: DOWN"; bad=1; fi
  done <"$pids"
  [ -f "$dir/redis-url" ] && echo "tier: $(cat "$dir/redis-url")"
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then echo "balancer: http://127.0.0.1:$port up"; fi
  # the balancer's view of each instance (its health checks), from its stats socket
  if [ -S "$dir/haproxy.sock" ]; then
    python3 - "$dir/haproxy.sock" <<'PY' || true
import csv, io, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(2)
try:
    s.connect(sys.argv[1])
    s.sendall(b"show stat\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
except OSError:
    sys.exit(0)
rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
for r in rows:
    if r["pxname"] == "kvlm" and r["svname"] not in ("FRONTEND", "BACKEND"):
        print("balancer: server %s %s (%s)" % (r["svname"], r["status"], r.get("check_status", "")))
PY
  fi
  return $bad
}

case $cmd in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: scripts/cluster.sh start|stop|status [--dir DIR] [--kvlm N] [--redis N] [--port P] [--model PATH] [-- serve options]" >&2; exit 2 ;;
esac
