#!/usr/bin/env bash
# bench/bench_tier_disk.sh: the disk tier's write and read speeds as a ratio
# of dd's on the same filesystem, in the same run.
#   dd write: 1 MiB blocks, conv=fdatasync (on disk when dd ends)
#   dd read:  after dropping the file's pages (iflag=nocache count=0 is
#             posix_fadvise DONTNEED), buffered like the tier's reads; and
#             with iflag=direct
# The tier's numbers come from bench_tier_disk (write: put .. flush + syncfs;
# read: get in batches after fadvise DONTNEED on every file).
# usage: bench/bench_tier_disk.sh [BUILD_DIR] [-- extra bench_tier_disk args]
#   env: KVLM_BENCH_DIR (default /tmp/kvlm-bench), MIB (default 1024)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shift || true
[ "${1:-}" = "--" ] && shift
bin=$build/bench_tier_disk
[ -x "$bin" ] || { echo "bench_tier_disk not built: cmake --build $build --target bench_tier_disk" >&2; exit 1; }
base=${KVLM_BENCH_DIR:-/tmp/kvlm-bench}
mib=${MIB:-1024}
mkdir -p "$base"
f=$base/dd-tier-compare.bin
trap 'rm -f "$f"' EXIT
echo "filesystem: $(df -T "$base" | awk 'NR==2 {print $1, $2}'), folder $base"

# "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 1.52 s, 706 MB/s" -> bytes per second
rate() { awk '/copied/ { printf "%.0f\n", $1 / $(NF-3) }'; }

# runs dd with the given arguments, shows its report, and sets $last to its rate
run_dd() {
  echo "dd $*"
  local o
  o=$(dd "$@" 2>&1)
  echo "  ${o//$'\n'/$'\n'  }"
  last=$(echo "$o" | rate)
}
run_dd if=/dev/zero of="$f" bs=1M count="$mib" conv=fdatasync; dd_w=$last
dd if="$f" iflag=nocache count=0 status=none # drop the file's pages
run_dd if="$f" of=/dev/null bs=1M; dd_r=$last
run_dd if="$f" of=/dev/null bs=1M iflag=direct; dd_rd=$last
rm -f "$f"

echo "$bin --total-mib $mib $*"
out=$("$bin" --total-mib "$mib" "$@")
echo "$out"
get() { echo "$out" | awk -v k="$1" '$1 == "RESULT" && $2 == k { print $3 }'; }
t_w=$(get tier_write_sync_Bps)
t_r=$(get tier_read_Bps)
[ -n "$t_w" ] && [ -n "$t_r" ] || { echo "no throughput from bench_tier_disk" >&2; exit 1; }
awk -v tw="$t_w" -v tr="$t_r" -v dw="$dd_w" -v dr="$dd_r" -v dd="$dd_rd" 'BEGIN {
  printf "\nwrite, on disk:   tier %7.1f MB/s, dd %7.1f MB/s: tier/dd = %.2f\n", tw/1e6, dw/1e6, tw/dw
  printf "read, cold cache: tier %7.1f MB/s, dd %7.1f MB/s: tier/dd = %.2f (dd O_DIRECT %.1f MB/s: %.2f)\n",
         tr/1e6, dr/1e6, tr/dr, dd/1e6, tr/dd }'
