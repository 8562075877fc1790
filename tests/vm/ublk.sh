#!/usr/bin/env bash
# Runs INSIDE the test VM (scripts/vm.sh --modules ublk_drv; started by
# tests/tests/ublk_vm.rs): flame-ublk exports a volume of a real Flame cluster on
# the guest's own loopback as /dev/ublkb0, and is killed with SIGKILL and
# recovered under a mounted ext4 while I/O runs.
#
#   1. flame-mgr, three flame-osd from $FLAME_BIN (the host's build, seen
#      read-only over 9p), all state in a guest tmpfs; a 1 GiB volume;
#      flame-ublk --queues 2 on it: /dev/ublkb0, its size and queue limits
#      checked (write-back cache with FUA, discard, write-zeroes, 512/4096).
#   2. Raw: a 1 MiB random pattern written with O_DIRECT (and fsync: a FLUSH),
#      read back with O_DIRECT, compared; blkdiscard of 64 KiB (discard) and
#      blkdiscard -z of 64 KiB (write-zeroes) read back as zeroes, the pattern
#      around them intact; flame-ublk's metrics count every operation; an
#      O_DSYNC write arrives at every copy as FUA (flame_osd_syncs_total).
#   3. mkfs.ext4, mount, files written with dd conv=fsync, their sha256 recorded.
#   4. Under the mounted file system: fio (randwrite, crc32c verify) and a writer
#      that fsyncs files one after the other; flame-ublk is killed with SIGKILL
#      after the writer's second file; `--recover 0` for another volume must be
#      refused (its size differs), then `flame-ublk --device 0` (what the systemd
#      unit runs) must find the device kept and recover it; fio
#      and every write and fsync must succeed, the file system must stay
#      read-write, the kernel must log no I/O error.
#   5. SIGTERM: flame-ublk stops and deletes /dev/ublkb0; `--device 0` adds it
#      again, caches dropped, mount read-only: every fsynced file checks (read
#      back from the cluster).
# Prints "ublk: OK" at the end; any failure exits non-zero with the logs.
set -euo pipefail

BIN="${FLAME_BIN:?FLAME_BIN must name the directory of the flame binaries}"
DIR="${TMPDIR:-/tmp}/flame-ublk-vm"
MNT="$DIR/mnt"
SUMS="$DIR/sums"
DEV=/dev/ublkb0
VOLUME=vol
NAME=ublk
# shellcheck source=tests/vm/cluster.sh
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
START=$SECONDS
RAW_OFF_MIB=900 # where the raw pattern goes (before mkfs)

trap 'fail "command failed at line $LINENO: $BASH_COMMAND"' ERR

for tool in fio mkfs.ext4 blkdiscard blockdev sha256sum timeout mount umount dd cmp curl; do
    command -v "$tool" >/dev/null || fail "required tool '$tool' is missing on the host (apt-get install fio e2fsprogs util-linux curl)"
done
for b in flame-mgr flame-osd flame-ublk flame-admin; do
    [[ -x "$BIN/$b" ]] || fail "$BIN/$b missing: build it first (cargo build --workspace --bins --features flame-client/ublk)"
done
[[ -c /dev/ublk-control ]] || fail "/dev/ublk-control is missing: the ublk_drv module is not loaded (scripts/vm.sh --modules ublk_drv)"

rm -rf "$DIR"
mkdir -p "$DIR/logs" "$MNT"
: >"$SUMS"
cd "$DIR"

# ------------------------------------------------- the cluster and flame-ublk
cat >ublk.yaml <<EOF2
mgr: "$MGR"
keyring: "$BRIDGE_KEYRING"
volume: $VOLUME
metrics_listen: "127.0.0.1:9310"
queues: 2
queue_depth: 32
poll_mode: interrupt
transport: tcp
$POOL_YAML
${FLAME_UBLK_EXTRA_CONFIG:-}
EOF2

UBLK_PID=""
start_ublk() { # extra flags; waits for the "ready"/"recovered" line
    local i before
    before="$(grep -c '^flame-ublk: /dev/ublkb0' logs/ublk.out 2>/dev/null || true)"
    RUST_LOG="${FLAME_UBLK_LOG:-info}" "$BIN/flame-ublk" --config ublk.yaml "$@" >>logs/ublk.out 2>>logs/ublk.log &
    UBLK_PID=$!
    for ((i = 0; i < 600; i++)); do
        [[ "$(grep -c '^flame-ublk: /dev/ublkb0' logs/ublk.out 2>/dev/null || true)" -gt "${before:-0}" ]] && return 0
        kill -0 "$UBLK_PID" 2>/dev/null || fail "flame-ublk $* exited before the device was ready"
        sleep 0.1
    done
    fail "flame-ublk $* not ready after 60 s"
}

cluster_up
admin volume create "$VOLUME" --size 1G >/dev/null
admin volume create other --size 512M >/dev/null
start_ublk --dev-id 0
# --device on a device another live flame-ublk serves: refused at once, exit 2
# (a service manager must not loop on it), and the device keeps serving.
rc=0
timeout 60 "$BIN/flame-ublk" --config ublk.yaml --device 0 >/dev/null 2>"$DIR/busy.err" || rc=$?
if ((rc != 2)) || ! grep -q "served by process $UBLK_PID" "$DIR/busy.err"; then
    fail "flame-ublk --device 0 on a served device: exit $rc, not 2 naming pid $UBLK_PID: $(cat "$DIR/busy.err")"
fi
[[ -b "$DEV" ]] || fail "$DEV is not a block device after flame-ublk reported it ready"
size="$(blockdev --getsize64 "$DEV")"
((size == 1 << 30)) || fail "$DEV has $size bytes, the volume 1 GiB"
# The kernel must see a volatile cache with FUA (so it sends FLUSH and FUA),
# discard and write-zeroes, and 512 B logical / 4 KiB physical blocks.
q=/sys/block/ublkb0/queue
[[ "$(cat $q/write_cache)" == "write back" ]] || fail "$DEV: write_cache is '$(cat $q/write_cache)', not 'write back': FLUSH would not be sent"
[[ "$(cat $q/fua)" == 1 ]] || fail "$DEV: fua is $(cat $q/fua): FUA would be emulated with flushes"
(($(cat $q/discard_max_bytes) > 0)) || fail "$DEV: no discard"
(($(cat $q/write_zeroes_max_bytes) > 0)) || fail "$DEV: no write-zeroes"
[[ "$(cat $q/logical_block_size) $(cat $q/physical_block_size)" == "512 4096" ]] ||
    fail "$DEV: block sizes $(cat $q/logical_block_size)/$(cat $q/physical_block_size), not 512/4096"
log "cluster and flame-ublk up ($((SECONDS - START)) s): $(tail -n 1 logs/ublk.out); write back cache, FUA, discard, write-zeroes"
DMESG0="$(dmesg | wc -l)"

no_kernel_errors_since() { # dmesg line count at the start
    local new
    new="$(dmesg | tail -n +$(($1 + 1)) | grep -E 'I/O error|EXT4-fs (error|warning)|Aborting journal|Remounting filesystem read-only|shut down requested' || true)"
    [[ -z "$new" ]] || fail "the kernel logged errors:
$new"
}

# ------------------------------------------------------------------- 2. raw
head -c 1048576 /dev/urandom >pattern
dd if=pattern of="$DEV" bs=64K seek="$((RAW_OFF_MIB * 16))" oflag=direct conv=fsync status=none ||
    fail "raw write failed"
dd if="$DEV" of=readback bs=64K skip="$((RAW_OFF_MIB * 16))" count=16 iflag=direct status=none ||
    fail "raw read failed"
cmp -s pattern readback || fail "the raw pattern read back differs"
# Discard 64 KiB at +128 KiB, write-zeroes 64 KiB at +512 KiB: zeroes there, the
# pattern elsewhere.
base=$((RAW_OFF_MIB << 20))
blkdiscard -o $((base + (128 << 10))) -l 65536 "$DEV" || fail "blkdiscard (discard) failed"
blkdiscard -z -o $((base + (512 << 10))) -l 65536 "$DEV" || fail "blkdiscard -z (write-zeroes) failed"
cp pattern expected
dd if=/dev/zero of=expected bs=64K seek=2 count=1 conv=notrunc status=none
dd if=/dev/zero of=expected bs=64K seek=8 count=1 conv=notrunc status=none
dd if="$DEV" of=readback bs=64K skip="$((RAW_OFF_MIB * 16))" count=16 iflag=direct status=none
cmp -s expected readback || fail "after discard and write-zeroes the range does not read back as expected"
ops="$(curl -s http://127.0.0.1:9310/metrics 2>/dev/null | grep -E '^flame_ublk_ops_total' || true)"
for op in read write trim write_zeroes flush; do
    grep -qE "op=\"$op\"\} [1-9]" <<<"$ops" || fail "flame_ublk_ops_total{op=\"$op\"} is not counted: $ops"
done
log "raw: 1 MiB pattern written and read back (O_DIRECT), discard and write-zeroes read as zeroes; metrics count every operation"

check_fua_arrives "$DEV" "$((RAW_OFF_MIB * 256))"

# ------------------------------------------------------ 3. ext4, fsynced files
write_file() { # name KiB
    dd if=/dev/urandom of="$MNT/$1" bs=1K count="$2" conv=fsync status=none ||
        fail "writing and fsyncing $1 failed"
    (cd "$MNT" && sha256sum "$1") >>"$SUMS"
}
verify_sums() { # what
    local out
    out="$(cd "$MNT" && sha256sum -c --quiet "$SUMS" 2>&1)" || fail "$1: files do not check: $out"
    log "$1: all $(wc -l <"$SUMS") files check"
}
timeout 120 mkfs.ext4 -q -E nodiscard,lazy_itable_init=1,lazy_journal_init=1 "$DEV" || fail "mkfs.ext4 failed"
mount -o noinit_itable "$DEV" "$MNT" || fail "mount failed"
write_file big.bin 4096
for n in 1 2 3; do write_file "small$n.bin" $((n * 4)); done
verify_sums "ext4 on $DEV"

# ------------------------------------- 4. kill -9 and recover under the mount
# fio: random 4 KiB writes with a crc32c header in every block, then reads
# every block back and checks it (verify_fatal: the first bad block fails fio).
fio --name=verify --filename="$MNT/fio.dat" --size=1M --rw=randwrite --bs=4k \
    --ioengine=psync --direct=1 --verify=crc32c --verify_fatal=1 --do_verify=1 \
    --end_fsync=1 --output="$DIR/fio.out" >/dev/null 2>"$DIR/fio.err" &
FIO=$!
WRITES=6
start_fsync_writer "$WRITES" 4
wait_written 2
kill -0 "$FIO" 2>/dev/null || fail "fio finished before the kill: make it write more ($(cat "$DIR/fio.err"))"
log "kill -9 flame-ublk (pid $UBLK_PID) under the mounted file system, fio and a writer running"
t_kill=$SECONDS
if [[ "${FLAME_UBLK_NOKILL:-0}" != 1 ]]; then # (a debugging switch: the same run without the kill)
    kill -9 "$UBLK_PID"
    wait "$UBLK_PID" 2>/dev/null || true
    # Another volume's process must not take the device over.
    rc=0
    "$BIN/flame-ublk" --config ublk.yaml --volume other --recover 0 >/dev/null 2>"$DIR/wrong.err" || rc=$?
    if ((rc == 0)) || ! grep -q "not this volume's device" "$DIR/wrong.err"; then
        fail "flame-ublk --volume other --recover 0 did not refuse the device (exit $rc): $(cat "$DIR/wrong.err")"
    fi
    # What the systemd unit runs (deploy/systemd/flame-ublk@.service): the
    # kernel still holds the device, so --device takes it over.
    start_ublk --device 0
    grep -q '^flame-ublk: /dev/ublkb0 recovered' logs/ublk.out ||
        fail "flame-ublk --device 0 did not recover the device the kernel kept"
fi
log "flame-ublk --device 0: $(tail -n 1 logs/ublk.out) ($((SECONDS - t_kill)) s after the kill)"
t_rec=$SECONDS
while ((SECONDS - t_rec < 120)); do
    kill -0 "$WRITER" 2>/dev/null || kill -0 "$FIO" 2>/dev/null || break
    sleep 0.2
done
if kill -0 "$WRITER" 2>/dev/null || kill -0 "$FIO" 2>/dev/null; then
    echo "---- stuck: inflight $(cat /sys/block/ublkb0/inflight 2>/dev/null), written $(cat "$DIR/written" 2>/dev/null)" >&2
    curl -s http://127.0.0.1:9310/metrics | grep -E '^flame_ublk_(ops_total|inflight|errors)|^flame_client_(retries|errors|connections)' >&2 || true
    tail -n 5 "$DIR/fio.out" >&2 || true
    echo w >/proc/sysrq-trigger || true
    sleep 1
    if [[ -n "${FLAME_UBLK_LOG:-}" ]]; then
        echo "---- unanswered requests of each flame-ublk process (trace)" >&2
        awk '/ublk::export: recovering|ctrl: device 0 flags 2 created/ { n++ }
             / request q=/ { k=$0; sub(/.* request /, "", k); open[n, k]=$0 }
             / done q=/ { k=$0; sub(/.* done /, "", k); sub(/ res=.*/, "", k); delete open[n, k] }
             END { for (x in open) print open[x] }' "$DIR/logs/ublk.log" >&2 || true
    fi
    fail "fio or the writer still runs 120 s after the recovery"
fi
writer_rc=0
fio_rc=0
wait "$WRITER" || writer_rc=$?
wait "$FIO" || fio_rc=$?
((writer_rc == 0)) || fail "a write or fsync failed across the recovery (writer exit $writer_rc, $(cat "$DIR/written" 2>/dev/null || echo 0) of $WRITES files done)"
((fio_rc == 0)) || fail "fio failed across the recovery (exit $fio_rc): $(cat "$DIR/fio.err") $(tail -n 20 "$DIR/fio.out")"
grep -qE 'err= *0' "$DIR/fio.out" || fail "fio reports errors: $(grep -E 'err=' "$DIR/fio.out")"
cat "$SUMS.during" >>"$SUMS"
write_file after.bin 256
grep -E "^$DEV $MNT ext4 rw[, ]" /proc/mounts >/dev/null || fail "the file system is no longer mounted read-write: $(grep "$DEV" /proc/mounts)"
no_kernel_errors_since "$DMESG0"
verify_sums "after the kill -9 and the recovery"
log "recovery under the mount: fio verified every block (err=0), $WRITES fsynced writes across it succeeded, no kernel error"

# --------------------------------------------- 5. stop, add again, read back
umount "$MNT"
kill -TERM "$UBLK_PID"
for ((i = 0; i < 300; i++)); do
    kill -0 "$UBLK_PID" 2>/dev/null || break
    sleep 0.1
done
kill -0 "$UBLK_PID" 2>/dev/null && fail "flame-ublk did not exit within 30 s of SIGTERM"
rc=0
wait "$UBLK_PID" || rc=$?
((rc == 0)) || fail "flame-ublk exited $rc on SIGTERM"
for ((i = 0; i < 50; i++)); do
    [[ -e "$DEV" ]] || break
    sleep 0.1
done
[[ -e "$DEV" ]] && fail "$DEV still exists after flame-ublk stopped"
for ((i = 0; i < 50; i++)); do
    [[ -e /dev/ublkc0 ]] || break
    sleep 0.1
done
[[ -e /dev/ublkc0 ]] && fail "/dev/ublkc0 still exists after flame-ublk stopped"
echo 3 >/proc/sys/vm/drop_caches
# --device again: the device is gone, so it is added.
start_ublk --device 0
[[ "$(tail -n 1 logs/ublk.out)" == "flame-ublk: /dev/ublkb0 ready"* ]] ||
    fail "flame-ublk --device 0 did not add a new device: $(tail -n 1 logs/ublk.out)"
mount -o ro,noload "$DEV" "$MNT" || fail "read-only mount of the re-added device failed"
verify_sums "read back through a new device"
umount "$MNT"
no_kernel_errors_since "$DMESG0"
kill -TERM "$UBLK_PID"
wait "$UBLK_PID" || fail "flame-ublk exited non-zero on the final SIGTERM"
log "done in $((SECONDS - START)) s"
echo "ublk: OK"
