# tests/web/serve_lib.sh: sourced by tests/cli_serve_openai.sh and cli_serve_browser.sh:
# checks what they need (SKIP otherwise), starts `kvlm serve` on a free loopback port, stops it on exit.
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
WEB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
skip() { echo "SKIP: $*"; exit 77; }  # ctest reports 77 as skipped
[ -f "$MODEL" ] || skip "$MODEL not found (set KVLM_MODELS)"
command -v node >/dev/null || skip "node not found (bash scripts/setup.sh installs nodejs)"
[ -d "$WEB_DIR/node_modules/openai" ] && [ -d "$WEB_DIR/node_modules/playwright-core" ] ||
  skip "$WEB_DIR/node_modules missing (bash scripts/setup.sh runs npm ci --prefix tests/web)"

tmp="$(mktemp -d)"
server_pid=""
stop_server() {
  [ -n "$server_pid" ] || return 0
  kill "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=""
}
trap 'stop_server; rm -rf "$tmp"' EXIT

# start_server [ARGS...]: runs kvlm serve -m MODEL --port 0 ARGS, sets URL once it prints its listening line.
start_server() {
  "$KVLM" serve -m "$MODEL" --host 127.0.0.1 --port 0 "$@" >"$tmp/serve.out" 2>"$tmp/serve.err" &
  server_pid=$!
  URL=""
  for _ in $(seq 300); do
    URL="$(sed -n 's/^kvlm serve: listening on //p' "$tmp/serve.out")"
    [ -n "$URL" ] && return 0
    if ! kill -0 "$server_pid" 2>/dev/null; then
      echo "FAIL: kvlm serve exited before listening: $(cat "$tmp/serve.err")"; server_pid=""; exit 1
    fi
    sleep 0.1
  done
  echo "FAIL: kvlm serve printed no listening line in 30 s: $(cat "$tmp/serve.err")"; exit 1
}

# finish RC: stops the server (SIGTERM: it shuts down cleanly) and exits with RC, or 1 when
# the server died, exited with an error or printed a sanitizer report.
finish() {
  local rc="$1" src=0
  if ! kill -0 "$server_pid" 2>/dev/null; then echo "FAIL: kvlm serve died: $(tail -20 "$tmp/serve.err")"; rc=1; fi
  kill -TERM "$server_pid" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$server_pid" 2>/dev/null && { echo "FAIL: kvlm serve ignored SIGTERM for 10 s"; kill -KILL "$server_pid"; rc=1; }
  wait "$server_pid" 2>/dev/null || src=$?
  server_pid=""
  if [ "$src" -ne 0 ] || grep -q "Sanitizer\|runtime error" "$tmp/serve.err"; then
    echo "FAIL: kvlm serve exited with status $src: $(tail -40 "$tmp/serve.err")"; rc=1
  fi
  exit "$rc"
}
