#!/usr/bin/env bash
# Builds a real guest OS disk: Debian (bookworm by default) with its own
# kernel, systemd, cloud-init (NoCloud), MariaDB, Apache with PHP, an SSH
# server, dbench and a compiler, booting from the disk itself. Built from
# Debian packages with debootstrap and written without mounting anything:
#
#   partition 1 (FAT, 64 MiB): SYSLINUX, the kernel and its initramfs
#   partition 2 (ext4, label ferry-root): the root file system (mke2fs -d)
#
# Output: $1 (default /var/cache/ferry-guest/debian-bookworm.img), a raw
# image of $SIZE (default 4G). Idempotent: does nothing when the image of
# this script's version exists. Needs root, debootstrap, syslinux, mtools,
# dosfstools, fdisk (sfdisk) and e2fsprogs.
#
# The image has no password, no SSH key and no address: cloud-init sets
# them at first boot from the NoCloud seed `ferry vm create --cloud-init`
# attaches. Baked in for the tests and benches:
#   - MariaDB listens on every address (clients come over the guest network);
#   - /var/www/html/db.php reads one row of sbtest.sbtest1 (sysbench's table)
#     and prints it, so an HTTP load reaches the database;
#   - timers that would wake up during a measurement are off (apt, man-db,
#     e2scrub, fstrim, logrotate), and so are units with nothing to do here
#     (e2scrub_reap, the virtual consoles' gettys) and cloud-init modules
#     no test uses, for a faster first boot under TCG.
set -euo pipefail
release="${RELEASE:-bookworm}"
out="${1:-/var/cache/ferry-guest/debian-$release.img}"
size="${SIZE:-4G}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Bumped whenever the image changes, so a cached older one is rebuilt.
version=3
stamp="$out.version"
if [ -s "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
for tool in debootstrap syslinux mcopy mkfs.vfat sfdisk mke2fs; do
  command -v "$tool" >/dev/null || { echo "debian-guest.sh needs $tool" >&2; exit 1; }
done
mkdir -p "$(dirname "$out")"
work=$(mktemp -d "${TMPDIR:-/var/tmp}/ferry-debian.XXXXXX")
root="$work/root"
cleanup() {
  # Package scripts may leave /proc or /sys mounted in the target.
  umount "$root/proc" "$root/sys" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# debootstrap resolves only a base; the rest goes in with apt inside the
# new root (services are not started there: policy-rc.d).
base=systemd-sysv,udev,linux-image-cloud-amd64,initramfs-tools,ifupdown,iproute2,netbase,procps
rest="locales cloud-init sudo openssh-server mariadb-server mariadb-client apache2 php libapache2-mod-php php-mysql"
rest+=" dbench gcc make libc6-dev"
debootstrap --variant=minbase --include="$base" "$release" "$root" "$mirror" > "$work/debootstrap.log" 2>&1 ||
  { tail -30 "$work/debootstrap.log" "$root/debootstrap/debootstrap.log" >&2; exit 1; }
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
# The locale cloud-init sets, made here once instead of at every first boot.
echo "en_US.UTF-8 UTF-8" > "$root/etc/locale.gen"
printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
chmod +x "$root/usr/sbin/policy-rc.d"
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get install -y -q --no-install-recommends $rest \
  > "$work/apt.log" 2>&1 || { tail -30 "$work/apt.log" >&2; exit 1; }
chroot "$root" apt-get clean
chroot "$root" locale-gen >/dev/null
rm -f "$root/usr/sbin/policy-rc.d"
umount "$root/proc" "$root/sys" 2>/dev/null || true

# --- configuration of the root file system --------------------------------
echo "LABEL=ferry-root / ext4 defaults,errors=remount-ro 0 1" > "$root/etc/fstab"
echo debian > "$root/etc/hostname"
: > "$root/etc/machine-id"   # systemd makes a new one at first boot
cat > "$root/etc/network/interfaces" <<'EOF'
auto lo
iface lo inet loopback
source /etc/network/interfaces.d/*
EOF
# Only NoCloud: the first boot does not wait for metadata servers that are
# not there. One SSH host key type (each RSA or DSA key takes seconds of
# an emulated CPU at first boot).
# The config and final stages run only the modules a NoCloud guest here
# uses (the rest look for package mirrors, configuration management and
# keyboards, and the locale module alone took 13 s of an emulated CPU to
# write the locale the image already has).
cat > "$root/etc/cloud/cloud.cfg.d/90_ferry.cfg" <<'EOF'
datasource_list: [ NoCloud, None ]
ssh_genkeytypes: [ ed25519 ]
cloud_config_modules: [ set-passwords, runcmd ]
cloud_final_modules: [ write-files-deferred, scripts-vendor, scripts-per-once, scripts-per-boot,
  scripts-per-instance, scripts-user, ssh-authkey-fingerprints, final-message, power-state-change ]
EOF
echo "LANG=en_US.UTF-8" > "$root/etc/default/locale"
sed -i 's/^bind-address.*/bind-address = 0.0.0.0/' "$root/etc/mysql/mariadb.conf.d/50-server.cnf"
cat > "$root/var/www/html/db.php" <<'EOF'
<?php
// One row of sysbench's table, read through MariaDB on every request.
$db = new mysqli("127.0.0.1", "sbtest", "sbtest", "sbtest");
$id = random_int(1, 1000);
$r = $db->query("SELECT id, k, c FROM sbtest1 WHERE id = $id");
$row = $r ? $r->fetch_assoc() : null;
echo $row ? "row {$row['id']} {$row['k']}\n" : "no row\n";
EOF
for unit in apt-daily.timer apt-daily-upgrade.timer man-db.timer e2scrub_all.timer \
  fstrim.timer logrotate.timer; do
  rm -f "$root/etc/systemd/system/timers.target.wants/$unit"
done
# Units with nothing to do on this guest that compete with the first boot
# for its one emulated CPU: e2scrub_reap looks for LVM snapshots (36 s at
# first boot), the gettys serve virtual consoles the guest has no display
# for (the serial console keeps its own).
for unit in e2scrub_reap.service getty-static.service getty@tty1.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done
kernel=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -1)
initrd=$(ls "$root"/boot/initrd.img-* | sort -V | tail -1)

# --- the disk: MBR, FAT boot partition, ext4 root --------------------------
boot_mib=64
start_mib=1
truncate -s 0 "$work/disk.img"
truncate -s "$size" "$work/disk.img"
total=$(stat -c %s "$work/disk.img")
root_off=$(((start_mib + boot_mib) * 1048576))
sfdisk -q "$work/disk.img" <<EOF
label: dos
start=${start_mib}MiB, size=${boot_mib}MiB, type=c, bootable
start=$((start_mib + boot_mib))MiB, type=83
EOF
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$work/disk.img" bs=440 count=1 conv=notrunc status=none

truncate -s "${boot_mib}M" "$work/boot.img"
mkfs.vfat -n FERRYBOOT "$work/boot.img" >/dev/null
syslinux --install "$work/boot.img"
cat > "$work/syslinux.cfg" <<'EOF'
DEFAULT debian
SERIAL 0 115200
PROMPT 0
TIMEOUT 1
LABEL debian
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND root=LABEL=ferry-root ro console=ttyS0 net.ifnames=0 quiet
EOF
mcopy -i "$work/boot.img" "$kernel" ::vmlinuz
mcopy -i "$work/boot.img" "$initrd" ::initrd.img
mcopy -i "$work/boot.img" "$work/syslinux.cfg" ::syslinux.cfg
dd if="$work/boot.img" of="$work/disk.img" bs=1M seek=$start_mib conv=notrunc status=none

root_kib=$(((total - root_off) / 1024))
mke2fs -q -F -t ext4 -L ferry-root -E offset=$root_off,nodiscard -d "$root" "$work/disk.img" "${root_kib}k"
mv "$work/disk.img" "$out"
echo "$version" > "$stamp"
echo "built $out ($release, $(du -h --apparent-size "$out" | cut -f1), $(du -sh "$root" | cut -f1) installed)"
