#!/usr/bin/env python3
"""What the host's memory sample pays to find a guest's resident pages:
the kernel's part of reading a process's whole pagemap in the sample's
batches (8,192 entries, 64 KiB a read), for a mapping of --gib GiB all
resident (a child process touches every page first).

    python3 bench/pagemap_cost.py [--gib 4] [--repeats 5]

Prints the wall and CPU seconds of each full read; the sample's own
parsing of the entries and its 16 MiB of page reads come on top.
"""
import argparse
import subprocess
import sys
import time

PAGE = 4096
BATCH = 8192


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    code = (f"import time\nb = bytearray({a.gib} << 30)\n"
            f"for i in range(0, len(b), {PAGE}):\n    b[i] = 1\n"
            "print('ready', flush=True)\ntime.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        start, end = max((tuple(int(x, 16) for x in line.split()[0].split("-"))
                          for line in open(f"/proc/{child.pid}/maps")), key=lambda r: r[1] - r[0])
        pages = (end - start) // PAGE
        for i in range(a.repeats):
            cpu, wall = time.process_time(), time.time()
            with open(f"/proc/{child.pid}/pagemap", "rb", buffering=0) as f:
                done = 0
                while done < pages:
                    n = min(BATCH, pages - done)
                    f.seek((start // PAGE + done) * 8)
                    f.read(n * 8)
                    done += n
            print(f"read {i + 1}: {pages} entries ({(end - start) / 2**30:.2f} GiB): "
                  f"{time.time() - wall:.3f} s wall, {time.process_time() - cpu:.3f} s CPU", flush=True)
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
