#!/usr/bin/env python3
"""4 KiB random writes into a file made a volume from a cold page cache,
once ferry's index has scanned it: the writes a guest makes just after its
disk image came in (copied from elsewhere, or the host rebooted).

Each run drops the kernel's caches (root), starts `ferry serve`, makes the
image a volume (`volume create --path`), waits for the index to finish
scanning it (`GET /v1/index`: its prints complete), then runs fio's nbd
engine (4 KiB random writes, 16 in flight, one and four connections).
Beside it, the local limit: fio's `psync` on the image itself from a
dropped cache (fio's default `--invalidate=1`), as `nbd_peers.py`'s
`ferry / local (dropped)` column. With `--base BIN` the previous build
runs the same in every repeat, order alternated (an A/B in one run).

On Linux 6.16+ ext4 a file read ahead in large runs is cached in large
folios, and a 4 KiB write into one walks every block of the folio: the
scan's reads decide the writes' speed (see `ferry_index::open_data`).

Usage: python3 bench/cold_volume_writes.py [--repeats 3] [--runtime 5] [--base BIN] [--out FILE]
Needs: root, fio (with the nbd engine), a release build of ferry.
"""
import argparse, os, shutil, statistics, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ensure_ferry, version  # noqa: E402
from migration_peers import Daemon  # noqa: E402
from nbd_peers import IMAGE_MIB, fio, set_cache  # noqa: E402

CONNS = (1, 4)


def writes(uri, conns, runtime, local=None):
    """IOPS of 4 KiB random writes, 16 deep per connection, over NBD at
    `uri`, or with `local` fio's `psync` on that file from a dropped cache."""
    return fio(uri, "randwrite", "4k", 16, conns, runtime, local=local, invalidate=1)["iops"]


def ferry_run(binary, image, work, runtime):
    """({conns: IOPS}, seconds the index took) for `binary` serving `image`
    made a volume from a cold cache."""
    set_cache(image, "cold")
    pool = os.path.join(work, "pool")
    d = Daemon(pool, binary=binary, allow_path=os.path.dirname(image))
    try:
        d.ferry("volume", "create", "bench", "--path", image)
        t = time.time()
        d.wait_indexed("bench", secs=120)
        scan_s = time.time() - t
        return {c: writes(f"nbd://127.0.0.1:{d.nbd}/bench", c, runtime) for c in CONNS}, scan_s
    finally:
        d.stop()
        shutil.rmtree(pool, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--base", help="a previous build of ferry, run beside this one")
    ap.add_argument("--out", help="append the table to this file")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (drops the kernel's caches)")
    ensure_ferry()
    builds = {"ferry": FERRY}
    if a.base:
        builds["base"] = a.base
    work = tempfile.mkdtemp(prefix="ferry-cold-")
    image = os.path.join(work, "image.raw")
    with open(image, "wb") as f:
        for _ in range(IMAGE_MIB):
            f.write(os.urandom(1 << 20))
    res = {k: {c: [] for c in CONNS} for k in [*builds, "local"]}
    scans = {k: [] for k in builds}
    try:
        for rep in range(a.repeats):
            names = list(builds)
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                iops, scan_s = ferry_run(builds[name], image, work, a.runtime)
                scans[name].append(scan_s)
                for c in CONNS:
                    res[name][c].append(iops[c])
                print(f"rep {rep} {name:6} scan {scan_s:5.1f} s " + " ".join(f"x{c} {iops[c]:8.0f}" for c in CONNS),
                      flush=True)
            for c in CONNS:
                set_cache(image, "cold")
                res["local"][c].append(writes(None, c, a.runtime, local=image))
            print(f"rep {rep} local  " + " ".join(f"x{c} {res['local'][c][-1]:8.0f}" for c in CONNS), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medv = {k: {c: statistics.median(v[c]) for c in CONNS} for k, v in res.items()}
    lines = [f"`python3 bench/cold_volume_writes.py --repeats {a.repeats} --runtime {a.runtime}"
             + (" --base BIN" if a.base else "") + f"`; {version(['fio', '--version'])}, "
             f"{os.uname().release}; medians of {a.repeats} (every run in the last column).", "",
             "| build | conns | IOPS | / local (dropped) | runs |", "|---|---|---|---|---|"]
    for k in res:
        for c in CONNS:
            ratio = "" if k == "local" else f"{medv[k][c] / medv['local'][c]:.2f}"
            lines.append(f"| {k} | {c} | {medv[k][c]:.0f} | {ratio} | "
                         + ", ".join(f"{x:.0f}" for x in res[k][c]) + " |")
    for k in builds:
        lines.append(f"\n{k}: the index's scan took {statistics.median(scans[k]):.1f} s at the median.")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
