#!/usr/bin/env bash
# The main job, from a fresh machine: set up, build, and generate text with
# stories260K (or whatever `kvlm run` arguments you pass).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
MODELS="${KVLM_MODELS:-../shared/models}"
if [ "$#" -eq 0 ]; then
  set -- -m "$MODELS/stories260K.gguf" -p "Once upon a time" -n 200 --temp 0.8 --seed 42
fi
exec ./build/kvlm run "$@"
