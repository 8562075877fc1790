#!/usr/bin/env bash
# Runs INSIDE the test VM (scripts/vm.sh; started by tests/tests/rdma_vm.rs): a
# Flame cluster on `transport: rdma` over Soft-RoCE, and a data test through NBD.
#
#   1. rxe0 on dummy0 (tests/vm/soft_roce.sh). flame-mgr and three flame-osd
#      (tests/vm/cluster.sh, CLUSTER_TRANSPORT=rdma) and flame-nbd from
#      $FLAME_BIN (the host's build with --features
#      flame-osd/rdma,flame-client/rdma, seen read-only over 9p), all state in a
#      guest tmpfs; the OSDs and flame-nbd on `transport: rdma`, so flame-nbd ->
#      OSD and OSD -> OSD (replication) connections are RDMA queue pairs on rxe0
#      (their TCP bootstraps on the guest's loopback). flame-nbd converts
#      every request of 4 KiB and more (`transfer_mode: convert`: writes pulled by
#      the OSD with RDMA READ, reads pushed with RDMA WRITE) and fetches its
#      replies (`reply_mode: fetch`: RDMA READs of the OSD's reply area).
#   2. qemu-io (NBD over loopback to flame-nbd): patterns of 512 B .. 4 MiB, one
#      across an object boundary, written and read back verified in one session,
#      then read back again in a fresh session.
#   3. The counters say it ran over verbs: the OSDs' converted requests and
#      replies left in reply areas, flame-nbd's converted requests and fetch hits,
#      every daemon's flame_rdma_completions_total (successful RDMA READ / WRITE /
#      SEND / RECV completions; only a device makes them), rxe0's packet counters.
#   4. Replication: osd.0 is killed (SIGKILL); once the manager has it down, every
#      pattern reads back from the two other copies (their primaries) — still
#      over rdma, on connections flame-nbd re-made.
# Prints "rdma_cluster: OK" at the end; any failure exits non-zero with the logs.
set -euo pipefail

BIN="${FLAME_BIN:?FLAME_BIN must name the directory of the flame binaries (built with --features flame-osd/rdma,flame-client/rdma)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NAME=rdma_cluster
DIR="${TMPDIR:-/tmp}/flame-rdma-cluster"
NBD_PORT=10809
VOLUME=vol
START=$SECONDS
CLUSTER_TRANSPORT=rdma
# shellcheck source=tests/vm/soft_roce.sh
source "$HERE/soft_roce.sh"
# shellcheck source=tests/vm/cluster.sh
source "$HERE/cluster.sh"
# Each RDMA connection pins 1 MiB of slots beside the pool; the guest runs as
# root (no RLIMIT_MEMLOCK). 16 MiB per thread: 4 MiB patterns are converted.
POOL_YAML='memory_pool: {bytes_per_thread: 16777216, large_bytes_per_thread: 16777216}'
trap 'fail "command failed at line $LINENO: $BASH_COMMAND"' ERR

for tool in qemu-io curl timeout awk; do
    command -v "$tool" >/dev/null || fail "required tool '$tool' is missing on the host (apt-get install qemu-utils curl)"
done
for b in flame-mgr flame-osd flame-nbd flame-admin; do
    [[ -x "$BIN/$b" ]] || fail "$BIN/$b missing: build it first (cargo build --bins --features flame-osd/rdma,flame-client/rdma)"
done

soft_roce_up

rm -rf "$DIR"
mkdir -p "$DIR/logs"
cd "$DIR"

# Every daemon's /metrics, fetched once into metrics.PORT (each exec costs a
# visible fraction of a second in this emulated guest).
fetch_metrics() {
    local port
    for port in 9200 9201 9202 9300; do
        curl -sf --max-time 10 "http://127.0.0.1:$port/metrics" >"metrics.$port" ||
            fail "GET /metrics on port $port failed"
    done
}
# Sum of every sample of metric PREFIX (name and the start of its labels) in
# the files given, with bash builtins only.
metric_sum() { # prefix file...
    local prefix="$1" line s=0 f
    shift
    for f in "$@"; do
        while read -r line; do
            [[ "$line" == "$prefix"* ]] && s=$((s + ${line##* }))
        done <"$f"
    done
    echo "$s"
}
metric() { metric_sum "$2" "metrics.$1"; }
osd_metric() { metric_sum "$1" metrics.9200 metrics.9201 metrics.9202; }

# ---------------------------------------------------------------- the cluster
cluster_up
for n in 0 1 2; do
    grep -q "RDMA device opened" "logs/osd.$n.log" || fail "osd.$n did not open the RDMA device"
done
cat >nbd.yaml <<EOF
mgr: "$MGR"
keyring: "$BRIDGE_KEYRING"
listen: "127.0.0.1:$NBD_PORT"
tcp_without_tls: true   # the VM is the only host; the kernel client speaks plain NBD
unix: null
metrics_listen: "127.0.0.1:9300"
threads: 1
poll_mode: interrupt
transport: rdma
transfer_mode: convert
convert_threshold_bytes: {tcp: 4294967295, shm: 65536, rdma: 4096}
reply_mode: fetch
$POOL_YAML
EOF
admin volume create "$VOLUME" --size 256M >/dev/null
"$BIN/flame-nbd" --config nbd.yaml >logs/nbd.log 2>&1 &
NBD_PID=$!
wait_port "$NBD_PORT" flame-nbd
grep -q "RDMA device opened" logs/nbd.log || fail "flame-nbd did not open the RDMA device"
log "cluster up ($((SECONDS - START)) s)"

rxe_counter() { cat "/sys/class/infiniband/$FLAME_RDMA_DEVICE/ports/1/hw_counters/$1"; }
PKTS0="$(rxe_counter sent_pkts)"

# ------------------------------------------------------------- 2. data
URI="nbd://127.0.0.1:$NBD_PORT/$VOLUME"
# offset length pattern: 512 B travels inline; 4 KiB and up are converted; the
# 256 KiB one spans objects 0 and 1 (two converted pieces); 4 MiB is the
# protocol's largest payload.
PATTERNS=(
    "0 512 0x11"
    "4096 4096 0x22"
    "65536 65536 0x33"
    "1048576 1048576 0x44"
    "4063232 262144 0x55"
    "8388608 4194304 0x66"
    "20975616 12288 0x77"
)
WRITES=()
READS=()
for p in "${PATTERNS[@]}"; do
    read -r off len pat <<<"$p"
    WRITES+=(-c "write -P $pat $off $len")
    READS+=(-c "read -P $pat $off $len")
done
# Never written: zeroes (pushed into the client's buffer too).
READS+=(-c "read -P 0 33554432 131072")
log "qemu-io: ${#PATTERNS[@]} patterns written, then read back verified"
timeout 120 qemu-io -f raw "$URI" "${WRITES[@]}" "${READS[@]}" >logs/qemu-io.1 2>&1 ||
    fail "qemu-io write/read-back failed: $(cat logs/qemu-io.1)"
grep -q 'Pattern verification failed' logs/qemu-io.1 && fail "qemu-io: $(cat logs/qemu-io.1)"
timeout 120 qemu-io -f raw -r "$URI" "${READS[@]}" >logs/qemu-io.2 2>&1 ||
    fail "qemu-io read-back in a fresh session failed: $(cat logs/qemu-io.2)"
grep -q 'Pattern verification failed' logs/qemu-io.2 && fail "qemu-io: $(cat logs/qemu-io.2)"
log "all patterns read back, twice"

# ------------------------------------------------------------- 3. counters
fetch_metrics
pulled="$(osd_metric 'flame_osd_converted_total{op="write"')"
pushed="$(osd_metric 'flame_osd_converted_total{op="read"')"
left="$(osd_metric 'flame_osd_fetch_replies_total{result="left"')"
osd_rdma_read="$(osd_metric 'flame_rdma_completions_total{op="read"')"
osd_rdma_write="$(osd_metric 'flame_rdma_completions_total{op="write"')"
osd_rdma_send="$(osd_metric 'flame_rdma_completions_total{op="send"')"
osd_rdma_recv="$(osd_metric 'flame_rdma_completions_total{op="recv"')"
c_conv_w="$(metric 9300 'flame_client_converted_total{op="write"')"
c_conv_r="$(metric 9300 'flame_client_converted_total{op="read"')"
c_hits="$(metric 9300 'flame_client_fetch_total{result="hit"')"
c_fallback="$(metric 9300 'flame_client_fetch_total{result="fallback"')"
nbd_rdma_read="$(metric 9300 'flame_rdma_completions_total{op="read"')"
nbd_rdma_send="$(metric 9300 'flame_rdma_completions_total{op="send"')"
pkts=$(($(rxe_counter sent_pkts) - PKTS0))
echo "rdma_cluster: OSDs: converted writes pulled $pulled, converted reads pushed $pushed, replies left in reply areas $left; RDMA completions read $osd_rdma_read write $osd_rdma_write send $osd_rdma_send recv $osd_rdma_recv"
echo "rdma_cluster: flame-nbd: converted writes $c_conv_w, reads $c_conv_r; fetch hits $c_hits, fallbacks $c_fallback; RDMA completions read $nbd_rdma_read send $nbd_rdma_send"
echo "rdma_cluster: $FLAME_RDMA_DEVICE sent $pkts RoCE packets during the I/O"
# 6 converted writes (the spanning one in 2 pieces: 7) and, per session, 6
# converted pattern reads (7) plus the 128 KiB zero read.
((pulled >= 7)) || fail "converted writes pulled by the OSDs: $pulled (want >= 7)"
((pushed >= 16)) || fail "converted reads pushed by the OSDs: $pushed (want >= 16)"
((c_conv_w == pulled)) || fail "flame-nbd counts $c_conv_w converted writes, the OSDs $pulled"
((c_conv_r == pushed)) || fail "flame-nbd counts $c_conv_r converted reads, the OSDs $pushed"
# Conversion over rdma is one-sided verbs: every pulled write is at least one
# RDMA READ by an OSD, every pushed read at least one RDMA WRITE.
((osd_rdma_read >= pulled)) || fail "OSDs completed $osd_rdma_read RDMA READs for $pulled converted writes"
((osd_rdma_write >= pushed)) || fail "OSDs completed $osd_rdma_write RDMA WRITEs for $pushed converted reads"
# Fetched replies: left by the OSDs, read by flame-nbd with RDMA READs.
((left >= 1 && c_hits >= 1)) || fail "no fetched replies (left $left, hits $c_hits)"
((nbd_rdma_read >= c_hits)) || fail "flame-nbd completed $nbd_rdma_read RDMA READs for $c_hits fetch hits"
# Replication between the OSDs and requests are SENDs.
((osd_rdma_send >= 1 && osd_rdma_recv >= 1 && nbd_rdma_send >= 1)) || fail "no two-sided RDMA traffic counted"
((pkts > 0)) || fail "$FLAME_RDMA_DEVICE sent no packets during the I/O"

# ------------------------------------------------------------- 4. a copy lost
log "kill -9 osd.0; reading everything back from the other copies"
kill -9 "${OSD_PIDS[0]}"
wait "${OSD_PIDS[0]}" 2>/dev/null || true
for ((i = 0; i < 300; i++)); do
    up="$(osds_up)" || up=3
    ((up == 2)) && break
    sleep 0.2
done
((up == 2)) || fail "the manager did not mark osd.0 down within 60 s ($up up)"
timeout 120 qemu-io -f raw -r "$URI" "${READS[@]}" >logs/qemu-io.3 2>&1 ||
    fail "qemu-io read-back with osd.0 down failed: $(cat logs/qemu-io.3)"
grep -q 'Pattern verification failed' logs/qemu-io.3 && fail "qemu-io: $(cat logs/qemu-io.3)"
kill -0 "$NBD_PID" 2>/dev/null || fail "flame-nbd exited"
log "osd.0 down: every pattern read back from the other two copies"

log "done in $((SECONDS - START)) s"
echo "rdma_cluster: OK"
