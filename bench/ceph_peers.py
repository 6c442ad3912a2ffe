#!/usr/bin/env python3
"""Serving an RBD image, side by side, in one Ceph cluster started for the
run (scripts/ceph-cluster.sh): fio's nbd engine against ferry (`ferry serve
--ceph-conf`, the volume's data an RBD image) and against qemu-nbd serving
the same image through QEMU's own rbd driver (`rbd:POOL/IMAGE`), plus fio's
rbd engine (librbd in fio's own process: no server, no network hop, the
ceiling any librbd consumer such as QEMU's rbd driver inside a guest can
reach). One image, filled once with random data; the peers run one after
another in every repeat (order rotated), medians over repeats.

`rbd-nbd` is not a row: it needs the kernel's NBD driver, which this
machine does not have (no /dev/nbd*).

Usage: python3 bench/ceph_peers.py [--runtime 5] [--repeats 3] [--store memstore|bluestore]
       [--rows "4k randread,1M seq write"] [--out FILE] [--compare-with OTHER_FERRY_BINARY]

--compare-with runs another build of ferry as one more server in the same
rotation (an A/B of a change against the previous main).
Needs: ceph-mon/osd/mgr, fio (nbd and rbd engines), qemu-nbd with
qemu-block-extra (rbd driver), a release build of ferry.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ROOT, ensure_ferry, free_port, med, version, wait_port  # noqa: E402
from evidence_rigs import cpu_seconds  # noqa: E402

ROWS = [  # name, rw, bs, iodepth
    ("4k randread", "randread", "4k", 16),
    ("4k randwrite", "randwrite", "4k", 16),
    ("1M seq read", "read", "1M", 4),
    ("1M seq write", "write", "1M", 4),
]
IMAGE_MIB = 1024
SCRIPT = os.path.join(ROOT, "scripts", "ceph-cluster.sh")


class Ferry:
    def __init__(self, work, conf, keyring, pool, binary=FERRY):
        self.port, self.admin = free_port(), free_port()
        self.proc = subprocess.Popen(
            [binary, "serve", "--pool", os.path.join(work, "ferry-pool"), "--nbd", f"127.0.0.1:{self.port}",
             "--admin", f"127.0.0.1:{self.admin}", "--ceph-conf", conf, "--ceph-keyring", keyring,
             "--ceph-pool", pool], stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "ferry.log"), "ab"))
        wait_port(self.admin, self.proc)
        self.uri = f"nbd://127.0.0.1:{self.port}/bench"

    def ferry(self, *args):
        subprocess.run([FERRY, *args, "--admin", f"127.0.0.1:{self.admin}"], check=True, stdout=subprocess.DEVNULL)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


class QemuNbd:
    def __init__(self, conf, pool):
        self.port = free_port()
        spec = f"rbd:{pool}/bench:conf={conf}"
        # QEMU's rbd driver at its best: no QEMU cache of its own
        # (librbd's writeback cache is librbd's default, as QEMU leaves it),
        # 16 clients at once.
        self.proc = subprocess.Popen(["qemu-nbd", "-f", "raw", "-x", "bench", "-b", "127.0.0.1", "-p", str(self.port),
                                      "-t", "-e", "16", "--cache=none", spec])
        wait_port(self.port, self.proc)
        self.uri = f"nbd://127.0.0.1:{self.port}/bench"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def fio(target, rw, bs, iodepth, runtime, conf):
    """One fio job; `runtime` None: once over the image (the fill)."""
    timing = ["--time_based", f"--runtime={runtime}", "--ramp_time=1"] if runtime else []
    cmd = ["fio", "--name=j", *target, f"--rw={rw}", f"--bs={bs}", f"--iodepth={iodepth}", f"--size={IMAGE_MIB}M",
           *timing, "--group_reporting", "--output-format=json"]
    env = dict(os.environ, CEPH_CONF=conf)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    j = json.loads(out[out.index("{"):])["jobs"][0]
    side = j["read"] if j["read"]["iops"] >= j["write"]["iops"] else j["write"]
    return {"iops": j["read"]["iops"] + j["write"]["iops"],
            "mbps": (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6,
            "p99_us": side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store", choices=["memstore", "bluestore"], default="bluestore")
    ap.add_argument("--rows", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare-with", default=None, help="another ferry binary, run as one more server")
    a = ap.parse_args()
    for t in ("fio", "qemu-nbd", "ceph-mon", "ceph-osd"):
        if not shutil.which(t):
            sys.exit(f"{t} is required")
    rows = [r for r in ROWS if a.rows is None or r[0] in a.rows.split(",")]
    ensure_ferry()
    work = tempfile.mkdtemp(prefix="ferry-ceph-bench-")
    cluster = os.path.join(work, "cluster")
    subprocess.run(["bash", SCRIPT, "start", cluster, "--store", a.store], check=True)
    conf, keyring, pool = os.path.join(cluster, "ceph.conf"), os.path.join(cluster, "keyring"), "rbd"
    kinds = ["ferry", "qemu-nbd rbd", "fio rbd"] + (["ferry (other build)"] if a.compare_with else [])
    res = {r[0]: {k: [] for k in kinds} for r in rows}
    try:
        # ferry makes the volume (and its image), then lets go of it while
        # the image is filled in the cluster.
        f = Ferry(work, conf, keyring, pool)
        f.ferry("volume", "create", "bench", "--size", f"{IMAGE_MIB}M")
        f.stop()
        fio(["--ioengine=rbd", f"--pool={pool}", "--rbdname=bench", "--clientname=admin"], "write", "4M", 4, None, conf)
        for rep in range(a.repeats):
            order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
            for kind in order:
                if kind.startswith("ferry"):
                    s = Ferry(work, conf, keyring, pool, FERRY if kind == "ferry" else a.compare_with)
                    target = ["--ioengine=nbd", f"--uri={s.uri}"]
                elif kind == "qemu-nbd rbd":
                    s = QemuNbd(conf, pool)
                    target = ["--ioengine=nbd", f"--uri={s.uri}"]
                else:
                    s = None
                    target = ["--ioengine=rbd", f"--pool={pool}", "--rbdname=bench", "--clientname=admin"]
                try:
                    for name, rw, bs, qd in rows:
                        c0 = cpu_seconds(s.proc.pid) if s else 0.0
                        r = fio(target, rw, bs, qd, a.runtime, conf)
                        # The server's CPU per request (fio's ramp second
                        # included in both: its requests are not counted).
                        if s:
                            r["cpu_us"] = 1e6 * (cpu_seconds(s.proc.pid) - c0) / max(r["iops"] * (a.runtime + 1), 1)
                        res[name][kind].append(r)
                        print(f"rep {rep} {kind:13} {name:14} {r['iops']:9.0f} IOPS {r['mbps']:8.1f} MB/s "
                              f"p99 {r['p99_us']:8.0f} us" + (f"  server {r['cpu_us']:6.1f} us CPU/req" if s else ""),
                              flush=True)
                finally:
                    if s:
                        s.stop()
    finally:
        subprocess.run(["bash", SCRIPT, "stop", cluster])
    lines = [f"Ceph {version(['ceph', '--version'])}, one OSD ({a.store}), {a.repeats} repeats x {a.runtime} s, "
             f"{version(['fio', '--version'])}, {version(['qemu-nbd', '--version'])}",
             "", "| row | ferry MB/s | qemu-nbd (rbd driver) MB/s | fio rbd (librbd in-process) MB/s "
             "| ferry / qemu-nbd | ferry / librbd | p99 µs ferry / qemu-nbd | server CPU µs/request ferry / qemu-nbd |",
             "|---|---|---|---|---|---|---|---|"]
    for name, *_ in rows:
        fr, qn, lr = (med(res[name][k], "mbps") for k in kinds[:3])
        fp, qp = med(res[name]["ferry"], "p99_us"), med(res[name]["qemu-nbd rbd"], "p99_us")
        fc, qc = med(res[name]["ferry"], "cpu_us"), med(res[name]["qemu-nbd rbd"], "cpu_us")
        lines.append(f"| {name} | {fr:.1f} | {qn:.1f} | {lr:.1f} | {fr / qn:.2f}x | {fr / lr:.2f}x | {fp:.0f} / {qp:.0f} "
                     f"| {fc:.0f} / {qc:.0f} |")
    if a.compare_with:
        lines += ["", f"ferry against the other build ({a.compare_with}), same rotation:", "",
                  "| row | ferry MB/s | other build MB/s | ratio | server CPU µs/request ferry / other |", "|---|---|---|---|---|"]
        for name, *_ in rows:
            f, o = res[name]["ferry"], res[name]["ferry (other build)"]
            lines.append(f"| {name} | {med(f, 'mbps'):.1f} | {med(o, 'mbps'):.1f} | {med(f, 'mbps') / med(o, 'mbps'):.2f}x "
                         f"| {med(f, 'cpu_us'):.0f} / {med(o, 'cpu_us'):.0f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
