"""Seeds 000/001 Figs. 11-12 redone on the real guest: a database guest
whose disk is at the other site either runs its job across the link, or
is first moved (VM only, memory across the link) to the site of its disk
and runs there. The guest is the Debian image of scripts/debian-guest.sh
(MariaDB), managed by two `ferry host`s on a bridge of this machine; the
job is a fixed number of sysbench oltp_read_write transactions from this
machine over the guest's network card."""
import json, subprocess, time

import matplotlib.pyplot as plt


def exp_db_move_then_run(ctx):
    """Seeds 000/001, Figs. 11-12 with the database guest."""
    import real_guest as rg
    rg.require_guest("sysbench", "mariadb", "qemu-system-x86_64")
    rtts = [8] if ctx.quick else [2, 4, 8, 16]
    n = 30 if ctx.quick else 300
    mbit = 1000
    rows, boot = [], None
    with rg.guest_sites(ctx.sub("db_move_then_run"), mbit, rtts[0]) as (sa, sb, A, B, link):
        # At site A, its disk at B's storage across the link.
        nbd_name, nbd_wan, boot = rg.remote_db_guest(A, sb, link, "db_move_then_run")
        mb_name, moves_b = link.proxy(f"127.0.0.1:{B.moves}")
        ma_name, moves_a = link.proxy(f"127.0.0.1:{A.moves}")

        def job(events):
            """Wall time of `events` transactions."""
            t = time.time()
            subprocess.run([*rg.SYSBENCH, f"--events={events}", "--time=0", "run"], check=True,
                           capture_output=True)
            return time.time() - t

        def move(host, to, disk):
            t = time.time()
            r = host.vm("migrate", "db", "--to-host", f"127.0.0.1:{to}", "--disk-server", f"db=127.0.0.1:{disk}",
                        "--json")
            if r.returncode != 0:
                raise RuntimeError(f"move failed: {r.stdout} {r.stderr}")
            return time.time() - t, json.loads(r.stdout)

        job(max(5, n // 10))  # warms MariaDB's buffer pool
        for rtt in rtts:
            for p in (nbd_name, mb_name, ma_name):
                link.set_rtt(p, rtt)
            remote_s = job(n)
            move_s, rep = move(A, moves_b, sb.nbd)
            local_s = job(n)
            rows.append({"rtt_ms": rtt, "remote_s": remote_s, "move_s": move_s, "local_s": local_s,
                         "pause_ms": rep.get("guest_pause_ms"), "memory_link": rep["bytes"]["memory_link"]})
            print(f"db_move_then_run {rtt} ms: remote {remote_s:.1f} s, move {move_s:.1f} s + local {local_s:.1f} s",
                  flush=True)
            # Back to A, the disk across the link again, for the next RTT.
            move(B, moves_a, nbd_wan)
        A.vm("stop", "db")
    return db_move_then_run_report(ctx, rows, n, mbit, boot)


def move_then_run_figure(png, rows, guest, job, suptitle=None):
    """Seeds 000/001 Figs. 11-12 drawn from `rows` (rtt_ms, remote_s,
    move_s, local_s, pause_ms, memory_link; a row with `failed` is a move
    after which the guest did not go on): the move's time against the
    seed's, and the job's time remote against moving first. Returns the
    table."""
    ok = [r for r in rows if "failed" not in r]
    failed = [r for r in rows if "failed" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["rtt_ms"] for r in ok]
    axes[0].plot(xs, [r["move_s"] for r in ok], "o-", label=f"ferry: VM-only move ({guest})")
    if failed:
        axes[0].plot([r["rtt_ms"] for r in failed], [r["move_s"] for r in failed], "rx", ms=10,
                     label="guest crashed after the move")
    axes[0].plot([1, 2, 4, 16], [21, 21, 21, 52], "s", color="grey", label="seed: 21 s (1-4 ms), 52 s (16 ms)")
    axes[0].set_xlabel("RTT between the sites (ms)")
    axes[0].set_ylabel("migration time (s)")
    axes[0].set_title("Migration time (seeds 000/001, Fig. 11)", fontsize=9)
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=.3)
    axes[1].plot(xs, [r["remote_s"] for r in ok], "o-", label="run with the disk remote")
    axes[1].plot(xs, [r["move_s"] + r["local_s"] for r in ok], "s-", label="move the VM to the disk, then run")
    axes[1].set_xlabel("RTT between the sites (ms)")
    axes[1].set_ylabel(f"time for {job} (s)")
    axes[1].set_title("Execution time (seeds 000/001, Fig. 12)", fontsize=9)
    axes[1].set_ylim(bottom=0)
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=.3)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    table = ["| RTT ms | run remote s | VM move s | run after the move s | move + run s | pause ms | memory MB on the link |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        pause = f"{r['pause_ms']:.0f}" if r.get("pause_ms") is not None else "-"
        if "failed" in r:
            table.append(f"| {r['rtt_ms']} | {r['remote_s']:.1f} | {r['move_s']:.1f} | guest crashed at B: "
                         f"`{r['failed']}` | - | {pause} | {r['memory_link'] / 1e6:.0f} |")
            continue
        table.append(f"| {r['rtt_ms']} | {r['remote_s']:.1f} | {r['move_s']:.1f} | {r['local_s']:.1f} | "
                     f"{r['move_s'] + r['local_s']:.1f} | {pause} | {r['memory_link'] / 1e6:.0f} |")
    return table


def db_move_then_run_report(ctx, rows, n, mbit, boot):
    table = move_then_run_figure(ctx.png("db_move_then_run"), rows, "512 MiB database guest",
                                 f"{n} OLTP transactions",
                                 "The database guest: run across the link, or move to the disk first")
    wins = [r["rtt_ms"] for r in rows if r["move_s"] + r["local_s"] < r["remote_s"]]
    ours = ((f"Moving first wins from {min(wins)} ms RTT on in this run" if wins else
             "Moving first did not win at any RTT measured here")
            + f" (a job of {n} transactions: remote it takes "
            f"{min(r['remote_s'] for r in rows):.0f}-{max(r['remote_s'] for r in rows):.0f} s, "
            f"at the disk's site {min(r['local_s'] for r in rows):.0f}-{max(r['local_s'] for r in rows):.0f} s). "
            f"The move itself takes {min(r['move_s'] for r in rows):.1f}-{max(r['move_s'] for r in rows):.1f} s "
            "and barely grows with the RTT, where the seed's went from 21 s to 52 s: its memory stream is one "
            "pipelined TLS connection whose window follows the bandwidth-delay product. The job's own time "
            "across the link grows with the RTT because every commit waits for its log's flush to cross it.")
    return {
        "title": "Move the database guest to its disk, then run, against running remote (seeds 000/001, Fig. 11-12)",
        "seed": "Seeds 000/001 Fig. 11: migrating the VM to the storage site took 21 s at 0-4 ms RTT and 52 s at "
                "16 ms; Fig. 12: migration plus running OSDL-DBT3 (a database benchmark) at the storage site beats "
                "running it against remote iSCSI \"when RTT is long\" (values not printed beyond the migration "
                "times).",
        "ours": ours,
        "table": table,
        "conditions": f"Debian bookworm guest (scripts/debian-guest.sh: systemd, MariaDB), 512 MiB, TCG, managed by "
                      "two `ferry host`s (sites A and B) and booted from its ferry volume at site B's storage; set "
                      f"up at first boot by cloud-init (booted and configured in {boot or 0:.0f} s). The sites are "
                      f"joined by toxiproxy ({mbit} Mbit/s, RTT/2 each way) on the disk's path and the moves' "
                      f"streams. The job: {n} sysbench oltp_read_write transactions (1 table of 10,000 rows, 1 "
                      "thread) from this machine over the guest's virtio-net card on a bridge; MariaDB's default "
                      "durability (a log flush per commit). At each RTT the guest runs the job at A (its disk "
                      "across the link), moves to B (`ferry vm migrate --to-host B --disk-server db=<B's local "
                      "NBD>`), runs the job there, and moves back to A for the next RTT.",
        "raw": {"rows": rows, "n": n, "mbit": mbit, "boot_s": boot},
    }
