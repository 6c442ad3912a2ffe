#!/usr/bin/env bash
# A throw-away Ceph cluster on this machine, from Debian's packages (ceph-mon,
# ceph-mgr, ceph-osd): one monitor, one manager, N OSDs, cephx on, every file
# under one directory, daemons on loopback ports of their own. Tests start
# one (or two, for migrations between clusters) and stop it at the end; a
# developer can start one by hand:
#
#   bash scripts/ceph-cluster.sh start DIR [--port P] [--osds N] [--store memstore|bluestore] [--pool NAME] [--no-mgr]
#   bash scripts/ceph-cluster.sh stop DIR
#   CEPH_CONF=DIR/ceph.conf ceph -s
#
# `start` prints nothing but errors; afterwards DIR/ceph.conf and
# DIR/keyring (client.admin) reach the cluster, and DIR/env says how:
# CEPH_CONF=..., CEPH_KEYRING=..., CEPH_POOL=.... OSDs keep their objects in
# memory (memstore, the default: quick, lost at stop) or in a sparse file
# each (bluestore: survives an OSD restart). `stop` kills every daemon whose
# pid file is under DIR and waits for them; the directory stays for reading
# logs (DIR/log) until the caller removes it.
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || usage
shift 2

stop_cluster() {
    local d=$1 pids=() pf
    for pf in "$d"/run/*.pid; do
        [ -e "$pf" ] || continue
        pids+=("$(cat "$pf")")
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 100); do
        local alive=0 p
        for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
    rm -f "$d"/run/*.pid
}

if [ "$cmd" = stop ]; then
    stop_cluster "$dir"
    exit 0
fi
[ "$cmd" = start ] || usage

port=0; osds=1; store=memstore; pool=rbd; mgr=1
while [ $# -gt 0 ]; do
    case $1 in
        --port) port=$2; shift 2 ;;
        --osds) osds=$2; shift 2 ;;
        --store) store=$2; shift 2 ;;
        --pool) pool=$2; shift 2 ;;
        --no-mgr) mgr=0; shift ;;
        *) usage ;;
    esac
done
case $store in memstore|bluestore) ;; *) echo "ceph-cluster: --store is memstore or bluestore" >&2; exit 2 ;; esac
for prog in ceph-mon ceph-osd ceph-authtool monmaptool ceph rbd; do
    command -v "$prog" >/dev/null || { echo "ceph-cluster: $prog missing (apt-get install ceph-mon ceph-osd ceph-mgr ceph-common)" >&2; exit 1; }
done
if [ "$port" = 0 ]; then
    # A free loopback port: the kernel's pick, released just before the monitor binds it.
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
fi

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ -e "$dir/ceph.conf" ]; then
    echo "ceph-cluster: $dir already holds a cluster (stop it and remove the directory first)" >&2
    exit 1
fi
mkdir -p "$dir/run" "$dir/log"
fsid=$(cat /proc/sys/kernel/random/uuid)
conf=$dir/ceph.conf

cat > "$conf" <<EOF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$port
public network = 127.0.0.0/8
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/keyring
run dir = $dir/run
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
# No syslog, no crash dumps outside the directory.
log to syslog = false
err to syslog = false
crash dir = $dir/crash
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
ms bind ipv4 = true
ms bind ipv6 = false
auth allow insecure global id reclaim = false
mon warn on msgr2 not enabled = false
[mon]
admin socket = $dir/run/\$name.asok
mon data = $dir/mon.\$id
mon data avail warn = 2
mon data avail crit = 1
mon cluster log file = $dir/log/cluster.log
[mgr]
admin socket = $dir/run/\$name.asok
mgr data = $dir/mgr.\$id
keyring = $dir/mgr.\$id/keyring
mgr disabled modules = dashboard prometheus restful
[osd]
admin socket = $dir/run/\$name.asok
osd data = $dir/osd.\$id
keyring = $dir/osd.\$id/keyring
osd objectstore = $store
memstore device bytes = 4294967296
bluestore block path = $dir/osd.\$id/block.file
bluestore block create = true
bluestore block size = 10737418240
bluestore fsck on mkfs = false
osd op num shards = 1
osd op num threads per shard = 2
EOF

ceph-authtool --create-keyring "$dir/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool --create-keyring "$dir/keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
ceph-authtool "$dir/mon.keyring" --import-keyring "$dir/keyring" >/dev/null
monmaptool --create --fsid "$fsid" --addv a "[v1:127.0.0.1:$port]" "$dir/monmap" >/dev/null
ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/mon.keyring"
ceph-mon -c "$conf" -i a

c() { timeout 60 ceph -c "$conf" "$@"; }
# The monitor answers once it has formed its quorum of one.
for i in $(seq 1 100); do
    c --connect-timeout 5 mon stat >/dev/null 2>&1 && break
    [ "$i" = 100 ] && { echo "ceph-cluster: the monitor did not answer (see $dir/log/mon.a.log)" >&2; stop_cluster "$dir"; exit 1; }
    sleep 0.2
done

if [ $mgr = 1 ]; then
    mkdir -p "$dir/mgr.x"
    c auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' > "$dir/mgr.x/keyring"
    ceph-mgr -c "$conf" -i x
fi

for n in $(seq 1 "$osds"); do
    uuid=$(cat /proc/sys/kernel/random/uuid)
    secret=$(ceph-authtool --gen-print-key)
    echo "{\"cephx_secret\": \"$secret\"}" > "$dir/osd-secret.json"
    id=$(c osd new "$uuid" -i "$dir/osd-secret.json")
    rm -f "$dir/osd-secret.json"
    mkdir -p "$dir/osd.$id"
    ceph-authtool --create-keyring "$dir/osd.$id/keyring" --name "osd.$id" --add-key "$secret" >/dev/null
    ceph-osd -c "$conf" -i "$id" --mkfs --key "$secret" --osd-uuid "$uuid" >"$dir/log/osd.$id.mkfs.log" 2>&1 || {
        echo "ceph-cluster: mkfs of osd.$id failed (see $dir/log/osd.$id.mkfs.log)" >&2; stop_cluster "$dir"; exit 1; }
    ceph-osd -c "$conf" -i "$id" 2>>"$dir/log/osd.$id.start.log"
done

# Every OSD up and in before the pool is made.
for i in $(seq 1 300); do
    up=$(c osd stat -f json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("num_up_osds",0))' 2>/dev/null || echo 0)
    [ "$up" -ge "$osds" ] && break
    [ "$i" = 300 ] && { echo "ceph-cluster: only $up of $osds OSDs came up (see $dir/log)" >&2; stop_cluster "$dir"; exit 1; }
    sleep 0.2
done

c osd pool create "$pool" 8 8 >/dev/null 2>&1
c osd pool application enable "$pool" rbd >/dev/null 2>&1
timeout 60 rbd -c "$conf" pool init "$pool"
# Placement groups active (I/O would wait on them otherwise).
for i in $(seq 1 300); do
    if c pg stat 2>/dev/null | grep -q 'active+clean' && ! c pg stat 2>/dev/null | grep -Eq 'creating|peering|unknown|activating'; then
        break
    fi
    [ "$i" = 300 ] && { echo "ceph-cluster: placement groups of $pool not active (see $dir/log)" >&2; stop_cluster "$dir"; exit 1; }
    sleep 0.2
done

cat > "$dir/env" <<EOF
CEPH_CONF=$conf
CEPH_KEYRING=$dir/keyring
CEPH_POOL=$pool
CEPH_MON=127.0.0.1:$port
EOF
