#!/usr/bin/env bash
# Builds the test guest: Debian's cloud kernel and a busybox initramfs whose
# /init mounts the ext4 file system on the first virtio disk and runs the
# record workload (see below). Output, in $1 (default
# /var/cache/ferry-guest): vmlinuz, initrd.img. Idempotent: does nothing
# when both exist. Needs apt-get (Debian) and gzip (busybox packs the cpio).
#
# The workload, in the guest: a counter N kept in memory (a shell
# variable, so it restarts if the guest reboots) and, forever:
#   N=N+1; append "rec N UPTIME MD5(N UPTIME)" to /mnt/records; sync -d;
#   print "ack N UPTIME" on the serial console.
# An "ack" line means the record is durable on the disk. With
# ferry.load=heavy on the kernel command line it also rewrites 256 KiB of
# random data per record (a write-heavy guest). With ferry.pace=SECONDS
# it sleeps that long after each record (a guest with a set demand, whose
# rate falls only when its CPU is short). With ferry.fill=MIB it first
# fills that much of its memory with random data (a ramfs file), so that
# a move has that much memory to send. Tests read the acks from the
# serial logs and the records from the disk, and compare.
#
# With ferry.ip=ADDR/PREFIX on the command line the guest also brings up
# its first network card (virtio-net) with that address and serves TCP
# echo on port 7 (busybox nc, one `cat` per connection): a client whose
# connection survives a move sees every line it sent come back.
set -euo pipefail
out="${1:-/var/cache/ferry-guest}"
# Bumped whenever the image changes, so a cached older one is rebuilt.
version=4
. "$(cd "$(dirname "$0")" && pwd)/guest-lib.sh"
guest_cached "$out" "$version" && exit 0
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

guest_unpack cloud-amd64
root="$work/root"
guest_root "$root" sh mount insmod sleep echo cat md5sum sync dd mkdir ls poweroff reboot ip nc
guest_modules "$root" virtio_pci virtio_blk virtio_net

cat > "$root/init" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules/order); do insmod /modules/$m.ko* 2>/dev/null; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
if ! mount -t ext4 /dev/vda /mnt; then
  echo "ferry-guest: cannot mount /dev/vda"; sleep 5; poweroff -f
fi
heavy=0
pace=
case " $(cat /proc/cmdline) " in *" ferry.load=heavy "*) heavy=1 ;; esac
for w in $(cat /proc/cmdline); do
  case "$w" in ferry.pace=*) pace="${w#ferry.pace=}" ;; esac
  case "$w" in ferry.fill=*)
    mkdir -p /fill && mount -t ramfs ramfs /fill
    dd if=/dev/urandom of=/fill/blob bs=1M count="${w#ferry.fill=}" 2>/dev/null
    echo "ferry-guest: filled ${w#ferry.fill=} MiB"
    ;;
  esac
  case "$w" in ferry.ip=*)
    ip link set lo up
    i=0
    while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
    ip link set eth0 up && ip addr add "${w#ferry.ip=}" dev eth0
    nc -ll -p 7 -e /bin/cat &
    echo "ferry-guest: eth0 ${w#ferry.ip=}, echo on 7"
    ;;
  esac
done
echo "ferry-guest: boot"
n=0
while true; do
  n=$((n+1))
  read up rest < /proc/uptime
  sum=$(echo "$n $up" | md5sum)
  echo "rec $n $up ${sum%% *}" >> /mnt/records
  if [ $heavy = 1 ]; then
    dd if=/dev/urandom of=/mnt/heavy bs=64k count=4 conv=notrunc 2>/dev/null
  fi
  sync -d /mnt/records
  echo "ack $n $up"
  if [ -n "$pace" ]; then sleep "$pace"; fi
done
EOF
chmod +x "$root/init"

guest_pack "$root" "$out" "$version"
echo "guest kernel $kver and initramfs in $out"
