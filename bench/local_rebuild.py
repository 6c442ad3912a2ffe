#!/usr/bin/env python3
"""A storage-only move whose destination already holds the volume's blocks
(a sibling volume made of the same image): how long the local rebuild
takes, and each daemon's CPU, with no link limit, so that the rebuild is
all there is to see.

The image is `--gib` GiB of random data; the source's volume is that image
and 64 MiB more the destination lacks. Both daemons' pools are made in
`--dir`: put it on the file system to measure (on XFS with reflink or
btrfs the destination shares the found blocks' extents instead of
writing them). `--base B --image I` move image I to a destination that
holds image B instead (real OS images from bench/similarity.sh, whose
shared blocks lie in another order: runs break where they part). Page
cache dropped before each move. With several
binaries (`--bin A --bin B`) the moves alternate between them, each
`--repeats` times, and the medians are printed side by side.

  python3 bench/local_rebuild.py --dir /mnt/xfs [--gib 2] [--repeats 3] [--bin OLD --bin NEW]
  python3 bench/local_rebuild.py --dir DIR --base /tmp/ferry-similarity/min.img \
      --image /tmp/ferry-similarity/lamp.img [--bin OLD --bin NEW]
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
import common  # noqa: E402
from evidence_rigs import cpu_seconds  # noqa: E402
from migration_peers import Daemon  # noqa: E402
from vm_peers import trust  # noqa: E402


def fs_type(path):
    return subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path], capture_output=True, text=True).stdout.strip()


def one_move(binary, work, base, image):
    """One move with `binary`; (seconds, source CPU s, destination CPU s, report)."""
    pa, pb = os.path.join(work, "a"), os.path.join(work, "b")
    for p in (pa, pb):
        shutil.rmtree(p, ignore_errors=True)
    trust(pa, pb)
    src, dst = Daemon(pa, binary=binary), Daemon(pb, migrate=True, binary=binary)
    try:
        dst.ferry("volume", "create", "base", "--size", str(os.path.getsize(base)))
        dst.ferry("volume", "import", "base", base)
        src.ferry("volume", "create", "vm", "--size", str(os.path.getsize(image)))
        src.ferry("volume", "import", "vm", image)
        dst.wait_indexed("base")
        src.wait_indexed("vm")
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        c0 = cpu_seconds(src.proc.pid), cpu_seconds(dst.proc.pid)
        t = time.time()
        rep = json.loads(src.ferry("migrate", "vm", "--to", f"127.0.0.1:{dst.mig}", "--json"))
        secs = time.time() - t
        c1 = cpu_seconds(src.proc.pid), cpu_seconds(dst.proc.pid)
        if rep.get("result") != "switched" or not rep.get("digest", {}).get("matches"):
            raise RuntimeError(f"the move did not switch with matching digests: {rep}")
        return secs, c1[0] - c0[0], c1[1] - c0[1], rep
    finally:
        src.stop()
        dst.stop()
        for p in (pa, pb):
            shutil.rmtree(p, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="where the pools are made (the file system measured)")
    ap.add_argument("--gib", type=float, default=2)
    ap.add_argument("--base", help="the image the destination holds (with --image; instead of --gib)")
    ap.add_argument("--image", help="the image moved")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bin", action="append", help="ferry binaries to alternate (default: this tree's release build)")
    a = ap.parse_args()
    bins = a.bin or [common.FERRY]
    for b in bins:
        if not os.path.exists(b):
            sys.exit(f"{b} missing")
    if bool(a.base) != bool(a.image):
        sys.exit("--base and --image go together")
    work = tempfile.mkdtemp(prefix="ferry-rebuild-", dir=a.dir)
    images = tempfile.mkdtemp(prefix="ferry-rebuild-images-")
    base, image = a.base or os.path.join(images, "base.img"), a.image or os.path.join(images, "image.img")
    try:
        if not a.base:
            with open(base, "wb") as f:
                for _ in range(int(a.gib * 1024)):
                    f.write(os.urandom(1 << 20))
            shutil.copyfile(base, image)
            with open(image, "ab") as f:
                for _ in range(64):
                    f.write(os.urandom(1 << 20))
        runs = {b: [] for b in bins}
        for i in range(a.repeats):
            for b in bins:
                secs, s, d, rep = one_move(b, work, base, image)
                runs[b].append((secs, s, d, (rep.get("chunks") or {}).get("local", 0)))
                print(json.dumps({"bin": b, "repeat": i, "seconds": round(secs, 2), "source_cpu_s": s,
                                  "destination_cpu_s": d, "chunks": rep.get("chunks")}), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(images, ignore_errors=True)
    what = (f"{os.path.basename(image)} moved to a destination holding {os.path.basename(base)}" if a.base
            else f"{a.gib:g} GiB held at the destination, 64 MiB lacking")
    print(f"{what}; pools on {fs_type(a.dir)} ({a.dir}); medians of {a.repeats}\n")
    print("| binary | move s | source CPU s | destination CPU s | every move s | chunks found here |")
    print("|---|---|---|---|---|---|")
    for b in bins:
        xs = runs[b]
        med = [statistics.median(x[k] for x in xs) for k in range(4)]
        print(f"| {b} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {' / '.join(f'{x[0]:.2f}' for x in xs)} "
              f"| {med[3]:.0f} |")


if __name__ == "__main__":
    main()
