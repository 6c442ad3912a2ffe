#!/usr/bin/env bash
# Builds the guest of the disk-driver experiment (seed 004's tables, in
# bench/evidence.py --only drivers): Debian's generic kernel (the cloud
# kernel has no emulated SCSI controller driver) and a busybox initramfs
# whose /init measures the guest's data disks the way the seed did, with
# dd and 64 KiB requests. Needs apt-get and gzip. Output, in $1 (default
# /var/cache/ferry-driver-guest): vmlinuz, initrd.img. Idempotent.
#
# In the guest, with ferry.disks=N and ferry.mib=M on the command line:
#   1. wait for N disks (/dev/vd* for virtio-blk, /dev/sd* for SCSI) and
#      print "ferry-driver: disk NAME SECTORS" for each (the host tells
#      them apart by size);
#   2. per disk, write M MiB (a multiple of 16) of non-zero data with dd
#      (bs=64k, through the guest's page cache, then fsync) and print
#      "ferry-driver: write NAME T0 T1" (guest uptime, seconds);
#   3. print "ferry-driver: written" and wait for a line on the second
#      serial port (the host drops its own caches meanwhile);
#   4. drop the guest's caches; per disk, read M MiB back with dd (bs=64k)
#      and print "ferry-driver: read NAME T0 T1"; print
#      "ferry-driver: done" and power off.
set -euo pipefail
out="${1:-/var/cache/ferry-driver-guest}"
version=2
. "$(cd "$(dirname "$0")/../scripts" && pwd)/guest-lib.sh"
guest_cached "$out" "$version" && exit 0
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

guest_unpack amd64
root="$work/root"
guest_root "$root" sh mount insmod sleep echo cat cut dd ls wc poweroff
guest_modules "$root" virtio_pci virtio_blk virtio_scsi sd_mod sym53c8xx

cat > "$root/init" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
for m in $(cat /modules/order); do insmod /modules/$m.ko* 2>/dev/null; done
n=1; mib=64
for w in $(cat /proc/cmdline); do
  case "$w" in ferry.disks=*) n=${w#*=} ;; ferry.mib=*) mib=${w#*=} ;; esac
done
disks() { for d in /sys/block/vd* /sys/block/sd*; do [ -e "$d" ] && echo "${d##*/}"; done; }
i=0
while [ "$(disks | wc -l)" -lt "$n" ] && [ $i -lt 600 ]; do
  sleep 0.1; i=$((i+1))
done
up() { cut -d' ' -f1 /proc/uptime; }
for d in $(disks); do echo "ferry-driver: disk $d $(cat /sys/block/$d/size)"; done
# 16 MiB of random data, written over and over: non-zero blocks that no
# layer can skip. The disk stays open on fd 3 between the dd runs, so no
# close flushes it early; the last run's fsync flushes the whole device.
dd if=/dev/urandom of=/tmp/pattern bs=64k count=256 2>/dev/null
blocks=$((mib * 16))
for d in $(disks); do
  exec 3<>/dev/$d
  t0=$(up)
  k=0
  while [ $k -lt $((mib / 16)) ]; do
    sync=; [ $k -eq $((mib / 16 - 1)) ] && sync=,fsync
    dd if=/tmp/pattern of=/dev/$d bs=64k seek=$((k * 256)) conv=notrunc$sync 2>/dev/null
    k=$((k + 1))
  done
  echo "ferry-driver: write $d $t0 $(up)"
  exec 3<&-
done
echo "ferry-driver: written"
read go < /dev/ttyS1
echo 3 > /proc/sys/vm/drop_caches
for d in $(disks); do
  t0=$(up)
  dd if=/dev/$d of=/dev/null bs=64k count=$blocks 2>/dev/null
  echo "ferry-driver: read $d $t0 $(up)"
done
echo "ferry-driver: done"
poweroff -f
EOF
chmod +x "$root/init"
guest_pack "$root" "$out" "$version"
echo "driver guest: $out (kernel $kver)"
