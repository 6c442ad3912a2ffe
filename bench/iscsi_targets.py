"""Start and stop the iSCSI targets compared in bench/: ferry (release
build) and tgt (Debian `tgt`, file-backed LUN), each on loopback ports of
its own. Shared by bench/iscsi_peers.py and bench/iscsi_conformance.py."""
import os, subprocess

from common import FERRY, ensure_ferry, free_port, wait_port

IQN = "iqn.2026-11.io.ferry"


def stop(proc):
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


class Ferry:
    """`ferry serve` with two iSCSI portals; volumes made from images."""

    def __init__(self, work, portals=2, config=None):
        ensure_ferry()
        self.ports = [free_port() for _ in range(portals)]
        self.admin = f"127.0.0.1:{free_port()}"
        # Images come from several work directories; this loopback daemon is
        # the bench's own, so any file may be made a volume.
        args = [FERRY, "serve", "--pool", os.path.join(work, "pool"), "--nbd", "", "--admin", self.admin,
                "--allow-path", "/"]
        if config:
            # Extra settings as TOML text (e.g. "[storage]\nsanitize_bytes_per_sec = 1").
            os.makedirs(work, exist_ok=True)
            path = os.path.join(work, "ferry.toml")
            with open(path, "w") as fh:
                fh.write(config)
            args += ["--config", path]
        for p in self.ports:
            args += ["--iscsi", f"127.0.0.1:{p}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(int(self.admin.split(":")[1]), self.proc)
        for p in self.ports:
            wait_port(p, self.proc)
        self.name = "ferry"

    def add(self, volume, image=None, size=None, read_only=False, physical_block_size=None):
        cmd = [FERRY, "volume", "create", volume, "--admin", self.admin]
        if physical_block_size:
            cmd += ["--physical-block-size", str(physical_block_size)]
        if image:
            cmd += ["--path", image]
        else:
            cmd += ["--size", str(size)]
        if read_only:
            cmd += ["--read-only"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return [f"iscsi://127.0.0.1:{p}/{IQN}:{volume}/0" for p in self.ports]

    def stop(self):
        stop(self.proc)


class Tgt:
    """tgtd in the foreground on its own portal and control port."""

    def __init__(self, work):
        self.port = free_port()
        self.ctl = str(1000 + self.port % 1000)  # tgtd accepts small control port numbers only
        self.proc = subprocess.Popen(["tgtd", "-f", "--iscsi", f"portal=127.0.0.1:{self.port}", "-C", self.ctl],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, self.proc)
        self.tid = 0
        self.name = "tgt"

    def adm(self, *args):
        subprocess.run(["tgtadm", "-C", self.ctl, "--lld", "iscsi"] + list(args), check=True)

    def add(self, volume, image, read_only=False):
        self.tid += 1
        iqn = f"iqn.2026-11.test.tgt:{volume}"
        self.adm("--op", "new", "--mode", "target", "--tid", str(self.tid), "-T", iqn)
        self.adm("--op", "new", "--mode", "logicalunit", "--tid", str(self.tid), "--lun", "1", "-b", image)
        if read_only:
            self.adm("--op", "update", "--mode", "logicalunit", "--tid", str(self.tid), "--lun", "1",
                     "--params", "readonly=1")
        self.adm("--op", "bind", "--mode", "target", "--tid", str(self.tid), "-I", "ALL")
        return [f"iscsi://127.0.0.1:{self.port}/{iqn}/1"]

    def stop(self):
        stop(self.proc)
