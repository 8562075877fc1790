#!/usr/bin/env bash
# Sourced by the test VM's guest scripts (tests/vm/ublk.sh, tests/vm/kernel_nbd.sh,
# tests/vm/bench_ublk_nbd.sh, tests/vm/rdma_cluster.sh): a Flame cluster on the
# guest's loopback — flame-mgr on 127.0.0.1:6800 and three flame-osd (one shard
# each, small memory pools: the guest is emulated and a registered pool is
# resident from the start), all state under the current directory. The caller
# sets NAME (its log prefix), BIN (the binaries) and DIR (its directory, with
# DIR/logs), and may set CLUSTER_TRANSPORT (the OSDs' `transport`, default tcp),
# change POOL_YAML (every daemon's memory pool) after sourcing, and define
# extra_failure_output to add to what `fail` prints.
#
#   cluster_up        start the daemons (their pids in OSD_PIDS) and wait until
#                     the three OSDs are up
#   start_fsync_writer N BLOCKS  in the background (pid in WRITER), write and
#                     fsync $MNT/during1..N.bin (BLOCKS x 64 KiB each) one after
#                     the other; each one's sha256 goes to $SUMS.during once its
#                     fsync returned, and its number to $DIR/written
#   wait_written N    wait up to 60 s until the writer has fsynced N files
#   admin ARGS        flame-admin against the cluster
#   osds_up           how many OSDs the manager has up
#   wait_port P WHAT  wait up to 30 s for 127.0.0.1:P to accept connections
#   check_fua_arrives DEV BLOCK  an O_DSYNC 4 KiB write must reach every OSD as FUA
#   log MSG, fail MSG

MGR=127.0.0.1:6800
CLUSTER_TRANSPORT="${CLUSTER_TRANSPORT:-tcp}"
# Every daemon's memory pool: 8 MiB per thread.
POOL_YAML='memory_pool: {bytes_per_thread: 8388608, large_bytes_per_thread: 8388608}'

log() { printf '[%s %5.1fs] %s\n' "$NAME" "$(awk '{print $1}' /proc/uptime)" "$*"; }
fail() {
    echo "$NAME: FAILED: $*" >&2
    if declare -F extra_failure_output >/dev/null; then extra_failure_output >&2 || true; fi
    for f in "$DIR"/logs/*.log; do
        [[ -f "$f" ]] || continue
        echo "---- $f (last 30 lines) ----" >&2
        tail -n 30 "$f" >&2
    done
    echo "---- dmesg (last 40 lines) ----" >&2
    dmesg | tail -n 40 >&2
    exit 1
}
# The cluster's keys (flame-admin auth init), in the including script's DIR (the
# guest's writable scratch directory; the host's tree is mounted read-only).
KEYS="${DIR:?tests/vm/cluster.sh needs DIR set by the script that sources it}/keys"
# The keyring the bridges (flame-nbd, flame-ublk) sign with: a role-client entity
# that cluster_up adds, as an operator would.
BRIDGE_KEYRING="$KEYS/client.bridge.keyring"
admin() { "$BIN/flame-admin" --mgr "$MGR" --keyring "$KEYS/client.admin.keyring" "$@"; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { # port what
    local i
    for ((i = 0; i < 300; i++)); do
        port_open "$1" && return 0
        sleep 0.1
    done
    fail "$2 does not listen on port $1 after 30 s"
}

# FUA arrives: an O_DIRECT|O_DSYNC write to DEVICE at 4 KiB block BLOCK is
# REQ_FUA on a device that advertises FUA, and must reach every copy as a synced
# write (flame_osd_syncs_total{kind="fua"} up on each of the three OSDs) — not be
# dropped by the bridge or the kernel's client on the way.
check_fua_arrives() { # device block
    local n before=() after=()
    for n in 0 1 2; do before[n]="$(osd_fua_syncs "$n")" || fail "GET /metrics of osd.$n failed"; done
    dd if=/dev/urandom of="$1" bs=4K count=1 seek="$2" oflag=direct,dsync status=none ||
        fail "O_DSYNC write to $1 failed"
    for n in 0 1 2; do after[n]="$(osd_fua_syncs "$n")" || fail "GET /metrics of osd.$n failed"; done
    for n in 0 1 2; do
        ((after[n] > before[n])) ||
            fail "an O_DSYNC (FUA) write to $1 did not reach osd.$n as a synced write (fua syncs ${before[*]} -> ${after[*]})"
    done
    log "FUA: an O_DSYNC write to $1 arrived at every copy as a synced write (fua syncs ${before[*]} -> ${after[*]})"
}
osd_fua_syncs() { # osd number; fails when its metrics cannot be read
    local body
    body="$(curl -fsS --max-time 10 "http://127.0.0.1:920$1/metrics")" || return 1
    awk '/^flame_osd_syncs_total\{kind="fua"\}/ {s += $2} END {printf "%d", s}' <<<"$body"
}

cluster_up() {
    local n i up=0
    "$BIN/flame-admin" auth init --dir "$KEYS" >/dev/null || fail "flame-admin auth init failed"
    cat >mgr.yaml <<EOF2
listen: "$MGR"
data_dir: ./mgr
keyring: "$KEYS/cluster.keyring"
heartbeat_grace_ms: 6000
failure_check_interval_ms: 1000
pool: {size: 3, min_size: 2, pg_count: 32, object_size: 4194304}
EOF2
    for n in 0 1 2; do
        cat >"osd.$n.yaml" <<EOF2
mgr: "$MGR"
keyring: "$KEYS/osd.$n.keyring"
listen: "127.0.0.1:69${n}0"
metrics_listen: "127.0.0.1:920$n"
data_dir: ./osd.$n
host: vm-host-$n
shards: 1
poll_mode: interrupt
transport: $CLUSTER_TRANSPORT
direct_io: auto
$POOL_YAML
EOF2
    done
    log "starting flame-mgr, 3 flame-osd (transport $CLUSTER_TRANSPORT) from $BIN"
    "$BIN/flame-mgr" --config mgr.yaml >logs/mgr.log 2>&1 &
    wait_port 6800 flame-mgr
    admin auth add client.bridge --role client --cluster-keyring "$KEYS/cluster.keyring" \
        --out "$BRIDGE_KEYRING" >/dev/null || fail "cannot add the bridges' entity client.bridge"
    OSD_PIDS=()
    for n in 0 1 2; do
        admin auth add "osd.$n" --cluster-keyring "$KEYS/cluster.keyring" \
            --out "$KEYS/osd.$n.keyring" >/dev/null || fail "cannot add osd.$n's own key"
        "$BIN/flame-osd" --config "osd.$n.yaml" >"logs/osd.$n.log" 2>&1 &
        OSD_PIDS+=($!)
    done
    for ((i = 0; i < 300; i++)); do
        up="$(osds_up)" || up=0
        ((up == 3)) && return 0
        for n in 0 1 2; do
            kill -0 "${OSD_PIDS[$n]}" 2>/dev/null || fail "osd.$n exited during start-up"
        done
        sleep 0.2
    done
    fail "only $up of 3 OSDs up after 60 s"
}
# How many OSDs the manager has up.
osds_up() { admin osd ls 2>/dev/null | awk '$1 ~ /^osd\./ && $6 == "up"' | wc -l; }

start_fsync_writer() { # count, 64 KiB blocks per file
    (
        for ((n = 1; n <= $1; n++)); do
            dd if=/dev/urandom of="$MNT/during$n.bin" bs=64K count="$2" conv=fsync status=none || exit 1
            (cd "$MNT" && sha256sum "during$n.bin") >>"$SUMS.during"
            echo "$n" >"$DIR/written"
        done
    ) &
    WRITER=$!
}

wait_written() { # files
    local i
    for ((i = 0; i < 600; i++)); do
        [[ "$(cat "$DIR/written" 2>/dev/null || echo 0)" -ge "$1" ]] && return 0
        kill -0 "$WRITER" 2>/dev/null || break
        sleep 0.1
    done
    [[ "$(cat "$DIR/written" 2>/dev/null || echo 0)" -ge "$1" ]] || fail "the writer did not get $1 files written in 60 s"
}
