#!/usr/bin/env bash
# Installs the Debian packages kvlm needs to build and test. Idempotent,
# non-interactive; run as root (or with sudo available).
set -euo pipefail
PKGS=(build-essential cmake pkg-config clang libpcre2-dev libcmocka-dev libjansson-dev libmicrohttpd-dev python3 python3-numpy libhiredis-dev libssl-dev libxxhash-dev libunistring-dev redis-server redis-tools haproxy nutcracker curl openssl)
# KV events (serve --kv-events): ZeroMQ and msgpack-c to build; Debian's Python
# bindings for the subscriber test (tests/cli_serve_kv_events.sh runs /usr/bin/python3).
PKGS+=(libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack)
# tests/cli_pretok.sh checks every pre-tokenizer against Python's regex module.
PKGS+=(python3-regex)
# tests/cli_kv_trust.sh forges KV blocks with recomputed XXH3 checksums.
PKGS+=(python3-xxhash)
# tests/cli_serve_json.sh checks structured output against an independent validator.
PKGS+=(python3-jsonschema)
# tests/cli_serve_compat.sh lints /metrics with promtool (skipped without it).
PKGS+=(prometheus)
# tests/cli_template.sh and cli_toolcall_roundtrip.sh render every chat template with Python's jinja2 as transformers does.
PKGS+=(python3-jinja2)
# kvlm chat's line editing and history (libedit; without it chat reads plain lines), and
# tmux, which drives kvlm chat at a terminal in tests/cli_chat_tty.sh.
PKGS+=(libedit-dev tmux)
# The web page (src/server/web/index.html) renders answers as markdown with marked and sanitises
# the HTML with DOMPurify: CMake inlines their browser builds into the page (no network at build time).
PKGS+=(libjs-marked node-marked node-dompurify)
# The Python package (python/): its build backend (pip install --no-build-isolation ./python)
# and tests/cli_python.sh's pytest.
PKGS+=(python3-setuptools python3-pytest python3-pip)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# curl and openssl: tests/cli_serve_auth (a self-signed certificate, an HTTPS round trip);
# openssl also makes tests/test_tier_redis_trust's and cli_kv_redis_trust's CA and certificates.
# libssl-dev: TLS to Redis (rediss://).
# clang: the libFuzzer harnesses (fuzz/, tests/cli_fuzz.sh).
# libunistring-dev: BERT's WordPiece (src/tok/wpm.c: Unicode normalisation, case, categories); also
# `pkg-config --static --libs kvlm` names -lunistring (libmicrohttpd -> gnutls),
# which Debian's libgnutls28-dev leaves out; tests/cli_install links examples/ that way.
# The web tests (tests/web): node and npm (kept if already there, e.g. from NodeSource), Debian's chromium.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
[ -x /usr/bin/chromium ] || missing+=(chromium)
if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}" >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The npm packages of the web tests (openai, playwright-core), pinned by tests/web/package-lock.json.
web="$(cd "$(dirname "$0")/.." && pwd)/tests/web"
if [ ! -d "$web/node_modules" ]; then
  echo "setup: npm ci in tests/web" >&2
  npm ci --prefix "$web" --no-audit --no-fund --loglevel=error >&2 ||
    echo "setup: npm ci failed (no registry?); the web tests will be skipped" >&2
fi
