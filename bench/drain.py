#!/usr/bin/env python3
"""Draining a site of N guests with `ferry control run`: one move at a time
against moves side by side.

Three sites: `a` and `b` run guests (a `ferry host` each), `c` holds their
disks (a `ferry serve`, no CPUs). Every guest (busybox under TCG, 128 MiB)
starts at `a`. Putting a site in maintenance makes the controller move each
guest off it, VM only, to the other site (disks stay at `c`); the guests
then go back the other way for the next run. The hosts' move listeners are
reached through toxiproxy (one proxy per host, `--rtt` ms of round trip;
toxiproxy caps each connection at `--mbit`, so the moves do not share
one bottleneck: the machine's cores are what they share).

Runs alternate between `serial` (max_moves_per_link, max_moves_per_site and
max_moves_per_host = 1: how the controller moved guests before it ran moves
side by side) and `side by side` (all three limits = N). For each run: the wall time from the
maintenance switch to the last guest's arrival, and the sum of the single
moves' own times. After the runs, `ferry control simulate --replay` of the
controller's own measurement taken just before the first side-by-side drain
predicts that drain.

    python3 bench/drain.py [--guests 8] [--repeats 2] [--rtt 20] [--mbit 200]

Results: printed as JSON, and with --md, as the rows docs/benchmarks.md holds.
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
from common import FERRY, ensure_ferry  # noqa: E402
from migration_peers import Daemon, Link, http  # noqa: E402
from vm_peers import GUEST, Host, test_guest, trust, wait_acks  # noqa: E402
from evidence_rigs import Controller, ext4_volume  # noqa: E402


def finished(api, since):
    """Completed moves journaled after `since` (unix), their outcomes."""
    out = []
    for e in json.loads(http("GET", api + "/v1/journal?limit=500")):
        if e["event"] == "finished" and e["at_unix"] >= since:
            out.append((e["at_unix"], e["outcome"]))
    return out


def drain(api, policy, site, limit, n, timeout):
    """Put `site` in maintenance with both limits at `limit`; wait for `n`
    completed moves. (wall seconds, [outcomes], failures)."""
    pol = dict(policy, maintenance=[site], max_moves_per_link=limit, max_moves_per_site=limit,
               max_moves_per_host=limit, paused=False)
    t0 = time.time()
    http("PUT", api + "/v1/policy", pol)
    while time.time() - t0 < timeout:
        done = finished(api, t0)
        ok = [(t, o) for t, o in done if o["result"] == "completed"]
        if len(ok) >= n:
            break
        time.sleep(0.5)
    done = finished(api, t0)
    ok = [(t, o) for t, o in done if o["result"] == "completed"]
    # Paused again so that nothing moves while the next run is set up.
    http("PUT", api + "/v1/policy", dict(pol, maintenance=[], paused=True))
    if len(ok) < n:
        raise RuntimeError(f"only {len(ok)} of {n} guests left {site} in {timeout} s: {done}")
    wall = max(t for t, _ in ok) - t0
    outs = [o for _, o in ok]
    return wall, outs, len(done) - len(ok)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--rtt", type=int, default=20, help="round trip of the link between a and b (ms)")
    ap.add_argument("--mbit", type=float, default=200.0, help="bandwidth of that link")
    ap.add_argument("--md", action="store_true", help="also print markdown rows")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, snapshot)")
    a = ap.parse_args()
    ensure_ferry()
    if not os.path.exists(os.path.join(GUEST, "vmlinuz")):
        sys.exit(f"{GUEST}/vmlinuz missing: run scripts/guest-image.sh")
    work = tempfile.mkdtemp(prefix="ferry-drain-")
    n = a.guests
    pc, ha, hb = (os.path.join(work, d) for d in ("sc", "ha", "hb"))
    for d in (ha, hb):
        os.makedirs(d)
    trust(ha, hb)
    sc = Daemon(pc, migrate=True)
    link = Link(work, a.mbit, a.rtt)
    hosts, ctl = [], None
    try:
        A, B = Host(ha), Host(hb)
        hosts = [A, B]
        _, moves_a = link.proxy(f"127.0.0.1:{A.moves}")
        _, moves_b = link.proxy(f"127.0.0.1:{B.moves}")
        nbd, admin = f"127.0.0.1:{sc.nbd}", f"127.0.0.1:{sc.admin}"
        serials = []
        for i in range(n):
            ext4_volume(sc, work, f"g{i}", mib=32)
            serials.append(test_guest(A, f"g{i}", f"g{i}", nbd, admin))
        for s in serials:
            wait_acks(s, 2, secs=300)
        host = lambda h, m: {"control": f"127.0.0.1:{h.control}", "moves": f"127.0.0.1:{m}"}  # noqa: E731
        inv = {"sites": [
            {"name": "a", "cpu_capacity": 64, "hosts": [host(A, moves_a)], "storage": []},
            {"name": "b", "cpu_capacity": 64, "hosts": [host(B, moves_b)], "storage": []},
            {"name": "c", "cpu_capacity": 0, "hosts": [],
             "storage": [{"nbd": nbd, "migrate": f"127.0.0.1:{sc.mig}", "admin": admin}]}],
            "links": [{"a": "a", "b": "b", "rtt_ms": a.rtt, "bandwidth": a.mbit * 125e3},
                      {"a": "a", "b": "c", "rtt_ms": 0.2, "bandwidth": 1.25e9},
                      {"a": "b", "b": "c", "rtt_ms": 0.2, "bandwidth": 1.25e9}]}
        snap, snap_site = os.path.join(work, "snapshot.json"), None
        ctl = Controller(work, inv)
        api = ctl.api
        policy = ctl.policy()
        # Moves are forced by the drain; locality would move nothing here.
        policy.update(locality=False, cooldown_s=0.0)
        runs = []
        at = "a"
        for r in range(a.repeats):
            for mode, limit in (("serial", 1), ("side by side", n)):
                if mode == "side by side" and snap_site is None:
                    # The controller's own last measurement, taken just
                    # before it drains side by side: what the replay starts
                    # from (a snapshot right after boot priced the guests'
                    # memory as it was while they booted).
                    t0 = time.time()
                    while True:
                        cluster = json.loads(http("GET", api + "/v1/status"))["cluster"] or {}
                        here = [v for v in cluster.get("vms", [])
                                if v["placement"]["host_site"] == at]
                        if len(here) == n or time.time() - t0 > 60:
                            break
                        time.sleep(1)
                    with open(snap, "w") as f:
                        json.dump(cluster, f)
                    snap_site = at
                wall, outs, failed = drain(api, policy, at, limit, n, timeout=60 * n)
                secs = [o["seconds"] for o in outs]
                runs.append({"mode": mode, "from": at, "wall_s": wall, "sum_of_moves_s": sum(secs),
                             "longest_move_s": max(secs), "failed_moves": failed,
                             "link_mb": sum(o["bytes"] for o in outs) / 1e6,
                             "predicted_link_mb": sum(o["predicted_bytes"] for o in outs) / 1e6,
                             "predicted_sum_of_moves_s": sum(o["predicted_seconds"] for o in outs)})
                print(json.dumps(runs[-1]), flush=True)
                at = "b" if at == "a" else "a"
        # The simulator's prediction of the same drain from the snapshot.
        pol_file = os.path.join(work, "policy.json")
        with open(pol_file, "w") as f:
            json.dump(dict(policy, maintenance=[snap_site], max_moves_per_link=n, max_moves_per_site=n,
                           max_moves_per_host=n, paused=False), f)
        rep = subprocess.run([FERRY, "control", "simulate", "--replay", snap, "--policy", pol_file,
                              "--tick-s", "1", "--ticks", "600", "--json"],
                             capture_output=True, text=True, check=True)
        moves = json.loads(rep.stdout)["moves"]
        predicted = max(m["ends_s"] for m in moves) if moves else None
    finally:
        if ctl is not None:
            ctl.stop()
        for h in hosts:
            h.stop()
        sc.stop()
        link.close()
        if a.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    med = lambda mode, k: statistics.median(r[k] for r in runs if r["mode"] == mode)  # noqa: E731
    summary = {"guests": n, "rtt_ms": a.rtt, "mbit": a.mbit, "runs": runs,
               "serial_wall_s": med("serial", "wall_s"), "side_by_side_wall_s": med("side by side", "wall_s"),
               "sum_of_single_moves_s": med("serial", "sum_of_moves_s"),
               "replay_predicted_s": predicted, "replay_moves": len(moves),
               "link_mb_per_drain": med("side by side", "link_mb"),
               "predicted_link_mb_per_drain": med("side by side", "predicted_link_mb")}
    summary["speedup_vs_serial"] = summary["serial_wall_s"] / summary["side_by_side_wall_s"]
    summary["speedup_vs_sum"] = summary["sum_of_single_moves_s"] / summary["side_by_side_wall_s"]
    print(json.dumps(summary, indent=1))
    if a.md:
        print(f"| {n} guests, {a.rtt} ms, {a.mbit:.0f} Mbit/s | {summary['sum_of_single_moves_s']:.1f} "
              f"| {summary['serial_wall_s']:.1f} | {summary['side_by_side_wall_s']:.1f} "
              f"| {summary['speedup_vs_sum']:.2f}× | {predicted:.0f} |")


if __name__ == "__main__":
    main()
