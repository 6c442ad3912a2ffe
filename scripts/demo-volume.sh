#!/usr/bin/env bash
# A volume migration on an embedded default: two ferry daemons on this machine
# joined by an emulated WAN (toxiproxy, 100 Mbit/s and 20 ms RTT), a base OS
# image at the destination, a bigger image of the same OS at the source with
# a workload writing to it through `ferry host`, a live migration over TLS,
# and its report.
#
# The OS images are ext4 file systems (mke2fs -d, no mounting) made from
# this machine's own /usr: base = /etc, /usr/bin, /usr/sbin and the shared
# libraries; bigger = base plus Python, GCC and /usr/libexec. Set
# FERRY_DEMO_KEEP=1 to keep the work directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q -p ferry-cli
F=$PWD/target/release/ferry

W=$(mktemp -d /tmp/ferry-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ "${FERRY_DEMO_KEEP:-0}" = 1 ] || rm -rf "$W"
}
trap cleanup EXIT
base=$((20000 + RANDOM % 20000))
SRC_NBD=127.0.0.1:$base SRC_ADMIN=127.0.0.1:$((base + 1))
DST_NBD=127.0.0.1:$((base + 2)) DST_ADMIN=127.0.0.1:$((base + 3)) DST_MIG=127.0.0.1:$((base + 4))
TOXI=127.0.0.1:$((base + 5)) WAN=127.0.0.1:$((base + 6)) HOST_NBD=127.0.0.1:$((base + 7))

echo "== building the OS images from this machine's files (in $W)"
tree() { # tree DIR PATH...
  local d=$1; shift
  mkdir -p "$d"
  for p in "$@"; do
    [ -e "$p" ] || continue
    mkdir -p "$d$(dirname "$p")"
    cp -a --reflink=auto "$p" "$d$p"
  done
}
tree "$W/base" /etc /usr/bin /usr/sbin /usr/lib/x86_64-linux-gnu
tree "$W/big" /etc /usr/bin /usr/sbin /usr/lib/x86_64-linux-gnu \
  /usr/lib/python3 /usr/lib/python3.11 /usr/lib/gcc /usr/libexec
# Sized from what went in (a quarter more, plus room for the metadata):
# how much of /usr this machine holds varies with what is installed.
mib() { echo $(( $(du -sm "$1" | cut -f1) * 5 / 4 + 256 )); }
BASE_MIB=$(mib "$W/base") BIG_MIB=$(mib "$W/big")
mke2fs -q -F -t ext4 -d "$W/base" "$W/base.img" "${BASE_MIB}M"
mke2fs -q -F -t ext4 -d "$W/big" "$W/big.img" "${BIG_MIB}M"
rm -rf "$W/base" "$W/big"

echo "== two daemons; they trust each other's certificates"
"$F" certs show --pool "$W/a" >/dev/null
"$F" certs show --pool "$W/b" >/dev/null
"$F" certs trust "$W/b/tls/cert.pem" --pool "$W/a" --name dst >/dev/null
"$F" certs trust "$W/a/tls/cert.pem" --pool "$W/b" --name src >/dev/null
FERRY_LOG=warn "$F" serve --pool "$W/a" --nbd "$SRC_NBD" --admin "$SRC_ADMIN" 2>"$W/src.log" &
pids+=($!)
FERRY_LOG=warn "$F" serve --pool "$W/b" --nbd "$DST_NBD" --admin "$DST_ADMIN" --migrate "$DST_MIG" 2>"$W/dst.log" &
pids+=($!)

echo "== the WAN: toxiproxy at 100 Mbit/s each way, 10 ms each way (20 ms RTT)"
toxiproxy-server -host 127.0.0.1 -port "${TOXI#*:}" >"$W/toxiproxy.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  curl -sf "http://$TOXI/version" >/dev/null && curl -sf "http://$SRC_ADMIN/v1/server" >/dev/null &&
    curl -sf "http://$DST_ADMIN/v1/server" >/dev/null && break
  sleep 0.1
done
curl -sf -X POST "http://$TOXI/proxies" -d "{\"name\":\"wan\",\"listen\":\"$WAN\",\"upstream\":\"$DST_MIG\",\"enabled\":true}" >/dev/null
for s in upstream downstream; do
  curl -sf -X POST "http://$TOXI/proxies/wan/toxics" \
    -d "{\"name\":\"rate-$s\",\"type\":\"bandwidth\",\"stream\":\"$s\",\"attributes\":{\"rate\":12500}}" >/dev/null
  curl -sf -X POST "http://$TOXI/proxies/wan/toxics" \
    -d "{\"name\":\"delay-$s\",\"type\":\"latency\",\"stream\":\"$s\",\"attributes\":{\"latency\":10}}" >/dev/null
done

echo "== base image at the destination (indexed on import), bigger image at the source"
export FERRY_ADMIN=$DST_ADMIN
"$F" volume create base --size "${BASE_MIB}M" >/dev/null
"$F" volume import base "$W/base.img"
export FERRY_ADMIN=$SRC_ADMIN
"$F" volume create vm --size "${BIG_MIB}M" >/dev/null
"$F" volume import vm "$W/big.img"
rm -f "$W/base.img" "$W/big.img"

echo "== the guest: ferry host gives it a stable NBD endpoint; ferry bench writes 4 KiB blocks at random"
FERRY_LOG=warn "$F" host --server "$SRC_NBD" --volume vm --listen "$HOST_NBD" 2>"$W/host.log" &
pids+=($!)
sleep 0.5
"$F" bench --nbd "$HOST_NBD" --export vm --rw randwrite --bs 4K --iodepth 1 \
  --range 256M --runtime 40 >"$W/bench.out" 2>&1 &
bench=$!
sleep 2

echo "== ferry migrate vm --to $WAN (through the emulated WAN, TLS 1.3, max downtime 100 ms)"
"$F" migrate vm --to "$WAN" --max-downtime 100ms --json >"$W/report.json"
echo "== migration report"
cat "$W/report.json"
echo
echo "== the guest's writes during and after the switch (an I/O error would fail the bench)"
if wait "$bench"; then
  cat "$W/bench.out"
else
  cat "$W/bench.out"
  echo "the workload saw an error" >&2
  exit 1
fi
grep -h "switching\|connected" "$W/host.log" || true
