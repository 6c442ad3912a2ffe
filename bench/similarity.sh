#!/usr/bin/env bash
# Similarity of real OS disk images versus block size (seed 002, Fig. 8):
# a minimal Debian install (what the destination holds) against a bigger
# install of the same release (LAMP stack and compilers), both built with
# debootstrap and `mke2fs -d` (no mounting). Prints a markdown table.
#   bash bench/similarity.sh [WORKDIR]        (as root; needs network to the Debian mirror)
# RELEASE=trixie ONLY_MIN=1 bash bench/similarity.sh [WORKDIR] builds only
# trixie-min.img (another release's images are named after it), the
# destination of bench/migration_peers.py's cross-release pair.
set -euo pipefail
work="${1:-/tmp/ferry-similarity}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
release="${RELEASE:-bookworm}"
ferry="$(cd "$(dirname "$0")/.." && pwd)/target/release/ferry"
[ -x "$ferry" ] || (cd "$(dirname "$0")/.." && cargo build --release -q -p ferry-cli)
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
mkdir -p "$work/cache"
prefix=""
[ "$release" = bookworm ] || prefix="$release-"
min="$work/${prefix}min"
if [ ! -f "$min.img" ]; then
  debootstrap --variant=minbase --cache-dir="$work/cache" "$release" "$min" "$mirror" > "$min.log"
  mke2fs -q -F -t ext4 -d "$min" "$min.img" 2G
fi
[ -z "${ONLY_MIN:-}" ] || exit 0
lamp="$work/${prefix}lamp"
if [ ! -f "$lamp.img" ]; then
  debootstrap --variant=minbase --cache-dir="$work/cache" \
    --include=apache2,php,libapache2-mod-php,mariadb-server,gcc,g++,make,python3,perl \
    "$release" "$lamp" "$mirror" > "$lamp.log"
  # Package scripts may leave /proc or /sys mounted in the target.
  umount "$lamp/proc" "$lamp/sys" 2>/dev/null || true
  mke2fs -q -F -t ext4 -d "$lamp" "$lamp.img" 4G
fi
echo "min: $(du -sh "$min" 2>/dev/null | cut -f1) installed; lamp: $(du -sh "$lamp" 2>/dev/null | cut -f1) installed ($release)"
echo
echo "| block size | LAMP blocks found in minimal (of non-zero) | LAMP image not to send (zero or found) |"
echo "|---|---|---|"
"$ferry" index similarity "$min.img" "$lamp.img" --json |
  python3 -c '
import json, sys
for r in json.load(sys.stdin):
    print("| %d | %.1f%% | %.1f%% |" % (r["block_size"], 100 * r["found_share"], 100 * r["saved_share"]))'
