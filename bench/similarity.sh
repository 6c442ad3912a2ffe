#!/usr/bin/env bash
# Similarity of real OS disk images versus block size (seed 002, Fig. 8):
# a minimal Debian install (what the destination holds) against a bigger
# install of the same release (LAMP stack and compilers), both built with
# debootstrap and `mke2fs -d` (no mounting). Prints a markdown table.
#   bash bench/similarity.sh [WORKDIR]        (as root; needs network to the Debian mirror)
set -euo pipefail
work="${1:-/tmp/ferry-similarity}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
release="${RELEASE:-bookworm}"
ferry="$(cd "$(dirname "$0")/.." && pwd)/target/release/ferry"
[ -x "$ferry" ] || (cd "$(dirname "$0")/.." && cargo build --release -q -p ferry-cli)
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
mkdir -p "$work/cache"
if [ ! -f "$work/min.img" ]; then
  debootstrap --variant=minbase --cache-dir="$work/cache" "$release" "$work/min" "$mirror" > "$work/min.log"
  mke2fs -q -F -t ext4 -d "$work/min" "$work/min.img" 2G
fi
if [ ! -f "$work/lamp.img" ]; then
  debootstrap --variant=minbase --cache-dir="$work/cache" \
    --include=apache2,php,libapache2-mod-php,mariadb-server,gcc,g++,make,python3,perl \
    "$release" "$work/lamp" "$mirror" > "$work/lamp.log"
  # Package scripts may leave /proc or /sys mounted in the target.
  umount "$work/lamp/proc" "$work/lamp/sys" 2>/dev/null || true
  mke2fs -q -F -t ext4 -d "$work/lamp" "$work/lamp.img" 4G
fi
echo "min: $(du -sh "$work/min" 2>/dev/null | cut -f1) installed; lamp: $(du -sh "$work/lamp" 2>/dev/null | cut -f1) installed ($release)"
echo
echo "| block size | LAMP blocks found in minimal (of non-zero) | LAMP image not to send (zero or found) |"
echo "|---|---|---|"
"$ferry" index similarity "$work/min.img" "$work/lamp.img" --json |
  python3 -c '
import json, sys
for r in json.load(sys.stdin):
    print("| %d | %.1f%% | %.1f%% |" % (r["block_size"], 100 * r["found_share"], 100 * r["saved_share"]))'
