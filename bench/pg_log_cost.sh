#!/usr/bin/env bash
# What the stable placement-group log costs: 4 KiB random writes through flame-nbd
# (fio's nbd engine) at QD1 and QD32, and QD1 with a FLUSH after every write, on a
# dev cluster of each of two checkouts built in release (BEFORE without the stable
# log, AFTER with it), interleaved, one fresh cluster per checkout.
#
#   bench/pg_log_cost.sh BEFORE_REPO AFTER_REPO [RUNTIME_S]
#
# Each repo must have its release binaries built (cargo build --release --bins).
# Prints one line per job and build: IOPS, median and p99 completion latency.
set -euo pipefail
before="${1:?BEFORE_REPO}"
after="${2:?AFTER_REPO}"
runtime="${3:-10}"
command -v fio >/dev/null || { echo "fio is missing (apt-get install fio)" >&2; exit 1; }

declare -A base=([before]=17000 [after]=17100)
declare -A repo=([before]="$before" [after]="$after")
dirs=()
cleanup() {
    for which in before after; do
        "${repo[$which]}/deploy/dev-cluster.sh" --dir "/tmp/flame-bench-$which" down >/dev/null 2>&1 || true
    done
    rm -rf "${dirs[@]}"
}
trap cleanup EXIT

for which in before after; do
    dir="/tmp/flame-bench-$which"
    rm -rf "$dir"
    dirs+=("$dir")
    "${repo[$which]}/deploy/dev-cluster.sh" --dir "$dir" --port-base "${base[$which]}" up --no-build >/dev/null
done

job() { # which name extra-fio-args...
    local which="$1" name="$2"
    shift 2
    local uri="nbd://127.0.0.1:$((base[$which] + 1))/demo"
    fio --name="$name" --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --size=1g \
        --runtime="$runtime" --time_based --output-format=json "$@" 2>/dev/null |
        python3 -c '
import json, sys
out = sys.stdin.read()
j = json.loads(out[out.index("{"):])["jobs"][0]["write"]
p = j["clat_ns"]["percentile"]
iops, p50, p99 = j["iops"], p["50.000000"] / 1000, p["99.000000"] / 1000
print("%-6s %-12s %9.0f IOPS  p50 %8.1f us  p99 %8.1f us" % (sys.argv[1], sys.argv[2], iops, p50, p99))
' "$which" "$name"
}

for spec in "qd1 --iodepth=1" "qd32 --iodepth=32" "qd1-flush --iodepth=1 --fsync=1"; do
    read -r name args <<<"$spec"
    for which in before after; do
        # shellcheck disable=SC2086
        job "$which" "$name" $args
    done
done
