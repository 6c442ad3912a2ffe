"""Issue 31's scale curves: how a teleport (guest and disk to the other
site) grows with the guest's memory, the disk's data and the link's round
trip, ferry against QEMU's copy-storage move as libvirt runs it
(`vm_peers.run_qemu_native`) in its best mode for a guest that keeps
writing (`--copy-storage-synchronous-writes`: the mirror's write-blocking
mode; in its default background mode, at 20 ms the mirror of this guest's
disk did not converge for 25-300 s), with the placement model's prediction
(`ferry control estimate --teleport-to`, asked just before each move) on
the same axes.

Each point is a fresh pair of sites: the test guest at A (`ferry.fill`:
half its memory holds random data), its disk an ext4 volume at A whose
files site B already holds in a sibling volume, plus a region of random
data B lacks. One axis moves at a time, the others stay at the middle
point. The disk axis grows what B already holds with what it lacks fixed:
ferry's bytes and time should follow what B lacks, QEMU's the disk.

FERRY_SCALE_SHARED=1, with TMPDIR on a file system that shares extents
(XFS with reflink, btrfs): each point holds its data about once, so the
disk axis reaches 32 GiB on this machine's disk. The image is filled in
place (loop-mounted, no staging copy), A's volume is the image itself
(`ferry volume create --path`), B's sibling a reflinked copy of it with
the region B lacks punched out, and the volume the move makes at B shares
the sibling's extents. Needs root (the mount)."""
import json, os, shutil, subprocess, time

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from common import FERRY, ROOT
from evidence_rigs import two_site_inventory
from migration_peers import Link, http
from vm_peers import GUEST, MULTIFD_CHANNELS, Host, run_qemu_native, test_guest, two_sites, wait_acks

MBIT = 400
# A QEMU move still running this long past the time its disk alone takes
# at the link's rate (half as long again) is given up and shown as such.
QEMU_LIMIT_S = 600


def qemu_limit_s(p):
    """How long QEMU's move of point `p` may run: [`QEMU_LIMIT_S`] past
    1.5 times its disk's time on the link (at 32 GiB the copy alone takes
    about 690 s at 400 Mbit/s)."""
    return QEMU_LIMIT_S + int(1.5 * ((p["held"] + p["lacks"]) << 20) * 8 / (MBIT * 1e6))


def axes(quick):
    """The middle point and, per axis, (name, values)."""
    if quick:
        mid = {"mem": 256, "held": 24, "lacks": 8, "rtt": 10}
        # Four points: every axis drawn, two on the one whose growth the
        # report compares (a CI run checks that it runs, not the curves).
        return mid, [("mem", [384]), ("held", [8, 24]), ("rtt", [2])]
    mid = {"mem": 512, "held": 1024, "lacks": 128, "rtt": 20}
    return mid, [("mem", [256, 512, 1024, 2048, 4096]), ("held", [256, 1024, 4096, 8192, 16384, 32768]),
                 ("rtt", [2, 20, 100, 200])]


LABELS = {"mem": "guest memory (MiB; half of it random data)",
          "held": "disk data site B already holds (MiB; it lacks {lacks} MiB more)",
          "rtt": "round-trip time between the sites (ms)"}


def shared():
    """Whether points are laid out to share extents (FERRY_SCALE_SHARED)."""
    return bool(os.environ.get("FERRY_SCALE_SHARED"))


def disk_need(p):
    """Free disk a point needs (bytes): at its peak, its data three times
    over (B's sibling volume, A's volume and the one the move makes at B;
    or A's image, QEMU's copy at B and the files the image is made from),
    and a tenth more for the file systems and the stores. Shared: once
    (QEMU's copy not made), and a fifth more."""
    if shared():
        return int(1.2 * (p["held"] + p["lacks"])) << 20
    return int(3.3 * (p["held"] + p["lacks"])) << 20


class DiskImage:
    """A's disk: an ext4 image holding `held` MiB of random files, with
    `lacks` MiB of other random data in its free space (the last `lacks`
    MiB before a 32 MiB tail; the guest's few records land early). B's
    sibling is the same image without that region (`to_sibling`)."""

    def __init__(self, work, held, lacks):
        size_mib = held + lacks + max(64, held // 8) + 64
        self.path, self.size = os.path.join(work, "disk.img"), size_mib << 20
        if shared():
            # Filled in place: no staging copy of the files.
            subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", self.path, f"{size_mib}M"], check=True)
            stage = os.path.join(work, "mnt")
            os.makedirs(stage, exist_ok=True)
            subprocess.run(["mount", "-o", "loop", self.path, stage], check=True)
            try:
                self._write_files(stage, held)
            finally:
                subprocess.run(["umount", stage], check=True)
            os.rmdir(stage)
        else:
            stage = os.path.join(work, "files")
            shutil.rmtree(stage, ignore_errors=True)
            os.makedirs(stage)
            self._write_files(stage, held)
            subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-d", stage, self.path, f"{size_mib}M"], check=True)
            shutil.rmtree(stage)
        self.lacking = ((size_mib - lacks - 32) << 20, lacks << 20)
        with open(self.path, "r+b") as f:
            f.seek(self.lacking[0])
            for _ in range(lacks):
                f.write(os.urandom(1 << 20))

    @staticmethod
    def _write_files(stage, held):
        """`held` MiB of random data in files of 256 MiB under `stage`."""
        for i in range(0, held, 256):
            with open(os.path.join(stage, f"blob{i}"), "wb") as f:
                for _ in range(min(256, held - i)):
                    f.write(os.urandom(1 << 20))

    def sibling_copy(self):
        """B's sibling beside the image, sharing its extents (`cp
        --reflink=always`: fails where the file system cannot), the region
        B lacks punched out; its path."""
        path = os.path.join(os.path.dirname(self.path), "sibling.img")
        subprocess.run(["cp", "--reflink=always", self.path, path], check=True)
        self._punch_lacking(path)
        return path

    def _punch_lacking(self, path):
        """The region B lacks, punched out of `path`: free space again."""
        offset, length = self.lacking
        subprocess.run(["fallocate", "--punch-hole", "--offset", str(offset), "--length", str(length), path],
                       check=True)

    def to_sibling(self):
        """Makes the image B's sibling, in place (no second copy of a disk
        that may be most of the machine's free space): the region B lacks
        is punched out, free space again as it was before it was filled."""
        self._punch_lacking(self.path)


def cmdline(mem):
    """The guest's kernel command line: half its memory filled (a guest
    under 256 MiB has no room for that beside its kernel and initramfs)."""
    return f"console=ttyS0 quiet ferry.fill={mem // 2}"


def ferry_point(work, link, image, mem):
    """One teleport A → B of the guest (`mem` MiB), its estimate just
    before: `image` (a DiskImage) becomes A's volume, then B's sibling, and
    is deleted."""
    dirs = [os.path.join(work, d) for d in ("sa", "sb", "ha", "hb")]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    sa, sb, ha, hb = two_sites(work, allow_path=work if shared() else None)
    hosts = []
    try:
        if shared():
            # A's volume is the image; B's sibling shares its extents.
            sibling = image.sibling_copy()
            sa.ferry("volume", "create", "root", "--path", image.path)
            sb.ferry("volume", "create", "sibling", "--path", sibling)
        else:
            sa.ferry("volume", "create", "root", "--size", str(image.size))
            sa.ferry("volume", "import", "root", image.path)
            image.to_sibling()
            sb.ferry("volume", "create", "sibling", "--size", str(image.size))
            sb.ferry("volume", "import", "sibling", image.path)
            os.unlink(image.path)  # the volumes hold it now
        # Both indexes done with the imports (B's finds its held blocks,
        # A's keeps the prints its source sends unread), as for disks that
        # have sat at their sites a while.
        sa.wait_indexed("root")
        sb.wait_indexed("sibling")
        # The imports' dirty pages written back now, not during the move
        # (up to the kernel's dirty limit, several GB: a cost that would
        # not grow with the disk's data and would bend its curve).
        os.sync()
        # Each guest's memory measured every 5 s (dirty rate, what a move
        # sends of it), so that the estimate sees the guest after its fill.
        A, B = Host(ha, ["--memory-sample-every", "5"]), Host(hb, ["--memory-sample-every", "5"])
        hosts = [A, B]
        inv, p = two_site_inventory(link, A, B, sa, sb, link.rtt, MBIT)
        (moves_name, moves_b), (mig_name, mig_b) = p["moves_b"], p["mig_b"]
        inv_file = os.path.join(work, "inventory.json")
        with open(inv_file, "w") as f:
            json.dump(inv, f)
        serial = test_guest(A, "g", "root", f"127.0.0.1:{sa.nbd}", f"127.0.0.1:{sa.admin}",
                            memory=f"{mem}M", cmdline=cmdline(mem))
        try:
            wait_acks(serial, 30, secs=120 + mem // 8)
        except RuntimeError as e:
            with open(serial, errors="replace") as f:
                raise RuntimeError(f"{e}; its console's last lines: {f.read()[-600:]!r}") from None
        time.sleep(12)  # two of the host's measurements since the fill ended
        r = subprocess.run([FERRY, "control", "estimate", "g", "--inventory", inv_file, "--interval", "3s",
                            "--teleport-to", "b", "--json"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"ferry control estimate: {r.stderr.strip()}")
        estimate = json.loads(r.stdout)
        cost = estimate["cost"]
        r = A.vm("migrate", "g", "--to-host", f"127.0.0.1:{moves_b}", "--with-disk", "--to-storage",
                 f"127.0.0.1:{mig_b}", "--to-storage-admin", f"127.0.0.1:{sb.admin}", "--json")
        if r.returncode != 0:
            raise RuntimeError(f"teleport: {r.stdout} {r.stderr}")
        rep = json.loads(r.stdout)
        # The rate B's daemon measured rebuilding what it held (what the
        # model prices its next move at), set beside the constant.
        lookup = json.loads(http("POST", f"http://127.0.0.1:{sb.admin}/v1/index/lookup", {"fingerprints": []}))
        wait_acks(os.path.join(hb, "vms", "g", "serial.log"), 3, secs=60)
        B.vm("stop", "g")
        return {"seconds": rep["total_s"], "bytes": link.bytes(moves_name) + link.bytes(mig_name),
                "pause_ms": rep.get("guest_pause_ms"), "phases": rep.get("phases"),
                "report_bytes": rep.get("bytes"), "report": rep,
                "rebuild_bps_measured": lookup.get("rebuild_bps"),
                "predicted": {"seconds": cost["seconds"], "bytes": cost["bytes"], "pause_ms": cost["pause_s"] * 1000},
                # Its inputs (the links as probed, the guest's measured load),
                # to tell a wrong input from a wrong formula.
                "estimate": estimate}
    finally:
        for h in hosts:
            h.stop()
        sa.stop()
        sb.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def qemu_point(work, link, image, p):
    """QEMU's copy-storage of the point's guest, run first, its source
    guest on the image itself (it adds its records to the file system,
    which then go to both of ferry's sites alike), so that no point holds
    its data more than three times. FERRY_SCALE_FERRY_ONLY=1 leaves it out
    (runs that fit the model; not for the evidence)."""
    def failed(why):
        return {"seconds": None, "bytes": None, "pause_ms": None, "error": why, "first": True}
    if os.environ.get("FERRY_SCALE_FERRY_ONLY"):
        return failed("not run (FERRY_SCALE_FERRY_ONLY)")
    # Shared, the point's disk is laid out once; QEMU's copy at B is a
    # second whole one.
    need = int(1.1 * (p["held"] + p["lacks"])) << 20
    if shared() and shutil.disk_usage(work).free < need:
        return failed(f"not run: QEMU's copy of the disk needs about {need / 1e9:.0f} GB more free disk")
    os.sync()  # the image's writing is set-up, not the move's
    try:
        q = run_qemu_native(work, link, image.path, "idle", mem=f"{p['mem']}M",
                            append=cmdline(p["mem"]), boot_secs=120 + p["mem"] // 8,
                            limit_s=qemu_limit_s(p), copy_mode="write-blocking", in_place=True)
    except TimeoutError as e:
        return failed(str(e))
    return {"seconds": q["seconds"], "bytes": q["bytes"], "pause_ms": q["stop_resume_ms"],
            "multifd": MULTIFD_CHANNELS, "first": True}


def exp_scale(ctx):
    """Teleport time, bytes and pause against memory, disk data and RTT."""
    if not os.path.exists(os.path.join(GUEST, "vmlinuz")):
        raise RuntimeError(f"{GUEST}/vmlinuz missing: run scripts/guest-image.sh")
    mid, plan = axes(ctx.quick)
    # FERRY_SCALE_ONLY=AXIS=VALUE[,...] measures only those points and
    # keeps the saved run's others (to redo a point, or finish a run).
    only = [tuple(x.split("=")) for x in os.environ.get("FERRY_SCALE_ONLY", "").split(",") if x]
    known = {(a, str(v)) for a, vs in plan for v in vs}
    if any(x not in known for x in only):
        raise RuntimeError(f"FERRY_SCALE_ONLY names {', '.join('='.join(x) for x in only if x not in known)}, "
                           f"not points of this run: {', '.join(f'{a}={v}' for a, v in sorted(known))}")
    rows, note, saved = [], None, None
    if only:
        # The points not measured come from the run saved in --out, else
        # the committed one (a quick run's from none: its sizes differ).
        saved = os.path.join(ctx.out, "scale.json")
        if not os.path.exists(saved):
            saved = None if ctx.quick else os.path.join(ROOT, "docs", "evidence", "scale.json")
            print(f"scale: no scale.json in {ctx.out}; the points not measured: {saved or 'none'}", flush=True)
    if saved:
        with open(saved) as f:
            raw = json.load(f)["raw"]
        rows = [r for r in raw["rows"] if (r["axis"], str(r["value"])) not in only]
        # Say which points are of this run, after what the saved run said.
        note = " ".join(filter(None, [raw.get("note"), (
            f"{', '.join(f'{a}={v}' for a, v in only)} measured on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
            f"(`FERRY_SCALE_ONLY={os.environ['FERRY_SCALE_ONLY']}`).")]))
    for axis, values in plan:
        for v in values:
            if only and (axis, str(v)) not in only:
                continue
            p = dict(mid, **{axis: v})
            work = ctx.sub(f"scale-{axis}-{v}")
            free = shutil.disk_usage(work).free
            if free < disk_need(p):
                why = (f"not run: the point needs about {disk_need(p) / 1e9:.0f} GB of free disk, "
                       f"this machine had {free / 1e9:.0f} GB")
                print(f"scale {axis}={v}: {why}", flush=True)
                rows.append({"axis": axis, "value": v, "point": p, "skipped": why})
                continue
            image = DiskImage(work, p["held"], p["lacks"])
            link = Link(work, MBIT, p["rtt"])
            try:
                q = qemu_point(work, link, image, p)
                try:
                    f = ferry_point(work, link, image, p["mem"])
                except RuntimeError as e:
                    # A failed move is a result: kept as such, the curve goes on.
                    why = str(e)
                    f = {"error": why if len(why) <= 2000 else f"{why[:1000]} … {why[-1000:]}"}
                    print(f"scale {axis}={v}: ferry failed: {f['error']}", flush=True)
            finally:
                link.close()
                shutil.rmtree(work, ignore_errors=True)
            rows.append({"axis": axis, "value": v, "point": p, "ferry": f, "qemu": q,
                         "layout": "shared" if shared() else "copied"})
            if "error" not in f:
                print(f"scale {axis}={v}: ferry {f['seconds']:.1f} s {f['bytes'] / 1e6:.0f} MB "
                      f"{f['pause_ms']:.0f} ms (predicted {f['predicted']['seconds']:.1f} s "
                      f"{f['predicted']['bytes'] / 1e6:.0f} MB {f['predicted']['pause_ms']:.0f} ms); QEMU {q}",
                      flush=True)
    order = {(a, v): i for i, (a, vs) in enumerate(plan) for v in vs}
    rows.sort(key=lambda r: (order.get((r["axis"], r["value"]), 99), r["value"]))
    return scale_report(ctx, rows, mid, note)


def layout_text(rows):
    """What the points' disks were laid out on, for the conditions: each
    data three times over on ext4 (points of before 2026-12-03 say no
    layout), or once on a file system that shares extents."""
    by = {}
    for r in rows:
        by.setdefault(r.get("layout", "copied"), []).append(f"{r['axis']}={r['value']}")
    copied = ("a point's data three times over on the machine's ext4 (B's sibling volume, the volume at A and "
              "the one the move makes at B; the volumes' files copied, not shared)")
    shared_ = ("the points' pools on XFS with reflink (`FERRY_SCALE_SHARED=1`): A's volume the image itself, B's "
               "sibling a reflinked copy with the region B lacks punched out, the volume the move makes at B "
               "sharing the sibling's extents, QEMU's copy at B a whole second one")
    if set(by) == {"copied"}:
        return f"Disks: {copied}."
    if set(by) == {"shared"}:
        return f"Disks: {shared_}."
    return f"Disks: {shared_} at {', '.join(by['shared'])}; {copied} at {', '.join(by['copied'])}."


def one_line(text):
    """`text` fit for a table cell."""
    return " ".join(text.replace("|", "/").split())


def err_pct(p, m):
    return (p - m) / m * 100 if m else float("nan")


def scale_report(ctx, rows, mid, note=None):
    """The figure (a row of panels per axis: time, bytes, pause) and table;
    `note` (kept with the results) is added to the conditions."""
    skipped = [r for r in rows if "skipped" in r]
    every_row, rows = rows, [r for r in rows if "skipped" not in r]
    names = list(dict.fromkeys(r["axis"] for r in rows))
    fig, grid = plt.subplots(len(names), 3, figsize=(14, 3.6 * len(names)), squeeze=False)
    for axs, axis in zip(grid, names):
        every = [r for r in rows if r["axis"] == axis]
        pts = [r for r in every if "error" not in r["ferry"]]
        xs = [r["value"] for r in pts]
        for ax, key, scale, unit in ((axs[0], "seconds", 1, "move time (s)"), (axs[1], "bytes", 1e-6, "bytes on the link (MB)"),
                                     (axs[2], "pause_ms", 1, "guest pause (ms, STOP→RESUME)")):
            ax.plot(xs, [(r["ferry"][key] or 0) * scale for r in pts], "o-", color="C0", label="ferry teleport")
            ax.plot(xs, [r["ferry"]["predicted"][key] * scale for r in pts], "x--", color="C0", alpha=.6,
                    label="ferry, the model's prediction")
            done = [r for r in every if r["qemu"][key] is not None]
            ax.plot([r["value"] for r in done], [r["qemu"][key] * scale for r in done], "s-", color="grey",
                    label="QEMU copy-storage (libvirt's order)")
            for r in every:
                if "error" in r["ferry"]:
                    ax.annotate("ferry: the move failed", (r["value"], 0), fontsize=6, rotation=90, color="C3",
                                va="bottom")
                why = r["qemu"].get("error")
                if why:
                    ax.annotate("QEMU: not run" if why.startswith("not run")
                                else f"QEMU: not done in {qemu_limit_s(r['point'])} s",
                                (r["value"], 0), fontsize=6, rotation=90, color="grey", va="bottom")
            ax.xaxis.set_major_locator(MaxNLocator(6))
            ax.set_xlabel(LABELS[axis].format(**mid), fontsize=8)
            ax.set_ylabel(unit, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=.3)
        axs[0].legend(fontsize=7)
    fig.suptitle(f"A teleport at scale: one axis at a time, the others at {mid['mem']} MiB of memory, "
                 f"{mid['held']} MiB held + {mid['lacks']} MiB lacking, {mid['rtt']} ms; {MBIT} Mbit/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(ctx.png("scale"), dpi=100)
    plt.close(fig)
    table = ["| axis | value | ferry s / QEMU s | ferry MB / QEMU MB | ferry pause / QEMU pause (ms) | "
             "model error: time, bytes, pause |", "|---|---|---|---|---|---|"]
    errs = []
    for r in every_row:
        if "skipped" in r:
            table.append(f"| {r['axis']} | {r['value']} | {r['skipped']} | | | |")
            continue
        f, q = r["ferry"], r["qemu"]
        if "error" in f:
            table.append(f"| {r['axis']} | {r['value']} | failed | | | {one_line(f['error'][-300:])} |")
            continue
        p = f["predicted"]
        e = [err_pct(p["seconds"], f["seconds"]), err_pct(p["bytes"], f["bytes"]),
             err_pct(p["pause_ms"], f["pause_ms"] or 0)]
        errs += e
        def num(x, scale=1, fmt="{:.0f}"):
            return "—" if x is None else fmt.format(x * scale)
        table.append(f"| {r['axis']} | {r['value']} | {f['seconds']:.1f} / {num(q['seconds'], fmt='{:.1f}')} | "
                     f"{f['bytes'] / 1e6:.0f} / {num(q['bytes'], 1e-6)} | {num(f['pause_ms'])} / "
                     f"{num(q['pause_ms'])} | {e[0]:+.0f}%, {e[1]:+.0f}%, {e[2]:+.0f}% |")
    within = sum(1 for e in errs if abs(e) <= 15)
    # QEMU's memory channels per point (points of before 2026-11-28 10:30
    # ran four and did not say so).
    # A point QEMU did not run (no room for its copy) used no channel.
    channels = sorted({r["qemu"].get("multifd", 4) for r in rows if "error" not in r["qemu"]})
    if channels == [0]:
        memory = "its classic single stream for memory"
    else:
        word = "channel" if channels == [1] else "channels"
        memory = f"multifd ({' or '.join(map(str, channels))} {word}, zstd) memory"
    if 4 in channels:
        memory += (" (with four channels sharing the link QEMU's pause is about three times what one channel "
                   "gives: docs/benchmarks.md, \"QEMU's memory channels\")")
    held = [r for r in rows if r["axis"] == "held" and "error" not in r["ferry"]]
    growth = ""
    if len(held) > 1:
        a, b = held[0], held[-1]
        growth = (f" From {a['value']} to {b['value']} MiB held at B, ferry's bytes went "
                  f"{a['ferry']['bytes'] / 1e6:.0f} → {b['ferry']['bytes'] / 1e6:.0f} MB")
        ran = [r for r in held if r["qemu"].get("bytes")]
        if len(ran) > 1:
            qa, qb = ran[0], ran[-1]
            growth += f" and QEMU's {qa['qemu']['bytes'] / 1e6:.0f} → {qb['qemu']['bytes'] / 1e6:.0f} MB"
            if (qa, qb) != (a, b):
                growth += f" (from {qa['value']} to {qb['value']} MiB, the points it ran)"
        growth += "."
    return {
        "title": "A teleport at scale: memory, disk data and RTT, with the model's prediction (issue 31)",
        "seed": "Seed 002 measured one guest size; issue 31 asks how time, bytes and pause grow with the guest's "
                "memory (256 MiB-4 GiB), the disk's data and the RTT (2-200 ms), ferry against QEMU's "
                "copy-storage, the model within 15% on every curve.",
        "ours": f"{within} of {len(errs)} predictions within 15%.{growth}"
                + "".join(f" The teleport at {r['axis']}={r['value']} failed: the destination's QEMU said "
                          f"{one_line(r['ferry']['error'].split('it said: ')[-1][:240])}"
                          for r in rows if "error" in r["ferry"])
                + "".join(f" The point {r['axis']}={r['value']} was {r['skipped']}." for r in skipped)
                + "".join(f" QEMU at {r['axis']}={r['value']}: {one_line(r['qemu']['error'][:240])}." for r in rows
                          if "error" in r["qemu"] and "error" not in r["ferry"]),
        "table": table,
        "conditions": f"Two sites on loopback joined by toxiproxy ({MBIT} Mbit/s each way, the RTT split between "
                      "directions); the test guest (TCG, one vCPU) writing a durable record at a time, half its "
                      "memory random data (`ferry.fill`); its disk an ext4 volume at A whose files B holds in a "
                      "sibling volume, plus random data B lacks in the file system's free space. ferry: `ferry vm "
                      "migrate --with-disk` (bytes: toxiproxy's count over the memory and disk proxies), the "
                      "prediction `ferry control estimate --teleport-to b` just before. QEMU (run first, its "
                      "source guest on the image ferry's volumes are then made of, whose file system gains its "
                      "records): `blockdev-mirror sync=full copy-mode=write-blocking` (libvirt's "
                      "`--copy-storage-synchronous-writes`) into the destination's NBD export, then "
                      f"{memory}, libvirt's order. Pause: QEMU's STOP→RESUME stamps. One run per point. "
                      + layout_text(every_row) + (f" {note}" if note else ""),
        "raw": {"rows": every_row, "mid": mid, **({"note": note} if note else {})},
    }
