#!/usr/bin/env bash
# tests/cli_fuzz: the libFuzzer harnesses (fuzz/) built with clang and run
# for 5 s each (KVLM_FUZZ_SECONDS; a smoke run in CI's budget: campaigns by hand, fuzz/run.sh 600) over their seed corpora and regression inputs (fuzz/run.sh);
# fails on any crash or sanitizer report. Skipped (77) without clang.
set -uo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v clang >/dev/null; then
  echo "SKIP: clang not found: the fuzzing harnesses are not built (scripts/setup.sh installs it)" >&2
  exit 77
fi
"$src/fuzz/run.sh" "${KVLM_FUZZ_SECONDS:-5}"
