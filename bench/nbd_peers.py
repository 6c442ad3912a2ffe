#!/usr/bin/env python3
"""NBD serving, side by side: fio's nbd engine against ferry, nbdkit (file
plugin) and qemu-nbd, each serving the same raw image, one after another in
every repeat (order rotated), medians over repeats. Then `ferry bench`
against fio on the same export and job shapes, with the server pinned to
CPU 0 and the clients to CPU 1 (so the comparison measures the server, not
which client needs less CPU on a shared 2-core machine).

Each server first runs every row's job once for a second, not counted (a
server's first job can run below its best: nbdkit's does). Every peer
row runs from a stated page-cache state of the image, set just
before it (`--cache`, one or more): `fresh` (the image just rewritten, its
pages dirty in the cache), `clean` (written back and read once: cached and
clean), `cold` (written back, then the kernel's caches dropped; needs root).
`fresh` and `clean` hold the image in page-sized folios, as a guest's own
small writes leave it (see `set_cache`).

Beside the servers, every row also runs fio's `psync` engine on the image
file itself (same job, one synchronous request at a time per job, no
network, the page cache left as the row set it: fio's `--invalidate=0`):
the local limit the issue's "0.7x of a local write" is measured
against, in the `ferry / local` column. A second local job runs with
fio's default instead (`--invalidate=1`: the file's cached pages dropped
when the job starts), as the issue's own figure was taken: the
`ferry / local (dropped)` column.

With `--pin`, every server runs on CPU 0 and fio (and the local job) on
CPU 1, so that no server competes with its client for a core: the fio nbd
client spends about as much CPU per 4 KiB request as the server does, and
on two shared cores it, not the server, sets the ceiling.

Usage: python3 bench/nbd_peers.py [--runtime 5] [--repeats 3] [--only peers|agree]
       [--cache clean[,fresh,cold]] [--rows "4k randwrite,1M seq write"] [--pin] [--out FILE]
       [--sendfile [off|always|sole-reader]]
Needs: fio (with the nbd engine), nbdkit, qemu-nbd, a release build of ferry.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ROOT, free_port, med, version, wait_port  # noqa: E402,F401

ROWS = [  # name, rw, bs, iodepth, connections
    ("4k randread", "randread", "4k", 16, 1),
    ("4k randwrite", "randwrite", "4k", 16, 1),
    ("1M seq read", "read", "1M", 4, 1),
    ("1M seq write", "write", "1M", 4, 1),
    ("4k randread x4", "randread", "4k", 16, 4),
    ("4k randwrite x4", "randwrite", "4k", 16, 4),
    ("1M seq read x4", "read", "1M", 4, 4),
    ("1M seq write x4", "write", "1M", 4, 4),
]

AGREE = [  # name, fio rw, bs, rwmixread, iodepth, ferry-bench args
    ("4k randread qd16", "randread", "4k", 100, 16, ["--rw", "randread", "--bs", "4K"]),
    ("4k randwrite qd16", "randwrite", "4k", 0, 16, ["--rw", "randwrite", "--bs", "4K"]),
    ("oltp 8k 67% read qd16", "randrw", "8k", 67, 16, ["--profile", "oltp"]),
    ("1M seq read qd4", "read", "1M", 100, 4, ["--rw", "read", "--bs", "1M"]),
]

IMAGE_MIB = 1024
# `--sendfile MODE`: ferry serves with `nbd.sendfile_reads = false` (off),
# `true` (always) or `"sole-reader"` (its default) rather than its default.
FERRY_SENDFILE = None


PIN_SERVER = ["taskset", "-c", "0"]
PIN_CLIENT = ["taskset", "-c", "1"]


class Server:
    def __init__(self, kind, image, work, pin=False):
        self.kind, self.port = kind, free_port()
        if kind == "ferry":
            self.admin = admin = free_port()
            extra = []
            if FERRY_SENDFILE:
                os.makedirs(work, exist_ok=True)
                conf = os.path.join(work, "ferry.toml")
                with open(conf, "w") as f:
                    mode = {"off": "false", "always": "true"}.get(FERRY_SENDFILE, f'"{FERRY_SENDFILE}"')
                    f.write(f"[nbd]\nsendfile_reads = {mode}\n")
                extra = ["--config", conf]
            self.proc = subprocess.Popen((PIN_SERVER if pin else []) + [FERRY, "serve", *extra, "--pool", os.path.join(work, "pool"),
                                          "--nbd", f"127.0.0.1:{self.port}", "--admin", f"127.0.0.1:{admin}",
                                          "--allow-path", os.path.dirname(os.path.abspath(image))],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_port(admin, self.proc)
            subprocess.run([FERRY, "volume", "create", "bench", "--path", image, "--admin", f"127.0.0.1:{admin}"],
                           check=True, stdout=subprocess.DEVNULL)
        elif kind == "nbdkit":
            self.proc = subprocess.Popen((PIN_SERVER if pin else []) + ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(self.port),
                                                                       "file", image])
        elif kind == "qemu-nbd":
            self.proc = subprocess.Popen((PIN_SERVER if pin else []) + ["qemu-nbd", "-f", "raw", "-x", "bench", "-b", "127.0.0.1",
                                                                       "-p", str(self.port), "-t", "-e", "16", "--aio=threads", image])
        wait_port(self.port, self.proc)
        self.uri = f"nbd://127.0.0.1:{self.port}/bench"

    def reads_from_file(self):
        """ferry's count of READs sent from the file so far (None for a peer)."""
        if self.kind != "ferry":
            return None
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/metrics", timeout=30) as r:
            text = r.read().decode()
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("ferry_nbd_reads_sent_from_file_total"))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def set_cache(image, state):
    """Put the image's pages in `state` (see the module's doc). Every state
    starts from the file written back and its pages dropped, and `fresh`
    and `clean` read it back in page-sized folios (POSIX_FADV_RANDOM): on
    Linux 6.16+ ext4 caches a file read ahead in large runs in large
    folios, and a 4 KiB write into one costs about ten times the kernel
    CPU (20k against 400k local writes a second here), so whichever job
    or server had read the file cold before would have set the next row's
    write speed."""
    subprocess.run(["sync"], check=True)
    if state == "cold":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    if state not in ("fresh", "clean"):
        raise ValueError(state)
    fd = os.open(image, os.O_RDWR)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        off = 0
        while True:
            n = len(os.pread(fd, 8 << 20, off))
            if not n:
                break
            off += n
        if state == "fresh":
            for i in range(IMAGE_MIB):
                os.pwrite(fd, os.urandom(1 << 20), i << 20)
    finally:
        os.close(fd)


def fio(uri, rw, bs, iodepth, conns, runtime, rwmixread=50, pin=False, local=None, invalidate=0):
    """One fio job against `uri` over NBD, or with `local` (a file) its
    `psync` engine on the file itself, dropping its cached pages first if
    `invalidate`."""
    region = IMAGE_MIB // conns
    # fio drops a file's cached pages before a job on it unless told not
    # to (`invalidate`); the servers keep theirs, so the local job must too
    # or it runs from a cold cache whatever state the row set.
    target = (["--ioengine=psync", f"--invalidate={invalidate}", f"--filename={local}"] if local
              else ["--ioengine=nbd", f"--uri={uri}"])
    cmd = ["fio", "--name=j", *target, f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={iodepth}", f"--numjobs={conns}", f"--size={region}M", f"--offset_increment={region}M",
           f"--rwmixread={rwmixread}", "--time_based", f"--runtime={runtime}", "--ramp_time=1",
           "--group_reporting", "--output-format=json"]
    out = subprocess.run((PIN_CLIENT if pin else []) + cmd, check=True, capture_output=True, text=True).stdout
    j = json.loads(out[out.index("{"):])["jobs"][0]
    iops = j["read"]["iops"] + j["write"]["iops"]
    bw = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
    side = j["read"] if j["read"]["iops"] >= j["write"]["iops"] else j["write"]
    p99 = side["clat_ns"].get("percentile", {}).get("99.000000", 0) / 1000
    return {"iops": iops, "mbps": bw, "p99_us": p99, "cpu": j.get("usr_cpu", 0) + j.get("sys_cpu", 0)}


def show(rep, kind, name, cache, r):
    """One result as it comes (with ferry's share of READs sent from the file)."""
    by_file = f" sendfile {r['from_file']:.0%}" if r.get("from_file") is not None else ""
    print(f"rep {rep} {kind:9} {name:18} {cache:5} {r['iops']:10.0f} IOPS {r['mbps']:8.1f} MB/s p99 {r['p99_us']:8.0f} us"
          + by_file, flush=True)


def ferry_bench(addr, args, iodepth, runtime):
    cmd = PIN_CLIENT + [FERRY, "bench", "--nbd", addr, "--export", "bench", "--iodepth", str(iodepth),
           "--runtime", str(runtime), "--json"] + args
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)[0]
    return {"iops": r["iops"], "mbps": r["mb_per_s"], "p99_us": r["lat_p99_us"], "cpu": r["client_cpu_pct"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["peers", "agree"], default=None)
    ap.add_argument("--cache", default="clean", help="page-cache states, comma-separated: fresh, clean, cold")
    ap.add_argument("--rows", default=None, help="peer rows to run, comma-separated names (default: all)")
    ap.add_argument("--sendfile", choices=["off", "always", "sole-reader"], nargs="?", const="always", default=None,
                    help="ferry's nbd.sendfile_reads: false, true (the flag alone) or \"sole-reader\""
                         " (ferry's default, as without the flag)")
    ap.add_argument("--pin", action="store_true",
                    help="peer rows: every server on CPU 0, fio (and the local job) on CPU 1")
    a = ap.parse_args()
    global FERRY_SENDFILE
    FERRY_SENDFILE = a.sendfile
    states = [c for c in a.cache.split(",") if c]
    for c in states:
        if c not in ("fresh", "clean", "cold"):
            sys.exit(f"unknown cache state {c!r}")
    if "cold" in states and os.geteuid() != 0:
        sys.exit("the cold state drops the kernel's caches: run as root")
    rows = [r for r in ROWS if a.rows is None or r[0] in a.rows.split(",")]
    for t in ("fio", "nbdkit", "qemu-nbd"):
        if not shutil.which(t):
            sys.exit(f"{t} is required")
    if not os.path.exists(FERRY):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "ferry-cli"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="ferry-bench-")
    image = os.path.join(work, "image.raw")
    with open(image, "wb") as f:
        for _ in range(IMAGE_MIB):
            f.write(os.urandom(1 << 20))
    kinds = ["ferry", "nbdkit", "qemu-nbd"]
    locals_ = {"local": 0, "dropped": 1}  # name: fio's invalidate
    res = {(r[0], c): {k: [] for k in kinds + list(locals_)} for r in rows for c in states}
    agree = {r[0]: {"fio": [], "ferry bench": []} for r in AGREE}
    for rep in range(a.repeats):
        if a.only != "agree":
            order = kinds[rep % 3:] + kinds[:rep % 3]
            for kind in order:
                s = Server(kind, image, os.path.join(work, f"{kind}-{rep}"), pin=a.pin)
                try:
                    # Each row's shape once, not counted: a server's first
                    # job can run below its best (nbdkit's first 1 MiB read
                    # job at 1,337-1,562 IOPS, its second at 2,451-2,645), and
                    # the row that came first would compare a peer at that.
                    for name, rw, bs, qd, conns in rows:
                        fio(s.uri, rw, bs, qd, conns, 1, pin=a.pin)
                    for name, rw, bs, qd, conns in rows:
                        for c in states:
                            set_cache(image, c)
                            before = s.reads_from_file()
                            r = fio(s.uri, rw, bs, qd, conns, a.runtime, pin=a.pin)
                            if before is not None and rw == "read":
                                reads = r["iops"] * (a.runtime + 1)  # the ramp's reads count too
                                r["from_file"] = (s.reads_from_file() - before) / max(reads, 1)
                            res[(name, c)][kind].append(r)
                            show(rep, kind, name, c, r)
                finally:
                    s.stop()
            for name, rw, bs, qd, conns in rows:
                for c in states:
                    for kind, inv in locals_.items():
                        set_cache(image, c)
                        r = fio(None, rw, bs, qd, conns, a.runtime, local=image, invalidate=inv, pin=a.pin)
                        res[(name, c)][kind].append(r)
                        show(rep, kind, name, c, r)
        if a.only != "peers":
            s = Server("ferry", image, os.path.join(work, f"agree-{rep}"), pin=True)
            try:
                for name, rw, bs, mix, qd, args in AGREE:
                    f = fio(s.uri, rw, bs, qd, 1, a.runtime, mix, pin=True)
                    b = ferry_bench(f"127.0.0.1:{s.port}", args, qd, a.runtime)
                    agree[name]["fio"].append(f)
                    agree[name]["ferry bench"].append(b)
                    print(f"rep {rep} agree {name:24} fio {f['iops']:9.0f}  ferry bench {b['iops']:9.0f}", flush=True)
            finally:
                s.stop()
    shutil.rmtree(work, ignore_errors=True)

    lines = []
    if a.only == "agree":
        lines.append("(peer comparison skipped)")
    lines.append(f"Medians of {a.repeats} repeats, {a.runtime} s each after 1 s ramp, fio {version(['fio', '--version'])} "
                 f"`--ioengine=nbd`, {IMAGE_MIB} MiB image of random data (page cache as the cache column says, set before each row), loopback TCP, "
                 + ("every server pinned to CPU 0 and fio (the local job too) to CPU 1. " if a.pin
                    else "2 cores shared by client and server. ")
                 + f"Peers: {version(['nbdkit', '--version'])} (file plugin), "
                 f"{version(['qemu-nbd', '--version'])} (`--aio=threads -e 16`). Ratio = ferry / best peer "
                 "(IOPS; for p99 latency: best peer / ferry, so > 1 means ferry is better on both). "
                 "Local: fio `psync` on the image file itself, same job (one request at a time per job), "
                 "the cache as the row set it; dropped: the same with fio's default, the file's cache dropped "
                 "when the job starts.")
    lines.append("")
    lines.append("| job | conns | cache | ferry IOPS | nbdkit IOPS | qemu-nbd IOPS | ferry MB/s | ferry p99 us | nbdkit p99 us | qemu-nbd p99 us | IOPS ratio | p99 ratio | local IOPS | ferry / local | ferry / local (dropped) |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, rw, bs, qd, conns), c in [(r, c) for r in rows for c in states]:
        r = res[(name, c)]
        if not r["ferry"]:
            continue
        fi, ki, qi = (med(r[k], "iops") for k in kinds)
        fp, kp, qp = (med(r[k], "p99_us") for k in kinds)
        li, di = med(r["local"], "iops"), med(r["dropped"], "iops")
        best_i = max(ki, qi)
        best_p = min(kp, qp)
        lines.append(f"| {rw} {bs} qd{qd} | {conns} | {c} | {fi:.0f} | {ki:.0f} | {qi:.0f} | {med(r['ferry'], 'mbps'):.0f} | "
                     f"{fp:.0f} | {kp:.0f} | {qp:.0f} | **{fi / best_i:.2f}** | {best_p / fp if fp else 0:.2f} | "
                     f"{li:.0f} | {fi / li if li else 0:.2f} | {fi / di if di else 0:.2f} |")
    lines.append("")
    lines.append("`ferry bench` against fio on the same ferry export and job shape (1 connection; "
                 "server pinned to CPU 0, client to CPU 1):")
    lines.append("")
    lines.append("| job | fio IOPS | ferry bench IOPS | ferry bench / fio | fio p99 us | ferry bench p99 us | fio client CPU % | ferry bench client CPU % |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for name, *_ in AGREE:
        f, b = agree[name]["fio"], agree[name]["ferry bench"]
        if not f:
            continue
        lines.append(f"| {name} | {med(f, 'iops'):.0f} | {med(b, 'iops'):.0f} | {med(b, 'iops') / med(f, 'iops'):.2f} | "
                     f"{med(f, 'p99_us'):.0f} | {med(b, 'p99_us'):.0f} | {med(f, 'cpu'):.0f} | {med(b, 'cpu'):.0f} |")
    table = "\n".join(lines)
    print("\n" + table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
