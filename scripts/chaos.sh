#!/usr/bin/env bash
# The chaos test (tests/tests/chaos.rs) for as long as you like: random OSD kill -9 /
# restart / out / in / network partition (iptables on lo: run as root) on a four-OSD
# loopback cluster while the write oracle's verified workload runs, never more than
# one failure at a time; then a full verification of every block and a byte
# comparison of the copies of every placement group.
#
#   scripts/chaos.sh                         # 1 minute, seed from the clock
#   scripts/chaos.sh --minutes 30 --seed 42  # a long run, reproducible choices
#   scripts/chaos.sh --seconds 90 --release  # release build
#   scripts/chaos.sh --no-partitions         # without root / iptables
#
# Prints the totals (minutes, kills, outs, partitions, writes verified) at the end; a
# failing run prints "CHAOS FAILED: seed S" with the command that replays its
# sequence of actions. The CI suite runs the same test for 60 s (cargo test --test
# chaos).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

seconds=60
seed=""
profile=()
partitions=1
usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}
while (($#)); do
    case "$1" in
    --minutes)
        [[ ${2:-} =~ ^[0-9]+$ ]] || usage 2
        seconds=$(($2 * 60))
        shift 2
        ;;
    --seconds)
        [[ ${2:-} =~ ^[0-9]+$ ]] || usage 2
        seconds=$2
        shift 2
        ;;
    --seed)
        [[ ${2:-} =~ ^[0-9]+$ ]] || usage 2
        seed=$2
        shift 2
        ;;
    --release)
        profile=(--release)
        shift
        ;;
    --no-partitions)
        partitions=0
        shift
        ;;
    -h | --help) usage 0 ;;
    *) usage 2 ;;
    esac
done
((seconds > 0)) || usage 2
if [[ -z $seed ]]; then
    seed=$(($(date +%s%N) % 1000000))
fi

echo "chaos: ${seconds} s, seed ${seed}, partitions ${partitions}"
cargo build "${profile[@]}" --workspace --bins
export FLAME_CHAOS_SECONDS=$seconds FLAME_CHAOS_SEED=$seed FLAME_CHAOS_PARTITIONS=$partitions
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
log=$(mktemp -t flame-chaos.XXXXXX)
trap 'rm -f "$log"' EXIT
replay="scripts/chaos.sh --seconds ${seconds} --seed ${seed}${profile:+ --release}"
((partitions)) || replay+=" --no-partitions"
if ! cargo test "${profile[@]}" -p flame-tests --test chaos -- --include-ignored --nocapture 2>&1 | tee "$log"; then
    echo "CHAOS FAILED: seed ${seed} (replay: ${replay})" >&2
    exit 1
fi
# The totals, last, where a long run's log ends.
echo "totals: $(grep -o 'CHAOS OK: .*' "$log" | tail -n 1)"
