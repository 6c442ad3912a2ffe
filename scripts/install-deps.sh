#!/usr/bin/env bash
# Installs what ferry's build, demo and tests need on Debian (run as root):
# the real clients the tests drive, and a Rust toolchain if there is none.
#   scripts/install-deps.sh          build + demo needs
#   scripts/install-deps.sh --test   also the test clients and cargo-fuzz
set -euo pipefail

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

export DEBIAN_FRONTEND=noninteractive
pkgs=(build-essential pkg-config ca-certificates curl e2fsprogs)
if [ "$want_test" = 1 ]; then
  pkgs+=(qemu-utils libnbd-bin nbdkit fio python3)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
fi

# Rust: use what is there (rustup or distro); otherwise install rustup.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null 2>&1; then
  echo "== installing the Rust toolchain"
  if apt-cache show rustup >/dev/null 2>&1; then
    apt-get install -y -q rustup
    rustup default stable
  else
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  fi
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt || true
fi

if [ "$want_test" = 1 ]; then
  # cargo-fuzz needs a nightly toolchain; pinned version of the tool itself.
  if command -v rustup >/dev/null 2>&1 && ! rustup run nightly rustc --version >/dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal || echo "WARN: no nightly toolchain; fuzz smoke runs will be skipped"
  fi
  if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --version 0.13.2 --locked || echo "WARN: cargo-fuzz not installed; fuzz smoke runs will be skipped"
  fi
fi
