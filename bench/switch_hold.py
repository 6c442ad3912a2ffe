#!/usr/bin/env python3
"""A volume moved back and forth between two storage daemons, no guest:
the hold of each switch (the report's `pause_ms`: from the source's writes
held to their release) and each move's time, and their medians. Every move after the first is a
tracked return (little to send), so the hold is what is left: the last
round trip, the destination's commit and whatever the source does before
it lets the writes go.

    python3 bench/switch_hold.py [--moves 24] [--rtt 8] [--mbit 200]

With `FERRY_BIN` naming another build the same command A/B-compares a
change to the hold. The daemons log the pause's steps at debug level
(kept in --work: a.log, b.log); from them the run also prints how long
each switch waited inside the pause for its journal of `switch_sent`,
and the time from the switch's start to `Switch` (all of which a
teleport's stopped guest waits for).
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FERRY_BENCH_LOG", "info,ferry_migration_engine=debug")
from common import ensure_ferry  # noqa: E402
from migration_peers import Daemon, Link  # noqa: E402
from vm_peers import trust  # noqa: E402


def write_blocks(site, blocks):
    """`blocks` writes of 4 KiB at random places of the volume, through the
    site's NBD export, each flushed as a guest's record is."""
    src = os.path.join(os.path.dirname(site.log), "block")
    cmds = []
    for i in range(blocks):
        with open(f"{src}{i}", "wb") as f:
            f.write(os.urandom(4096))
        cmds += ["-c", f"write -s {src}{i} {random.randrange(128 << 8) << 12} 4k", "-c", "flush"]
    subprocess.run(["qemu-io", "-f", "raw", *cmds, f"nbd://127.0.0.1:{site.nbd}/vm"],
                   check=True, stdout=subprocess.DEVNULL)


STEP = re.compile(r"pause: (digest groups hashed|writers drained|last chunks queued, digest computed"
                  r"|switch journalled) elapsed=([0-9.]+)(µs|ms|s)\b")


def journal_steps(logs):
    """Per switch in the sources' debug lines: (the journal's wait inside
    the pause, the switch's start to `Switch`), in ms. The hashing,
    the journal and `Switch` are timed from the switch's start; the drain
    and the last chunks each from their own."""
    scale = {"µs": 1e-3, "ms": 1.0, "s": 1e3}
    out = []
    for path in logs:
        step = {}
        with open(path) as f:
            for line in f:
                m = STEP.search(line)
                if not m:
                    continue
                step[m.group(1)] = float(m.group(2)) * scale[m.group(3)]
                if m.group(1) == "switch journalled" and len(step) == 4:
                    held = (step["digest groups hashed"] + step["writers drained"]
                            + step["last chunks queued, digest computed"])
                    out.append((max(0.0, step["switch journalled"] - held), max(held, step["switch journalled"])))
                    step = {}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moves", type=int, default=24)
    ap.add_argument("--rtt", type=int, default=8)
    ap.add_argument("--mbit", type=float, default=200)
    ap.add_argument("--data-mib", type=int, default=48, help="random data in the 128 MiB volume")
    ap.add_argument("--gap", type=float, default=1.0,
                    help="seconds between moves (the destination indexes an arrived volume in the "
                         "background; a return before that reads what it would take from the index)")
    ap.add_argument("--write-kib", type=int, default=0,
                    help="before each move, write this much in 4 KiB blocks at random places over NBD "
                         "(qemu-io), as a guest's records between moves")
    ap.add_argument("--work", default="/tmp/ferry-switch-hold", help="state and logs (emptied first, kept after)")
    a = ap.parse_args()
    ensure_ferry()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    pa, pb = os.path.join(a.work, "a"), os.path.join(a.work, "b")
    trust(pa, pb)
    img = os.path.join(a.work, "img")
    with open(img, "wb") as f:
        f.write(os.urandom(a.data_mib << 20))
        f.truncate(128 << 20)
    sites = [Daemon(pa, migrate=True), Daemon(pb, migrate=True)]
    link = Link(a.work, a.mbit, a.rtt)
    holds, times = [], []
    try:
        sites[0].ferry("volume", "create", "vm", "--size", str(128 << 20))
        sites[0].ferry("volume", "import", "vm", img)
        ports = [link.proxy(f"127.0.0.1:{d.mig}")[1] for d in sites]
        at = 0
        for i in range(a.moves):
            to = 1 - at
            if a.write_kib:
                write_blocks(sites[at], a.write_kib // 4)
            r = json.loads(sites[at].ferry("migrate", "vm", "--to", f"127.0.0.1:{ports[to]}", "--json"))
            if r["result"] != "switched":
                raise SystemExit(f"move {i + 1} did not switch: {r.get('error')}")
            hold = r["time"]["pause_ms"]
            # The first move sends the data: its hold is not a return's.
            if i > 0:
                holds.append(hold)
                times.append(r["time"]["total_s"])
            print(f"move {i + 1}: site {'AB'[at]} -> {'AB'[to]}: hold {hold:.1f} ms, "
                  f"{r['time']['total_s']:.3f} s, copy {r['destination_copy']}", flush=True)
            at = to
            time.sleep(a.gap)
    finally:
        for d in sites:
            d.stop()
        link.close()
    if holds:
        print(f"hold ms over {len(holds)} returns: median {statistics.median(holds):.1f}, "
              f"{min(holds):.1f}-{max(holds):.1f}; time s: median {statistics.median(times):.3f}, "
              f"{min(times):.3f}-{max(times):.3f}")
    steps = journal_steps([d.log for d in sites])
    if steps:
        wait, to_switch = [s[0] for s in steps], [s[1] for s in steps]
        print(f"journal's wait in the pause ms over {len(steps)} switches: median {statistics.median(wait):.2f}, "
              f"{min(wait):.2f}-{max(wait):.2f}; switch start to Switch ms: median "
              f"{statistics.median(to_switch):.2f}, {min(to_switch):.2f}-{max(to_switch):.2f}")


if __name__ == "__main__":
    main()
