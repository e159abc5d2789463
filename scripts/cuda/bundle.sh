#!/usr/bin/env bash
# Builds the CUDA backend here (nvcc, no GPU needed) and gathers what
# scripts/cuda/check.sh runs on a GPU machine that has no packages: the
# binaries (kvlm, test_cuda, bench_cuda), the CUDA module they load
# (libkvlm-cuda.so, in lib/: ../lib from the programs), the shared libraries
# they need beyond libc and CUDA's, the shared models and corpora.
#   bash scripts/cuda/bundle.sh OUT_DIR [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?out dir}"
build="${2:-build-cuda}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVLM_CUDA=ON >/dev/null
cmake --build "$build" -j"$(nproc)" --target kvlm_cli kvlm_cuda test_cuda bench_cuda
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/models" "$out/corpora"
for b in kvlm test_cuda bench_cuda; do strip -o "$out/bin/$b" "$build/$b"; done
strip -o "$out/lib/libkvlm-cuda.so" "$build/libkvlm-cuda.so"
ldd "$out"/bin/* "$out/lib/libkvlm-cuda.so" | awk '/=>/ {print $3}' | sort -u |
    grep -v -E 'libc\.so|libm\.so|libstdc\+\+|libgcc_s|ld-linux|libdl\.so|libpthread|librt\.so|cuda|cublas' |
    while read -r l; do cp -L "$l" "$out/lib/"; done
models="${KVLM_MODELS:-../shared/models}"
corpora="${KVLM_CORPORA:-../shared/corpora}"
cp "$models/stories260K.gguf" "$models/stories4M_hd64.gguf" "$out/models/"
cp "$corpora"/*.txt "$corpora"/*.raw "$out/corpora/" 2>/dev/null || true
cp scripts/cuda/serve_check.py "$out/"
du -sh "$out"
