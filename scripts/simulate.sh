#!/usr/bin/env bash
# The deterministic simulator (tests/src/sim/, docs/testing.md): whole clusters in
# virtual time, one seed each, for as many seeds as you like, in parallel processes.
#
#   scripts/simulate.sh --seed 42                     # replay one seed (debug build)
#   scripts/simulate.sh --seeds 5000 --jobs 8         # a long run (release build)
#   scripts/simulate.sh --seeds 1000 --from 100000 --ops 1000
#   scripts/simulate.sh --seed 42 --events            # a passing seed's event log
#   RUST_LOG=info scripts/simulate.sh --seed 42       # with the daemons' logs
#
# Options besides --seeds/--from/--jobs go to the `simulate` binary: --ops N,
# --pg-log N (the OSDs' log bound), --clients N, --writers N, --no-faults, --no-disk-faults, --no-resizes, --no-tcp-holds, --no-shrunk-wait, --no-scrubs, --no-bit-rot, --no-slow-disks, --doubt-does-not-impair, --no-rewrites, --no-tcp-backoff, --twice (run each seed twice and compare the traces),
# --events, --trace-file NAME (with RUST_LOG=info: every disk operation on the
# files of that name, an object's `<volume>.<index>` in 16 hex digits each). A
# failing seed prints its errors, its last events and this script's command that
# replays it; the exit status is 1 if any seed failed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

seeds=""
from=1
jobs=1
pass=()
usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}
while (($#)); do
    case "$1" in
        --seed) [[ $# -ge 2 ]] || usage 2; from="$2"; seeds=1; shift 2 ;;
        --seeds) [[ $# -ge 2 ]] || usage 2; seeds="$2"; shift 2 ;;
        --from) [[ $# -ge 2 ]] || usage 2; from="$2"; shift 2 ;;
        --jobs) [[ $# -ge 2 ]] || usage 2; jobs="$2"; shift 2 ;;
        -h | --help) usage 0 ;;
        *) pass+=("$1"); shift ;;
    esac
done
[[ -n "$seeds" ]] || seeds=1
[[ "$seeds" =~ ^[0-9]+$ && "$from" =~ ^[0-9]+$ && "$jobs" =~ ^[1-9][0-9]*$ ]] || usage 2

target="${CARGO_TARGET_DIR:-target}"
# One seed: the debug build (what CI runs, quick to build). Many: release.
if ((seeds == 1)); then
    cargo build -q -p flame-tests --bin simulate
    exec "$target/debug/simulate" --seed "$from" "${pass[@]}"
fi
cargo build -q --release -p flame-tests --bin simulate
bin="$target/release/simulate"
started=$(date +%s%N)
per=$(((seeds + jobs - 1) / jobs))
logs=$(mktemp -d)
pids=()
for ((j = 0; j < jobs; j++)); do
    start=$((from + j * per))
    count=$((seeds - j * per))
    ((count > per)) && count=$per
    ((count > 0)) || break
    "$bin" --seeds "$count" --from "$start" "${pass[@]}" >"$logs/$j.log" 2>&1 &
    pids+=($!)
done
status=0
for p in "${pids[@]}"; do
    wait "$p" || status=1
done
cat "$logs"/*.log | grep -v "^seed .*: passed in" || true
grep -h "seeds passed" "$logs"/*.log
rm -rf "$logs"
# The one-line summary: the seeds per minute are what the CI budget is sized
# by (docs/testing.md, "Cost").
ms=$((($(date +%s%N) - started) / 1000000))
((ms > 0)) || ms=1
verdict=passed
((status == 0)) || verdict=FAILED
echo "simulate.sh: seeds $from..$((from + seeds - 1)) ($seeds) $verdict in $((ms / 1000)).$((ms % 1000 / 100)) s" \
    "with ${#pids[@]} jobs: $((seeds * 60000 / ms)) seeds a minute ($((seeds * 60000 / ms / ${#pids[@]})) per job)"
exit "$status"
