#!/usr/bin/env bash
# Runs INSIDE the test VM (scripts/vm.sh; started by tests/tests/rdma_vm.rs): the
# transport conformance suite's rdma cases (flame-common/tests/
# transport_conformance.rs, built on the host with --features rdma) over
# Soft-RoCE. Every case's queue pairs are on rxe0 in this guest; the bootstrap
# sockets are on its loopback.
#
#   FLAME_RDMA_CONFORMANCE  the test executable (the host's build, seen over 9p)
#
# Prints "rdma_conformance: OK" at the end; any failure exits non-zero.
set -euo pipefail

EXE="${FLAME_RDMA_CONFORMANCE:?FLAME_RDMA_CONFORMANCE must name the transport_conformance executable built with --features rdma}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tests/vm/soft_roce.sh
source "$HERE/soft_roce.sh"

[[ -x "$EXE" ]] || { echo "rdma_conformance: FAILED: $EXE is not an executable" >&2; exit 1; }
soft_roce_up

cd "${TMPDIR:-/tmp}"
# The rdma cases are the ignored ones (no device on the host); --ignored runs
# them, and the filter keeps to them (the tcp and shm cases ran on the host).
# Two threads, one per emulated CPU; each case bounds itself (60 s).
list="$("$EXE" --ignored --list rdma 2>/dev/null | grep -c ': test$')" || list=0
((list >= 17)) || { echo "rdma_conformance: FAILED: only $list rdma cases listed (want 17): not a --features rdma build?" >&2; exit 1; }
start=$SECONDS
rc=0
"$EXE" --ignored --test-threads 2 rdma || rc=$?
echo "rdma_conformance: $list cases, $((SECONDS - start)) s in the guest, exit $rc"
echo "---- rxe0 counters (/sys/class/infiniband/rxe0/ports/1/hw_counters) ----"
for f in sent_pkts rcvd_pkts rdma_sends rdma_recvs send_err duplicate_request out_of_seq_request retry_exceeded_err; do
    printf '%s %s\n' "$f" "$(cat "/sys/class/infiniband/rxe0/ports/1/hw_counters/$f" 2>/dev/null || echo '?')"
done
((rc == 0)) || { echo "rdma_conformance: FAILED (exit $rc)" >&2; exit "$rc"; }
echo "rdma_conformance: OK"
