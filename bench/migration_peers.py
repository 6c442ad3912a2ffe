#!/usr/bin/env python3
"""Moving a disk image across an emulated WAN: ferry against its peers.

The destination already holds a base OS image; the source holds a bigger
install of the same OS (or, for the cross pair, of the previous release).
Over the same toxiproxy link (bandwidth cap each way, latency each way),
one after the other in one run, this measures bytes through the link and
wall time for:

  ferry          ferry migrate (fingerprints first, rebuild from local blocks)
  ferry-noindex  ferry migrate --no-dedup (every non-zero block sent: the seed's baseline)
  qemu-mirror    qemu-storage-daemon blockdev-mirror (sync=full) to an NBD export at the destination
  rsync          rsync -z --no-whole-file -B 4096, the base image as basis (rsync daemon)
  casync         casync make at the source, casync extract --seed=base at the destination over HTTP

and the pause of a ferry migration with an idle volume and under a steady
random-write load (through ferry host). Images come from bench/similarity.sh
(debootstrap + mke2fs -d). Prints a markdown table; --json for raw results.

  python3 bench/migration_peers.py [--rtt 20 --rtt 100] [--mbit 100] [--pairs same,cross]
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import FERRY, ROOT, free_port, wait_port  # noqa: E402,F401


def http(method, url, body=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    # ferry's APIs refuse state changes without a JSON content type.
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


class Exited(RuntimeError):
    """The process that was to answer exited first."""


def wait_http(url, secs=30, proc=None, log=None):
    """Until `url` answers a GET; raises `Exited` at once if `proc` exits
    first, with the tail of its `log`."""
    end = time.time() + secs
    while time.time() < end:
        if proc is not None and proc.poll() is not None:
            tail = ""
            if log is not None:
                with open(log, errors="replace") as f:
                    tail = f.read()[-2000:]
            raise Exited(f"{proc.args[0]} exited ({proc.returncode}) before {url} answered:\n{tail}")
        try:
            http("GET", url, timeout=2)
            return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


class Link:
    """A toxiproxy proxy with a bandwidth cap and latency on both streams."""

    def __init__(self, work, mbit, rtt_ms):
        self.api_port = free_port()
        self.proc = subprocess.Popen(
            ["toxiproxy-server", "-host", "127.0.0.1", "-port", str(self.api_port), "-proxy-metrics"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "toxiproxy.log"), "w"))
        self.api = f"http://127.0.0.1:{self.api_port}"
        wait_http(self.api + "/version")
        self.kbps = int(mbit * 1000 / 8)
        self.rtt = rtt_ms
        self.n = 0

    def proxy(self, upstream, connections=1):
        """A new proxy (fresh byte counters) to `upstream`; returns (name,
        port). toxiproxy caps each connection on its own: a peer that
        carries one stream over `connections` parallel ones (QEMU's
        multifd channels) gets the link's rate split among them, as the
        one link of a WAN would share it."""
        self.n += 1
        name = f"p{self.n}"
        port = free_port()
        http("POST", self.api + "/proxies",
             {"name": name, "listen": f"127.0.0.1:{port}", "upstream": upstream, "enabled": True})
        rate = max(1, self.kbps // connections)
        for s in ("upstream", "downstream"):
            http("POST", f"{self.api}/proxies/{name}/toxics",
                 {"name": f"rate-{s}", "type": "bandwidth", "stream": s, "attributes": {"rate": rate}})
            http("POST", f"{self.api}/proxies/{name}/toxics",
                 {"name": f"delay-{s}", "type": "latency", "stream": s,
                  "attributes": {"latency": self.rtt // 2}})
        return name, port

    def set_rtt(self, name, rtt_ms):
        """Change the round trip of proxy `name` (half each way) while it carries traffic."""
        for s in ("upstream", "downstream"):
            http("POST", f"{self.api}/proxies/{name}/toxics/delay-{s}", {"attributes": {"latency": rtt_ms // 2}})

    def bytes(self, name):
        """Bytes carried by proxy `name`, both directions (toxiproxy metrics)."""
        text = http("GET", self.api + "/metrics").decode()
        total = 0
        for line in text.splitlines():
            if line.startswith("toxiproxy_proxy_sent_bytes_total") and f'proxy="{name}"' in line:
                total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def close(self):
        self.proc.kill()
        self.proc.wait()


class Daemon:
    def __init__(self, pool, migrate=False, binary=None, allow_path=None):
        """`binary`: the ferry build to run (default: FERRY); `allow_path`:
        a directory whose files volumes may be made of (`--path`)."""
        self.bin = binary or FERRY
        self.log = pool + ".log"
        # A port free_port() found can be taken (by any connection's
        # ephemeral port) before the daemon binds it; the daemon then exits
        # at once, and a start on fresh ports is the cure.
        for attempt in range(3):
            try:
                self._start(pool, migrate, allow_path)
                return
            except Exited:
                if attempt == 2:
                    raise

    def _start(self, pool, migrate, allow_path):
        self.nbd, self.admin = free_port(), free_port()
        args = [self.bin, "serve", "--pool", pool, "--nbd", f"127.0.0.1:{self.nbd}",
                "--admin", f"127.0.0.1:{self.admin}"]
        if allow_path:
            args += ["--allow-path", allow_path]
        self.mig = None
        if migrate:
            self.mig = free_port()
            args += ["--migrate", f"127.0.0.1:{self.mig}"]
        env = dict(os.environ, FERRY_LOG=os.environ.get("FERRY_BENCH_LOG", "warn"))
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "w"))
        try:
            wait_http(f"http://127.0.0.1:{self.admin}/v1/server", 60, self.proc, self.log)
        except RuntimeError:
            self.proc.kill()
            self.proc.wait()
            raise

    def ferry(self, *args):
        env = dict(os.environ, FERRY_ADMIN=f"127.0.0.1:{self.admin}")
        return subprocess.run([self.bin, *args], env=env, check=True, capture_output=True, text=True).stdout

    def wait_indexed(self, volume, secs=1800):
        """Until the daemon's index holds `volume` (an import's scan runs in
        the background) with its prints in block order where the build
        keeps them: as a volume that has sat at its site a while."""
        end = time.time() + secs
        while time.time() < end:
            st = json.loads(http("GET", f"http://127.0.0.1:{self.admin}/v1/index"))
            v = next((v for v in st["volumes"] if v["volume"] == volume), None)
            if v is not None and v.get("prints", True):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{volume} was not indexed in {secs} s")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def volume_size(path):
    return os.path.getsize(path)


# How long the guest workload of the loaded pause runs (covers the move).
GUEST_SECONDS = 45


def run_ferry(work, link, base, image, dedup=True, load=False):
    pa, pb = os.path.join(work, "a"), os.path.join(work, "b")
    for p in (pa, pb):
        shutil.rmtree(p, ignore_errors=True)
    subprocess.run([FERRY, "certs", "show", "--pool", pa], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "show", "--pool", pb], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "trust", f"{pb}/tls/cert.pem", "--pool", pa], check=True, capture_output=True)
    subprocess.run([FERRY, "certs", "trust", f"{pa}/tls/cert.pem", "--pool", pb], check=True, capture_output=True)
    src, dst = Daemon(pa), Daemon(pb, migrate=True)
    extra = []
    try:
        dst.ferry("volume", "create", "base", "--size", str(volume_size(base)))
        dst.ferry("volume", "import", "base", base)
        src.ferry("volume", "create", "vm", "--size", str(volume_size(image)))
        src.ferry("volume", "import", "vm", image)
        name, port = link.proxy(f"127.0.0.1:{dst.mig}")
        if load:
            hport = free_port()
            extra.append(subprocess.Popen(
                [FERRY, "host", "--server", f"127.0.0.1:{src.nbd}", "--volume", "vm",
                 "--listen", f"127.0.0.1:{hport}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_port(hport)
            # The guest: 4 KiB random writes at queue depth 1 through the
            # agent, for longer than the migration; its largest write latency
            # is the longest stall the guest saw (the pause as the guest sees
            # it, plus any auto-converge delay and flush burst).
            guest = subprocess.Popen(
                [FERRY, "bench", "--nbd", f"127.0.0.1:{hport}", "--export", "vm", "--rw", "randwrite",
                 "--bs", "4K", "--iodepth", "1", "--range", "256M", "--runtime", str(GUEST_SECONDS), "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            extra.append(guest)
            time.sleep(2)
        args = ["migrate", "vm", "--to", f"127.0.0.1:{port}", "--json", "--max-downtime", "100ms"]
        if not dedup:
            args.append("--no-dedup")
        t = time.time()
        report = json.loads(src.ferry(*args))
        secs = time.time() - t
        out = {"bytes": link.bytes(name), "seconds": secs, "report": report}
        if load:
            try:
                g = json.loads(guest.communicate(timeout=GUEST_SECONDS + 60)[0])[0]
                out["guest_max_ms"] = g["lat_max_us"] / 1e3
                out["guest_p99_ms"] = g["lat_p99_us"] / 1e3
            except (subprocess.TimeoutExpired, ValueError, IndexError, KeyError) as e:
                print(f"guest bench gave no report: {e}", file=sys.stderr)
        return out
    finally:
        for p in extra:
            p.kill()
            p.wait()
        src.stop()
        dst.stop()


def qmp(sock_path, events=None):
    """A QMP caller; events read on the way are kept in `events` if given."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    f = s.makefile("rw")
    json.loads(f.readline())
    f.write(json.dumps({"execute": "qmp_capabilities"}) + "\n")
    f.flush()
    json.loads(f.readline())

    def call(cmd, **args):
        f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n")
        f.flush()
        while True:
            m = json.loads(f.readline())
            if "event" in m and events is not None:
                events.append(m)
            elif "return" in m or "error" in m:
                if "error" in m:
                    raise RuntimeError(f"{cmd}: {m['error']}")
                return m["return"]
    return call


def qmp_connect(qsock, tries=400):
    """A QMP caller on `qsock` once the daemon listens there."""
    for _ in range(tries):
        try:
            return qmp(qsock)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("qemu-storage-daemon QMP did not come up")


def mirror_to_nbd(call, port, **target):
    """blockdev-mirror (sync=full) of node "s" into the NBD export "t" at
    127.0.0.1:`port` (more options of the target node in `target`),
    completed once ready. Returns when it started, when it was told to
    complete (the guest stops there) and when it ended."""
    t = time.time()
    call("blockdev-add", driver="nbd", **{"node-name": "tgt", **target},
         server={"type": "inet", "host": "127.0.0.1", "port": str(port)}, export="t")
    call("blockdev-mirror", **{"job-id": "m"}, device="s", target="tgt", sync="full")
    completing = None
    while True:
        jobs = [j for j in call("query-jobs") if j["id"] == "m"]
        st = jobs[0]["status"] if jobs else "gone"
        if st == "ready" and completing is None:
            completing = time.time()
            call("job-complete", id="m")
        if st in ("concluded", "gone", "null"):
            break
        time.sleep(0.05)
    end = time.time()
    return t, completing or end, end


def run_qemu_mirror(work, link, image):
    target = os.path.join(work, "mirror-target.raw")
    with open(target, "wb") as f:
        f.truncate(volume_size(image))
    nport = free_port()
    dst = subprocess.Popen(
        ["qemu-storage-daemon", "--blockdev", f"file,filename={target},node-name=t",
         "--nbd-server", f"addr.type=inet,addr.host=127.0.0.1,addr.port={nport}",
         "--export", "type=nbd,id=e,node-name=t,name=t,writable=on"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(nport)
    name, port = link.proxy(f"127.0.0.1:{nport}")
    qsock = os.path.join(work, "qmp.sock")
    if os.path.exists(qsock):
        os.unlink(qsock)
    src = subprocess.Popen(
        ["qemu-storage-daemon", "--blockdev", f"file,filename={image},node-name=s,read-only=on",
         "--chardev", f"socket,id=q,path={qsock},server=on,wait=off", "--monitor", "chardev=q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t, _, end = mirror_to_nbd(qmp_connect(qsock), port)
        secs = end - t
    finally:
        for p in (src, dst):
            p.kill()
            p.wait()
    # toxiproxy counts a connection's bytes when it closes.
    ok = subprocess.run(["cmp", "-s", image, target]).returncode == 0
    os.unlink(target)
    return {"bytes": link.bytes(name), "seconds": secs, "verified": ok}


def run_rsync(work, link, base, image):
    d = os.path.join(work, "rsync-dst")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    rport = free_port()
    conf = os.path.join(work, "rsyncd.conf")
    with open(conf, "w") as f:
        f.write(f"port = {rport}\naddress = 127.0.0.1\nuse chroot = no\n"
                f"[m]\npath = {d}\nread only = no\nuid = root\ngid = root\n")
    daemon = subprocess.Popen(["rsync", "--daemon", "--no-detach", f"--config={conf}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(rport)
    name, port = link.proxy(f"127.0.0.1:{rport}")
    try:
        t = time.time()
        # The basis: the destination's base image, copied locally under the new name.
        subprocess.run(["cp", "--sparse=always", base, os.path.join(d, "vm.img")], check=True)
        # rsync at its best here: no --inplace (so a block may match
        # anywhere in the basis, not only ahead of where it is written) and
        # 4 KiB blocks (the images' file system block: more matches).
        subprocess.run(["rsync", "-z", "--no-whole-file", "-B", "4096", image,
                        f"rsync://127.0.0.1:{port}/m/vm.img"], check=True)
        secs = time.time() - t
        ok = subprocess.run(["cmp", "-s", image, os.path.join(d, "vm.img")]).returncode == 0
        return {"bytes": link.bytes(name), "seconds": secs, "verified": ok}
    finally:
        daemon.kill()
        daemon.wait()
        shutil.rmtree(d, ignore_errors=True)


CASYNC_MADE = {}
# casync fetches chunks one HTTP request at a time; at 100 ms RTT that is slow.
CASYNC_TIMEOUT = 300


def run_casync(work, link, base, image):
    """`casync make` at the source (once per image: its time is added to
    every run), then `casync extract --seed=base` over HTTP through the link."""
    if image not in CASYNC_MADE:
        s = os.path.join(work, f"casync-src-{len(CASYNC_MADE)}")
        shutil.rmtree(s, ignore_errors=True)
        os.makedirs(s)
        t = time.time()
        subprocess.run(["casync", "make", f"--store={s}/store.castr", f"{s}/vm.caibx", image],
                       check=True, capture_output=True)
        CASYNC_MADE[image] = (s, time.time() - t)
    s, make_secs = CASYNC_MADE[image]
    hport = free_port()
    srv = subprocess.Popen([sys.executable, "-m", "http.server", str(hport), "--bind", "127.0.0.1",
                            "--directory", s], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(hport)
    name, port = link.proxy(f"127.0.0.1:{hport}")
    out = os.path.join(work, "casync-out.img")
    try:
        t = time.time()
        try:
            subprocess.run(["casync", "extract", f"--store=http://127.0.0.1:{port}/store.castr",
                            f"--seed={base}", f"http://127.0.0.1:{port}/vm.caibx", out],
                           check=True, capture_output=True, timeout=CASYNC_TIMEOUT)
        except subprocess.TimeoutExpired:
            return {"bytes": link.bytes(name), "seconds": make_secs + CASYNC_TIMEOUT,
                    "make_seconds": make_secs, "extract_seconds": None, "verified": False,
                    "note": f"extract did not finish in {CASYNC_TIMEOUT} s"}
        extract_secs = time.time() - t
    finally:
        srv.kill()
        srv.wait()
    ok = subprocess.run(["cmp", "-s", image, out]).returncode == 0
    os.unlink(out)
    return {"bytes": link.bytes(name), "seconds": make_secs + extract_secs,
            "make_seconds": make_secs, "extract_seconds": extract_secs, "verified": ok}


def main():
    global GUEST_SECONDS
    ap = argparse.ArgumentParser()
    ap.add_argument("--rtt", type=int, action="append", help="round-trip time in ms (repeatable)")
    ap.add_argument("--mbit", type=float, default=100)
    ap.add_argument("--pairs", default="same", help="same,cross")
    # "pause-load" alone runs only the loaded pause measurement; "pause" both
    # pause measurements (idle and loaded) without a copy of its own.
    ap.add_argument("--peers", default="ferry,ferry-noindex,qemu-mirror,rsync,casync")
    ap.add_argument("--no-pause", action="store_true", help="skip the pause measurements that come with the ferry peer")
    ap.add_argument("--guest-seconds", type=int, default=GUEST_SECONDS,
                    help="how long the loaded pause's guest writes (must cover the move)")
    ap.add_argument("--images", default="/tmp/ferry-similarity")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log", help="append each result as a JSON line to this file as it comes")
    a = ap.parse_args()
    GUEST_SECONDS = a.guest_seconds
    rtts = a.rtt or [20, 100]
    if not all(os.path.exists(os.path.join(a.images, f)) for f in ("min.img", "lamp.img")):
        subprocess.run(["bash", os.path.join(ROOT, "bench", "similarity.sh"), a.images], check=True)
    if "cross" in a.pairs and not os.path.exists(os.path.join(a.images, "trixie-min.img")):
        subprocess.run(["bash", os.path.join(ROOT, "bench", "similarity.sh"), a.images],
                       env=dict(os.environ, RELEASE="trixie", ONLY_MIN="1"), check=True)
    if not os.environ.get("FERRY_BIN"):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "ferry-cli"], cwd=ROOT, check=True)
    pairs = {
        "same": (os.path.join(a.images, "min.img"), os.path.join(a.images, "lamp.img")),
        "cross": (os.path.join(a.images, "trixie-min.img"), os.path.join(a.images, "lamp.img")),
    }
    results = []
    work = tempfile.mkdtemp(prefix="ferry-migbench-")
    try:
        for pair in a.pairs.split(","):
            base, image = pairs[pair]
            for rtt in rtts:
                link = Link(work, a.mbit, rtt)
                try:
                    for peer in a.peers.split(","):
                        if peer in ("pause-load", "pause"):
                            continue  # only the loaded pause run, below
                        if peer == "ferry":
                            r = run_ferry(work, link, base, image)
                        elif peer == "ferry-noindex":
                            r = run_ferry(work, link, base, image, dedup=False)
                        elif peer == "qemu-mirror":
                            r = run_qemu_mirror(work, link, image)
                        elif peer == "rsync":
                            r = run_rsync(work, link, base, image)
                        elif peer == "casync":
                            r = run_casync(work, link, base, image)
                        else:
                            raise SystemExit(f"unknown peer {peer}")
                        r.update(pair=pair, rtt=rtt, peer=peer)
                        results.append(r)
                        if a.log:
                            with open(a.log, "a") as f:
                                f.write(json.dumps(r) + "\n")
                        print(f"{pair} rtt={rtt}ms {peer}: {r['bytes'] / 1e6:.1f} MB, {r['seconds']:.1f} s",
                              file=sys.stderr, flush=True)
                    peers = a.peers.split(",")
                    if not a.no_pause and ("ferry" in peers or "pause-load" in peers or "pause" in peers):
                        both = "ferry" in peers or "pause" in peers
                        for load in (False, True) if both else (True,):
                            r = run_ferry(work, link, base, image, load=load)
                            r.update(pair=pair, rtt=rtt, peer="ferry-pause-" + ("load" if load else "idle"))
                            results.append(r)
                            if a.log:
                                with open(a.log, "a") as f:
                                    f.write(json.dumps(r) + "\n")
                            seen = (f", largest guest write {r['guest_max_ms']:.0f} ms"
                                    if "guest_max_ms" in r else "")
                            print(f"{pair} rtt={rtt}ms pause ({'load' if load else 'idle'}): "
                                  f"{r['report']['time']['pause_ms']:.0f} ms{seen}", file=sys.stderr, flush=True)
                finally:
                    link.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(results, indent=1))
        return
    print(f"Link: {a.mbit:g} Mbit/s each way (toxiproxy bandwidth + latency toxics); "
          "bytes are both directions through the proxy.\n")
    print("| pair | RTT | tool | MB on the wire | time s | bytes vs ferry | time vs ferry | check |")
    print("|---|---|---|---|---|---|---|---|")
    for pair in a.pairs.split(","):
        for rtt in rtts:
            rows = [r for r in results if r["pair"] == pair and r["rtt"] == rtt and not r["peer"].startswith("ferry-pause")]
            f = next((r for r in rows if r["peer"] == "ferry"), None)
            for r in rows:
                check = "digest" if "report" in r and r["report"]["digest"]["matches"] else (
                    "cmp" if r.get("verified") else "FAILED" if "verified" in r or "report" in r else "")
                rb = f"{r['bytes'] / f['bytes']:.2f}" if f else ""
                rt = f"{r['seconds'] / f['seconds']:.2f}" if f else ""
                print(f"| {pair} | {rtt} ms | {r['peer']} | {r['bytes'] / 1e6:.1f} | {r['seconds']:.1f} | {rb} | {rt} | {check} |")
    print()
    print("| pair | RTT | ferry phase | value |")
    print("|---|---|---|---|")
    for r in results:
        if r["peer"] == "ferry":
            rep = r["report"]
            busy = rep["bytes"]["wire_tx"] / max(rep["time"]["fingerprints_s"] + rep["time"]["rounds_s"], 1e-3)
            print(f"| {r['pair']} | {r['rtt']} ms | chunks zero / local / sent | "
                  f"{rep['chunks']['zero']} / {rep['chunks']['local']} / {rep['chunks']['sent']} |")
            print(f"| {r['pair']} | {r['rtt']} ms | link use while sending | "
                  f"{100 * busy / (a.mbit * 1e6 / 8):.0f}% |")
        if r["peer"].startswith("ferry-pause"):
            rep = r["report"]
            seen = (f"; largest write latency the guest saw {r['guest_max_ms']:.0f} ms"
                    if "guest_max_ms" in r else "")
            print(f"| {r['pair']} | {r['rtt']} ms | pause, {r['peer'][12:]} | {rep['time']['pause_ms']:.0f} ms "
                  f"(rounds {rep['rounds']}, throttle max {rep['auto_converge']['max_delay_us']} us){seen} |")


if __name__ == "__main__":
    main()
