#!/usr/bin/env python3
"""Moving a real, networked guest while its clients work: ferry's three
kinds of move against QEMU's copy-storage migration run as libvirt runs it.

The guest: the Debian bookworm image of scripts/debian-guest.sh (its own
kernel and systemd, MariaDB, Apache with PHP), 512 MiB, TCG, booted from its
disk and set up at first boot by cloud-init (its address, a database user).
Its card is on a bridge of this machine (`fbench0`, 192.168.97.0/24), where
the clients are:

  sysbench  oltp_read_write, one thread, against MariaDB, in rounds of 10 s
            with a report every second (transactions/s, errors, reconnects)
  wrk       one thread, two connections, on /db.php (a row read from the
            database per request), in rounds of 5 s
  session   one MariaDB session held open through every move: after each
            move it must still be the same connection with its variable

The moves go over toxiproxy links (bandwidth cap and latency each way;
bytes are toxiproxy's count). ferry, one guest moved three times:

  teleport   A -> B, memory and disk (site B holds the image the guest was
             made from, as a cloud site holds its templates)
  vm-only    B -> A, memory only (the disk stays at B)
  disk-only  B's storage -> A's storage, the guest running on at A (the
             disk's return trip)

and QEMU alone, on a second boot of the same image: the destination QEMU
(-incoming defer -S, an empty disk) exports its disk over NBD, the source
mirrors into it (blockdev-mirror sync=full), then migrates memory (multifd,
one channel, zstd), cancels the ready mirror and resumes the destination (libvirt's
order for `virsh migrate --live --copy-storage-all`); peer `qemu-sync` runs
it again with libvirt's `--copy-storage-synchronous-writes` (the mirror in
write-blocking mode: QEMU's better mode for a guest that keeps writing).

For each move: bytes and time of the move, the guest's pause (STOP at the
source to RESUME at the destination, QEMU's stamps; for a disk-only move
ferry's disk pause), and from the clients: transactions and requests that
failed, connections dropped, their worst latency, and their throughput
before, during and after. The clients' traffic stays on this machine's
bridge (no netem here to delay it), so what is measured is what a move
costs the clients, not where they are.

  python3 bench/real_guest.py [--rtt 20] [--mbit 100] [--json] [--timeline FILE]
Needs root (a bridge and taps), sysbench, wrk, the MariaDB client and
toxiproxy-server.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ensure_ferry, version  # noqa: E402
from migration_peers import Link  # noqa: E402
from vm_peers import (GUEST, Host, connect_qmp, copy_storage_move, copy_storage_setup,  # noqa: E402
                      stamp, two_sites)

IMAGE = os.path.join(GUEST, "debian-bookworm.img")
BRIDGE = "fbench0"
NET = "192.168.97"
GUEST_IP = f"{NET}.20"
MAC = "52:54:00:97:00:20"
MEM = "512M"
MAX_DOWNTIME_MS = 300
TEMPLATE = True  # site B holds the image the guest was made from (--no-template: nothing)
DB = ["-h", GUEST_IP, "-u", "sbtest", "-psbtest", "sbtest"]
FIRST_BOOT = ("until mariadb -e 'SELECT 1'; do sleep 1; done; "
              "mariadb -e \"CREATE DATABASE sbtest; CREATE USER 'sbtest'@'%' IDENTIFIED BY 'sbtest'; "
              "GRANT ALL ON sbtest.* TO 'sbtest'@'%'\"")
SYSBENCH = ["sysbench", "oltp_read_write", "--db-driver=mysql", f"--mysql-host={GUEST_IP}",
            "--mysql-user=sbtest", "--mysql-password=sbtest", "--mysql-db=sbtest",
            "--tables=1", "--table-size=10000"]


def require_guest(*tools):
    """Raise, saying how to get it, unless `tools` and the guest image are here."""
    for tool in tools:
        if not shutil.which(tool):
            raise RuntimeError(f"{tool} missing (scripts/install-deps.sh --test)")
    if not os.path.exists(IMAGE):
        raise RuntimeError(f"{IMAGE} missing: bash scripts/debian-guest.sh")


def sh(*args):
    subprocess.run(args, check=True, capture_output=True)


class Bridge:
    """The guests' network: a bridge with this machine's address on it.
    With FERRY_BENCH_PCAP=DIR, the headers of every packet to or from the
    guest's address and every ARP and RARP (QEMU's announcements), on every
    interface (the bridge and each host's tap, told apart by interface
    index), go to DIR/<time>.pcap while it stands."""

    def __init__(self):
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        self.capture = None
        into = os.environ.get("FERRY_BENCH_PCAP")
        if into:
            if not shutil.which("tcpdump"):
                raise RuntimeError("FERRY_BENCH_PCAP needs tcpdump (scripts/install-deps.sh --test)")
            os.makedirs(into, exist_ok=True)
            path = os.path.join(into, time.strftime("%Y%m%d-%H%M%S") + ".pcap")
            self.capture = subprocess.Popen(
                ["tcpdump", "-i", "any", "-y", "LINUX_SLL2", "-s", "128", "-U", "-w", path,
                 f"host {GUEST_IP} or arp or rarp"],
                stdout=subprocess.DEVNULL, stderr=open(path + ".log", "w"))
            print(f"capturing the guest's frames in {path}", file=sys.stderr, flush=True)

    def tap(self, name):
        subprocess.run(["ip", "link", "del", name], capture_output=True)
        sh("ip", "tuntap", "add", "dev", name, "mode", "tap")
        sh("ip", "link", "set", name, "master", BRIDGE, "up")
        return name

    def close(self):
        if self.capture:
            self.capture.terminate()
            self.capture.wait()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@contextlib.contextmanager
def guest_sites(work, mbit, rtt):
    """Two sites for the Debian guest in `work`: a storage daemon and a host
    daemon each (the hosts' network `lan` is the guests' bridge) and the
    toxiproxy link between them; yields (sa, sb, A, B, link). On leaving,
    everything is stopped and `work` removed (it holds copies of a 4 GiB
    disk, gone before the next experiment)."""
    sa, sb, ha, hb = two_sites(work)
    link, bridge = Link(work, mbit, rtt), Bridge()
    hosts = []
    try:
        net = f"lan,bridge={BRIDGE}"
        hosts = [Host(ha, ["--network", net]), Host(hb, ["--network", net])]
        yield sa, sb, hosts[0], hosts[1], link
    finally:
        for h in hosts:
            h.stop()
        for d in (sa, sb):
            d.stop()
        link.close()
        bridge.close()
        keep_logs(work)
        shutil.rmtree(work, ignore_errors=True)


def keep_logs(work):
    """With FERRY_BENCH_KEEP_LOGS=DIR, every log under `work` (daemons,
    toxiproxy, the guests' consoles and QEMU's) copied to DIR/<time>/ before
    `work` goes; with FERRY_BENCH_LOG=info the daemons' logs say what each
    move did."""
    into = os.environ.get("FERRY_BENCH_KEEP_LOGS")
    if not into:
        return
    into = os.path.join(into, time.strftime("%Y%m%d-%H%M%S"))
    for root, _, files in os.walk(work):
        for f in files:
            if f.endswith(".log"):
                d = os.path.join(into, os.path.relpath(root, work))
                os.makedirs(d, exist_ok=True)
                shutil.copy(os.path.join(root, f), d)
    print(f"logs kept in {into}", file=sys.stderr, flush=True)


def import_image(storage, volume):
    """Volume `volume` of `storage`: a copy of the Debian image."""
    storage.ferry("volume", "create", volume, "--size", str(os.path.getsize(IMAGE)))
    storage.ferry("volume", "import", volume, IMAGE)


def remote_db_guest(host, storage, link, tag):
    """The database guest on `host`, booted from volume `db` (a copy of
    the Debian image) of `storage` across `link`, its database ready for
    sysbench: (the disk's proxy name, its port, seconds to boot and set up)."""
    import_image(storage, "db")
    name, port = link.proxy(f"127.0.0.1:{storage.nbd}")
    create_db_guest(host, f"127.0.0.1:{port}", f"127.0.0.1:{storage.admin}")
    boot = wait_database()
    prepare()
    print(f"{tag}: booted and configured in {boot:.0f} s", flush=True)
    return name, port, boot


def create_db_guest(host, nbd, admin):
    """The database guest `db` made on `host` (whose network `lan` is the
    bridge), booted from volume `db` at `nbd` (admin API `admin`) and set
    up at first boot by cloud-init: its address, name and database user."""
    r = host.vm("create", "db", "--memory", MEM, "--accel", "tcg", "--boot-disk",
                "--disk", f"db@{nbd}@{admin}",
                "--nic", f"lan,mac={MAC}", "--address", f"{GUEST_IP}/24",
                "--hostname", "db-1", "--first-boot", FIRST_BOOT)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)


def wait_database(secs=900):
    t = time.time()
    while time.time() - t < secs:
        r = subprocess.run(["mariadb", *DB, "-e", "SELECT 1"], capture_output=True)
        if r.returncode == 0:
            return time.time() - t
        time.sleep(2)
    raise RuntimeError("the guest's database never answered")


def prepare():
    subprocess.run([*SYSBENCH, "cleanup"], capture_output=True)
    subprocess.run([*SYSBENCH, "prepare"], check=True, capture_output=True)


def oltp_round(secs=10):
    """One round of sysbench oltp_read_write for `secs` seconds with a
    report every second: (the reports: time, transactions/s, 95th
    percentile latency, errors/s, reconnects/s; the round's summary:
    whether it ended well, when it started, its totals; the finished
    process)."""
    t0 = time.time()
    r = subprocess.run([*SYSBENCH, f"--time={secs}", "--report-interval=1", "run"],
                       capture_output=True, text=True)
    per_s, summary = [], {"ok": r.returncode == 0, "start": t0}
    for line in r.stdout.splitlines():
        m = re.match(r"\[ (\d+)s \] .*tps: ([\d.]+).*lat \(ms,95%\): ([\d.]+) err/s: ([\d.]+) reconn/s: ([\d.]+)", line)
        if m:
            per_s.append({"t": t0 + int(m.group(1)), "tps": float(m.group(2)),
                          "p95_ms": float(m.group(3)), "err": float(m.group(4)),
                          "reconn": float(m.group(5))})
        for key, name in (("transactions:", "tx"), ("ignored errors:", "errors"),
                          ("reconnects:", "reconnects"), ("max:", "max_ms")):
            if line.strip().startswith(key):
                summary[name] = float(line.split(key)[1].split()[0])
    return per_s, summary, r


def wrk_ms(s):
    """wrk's duration ("12.3ms", "1.2s", "800us") in ms."""
    m = re.match(r"([\d.]+)(us|ms|s|m)$", s)
    if not m:
        return None
    return float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000, "m": 60000}[m.group(2)]


class Clients:
    """sysbench and wrk in rounds, and one session, until stop()."""

    def __init__(self):
        self.stop_ev = threading.Event()
        self.oltp, self.http, self.lock = [], [], threading.Lock()
        self.session = subprocess.Popen(
            ["mariadb", *DB, "--batch", "--skip-column-names", "--skip-reconnect", "--unbuffered"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.session_id = self.ask("SET @mark = 4242; SELECT CONNECTION_ID();")
        self.fdb = []
        self.threads = [threading.Thread(target=self.oltp_rounds, daemon=True),
                        threading.Thread(target=self.http_rounds, daemon=True),
                        threading.Thread(target=self.watch_fdb, daemon=True)]
        for t in self.threads:
            t.start()

    def ask(self, q):
        self.session.stdin.write(q + "\n")
        self.session.stdin.flush()
        return self.session.stdout.readline().strip()

    def session_kept(self):
        """Whether the session is the one opened, its variable still set."""
        try:
            return self.ask("SELECT CONNECTION_ID(), @mark;") == f"{self.session_id}\t4242"
        except (OSError, ValueError):
            return False

    def oltp_rounds(self):
        while not self.stop_ev.is_set():
            per_s, summary, r = oltp_round()
            if r.returncode != 0:
                summary["error"] = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
            summary["per_s"] = per_s
            with self.lock:
                self.oltp.append(summary)

    def http_rounds(self):
        while not self.stop_ev.is_set():
            t0 = time.time()
            r = subprocess.run(["wrk", "-t1", "-c2", "-d5s", "--timeout", "30s",
                                f"http://{GUEST_IP}/db.php"], capture_output=True, text=True)
            s = {"start": t0, "end": time.time(), "ok": r.returncode == 0, "requests": 0,
                 "errors": 0, "max_ms": None}
            for line in r.stdout.splitlines():
                f = line.split()
                if f[:1] == ["Latency"] and len(f) >= 4:
                    s["max_ms"] = wrk_ms(f[3])
                m = re.search(r"(\d+) requests in", line)
                if m:
                    s["requests"] = int(m.group(1))
                m = re.search(r"connect (\d+), read (\d+), write (\d+), timeout (\d+)", line)
                if m:
                    s["errors"] += sum(int(x) for x in m.groups())
                m = re.search(r"Non-2xx or 3xx responses: (\d+)", line)
                if m:
                    s["errors"] += int(m.group(1))
            with self.lock:
                self.http.append(s)

    def window(self, t0, t1):
        """What the clients saw from t0 to t1 (host clock)."""
        with self.lock:
            oltp = [r for r in self.oltp if r["start"] < t1 and r["start"] + 10 > t0]
            http = [r for r in self.http if r["start"] < t1 and r["end"] > t0]
        secs = [p for r in oltp for p in r["per_s"] if t0 <= p["t"] <= t1]
        return {
            "oltp_rounds": len(oltp),
            "oltp_failed_rounds": sum(1 for r in oltp if not r["ok"]),
            "oltp_errors": sum(r.get("errors", 0) for r in oltp),
            "oltp_reconnects": sum(r.get("reconnects", 0) for r in oltp),
            "oltp_max_ms": max((r.get("max_ms", 0) for r in oltp), default=None),
            "oltp_tps": sum(p["tps"] for p in secs) / len(secs) if secs else None,
            "http_requests": sum(r["requests"] for r in http),
            "http_errors": sum(r["errors"] for r in http) + sum(1 for r in http if not r["ok"]),
            "http_max_ms": max((r["max_ms"] or 0 for r in http), default=None),
            "http_rps": (sum(r["requests"] for r in http) / sum(r["end"] - r["start"] for r in http))
            if http else None,
            "oltp_errors_said": [r["error"] for r in oltp if "error" in r],
        }

    def wait_round_after(self, t):
        """Until an OLTP and an HTTP round have each begun after t and ended."""
        end = time.time() + 120
        while time.time() < end:
            with self.lock:
                o = any(r["start"] > t for r in self.oltp)
                h = any(r["start"] > t for r in self.http)
            if o and h:
                return
            time.sleep(0.5)

    def watch_fdb(self):
        """Which bridge port the guest's MAC is learned on, every 0.1 s
        (changes only): where frames to the guest go across a move."""
        last = None
        while not self.stop_ev.wait(0.1):
            r = subprocess.run(["bridge", "fdb", "show", "br", BRIDGE], capture_output=True, text=True)
            port = next((ln.split()[2] for ln in r.stdout.splitlines()
                         if ln.lower().startswith(MAC) and len(ln.split()) > 2), None)
            if port != last:
                with self.lock:
                    self.fdb.append({"t": time.time(), "port": port})
                last = port

    def timeline(self):
        with self.lock:
            return {"fdb": list(self.fdb), "oltp": [p for r in self.oltp for p in r["per_s"]],
                    "http": [{"start": r["start"], "end": r["end"], "requests": r["requests"],
                              "errors": r["errors"]} for r in self.http]}

    def stop(self):
        self.stop_ev.set()
        for t in self.threads:
            t.join()
        kept = self.session_kept()
        try:
            self.session.stdin.close()
        except OSError:
            pass
        self.session.kill()
        self.session.wait()
        return kept


def moved_under_load(clients, move, warm=10):
    """Run `move()` (returns (report, bytes)) with the clients at work; what
    they saw before, during and after it."""
    time.sleep(warm)
    t0 = time.time()
    report, nbytes = move()
    t1 = time.time()
    clients.wait_round_after(t1)
    kept = clients.session_kept()
    return {
        "seconds": t1 - t0, "bytes": nbytes, "report": report, "session_kept": kept,
        "before": clients.window(t0 - warm, t0), "during": clients.window(t0, t1),
        "after": clients.window(t1, time.time()), "t0": t0, "t1": t1,
    }


def run_ferry(work, link):
    sa, sb, ha, hb = two_sites(work)
    hosts, clients, rows = [], None, []
    net = f"lan,bridge={BRIDGE}"
    try:
        size = str(os.path.getsize(IMAGE))
        if TEMPLATE:
            sb.ferry("volume", "create", "template", "--size", size)
            sb.ferry("volume", "import", "template", IMAGE)
        sa.ferry("volume", "create", "db", "--size", size)
        sa.ferry("volume", "import", "db", IMAGE)
        A, B = Host(ha, ["--network", net]), Host(hb, ["--network", net])
        hosts = [A, B]
        create_db_guest(A, f"127.0.0.1:{sa.nbd}", f"127.0.0.1:{sa.admin}")
        boot = wait_database()
        prepare()
        clients = Clients()

        def ferry_move(host, args, proxies):
            def move():
                r = host.vm("migrate", "db", "--max-downtime", f"{MAX_DOWNTIME_MS}ms", "--json", *args)
                rep = json.loads(r.stdout) if r.stdout.strip() else {"reason": r.stderr}
                if r.returncode != 0:
                    raise RuntimeError(f"ferry {args}: {rep.get('reason')}")
                return rep, sum(link.bytes(p) for p in proxies)
            return move

        mem_b, disk_b = link.proxy(f"127.0.0.1:{B.moves}"), link.proxy(f"127.0.0.1:{sb.mig}")
        rows.append(dict(kind="teleport", **moved_under_load(clients, ferry_move(
            A, ["--to-host", f"127.0.0.1:{mem_b[1]}", "--with-disk", "--to-storage", f"127.0.0.1:{disk_b[1]}"],
            [mem_b[0], disk_b[0]]))))
        mem_a = link.proxy(f"127.0.0.1:{A.moves}")
        rows.append(dict(kind="vm-only", **moved_under_load(clients, ferry_move(
            B, ["--to-host", f"127.0.0.1:{mem_a[1]}"], [mem_a[0]]))))
        disk_a = link.proxy(f"127.0.0.1:{sa.mig}")
        rows.append(dict(kind="disk-only", **moved_under_load(clients, ferry_move(
            A, ["--to-storage", f"127.0.0.1:{disk_a[1]}"], [disk_a[0]]))))
        kept = clients.stop()
        timeline = clients.timeline()
        clients = None
        A.vm("stop", "db")
        for row in rows:
            row["boot_s"] = boot
        return rows, timeline, kept
    finally:
        if clients:
            clients.stop()
        for h in hosts:
            h.stop()
        for d in (sa, sb):
            d.stop()


def qemu_args(name, disk, seed, tap, qsock, serial, incoming=False):
    node = json.dumps({"driver": "raw", "node-name": "disk0",
                       "file": {"driver": "file", "filename": disk}})
    seed_node = json.dumps({"driver": "raw", "node-name": "seed", "read-only": True,
                            "file": {"driver": "file", "filename": seed, "read-only": True}})
    a = ["qemu-system-x86_64", "-name", name, "-M", "q35", "-accel", "tcg", "-cpu", "max",
         "-m", MEM, "-nodefaults", "-display", "none",
         "-qmp", f"unix:{qsock},server=on,wait=off",
         "-chardev", f"file,id=s0,path={serial}", "-serial", "chardev:s0",
         "-blockdev", node, "-device", "virtio-blk-pci,drive=disk0,id=vd0,bootindex=1",
         "-blockdev", seed_node, "-device", "virtio-blk-pci,drive=seed,id=seed",
         "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no",
         "-device", f"virtio-net-pci,netdev=n0,mac={MAC},id=nic0"]
    if incoming:
        a += ["-incoming", "defer", "-S"]
    return a


def run_qemu(work, link, bridge, seed, copy_mode="background"):
    src_disk, dst_disk = os.path.join(work, "qa.raw"), os.path.join(work, "qb.raw")
    sh("cp", "--sparse=always", IMAGE, src_disk)
    with open(dst_disk, "wb") as f:
        f.truncate(os.path.getsize(IMAGE))
    qa, qb = os.path.join(work, "qa.qmp"), os.path.join(work, "qb.qmp")
    sa, sb = os.path.join(work, "qa.serial"), os.path.join(work, "qb.serial")
    procs, clients = [], None
    try:
        procs.append(subprocess.Popen(qemu_args("src", src_disk, seed, bridge.tap("fbq0"), qa, sa),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        boot = wait_database()
        prepare()
        clients = Clients()
        procs.append(subprocess.Popen(qemu_args("dst", dst_disk, seed, bridge.tap("fbq1"), qb, sb, incoming=True),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        src_ev, dst_ev = [], []
        src, dst = connect_qmp(qa, src_ev), connect_qmp(qb, dst_ev)
        disk_p, mem_p = copy_storage_setup(src, dst, link)

        def move():
            st = copy_storage_move(src, dst, disk_p[1], mem_p[1], copy_mode=copy_mode)
            time.sleep(0.5)
            src("query-status")
            dst("query-status")
            stop, resume = stamp(src_ev, "STOP"), stamp(dst_ev, "RESUME")
            rep = {"guest_pause_ms": (resume - stop) * 1000 if stop and resume else None,
                   "downtime_ms_qemu": st.get("downtime")}
            return rep, link.bytes(disk_p[0]) + link.bytes(mem_p[0])

        kind = "qemu copy-storage" + (", synchronous writes" if copy_mode == "write-blocking" else "")
        row = dict(kind=kind, boot_s=boot, **moved_under_load(clients, move))
        kept = clients.stop()
        timeline = clients.timeline()
        clients = None
        return [row], timeline, kept
    finally:
        if clients:
            clients.stop()
        for p in procs:
            p.kill()
            p.wait()
        for p in (src_disk, dst_disk):
            if os.path.exists(p):
                os.unlink(p)
        for t in ("fbq0", "fbq1"):
            subprocess.run(["ip", "link", "del", t], capture_output=True)


def plot(timelines, path):
    """The clients' throughput over time, one panel per peer, each move
    shaded: OLTP transactions/s (sysbench's per-second report) and HTTP
    requests/s (per wrk round)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    peers = [p for p in timelines if timelines[p].get("timeline")]
    fig, axes = plt.subplots(len(peers), 1, figsize=(10, 3.2 * len(peers)), squeeze=False)
    for ax, peer in zip(axes[:, 0], peers):
        tl, moves = timelines[peer]["timeline"], timelines[peer]["moves"]
        t0 = min([p["t"] for p in tl["oltp"]] + [r["start"] for r in tl["http"]])
        ax.plot([p["t"] - t0 for p in tl["oltp"]], [p["tps"] for p in tl["oltp"]], ".-", lw=.8, ms=3,
                label="OLTP transactions/s (1 s)")
        ax2 = ax.twinx()
        ax2.step([r["start"] - t0 for r in tl["http"]],
                 [r["requests"] / max(r["end"] - r["start"], 1e-3) for r in tl["http"]],
                 where="post", color="tab:orange", lw=.8, label="HTTP requests/s (5 s rounds)")
        for m in moves:
            if m.get("t0"):
                ax.axvspan(m["t0"] - t0, m["t1"] - t0, color="grey", alpha=.25)
                ax.text(m["t0"] - t0, ax.get_ylim()[1] * .95 if ax.get_ylim()[1] else 1, m["kind"], fontsize=7)
        ax.set_title(f"{peer}: clients' throughput, moves shaded", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("transactions/s")
        ax2.set_ylabel("requests/s")
        ax.set_ylim(bottom=0)
        ax2.set_ylim(bottom=0)
        ax.grid(alpha=.3)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x, unit="", nd=0):
    return "-" if x is None else f"{x:.{nd}f}{unit}"


# A client's worst latency during a move above this keeps the run's logs.
STALL_MS = 5000


def keep_logs_of_stalls(work, rows, kept):
    """When a move stalled a client for more than STALL_MS, copy the hosts'
    and storage daemons' logs out of the temporary `work` (already kept
    with --keep) and say where."""
    stalled = [r["kind"] for r in rows if (r.get("during") or {}).get("oltp_max_ms", 0) > STALL_MS]
    if not stalled or kept:
        return
    out = tempfile.mkdtemp(prefix="ferry-realguest-stall-")
    for name in os.listdir(work):
        if name.endswith(".log"):
            shutil.copy(os.path.join(work, name), out)
    print(f"{', '.join(stalled)}: a client waited over {STALL_MS} ms; the logs are in {out}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt", type=int, default=20)
    ap.add_argument("--mbit", type=float, default=100)
    ap.add_argument("--peers", default="ferry,qemu,qemu-sync",
                    help="qemu: libvirt's copy-storage (its mirror in background mode); qemu-sync: the same with "
                         "--copy-storage-synchronous-writes (write-blocking mirror)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and leave the daemons' state and logs there")
    ap.add_argument("--timeline", metavar="FILE", help="write the clients' per-second throughput and the bridge port "
                    "the guest's MAC is learned on, over time, here (JSON)")
    ap.add_argument("--plot", metavar="PNG", help="draw the clients' throughput over time, moves shaded")
    ap.add_argument("--replot", metavar="TIMELINE", help="only draw --plot from a saved --timeline file")
    ap.add_argument("--no-template", action="store_true",
                    help="site B holds nothing the guest's disk shares (by default it holds the image it was made from)")
    a = ap.parse_args()
    global TEMPLATE
    TEMPLATE = not a.no_template
    if a.replot:
        with open(a.replot) as f:
            plot(json.load(f), a.plot or "real_guest.png")
        return
    for tool in ("sysbench", "wrk", "mariadb", "toxiproxy-server"):
        if not shutil.which(tool):
            sys.exit(f"{tool} missing (scripts/install-deps.sh --test)")
    if not os.path.exists(IMAGE):
        sys.exit(f"{IMAGE} missing: bash scripts/debian-guest.sh")
    ensure_ferry()
    rows, timelines = [], {}
    bridge = Bridge()
    try:
        with (contextlib.nullcontext(a.keep) if a.keep else
              tempfile.TemporaryDirectory(prefix="ferry-realguest-")) as work:
            os.makedirs(work, exist_ok=True)
            seed = None
            for peer in a.peers.split(","):
                link = Link(work, a.mbit, a.rtt)
                try:
                    if peer == "ferry":
                        rs, tl, kept = run_ferry(work, link)
                        keep_logs_of_stalls(work, rs, a.keep)
                        # The very seed ferry made, for QEMU's guest.
                        seed = os.path.join(work, "seed.img")
                        shutil.copy(os.path.join(work, "ha", "vms", "db", "cloud-init.img"), seed)
                    elif peer in ("qemu", "qemu-sync"):
                        if seed is None:
                            # Without a ferry run first: the seed `ferry vm
                            # create` would attach, made alone.
                            seed = os.path.join(work, "seed.img")
                            subprocess.run([FERRY, "vm", "seed", "db", "--out", seed, "--mac", MAC,
                                            "--address", f"{GUEST_IP}/24", "--hostname", "db-1",
                                            "--first-boot", FIRST_BOOT], check=True, capture_output=True)
                        rs, tl, kept = run_qemu(work, link, bridge, seed,
                                                "write-blocking" if peer == "qemu-sync" else "background")
                    else:
                        sys.exit(f"unknown peer {peer}")
                except Exception as e:  # one peer's failure is a row, not the end
                    rs, tl, kept = [{"kind": peer, "error": str(e)}], {}, False
                finally:
                    link.close()
                for r in rs:
                    r.update(peer=peer, rtt=a.rtt, mbit=a.mbit, session_kept_to_end=kept)
                    print(json.dumps({k: v for k, v in r.items() if k not in ("report",)}), file=sys.stderr)
                rows += rs
                timelines[peer] = {"timeline": tl, "moves": [{"kind": r["kind"], "t0": r.get("t0"),
                                                              "t1": r.get("t1")} for r in rs]}
    finally:
        bridge.close()
    if a.timeline:
        with open(a.timeline, "w") as f:
            json.dump(timelines, f)
    if a.plot:
        plot(timelines, a.plot)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"ferry {version([FERRY, '--version'])}; {version(['qemu-system-x86_64', '--version'])}; "
          f"{version(['sysbench', '--version'])}; {a.mbit:g} Mbit/s, {a.rtt} ms RTT; "
          f"guest {MEM} TCG, Debian bookworm, max downtime {MAX_DOWNTIME_MS} ms\n")
    print("| move | bytes on the link | time | guest pause | OLTP failed (errors, reconnects, failed rounds) | OLTP worst latency | OLTP tx/s before / during / after | HTTP failed | HTTP worst latency | HTTP req/s before / during / after | session kept |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | failed: {r['error']} |||||||||")
            continue
        rep = r["report"]
        pause = rep.get("guest_pause_ms") if r["kind"] != "disk-only" else rep.get("disk_pause_ms")
        d, b, af = r["during"], r["before"], r["after"]
        print(f"| {r['kind']} | {r['bytes'] / 1e6:.0f} MB | {r['seconds']:.1f} s | {fmt(pause, ' ms')} | "
              f"{d['oltp_errors']:.0f}, {d['oltp_reconnects']:.0f}, {d['oltp_failed_rounds']} | "
              f"{fmt(d['oltp_max_ms'], ' ms')} | "
              f"{fmt(b['oltp_tps'], '', 1)} / {fmt(d['oltp_tps'], '', 1)} / {fmt(af['oltp_tps'], '', 1)} | "
              f"{d['http_errors']} | {fmt(d['http_max_ms'], ' ms')} | "
              f"{fmt(b['http_rps'], '', 1)} / {fmt(d['http_rps'], '', 1)} / {fmt(af['http_rps'], '', 1)} | "
              f"{'yes' if r['session_kept'] else 'NO'} |")


if __name__ == "__main__":
    main()
