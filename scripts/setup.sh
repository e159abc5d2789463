#!/usr/bin/env bash
# Installs the Debian packages kvlm needs to build and test. Idempotent,
# non-interactive; run as root (or with sudo available).
set -euo pipefail
PKGS=(build-essential cmake pkg-config libpcre2-dev libcmocka-dev libjansson-dev libmicrohttpd-dev python3 python3-numpy)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}" >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
