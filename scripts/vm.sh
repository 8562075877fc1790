#!/usr/bin/env bash
# Flame's test VM: runs one command inside a QEMU guest with Debian's 6.12 kernel,
# for what this machine's own kernel cannot do (no nbd, ublk or rdma modules, and
# no module loading at all). The guest sees the host's whole file system read-only
# over virtio-9p and runs the command in a chroot of it, so the host's own
# binaries and libraries (cargo's target dir, nbd-client, mkfs.ext4, ...) run
# unchanged; /tmp, /run, /var/tmp, /root and /dev/shm are guest-private tmpfs. The
# guest has no network device: only its own loopback, so nothing the command does
# leaves the VM.
#
#   scripts/vm.sh [OPTIONS] [--] COMMAND [ARG...]   run COMMAND in the guest; exit
#                                                    with its exit status
#   scripts/vm.sh --prepare                         fetch and build the cache only
#
# Options:
#   --timeout S     kill QEMU after S seconds (default $FLAME_VM_TIMEOUT, else 300);
#                   exit status 124 then
#   --mem MIB       guest memory (default 2048)
#   --smp N         guest CPUs (default 2)
#   --cwd DIR       working directory of COMMAND in the guest (default: the current
#                   one; the guest sees the host's paths)
#   --env NAME=VAL  set a variable for COMMAND (repeatable). The guest starts from
#                   an empty environment (PATH, HOME=/root, TMPDIR=/tmp, LANG)
#   --modules LIST  extra kernel modules (comma-separated names) to load at boot,
#                   with their dependencies; the default set is always loaded:
#                   9p (and its transport), nbd, ext4 (and crc32c), and Soft-RoCE:
#                   rdma_rxe (ib_core, ib_uverbs, ...), crc32, dummy (the rxe
#                   device itself is made by tests/vm/soft_roce.sh)
#
# Environment:
#   FLAME_VM_CACHE        cache directory (default /var/cache/flame-vm): the kernel
#                         and busybox packages, the extracted kernel, the initramfs
#   FLAME_VM_KERNEL_PKG   kernel package (default linux-image-6.12-amd64; a
#                         meta-package is resolved to the image it depends on). The
#                         first resolution is kept in the cache: later runs reuse
#                         that kernel without asking apt (delete the cache to move on)
#   FLAME_VM_ACCEL        tcg (default: QEMU's software emulation) or kvm. Not kvm
#                         by default: this machine has a /dev/kvm, but its (nested)
#                         KVM stops the guest's kernel with "KVM internal error ...
#                         emulation failure" while it decompresses itself
#   FLAME_VM_TIMEOUT      default of --timeout
#
# Exit status: the command's; 124 when the timeout killed the guest; 125 when the
# harness itself failed (a missing package, no exit marker from the guest: a
# kernel panic, a crash of init). Missing host tools are installed with apt-get
# (as root, else with sudo) or the script fails loudly; nothing is skipped.
set -euo pipefail

CACHE="${FLAME_VM_CACHE:-/var/cache/flame-vm}"
KERNEL_PKG="${FLAME_VM_KERNEL_PKG:-linux-image-6.12-amd64}"
ACCEL="${FLAME_VM_ACCEL:-tcg}"
TIMEOUT_S="${FLAME_VM_TIMEOUT:-300}"
MEM_MIB=2048
SMP=2
CWD="$PWD"
ENVS=()
EXTRA_MODULES=""
PREPARE_ONLY=0
# Always loaded, in this order, each after its dependencies (from modules.dep).
# crc32c_generic: ext4's metadata checksums ask the crypto API for "crc32c", which
# is not a symbol dependency and so not in modules.dep. Soft-RoCE: rdma_rxe (with
# ib_core, ib_uverbs, udp_tunnel, ip6_udp_tunnel from modules.dep), crc32_generic
# (rxe's ICRC asks the crypto API for "crc32", again no symbol dependency) and
# dummy (a guest-local netdev, dummy0, to put rxe0 on: tests/vm/soft_roce.sh).
# One set for every run, so one initramfs serves them all.
BASE_MODULES="netfs 9pnet 9pnet_virtio 9p nbd crc32c_generic ext4 crc32_generic rdma_rxe dummy"

die() {
    echo "vm.sh: FAILED: $*" >&2
    exit 125
}
note() { echo "vm.sh: $*" >&2; }

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

while (($#)); do
    case "$1" in
    --timeout)
        TIMEOUT_S="${2:?--timeout needs a value}"
        shift 2
        ;;
    --mem)
        MEM_MIB="${2:?--mem needs a value}"
        shift 2
        ;;
    --smp)
        SMP="${2:?--smp needs a value}"
        shift 2
        ;;
    --cwd)
        CWD="${2:?--cwd needs a value}"
        shift 2
        ;;
    --env)
        [[ "${2:-}" == *=* ]] || die "--env needs NAME=VALUE, got '${2:-}'"
        ENVS+=("$2")
        shift 2
        ;;
    --modules)
        EXTRA_MODULES="${2:?--modules needs a value}"
        shift 2
        ;;
    --prepare)
        PREPARE_ONLY=1
        shift
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    --)
        shift
        break
        ;;
    -*)
        echo "vm.sh: unknown option '$1' (see --help)" >&2
        exit 2
        ;;
    *) break ;;
    esac
done
{ [[ "$TIMEOUT_S" =~ ^[0-9]+$ ]] && ((TIMEOUT_S > 0)); } || die "--timeout must be a positive number of seconds: $TIMEOUT_S"
[[ "$MEM_MIB" =~ ^[0-9]+$ ]] || die "--mem must be MiB: $MEM_MIB"
[[ "$SMP" =~ ^[0-9]+$ ]] || die "--smp must be a number: $SMP"
if ((!PREPARE_ONLY)) && (($# == 0)); then
    echo "vm.sh: no command given (see --help)" >&2
    exit 2
fi

# ------------------------------------------------------------------------------
# Host tools: installed when missing, else a loud failure.
SUDO=()
if ((EUID != 0)); then
    command -v sudo >/dev/null || die "not root and no sudo: the guest needs root on the host for apt-get"
    SUDO=(sudo)
fi
APT_UPDATED=0
apt_update_once() {
    ((APT_UPDATED)) && return 0
    "${SUDO[@]}" apt-get update -q >&2 || die "apt-get update failed"
    APT_UPDATED=1
}
need_tools() { # pairs: tool package
    local missing=() tool pkg
    while (($#)); do
        tool="$1" pkg="$2"
        shift 2
        command -v "$tool" >/dev/null || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    note "installing: ${missing[*]}"
    apt_update_once
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 ||
        die "apt-get install ${missing[*]} failed"
}
need_tools qemu-system-x86_64 qemu-system-x86 depmod kmod cpio cpio xz xz-utils \
    gzip gzip dpkg-deb dpkg timeout coreutils flock util-linux
for t in qemu-system-x86_64 depmod cpio xz gzip dpkg-deb timeout flock apt-get apt-cache; do
    command -v "$t" >/dev/null || die "required tool '$t' is missing after the install step"
done

# ------------------------------------------------------------------------------
# The cache: packages, the extracted kernel, the initramfs. Built under a lock, so
# parallel runs (cargo test) build it once.
mkdir -p "$CACHE" || die "cannot create the cache directory $CACHE (FLAME_VM_CACHE)"
exec 9>"$CACHE/.lock"
flock -w 600 9 || die "the cache $CACHE stayed locked for 10 minutes"

# Prints the real package a (meta-)package name stands for: itself when it has
# files, else the linux-image it depends on.
resolve_pkg() {
    local pkg="$1" show dep
    show="$(apt-cache show --no-all-versions "$pkg" 2>/dev/null)" || show=""
    if [[ -z "$show" ]]; then
        apt_update_once
        show="$(apt-cache show --no-all-versions "$pkg" 2>/dev/null)" ||
            die "apt knows no package '$pkg' (FLAME_VM_KERNEL_PKG)"
    fi
    dep="$(sed -n 's/^Depends: //p' <<<"$show" | tr ',' '\n' | sed -n 's/^ *\(linux-image-[^ ]*\).*/\1/p' | head -n 1)"
    # A real image depends on no other linux-image; a meta-package does.
    echo "${dep:-$pkg}"
}

# Downloads package $1 (exact name) into $CACHE/debs unless it is there; prints
# the .deb's path.
fetch_deb() {
    local pkg="$1" deb
    mkdir -p "$CACHE/debs"
    deb="$(compgen -G "$CACHE/debs/${pkg}_*.deb" | head -n 1)" || deb=""
    if [[ -z "$deb" ]]; then
        note "downloading $pkg into $CACHE/debs"
        apt-cache show "$pkg" >/dev/null 2>&1 || apt_update_once
        (cd "$CACHE/debs" && apt-get download -q "$pkg" >&2) || die "apt-get download $pkg failed"
        deb="$(compgen -G "$CACHE/debs/${pkg}_*.deb" | head -n 1)" || die "apt-get download $pkg left no .deb"
    fi
    echo "$deb"
}

if [[ -s "$CACHE/kernel.pkg" ]]; then
    KPKG="$(cat "$CACHE/kernel.pkg")"
else
    KPKG="$(resolve_pkg "$KERNEL_PKG")"
    [[ "$KPKG" == linux-image-* ]] || die "'$KERNEL_PKG' resolved to '$KPKG', not a linux-image package"
fi
KDEB="$(fetch_deb "$KPKG")"
echo "$KPKG" >"$CACHE/kernel.pkg"
BBDEB="$(fetch_deb busybox-static)"

KDIR="$CACHE/kernel/$KPKG"
if [[ ! -f "$KDIR/.done" ]]; then
    note "extracting $(basename "$KDEB")"
    rm -rf "$KDIR"
    mkdir -p "$KDIR"
    dpkg-deb -x "$KDEB" "$KDIR" || die "dpkg-deb -x $KDEB failed"
    KVER="$(basename "$(compgen -G "$KDIR/lib/modules/*" | head -n 1)")"
    [[ -n "$KVER" && -f "$KDIR/boot/vmlinuz-$KVER" ]] || die "$KDEB has no /boot/vmlinuz and /lib/modules"
    # The package ships no modules.dep (depmod makes it at install time).
    depmod -b "$KDIR" "$KVER" || die "depmod on $KDIR failed"
    touch "$KDIR/.done"
fi
KVER="$(basename "$(compgen -G "$KDIR/lib/modules/*" | head -n 1)")"
MODDIR="$KDIR/lib/modules/$KVER"
VMLINUZ="$KDIR/boot/vmlinuz-$KVER"
[[ -f "$VMLINUZ" && -f "$MODDIR/modules.dep" ]] || die "$KDIR is incomplete: delete it and run again"

# Module load order: each module after its dependencies (modules.dep), once.
MODULE_ORDER=()
declare -A MOD_SEEN=()
mod_path() { # name -> path relative to $MODDIR, from modules.dep (- and _ are one)
    local n="${1//-/[-_]}"
    n="${n//_/[-_]}"
    grep -E "(^|/)${n}\.ko(\.xz|\.zst|\.gz)?:" "$MODDIR/modules.dep" | head -n 1 | cut -d: -f1
}
add_module() {
    local path="$1" deps
    [[ -n "${MOD_SEEN[$path]:-}" ]] && return 0
    MOD_SEEN[$path]=1
    deps="$(grep -E "^${path//./\\.}:" "$MODDIR/modules.dep" | cut -d: -f2-)"
    # modules.dep lists the deepest dependency last: load from the end.
    local arr=()
    read -r -a arr <<<"$deps"
    local i
    for ((i = ${#arr[@]} - 1; i >= 0; i--)); do
        add_module "${arr[$i]}"
    done
    MODULE_ORDER+=("$path")
}
for m in $BASE_MODULES ${EXTRA_MODULES//,/ }; do
    p="$(mod_path "$m")"
    if [[ -z "$p" ]]; then
        grep -qE "/${m//-/_}\.ko" "$MODDIR/modules.builtin" 2>/dev/null && continue
        die "kernel $KVER has no module '$m' (not in modules.dep nor modules.builtin)"
    fi
    add_module "$p"
done

# The guest's /init (busybox sh). Placeholders: none; the per-run part
# (/flame-vm/run.sh, the command and its marker) comes in a second cpio archive
# appended to the initramfs.
# shellcheck disable=SC2016 # expanded by the guest's shell
INIT_SCRIPT='#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() {
    echo "flame-vm-init: $*"
    echo "FLAME-VM-INIT-FAILED"
    poweroff -f
}
while read -r m; do
    insmod "/modules/$m" || fail "insmod $m failed"
done </modules/order
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 host /host ||
    fail "mounting the host root over 9p failed"
ip link set lo up || fail "ip link set lo up failed"
for d in tmp run var/tmp root; do
    mount -t tmpfs -o mode=1777 tmpfs "/host/$d" || fail "tmpfs on /$d failed"
done
chmod 0700 /host/root
# /var/lock is /run/lock on Debian (qemu-nbd -c locks there).
mkdir -p /host/run/lock
mount -t proc proc /host/proc || fail "proc in the chroot"
mount -t sysfs sys /host/sys || fail "sysfs in the chroot"
mount -o bind /dev /host/dev || fail "dev in the chroot"
mount -t devpts devpts /host/dev/pts 2>/dev/null
mkdir -p /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm || fail "/dev/shm in the chroot"
mkdir -p /host/run/flame-vm
cp /flame-vm/run.sh /host/run/flame-vm/run.sh || fail "no /flame-vm/run.sh in the initramfs"
. /flame-vm/marker
read -r up _ </proc/uptime
echo "flame-vm: guest up after ${up} s (kernel uptime), running the command"
chroot /host /usr/bin/env -i /bin/bash /run/flame-vm/run.sh </dev/null
rc=$?
read -r up _ </proc/uptime
echo "flame-vm: command done at ${up} s (kernel uptime)"
echo "$FLAME_VM_MARKER $rc"
sync
poweroff -f
'

INIT_HASH="$( (
    printf '%s\n' "$INIT_SCRIPT" "${MODULE_ORDER[@]}"
    basename "$BBDEB"
    echo "$KPKG"
) | sha256sum | cut -c1-16)"
INITRD="$CACHE/initramfs/$KVER-$INIT_HASH.cpio.gz"
if [[ ! -f "$INITRD" ]]; then
    note "building the initramfs ($INITRD)"
    mkdir -p "$CACHE/initramfs"
    STAGE="$(mktemp -d "$CACHE/initramfs/stage.XXXXXX")"
    trap 'rm -rf "$STAGE"' EXIT
    mkdir -p "$STAGE"/{bin,dev,proc,sys,modules,flame-vm,tmp}
    BBX="$STAGE/bbx"
    dpkg-deb -x "$BBDEB" "$BBX" || die "dpkg-deb -x $BBDEB failed"
    [[ -x "$BBX/bin/busybox" ]] || die "$BBDEB has no /bin/busybox"
    cp "$BBX/bin/busybox" "$STAGE/bin/busybox"
    rm -rf "$BBX"
    : >"$STAGE/modules/order"
    for p in "${MODULE_ORDER[@]}"; do
        name="$(basename "$p")"
        # busybox insmod does not decompress: store them plain.
        plain="${name%.ko*}.ko"
        case "$name" in
        *.ko.xz) xz -dc "$MODDIR/$p" >"$STAGE/modules/$plain" || die "xz -d $p" ;;
        *.ko.gz) gzip -dc "$MODDIR/$p" >"$STAGE/modules/$plain" || die "gzip -d $p" ;;
        *.ko) cp "$MODDIR/$p" "$STAGE/modules/$plain" ;;
        *) die "module $p: unsupported compression" ;;
        esac
        echo "$plain" >>"$STAGE/modules/order"
    done
    printf '%s\n' "$INIT_SCRIPT" >"$STAGE/init"
    chmod 755 "$STAGE/init"
    (cd "$STAGE" && find . -print0 | cpio --null -o -H newc --quiet | gzip -6) >"$INITRD.tmp" ||
        die "cpio of the initramfs failed"
    mv "$INITRD.tmp" "$INITRD"
    rm -rf "$STAGE"
    trap - EXIT
    # Older initramfs builds of this kernel are no longer used.
    find "$CACHE/initramfs" -name "$KVER-*.cpio.gz" ! -name "$(basename "$INITRD")" -delete
fi
flock -u 9
exec 9>&-

if ((PREPARE_ONLY)); then
    note "ready: kernel $KVER, initramfs $INITRD, modules: ${MODULE_ORDER[*]##*/}"
    exit 0
fi

# ------------------------------------------------------------------------------
# One run: the command in a second cpio archive, QEMU under a hard timeout.
RUN="$(mktemp -d "${TMPDIR:-/tmp}/flame-vm.XXXXXX")"
QEMU_PID=""
# shellcheck disable=SC2317 # called by the trap
cleanup() {
    [[ -n "$QEMU_PID" ]] && kill -9 "$QEMU_PID" 2>/dev/null
    rm -rf "$RUN"
}
trap cleanup EXIT
MARKER="FLAME-VM-EXIT-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')"
mkdir -p "$RUN/arc/flame-vm"
{
    echo '#!/bin/bash'
    echo 'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp LANG=C.UTF-8'
    for e in "${ENVS[@]}"; do
        printf 'export %q\n' "$e"
    done
    printf 'cd %q || exit 125\n' "$CWD"
    printf 'exec'
    printf ' %q' "$@"
    echo
} >"$RUN/arc/flame-vm/run.sh"
printf 'FLAME_VM_MARKER=%s\n' "$MARKER" >"$RUN/arc/flame-vm/marker"
(cd "$RUN/arc" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) >"$RUN/run.cpio.gz" || die "cpio of the command failed"
cat "$INITRD" "$RUN/run.cpio.gz" >"$RUN/initrd"

case "$ACCEL" in
kvm) CPU=host ;;
tcg) CPU=max ;;
*) die "FLAME_VM_ACCEL must be tcg or kvm: $ACCEL" ;;
esac

# A guest kernel that panics while it boots, before the command starts (the
# console has no "flame-vm: guest up" line), is booted once more: seen once in
# CI, an int3 oops in sched_clock_cpu while the kernel patched its own code
# under TCG with two CPUs, which is the emulator's race, not the test's. A
# panic after the command started is never retried.
for attempt in 1 2; do
    note "booting $KVER ($ACCEL, ${MEM_MIB} MiB, $SMP CPUs, timeout ${TIMEOUT_S} s): $*"
    START_NS="$(date +%s%N)"
    # The console goes to stdout as it comes (the command's output and the kernel's)
    # and to $RUN/console, where the exit marker is looked for. SeaBIOS's terminal
    # escapes are dropped.
    rm -f "$RUN/fifo"
    mkfifo "$RUN/fifo"
    sed -u 's/\r$//; s/\x1bc//g; s/\x1b\[[0-9;?]*[A-Za-z]//g' <"$RUN/fifo" | tee "$RUN/console" &
    TEE_PID=$!
    qemu-system-x86_64 \
        -machine q35,accel="$ACCEL" -cpu "$CPU" -m "$MEM_MIB" -smp "$SMP" \
        -nographic -no-reboot -nic none \
        -kernel "$VMLINUZ" -initrd "$RUN/initrd" \
        -append "console=ttyS0 quiet panic=-1 mitigations=off" \
        -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
        </dev/null >"$RUN/fifo" 2>&1 &
    QEMU_PID=$!
    timed_out=0
    deadline=$((SECONDS + TIMEOUT_S))
    kvm_failed=0
    while kill -0 "$QEMU_PID" 2>/dev/null; do
        # A KVM that cannot run the guest leaves QEMU paused, not exited.
        if [[ "$ACCEL" == kvm ]] && grep -q 'KVM internal error' "$RUN/console"; then
            kvm_failed=1
            kill -9 "$QEMU_PID" 2>/dev/null
            break
        fi
        if ((SECONDS >= deadline)); then
            timed_out=1
            kill -9 "$QEMU_PID" 2>/dev/null
            break
        fi
        sleep 0.2
    done
    qemu_rc=0
    wait "$QEMU_PID" || qemu_rc=$?
    QEMU_PID=""
    wait "$TEE_PID" 2>/dev/null || true
    WALL_MS=$((($(date +%s%N) - START_NS) / 1000000))
    if ((attempt == 1 && !timed_out && !kvm_failed)) &&
        ! grep -q "^$MARKER " "$RUN/console" &&
        ! grep -q 'flame-vm: guest up' "$RUN/console" &&
        grep -q 'Kernel panic' "$RUN/console"; then
        note "the guest kernel panicked while booting, before the command started: booting once more"
        continue
    fi
    break
done

((kvm_failed)) && die "KVM could not run the guest (KVM internal error, above): use FLAME_VM_ACCEL=tcg"
if ((timed_out)); then
    note "TIMEOUT: the guest ran longer than ${TIMEOUT_S} s and was killed"
    exit 124
fi
rc="$(tr -d '\r' <"$RUN/console" | sed -n "s/^$MARKER \([0-9]\{1,3\}\)\$/\1/p" | tail -n 1)"
if [[ -z "$rc" ]]; then
    grep -q FLAME-VM-INIT-FAILED "$RUN/console" && die "the guest's init failed (see above)"
    die "no exit marker from the guest (QEMU exit status $qemu_rc): a kernel panic or a crash of init? (console above)"
fi
note "command exited $rc; QEMU ran $((WALL_MS / 1000)).$(printf '%03d' $((WALL_MS % 1000))) s wall"
exit "$rc"
