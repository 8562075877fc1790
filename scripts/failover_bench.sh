#!/usr/bin/env bash
# The failover numbers of docs/benchmarks.md ("Failover (issue 6)"), in a release
# build: kill -9 -> marked down -> client I/O resumed, the longest client pause,
# catch-up after a restart, backfill after `osd out` unthrottled and throttled
# (MiB/s and client ops/s while recovering), then a chaos run for the totals.
# Partitions in the chaos run use iptables on lo: run as root.
#
#   scripts/failover_bench.sh                      # 3 rounds, 3 chaos minutes
#   ROUNDS=5 CHAOS_MINUTES=10 scripts/failover_bench.sh
#
# Prints the machine's load before each part: the figures are only comparable on a
# quiet machine.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
rounds=${ROUNDS:-3}
minutes=${CHAOS_MINUTES:-3}
throttle=${THROTTLE_BYTES_PER_SEC:-8388608}
[[ $rounds =~ ^[0-9]+$ && $minutes =~ ^[0-9]+$ && $throttle =~ ^[0-9]+$ ]] || {
    echo "ROUNDS, CHAOS_MINUTES and THROTTLE_BYTES_PER_SEC must be numbers" >&2
    exit 2
}
load() { echo "--- $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD), load: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"; }

cargo build --release --workspace --bins
cargo test --release -p flame-tests --test failover_bench --no-run
bench() { cargo test --release -p flame-tests --test failover_bench "$@" -- --ignored --nocapture --test-threads 1; }
load
echo "=== failover_times and recovery_throughput, unthrottled"
FLAME_BENCH_ROUNDS=$rounds bench
load
echo "=== recovery_throughput, recovery_bytes_per_sec: $throttle (per shard)"
FLAME_BENCH_ROUNDS=$rounds FLAME_BENCH_OSD_YAML="recovery_bytes_per_sec: $throttle" bench recovery_throughput
load
echo "=== chaos, $minutes minutes"
scripts/chaos.sh --release --minutes "$minutes"
load
