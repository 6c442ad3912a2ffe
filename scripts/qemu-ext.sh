#!/usr/bin/env bash
# Makes QEMU tools that speak NBD extended headers (QEMU >= 9) available to
# the tests, beside the system QEMU the VM tests use. Debian 12 ships QEMU
# 7.2; bookworm-backports has 10.x, whose qemu-utils runs on bookworm's
# libraries: it is downloaded and unpacked into $1 (default
# /opt/ferry/qemu-ext), not installed over the system one. Where the system
# QEMU is new enough already, nothing is done. Idempotent.
set -euo pipefail
out="${1:-/opt/ferry/qemu-ext}"
major() { "$1" --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1; }
v=$(major qemu-io || true)
if [ -n "$v" ] && [ "$v" -ge 9 ]; then
  exit 0
fi
if [ -x "$out/usr/bin/qemu-io" ] && [ "$(major "$out/usr/bin/qemu-io")" -ge 9 ]; then
  exit 0
fi
. /etc/os-release
[ "${VERSION_CODENAME:-}" = bookworm ] || { echo "no newer QEMU known for ${VERSION_CODENAME:-this system}" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"   # apt's download user writes there
mkdir -p "$work/parts" "$work/lists/partial"
cat > "$work/parts/bpo.sources" <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/parts" -o "Dir::State::Lists=$work/lists")
apt-get "${apt[@]}" update -q >/dev/null
(cd "$work" && apt-get "${apt[@]}" download -q qemu-utils >/dev/null 2>&1)
rm -rf "$out"
mkdir -p "$out"
dpkg -x "$work"/qemu-utils_*.deb "$out"
"$out/usr/bin/qemu-io" --version | head -1
