"""The steps of a teleport's disk switch, read from the daemons' logs of
a bench run kept with its work directory (`bench/move_soak.py --work
DIR`, `bench/evidence.py --keep-work`), logged with

    FERRY_BENCH_LOG="info,ferry_vm_host=debug,ferry_migration_engine=debug"

For each teleport: the source host's release of its disks (the step's
own milliseconds, `disks released ms=`) and the time from that release
to the source storage daemon's `migration switched` (the disk's last
delta, digest round trip and commit). Prints each list's median and
range.

    python3 bench/pause_steps.py DIR [DIR ...]
"""
import datetime
import os
import re
import statistics
import sys

LOGS = ("ha.log", "hb.log", "sa.log", "sb.log")


def stamp(line):
    return datetime.datetime.fromisoformat(line[:26])


def steps(work):
    """(release ms, release → switched ms) lists of one work directory."""
    events = []
    for name in LOGS:
        path = os.path.join(work, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                if "disks released" in line:
                    m = re.search(r"ms=([0-9.]+)", line)
                    events.append((stamp(line), "released", float(m.group(1)) if m else None))
                elif "migration switched" in line and "ferry_migration_engine::source" in line:
                    events.append((stamp(line), "switched", None))
    events.sort(key=lambda e: e[0])
    release, to_switch, last = [], [], None
    for t, kind, ms in events:
        if kind == "released":
            last = t
            if ms is not None:
                release.append(ms)
        elif last is not None:
            to_switch.append((t - last).total_seconds() * 1e3)
            last = None
    return release, to_switch


def summary(values):
    if not values:
        return "none"
    return f"median {statistics.median(values):.2f} ms ({min(values):.2f}-{max(values):.2f}, n={len(values)})"


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    for work in sys.argv[1:]:
        release, to_switch = steps(work)
        print(f"{work}: release {summary(release)}; release to switched {summary(to_switch)}")


if __name__ == "__main__":
    main()
