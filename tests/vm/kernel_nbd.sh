#!/usr/bin/env bash
# Runs INSIDE the test VM (scripts/vm.sh; started by tests/tests/kernel_nbd.rs):
# the kernel's NBD client against a real Flame cluster on the guest's own
# loopback, and a kill -9 and restart of flame-nbd under a mounted ext4.
#
#   1. flame-mgr, three flame-osd and flame-nbd from $FLAME_BIN (the host's build,
#      seen read-only over 9p), all state in a guest tmpfs; a 1 GiB volume.
#   2. nbd-client (netlink, the README's first command) on flame-nbd's Unix
#      socket export (no TCP export: the socket admits root, flame-nbd's uid,
#      only) -> /dev/nbd0: mkfs.ext4,
#      mount, files written and fsynced, their sha256 recorded; umount, nbd-client
#      -d. Also checked: nbd-client leaves no process behind in netlink mode, which
#      is why its -persist cannot reconnect anything (docs/testing.md).
#   3. qemu-nbd -c /dev/nbd0 with reconnect-delay (the README's way to survive a
#      restart): mount, the files of 2 check, a writer fsyncs files one after the
#      other while flame-nbd is killed with SIGKILL and restarted; every write
#      and fsync must succeed, the file system must stay read-write, and the
#      kernel must log no I/O error.
#   4. a fresh nbd-client connection, caches dropped, mount read-only: every
#      fsynced file of 2 and 3 checks (read back from the cluster).
# Prints "kernel_nbd: OK" at the end; any failure exits non-zero with the logs.
set -euo pipefail

BIN="${FLAME_BIN:?FLAME_BIN must name the directory of the flame binaries}"
DIR="${TMPDIR:-/tmp}/flame-kernel-nbd"
MNT="$DIR/mnt"
SUMS="$DIR/sums"
DEV=/dev/nbd0
# flame-nbd's Unix socket export: the kernel's client and qemu-nbd connect
# through it as root, the uid flame-nbd runs as (no TCP export at all).
SOCK="$DIR/nbd.sock"
VOLUME=vol
START=$SECONDS

NAME=kernel_nbd
# shellcheck source=tests/vm/cluster.sh
source "$(dirname "${BASH_SOURCE[0]}")/cluster.sh"
trap 'fail "command failed at line $LINENO: $BASH_COMMAND"' ERR

for tool in nbd-client qemu-nbd mkfs.ext4 sha256sum timeout mount umount dd curl awk; do
    command -v "$tool" >/dev/null || fail "required tool '$tool' is missing on the host (apt-get install nbd-client qemu-utils e2fsprogs curl)"
done
for b in flame-mgr flame-osd flame-nbd flame-admin; do
    [[ -x "$BIN/$b" ]] || fail "$BIN/$b missing: build it first (cargo build --workspace --bins)"
done
[[ -b "$DEV" ]] || fail "$DEV is missing: the nbd module is not loaded"

rm -rf "$DIR"
mkdir -p "$DIR/logs" "$MNT"
: >"$SUMS"
cd "$DIR"

# ---------------------------------------------------------------- the cluster
# tests/vm/cluster.sh's (small memory pools, one shard per OSD), and flame-nbd.
cat >nbd.yaml <<EOF
mgr: "$MGR"
keyring: "$BRIDGE_KEYRING"
unix: {path: "$SOCK"}
metrics_listen: "127.0.0.1:9300"
threads: 1
poll_mode: interrupt
transport: tcp
$POOL_YAML
EOF

NBD_PID=""
start_nbd() {
    # A killed flame-nbd leaves its socket file: gone first, so the wait below
    # sees the new one.
    rm -f "$SOCK"
    "$BIN/flame-nbd" --config nbd.yaml >>logs/nbd.log 2>&1 &
    NBD_PID=$!
    # The socket file appears at bind, just before listen: a client that comes
    # in between is refused and retries (qemu-nbd's reconnect does).
    local i
    for ((i = 0; i < 300; i++)); do
        [[ -S "$SOCK" ]] && return 0
        sleep 0.1
    done
    fail "flame-nbd does not listen on $SOCK after 30 s"
}

cluster_up
admin volume create "$VOLUME" --size 1G >/dev/null
start_nbd
log "cluster up ($((SECONDS - START)) s)"

# Writes file $1 of $2 KiB from /dev/urandom, fsyncs it, records its sha256.
write_file() {
    dd if=/dev/urandom of="$MNT/$1" bs=1K count="$2" conv=fsync status=none ||
        fail "writing and fsyncing $1 failed"
    (cd "$MNT" && sha256sum "$1") >>"$SUMS"
}
verify_sums() { # what
    local out
    out="$(cd "$MNT" && sha256sum -c --quiet "$SUMS" 2>&1)" || fail "$1: files do not check: $out"
    log "$1: all $(wc -l <"$SUMS") files check"
}
nbd_disconnect() {
    nbd-client -d "$DEV" >/dev/null 2>&1 || fail "nbd-client -d $DEV failed"
    local i
    for ((i = 0; i < 100; i++)); do
        [[ ! -e /sys/block/nbd0/pid ]] && return 0
        sleep 0.1
    done
    fail "$DEV still connected 10 s after nbd-client -d"
}
no_kernel_errors_since() { # dmesg line count at the start
    local new
    new="$(dmesg | tail -n +$(($1 + 1)) | grep -E 'I/O error|EXT4-fs (error|warning)|Aborting journal|Remounting filesystem read-only|shut down requested' || true)"
    [[ -z "$new" ]] || fail "the kernel logged errors:
$new"
}

# ------------------------------------------------- 2. nbd-client, plain (netlink)
log "nbd-client -N $VOLUME -u $SOCK $DEV"
timeout 60 nbd-client -N "$VOLUME" -timeout 60 -u "$SOCK" "$DEV" ||
    fail "nbd-client could not connect"
# In netlink mode (the default) nbd-client hands the socket to the kernel and
# exits: no process is left that could reconnect, so its -persist does nothing
# (the README used to promise it would). If this ever changes, the README's NBD
# section must be revisited.
if pgrep -x nbd-client >/dev/null; then
    fail "an nbd-client process stayed after connecting: netlink mode behaves differently from what docs/testing.md records; check -persist again and update the README"
fi
[[ "$(cat "/sys/block/${DEV#/dev/}/queue/fua")" == 1 ]] ||
    fail "$DEV: fua is $(cat "/sys/block/${DEV#/dev/}/queue/fua"): flame-nbd's NBD_FLAG_SEND_FUA was not taken up"
check_fua_arrives "$DEV" 0
timeout 120 mkfs.ext4 -q -E nodiscard,lazy_itable_init=1,lazy_journal_init=1 "$DEV" || fail "mkfs.ext4 failed"
mount -o noinit_itable "$DEV" "$MNT" || fail "mount failed"
write_file big.bin 8192
for n in 1 2 3 4; do write_file "small$n.bin" $((n * 4)); done
write_file mid.bin 1024
verify_sums "through nbd-client"
umount "$MNT" || fail "umount failed"
nbd_disconnect
log "nbd-client: mkfs, mount, $(wc -l <"$SUMS") files written and fsynced, disconnected"

# ------------------------------- 3. qemu-nbd -c with reconnect-delay, a restart
DMESG0="$(dmesg | wc -l)"
log "qemu-nbd -c $DEV (reconnect-delay=60)"
timeout 60 qemu-nbd --fork -c "$DEV" --image-opts \
    "driver=nbd,server.type=unix,server.path=$SOCK,export=$VOLUME,reconnect-delay=60" ||
    fail "qemu-nbd -c failed"
for ((i = 0; i < 100; i++)); do
    [[ "$(cat /sys/block/nbd0/size 2>/dev/null || echo 0)" != 0 ]] && break
    sleep 0.1
done
mount -o noinit_itable "$DEV" "$MNT" || fail "mount through qemu-nbd failed"
verify_sums "through qemu-nbd, before the restart"

# A writer that fsyncs one file after the other; a file counts once its fsync
# returned. flame-nbd is killed after the second and restarted 2 s later.
WRITES=10
start_fsync_writer "$WRITES" 8
wait_written 2
log "kill -9 flame-nbd (pid $NBD_PID) under the mounted file system"
kill -9 "$NBD_PID"
wait "$NBD_PID" 2>/dev/null || true
t_kill=$SECONDS
sleep 2
start_nbd
log "flame-nbd restarted ($((SECONDS - t_kill)) s after the kill)"
writer_rc=0
for ((i = 0; i < 900; i++)); do
    kill -0 "$WRITER" 2>/dev/null || break
    sleep 0.1
done
kill -0 "$WRITER" 2>/dev/null && fail "the writer did not finish within 90 s of the restart"
wait "$WRITER" || writer_rc=$?
((writer_rc == 0)) || fail "a write or fsync failed across the restart (writer exit $writer_rc, $(cat "$DIR/written" 2>/dev/null || echo 0) of $WRITES files done)"
cat "$SUMS.during" >>"$SUMS"
write_file after.bin 512
grep -E "^$DEV $MNT ext4 rw[, ]" /proc/mounts >/dev/null || fail "the file system is no longer mounted read-write: $(grep "$DEV" /proc/mounts)"
no_kernel_errors_since "$DMESG0"
verify_sums "through qemu-nbd, after the restart"
umount "$MNT" || fail "umount after the restart failed"
qemu-nbd -d "$DEV" >/dev/null || fail "qemu-nbd -d failed"
for ((i = 0; i < 100; i++)); do
    [[ "$(cat /sys/block/nbd0/size 2>/dev/null || echo 0)" == 0 ]] && ! pgrep -x qemu-nbd >/dev/null && break
    sleep 0.1
done
log "restart under qemu-nbd: $WRITES writes and fsyncs across it, all succeeded, no kernel error"

# ------------------------------------------- 4. read everything back, fresh
echo 3 >/proc/sys/vm/drop_caches
timeout 60 nbd-client -N "$VOLUME" -timeout 60 -u "$SOCK" "$DEV" ||
    fail "nbd-client could not connect again"
mount -o ro,noload "$DEV" "$MNT" || fail "read-only mount failed"
verify_sums "read back through a fresh nbd-client connection"
umount "$MNT"
nbd_disconnect
no_kernel_errors_since "$DMESG0"
log "done in $((SECONDS - START)) s"
echo "kernel_nbd: OK"
