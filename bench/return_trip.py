#!/usr/bin/env python3
"""The return trip: a volume migrates from daemon A to daemon B, a client
writes N MiB of random data to it at B, and it migrates back to A, which
still holds the copy it left (the basis). What crosses back should be
about N MiB plus the fingerprints, not the volume. Then it goes to B
again, where the copy A left behind is the basis in turn.

Each row is one N: the bytes on the wire of each leg (both directions,
from the migration reports), the return leg's bytes over N, and the
return legs' time (each report's `time.total_s`). For scale, the first
leg (nothing at B yet) sends the whole volume. Each daemon's index holds
the volume before it is written there and leaves (each waits until
`ferry index status` says so: an import or an arrival is indexed in the
background), as on a site where it lived a while; the writes are then
marked in the index's bitmap.

Usage: python3 bench/return_trip.py [--size-mib 1024] [--writes 16,64,256] [--out FILE]
Needs: a release build of ferry, /usr/bin/python3 with python3-libnbd.
Both daemons on loopback, plaintext: bytes, and the time of what the
daemons do (no link to wait on).
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ensure_ferry, free_port, wait_port  # noqa: E402

WRITE_BLOCK = 64 << 10


class Daemon:
    def __init__(self, work, name):
        self.nbd, self.admin, self.mig = free_port(), free_port(), free_port()
        self.proc = subprocess.Popen(
            [FERRY, "serve", "--pool", os.path.join(work, name), "--nbd", f"127.0.0.1:{self.nbd}",
             "--admin", f"127.0.0.1:{self.admin}", "--migrate", f"127.0.0.1:{self.mig}",
             "--migrate-plaintext", "--advertise-nbd", f"127.0.0.1:{self.nbd}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.admin, self.proc)
        wait_port(self.mig, self.proc)

    def ferry(self, *args):
        return subprocess.run([FERRY, *args, "--admin", f"127.0.0.1:{self.admin}"], check=True,
                              capture_output=True, text=True).stdout

    def migrate(self, volume, to):
        out = self.ferry("migrate", volume, "--to", f"127.0.0.1:{to.mig}", "--plaintext", "--json")
        r = json.loads(out)
        if r["result"] != "switched":
            raise RuntimeError(f"migration did not switch: {r}")
        return r

    def indexed(self, volume, timeout=120):
        """Wait until this daemon's index holds every print of `volume`
        (an arrival is indexed in the background)."""
        t = time.time()
        while time.time() - t < timeout:
            st = json.loads(self.ferry("index", "status", "--json"))
            if any(v["volume"] == volume and v.get("prints") for v in st["volumes"]):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{volume} not indexed within {timeout} s")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def write_random(port, volume, size, mib, seed):
    """Write `mib` MiB of random bytes at distinct 64 KiB-aligned offsets,
    through NBD (libnbd), flushing at the end."""
    code = f"""
import nbd, os, random
h = nbd.NBD()
h.connect_uri("nbd://127.0.0.1:{port}/{volume}")
rng = random.Random({seed})
blocks = {size} // {WRITE_BLOCK}
for b in rng.sample(range(blocks), {mib} * (1 << 20) // {WRITE_BLOCK}):
    h.pwrite(os.urandom({WRITE_BLOCK}), b * {WRITE_BLOCK})
h.flush()
h.shutdown()
"""
    subprocess.run(["/usr/bin/python3", "-c", code], check=True)


def wire(r):
    return r["bytes"]["wire_tx"] + r["bytes"]["wire_rx"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--writes", default="16,64,256", help="MiB written at the other site, one row each")
    ap.add_argument("--out")
    a = ap.parse_args()
    ensure_ferry()
    size = a.size_mib << 20
    rows = []
    for i, mib in enumerate(int(x) for x in a.writes.split(",")):
        work = tempfile.mkdtemp(prefix="ferry-return-")
        try:
            img = os.path.join(work, "image.raw")
            with open(img, "wb") as fh:
                for _ in range(a.size_mib):
                    fh.write(os.urandom(1 << 20))
            da, db = Daemon(work, "a"), Daemon(work, "b")
            try:
                da.ferry("volume", "import", "v", img)
                da.indexed("v")
                there = da.migrate("v", db)
                db.indexed("v")
                write_random(db.nbd, "v", size, mib, seed=i)
                back = db.migrate("v", da)
                da.indexed("v")
                write_random(da.nbd, "v", size, mib, seed=100 + i)
                again = da.migrate("v", db)
            finally:
                da.stop()
                db.stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append({"written_mib": mib, "there": wire(there), "back": wire(back), "again": wire(again),
                     "back_fingerprints": back["bytes"]["fingerprints"],
                     "back_chunks_sent": back["chunks"]["sent"], "back_chunks_resumed": back["chunks"]["resumed"],
                     "back_chunks_unchanged": back["chunks"].get("unchanged", 0),
                     "back_s": back["time"]["total_s"], "again_s": again["time"]["total_s"]})
        print(f"{mib} MiB written: there {wire(there)/2**20:.1f} MiB, back {wire(back)/2**20:.1f} MiB, "
              f"again {wire(again)/2**20:.1f} MiB; back {back['time']['total_s']:.2f} s, "
              f"again {again['time']['total_s']:.2f} s", file=sys.stderr)
    lines = [f"Volume of {a.size_mib} MiB of random data; at the other site a client writes N MiB of random "
             f"data in 64 KiB blocks at distinct offsets (NBD, libnbd), then the volume migrates back; then "
             f"the same again towards the first site. Wire bytes both ways, from each report "
             f"(loopback, plaintext, compression on).", "",
             "| N written | first leg MiB | back MiB | back / N | of which fingerprints MiB | again MiB | again / N "
             "| back s | again s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = r["written_mib"] << 20
        lines.append(f"| {r['written_mib']} MiB | {r['there']/2**20:.1f} | {r['back']/2**20:.1f} | "
                     f"{r['back']/n:.3f} | {r['back_fingerprints']/2**20:.2f} | {r['again']/2**20:.1f} | "
                     f"{r['again']/n:.3f} | {r['back_s']:.2f} | {r['again_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
