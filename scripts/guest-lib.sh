# Shared by scripts/guest-image.sh and bench/driver_guest.sh (sourced, not
# run): a Debian kernel and busybox unpacked in the current directory, and
# an initramfs root built from them.

# guest_cached OUT VERSION: OUT already holds this version of the guest.
guest_cached() {
  [ -s "$1/vmlinuz" ] && [ -s "$1/initrd.img" ] && [ "$(cat "$1/version" 2>/dev/null)" = "$2" ]
}

# guest_unpack FLAVOUR: the newest linux-image-*-FLAVOUR-unsigned package
# (cloud-amd64, amd64) and busybox-static, unpacked into k/ and bb/; sets
# kver and mods (the kernel's module tree).
guest_unpack() {
  local kpkg
  kpkg=$(apt-cache search --names-only "^linux-image-[0-9.]+-[0-9]+-$1-unsigned\$" \
    | awk '{print $1}' | sort -V | tail -1)
  [ -n "$kpkg" ] || { echo "no Debian $1 kernel package found" >&2; return 1; }
  apt-get download -q "$kpkg" busybox-static >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null && apt-get download -q "$kpkg" busybox-static >/dev/null)
  dpkg -x linux-image-*.deb k
  dpkg -x busybox-static_*.deb bb
  kver=$(ls k/lib/modules | head -1)
  mods="k/lib/modules/$kver"
}

# guest_root ROOT APPLET...: ROOT with busybox and the applets in bin/,
# and the usual mount points.
guest_root() {
  local root=$1 a
  shift
  mkdir -p "$root"/{bin,dev,proc,sys,mnt,tmp,modules}
  cp bb/bin/busybox "$root/bin/busybox"
  for a in "$@"; do ln -s busybox "$root/bin/$a"; done
}

# guest_modules ROOT MODULE...: the modules, and those they depend on
# (each module's depends=), in ROOT/modules, their load order in
# ROOT/modules/order. Modules built into the kernel are skipped.
guest_modules() {
  local root=$1 m
  shift
  order=()
  for m in "$@"; do guest_add_module "$root" "$m"; done
  printf '%s\n' "${order[@]}" > "$root/modules/order"
}

guest_add_module() {
  local root=$1 m=$2 f d x
  for x in "${order[@]}"; do [ "$x" = "$m" ] && return 0; done
  f=$(find "$mods" -name "$m.ko*" | head -1)
  [ -n "$f" ] || return 0
  d=$(grep -a -o 'depends=[a-z_0-9,-]*' "$f" | head -1 | cut -d= -f2 | tr ',' ' ')
  for x in $d; do guest_add_module "$root" "$x"; done
  cp "$f" "$root/modules/"
  order+=("$m")
}

# guest_pack ROOT OUT VERSION: OUT/initrd.img (ROOT as a cpio), OUT/vmlinuz
# and OUT/version, each written whole before it replaces the old one.
guest_pack() {
  (cd "$1" && find . | "$OLDPWD/bb/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1) > "$2/initrd.img.tmp"
  cp "k/boot/vmlinuz-$kver" "$2/vmlinuz.tmp"
  mv "$2/initrd.img.tmp" "$2/initrd.img"
  mv "$2/vmlinuz.tmp" "$2/vmlinuz"
  echo "$3" > "$2/version"
}
