#!/usr/bin/env bash
# bench/peers.sh: kvlm against llama.cpp (b4747) and ik_llama.cpp (8337e4c) on the same machine, in the
# same run, on the same GGUFs: pp512, tg128, decode at 4k and 16k of context, 16 streams through the servers.
# Builds the peers from ../shared/peers once, outside the repo, then runs bench/peers.py (the measuring).
#
# usage: bench/peers.sh [--peers DIR] [--isa native|avx2] [peers.py options...]
#   --peers DIR   where the peers are (or get) built (default $KVLM_PEERS_DIR, else /tmp/kvlm-peers, and
#                 /tmp/kvlm-peers-avx2 with --isa avx2); built by ../shared/peers/build.sh when missing
#   --isa avx2    AVX2 on both sides: kvlm with KVLM_SIMD=avx2, the peers built with --avx2-only
#                 (GGML_NATIVE=OFF, AVX2/FMA/F16C only), so AVX2 is measured on an AVX-512 machine too
#   the rest goes to bench/peers.py (--shapes, --types, --runs, --parts, --depths, --streams, --budget,
#   ...: /usr/bin/python3 bench/peers.py --help). kvlm: $KVLM_BIN, else build/kvlm. KVLM_PEERS_SRC: the
#   folder of build.sh, if not ../shared/peers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${KVLM_PEERS_DIR:-} isa=native args=()
while (($#)); do
  case $1 in
    --peers) peers=${2:?--peers DIR}; shift 2 ;;
    --peers=*) peers=${1#*=}; shift ;;
    --isa) isa=${2:?--isa native|avx2}; shift 2 ;;
    --isa=*) isa=${1#*=}; shift ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exec /usr/bin/python3 "$root/bench/peers.py" --help ;;
    *) args+=("$1"); shift ;;
  esac
done
case $isa in native|avx2) ;; *) echo "peers.sh: --isa native or avx2, not '$isa'" >&2; exit 2 ;; esac
[ -n "$peers" ] || { peers=/tmp/kvlm-peers; [ "$isa" = avx2 ] && peers=/tmp/kvlm-peers-avx2; }
case $peers in "$root"|"$root"/*) echo "peers.sh: build the peers outside the repo, not in $peers" >&2; exit 2 ;; esac
src=${KVLM_PEERS_SRC:-$root/../shared/peers}

built() {
  local p t
  for p in llama.cpp ik_llama.cpp; do
    for t in llama-bench llama-batched-bench llama-server; do [ -x "$peers/$p/build/bin/$t" ] || return 1; done
  done
}
if ! built; then
  [ -x "$src/build.sh" ] || { echo "peers.sh: no $src/build.sh to build the peers with (set KVLM_PEERS_SRC)" >&2; exit 1; }
  flag=(); [ "$isa" = avx2 ] && flag=(--avx2-only)
  echo "peers.sh: building the peers in $peers (about 35 minutes on 2 cores; once)" >&2
  "$src/build.sh" "$peers" "${flag[@]}" >&2
fi
# the build folder must be of the ISA asked for (a native build would not pin AVX2)
for p in llama.cpp ik_llama.cpp; do
  native=$(sed -n 's/^GGML_NATIVE:BOOL=//p' "$peers/$p/build/CMakeCache.txt")
  if [ "$isa" = avx2 ] && [ "$native" != OFF ]; then
    echo "peers.sh: $peers/$p was built with GGML_NATIVE=$native; --isa avx2 needs build.sh --avx2-only (another --peers)" >&2; exit 1
  fi
  if [ "$isa" = native ] && [ "$native" = OFF ]; then
    echo "peers.sh: $peers/$p was built for AVX2 only; use --isa avx2 with it, or another --peers" >&2; exit 1
  fi
done
kvlm=${KVLM_BIN:-$root/build/kvlm}
[ -x "$kvlm" ] || { echo "peers.sh: no $kvlm: cmake --build build --target kvlm first" >&2; exit 1; }
exec /usr/bin/python3 "$root/bench/peers.py" --kvlm "$kvlm" --peers "$peers" --isa "$isa" "${args[@]}"
