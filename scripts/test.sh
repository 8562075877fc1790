#!/usr/bin/env bash
# Flame's test command: everything CI checks, in order, on a fresh Debian 12 machine
# (as root, with Rust installed). Run it from anywhere: scripts/test.sh
#
#   1. installs the test tools with apt-get, only those missing
#   2. cargo fmt --check, clippy -D warnings (plain, then flame-common,
#      flame-osd and flame-client once more with every feature: failpoints, ublk,
#      rdma)
#   3. cargo build --workspace --bins --features flame-osd/failpoints,flame-client/ublk;
#      the test VM (scripts/vm.sh: a QEMU guest with Debian's 6.12 kernel, since
#      this machine's kernel has no nbd or ublk module) prepared and booted once;
#      cargo test --workspace (unit + integration tests; the integration tests
#      start the real binaries, see tests/; the OSD is built with its failpoints
#      for them; tests/tests/kernel_nbd.rs runs a cluster and the kernel's NBD
#      client in the VM, tests/tests/ublk_vm.rs a cluster and flame-ublk with a
#      kill -9 and recovery under ext4); flame-client's unit tests with `ublk`
#   4. RDMA (feature `rdma`; must compile and lint everywhere, linted in step 2):
#      cargo test -p flame-common --features rdma rdma (the transport's pure
#      parts and device discovery, which must answer cleanly without hardware), then
#      flame-osd and flame-nbd rebuilt with the feature must refuse `transport: rdma`
#      on a machine without a device, naming it (tests/tests/rdma_unavailable.rs),
#      and, in the test VM over Soft-RoCE, the transport conformance suite's rdma
#      cases, a cluster on `transport: rdma` and the replication and nbd_cluster
#      suites with FLAME_TEST_TRANSPORT=rdma (tests/tests/rdma_vm.rs)
#   5. smoke test of deploy/dev-cluster.sh: up, flame-admin status, qemu-io through
#      flame-nbd, down, up again (same data), down — in a temporary directory with
#      its own port base (ports 16800..16839 by default), so it runs beside a
#      default dev cluster (deploy/dev-cluster.sh up, ports 6800 etc.)
#   6. the deterministic simulator in the release build: every regression seed
#      (one test per bug), seeds 1..120 and a window of 100 that moves with the
#      commit (printed, with the command that replays it); the main pass ran
#      seeds 1..4 in the debug build
#
# Environment: FLAME_SMOKE_PORT_BASE=N moves the smoke cluster to ports N..N+39 (for
# two test runs at once, or a machine where 16800..16839 are taken);
# FLAME_TEST_SKIP_SMOKE=1 skips step 5; FLAME_SIM_WINDOW_FROM=N runs step 6's
# window from seed N (to replay a run's), FLAME_SIM_MOVING=0 leaves it out.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# A clean clone builds everything once: incremental compilation's caches would only
# take disk (a CI run once failed with ENOSPC writing one) and time.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

START=$SECONDS
section_start=$SECONDS
section() {
    if ((SECONDS > START)); then
        echo "---- (previous section took $((SECONDS - section_start)) s)"
    fi
    section_start=$SECONDS
    printf '\n==== [%4d s] %s ====\n' $((SECONDS - START)) "$*"
}
die() {
    echo "test.sh: FAILED: $*" >&2
    exit 1
}

# ------------------------------------------------------------------------------
section "system packages"
# qemu-utils: qemu-io, qemu-img; libnbd-bin: nbdinfo, nbdcopy, nbdfuse; fio (nbd
# engine); python3-libnbd: scripted NBD clients; fuse3: nbdfuse's mounts; cmake and
# libclang-dev: the rdma feature's build (sideway's bindings); iptables: network
# fault tests; curl: metrics checks; shellcheck: lints these scripts;
# qemu-system-x86 (and qemu-system-common, named: without it apt once found no
# solution on a fresh machine), kmod, cpio, xz-utils: the test VM (scripts/vm.sh); nbd-client,
# e2fsprogs: the kernel NBD test run in it (tests/tests/kernel_nbd.rs; the guest
# runs the host's own tools); rdma-core, ibverbs-providers (librxe, Soft-RoCE's
# userspace driver), libibverbs1, ibverbs-utils (ibv_devices), iproute2 (`rdma
# link add`): the rdma tests run in it over Soft-RoCE (tests/tests/rdma_vm.rs).
PACKAGES=(qemu-utils libnbd-bin fio python3-libnbd fuse3 cmake libclang-dev iptables curl shellcheck
    qemu-system-common qemu-system-x86 kmod cpio xz-utils nbd-client e2fsprogs
    rdma-core ibverbs-providers libibverbs1 ibverbs-utils iproute2)
missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    SUDO=()
    if ((EUID != 0)); then
        command -v sudo >/dev/null || die "not root and no sudo: install ${missing[*]} by hand"
        SUDO=(sudo)
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -q
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
    # A machine may come with a newer qemu-utils than its apt sources hold; the
    # sources' qemu-system-common Breaks it, so apt removes it to install the VM's
    # QEMU. Then put back the sources' own qemu-utils (qemu-io, qemu-img,
    # qemu-nbd), of the same version as qemu-system.
    if ! command -v qemu-io >/dev/null; then
        echo "qemu-utils was removed by the qemu-system install: installing the matching one"
        "${SUDO[@]}" apt-get install -y -q --no-install-recommends qemu-utils
    fi
else
    echo "all present: ${PACKAGES[*]}"
fi

# Fail loudly here rather than with a confusing error deep inside a test.
for tool in cargo rustc qemu-io qemu-img qemu-nbd nbdinfo nbdcopy nbdfuse fio fusermount3 cmake iptables curl shellcheck setsid \
    qemu-system-x86_64 depmod cpio xz nbd-client mkfs.ext4 rdma ibv_devices ibv_devinfo; do
    command -v "$tool" >/dev/null || die "required tool '$tool' is missing after the install step"
done
compgen -G '/usr/lib/*/libibverbs/librxe-rdmav*.so' >/dev/null || die "the rxe provider (librxe) is missing (ibverbs-providers)"
cargo fmt --version >/dev/null 2>&1 || die "rustfmt is missing (rustup component add rustfmt)"
cargo clippy --version >/dev/null 2>&1 || die "clippy is missing (rustup component add clippy)"
/usr/bin/python3 -c 'import nbd' 2>/dev/null || die "python3-libnbd is not importable by /usr/bin/python3"
compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null || die "libclang is missing (libclang-dev)"
# The test clusters live on this file system; say how full it is (a nearly full
# disk fails writes with ENOSPC, as it should).
echo "disk: $(df -h --output=size,used,avail,pcent "${TMPDIR:-/tmp}" | tail -n 1)"
# The builds below (debug, the rdma build, release) take several GiB beside the
# repository: say so first when there is less, so an ENOSPC later is explained.
target_dir="${CARGO_TARGET_DIR:-$REPO/target}"
mkdir -p "$target_dir"
target_free_kib="$(df -k --output=avail "$target_dir" | tail -n 1 | tr -d ' ')"
echo "disk of $target_dir: $((target_free_kib / 1024)) MiB free"
if ((target_free_kib < 8 * 1024 * 1024)); then
    echo "WARNING: less than 8 GiB free for the builds in $target_dir; a full run's builds take about 7 GiB" >&2
fi
echo "tools: $(rustc --version); $(qemu-io --version | head -n 1); $(nbdinfo --version | head -n 1); $(fio --version)"

# ------------------------------------------------------------------------------
section "shellcheck"
shellcheck deploy/dev-cluster.sh scripts/*.sh tests/vm/*.sh .ci/run

section "cargo fmt --all -- --check"
cargo fmt --all -- --check

section "cargo clippy --workspace --all-targets -- -D warnings (and with every feature)"
cargo clippy --workspace --all-targets -- -D warnings
# The code behind features, linted in one more pass (one pass instead of three:
# each re-checks every crate above the one whose features changed): flame-osd's
# failpoints, flame-ublk (flame-client's `ublk`: libublk, bindgen, needs
# libclang), and the rdma transport (`rdma`, sideway).
cargo clippy -p flame-common -p flame-osd -p flame-client --all-targets --features \
    flame-osd/failpoints,flame-client/ublk,flame-common/rdma,flame-osd/rdma,flame-client/rdma -- -D warnings

section "cargo build --workspace --bins --features flame-osd/failpoints,flame-client/ublk"
# The integration tests (tests/) start these binaries, so they are built first —
# flame-osd with its failpoints (injected disk and network faults, controlled over
# its metrics HTTP server; tests/tests/faults.rs). Release builds have none.
# flame-ublk too, for tests/tests/ublk_vm.rs (the test VM).
cargo build --workspace --bins --features flame-osd/failpoints,flame-client/ublk

section "test VM: scripts/vm.sh --prepare, then a boot"
# The kernel package and busybox are fetched by package name and the initramfs
# built once, into FLAME_VM_CACHE (/var/cache/flame-vm); later runs reuse them.
# Done here so a first run's download is not charged to a test, and a broken VM
# fails here, by name. Then one boot that runs nothing: its exit status must come
# back, with nbd and Soft-RoCE's modules loaded (tests/tests/kernel_nbd.rs runs
# the real thing in the main pass below, tests/tests/rdma_vm.rs in the rdma
# section).
scripts/vm.sh --prepare
vm_rc=0
scripts/vm.sh --timeout 120 -- bash -c 'test -b /dev/nbd0 && test -d /sys/module/rdma_rxe && exit 7' || vm_rc=$?
((vm_rc == 7)) || die "the test VM did not return its command's exit status (7 expected, got $vm_rc)"

section "cargo test --workspace --no-fail-fast"
# Includes tests/tests/kernel_nbd.rs: a cluster, nbd-client, qemu-nbd -c and ext4
# in the test VM (about 80 s; docs/testing.md, "The test VM"), and
# tests/tests/ublk_vm.rs: flame-ublk, ext4, fio verify, kill -9 and --recover in
# the VM (about 95 s).
# `cargo test` builds the binaries of every package that has integration tests
# (tests/*.rs) with that command's features, over the ones built above: an
# integration test in flame-osd would replace the failpoints build of flame-osd and
# the fault tests would find no failpoints. flame-osd's tests stay unit tests.
[[ ! -d flame-osd/tests ]] || die "flame-osd/tests/ exists: cargo test would rebuild flame-osd without failpoints; make those tests unit tests (#[cfg(test)] modules)"
echo "disk after the build: $(df -h --output=used,avail,pcent "${TMPDIR:-/tmp}" | tail -n 1)"
# The simulator's seeds run here in the debug build (debug assertions on): the
# fixed seeds 1..4 (not moving: a debug-only assertion's failure stays
# comparable from run to run; each seed runs 1 000-2 000 operations on volumes
# of up to 1 GiB, five times the CPU of the 300-operation seeds of which 60 ran
# here); the release build the smoke test makes runs every regression seed (one
# test per bug, ignored here) and seeds 1..120 at the end.
FLAME_SIM_SEEDS="${FLAME_SIM_SEEDS:-4}" cargo test --workspace --no-fail-fast
# flame-client's unit tests of the ublk module (its config, request decoding).
cargo test -p flame-client --features ublk --lib ublk

section "FLAME_TEST_TRANSPORT=shm cargo test -p flame-tests --test replication --test nbd_cluster"
# The same real-cluster tests with every OSD and flame-nbd on the shm transport
# (tests/tests/shm_transport.rs runs shm in the main pass too).
FLAME_TEST_TRANSPORT=shm cargo test -p flame-tests --test replication --test nbd_cluster

section "FLAME_TEST_AUTH=none FLAME_TEST_MEMORY_POOL=locked FLAME_TEST_THREADING=staged cargo test -p flame-tests --test replication"
# The paths kept only for the comparisons (one locked pool, staged threads) run a
# real-cluster test so they do not rot; with the manager's `auth: none`, the
# setting an operator may choose, so it keeps working too.
FLAME_TEST_AUTH=none FLAME_TEST_MEMORY_POOL=locked FLAME_TEST_THREADING=staged cargo test -p flame-tests --test replication

section "FLAME_TEST_TRANSPORT=shm FLAME_TEST_THREADING=staged cargo test -p flame-tests --test nbd_cluster"
# Staged threads over shm, where writes and reads of 64 KiB and more are converted
# by default: the network threads must run the one-sided transfers (a bug once:
# every converted request failed with EINVAL in staged mode).
FLAME_TEST_TRANSPORT=shm FLAME_TEST_THREADING=staged cargo test -p flame-tests --test nbd_cluster
# Sessions and their fences in staged mode (the workers keep them), keyed by
# entity (another entity's claim of a session id fences nothing), and op ids
# scoped by entity (the network threads scope them), and a rotated osd key
# followed by the network threads' HELLO gates.
FLAME_TEST_THREADING=staged cargo test -p flame-tests --test osd_protocol -- a_reconnected_session_fences_its_old_connection a_clients_op_ids_are_scoped_to_its_entity a_rotated_osd_key_reaches_every_osd_without_a_restart

section "cargo test -p flame-osd --features failpoints failpoints"
cargo test -p flame-osd --features failpoints failpoints

section "rdma: unit tests, daemons refuse without a device, Soft-RoCE in the test VM"
# (Its code was linted with the other features' at the start.)
# Also builds the conformance executable with the feature (its rdma cases are
# listed as ignored here: this machine has no RDMA device); rdma_vm runs them.
cargo test -p flame-common --features rdma rdma
# Last, because it replaces the debug binaries the tests above used (the OSD's
# failpoints build) with RDMA-enabled ones.
cargo build -p flame-osd -p flame-client --bins --features flame-osd/rdma,flame-client/rdma
FLAME_TEST_RDMA_BUILD=1 cargo test -p flame-tests --test rdma_unavailable
# In the test VM, over Soft-RoCE (rxe0 on a guest-local dummy netdev): the
# conformance suite's rdma cases, a three-OSD cluster with flame-nbd on
# transport: rdma (conversion, fetched replies, a copy killed) through NBD, and
# the replication and nbd_cluster suites with FLAME_TEST_TRANSPORT=rdma.
# Ignored in the main pass (they need the two rdma builds just made); about
# 4-5 minutes (docs/testing.md, "rdma over Soft-RoCE").
cargo test -p flame-tests --test replication --test nbd_cluster --no-run
cargo test -p flame-tests --test rdma_vm -- --ignored --test-threads 1

# ------------------------------------------------------------------------------
if [[ "${FLAME_TEST_SKIP_SMOKE:-0}" == 1 ]]; then
    section "dev cluster smoke test: SKIPPED (FLAME_TEST_SKIP_SMOKE=1)"
else
    section "dev cluster smoke test (deploy/dev-cluster.sh)"
    SMOKE_DIR="$(mktemp -d /tmp/flame-smoke.XXXXXX)"
    SMOKE_PORT_BASE="${FLAME_SMOKE_PORT_BASE:-16800}"
    DEV=(deploy/dev-cluster.sh --dir "$SMOKE_DIR" --port-base "$SMOKE_PORT_BASE")
    cleanup() {
        "${DEV[@]}" down >/dev/null 2>&1 || true
        rm -rf "$SMOKE_DIR"
    }
    trap cleanup EXIT
    smoke_fail() {
        echo "---- logs of the smoke cluster ----" >&2
        "${DEV[@]}" logs >&2 || true
        die "$*"
    }
    ADMIN="${CARGO_TARGET_DIR:-$REPO/target}/${FLAME_PROFILE:-release}/flame-admin"
    PLAIN_URI="nbd://127.0.0.1:$((SMOKE_PORT_BASE + 1))/demo"
    # A bad command line names what is wrong and exits 2 before touching anything.
    bad_rc=0
    bad_out="$("${DEV[@]}" frobnicate 2>&1)" || bad_rc=$?
    if ((bad_rc != 2)) || ! grep -q "unknown command 'frobnicate'" <<<"$bad_out"; then
        smoke_fail "an unknown command must be named (exit $bad_rc): $bad_out"
    fi

    "${DEV[@]}" up || smoke_fail "dev-cluster.sh up"
    "${DEV[@]}" up >/dev/null || smoke_fail "dev-cluster.sh up on a running cluster must succeed"
    "${DEV[@]}" status || smoke_fail "dev-cluster.sh status"
    # No --mgr: flame-admin finds this cluster's manager, admin keyring and CA
    # through the env file `up` writes (FLAME_MGR, FLAME_KEYRING, FLAME_MGR_CA).
    # shellcheck source=/dev/null
    source "$SMOKE_DIR/env" || smoke_fail "dev-cluster.sh up wrote no $SMOKE_DIR/env"
    [[ "${FLAME_MGR:-}" == "127.0.0.1:$SMOKE_PORT_BASE" ]] || smoke_fail "env file sets FLAME_MGR=${FLAME_MGR:-} (want 127.0.0.1:$SMOKE_PORT_BASE)"
    "$ADMIN" status || smoke_fail "flame-admin status"
    status_json="$("$ADMIN" status --json)" || smoke_fail "flame-admin status --json"
    grep -Eq '"osds_up": *3' <<<"$status_json" || smoke_fail "expected 3 OSDs up: $status_json"
    "$ADMIN" volume info demo || smoke_fail "volume demo missing"
    # Nobody without the key changes anything: a raw DELETE and flame-admin without
    # FLAME_KEYRING are refused, and the volume is still there.
    # The manager serves HTTPS only, under the cluster CA the env file names.
    [[ -f "${FLAME_MGR_CA:-}" ]] || smoke_fail "env file sets no FLAME_MGR_CA (the cluster CA)"
    code="$(curl -s -o /dev/null -w '%{http_code}' --cacert "$FLAME_MGR_CA" -X DELETE "https://127.0.0.1:$SMOKE_PORT_BASE/v1/volumes/demo")"
    [[ "$code" == 401 ]] || smoke_fail "an unsigned DELETE of a volume answered $code, not 401"
    code="$(curl -s -m 5 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$SMOKE_PORT_BASE/metrics" || true)"
    [[ "$code" == 000 ]] || smoke_fail "the manager answered plain HTTP with $code"
    if env -u FLAME_KEYRING "$ADMIN" volume rm demo 2>/dev/null; then
        smoke_fail "flame-admin without a keyring removed a volume"
    fi
    "$ADMIN" volume info demo >/dev/null || smoke_fail "volume demo gone after refused deletes"

    # flame-nbd: the env file names the Unix socket export (this user only) and
    # the TLS one with its client credentials; TCP without a certificate is refused.
    URI="${FLAME_NBD_URI:-}"
    [[ "$URI" == nbd+unix://* ]] || smoke_fail "env file sets FLAME_NBD_URI=$URI (want nbd+unix://…)"
    [[ -f "${FLAME_NBD_TLS_DIR:-}/client-cert.pem" ]] || smoke_fail "env file sets no FLAME_NBD_TLS_DIR with a client certificate"
    if nbdinfo --list "$PLAIN_URI" >/dev/null 2>&1; then
        smoke_fail "flame-nbd listed its exports to a client without TLS"
    fi

    # Across the 4 MiB object boundary, and readback.
    qemu-io -f raw "$URI" \
        -c 'write -P 0xab 0 1M' \
        -c 'write -P 0xcd 4190208 8192' \
        -c 'read -P 0xab 0 1M' \
        -c 'read -P 0xcd 4190208 8192' \
        -c 'read -P 0 1048576 4096' || smoke_fail "qemu-io write/read through flame-nbd"
    # The same bytes over TLS with the client certificate `up` issued.
    nbdinfo "$FLAME_NBD_TLS_URI" >/dev/null || smoke_fail "nbdinfo over TLS ($FLAME_NBD_TLS_URI)"
    qemu-io --object "tls-creds-x509,id=tls0,dir=$FLAME_NBD_TLS_DIR,endpoint=client" \
        --image-opts "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=$((SMOKE_PORT_BASE + 1)),export=demo,tls-creds=tls0" \
        -c 'read -P 0xab 0 1M' || smoke_fail "qemu-io over TLS through flame-nbd"
    # The dev cluster runs shm between flame-nbd and the OSDs (and between OSDs):
    # the shm grant counters exist only once a shm connection was made, so their
    # absence means every connection fell back to tcp.
    for port in $((SMOKE_PORT_BASE + 2)) $((SMOKE_PORT_BASE + 3)); do
        curl -sf "http://127.0.0.1:$port/metrics" | grep -q '^flame_shm_grants_total' ||
            smoke_fail "no shm connection on the daemon with metrics port $port (fell back to tcp?)"
    done

    # The README's benchmark runs on a scratch volume; `demo` now holds data, so a
    # write benchmark on it is refused.
    if "$ADMIN" bench demo --rw randwrite --runtime 1s >/dev/null 2>&1; then
        smoke_fail "a write benchmark overwrote volume demo, which holds data"
    fi
    "$ADMIN" volume create scratch --size 1G || smoke_fail "volume create scratch"
    "$ADMIN" bench scratch --rw randwrite --bs 4k --iodepth 8 --runtime 1s || smoke_fail "bench scratch"
    "$ADMIN" volume rm scratch || smoke_fail "volume rm scratch"

    "${DEV[@]}" down || smoke_fail "dev-cluster.sh down"
    if "${DEV[@]}" status >/dev/null 2>&1; then smoke_fail "status after down says running"; fi
    "${DEV[@]}" up --no-build >/dev/null || smoke_fail "dev-cluster.sh up after down"
    qemu-io -f raw "$URI" \
        -c 'read -P 0xab 0 1M' \
        -c 'read -P 0xcd 4190208 8192' || smoke_fail "data written before down/up is gone"
    "${DEV[@]}" down || smoke_fail "dev-cluster.sh down"
    trap - EXIT
    cleanup
fi

# The simulator in the release build, 120 seeds in two processes (each 1 000-2 000
# operations on 1-3 volumes of 64 MiB-1 GiB: about 1 s of CPU a seed, see
# docs/testing.md "Cost"; built by the smoke test's release build, or here):
# the fixed seeds 1..120, comparable from run to run, and a window of 100 that
# moves with the commit, so CI looks somewhere new each time: a seed that fails
# there is a bug found (replay it with the command printed; it joins the
# regression tests once traced). The regression seeds run here first
# (tests/tests/simulator.rs, one test per bug, ignored in the debug pass). FLAME_SIM_WINDOW_FROM=N replays
# a given run's window; FLAME_SIM_MOVING=0 leaves the window out.
SIM_FIXED=120
SIM_WINDOW=100
sim_from=""
if [[ -n "${FLAME_SIM_WINDOW_FROM:-}" ]]; then
    [[ "$FLAME_SIM_WINDOW_FROM" =~ ^[0-9]+$ ]] || die "FLAME_SIM_WINDOW_FROM=$FLAME_SIM_WINDOW_FROM: not a number"
    sim_from="$FLAME_SIM_WINDOW_FROM"
    sim_why="FLAME_SIM_WINDOW_FROM"
elif [[ "${FLAME_SIM_MOVING:-1}" != 0 ]]; then
    if head=$(git -C "$REPO" rev-parse --verify -q HEAD 2>/dev/null) && [[ "$head" =~ ^[0-9a-f]{8} ]]; then
        # From the commit: 1000 + (first 8 hex digits of HEAD) mod 10 000 000,
        # past the fixed block and the seeds the regression tests name.
        sim_from=$((1000 + 16#${head:0:8} % 10000000))
        sim_why="commit ${head:0:12}"
    else
        sim_from=1000
        sim_why="not a git checkout: the window does not move (set FLAME_SIM_WINDOW_FROM to move it)"
    fi
fi
if [[ -n "$sim_from" ]]; then
    section "simulator, release build: fixed seeds 1..$SIM_FIXED, window $sim_from..$((sim_from + SIM_WINDOW - 1)) ($sim_why)"
    echo "replay this window: scripts/simulate.sh --seeds $SIM_WINDOW --from $sim_from --jobs 2"
else
    section "simulator, release build: fixed seeds 1..$SIM_FIXED (FLAME_SIM_MOVING=0: no moving window)"
fi
echo "  (one seed: scripts/simulate.sh --seed N)"
# Every regression seed, one test per bug (ignored in the debug pass: docs/testing.md).
cargo test --release -p flame-tests --test simulator -- --skip every_seed_of_the_ci_budget
scripts/simulate.sh --seeds "$SIM_FIXED" --from 1 --jobs 2
if [[ -n "$sim_from" ]]; then
    scripts/simulate.sh --seeds "$SIM_WINDOW" --from "$sim_from" --jobs 2
fi

section "all tests passed in $((SECONDS - START)) s"
