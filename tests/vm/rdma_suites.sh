#!/usr/bin/env bash
# Runs INSIDE the test VM (scripts/vm.sh; started by tests/tests/rdma_vm.rs): the
# Rust cluster suites (tests/tests/replication.rs, tests/tests/nbd_cluster.rs,
# built on the host and seen read-only over 9p) with FLAME_TEST_TRANSPORT=rdma,
# over Soft-RoCE. The harness starts flame-mgr, the OSDs and flame-nbd from the
# executables' target directory (the host's build with --features
# flame-osd/rdma,flame-client/rdma): every OSD and flame-nbd on `transport: rdma`,
# their TCP bootstraps on the guest's loopback, their queue pairs on rxe0
# (tests/vm/soft_roce.sh exports the device the daemons inherit).
#
#   rdma_suites.sh [NAME=VALUE...] EXE [[NAME=VALUE...] EXE]...
#       each EXE a cargo test executable, all of whose tests run (one at a time:
#       two emulated CPUs) with the NAME=VALUE settings just before it (the
#       harness's FLAME_TEST_* knobs, e.g. FLAME_TEST_REPLY_MODE=fetch)
#
# After the suites, the daemons' work must show on rxe0's packet counters (a
# daemon that fell back to anything else would leave them still). Prints
# "rdma_suites: OK" at the end; any failure exits non-zero.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tests/vm/soft_roce.sh
source "$HERE/soft_roce.sh"

fail() { echo "rdma_suites: FAILED: $*" >&2; exit 1; }
(($# > 0)) || fail "usage: rdma_suites.sh TEST_EXECUTABLE..."
# One entry per suite in each array: its settings ("NAME=VALUE ...": the
# FLAME_TEST_* values hold no spaces) and its executable's absolute path.
run_settings=()
run_exes=()
settings=""
for arg in "$@"; do
    if [[ "$arg" =~ ^FLAME_TEST_[A-Z_]+=[^[:space:]]*$ ]]; then
        settings+="$arg "
        continue
    fi
    [[ -x "$arg" ]] || fail "$arg is neither a FLAME_TEST_NAME=VALUE setting nor an executable"
    run_settings+=("$settings")
    run_exes+=("$(cd "$(dirname "$arg")" && pwd)/$(basename "$arg")")
    settings=""
done
((${#run_exes[@]} > 0)) || fail "no test executable given"
[[ -z "$settings" ]] || fail "settings after the last executable: $settings"
soft_roce_up

counter() { cat "/sys/class/infiniband/$SOFT_ROCE_DEV/ports/1/hw_counters/$1" 2>/dev/null || echo 0; }
sent_before="$(counter sent_pkts)"
cd "${TMPDIR:-/tmp}"
for i in "${!run_exes[@]}"; do
    read -r -a vars <<<"${run_settings[$i]}"
    exe="${run_exes[$i]}"
    start=$SECONDS
    rc=0
    echo "rdma_suites: FLAME_TEST_TRANSPORT=rdma ${run_settings[$i]}$exe"
    env FLAME_TEST_TRANSPORT=rdma "${vars[@]}" "$exe" --test-threads 1 || rc=$?
    echo "rdma_suites: $(basename "$exe"): $((SECONDS - start)) s in the guest, exit $rc"
    ((rc == 0)) || fail "$(basename "$exe") failed with transport rdma (exit $rc)"
done
sent_after="$(counter sent_pkts)"
echo "rdma_suites: rxe0 sent $((sent_after - sent_before)) packets during the suites"
((sent_after - sent_before > 1000)) ||
    fail "rxe0 sent only $((sent_after - sent_before)) packets: the clusters did not run over rdma"
echo "rdma_suites: OK"
