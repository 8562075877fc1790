#!/usr/bin/env bash
# flame-ublk against flame-nbd + the kernel's NBD client: 4 KiB random reads and
# writes at QD1 and QD32 (fio), on one Flame cluster, same run; prints a table of
# IOPS and their ratio (tests/vm/bench_ublk_nbd.sh does the work).
#
#   scripts/bench-ublk-vs-nbd.sh           in the test VM (scripts/vm.sh, TCG):
#                                          emulated CPUs, only the RATIO means
#                                          anything
#   scripts/bench-ublk-vs-nbd.sh --here    on this machine, as root, when its
#                                          kernel has ublk_drv and nbd loaded
#                                          (modprobe ublk_drv nbd): real figures
#
# Build first: cargo build --release --workspace --bins --features flame-client/ublk
# Options: --bin DIR (default: $CARGO_TARGET_DIR/release, else target/release),
# --runtime S (seconds per fio run, default 10), --region MIB (default 64).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release"
HERE=0
RUNTIME=10
REGION=64
while (($#)); do
    case "$1" in
    --here) HERE=1; shift ;;
    --bin) BIN="${2:?--bin needs a directory}"; shift 2 ;;
    --runtime) RUNTIME="${2:?--runtime needs seconds}"; shift 2 ;;
    --region) REGION="${2:?--region needs MiB}"; shift 2 ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-ublk-vs-nbd.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
[[ -d "$BIN" ]] || { echo "bench-ublk-vs-nbd.sh: no directory $BIN: build first (see --help)" >&2; exit 2; }
BIN="$(cd "$BIN" && pwd)"
for b in flame-mgr flame-osd flame-nbd flame-ublk flame-admin; do
    [[ -x "$BIN/$b" ]] || { echo "bench-ublk-vs-nbd.sh: $BIN/$b missing: cargo build --release --workspace --bins --features flame-client/ublk" >&2; exit 2; }
done
cd "$REPO"
if ((HERE)); then
    exec env FLAME_BIN="$BIN" BENCH_RUNTIME="$RUNTIME" BENCH_REGION_MIB="$REGION" bash tests/vm/bench_ublk_nbd.sh
fi
# 8 fio runs, the prefill, the cluster's start: bounded well above that.
TIMEOUT=$((8 * (RUNTIME + 15) + 240))
exec scripts/vm.sh --timeout "$TIMEOUT" --modules ublk_drv --env FLAME_BIN="$BIN" \
    --env BENCH_RUNTIME="$RUNTIME" --env BENCH_REGION_MIB="$REGION" -- bash tests/vm/bench_ublk_nbd.sh
