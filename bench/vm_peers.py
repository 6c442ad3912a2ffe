#!/usr/bin/env python3
"""Moving a running VM, memory and disk, across an emulated WAN: ferry
against what `virsh migrate --live --copy-storage-all` does with QEMU alone.

The guest: Debian's kernel (scripts/guest-image.sh) on a Debian LAMP disk
image (bench/similarity.sh), 256 MiB of RAM, TCG; it appends a numbered,
timestamped record with fsync to /records every few milliseconds and prints
an "ack" per durable record on its serial console ("heavy": also rewrites
256 KiB of random data per record). Site B already holds a sibling VM's
disk (the minimal install of the same release). Links are toxiproxy
proxies (bandwidth cap and latency each way); bytes are toxiproxy's count
over every proxy the move used. One after the other, in one run:

  ferry-vm-only   ferry vm migrate --to-host (memory only; the disk stays)
  ferry-teleport  ferry vm migrate --to-host --with-disk --to-storage
                  --to-storage-admin
  qemu-native     the destination QEMU (-incoming defer -S) exports its
                  empty disk over NBD (nbd-server-start, block-export-add);
                  the source mirrors into it (blockdev-mirror sync=full),
                  then migrates memory (multifd, one channel, zstd: QEMU's
                  best for a slow link); at completion the mirror is cancelled in its
                  ready state and the destination resumed (libvirt's order)
  qemu-native-sync  the same with libvirt's --copy-storage-synchronous-writes
                  (the mirror in write-blocking mode: each guest write
                  reaches both disks, so a guest that writes faster than
                  the mirror copies cannot keep it from converging)

The guest's pause is QEMU's own stamps: STOP at the source to RESUME at the
destination (host clocks). The largest gap between consecutive records'
uptime stamps (both sides' serial logs) around the switch is reported too,
but under TCG the guest's clock stands still while QEMU stops it, so that
gap shows the guest's slowness after it resumes (a cold translation cache
at the destination), not the stop. The largest gap of the whole move is
placed in time (host clock, seconds from the command) by watching the
serial logs as the acks appear: a stall during the pre-copy shows there.
`--keep-logs DIR` keeps the daemons' logs (`FERRY_BENCH_LOG` sets their
level; the host daemon logs every guest request over 100 ms).

With `--repeats N` every (RTT, load) point moves the guest N times per
peer, the peers' order rotated each time, and a second table gives each
peer's median STOP→RESUME with its spread.

  python3 bench/vm_peers.py [--rtt 20 --rtt 100] [--mbit 100] [--loads idle,heavy] [--repeats 3] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ensure_ferry, free_port, version  # noqa: E402
from migration_peers import Daemon, Exited, Link, qmp, wait_http  # noqa: E402

GUEST = os.environ.get("FERRY_GUEST_DIR", "/var/cache/ferry-guest")
MEM = "256M"
ACCEL = "tcg"  # --accel; module-wide so every peer runs the same way
KEEP_LOGS = None  # --keep-logs: where the host daemons' logs are copied
MAX_DOWNTIME_MS = 300
# QEMU's memory stream runs over this many parallel connections (multifd,
# zstd); 0: QEMU's classic single stream, uncompressed (--multifd-channels).
# One is QEMU's best on these links: sharing one link, four channels each
# carry a quarter of its rate and the last round and the device state
# cross slower (copy-storage pauses of 1,064-1,369 ms at 100 Mbit/s and
# 20 ms, against 373-440 ms with one channel and 446-509 ms with the
# classic stream; docs/benchmarks.md, "QEMU's memory channels").
MULTIFD_CHANNELS = 1


def cmdline(load):
    return "console=ttyS0 quiet" + (" ferry.load=heavy" if load == "heavy" else "")


def test_guest(host, vm, volume, nbd, admin, memory="128M", accel="tcg", cmdline="console=ttyS0 quiet"):
    """The test guest `vm` made on `host` (a Host), booted from GUEST's
    kernel and initramfs, its disk volume `volume` at `nbd` (admin API
    `admin`); returns its serial log."""
    r = host.vm("create", vm, "--memory", memory, "--accel", accel,
                "--disk", f"{volume}@{nbd}@{admin}",
                "--kernel", f"{GUEST}/vmlinuz", "--initrd", f"{GUEST}/initrd.img",
                "--cmdline", cmdline)
    if r.returncode != 0:
        raise RuntimeError(f"{vm}: {r.stderr}")
    return os.path.join(host.state, "vms", vm, "serial.log")


def parse_ack(line):
    """(n, uptime) of an "ack N UPTIME" line, else None."""
    f = line.split()
    if len(f) == 3 and f[0] == "ack":
        try:
            return int(f[1]), float(f[2])
        except ValueError:
            pass
    return None


def acks(paths):
    """(n, uptime) of every complete ack line in the logs, by n."""
    out = {}
    for p in paths:
        try:
            text = open(p, errors="replace").read()
        except OSError:
            continue
        for line in text.splitlines()[:-1] if not text.endswith("\n") else text.splitlines():
            a = parse_ack(line)
            if a:
                out[a[0]] = a[1]
    return sorted(out.items())


def gaps_ms(paths, after_n=0):
    a = [x for x in acks(paths) if x[0] > after_n]
    return [(b[1] - x[1]) * 1000 for x, b in zip(a, a[1:]) if b[0] == x[0] + 1]


def max_gap_ms(paths, after_n=0):
    g = gaps_ms(paths, after_n)
    return max(g) if g else None


def median_gap_ms(paths, after_n=0):
    g = sorted(gaps_ms(paths, after_n))
    return g[len(g) // 2] if g else None


class AckClock:
    """Host-clock time at which each ack line appears in the serial logs
    (polled every 10 ms): places the guest's largest gap against the
    move's phases. Files are kept open, so a log moved away still reads."""

    def __init__(self, paths):
        import threading
        self.paths, self.files, self.seen, self.rest = paths, {}, {}, {}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop_ev.is_set():
            now = time.time()
            for p in self.paths:
                if p not in self.files:
                    try:
                        self.files[p] = open(p, errors="replace")
                    except OSError:
                        continue
                text = self.rest.get(p, "") + self.files[p].read()
                lines = text.split("\n")
                self.rest[p] = lines.pop()
                for line in lines:
                    a = parse_ack(line)
                    if a:
                        self.seen.setdefault(a[0], now)
            time.sleep(0.01)

    def close(self):
        self.stop_ev.set()
        self.thread.join()
        for f in self.files.values():
            f.close()


def largest_gap(paths, clock, t0, after_n=0, window=None):
    """The largest gap between consecutive records (guest clock) and when
    (host clock, seconds from t0) the record ending it appeared; with a
    window (from, to), only among records that appeared in it."""
    a = [x for x in acks(paths) if x[0] > after_n]
    best = None
    for x, b in zip(a, a[1:]):
        at = clock.seen.get(b[0])
        if window and (at is None or not window[0] <= at - t0 <= window[1]):
            continue
        if b[0] == x[0] + 1 and (best is None or b[1] - x[1] > best[0]):
            best = (b[1] - x[1], b[0])
    if best is None:
        return None
    at = clock.seen.get(best[1])
    return {"ms": round(best[0] * 1000), "ack": best[1],
            "seen_at_s": None if at is None else round(at - t0, 3)}


def switchover_at(report):
    """Seconds from the move's start to its switchover phase."""
    acc = 0.0
    for p in report.get("phases", []):
        if p["phase"] == "switchover":
            return acc
        acc += p["seconds"]
    return None


def wait_acks(path, n, secs=120):
    end = time.time() + secs
    while time.time() < end:
        a = acks([path])
        if a and a[-1][0] >= n:
            return a[-1][0]
        time.sleep(0.2)
    raise RuntimeError(f"guest did not reach {n} acks ({path})")


def trust(a, b):
    for p in (a, b):
        subprocess.run([FERRY, "certs", "show", "--pool", p], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "trust", f"{b}/tls/cert.pem", "--pool", a], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "trust", f"{a}/tls/cert.pem", "--pool", b], check=True, capture_output=True)


class Host:
    def __init__(self, state, extra=()):
        os.makedirs(state, exist_ok=True)
        self.state = state
        # As a Daemon: a host that exits at once (a port taken between
        # free_port() and its bind) is started again on fresh ports.
        for attempt in range(3):
            self.control, self.moves = free_port(), free_port()
            self.proc = subprocess.Popen(
                [FERRY, "host", "--state-dir", state, "--control", f"127.0.0.1:{self.control}",
                 "--move-listen", f"127.0.0.1:{self.moves}", "--image-dir", GUEST, *extra],
                env=dict(os.environ, FERRY_LOG=os.environ.get("FERRY_BENCH_LOG", "warn")),
                stdout=subprocess.DEVNULL, stderr=open(state + ".log", "w"))
            try:
                wait_http(f"http://127.0.0.1:{self.control}/v1/vms", 60, self.proc, state + ".log")
                return
            except Exited:
                if attempt == 2:
                    raise
            except RuntimeError:
                self.proc.kill()
                self.proc.wait()
                raise

    def vm(self, *args):
        return subprocess.run([FERRY, "vm", "--host", f"127.0.0.1:{self.control}", *args],
                              capture_output=True, text=True)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        if KEEP_LOGS:
            os.makedirs(KEEP_LOGS, exist_ok=True)
            shutil.copy(self.state + ".log", os.path.join(KEEP_LOGS, f"{int(time.time())}-{os.path.basename(self.state)}.log"))
        for d in os.listdir(os.path.join(self.state, "vms")) if os.path.isdir(os.path.join(self.state, "vms")) else []:
            try:
                pid = int(open(os.path.join(self.state, "vms", d, "qemu.pid")).read())
                os.kill(pid, 9)
            except (OSError, ValueError):
                pass


def two_sites(work, allow_path=None):
    """Sites A and B in `work`: a storage daemon each (migrations on; volumes
    may be made of files in `allow_path`) and the state directories of
    their host daemons (`ha`, `hb`), each pair trusting the other. Returns
    (sa, sb, ha, hb)."""
    pa, pb, ha, hb = (os.path.join(work, d) for d in ("sa", "sb", "ha", "hb"))
    trust(pa, pb)
    os.makedirs(ha)
    os.makedirs(hb)
    trust(ha, hb)
    return (Daemon(pa, migrate=True, allow_path=allow_path), Daemon(pb, migrate=True, allow_path=allow_path),
            ha, hb)


def run_ferry(work, link, base, image, load, teleport):
    for d in ("sa", "sb", "ha", "hb"):
        shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    sa, sb, ha, hb = two_sites(work)
    hosts = []
    try:
        sb.ferry("volume", "create", "sibling", "--size", str(os.path.getsize(base)))
        sb.ferry("volume", "import", "sibling", base)
        sa.ferry("volume", "create", "root", "--size", str(os.path.getsize(image)))
        sa.ferry("volume", "import", "root", image)
        A, B = Host(ha), Host(hb)
        hosts = [A, B]
        mem_name, mem_port = link.proxy(f"127.0.0.1:{B.moves}")
        disk_name, disk_port = link.proxy(f"127.0.0.1:{sb.mig}")
        serial_a = test_guest(A, "g", "root", f"127.0.0.1:{sa.nbd}", f"127.0.0.1:{sa.admin}", MEM, ACCEL,
                              cmdline(load))
        n0 = wait_acks(serial_a, 100)
        args = ["migrate", "g", "--to-host", f"127.0.0.1:{mem_port}",
                "--max-downtime", f"{MAX_DOWNTIME_MS}ms", "--json"]
        if teleport:
            # As the controller moves it: B's storage admin API named, so
            # host B learns of the disk's switch from storage B itself.
            args += ["--with-disk", "--to-storage", f"127.0.0.1:{disk_port}",
                     "--to-storage-admin", f"127.0.0.1:{sb.admin}"]
        serial_b = os.path.join(hb, "vms", "g", "serial.log")
        clock = AckClock([serial_a, serial_b])
        t = time.time()
        r = A.vm(*args)
        secs = time.time() - t
        report = json.loads(r.stdout) if r.stdout.strip() else {"error": r.stderr}
        if r.returncode != 0:
            return {"ok": False, "error": report.get("reason") or report.get("error"), "report": report,
                    "seconds": secs}
        moved = [d for d in os.listdir(os.path.join(ha, "moved"))] if os.path.isdir(os.path.join(ha, "moved")) else []
        src_logs = [os.path.join(ha, "moved", d, "serial.log") for d in moved] + [serial_a]
        try:
            wait_acks(serial_b, 1, secs=30)
        except RuntimeError:
            # A result, not a script failure: the guest did not go on at B.
            text = open(serial_b, errors="replace").read() if os.path.exists(serial_b) else ""
            first = next((ln.strip() for ln in text.splitlines() if "BUG" in ln or "panic" in ln), "no output")
            return {"ok": False, "error": f"the guest did not go on at B: {first}", "report": report,
                    "seconds": secs}
        time.sleep(3)
        # The destination's forwarder: its slowest requests since the guest
        # arrived (histogram buckets, cumulative), to tell a slow disk after
        # the switch from a slow guest.
        dest = {}
        try:
            v = json.loads(B.vm("show", "g", "--json").stdout)
            d = v["disks"][0]
            total = d["latency_us"][-1][1]
            slow = [(b, total - n) for b, n in d["latency_us"] if total - n > 0]
            dest = {"requests": total, "above_us": slow[-3:], "server": d["server"],
                    "first_io_unix_ms": d["first_io_unix_ms"]}
        except (ValueError, KeyError, IndexError):
            pass
        clock.close()
        out = {
            "ok": r.returncode == 0,
            "largest_gap": largest_gap(src_logs + [serial_b], clock, t, after_n=n0),
            # The switch's own cost to the guest: records that appeared from
            # the switchover to 2 s after the command returned.
            "switch_gap": largest_gap(src_logs + [serial_b], clock, t, after_n=n0,
                                      window=(switchover_at(report) or 0, secs + 2)),
            "seconds": secs,
            "pause_ms": max_gap_ms(src_logs + [serial_b], after_n=n0),
            "record_gap_ms": median_gap_ms(src_logs + [serial_b], after_n=n0),
            "report": report,
            "destination_disk": dest,
        }
        B.vm("stop", "g")
        for h in hosts:
            h.stop()
        hosts = []
        sa.stop()
        sb.stop()
        out["bytes"] = link.bytes(mem_name) + (link.bytes(disk_name) if teleport else 0)
        out["memory_bytes"] = link.bytes(mem_name)
        return out
    finally:
        for h in hosts:
            h.stop()
        for d in (sa, sb):
            if d.proc.poll() is None:
                d.stop()
            if KEEP_LOGS:
                os.makedirs(KEEP_LOGS, exist_ok=True)
                shutil.copy(d.log, os.path.join(KEEP_LOGS, f"{int(time.time())}-{os.path.basename(d.log)}"))


def qemu_cmd(name, disk, qsock, serial, append, incoming=None, mem=None):
    """QEMU alone running the test guest from `disk` (raw), kernel command
    line `append`, `mem` of RAM (default MEM)."""
    node = json.dumps({"driver": "raw", "node-name": "disk0",
                       "file": {"driver": "file", "filename": disk}})
    args = ["qemu-system-x86_64", "-name", name, "-M", "q35", "-accel", ACCEL, "-cpu", "max",
            "-m", mem or MEM, "-nodefaults", "-display", "none",
            "-qmp", f"unix:{qsock},server=on,wait=off",
            "-chardev", f"file,id=s0,path={serial}", "-serial", "chardev:s0",
            "-blockdev", node, "-device", "virtio-blk-pci,drive=disk0,id=vd0",
            "-kernel", f"{GUEST}/vmlinuz", "-initrd", f"{GUEST}/initrd.img", "-append", append]
    if incoming:
        args += ["-incoming", "defer", "-S"]
    return args


def connect_qmp(path, events=None):
    for _ in range(200):
        try:
            return qmp(path, events)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"QMP {path} did not come up")


def stamp(events, name):
    ts = [e["timestamp"]["seconds"] + e["timestamp"]["microseconds"] / 1e6 for e in events if e["event"] == name]
    return ts[-1] if ts else None


def copy_storage_setup(src, dst, link):
    """libvirt's set-up of `virsh migrate --live --copy-storage-all` between
    QEMU monitors `src` and `dst` (the destination started `-incoming
    defer -S` with an empty disk `disk0`): multifd (MULTIFD_CHANNELS, zstd) and
    auto-converge on both, the downtime limit, the destination's disk
    exported over NBD and its migration listening; each reached through a
    new proxy of `link`. Returns ((name, port) of the disk's proxy, (name,
    port) of the memory's)."""
    nbd_port, mig_port = free_port(), free_port()
    caps = [{"capability": "auto-converge", "state": True},
            {"capability": "multifd", "state": MULTIFD_CHANNELS > 0}]
    params = {"multifd-channels": MULTIFD_CHANNELS, "multifd-compression": "zstd"} if MULTIFD_CHANNELS else {}
    for c in (src, dst):
        c("migrate-set-capabilities", capabilities=caps)
        if params:
            c("migrate-set-parameters", **params)
    src("migrate-set-parameters", **{"downtime-limit": MAX_DOWNTIME_MS, "max-bandwidth": 1 << 40})
    dst("nbd-server-start", addr={"type": "inet", "data": {"host": "127.0.0.1", "port": str(nbd_port)}})
    dst("block-export-add", type="nbd", id="e0", **{"node-name": "disk0"}, writable=True, name="disk0")
    dst("migrate-incoming", uri=f"tcp:127.0.0.1:{mig_port}")
    # The memory's channels share the link's rate (toxiproxy would give
    # each channel a whole link of its own).
    return link.proxy(f"127.0.0.1:{nbd_port}"), link.proxy(f"127.0.0.1:{mig_port}", max(1, MULTIFD_CHANNELS))


def copy_storage_move(src, dst, disk_port, mem_port, limit_s=None, copy_mode="background"):
    """libvirt's copy-storage move: mirror the disk into the destination's
    export until ready, migrate memory, then cancel the ready mirror (a
    consistent copy), remove the export and resume the destination.
    Returns QEMU's last `query-migrate`; with `limit_s`, a move that has
    not completed by then raises TimeoutError. `copy_mode` "write-blocking"
    is libvirt's `--copy-storage-synchronous-writes`: the guest's writes
    reach both disks before they complete, so a guest that writes faster
    than the mirror copies still lets it converge."""
    end = time.time() + limit_s if limit_s else None

    def check(what):
        if end and time.time() > end:
            raise TimeoutError(f"QEMU's move did not complete within {limit_s} s ({what})")

    src("blockdev-add", driver="nbd", **{"node-name": "tgt"},
        server={"type": "inet", "host": "127.0.0.1", "port": str(disk_port)}, export="disk0")
    src("blockdev-mirror", **{"job-id": "m0", "copy-mode": copy_mode}, device="disk0", target="tgt", sync="full")
    while True:
        jobs = [j for j in src("query-jobs") if j["id"] == "m0"]
        if jobs and jobs[0]["status"] == "ready":
            break
        if not jobs:
            raise RuntimeError("mirror job vanished")
        check("the disk's mirror was not ready")
        time.sleep(0.1)
    src("migrate", uri=f"tcp:127.0.0.1:{mem_port}")
    while True:
        st = src("query-migrate")
        if st.get("status") == "completed":
            break
        if st.get("status") in ("failed", "cancelled"):
            raise RuntimeError(f"QEMU migration {st}")
        check(f"memory: {st.get('status')}")
        time.sleep(0.05)
    src("block-job-cancel", device="m0")
    while [j for j in src("query-jobs") if j["id"] == "m0"]:
        time.sleep(0.02)
    src("blockdev-del", **{"node-name": "tgt"})
    dst("block-export-del", id="e0", mode="hard")
    dst("nbd-server-stop")
    # libvirt resumes the destination in its Finish phase, once the
    # incoming side has loaded the whole stream: a `cont` while QEMU is
    # still loading races its end of the migration.
    status = None
    for _ in range(600):
        status = dst("query-status").get("status")
        if status != "inmigrate":
            break
        time.sleep(0.05)
    dst("cont")
    for _ in range(200):
        status = dst("query-status").get("status")
        if status == "running":
            return st
        time.sleep(0.05)
    raise RuntimeError(f"the destination QEMU does not run after the move: {status}")


def run_qemu_native(work, link, image, load, mem=None, append=None, boot_secs=120, limit_s=None,
                    copy_mode="background", in_place=False):
    """libvirt's copy-storage move of the test guest (`mem` of RAM, kernel
    command line `append`; defaults MEM and the `load`'s) from a copy of
    `image` to an empty disk across `link`, once it has made 100 records
    (within `boot_secs`); `limit_s` bounds the move (TimeoutError).
    `in_place` runs the source guest on `image` itself (its records are
    added to it), for disks too large to copy once more."""
    append = append or cmdline(load)
    src_disk, dst_disk = os.path.join(work, "qa.raw"), os.path.join(work, "qb.raw")
    if in_place:
        src_disk = image
    else:
        subprocess.run(["cp", "--sparse=always", image, src_disk], check=True)
    with open(dst_disk, "wb") as f:
        f.truncate(os.path.getsize(image))
    qa, qb = os.path.join(work, "qa.qmp"), os.path.join(work, "qb.qmp")
    sa, sb = os.path.join(work, "qa.serial"), os.path.join(work, "qb.serial")
    for p in (qa, qb, sa, sb):
        if os.path.exists(p):
            os.unlink(p)
    procs = []
    try:
        procs.append(subprocess.Popen(qemu_cmd("src", src_disk, qa, sa, append, mem=mem),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        n0 = wait_acks(sa, 100, secs=boot_secs)
        procs.append(subprocess.Popen(qemu_cmd("dst", dst_disk, qb, sb, append, incoming=True, mem=mem),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        src_ev, dst_ev = [], []
        src, dst = connect_qmp(qa, src_ev), connect_qmp(qb, dst_ev)
        (disk_name, disk_port), (mem_name, mem_port) = copy_storage_setup(src, dst, link)
        t = time.time()
        st = copy_storage_move(src, dst, disk_port, mem_port, limit_s, copy_mode)
        secs = time.time() - t
        downtime = st.get("downtime")
        time.sleep(0.5)
        src("query-status")
        dst("query-status")
        stop, resume = stamp(src_ev, "STOP"), stamp(dst_ev, "RESUME")
        stop_resume = (resume - stop) * 1000 if stop and resume else None
        wait_acks(sb, n0 + 1, secs=60)
        time.sleep(3)
        pause = max_gap_ms([sa, sb], after_n=n0)
        normal = median_gap_ms([sa, sb], after_n=n0)
        for p in procs:
            p.kill()
            p.wait()
        procs = []
        return {"ok": True, "seconds": secs, "pause_ms": pause, "record_gap_ms": normal,
                "stop_resume_ms": stop_resume,
                "downtime_ms_qemu": downtime,
                "bytes": link.bytes(disk_name) + link.bytes(mem_name), "memory_bytes": link.bytes(mem_name)}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for p in (dst_disk,) if in_place else (src_disk, dst_disk):
            if os.path.exists(p):
                os.unlink(p)


def main():
    global ACCEL, KEEP_LOGS, MULTIFD_CHANNELS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt", type=int, action="append")
    ap.add_argument("--mbit", type=float, default=100)
    ap.add_argument("--loads", default="idle,heavy")
    ap.add_argument("--peers", default="ferry-vm-only,ferry-teleport,qemu-native,qemu-native-sync")
    ap.add_argument("--images", default="/tmp/ferry-similarity")
    ap.add_argument("--accel", choices=["tcg", "kvm"], default="tcg",
                    help="how the guests run (kvm needs a working /dev/kvm)")
    ap.add_argument("--keep-logs", metavar="DIR",
                    help="copy each host daemon's log here (FERRY_BENCH_LOG sets its level; slow guest requests are warnings)")
    ap.add_argument("--multifd-channels", type=int, default=MULTIFD_CHANNELS,
                    help="the QEMU peers' memory channels (multifd, zstd); 0: one uncompressed stream")
    ap.add_argument("--repeats", type=int, default=1,
                    help="moves per peer at each RTT and load, the peers' order rotated each time")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    ACCEL, KEEP_LOGS, MULTIFD_CHANNELS = a.accel, a.keep_logs, a.multifd_channels
    rtts = a.rtt or [20]
    base, image = os.path.join(a.images, "min.img"), os.path.join(a.images, "lamp.img")
    for f in (base, image, f"{GUEST}/vmlinuz"):
        if not os.path.exists(f):
            sys.exit(f"{f} missing: run bench/similarity.sh and scripts/guest-image.sh")
    ensure_ferry()
    results = []
    with tempfile.TemporaryDirectory(prefix="ferry-vmbench-") as work:
        peers = a.peers.split(",")
        for rtt in rtts:
            for load, repeat in ((lo, i) for lo in a.loads.split(",") for i in range(a.repeats)):
                for peer in peers[repeat % len(peers):] + peers[:repeat % len(peers)]:
                    link = Link(work, a.mbit, rtt)
                    try:
                        if peer == "ferry-vm-only":
                            r = run_ferry(work, link, base, image, load, teleport=False)
                        elif peer == "ferry-teleport":
                            r = run_ferry(work, link, base, image, load, teleport=True)
                        elif peer == "qemu-native":
                            r = run_qemu_native(work, link, image, load)
                        elif peer == "qemu-native-sync":
                            r = run_qemu_native(work, link, image, load, copy_mode="write-blocking")
                        else:
                            sys.exit(f"unknown peer {peer}")
                    except Exception as e:  # one peer's failure is a row, not the end
                        r = {"ok": False, "error": str(e)}
                    finally:
                        link.close()
                    r.update(peer=peer, rtt=rtt, load=load, mbit=a.mbit, repeat=repeat)
                    if peer.startswith("qemu"):
                        r.update(multifd_channels=MULTIFD_CHANNELS)
                    print(json.dumps({k: v for k, v in r.items() if k != "report"}), file=sys.stderr)
                    results.append(r)
    if a.json:
        print(json.dumps(results, indent=1))
        return
    print(f"ferry {version([FERRY, '--version'])}; {version(['qemu-system-x86_64', '--version'])}; "
          f"{a.mbit:g} Mbit/s, guest {MEM} {ACCEL.upper()}, max downtime {MAX_DOWNTIME_MS} ms\n")
    print("| RTT | guest load | peer | bytes on the link | of which memory | total time | STOP→RESUME (QEMU's stamps) | stall after resume, guest clock (normal gap) | largest stall of the move, guest clock (at) | QEMU downtime |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if not r.get("ok"):
            print(f"| {r['rtt']} ms | {r['load']} | {r['peer']} | failed: {r.get('error') or r.get('report', {}).get('reason')} | | | | |")
            continue
        rep = r.get("report", {})
        dt = r.get("downtime_ms_qemu", rep.get("downtime_ms_qemu"))
        pause = r.get("pause_ms")
        sr = stop_resume_ms(r)
        sw, lg = r.get("switch_gap"), r.get("largest_gap")
        pause = sw["ms"] if sw else pause
        where = f"{lg['ms']} ms ({lg['seen_at_s']:.1f} s)" if lg and lg.get("seen_at_s") is not None else "-"
        peer = r["peer"] + (f" (multifd {r['multifd_channels']})" if "multifd_channels" in r else "")
        print(f"| {r['rtt']} ms | {r['load']} | {peer} | {r['bytes'] / 1e6:.1f} MB | "
              f"{r['memory_bytes'] / 1e6:.1f} MB | {r['seconds']:.1f} s | "
              f"{'-' if sr is None else f'{sr:.0f} ms'} | "
              f"{'-' if pause is None else f'{pause:.0f} ms'} ({r.get('record_gap_ms') or 0:.0f} ms) | "
              f"{where} | {'-' if dt is None else f'{dt} ms'} |")
    if a.repeats > 1:
        print_medians(results, a.repeats)


def stop_resume_ms(r):
    """A row's STOP→RESUME: QEMU's stamps for the QEMU peers, the move
    report's for ferry's."""
    return r.get("stop_resume_ms", r.get("report", {}).get("guest_pause_ms"))


def print_medians(results, repeats):
    """Each peer's median STOP→RESUME per RTT and load over its repeats,
    and the teleport's above the VM-only move's."""
    def pauses(rtt, load, peer):
        xs = (stop_resume_ms(r) for r in results
              if r.get("ok") and (r["rtt"], r["load"], r["peer"]) == (rtt, load, peer))
        return sorted(x for x in xs if x is not None)

    def median(xs):
        return statistics.median(xs) if xs else None

    print(f"\nMedians over {repeats} moves per peer:\n")
    print("| RTT | guest load | peer | moves | STOP→RESUME median (min-max) |")
    print("|---|---|---|---|---|")
    keys = list(dict.fromkeys((r["rtt"], r["load"], r["peer"]) for r in results))
    for rtt, load, peer in keys:
        xs = pauses(rtt, load, peer)
        spread = f"{median(xs):.0f} ms ({xs[0]:.0f}-{xs[-1]:.0f})" if xs else "-"
        print(f"| {rtt} ms | {load} | {peer} | {len(xs)} | {spread} |")
    for rtt, load in dict.fromkeys((k[0], k[1]) for k in keys):
        t, v = median(pauses(rtt, load, "ferry-teleport")), median(pauses(rtt, load, "ferry-vm-only"))
        if t is not None and v is not None:
            print(f"\n{rtt} ms, {load}: the teleport's median pause is {t - v:+.0f} ms from the VM-only move's "
                  f"({'within' if t - v <= rtt else 'more than'} one RTT)")


if __name__ == "__main__":
    main()
