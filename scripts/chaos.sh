#!/usr/bin/env bash
# The chaos test (tests/tests/chaos.rs) for as long as you like: random OSD kill -9 /
# restart / out / in on a four-OSD loopback cluster while the write oracle's verified
# workload runs, never more than one failure at a time; then a full verification of
# every block and a byte comparison of the copies of every placement group.
#
#   scripts/chaos.sh                         # 1 minute, seed from the clock
#   scripts/chaos.sh --minutes 30 --seed 42  # a long run, reproducible choices
#   scripts/chaos.sh --seconds 90 --release  # release build
#
# Prints the totals (minutes, kills, outs, writes verified) at the end; a failing run
# prints "CHAOS FAILED: seed S" with the command that replays its sequence of
# actions. The CI suite runs the same test for 60 s (cargo test --test chaos).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

seconds=60
seed=""
profile=()
usage() {
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
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
    -h | --help) usage 0 ;;
    *) usage 2 ;;
    esac
done
((seconds > 0)) || usage 2
if [[ -z $seed ]]; then
    seed=$(($(date +%s%N) % 1000000))
fi

echo "chaos: ${seconds} s, seed ${seed}"
cargo build "${profile[@]}" --workspace --bins
export FLAME_CHAOS_SECONDS=$seconds FLAME_CHAOS_SEED=$seed
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
if ! cargo test "${profile[@]}" -p flame-tests --test chaos -- --include-ignored --nocapture; then
    echo "CHAOS FAILED: seed ${seed} (replay: scripts/chaos.sh --seconds ${seconds} --seed ${seed})" >&2
    exit 1
fi
