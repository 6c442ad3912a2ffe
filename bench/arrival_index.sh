#!/usr/bin/env bash
# What indexing a volume that just arrived by migration costs its
# neighbours at the destination: a 1 GiB random volume migrates between
# two daemons on loopback (plaintext) while a single-threaded CPU-bound
# probe runs; right after the switch a second client writes 4 KiB + flush
# to the arrived volume for 3 s. Prints the probe's rate per second after
# the switch (and as a share of its rate before), the writer's rate and
# latency, and how long the background index took.
#   bash bench/arrival_index.sh [FERRY_BINARY]      (A/B: run it with each build, alternating)
set -u
BIN=${1:-$(cd "$(dirname "$0")/.." && pwd)/target/release/ferry}
PY=/usr/bin/python3   # python3-libnbd is Debian's
W=$(mktemp -d)
trap 'kill $pa $pb 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
cat > "$W/probe.py" <<'EOF'
import time, sys, hashlib
end = time.monotonic() + float(sys.argv[1])
buf = b"x" * 65536
out = []
while time.monotonic() < end:
    for _ in range(60):
        hashlib.sha256(buf).digest()
    out.append(time.monotonic())
print("\n".join(f"{t:.4f}" for t in out))
EOF
cat > "$W/io.py" <<'EOF'
import nbd, sys, time, os
h = nbd.NBD()
h.connect_uri(sys.argv[1])
buf, size, lat, i = os.urandom(4096), h.get_size(), [], 0
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t = time.monotonic()
    h.pwrite(buf, (i * 7919 * 4096) % (size - 4096))
    h.flush()
    lat.append((time.monotonic() - t) * 1000)
    i += 1
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
print(f"writer after the switch: {len(lat)/float(sys.argv[2]):.0f} ops/s, p50 {q(0.5):.2f} ms, p99 {q(0.99):.2f} ms, max {lat[-1]:.1f} ms")
EOF
"$BIN" serve --pool "$W/a" --nbd 127.0.0.1:13809 --admin 127.0.0.1:13880 >"$W/a.log" 2>&1 &
pa=$!
"$BIN" serve --pool "$W/b" --nbd 127.0.0.1:14809 --admin 127.0.0.1:14880 \
  --migrate 127.0.0.1:14900 --migrate-plaintext >"$W/b.log" 2>&1 &
pb=$!
sleep 1
"$BIN" volume create v --size 1G --admin 127.0.0.1:13880 >/dev/null
head -c 1G /dev/urandom >"$W/img"
"$BIN" volume import v "$W/img" --admin 127.0.0.1:13880 >/dev/null 2>&1
sync
rm "$W/img"
$PY "$W/probe.py" 14 >"$W/probe.txt" &
pp=$!
sleep 2
now() { $PY -c 'import time; print(time.monotonic())'; }
t0=$(now)
"$BIN" migrate v --to 127.0.0.1:14900 --plaintext --no-compress --json --admin 127.0.0.1:13880 >"$W/report.json" 2>"$W/mig.err" \
  || { echo "migration failed: $(tail -1 "$W/mig.err")"; exit 1; }
t1=$(now)
$PY "$W/io.py" nbd://127.0.0.1:14809/v 3
wait $pp
$PY - "$W/probe.txt" "$t0" "$t1" <<'EOF'
import sys
ts = [float(x) for x in open(sys.argv[1]) if x.strip()]
t0, t1 = float(sys.argv[2]), float(sys.argv[3])
rate = lambda a, b: sum(1 for t in ts if a <= t < b) / (b - a)
base = rate(t0 - 1.8, t0)
after = [rate(t1 + i, t1 + i + 1) for i in range(3)]
print(f"migration {t1 - t0:.1f} s; CPU probe before {base:.0f}/s; seconds 1-3 after the switch: "
      + ", ".join(f"{a:.0f} ({a / base:.2f})" for a in after))
EOF
sleep 3
sed 's/\x1b\[[0-9;]*m//g' "$W/b.log" | grep -o 'indexed the migrated volume.*seconds=[0-9.]*' \
  | sed 's/.*seconds=/background index took (s): /'
