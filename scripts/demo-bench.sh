#!/usr/bin/env bash
# The storage-server demo: builds ferry, starts a daemon on a
# temporary pool, imports an ext4 disk image, runs every `ferry bench`
# profile against it and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q -p ferry-cli
exec target/release/ferry demo "$@"
