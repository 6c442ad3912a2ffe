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
# random data per record (a write-heavy guest). Tests read the acks from
# the serial logs and the records from the disk, and compare.
#
# With ferry.ip=ADDR/PREFIX on the command line the guest also brings up
# its first network card (virtio-net) with that address and serves TCP
# echo on port 7 (busybox nc, one `cat` per connection): a client whose
# connection survives a move sees every line it sent come back.
set -euo pipefail
out="${1:-/var/cache/ferry-guest}"
# Bumped whenever the image changes, so a cached older one is rebuilt.
version=2
if [ -s "$out/vmlinuz" ] && [ -s "$out/initrd.img" ] && [ "$(cat "$out/version" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

kpkg=$(apt-cache search --names-only '^linux-image-[0-9.]+-[0-9]+-cloud-amd64-unsigned$' \
  | awk '{print $1}' | sort -V | tail -1)
[ -n "$kpkg" ] || { echo "no Debian cloud kernel package found" >&2; exit 1; }
apt-get download -q "$kpkg" busybox-static >/dev/null 2>&1 \
  || (apt-get update -q >/dev/null && apt-get download -q "$kpkg" busybox-static >/dev/null)
dpkg -x linux-image-*.deb k
dpkg -x busybox-static_*.deb bb
kver=$(ls k/lib/modules | head -1)
mods="k/lib/modules/$kver"

root="$work/root"
mkdir -p "$root"/{bin,dev,proc,sys,mnt,modules}
cp bb/bin/busybox "$root/bin/busybox"
for a in sh mount insmod sleep echo cat md5sum sync dd mkdir ls poweroff reboot ip nc; do
  ln -s busybox "$root/bin/$a"
done

# Modules the guest loads, dependencies first (from each module's depends=).
order=()
add() {
  local m=$1 f d
  for x in "${order[@]}"; do [ "$x" = "$m" ] && return; done
  f=$(find "$mods" -name "$m.ko*" | head -1)
  [ -n "$f" ] || return 0   # built in
  d=$(grep -a -o 'depends=[a-z_0-9,-]*' "$f" | head -1 | cut -d= -f2 | tr ',' ' ')
  for x in $d; do add "$x"; done
  cp "$f" "$root/modules/"
  order+=("$m")
}
for m in virtio_pci virtio_blk virtio_net; do add "$m"; done
printf '%s\n' "${order[@]}" > "$root/modules/order"

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
case " $(cat /proc/cmdline) " in *" ferry.load=heavy "*) heavy=1 ;; esac
for w in $(cat /proc/cmdline); do
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
done
EOF
chmod +x "$root/init"

(cd "$root" && find . | "$work/bb/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1) > "$out/initrd.img.tmp"
cp "k/boot/vmlinuz-$kver" "$out/vmlinuz.tmp"
mv "$out/initrd.img.tmp" "$out/initrd.img"
mv "$out/vmlinuz.tmp" "$out/vmlinuz"
echo "$version" > "$out/version"
echo "guest kernel $kver and initramfs in $out"
