#!/usr/bin/env python3
"""Move the test guest back and forth between two sites until a move
fails or N moves are done: a soak for the rare failure one move in a
hundred shows, which no single test run finds.

Two storage daemons and two host daemons on this machine, every move
through toxiproxy (20 ms RTT, 400 Mbit/s by default); the guest is the
test guest (`scripts/guest-image.sh`) writing records on an ext4 volume.
The host daemons log at info level, so each memory stream's end (bytes
sent at the source, bytes handed to QEMU at the destination) is in
their logs, kept in --work.

    python3 bench/move_soak.py --moves 40
    python3 bench/move_soak.py --moves 12 --teleport
    python3 bench/move_soak.py --moves 12 --disk-only   # the guest stays at A, its disk goes back and forth

Each move's pause (QEMU's STOP to RESUME; for a disk-only move the hold
of the guest's writes at the switch) and QEMU's own downtime are
printed with it, and their medians and ranges at the end: with
`FERRY_BIN` naming another build, the same run A/B-compares a change to
the pause (the model check gives three pauses of each kind a run).

It found the memory stream's lost tail (2026-11-27): the fourth VM-only
move failed with the destination's QEMU reading zeros where a page
header belonged, its link having ended 1.95 MB short of what the source
sent; ARCHITECTURE.md, "Invariants".
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FERRY_BENCH_LOG", "info")
import vm_peers  # noqa: E402
from common import ensure_ferry  # noqa: E402
from migration_peers import Link  # noqa: E402


def ext4_image(path, mib):
    subprocess.run(["truncate", "-s", f"{mib}M", path], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", path], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moves", type=int, default=40)
    ap.add_argument("--teleport", action="store_true", help="move the disk with the guest each time")
    ap.add_argument("--disk-only", action="store_true",
                    help="move the disk alone, the guest staying at site A (every move after the first a return)")
    ap.add_argument("--rtt", type=int, default=20)
    ap.add_argument("--mbit", type=float, default=400)
    ap.add_argument("--max-downtime", help="the move's longest pause allowed (`ferry vm migrate --max-downtime`, "
                                           "e.g. 100ms); its default if not given")
    ap.add_argument("--work", default="/tmp/ferry-move-soak", help="state and logs (emptied first, kept after)")
    a = ap.parse_args()
    ensure_ferry()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    image = os.path.join(a.work, "root.img")
    ext4_image(image, 256)
    link = Link(a.work, a.mbit, a.rtt)
    sa, sb, ha, hb = vm_peers.two_sites(a.work)
    hosts = []
    failed = None
    pauses, downtimes, times = [], [], []
    try:
        sa.ferry("volume", "create", "root", "--size", str(os.path.getsize(image)))
        sa.ferry("volume", "import", "root", image)
        hosts = [vm_peers.Host(ha), vm_peers.Host(hb)]
        sites = list(zip(hosts, (sa, sb)))
        mem = [link.proxy(f"127.0.0.1:{h.moves}")[1] for h in hosts]
        disk = [link.proxy(f"127.0.0.1:{s.mig}")[1] for s in (sa, sb)]
        serial = vm_peers.test_guest(hosts[0], "g", "root", f"127.0.0.1:{sa.nbd}", f"127.0.0.1:{sa.admin}",
                                     "256M", "tcg", vm_peers.cmdline("idle"))
        vm_peers.wait_acks(serial, 20)
        at = 0
        for i in range(a.moves):
            to = 1 - at
            storage = ["--to-storage", f"127.0.0.1:{disk[to]}", "--to-storage-admin", f"127.0.0.1:{sites[to][1].admin}"]
            if a.disk_only:
                args = ["migrate", "g", *storage, "--json"]
            else:
                args = ["migrate", "g", "--to-host", f"127.0.0.1:{mem[to]}", "--json"]
            if a.max_downtime:
                args += ["--max-downtime", a.max_downtime]
            if a.teleport:
                args += ["--with-disk", *storage]
            t = time.time()
            # A disk-only move is asked of the host the guest stays at.
            r = sites[0 if a.disk_only else at][0].vm(*args)
            try:
                rep = json.loads(r.stdout)
            except ValueError:
                rep = {"result": "error", "reason": r.stderr.strip()[-500:]}
            pause = rep.get("disk_pause_ms") if a.disk_only else rep.get("guest_pause_ms")
            qemu = rep.get("downtime_ms_qemu")
            print(f"move {i + 1}: site {'AB'[at]} -> {'AB'[to]}: {rep.get('result')} in {time.time() - t:.1f} s"
                  + (f", pause {pause:.1f} ms (QEMU's downtime {qemu} ms)" if pause is not None else "")
                  + (f" ({rep.get('reason')})" if rep.get("reason") else ""), flush=True)
            if r.returncode != 0 or rep.get("result") != "completed":
                failed = i + 1
                break
            at = to
            if pause is not None:
                pauses.append(pause)
                downtimes.append(qemu or 0)
                times.append(rep.get("total_s") or 0)
            time.sleep(2)
    finally:
        for h in hosts:
            h.stop()
        for d in (sa, sb):
            if d.proc.poll() is None:
                d.stop()
        link.close()
    if pauses:
        print(f"pause ms: median {statistics.median(pauses):.1f}, {min(pauses):.1f}-{max(pauses):.1f}; "
              f"QEMU's downtime ms: median {statistics.median(downtimes):.0f}, {min(downtimes)}-{max(downtimes)}; "
              f"move s: median {statistics.median(times):.3f}, {min(times):.3f}-{max(times):.3f} (n={len(pauses)})")
    print(f"{a.moves if failed is None else failed - 1} moves completed"
          + ("" if failed is None else f"; move {failed} failed (logs: {a.work}/ha.log, hb.log)"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
