"""Seed 003's threshold-triggered move with the database guest: the Debian
guest of scripts/debian-guest.sh (MariaDB) runs at site A with its disk at
site B; a client on this machine runs sysbench oltp_read_write against it
over the guest's network card; the RTT to the disk rises, and
`ferry control run` sees the guest's disk latency stay above its threshold
and moves it by itself, while the client keeps working."""
import threading, time

import matplotlib.pyplot as plt

from evidence_rigs import Controller, journal_events, mark_events


class OltpRounds:
    """sysbench oltp_read_write in rounds of 10 s (a report every second,
    `real_guest.oltp_round`) until stop(): per second, the transactions and
    errors; per round, whether it ended well."""

    def __init__(self, one_round):
        self.one_round = one_round
        self.per_s, self.rounds = [], []
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop_ev.is_set():
            per_s, summary, r = self.one_round()
            self.per_s += per_s
            self.rounds.append({"start": summary["start"], "ok": summary["ok"],
                                "error": "" if r.returncode == 0 else (r.stderr or r.stdout).strip()[-300:]})

    def stop(self):
        self.stop_ev.set()
        self.thread.join(30)


def exp_db_threshold(ctx):
    """Seed 003's threshold-triggered move, on the database guest."""
    import real_guest as rg
    rg.require_guest("sysbench", "mariadb", "qemu-system-x86_64")
    before_s, total_s, rtt_hi = (20, 70, 16) if ctx.quick else (40, 160, 16)
    ctl, clients, boot = None, None, None
    events = []
    work = ctx.sub("db_threshold")
    with rg.guest_sites(work, 1000, 0) as (sa, sb, A, B, link):
        try:
            nbd_name, nbd_wan, boot = rg.remote_db_guest(A, sb, link, "db_threshold")
            moves_name, moves_b = link.proxy(f"127.0.0.1:{B.moves}")
            mig_b_name, mig_b = link.proxy(f"127.0.0.1:{sb.mig}")
            mig_a_name, mig_a = link.proxy(f"127.0.0.1:{sa.mig}")
            inv = {"sites": [
                {"name": "a", "cpu_capacity": 8,
                 "hosts": [{"control": f"127.0.0.1:{A.control}", "moves": f"127.0.0.1:{A.moves}"}],
                 "storage": [{"nbd": f"127.0.0.1:{sa.nbd}", "migrate": f"127.0.0.1:{mig_a}",
                              "admin": f"127.0.0.1:{sa.admin}"}]},
                {"name": "b", "cpu_capacity": 8,
                 "hosts": [{"control": f"127.0.0.1:{B.control}", "moves": f"127.0.0.1:{moves_b}"}],
                 "storage": [{"nbd": f"127.0.0.1:{nbd_wan}", "nbd_local": f"127.0.0.1:{sb.nbd}",
                              "migrate": f"127.0.0.1:{mig_b}", "admin": f"127.0.0.1:{sb.admin}"}]}],
                "links": [{"a": "a", "b": "b", "rtt_ms": rtt_hi, "bandwidth": 125e6}]}
            ctl = Controller(work, inv)
            pol = ctl.policy()
            pol.update(latency_trigger_ms=5.0, hold_s=6.0, paused=False)
            ctl.put_policy(pol)
            clients = OltpRounds(rg.oltp_round)
            t0 = time.time()
            raised = False
            while time.time() - t0 < total_s:
                if not raised and time.time() - t0 >= before_s:
                    for name in (nbd_name, moves_name, mig_b_name, mig_a_name):
                        link.set_rtt(name, rtt_hi)
                    raised = True
                    events.append({"t": time.time() - t0, "what": f"RTT to the disk raised to {rtt_hi} ms"})
                time.sleep(0.5)
            clients.stop()
            events += journal_events(ctl.journal(), t0)
            where = next((h for h in (A, B) if h.vm("show", "db", "--json").returncode == 0), None)
            if where is not None:
                where.vm("stop", "db")
        finally:
            if clients is not None:
                clients.stop()
            if ctl is not None:
                ctl.stop()
    per_s = [dict(p, t=p["t"] - t0) for p in clients.per_s]
    rounds = [dict(r, start=r["start"] - t0) for r in clients.rounds]
    return db_threshold_report(ctx, per_s, rounds, events, before_s, total_s, rtt_hi, boot)


def db_threshold_report(ctx, per_s, rounds, events, before_s, total_s, rtt_hi, boot):
    """The figure, table and text of `db_threshold` from its measurements."""
    def mean_over(t1, t2):
        pts = [p["tps"] for p in per_s if t1 <= p["t"] <= t2]
        return sum(pts) / len(pts) if pts else float("nan")
    dec = [e for e in events if e["what"].startswith("decided")]
    fin = [e for e in events if e["what"].startswith("finished")]
    end_move = fin[0]["t"] if fin else None
    r0 = mean_over(5, before_s)
    r1 = mean_over(before_s + 2, dec[0]["t"] if dec else total_s)
    r2 = mean_over(end_move + 5, total_s) if end_move else float("nan")
    failed = [r for r in rounds if not r["ok"]]
    errors = sum(p["err"] for p in per_s)
    reconnects = sum(p["reconn"] for p in per_s)
    # The longest time without a transaction from the move's start to ten
    # seconds after its end: between two seconds that had some (a round
    # that could not connect reports no seconds at all).
    started = next((e["t"] for e in events if e["what"].startswith("started")), None)
    stall = 0.0
    if started is not None:
        busy = [p["t"] for p in sorted(per_s, key=lambda p: p["t"]) if p["tps"] > 0]
        last = max((t for t in busy if t <= started), default=started)
        until = (end_move if end_move is not None else total_s) + 10
        for t in busy:
            if t <= started:
                continue
            # A second reported at t covers (t - 1, t].
            stall = max(stall, t - 1 - last)
            last = t
            if t > until:
                break
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot([p["t"] for p in per_s], [p["tps"] for p in per_s], "-", lw=1,
            label="sysbench oltp_read_write transactions per second (client outside the guest)")
    mark_events(ax, events, rtt_hi, max((p["tps"] for p in per_s), default=1))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("transactions / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Threshold-triggered move of the database guest by `ferry control run` (seed 003)", fontsize=9)
    fig.tight_layout()
    fig.savefig(ctx.png("db_threshold"), dpi=110)
    plt.close(fig)

    table = ["| t (s) | event |", "|---|---|"] + [f"| {e['t']:.1f} | {e['what']} |"
                                                  for e in sorted(events, key=lambda e: e["t"])]
    table += ["", f"Transactions per second: {r0:.1f} with the disk across 0 ms, {r1:.1f} across {rtt_hi} ms "
                  f"before the move, {r2:.1f} after it. Client rounds that failed: {len(failed)} of {len(rounds)}; "
                  f"errors {errors:.0f}, reconnects {reconnects:.0f}; the client's longest time without a transaction "
                  f"from the move's start to 10 s after its end: {stall:.0f} s."]
    for r in failed:
        table.append(f"- round at {r['start']:.0f} s failed: `{r['error'][-160:]}`")
    ours = (f"The RTT to the database guest's disk rose to {rtt_hi} ms at {before_s} s; the controller decided "
            f"{dec[0]['t'] - before_s:.0f} s later ({dec[0]['what'].split(': ', 1)[1].split(' (')[0]}) and the move "
            f"ended at {end_move:.0f} s. The client's transactions went {r0:.1f} → {r1:.1f} → {r2:.1f} per second; "
            f"{len(failed)} of its {len(rounds)} rounds failed, {errors:.0f} errors, {reconnects:.0f} reconnects; "
            f"its longest time without a transaction around the move: {stall:.0f} s."
            if dec and end_move else "The controller did not complete a move within the run (see the table).")
    return {
        "title": "Threshold-triggered move of the database guest, decided by the controller (seed 003)",
        "seed": "Seed 003 migrates a VM (vMotion) when a monitored threshold is crossed; VMware Storage DRS acts on "
                "15 ms of I/O latency at the 90th percentile, OpenStack Watcher on 25% CPU over 300 s. None of them "
                "looks at the RTT to the disk.",
        "ours": ours,
        "table": table,
        "conditions": "Two sites on loopback joined by toxiproxy (1 Gbit/s); the Debian guest (512 MiB, TCG, "
                      "MariaDB; scripts/debian-guest.sh) at site A booted from its disk at site B, its card on a "
                      "bridge of this machine that both sites' hosts plug it into; sysbench oltp_read_write (one "
                      "thread, 10 s rounds) from this machine. `ferry control run --interval 2s --sample 1s`, "
                      "thresholds policy (latency_trigger_ms 5, hold_s 6), locality on. The RTT of the whole link "
                      f"is raised to {rtt_hi} ms at {before_s} s. Guest booted and configured in "
                      f"{boot or 0:.0f} s.",
        "raw": {"per_s": per_s, "rounds": rounds, "events": events, "before_s": before_s, "total_s": total_s,
                "rtt_hi": rtt_hi, "boot_s": boot},
    }


def db_threshold_redraw(ctx, raw):
    return db_threshold_report(ctx, raw["per_s"], raw["rounds"], raw["events"], raw["before_s"], raw["total_s"],
                               raw["rtt_hi"], raw.get("boot_s"))
