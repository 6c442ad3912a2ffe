#!/usr/bin/env bash
# The main job on an embedded default: two sites on this machine joined by
# an emulated WAN (toxiproxy: 100 Mbit/s, 20 ms RTT), each with a storage
# daemon and a host; a guest (QEMU, Debian's kernel with a busybox
# initramfs that writes numbered records to its disk with fsync) running
# at site b with its disk at site a, so every disk request crosses the
# WAN; the controller measuring it and moving what it decides (the disk,
# the VM or both); then a teleport (VM and disk together) to the other
# site; the reports at the end. The controller's page is at the address
# printed while it runs. About five minutes once built.
#
# FERRY_DEMO_KEEP=1 keeps the work directory (logs, journal, serial
# consoles). scripts/demo-volume.sh is the volume-only demo (a migration of
# an OS image under a workload, deduplicated against a base image).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q -p ferry-cli
F=$PWD/target/release/ferry
GUEST=${FERRY_GUEST_DIR:-/var/cache/ferry-guest}
unset FERRY_ADMIN FERRY_HOST FERRY_CONTROLLER FERRY_TLS_DIR

W=$(mktemp -d /tmp/ferry-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # Guests outlive their host daemon by design: end them.
  pkill -9 -f "qemu-system.*$W/" 2>/dev/null || true
  [ "${FERRY_DEMO_KEEP:-0}" = 1 ] && echo "work directory kept: $W" || rm -rf "$W"
}
trap cleanup EXIT
base=$((20000 + RANDOM % 20000))
port() { echo "127.0.0.1:$((base + $1))"; }
NBD_A=$(port 0) ADMIN_A=$(port 1) MIG_A=$(port 2) CTL_A=$(port 3) MOVES_A=$(port 4)
NBD_B=$(port 10) ADMIN_B=$(port 11) MIG_B=$(port 12) CTL_B=$(port 13) MOVES_B=$(port 14)
TOXI=$(port 20) CTL=$(port 21)
# What each site reaches of the other: through the WAN.
NBD_A_WAN=$(port 30) MIG_A_WAN=$(port 31) MOVES_A_WAN=$(port 32)
NBD_B_WAN=$(port 40) MIG_B_WAN=$(port 41) MOVES_B_WAN=$(port 42)

wait_http() { # URL
  for _ in $(seq 200); do curl -sf "$1" >/dev/null && return 0; sleep 0.1; done
  echo "nothing answers at $1" >&2; exit 1
}

echo "== the WAN: toxiproxy, 10 ms and 100 Mbit/s each way"
toxiproxy-server -host 127.0.0.1 -port "${TOXI#*:}" >"$W/toxiproxy.log" 2>&1 &
pids+=($!)
wait_http "http://$TOXI/version"
wan() { # NAME LISTEN UPSTREAM
  curl -sf -X POST "http://$TOXI/proxies" \
    -d "{\"name\":\"$1\",\"listen\":\"$2\",\"upstream\":\"$3\",\"enabled\":true}" >/dev/null
  for s in upstream downstream; do
    curl -sf -X POST "http://$TOXI/proxies/$1/toxics" \
      -d "{\"name\":\"rate-$s\",\"type\":\"bandwidth\",\"stream\":\"$s\",\"attributes\":{\"rate\":12500}}" >/dev/null
    curl -sf -X POST "http://$TOXI/proxies/$1/toxics" \
      -d "{\"name\":\"delay-$s\",\"type\":\"latency\",\"stream\":\"$s\",\"attributes\":{\"latency\":10}}" >/dev/null
  done
}
wan nbd-a "$NBD_A_WAN" "$NBD_A"; wan mig-a "$MIG_A_WAN" "$MIG_A"; wan moves-a "$MOVES_A_WAN" "$MOVES_A"
wan nbd-b "$NBD_B_WAN" "$NBD_B"; wan mig-b "$MIG_B_WAN" "$MIG_B"; wan moves-b "$MOVES_B_WAN" "$MOVES_B"

echo "== two sites: a storage daemon and a host each; each trusts its peer's certificate"
for s in a b; do
  mkdir -p "$W/$s"
  "$F" certs show --pool "$W/$s/pool" >/dev/null
  "$F" certs show --pool "$W/$s/host" >/dev/null
done
"$F" certs trust "$W/b/pool/tls/cert.pem" --pool "$W/a/pool" --name b >/dev/null
"$F" certs trust "$W/a/pool/tls/cert.pem" --pool "$W/b/pool" --name a >/dev/null
"$F" certs trust "$W/b/host/tls/cert.pem" --pool "$W/a/host" --name b >/dev/null
"$F" certs trust "$W/a/host/tls/cert.pem" --pool "$W/b/host" --name a >/dev/null
"$F" serve --pool "$W/a/pool" --nbd "$NBD_A" --admin "$ADMIN_A" --migrate "$MIG_A" 2>"$W/a/serve.log" &
pids+=($!)
"$F" serve --pool "$W/b/pool" --nbd "$NBD_B" --admin "$ADMIN_B" --migrate "$MIG_B" 2>"$W/b/serve.log" &
pids+=($!)
"$F" host --state-dir "$W/a/host" --control "$CTL_A" --move-listen "$MOVES_A" --image-dir "$GUEST" \
  --memory-sample-every 5 2>"$W/a/host.log" &
pids+=($!)
"$F" host --state-dir "$W/b/host" --control "$CTL_B" --move-listen "$MOVES_B" --image-dir "$GUEST" \
  --memory-sample-every 5 2>"$W/b/host.log" &
pids+=($!)
for u in "$ADMIN_A/v1/server" "$ADMIN_B/v1/server" "$CTL_A/v1/vms" "$CTL_B/v1/vms"; do wait_http "http://$u"; done

echo "== the guest's disk at site a: a 64 MiB ext4 volume"
truncate -s 64M "$W/web.img"
mke2fs -q -F -t ext4 "$W/web.img"
"$F" volume create web-root --size 64M --admin "$ADMIN_A" >/dev/null
"$F" volume import web-root "$W/web.img" --admin "$ADMIN_A" >/dev/null
rm -f "$W/web.img"

echo "== the guest runs at site b; its disk stays at a, across the WAN"
"$F" vm --host "$CTL_B" create web --memory 128M --accel tcg \
  --disk "web-root@$NBD_A_WAN@$ADMIN_A" \
  --kernel "$GUEST/vmlinuz" --initrd "$GUEST/initrd.img" --cmdline "console=ttyS0 quiet"
acks() { cat "$W"/*/host/vms/web/serial.log "$W"/*/host/moved/web.*/serial.log 2>/dev/null | grep -c '^ack ' || true; }
for _ in $(seq 120); do [ "$(acks)" -ge 5 ] && break; sleep 1; done
echo "   the guest has acknowledged $(acks) records"

echo "== the controller over both sites"
"$F" control run --state-dir "$W/ctl" --listen "$CTL" --interval 5s --sample 2s 2>"$W/ctl.log" &
pids+=($!)
wait_http "http://$CTL/v1/status"
export FERRY_CONTROLLER=$CTL
"$F" site add a --cpu-capacity 8 --host "control=$CTL_A,moves=$MOVES_A_WAN" \
  --storage "nbd=$NBD_A_WAN,nbd_local=$NBD_A,migrate=$MIG_A_WAN,admin=$ADMIN_A"
"$F" site add b --cpu-capacity 8 --host "control=$CTL_B,moves=$MOVES_B_WAN" \
  --storage "nbd=$NBD_B_WAN,nbd_local=$NBD_B,migrate=$MIG_B_WAN,admin=$ADMIN_B"
"$F" site link a b --rtt-ms 20 --mbit 100
echo
echo "   the controller's page, live: http://$CTL/"
echo
finished=""
for _ in $(seq 240); do
  finished=$(curl -sf "http://$CTL/v1/journal?limit=200" | grep -o '"event":"finished"' || true)
  [ -n "$finished" ] && break
  sleep 1
done
echo "== what the controller saw, decided and did"
"$F" control status
[ -n "$finished" ] || { echo "the controller moved nothing in 4 minutes" >&2; exit 1; }

# Where the guest runs now, and where its disk is.
if "$F" vm --host "$CTL_A" show web --json >/dev/null 2>&1; then
  at=a here=$CTL_A
else
  at=b here=$CTL_B
fi
if [ "$at" = a ]; then to=b; else to=a; fi
eval "moves_wan=\$MOVES_${to^^}_WAN mig_wan=\$MIG_${to^^}_WAN"
echo
echo "== a teleport: the guest and its disk to site $to, one pause"
"$F" vm --host "$here" migrate web --to-host "$moves_wan" --with-disk --to-storage "$mig_wan" \
  --max-downtime 300ms
eval "there=\$CTL_${to^^}"
echo
"$F" vm --host "$there" show web
n0=$(acks)
sleep 5
n1=$(acks)
boots=$(cat "$W"/*/host/vms/web/serial.log "$W"/*/host/moved/web.*/serial.log 2>/dev/null | grep -c 'ferry-guest: boot' || true)
echo
echo "== the guest: $n1 records acknowledged across every move ($((n1 - n0)) in the last 5 s), booted $boots time(s)"
[ "$n1" -gt "$n0" ] || { echo "the guest stopped writing" >&2; exit 1; }
[ "$boots" = 1 ] || { echo "the guest rebooted" >&2; exit 1; }
