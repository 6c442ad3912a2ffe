"""Helpers every bench script shares: where ferry is, free ports, waiting
for a server to listen, medians and tool versions."""
import os, socket, statistics, subprocess, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# FERRY_BIN points the benches at another build (A/B runs against main).
FERRY = os.environ.get("FERRY_BIN") or os.path.join(ROOT, "target", "release", "ferry")


def ensure_ferry():
    if not os.path.exists(FERRY):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "ferry-cli"], cwd=ROOT, check=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, proc=None, timeout=30):
    """Wait until 127.0.0.1:port accepts; fail early if `proc` exits."""
    end = time.time() + timeout
    while time.time() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early: {proc.args}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def med(xs, k):
    return statistics.median(x[k] for x in xs)


def version(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0].strip()
    except Exception:
        return "?"
