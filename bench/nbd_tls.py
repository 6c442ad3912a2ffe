#!/usr/bin/env python3
"""NBD over TLS, side by side: nbdcopy reading a 1 GiB export to null: and
writing a 1 GiB file into it, through ferry, nbdkit (file plugin) and
qemu-nbd, each in its TLS mode with client certificates required (the same
credentials, made by `ferry certs nbd`), one after another in every repeat
(order rotated), medians over repeats; and ferry in clear beside them, so
the table also shows what TLS costs. Beside the rates, each server's own
CPU seconds per GiB moved (its process's user + system time over the
transfer): on this 2-core machine client and server share the cores, so
the rates swing by a tenth between runs while the server's CPU per GiB
is steady.

Usage: python3 bench/nbd_tls.py [--repeats 3] [--out FILE] [--copy-tls-reads]
  --copy-tls-reads: ferry copies large TLS READs into a buffer first
  (nbd.mapped_tls_reads = false), for an A/B on one build.
Needs: nbdcopy, nbdkit, qemu-nbd, a release build of ferry.
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ensure_ferry, free_port, version, wait_port  # noqa: E402

IMAGE_MIB = 1024
KINDS = ["ferry", "nbdkit", "qemu-nbd", "ferry (clear)"]


class Server:
    def __init__(self, kind, image, work, pki, mapped=True):
        self.kind, self.port = kind, free_port()
        server = os.path.join(pki, "server")
        tls = kind != "ferry (clear)"
        if kind.startswith("ferry"):
            admin = free_port()
            cfg = os.path.join(work, "ferry.toml")
            with open(cfg, "w") as f:
                f.write("[nbd]\ntls_clear_loopback = false\n")
                if not mapped:
                    f.write("mapped_tls_reads = false\n")
            pool = os.path.join(work, "pool-" + str(self.port))
            args = [FERRY, "serve", "--pool", pool, "--nbd", f"127.0.0.1:{self.port}",
                    "--admin", f"127.0.0.1:{admin}", "--allow-path", os.path.dirname(os.path.abspath(image))]
            if tls:
                args += ["--config", cfg, "--nbd-tls-dir", server]
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_port(admin, self.proc)
            subprocess.run([FERRY, "volume", "create", "bench", "--path", image, "--admin", f"127.0.0.1:{admin}"],
                           check=True, stdout=subprocess.DEVNULL)
        elif kind == "nbdkit":
            self.proc = subprocess.Popen(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(self.port), "--tls=require",
                                          f"--tls-certificates={server}", "--tls-verify-peer", "file", image])
        elif kind == "qemu-nbd":
            self.proc = subprocess.Popen(["qemu-nbd", "--object",
                                          f"tls-creds-x509,id=tls0,dir={server},endpoint=server,verify-peer=on",
                                          "--tls-creds", "tls0", "-f", "raw", "-x", "bench", "-b", "127.0.0.1",
                                          "-p", str(self.port), "-t", "-e", "16", "--aio=threads", image])
        wait_port(self.port, self.proc)
        client = os.path.join(pki, "client-bench")
        self.uri = (f"nbds://localhost:{self.port}/bench?tls-certificates={client}" if tls
                    else f"nbd://localhost:{self.port}/bench")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cpu_seconds(pid):
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(args, pid):
    """Wall seconds of `args`, and the CPU seconds process `pid` used meanwhile."""
    c, t = cpu_seconds(pid), time.monotonic()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - t, cpu_seconds(pid) - c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--copy-tls-reads", action="store_true")
    a = ap.parse_args()
    for tool in ("nbdcopy", "nbdkit", "qemu-nbd"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is needed")
    ensure_ferry()
    work = tempfile.mkdtemp(prefix="ferry-nbd-tls-")
    try:
        pki = os.path.join(work, "pki")
        subprocess.run([FERRY, "certs", "nbd", "--out", pki, "--server-name", "localhost",
                        "--client", "bench"], check=True, stdout=subprocess.DEVNULL)
        image = os.path.join(work, "image.raw")
        src = os.path.join(work, "src.raw")
        with open(src, "wb") as f:
            for _ in range(IMAGE_MIB):
                f.write(os.urandom(1 << 20))
        shutil.copyfile(src, image)
        runs = {k: [] for k in KINDS}
        for r in range(a.repeats):
            order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
            for kind in order:
                s = Server(kind, image, work, pki, mapped=not a.copy_tls_reads)
                try:
                    read_s, read_cpu = timed(["nbdcopy", s.uri, "null:"], s.proc.pid)
                    write_s, write_cpu = timed(["nbdcopy", "--flush", src, s.uri], s.proc.pid)
                finally:
                    s.stop()
                gib = IMAGE_MIB / 1024
                runs[kind].append({"read_mbs": IMAGE_MIB * 1.048576 / read_s,
                                   "write_mbs": IMAGE_MIB * 1.048576 / write_s,
                                   "read_cpu_s_per_gib": read_cpu / gib,
                                   "write_cpu_s_per_gib": write_cpu / gib})
        med = lambda k, f: sorted(x[f] for x in runs[k])[len(runs[k]) // 2]
        best = {f: max(med(k, f) for k in ("nbdkit", "qemu-nbd")) for f in ("read_mbs", "write_mbs")}
        print("| server | read MB/s | write MB/s | server CPU s/GiB read | server CPU s/GiB write |")
        print("|---|---|---|---|---|")
        for k in KINDS:
            print(f"| {k} | {med(k, 'read_mbs'):.0f} | {med(k, 'write_mbs'):.0f} | "
                  f"{med(k, 'read_cpu_s_per_gib'):.2f} | {med(k, 'write_cpu_s_per_gib'):.2f} |")
        print(f"| ferry / best TLS peer | {med('ferry', 'read_mbs') / best['read_mbs']:.2f} | "
              f"{med('ferry', 'write_mbs') / best['write_mbs']:.2f} |")
        print(f"| ferry TLS / ferry clear | {med('ferry', 'read_mbs') / med('ferry (clear)', 'read_mbs'):.2f} | "
              f"{med('ferry', 'write_mbs') / med('ferry (clear)', 'write_mbs'):.2f} |")
        print(f"| ferry / nbdkit, server CPU per GiB | | | {med('ferry', 'read_cpu_s_per_gib') / med('nbdkit', 'read_cpu_s_per_gib'):.2f} | "
              f"{med('ferry', 'write_cpu_s_per_gib') / med('nbdkit', 'write_cpu_s_per_gib'):.2f} |")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"runs": runs, "versions": {t: version([t, "--version"]) for t in ("nbdkit", "qemu-nbd", "nbdcopy")}},
                          f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
