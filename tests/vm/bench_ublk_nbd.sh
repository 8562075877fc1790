#!/usr/bin/env bash
# The relative benchmark of the two block bridges: flame-ublk (/dev/ublkb0)
# against flame-nbd with the kernel's NBD client (/dev/nbd0), on one Flame
# cluster, same run: 4 KiB random reads and writes at queue depth 1 and 32 with
# fio (libaio, O_DIRECT), each bridge on its own 1 GiB volume with one
# thread/queue and one connection. Prints a table of IOPS and the ratio.
#
# Runs in the test VM (scripts/bench-ublk-vs-nbd.sh starts it there) or, on a
# host whose kernel has ublk_drv and nbd loaded, directly as root
# (scripts/bench-ublk-vs-nbd.sh --here): the same script gives real figures
# there. In the VM the CPU is emulated (TCG): only the ratio means anything.
#
# Environment: FLAME_BIN (the binaries; a release build), BENCH_RUNTIME (seconds
# per fio run, default 10), BENCH_REGION_MIB (the range each run covers,
# prefilled first, default 64).
set -euo pipefail

BIN="${FLAME_BIN:?FLAME_BIN must name the directory of the flame binaries}"
DIR="${TMPDIR:-/tmp}/flame-bench-ublk-nbd"
RUNTIME="${BENCH_RUNTIME:-10}"
REGION_MIB="${BENCH_REGION_MIB:-64}"
NAME=bench
# shellcheck source=tests/vm/cluster.sh
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
trap 'fail "command failed at line $LINENO: $BASH_COMMAND"' ERR

for tool in fio nbd-client python3 dd; do
    command -v "$tool" >/dev/null || fail "required tool '$tool' is missing (apt-get install fio nbd-client python3)"
done
for b in flame-mgr flame-osd flame-nbd flame-ublk flame-admin; do
    [[ -x "$BIN/$b" ]] || fail "$BIN/$b missing: build it first (cargo build --release --workspace --bins --features flame-client/ublk)"
done
[[ -c /dev/ublk-control ]] || fail "/dev/ublk-control is missing: load ublk_drv (modprobe ublk_drv)"
[[ -b /dev/nbd0 ]] || fail "/dev/nbd0 is missing: load nbd (modprobe nbd)"
[[ -e /sys/block/ublkb0 ]] && fail "/dev/ublkb0 exists already: this benchmark creates it"
[[ -e /sys/block/nbd0/pid ]] && fail "/dev/nbd0 is connected already"

rm -rf "$DIR"
mkdir -p "$DIR/logs"
cd "$DIR"
cluster_up
admin volume create vublk --size 1G >/dev/null
admin volume create vnbd --size 1G >/dev/null

cat >nbd.yaml <<EOF2
mgr: "$MGR"
keyring: "$BRIDGE_KEYRING"
listen: "127.0.0.1:10809"
tcp_without_tls: true   # the VM is the only host; the kernel client speaks plain NBD
unix: null
metrics_listen: "127.0.0.1:9300"
threads: 1
poll_mode: interrupt
transport: tcp
$POOL_YAML
EOF2
cat >ublk.yaml <<EOF2
mgr: "$MGR"
keyring: "$BRIDGE_KEYRING"
volume: vublk
metrics_listen: "127.0.0.1:9310"
dev_id: 0
queues: 1
queue_depth: 64
poll_mode: interrupt
transport: tcp
$POOL_YAML
EOF2
"$BIN/flame-nbd" --config nbd.yaml >logs/nbd.log 2>&1 &
NBD_PID=$!
"$BIN/flame-ublk" --config ublk.yaml >logs/ublk.out 2>logs/ublk.log &
UBLK_PID=$!
cleanup() {
    nbd-client -d /dev/nbd0 >/dev/null 2>&1 || true
    kill -TERM "$UBLK_PID" "$NBD_PID" 2>/dev/null || true
    wait "$UBLK_PID" 2>/dev/null || true
}
trap cleanup EXIT
wait_port 10809 flame-nbd
timeout 60 nbd-client -N vnbd -timeout 60 127.0.0.1 10809 /dev/nbd0 >/dev/null || fail "nbd-client could not connect"
for ((i = 0; i < 600; i++)); do
    grep -q '^flame-ublk: /dev/ublkb0 ready' logs/ublk.out 2>/dev/null && break
    kill -0 "$UBLK_PID" 2>/dev/null || fail "flame-ublk exited"
    sleep 0.1
done
grep -q '^flame-ublk: /dev/ublkb0 ready' logs/ublk.out || fail "flame-ublk not ready after 60 s"
for ((i = 0; i < 100; i++)); do
    [[ "$(cat /sys/block/nbd0/size 2>/dev/null || echo 0)" != 0 ]] && break
    sleep 0.1
done
log "cluster, flame-nbd + nbd-client (/dev/nbd0) and flame-ublk (/dev/ublkb0) up"

# Reads must hit written data (a never-written object reads as zeroes without
# touching a disk).
for dev in /dev/ublkb0 /dev/nbd0; do
    dd if=/dev/urandom of="$dev" bs=1M count="$REGION_MIB" oflag=direct status=none || fail "prefilling $dev"
done
log "prefilled $REGION_MIB MiB on each device; $RUNTIME s per fio run"

# fio JSON -> IOPS and mean latency (us) of the run's direction.
parse() { # file rw
    python3 - "$1" "$2" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
d = job["read" if "read" in sys.argv[2] else "write"]
if job.get("error", 0) or d["io_bytes"] == 0:
    sys.exit("fio error %s, %s bytes" % (job.get("error"), d["io_bytes"]))
print("%.0f %.0f" % (d["iops"], d["lat_ns"]["mean"] / 1000.0))
PY
}
run() { # dev rw qd -> "iops lat_us"
    fio --name=b --filename="$1" --rw="$2" --bs=4k --iodepth="$3" --ioengine=libaio \
        --direct=1 --size="${REGION_MIB}M" --runtime="$RUNTIME" --time_based=1 \
        --randrepeat=0 --output-format=json --output="$DIR/fio.json" >/dev/null 2>"$DIR/fio.err" ||
        fail "fio $2 QD$3 on $1 failed: $(cat "$DIR/fio.err")"
    parse "$DIR/fio.json" "$2" || fail "fio $2 QD$3 on $1: no result"
}

RESULTS="$DIR/results"
: >"$RESULTS"
for qd in 1 32; do
    for rw in randread randwrite; do
        # The two bridges back to back for each workload, ublk first.
        read -r u_iops u_lat <<<"$(run /dev/ublkb0 "$rw" "$qd")"
        read -r n_iops n_lat <<<"$(run /dev/nbd0 "$rw" "$qd")"
        echo "$rw $qd $u_iops $u_lat $n_iops $n_lat" >>"$RESULTS"
        log "$rw QD$qd: ublk $u_iops IOPS (${u_lat} us), nbd $n_iops IOPS (${n_lat} us)"
    done
done

echo
echo "4 KiB, fio libaio O_DIRECT, ${RUNTIME} s per run, one thread/queue per bridge, 3 OSDs (tcp), $(uname -r)"
python3 - "$RESULTS" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
print("| workload | flame-ublk IOPS | flame-nbd + nbd-client IOPS | ublk / nbd IOPS | ublk / nbd mean latency |")
print("|---|---:|---:|---:|---:|")
for rw, qd, ui, ul, ni, nl in rows:
    ui, ul, ni, nl = map(float, (ui, ul, ni, nl))
    ratio = ui / ni if ni else float("nan")
    lat = ul / nl if nl else float("nan")
    print(f"| 4k {rw} QD{qd} | {ui:.0f} | {ni:.0f} | {ratio:.2f} | {lat:.2f} |")
PY
echo "bench_ublk_nbd: OK"
