#!/usr/bin/env bash
# Every test, from a fresh machine: set up, build (Release, with the CUDA
# backend where nvcc is installed; then ASan+UBSan, CPU only),
# and run the whole suite with ctest in both builds (the sanitizer build
# leaves out the comparisons with outside references, label "reference",
# and its long end-to-end tests do less under KVLM_TEST_QUICK).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs="$(nproc)"
echo "== release build =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest --output-on-failure -j"$jobs")
echo "== sanitizer build (ASan + UBSan) =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLM_SANITIZE=ON -DKVLM_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   KVLM_TEST_QUICK=1 ctest --output-on-failure -j"$jobs" -LE reference)
