#!/usr/bin/env python3
"""iSCSI serving, side by side: ferry against tgt (file-backed LUN), both
serving the same raw image, one after the other in every repeat (order
rotated), medians over repeats, ratios ferry / tgt.

Jobs: libiscsi's iscsi-perf for 4 KiB random read at QD 16 and 1 MiB
sequential read at QD 4; `qemu-img bench` over iscsi:// for 4 KiB writes at
QD 16 (scattered offsets: the step is 7919 blocks, so each write lands far
from the last) and 1 MiB sequential reads at QD 4.

Usage: python3 bench/iscsi_peers.py [--seconds 5] [--repeats 3] [--only NAME] [--out FILE]
Needs (scripts/install-deps.sh --test): libiscsi-bin, tgt, qemu-block-extra,
a release build of ferry. Run as root (tgtd).
"""
import argparse, os, re, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import med, version  # noqa: E402
from iscsi_targets import Ferry, Tgt  # noqa: E402

IMAGE_MIB = 1024


def iscsi_perf(url, qd, blocks, seconds, random):
    args = ["iscsi-perf", "-m", str(qd), "-b", str(blocks), "-t", str(seconds)]
    if random:
        args.append("-r")
    out = subprocess.run(args + [url], capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.findall(r"iops average (\d+) \((\d+) MB/s\)", out)
    if not m:
        raise RuntimeError(f"iscsi-perf printed no result:\n{out[-500:]}")
    iops, mbps = m[-1]
    return {"iops": float(iops), "mbps": float(mbps)}


def qemu_bench(url, size, qd, count, write, step=None):
    args = ["qemu-img", "bench", "-f", "raw", "-s", str(size), "-d", str(qd), "-c", str(count)]
    if write:
        args += ["-w", "--pattern=0x5a"]
    if step:
        args += ["-S", str(step)]
    t = time.time()
    out = subprocess.run(args + [url], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    m = re.search(r"Run completed in ([\d.]+) seconds", out.stdout)
    secs = float(m.group(1)) if m else time.time() - t
    return {"iops": count / secs, "mbps": count * size / secs / 1e6}


JOBS = [  # name, runner
    ("4k randread qd16 (iscsi-perf)", lambda u, s: iscsi_perf(u, 16, 8, s, True)),
    ("4k write qd16, scattered (qemu-img bench)", lambda u, s: qemu_bench(u, 4096, 16, 20000 * s, True, 4096 * 7919)),
    ("1M seq read qd4 (iscsi-perf)", lambda u, s: iscsi_perf(u, 4, 2048, s, False)),
    ("1M seq read qd4 (qemu-img bench)", lambda u, s: qemu_bench(u, 1 << 20, 4, 400 * s, False)),
    ("1M seq write qd4 (qemu-img bench)", lambda u, s: qemu_bench(u, 1 << 20, 4, 400 * s, True)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="run only the jobs whose name contains this")
    a = ap.parse_args()
    jobs = [j for j in JOBS if a.only in j[0]]
    for t in ("iscsi-perf", "qemu-img", "tgtd", "tgtadm"):
        if not shutil.which(t):
            sys.exit(f"{t} is required (scripts/install-deps.sh --test)")
    work = tempfile.mkdtemp(prefix="ferry-iscsi-bench-")
    image = os.path.join(work, "image.raw")
    with open(image, "wb") as f:
        for _ in range(IMAGE_MIB):
            f.write(os.urandom(1 << 20))
    kinds = ["ferry", "tgt"]
    res = {j[0]: {k: [] for k in kinds} for j in jobs}
    try:
        for rep in range(a.repeats):
            for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
                d = os.path.join(work, f"{kind}-{rep}")
                os.makedirs(d)
                t = Ferry(d, portals=1) if kind == "ferry" else Tgt(d)
                try:
                    url = t.add("bench", image=image)[0]
                    for name, run in jobs:
                        r = run(url, a.seconds)
                        res[name][kind].append(r)
                        print(f"rep {rep} {kind:6} {name:42} {r['iops']:9.0f} IOPS {r['mbps']:8.1f} MB/s", flush=True)
                finally:
                    t.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [f"Medians of {a.repeats} repeats ({a.seconds} s per iscsi-perf job; qemu-img bench jobs sized to run "
             f"a few seconds), {IMAGE_MIB} MiB image of random data, loopback TCP, 2 cores shared by initiator and "
             f"target. tgt: {version(['tgtd', '--version']) or 'Debian tgt'} with a file-backed LUN (`-b image`). "
             f"Initiators: libiscsi {version(['dpkg-query', '-W', '-f', '${Version}', 'libiscsi-bin'])} (iscsi-perf), "
             f"{version(['qemu-img', '--version'])}. Ratio = ferry / tgt.", "",
             "| job | ferry IOPS | tgt IOPS | ferry MB/s | tgt MB/s | ratio |", "|---|---|---|---|---|---|"]
    for name, _ in jobs:
        r = res[name]
        fi, ti = med(r["ferry"], "iops"), med(r["tgt"], "iops")
        lines.append(f"| {name} | {fi:.0f} | {ti:.0f} | {med(r['ferry'], 'mbps'):.0f} | {med(r['tgt'], 'mbps'):.0f} | "
                     f"**{fi / ti:.2f}** |")
    text = "\n".join(lines)
    print()
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
