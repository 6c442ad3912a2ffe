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
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile, time, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ensure_ferry, free_port, version, wait_port  # noqa: E402

IMAGE_MIB = 1024
CONNS = (1, 4)


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def fio(target, conns, runtime):
    """IOPS of 4 KiB random writes, 16 deep per connection, on `target`
    (fio's engine options)."""
    region = IMAGE_MIB // conns
    cmd = ["fio", "--name=j", *target, "--rw=randwrite", "--bs=4k", "--iodepth=16", f"--numjobs={conns}",
           f"--size={region}M", f"--offset_increment={region}M", "--time_based", f"--runtime={runtime}",
           "--ramp_time=1", "--group_reporting", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])["jobs"][0]["write"]["iops"]


def ferry_run(binary, image, work, runtime):
    """{conns: IOPS} for `binary` serving `image` made a volume from a cold cache."""
    drop_caches()
    port, admin = free_port(), free_port()
    proc = subprocess.Popen([binary, "serve", "--pool", os.path.join(work, "pool"), "--nbd", f"127.0.0.1:{port}",
                             "--admin", f"127.0.0.1:{admin}", "--allow-path", os.path.dirname(image)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(admin, proc)
        subprocess.run([binary, "volume", "create", "bench", "--path", image, "--admin", f"127.0.0.1:{admin}"],
                       check=True, stdout=subprocess.DEVNULL)
        t = time.time()
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/v1/index", timeout=30) as r:
                vols = json.load(r).get("volumes", [])
            if any(v["volume"] == "bench" and v.get("prints") for v in vols):
                break
            if time.time() - t > 120:
                raise RuntimeError("the index did not finish scanning the volume in 120 s")
            time.sleep(0.2)
        scan_s = time.time() - t
        return {c: fio(["--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}/bench"], c, runtime) for c in CONNS}, scan_s
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(os.path.join(work, "pool"), ignore_errors=True)


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
                drop_caches()
                res["local"][c].append(fio(["--ioengine=psync", "--invalidate=1", f"--filename={image}"], c,
                                           a.runtime))
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
