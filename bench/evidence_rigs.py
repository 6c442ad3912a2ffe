"""The parts the evidence experiments are built from: a ferry storage daemon
serving NBD and iSCSI, a toxiproxy link whose round trip can be changed,
QEMU's iSCSI initiator (qemu-storage-daemon) re-exported as a local NBD
socket so that fio drives both protocols the same way, fio itself, and the
CPU time a process used."""
import json, os, shutil, socket, subprocess, time, urllib.error

from common import FERRY, ensure_ferry, free_port, wait_port
from migration_peers import http as _http

IQN = "iqn.2026-11.io.ferry"


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ext4_volume(storage, work, name="root", mib=64):
    """An empty ext4 file system as volume `name` of `storage` (a daemon with `.ferry(...)`)."""
    img = os.path.join(work, f"{name}.img")
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", img, f"{mib}M"], check=True, capture_output=True)
    storage.ferry("volume", "create", name, "--size", str(mib << 20))
    storage.ferry("volume", "import", name, img)
    os.unlink(img)


class Controller:
    """`ferry control run` over the inventory `inv` (written to `inv_file`),
    cycling every 2 s on 1 s samples, started paused so that no cycle runs
    on the default policy; `policy()` reads it, `put_policy()` sets it."""

    def __init__(self, work, inv):
        self.inv_file = os.path.join(work, "inventory.json")
        with open(self.inv_file, "w") as f:
            json.dump(inv, f)
        port = free_port()
        self.proc = subprocess.Popen(
            [FERRY, "control", "run", "--state-dir", os.path.join(work, "controller"), "--listen",
             f"127.0.0.1:{port}", "--interval", "2s", "--sample", "1s", "--inventory", self.inv_file, "--paused"],
            env=dict(os.environ, FERRY_LOG="warn"), stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(work, "controller.log"), "w"))
        wait_port(port, self.proc)
        self.api = f"http://127.0.0.1:{port}"

    def get(self, path):
        return json.loads(_http("GET", self.api + path))

    def policy(self):
        return self.get("/v1/settings")["policy"]

    def put_policy(self, pol):
        _http("PUT", self.api + "/v1/policy", pol)

    def journal(self, limit=200):
        return self.get(f"/v1/journal?limit={limit}")

    def stop(self):
        self.proc.kill()
        self.proc.wait()


def journal_events(journal, t0):
    """The controller's decisions, move starts and ends from its journal,
    as {"t": seconds since t0, "what": text}, in time order."""
    events = []
    for e in journal:
        if e["event"] not in ("decided", "started", "finished") or not e.get("acted", True):
            continue
        what = e["event"] + ": " + (e.get("vm", "") or e.get("outcome", {}).get("vm", ""))
        if e["event"] == "decided":
            what += f" {e['action']}" + (f" ({e['reason']})" if e.get("reason") else "")
        if e["event"] == "finished":
            o = e["outcome"]
            what += (f" {o['action']} {o['result']} in {o['seconds']:.1f} s (predicted "
                     f"{o['predicted_seconds']:.1f} s), {o['bytes'] / 1e6:.2f} MB (predicted "
                     f"{o['predicted_bytes'] / 1e6:.2f} MB)")
        events.append({"t": e["at_unix"] - t0, "what": what})
    return sorted(events, key=lambda e: e["t"])


def mark_events(ax, events, rtt_hi, top):
    """A threshold run's events (`journal_events` and the RTT's rise) as
    dashed lines on `ax`, each labelled at a height of its own below `top`."""
    marks = {"RTT": ("red", f"RTT → {rtt_hi} ms"), "decided": ("orange", "decided"),
             "started": ("purple", "move started"), "finished": ("green", "move ended")}
    for i, e in enumerate(sorted(events, key=lambda e: e["t"])):
        c, label = next((v for k, v in marks.items() if e["what"].startswith(k)), ("grey", e["what"][:20]))
        ax.axvline(e["t"], color=c, ls="--", lw=1)
        ax.annotate(label, (e["t"], top * (0.25 + 0.2 * (i % 4))), xytext=(4, 0), textcoords="offset points",
                    fontsize=8, color=c)


def two_site_inventory(link, A, B, sa, sb, rtt_ms, mbit):
    """The controller's inventory of sites a (host A, storage sa) and b
    (B, sb), each reached from the other through a new proxy of `link`
    (`migration_peers.Link`): returns (inventory, {what: (proxy name,
    port)}) for what in nbd_a, nbd_b, moves_a, moves_b, mig_a, mig_b."""
    p = {f"{kind}_{site}": link.proxy(f"127.0.0.1:{port}")
         for site, h, st in (("a", A, sa), ("b", B, sb))
         for kind, port in (("nbd", st.nbd), ("moves", h.moves), ("mig", st.mig))}

    def site(name, h, st):
        return {"name": name, "cpu_capacity": 8,
                "hosts": [{"control": f"127.0.0.1:{h.control}", "moves": f"127.0.0.1:{p['moves_' + name][1]}"}],
                "storage": [{"nbd": f"127.0.0.1:{p['nbd_' + name][1]}", "nbd_local": f"127.0.0.1:{st.nbd}",
                             "migrate": f"127.0.0.1:{p['mig_' + name][1]}", "admin": f"127.0.0.1:{st.admin}"}]}
    inv = {"sites": [site("a", A, sa), site("b", B, sb)],
           "links": [{"a": "a", "b": "b", "rtt_ms": rtt_ms, "bandwidth": mbit * 125000}]}
    return inv, p


class Storage:
    """`ferry serve` with NBD, one iSCSI portal and the admin API."""

    def __init__(self, work):
        ensure_ferry()
        os.makedirs(work, exist_ok=True)
        self.nbd, self.iscsi, self.admin = free_port(), free_port(), free_port()
        self.log = open(os.path.join(work, "serve.log"), "w")
        self.proc = subprocess.Popen(
            [FERRY, "serve", "--pool", os.path.join(work, "pool"), "--nbd", f"127.0.0.1:{self.nbd}",
             "--iscsi", f"127.0.0.1:{self.iscsi}", "--admin", f"127.0.0.1:{self.admin}",
             # Images come from several work directories; this loopback
             # daemon is the bench's own.
             "--allow-path", "/"],
            env=dict(os.environ, FERRY_LOG="warn"), stdout=subprocess.DEVNULL, stderr=self.log)
        for p in (self.admin, self.nbd, self.iscsi):
            wait_port(p, self.proc)

    def ferry(self, *args):
        env = dict(os.environ, FERRY_ADMIN=f"127.0.0.1:{self.admin}")
        return subprocess.run([FERRY, *args], env=env, check=True, capture_output=True, text=True).stdout

    def volume(self, name, path=None, size=None):
        args = ["volume", "create", name]
        args += ["--path", path] if path else ["--size", str(size)]
        self.ferry(*args)

    def cpu_seconds(self):
        return cpu_seconds(self.proc.pid)

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self):
        stop(self.proc)
        self.log.close()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Link:
    """toxiproxy: proxies whose round-trip time (half each way) and
    bandwidth cap can be set while clients use them."""

    def __init__(self, work):
        self.api_port = free_port()
        self.proc = subprocess.Popen(
            ["toxiproxy-server", "-host", "127.0.0.1", "-port", str(self.api_port)],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "toxiproxy.log"), "w"))
        self.api = f"http://127.0.0.1:{self.api_port}"
        end = time.time() + 30
        while True:
            try:
                _http("GET", self.api + "/version")
                break
            except OSError:
                if time.time() > end:
                    raise
                time.sleep(0.05)

    def proxy(self, name, upstream_port):
        port = free_port()
        _http("POST", self.api + "/proxies",
              {"name": name, "listen": f"127.0.0.1:{port}", "upstream": f"127.0.0.1:{upstream_port}",
               "enabled": True})
        return port

    def set_rtt(self, name, rtt_ms):
        for s in ("upstream", "downstream"):
            try:
                _http("DELETE", f"{self.api}/proxies/{name}/toxics/delay-{s}")
            except urllib.error.HTTPError:
                pass
            if rtt_ms > 0:
                _http("POST", f"{self.api}/proxies/{name}/toxics",
                      {"name": f"delay-{s}", "type": "latency", "stream": s,
                       "attributes": {"latency": int(rtt_ms) // 2}})

    def close(self):
        stop(self.proc)


class IscsiBridge:
    """QEMU's iSCSI initiator (the one a guest's disk would use) logged in
    to `portal`, its LUN re-exported as NBD on a unix socket for fio."""

    def __init__(self, work, portal_port, volume, name="bridge"):
        self.sock = os.path.join(work, f"{name}.sock")
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.proc = subprocess.Popen(
            ["qemu-storage-daemon",
             "--blockdev", f"driver=iscsi,node-name=d,transport=tcp,portal=127.0.0.1:{portal_port},"
                           f"target={IQN}:{volume},lun=0,cache.direct=on",
             "--nbd-server", f"addr.type=unix,addr.path={self.sock}",
             "--export", "type=nbd,id=e,node-name=d,name=d,writable=on"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, f"{name}.log"), "w"))
        end = time.time() + 30
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.time() > end:
                raise RuntimeError(f"qemu-storage-daemon did not log in to iSCSI portal {portal_port}")
            time.sleep(0.05)
        self.uri = f"nbd+unix:///d?socket={self.sock}"

    def stop(self):
        stop(self.proc)


def fio(uri, *, rw, bs=None, bssplit=None, iodepth=1, rwmixread=None, size="64M", number_ios=None,
        runtime=None, think_us=None, extra=()):
    """One fio job through libnbd; returns IOPS, MB/s, mean latency (ms),
    run time (s) and fio's own CPU share."""
    cmd = ["fio", "--name=j", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--iodepth={iodepth}",
           f"--size={size}", "--output-format=json", "--randrepeat=0"]
    if bs:
        cmd.append(f"--bs={bs}")
    if bssplit:
        cmd.append(f"--bssplit={bssplit}")
    if rwmixread is not None:
        cmd.append(f"--rwmixread={rwmixread}")
    if number_ios:
        cmd.append(f"--number_ios={number_ios}")
    if runtime:
        cmd += ["--time_based", f"--runtime={runtime}"]
    if think_us:
        # Sleeping think time: fio's spinning variant (thinktime_spin) stalls
        # its nbd engine for seconds at random (seen with nbdkit too).
        cmd.append(f"--thinktime={think_us}")
    cmd += list(extra)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=(runtime or 0) + 900).stdout
    return fio_summary(out)


def fio_summary(out):
    """IOPS, MB/s, mean latency (ms), run time (s) and fio's own CPU share from fio's JSON output (which
    libnbd may precede with a line of its own)."""
    j = json.loads(out[out.index("{"):])["jobs"][0]
    r, w = j["read"], j["write"]
    ios = r["total_ios"] + w["total_ios"]
    lat = (r["lat_ns"]["mean"] * r["total_ios"] + w["lat_ns"]["mean"] * w["total_ios"]) / max(ios, 1) / 1e6
    return {"iops": r["iops"] + w["iops"], "mbps": (r["bw_bytes"] + w["bw_bytes"]) / 1e6, "lat_ms": lat,
            "seconds": j["job_runtime"] / 1e3, "client_cpu": j.get("usr_cpu", 0) + j.get("sys_cpu", 0)}


def drop_host_caches():
    """Write back and drop the host's page cache; False where this process may not."""
    subprocess.run(["sync"])
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def random_image(path, size, data_share=1.0, stripe=4 << 20):
    """A file of `size` bytes: per stripe, the first `data_share` of it random
    data and the rest a hole (so that the zero share is known)."""
    with open(path, "wb") as f:
        f.truncate(size)
        data = int(stripe * data_share)
        for off in range(0, size, stripe):
            n = min(data, size - off)
            if n > 0:
                f.seek(off)
                f.write(os.urandom(n))


def ext4_image(path, src_dirs, size_mib):
    """An ext4 image holding copies of `src_dirs` (mke2fs -d, no mount)."""
    stage = path + ".d"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    for d in src_dirs:
        subprocess.run(["cp", "-a", d, os.path.join(stage, os.path.basename(d.rstrip("/")))], check=True)
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-d", stage, path, f"{size_mib}M"], check=True)
    shutil.rmtree(stage, ignore_errors=True)


def zero_share(path, block=4096):
    """Share of `block`-sized blocks of a file that are all zero (holes count)."""
    size = os.path.getsize(path)
    zeros, total, z = 0, size // block, bytes(block)
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            try:
                data_at = os.lseek(f.fileno(), pos, os.SEEK_DATA)
            except OSError:
                data_at = size
            zeros += (data_at - pos) // block
            if data_at >= size:
                break
            hole_at = os.lseek(f.fileno(), data_at, os.SEEK_HOLE)
            f.seek(data_at)
            left = hole_at - data_at
            while left > 0:
                chunk = f.read(min(left, 8 << 20))
                if not chunk:
                    break
                left -= len(chunk)
                for i in range(0, len(chunk) - block + 1, block):
                    if chunk[i:i + block] == z:
                        zeros += 1
            pos = hole_at
    return zeros / max(total, 1)


def sock_ok(port):
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False
