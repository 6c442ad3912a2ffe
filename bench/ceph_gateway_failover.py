#!/usr/bin/env python3
"""A gateway killed under load: fio writes 4 KiB blocks at random (16 in
flight) to a volume on Ceph through a VM host's forwarder (`ferry host`,
the way a guest's QEMU reaches its disk), and the gateway serving it is
killed with SIGKILL part-way through. Measured as the guest would see it:
whether any request failed, the slowest request, and the longest time
with no request completing.

Two ways of running the site's storage, side by side in each repeat:

- "two shared gateways": `ferry serve --ceph-shared` twice in front of one
  cluster, the forwarder knowing both (`--gateways A,B`); the survivor
  claims the volume from the dead one (breaking and fencing its lock).
- "one gateway, restarted at once": one `ferry serve` on Ceph, started
  again on the same pool directory and address right after the kill (what
  a service manager does); the forwarder holds requests until it is back.

And the iSCSI path, which has no forwarder of ferry's:

- "iSCSI site portal, QEMU's initiator": two shared gateways taking turns
  at the site's iSCSI portal (`[iscsi] site_portal`, an address on a veth
  device of the bench's own, CHAP), `qemu-nbd` reaching the volume through
  QEMU's iSCSI driver (libiscsi) at that address and exporting it to fio's
  nbd engine; the gateway holding the portal is the one killed. fio has
  no libiscsi engine; through qemu-nbd the initiator is the one a guest's
  QEMU runs, with its own reconnect.

There is no Ceph-native row: `rbd-nbd` (whose kernel NBD device would
see the daemon die) cannot run here (no kernel NBD), and QEMU's own rbd
driver has no gateway to lose.

Usage: python3 bench/ceph_gateway_failover.py [--runtime 20] [--kill-at 8] [--repeats 3]
       [--store bluestore|memstore] [--kinds shared,restarted,iscsi] [--out FILE]
Needs: ceph-mon/osd/mgr, fio (nbd engine), qemu-nbd with iSCSI (qemu-block-extra),
iproute2 and root (the site portal's device), a release build of ferry.
"""
import argparse, glob, os, shutil, signal, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ROOT, ensure_ferry, free_port, version, wait_port  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "ceph-cluster.sh")
IMAGE_MIB = 1024


KINDS = {"shared": "two shared gateways", "restarted": "one gateway, restarted at once",
         "iscsi": "iSCSI site portal, QEMU's initiator"}
CHAP = ("bench", "site-portal-bench-secret")


class Gateway:
    def __init__(self, work, name, conf, keyring, pool, shared, nbd=None, admin=None, extra=()):
        self.work, self.name, self.conf, self.keyring, self.pool = work, name, conf, keyring, pool
        self.shared = shared
        self.nbd = nbd or free_port()
        self.admin = admin or free_port()
        self.extra = list(extra)
        self.start()

    @property
    def log(self):
        return os.path.join(self.work, self.name + ".log")

    def start(self):
        args = [FERRY, "serve", "--pool", os.path.join(self.work, self.name), "--nbd", f"127.0.0.1:{self.nbd}",
                "--admin", f"127.0.0.1:{self.admin}", "--ceph-conf", self.conf, "--ceph-keyring", self.keyring,
                "--ceph-pool", self.pool, *self.extra]
        if self.shared:
            args.append("--ceph-shared")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))
        wait_port(self.admin, self.proc)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def ferry(self, *args):
        subprocess.run([FERRY, *args, "--admin", f"127.0.0.1:{self.admin}"], check=True, stdout=subprocess.DEVNULL)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def completions(prefix):
    """Completion times (ms since the job began) and latencies (ms) of
    every request fio logged."""
    times, lats = [], []
    for path in glob.glob(prefix + "_clat.*.log"):
        with open(path) as fh:
            for line in fh:
                f = line.split(",")
                if len(f) >= 2:
                    times.append(int(f[0]))
                    lats.append(int(f[1]) / 1e6)
    return sorted(times), lats


class SiteLink:
    """A veth pair of the bench's own: the device the site portal's address
    goes on."""

    def __init__(self):
        self.name = f"fbfo{os.getpid() % 100000}"
        subprocess.run(["ip", "link", "del", self.name], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "add", self.name, "type", "veth", "peer", "name", self.name + "p"], check=True)
        for n in (self.name, self.name + "p"):
            subprocess.run(["ip", "link", "set", n, "up"], check=True)

    def remove(self):
        subprocess.run(["ip", "link", "del", self.name], stderr=subprocess.DEVNULL)


def portal_holder(gateways, timeout=30):
    """The gateway whose log says it holds the site portal now."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        for g in gateways:
            text = open(g.log).read() if os.path.exists(g.log) else ""
            took, gave = text.rfind("this gateway holds the site portal"), text.rfind("site portal given back")
            if took >= 0 and gave < took:
                return g
        time.sleep(0.2)
    sys.exit("no gateway took the site portal")


def run(work, kind, conf, keyring, pool, runtime, kill_at, rep, link):
    if kind == KINDS["iscsi"]:
        return run_iscsi(work, conf, keyring, pool, runtime, kill_at, rep, link)
    shared = kind == KINDS["shared"]
    g1 = Gateway(work, f"g1-{rep}", conf, keyring, pool, shared)
    g2 = Gateway(work, f"g2-{rep}", conf, keyring, pool, True) if shared else None
    vol = f"fo{rep}{'s' if shared else 'r'}"
    g1.ferry("volume", "create", vol, "--size", f"{IMAGE_MIB}M")
    listen = free_port()
    host = [FERRY, "host", "--server", f"127.0.0.1:{g1.nbd}", "--volume", vol, "--listen", f"127.0.0.1:{listen}"]
    if g2:
        host += ["--gateways", f"127.0.0.1:{g1.nbd},127.0.0.1:{g2.nbd}"]
    fwd = subprocess.Popen(host, stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "host.log"), "ab"))
    try:
        wait_port(listen, fwd)
        return measure(work, "s" if shared else "r", g1, not shared, vol, listen, runtime, kill_at, rep)
    finally:
        fwd.terminate()
        fwd.wait(30)
        for g in (g1, g2):
            if g:
                g.stop()


def run_iscsi(work, conf, keyring, pool, runtime, kill_at, rep, link):
    cfg = os.path.join(work, "iscsi.toml")
    with open(cfg, "w") as fh:
        fh.write(f'[iscsi]\nchap_user = "{CHAP[0]}"\nchap_secret = "{CHAP[1]}"\n')
    site = f"10.214.{rep % 200 + 1}.{os.getpid() % 200 + 20}:{free_port()}"

    def gateway(name):
        return Gateway(work, name, conf, keyring, pool, True,
                       extra=["--config", cfg, "--iscsi", f"127.0.0.1:{free_port()}",
                              "--iscsi-site-portal", site, "--iscsi-site-device", link.name])
    gws = [gateway(f"g1-{rep}i"), gateway(f"g2-{rep}i")]
    vol = f"fo{rep}i"
    gws[0].ferry("volume", "create", vol, "--size", f"{IMAGE_MIB}M")
    holder = portal_holder(gws)
    listen = free_port()
    url = f"iscsi://{CHAP[0]}%{CHAP[1]}@{site}/iqn.2026-11.io.ferry:{vol}/0"
    # QEMU's initiator, its disk exported to fio: writes are acknowledged
    # when the target acknowledged them (no cache of QEMU's own).
    qnbd = subprocess.Popen(["qemu-nbd", "-f", "raw", "--cache=none", "-t", "-x", vol, "-b", "127.0.0.1",
                             "-p", str(listen), url],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "qemu-nbd.log"), "ab"))
    try:
        wait_port(listen, qnbd)
        return measure(work, "i", holder, False, vol, listen, runtime, kill_at, rep)
    finally:
        qnbd.terminate()
        qnbd.wait(30)
        for g in gws:
            g.stop()


def measure(work, tag, victim, restart, vol, listen, runtime, kill_at, rep):
    """fio through `listen` while `victim` is killed at `kill_at` (and
    started again if `restart`)."""
    prefix = os.path.join(work, f"lat-{rep}-{tag}")
    cmd = ["fio", "--name=j", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{listen}/{vol}", "--rw=randwrite",
           "--bs=4k", "--iodepth=16", f"--size={IMAGE_MIB}M", "--time_based", f"--runtime={runtime}",
           f"--write_lat_log={prefix}", "--log_avg_msec=0", "--output-format=json"]
    t0 = time.monotonic()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def killer():
        time.sleep(max(0.0, kill_at - (time.monotonic() - t0)))
        victim.kill()
        with open(os.path.join(work, "kills.log"), "a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime())}.{int(time.time() * 1e6) % 1000000:06d}Z "
                     f"killed {victim.name}\n")
        if restart:
            victim.start()
    k = threading.Thread(target=killer)
    k.start()
    try:
        out, err = job.communicate(timeout=runtime + 120)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        err = "fio did not finish in time " + err
        job.returncode = -1
    k.join()
    times, lats = completions(prefix)
    # The stall: the longest time with no request completing, from a
    # second before the kill on (fio's clock starts a little after t0).
    around = [t for t in times if t >= (kill_at - 1) * 1000]
    gap = max((b - a for a, b in zip(around, around[1:])), default=0)
    return {"ok": job.returncode == 0, "error": err.strip()[-300:] if job.returncode else "",
            "ios": len(times), "stall_ms": gap, "max_ms": max(lats, default=0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=20)
    ap.add_argument("--kill-at", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store", choices=["memstore", "bluestore"], default="bluestore")
    ap.add_argument("--kinds", default="shared,restarted,iscsi",
                    help="which set-ups, of: " + ", ".join(f"{k} ({v})" for k, v in KINDS.items()))
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = ap.parse_args()
    kinds = [KINDS[k] for k in a.kinds.split(",")]
    for t in ("fio", "ceph-mon", "ceph-osd") + (("qemu-nbd", "ip") if KINDS["iscsi"] in kinds else ()):
        if not shutil.which(t):
            sys.exit(f"{t} is required")
    ensure_ferry()
    work = tempfile.mkdtemp(prefix="ferry-failover-bench-")
    cluster = os.path.join(work, "cluster")
    subprocess.run(["bash", SCRIPT, "start", cluster, "--store", a.store], check=True)
    conf, keyring, pool = os.path.join(cluster, "ceph.conf"), os.path.join(cluster, "keyring"), "rbd"
    res = {k: [] for k in kinds}
    link = SiteLink() if KINDS["iscsi"] in kinds else None
    try:
        for rep in range(a.repeats):
            for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
                r = run(work, kind, conf, keyring, pool, a.runtime, a.kill_at, rep, link)
                res[kind].append(r)
                print(f"rep {rep} {kind:36} ok={r['ok']} stall {r['stall_ms']:6.0f} ms  slowest {r['max_ms']:7.0f} ms "
                      f"{r['ios']} requests {r['error']}", flush=True)
    finally:
        subprocess.run(["bash", SCRIPT, "stop", cluster])
        if link:
            link.remove()

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0
    lines = [f"Ceph {version(['ceph', '--version'])}, one OSD ({a.store}), {a.repeats} repeats, "
             f"fio {a.runtime} s of 4 KiB random writes (16 in flight) through `ferry host` (iSCSI: qemu-nbd), "
             f"the serving gateway SIGKILLed at {a.kill_at:g} s; {version(['fio', '--version'])}",
             "", "| storage | runs without an error | stall, median (each run) ms | slowest request, median ms |",
             "|---|---|---|---|"]
    for k in kinds:
        rs = res[k]
        lines.append(f"| {k} | {sum(r['ok'] for r in rs)} of {len(rs)} | {median([r['stall_ms'] for r in rs]):.0f} "
                     f"({', '.join(str(round(r['stall_ms'])) for r in rs)}) | {median([r['max_ms'] for r in rs]):.0f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    if a.keep:
        print(f"logs in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
