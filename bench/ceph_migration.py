#!/usr/bin/env python3
"""Moving a disk from one Ceph cluster to another across a WAN link, side by
side, in two clusters started for the run (scripts/ceph-cluster.sh):

- ferry: `ferry migrate` from a gateway on cluster A (the volume an RBD
  image there) to a gateway on cluster B, which holds a template the disk
  was made from (an RBD volume, indexed): live, one pause at the switch.
- rbd: what a Ceph user does today, in its best mode: a snapshot, `rbd
  export-diff` of it streamed into `rbd import-diff` onto a sibling at B (a
  clone of the same template there) while the guest runs, then the guest
  stopped, a second snapshot and the incremental export-diff --from-snap
  of what changed (its time is the guest's pause).
- QEMU: its copy-storage path as libvirt runs it, the disk an RBD image
  on both sides: at B an NBD export of a new image of cluster B
  (qemu-storage-daemon, its rbd driver), at A qemu-storage-daemon opens
  the disk's image of cluster A with its rbd driver and mirrors it there
  (blockdev-mirror sync=full; the target with detect-zeroes=unmap, so
  zeroes go as zero writes, not data), then completes the job (its time is the guest's pause: libvirt
  stops the guest, then completes the mirror).

Both cross the same toxiproxy link (bandwidth cap and latency each way);
bytes are the link's counters. The disk: a template (random data in three
of four MiB, zeroes elsewhere) plus new data scattered over it.

Each move runs `--repeats` times (new clusters each time); the table
gives the medians and every run.

Usage: python3 bench/ceph_migration.py [--template-mib 512] [--new-mib 32] [--mbit 100] [--rtt 20]
       [--repeats 3] [--store bluestore|memstore] [--out FILE]
Needs: ceph-mon/osd/mgr and rbd, toxiproxy-server, qemu-storage-daemon with
QEMU's rbd driver (qemu-block-extra), a release build of ferry.
"""
import argparse, json, os, random, shutil, socket, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ROOT, ensure_ferry, free_port, med, version, wait_port  # noqa: E402
from migration_peers import Link, mirror_to_nbd, qmp_connect, wait_http  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "ceph-cluster.sh")
MIB = 1 << 20


def make_images(work, template_mib, new_mib):
    rng = random.Random(7)
    tmpl, image = os.path.join(work, "template.raw"), os.path.join(work, "image.raw")
    with open(tmpl, "wb") as f:
        for i in range(template_mib):
            f.write(os.urandom(MIB) if i % 4 != 3 else bytes(MIB))
    shutil.copyfile(tmpl, image)
    with open(image, "r+b") as f:
        for off in rng.sample(range(template_mib), new_mib):
            f.seek(off * MIB)
            f.write(os.urandom(MIB))
    return tmpl, image


class Gateway:
    def __init__(self, work, name, cluster, migrate=False):
        self.admin, self.nbd = free_port(), free_port()
        pool = os.path.join(work, name)
        args = [FERRY, "serve", "--pool", pool, "--nbd", f"127.0.0.1:{self.nbd}", "--admin", f"127.0.0.1:{self.admin}",
                "--ceph-conf", os.path.join(cluster, "ceph.conf"), "--ceph-keyring", os.path.join(cluster, "keyring"),
                "--ceph-pool", "rbd"]
        self.mig = None
        if migrate:
            self.mig = free_port()
            args += ["--migrate", f"127.0.0.1:{self.mig}"]
        env = dict(os.environ, FERRY_LOG=os.environ.get("FERRY_BENCH_LOG", "warn"))
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=open(pool + ".log", "w"))
        wait_http(f"http://127.0.0.1:{self.admin}/v1/server", 60, self.proc, pool + ".log")

    def ferry(self, *args):
        env = dict(os.environ, FERRY_ADMIN=f"127.0.0.1:{self.admin}")
        return subprocess.run([FERRY, *args], env=env, check=True, capture_output=True, text=True).stdout

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


def run_ferry(work, link, ca, cb, tmpl, image):
    pa, pb = os.path.join(work, "a"), os.path.join(work, "b")
    for p in (pa, pb):
        subprocess.run([FERRY, "certs", "show", "--pool", p], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "trust", f"{pb}/tls/cert.pem", "--pool", pa], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "trust", f"{pa}/tls/cert.pem", "--pool", pb], check=True, capture_output=True)
    src, dst = Gateway(work, "a", ca), Gateway(work, "b", cb, migrate=True)
    try:
        size = str(os.path.getsize(image))
        dst.ferry("volume", "create", "template", "--size", size)
        dst.ferry("volume", "import", "template", tmpl)
        dst.ferry("index", "rebuild")
        src.ferry("volume", "create", "vm", "--size", size)
        src.ferry("volume", "import", "vm", image)
        name, port = link.proxy(f"127.0.0.1:{dst.mig}")
        t = time.time()
        report = json.loads(src.ferry("migrate", "vm", "--to", f"127.0.0.1:{port}", "--json", "--max-downtime", "100ms"))
        secs = time.time() - t
        assert report["result"] == "switched", report
        return {"bytes": link.bytes(name), "seconds": secs, "pause_ms": report["time"]["pause_ms"]}
    finally:
        src.stop()
        dst.stop()


def rbd(cluster, *args, **kw):
    return subprocess.run(["rbd", "-c", os.path.join(cluster, "ceph.conf"), *args], check=True,
                          capture_output=True, **kw)


def relay_through(link, cmd_out, cmd_in):
    """Run `cmd_out | link | cmd_in`: a listener feeds cmd_in's stdin from
    whatever arrives through the link's proxy, the sender writes cmd_out's
    stdout into the proxy. Returns (seconds, proxy name)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    name, port = link.proxy(f"127.0.0.1:{lst.getsockname()[1]}")
    sink = subprocess.Popen(cmd_in, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def receive():
        conn, _ = lst.accept()
        while True:
            b = conn.recv(1 << 20)
            if not b:
                break
            sink.stdin.write(b)
        sink.stdin.close()
        conn.close()

    th = threading.Thread(target=receive)
    th.start()
    t = time.time()
    src = subprocess.Popen(cmd_out, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    s = socket.create_connection(("127.0.0.1", port))
    while True:
        b = src.stdout.read(1 << 20)
        if not b:
            break
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
    src.wait()
    th.join()
    rc = sink.wait()
    secs = time.time() - t
    s.close()
    lst.close()
    if src.returncode or rc:
        raise RuntimeError(f"{cmd_out} | {cmd_in} failed ({src.returncode}, {rc})")
    return secs, name


def run_rbd(work, link, ca, cb, tmpl, image):
    conf = lambda c: ["rbd", "-c", os.path.join(c, "ceph.conf"), "--no-progress"]  # noqa: E731
    # Site B: the template and a sibling clone of it to import onto.
    rbd(cb, "import", "--no-progress", tmpl, "rbd/rtemplate")
    rbd(cb, "snap", "create", "--no-progress", "rbd/rtemplate@base")
    rbd(cb, "snap", "protect", "rbd/rtemplate@base")
    rbd(cb, "clone", "rbd/rtemplate@base", "rbd/rvm")
    # Site A: the disk.
    rbd(ca, "import", "--no-progress", image, "rbd/rvm")
    rbd(ca, "snap", "create", "--no-progress", "rbd/rvm@s1")
    # Pass 1, the guest running.
    s1, n1 = relay_through(link, conf(ca) + ["export-diff", "rbd/rvm@s1", "-"],
                           conf(cb) + ["import-diff", "-", "rbd/rvm"])
    # Pass 2, the guest stopped: what changed since s1.
    t = time.time()
    rbd(ca, "snap", "create", "--no-progress", "rbd/rvm@s2")
    s2, n2 = relay_through(link, conf(ca) + ["export-diff", "--from-snap", "s1", "rbd/rvm@s2", "-"],
                           conf(cb) + ["import-diff", "-", "rbd/rvm"])
    pause = time.time() - t
    return {"bytes": link.bytes(n1) + link.bytes(n2), "seconds": s1 + pause, "pause_ms": pause * 1000}


def run_qemu(work, link, ca, cb, tmpl, image):
    size = os.path.getsize(image)
    rbd(ca, "import", "--no-progress", image, "rbd/qvm")
    rbd(cb, "create", "--size", f"{size // MIB}M", "rbd/qvm")
    nport = free_port()
    # QEMU's rbd driver without a cache of QEMU's own, as in the serving bench.
    dst = subprocess.Popen(
        ["qemu-storage-daemon", "--blockdev",
         json.dumps({"driver": "rbd", "node-name": "t", "pool": "rbd", "image": "qvm",
                     "conf": os.path.join(cb, "ceph.conf"), "cache": {"direct": True}}),
         "--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={nport}",
         "--export", "type=nbd,id=e,node-name=t,name=t,writable=on"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "qsd-dst.log"), "w"))
    wait_port(nport, dst)
    name, port = link.proxy(f"127.0.0.1:{nport}")
    qsock = os.path.join(work, "qmp.sock")
    if os.path.exists(qsock):
        os.unlink(qsock)
    src = subprocess.Popen(
        ["qemu-storage-daemon", "--blockdev",
         json.dumps({"driver": "rbd", "node-name": "s", "pool": "rbd", "image": "qvm",
                     "conf": os.path.join(ca, "ceph.conf"), "cache": {"direct": True}}),
         "--chardev", f"socket,id=q,path={qsock},server=on,wait=off", "--monitor", "chardev=q"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "qsd-src.log"), "w"))
    try:
        # Its best mode: zeroes found in the data go as zero writes, not
        # as data (the image's allocation is per 4 MiB object, so the
        # template's zero MiBs read as data to the mirror).
        t, stopped, end = mirror_to_nbd(qmp_connect(qsock), port, **{"detect-zeroes": "unmap", "discard": "unmap"})
    finally:
        for p in (src, dst):
            p.kill()
            p.wait()
    return {"bytes": link.bytes(name), "seconds": end - t, "pause_ms": (end - stopped) * 1000}


MOVES = {"ferry": run_ferry, "rbd export-diff | import-diff": run_rbd, "QEMU copy-storage (rbd driver, mirror)": run_qemu}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--template-mib", type=int, default=512)
    ap.add_argument("--new-mib", type=int, default=32)
    ap.add_argument("--mbit", type=float, default=100)
    ap.add_argument("--rtt", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--store", choices=["memstore", "bluestore"], default="bluestore")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for t in ("rbd", "ceph-mon", "ceph-osd", "toxiproxy-server", "qemu-storage-daemon"):
        if not shutil.which(t):
            sys.exit(f"{t} is required")
    ensure_ferry()
    runs = {k: [] for k in MOVES}
    for rep in range(a.repeats):
        work = tempfile.mkdtemp(prefix="ferry-ceph-mig-")
        ca, cb = os.path.join(work, "cluster-a"), os.path.join(work, "cluster-b")
        link = None
        try:
            for c in (ca, cb):
                subprocess.run(["bash", SCRIPT, "start", c, "--store", a.store], check=True)
            tmpl, image = make_images(work, a.template_mib, a.new_mib)
            link = Link(work, a.mbit, a.rtt)
            for k, run in MOVES.items():
                r = run(work, link, ca, cb, tmpl, image)
                runs[k].append(r)
                print(f"rep {rep} {k}: {r['bytes'] / 1e6:.1f} MB, {r['seconds']:.1f} s, pause {r['pause_ms']:.0f} ms",
                      flush=True)
        finally:
            if link:
                link.close()
            for c in (ca, cb):
                subprocess.run(["bash", SCRIPT, "stop", c])
            shutil.rmtree(work, ignore_errors=True)
    lines = [f"{version(['ceph', '--version'])}, two clusters of one OSD ({a.store}); link {a.mbit:g} Mbit/s, "
             f"RTT {a.rtt} ms (toxiproxy); disk: {a.template_mib} MiB template (3/4 data) + {a.new_mib} MiB new, "
             f"the template at B; {version(['qemu-storage-daemon', '--version'])}; medians of {a.repeats}",
             "", "| move | bytes on the link | time | guest stopped | runs (MB, s, ms) |", "|---|---|---|---|---|"]
    for k, rs in runs.items():
        each = "; ".join(f"{r['bytes'] / 1e6:.1f}, {r['seconds']:.1f}, {r['pause_ms']:.0f}" for r in rs)
        lines.append(f"| {k.replace('|', chr(92) + '|')} | {med(rs, 'bytes') / 1e6:.1f} MB | "
                     f"{med(rs, 'seconds'):.1f} s | {med(rs, 'pause_ms'):.0f} ms | {each} |")
    f = runs["ferry"]
    lines.append("")
    for k in list(MOVES)[1:]:
        r = runs[k]
        lines.append(f"ferry / {k.replace('|', chr(92) + '|')}: {med(f, 'bytes') / med(r, 'bytes'):.2f}x the bytes, "
                     f"{med(f, 'seconds') / med(r, 'seconds'):.2f}x the time, "
                     f"{med(f, 'pause_ms') / med(r, 'pause_ms'):.2f}x the pause")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
