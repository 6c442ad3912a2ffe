#!/usr/bin/env bash
# Installs what ferry's build, demo and tests need on Debian (run as root):
# the real clients the tests drive, and a Rust toolchain if there is none.
#   scripts/install-deps.sh          build + demo needs
#   scripts/install-deps.sh --test   also the test clients and cargo-fuzz
set -euo pipefail

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

export DEBIAN_FRONTEND=noninteractive
# qemu-system-x86: the demo's guest (and the VM tests').
pkgs=(build-essential pkg-config ca-certificates curl e2fsprogs qemu-system-x86 qemu-utils)
if [ "$want_test" = 1 ]; then
  # libiscsi-bin: iscsi-test-cu, iscsi-ls, iscsi-inq, iscsi-perf; qemu-block-extra:
  # qemu-img and qemu-io over iscsi://; tgt: the peer in bench/iscsi_peers.py.
  # qemu-system-x86: real QEMU guests for the QMP client and the VM tests.
  # python3-matplotlib: bench/evidence.py (its --quick run is a test);
  # chromium: the controller's page is checked in a real browser;
  # etcd-server: controllers sharing their state and electing a leader;
  # prometheus: scrapes every daemon, and runs the Grafana dashboard's queries;
  # syslinux, mtools, dosfstools: a disk a guest boots from (--boot-disk).
  # iproute2: guest networks (bridges, VXLAN, taps; the sites' namespaces).
  # nftables: a gateway cut off from its cluster (a net_cls class dropped).
  # xfsprogs: a pool on XFS, whose files share extents (a migration's
  # destination shares the blocks it already holds instead of copying them).
  # debootstrap, fdisk: the Debian guest image (scripts/debian-guest.sh);
  # sysbench, mariadb-client, wrk, openssh-client: its clients; tcpdump:
  # the real-guest benches' packet capture (FERRY_BENCH_PCAP).
  # ceph-mon, ceph-mgr, ceph-osd, ceph-common: the Ceph clusters volumes on
  # RBD are tested in (scripts/ceph-cluster.sh); librbd1 is what ferry loads.
  pkgs+=(ceph-mon ceph-mgr ceph-osd ceph-common librbd1 debootstrap fdisk sysbench mariadb-client openssh-client wrk tcpdump qemu-block-extra libnbd-bin python3-libnbd nbdkit fio python3 python3-matplotlib chromium rsync libiscsi-bin tgt etcd-server prometheus syslinux syslinux-common mtools dosfstools iproute2 nftables xfsprogs)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
fi

# The unprivileged user guests' QEMU runs as (ferry host --qemu-user).
if ! id ferry-qemu >/dev/null 2>&1; then
  echo "== useradd ferry-qemu"
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin ferry-qemu
fi

# Rust: use what is there (rustup or distro); otherwise install rustup.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null 2>&1; then
  echo "== installing the Rust toolchain"
  if apt-cache show rustup >/dev/null 2>&1; then
    apt-get install -y -q rustup
    rustup default stable
  else
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  fi
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt || true
fi

# toxiproxy: the emulated WAN of the demo, and link faults in the tests. Pinned.
if ! command -v toxiproxy-server >/dev/null 2>&1; then
  GO=$(command -v go || true)
  [ -z "$GO" ] && [ -x /usr/local/go/bin/go ] && GO=/usr/local/go/bin/go
  if [ -z "$GO" ]; then
    apt-get install -y -q golang-go
    GO=$(command -v go)
  fi
  # v2.9.0 needs Go 1.22; Debian 12's Go 1.19 builds v2.5.0 (same API).
  if "$GO" version | grep -Eq 'go1\.(1[0-9]|2[01])([. ]|$)'; then tp=v2.5.0; else tp=v2.9.0; fi
  echo "== go install toxiproxy $tp"
  tmp=$(mktemp -d)
  GOBIN="$tmp" "$GO" install "github.com/Shopify/toxiproxy/v2/cmd/server@$tp"
  install -m 0755 "$tmp/server" /usr/local/bin/toxiproxy-server
  rm -rf "$tmp"
fi

# The guest of the demo and the VM tests: Debian's kernel and a busybox
# initramfs (does nothing when it is there).
bash "$(dirname "$0")/guest-image.sh" "${FERRY_GUEST_DIR:-/var/cache/ferry-guest}" \
  || echo "WARN: no guest image; the demo and the VM tests need it"

if [ "$want_test" = 1 ]; then
  # cargo-fuzz needs a nightly toolchain; pinned version of the tool itself.
  if command -v rustup >/dev/null 2>&1 && ! rustup run nightly rustc --version >/dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal || echo "WARN: no nightly toolchain; fuzz smoke runs will be skipped"
  fi
  if ! command -v cargo-fuzz >/dev/null 2>&1; then
    cargo install cargo-fuzz --version 0.13.2 --locked || echo "WARN: cargo-fuzz not installed; fuzz smoke runs will be skipped"
  fi
  # A real OS guest (Debian, systemd, cloud-init, MariaDB, Apache+PHP)
  # booting from its disk: the networked database test and the benches.
  bash "$(dirname "$0")/debian-guest.sh" "${FERRY_GUEST_DIR:-/var/cache/ferry-guest}/debian-bookworm.img" \
    || echo "WARN: no Debian guest image; the Debian guest test will fail under FERRY_REQUIRE_TOOLS"
  # The guest of the evidence set's disk-driver experiment (seed 004):
  # Debian's generic kernel, with the emulated SCSI controller's driver.
  bash "$(dirname "$0")/../bench/driver_guest.sh" "${FERRY_DRIVER_GUEST_DIR:-/var/cache/ferry-driver-guest}" \
    || echo "WARN: no driver guest; bench/evidence.py --only drivers builds it when run"
  # QEMU tools that negotiate NBD extended headers (QEMU >= 9), beside the
  # system QEMU.
  bash "$(dirname "$0")/qemu-ext.sh" "${FERRY_QEMU_EXT_DIR:-/opt/ferry/qemu-ext}" \
    || echo "WARN: no QEMU >= 9; the NBD extended-header tests will fail under FERRY_REQUIRE_TOOLS"
fi
