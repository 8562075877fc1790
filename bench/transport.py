#!/usr/bin/env python3
"""tcp vs shm: the same jobs through `flame-admin bench`, interleaved, several rounds.

Starts two dev clusters from target/release (deploy/dev-cluster.sh --no-build), one
with FLAME_DEV_TRANSPORT=tcp and one with shm (flame-nbd unused; OSD <-> OSD
replication uses the cluster's transport), in temp directories on their own ports
(--port-base, default 23800 and 23900). For each round and job it runs
`flame-admin --json bench <volume> --transport <t>` against each cluster in turn
(the order alternates every round), then prints medians and the shm/tcp ratio.

Usage (release binaries built: cargo build --release --bins; FLAME_PROFILE=debug
uses target/debug instead, as deploy/dev-cluster.sh does):
    bench/transport.py --runtime 5 --repeat 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

JOBS = [
    # name, rw, bs, iodepth, metric
    ("4k randwrite QD1", "randwrite", "4k", 1, "p50_us"),
    ("4k randread QD1", "randread", "4k", 1, "p50_us"),
    ("4k randwrite QD32", "randwrite", "4k", 32, "iops"),
    ("4k randread QD32", "randread", "4k", 32, "iops"),
    ("1M write QD4", "write", "1M", 4, "mib_per_s"),
    ("1M read QD4", "read", "1M", 4, "mib_per_s"),
]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dev(dirname, port_base, transport, *args):
    env = dict(os.environ, FLAME_DEV_TRANSPORT=transport)
    return subprocess.run(
        [os.path.join(REPO, "deploy/dev-cluster.sh"), "--dir", dirname,
         "--port-base", str(port_base), "--no-build", *args],
        env=env, check=True, capture_output=True, text=True, timeout=180)


def bench(port_base, transport, rw, bs, qd, runtime):
    profile = os.environ.get("FLAME_PROFILE", "release")
    admin = os.path.join(REPO, "target", profile, "flame-admin")
    out = subprocess.run(
        [admin, "--mgr", f"127.0.0.1:{port_base}", "--json", "bench", "demo",
         "--rw", rw, "--bs", bs, "--iodepth", str(qd), "--runtime", f"{runtime}s",
         "--size-limit", "1G", "--force-overwrite", "--transport", transport],
        check=True, capture_output=True, text=True, timeout=runtime + 120)
    r = json.loads(out.stdout)
    lat = r.get("latency", {})
    return {"iops": r["iops"], "mib_per_s": r["mib_per_s"],
            "p50_us": lat.get("p50_us"), "p99_us": lat.get("p99_us")}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port-base", type=int, default=23800)
    args = ap.parse_args()
    clusters = {"tcp": args.port_base, "shm": args.port_base + 100}
    dirs = {t: tempfile.mkdtemp(prefix=f"flame-bench-{t}.") for t in clusters}
    results = {(j[0], t): [] for j in JOBS for t in clusters}
    try:
        for t, port in clusters.items():
            dev(dirs[t], port, t, "up")
        for rnd in range(args.repeat):
            order = list(clusters) if rnd % 2 == 0 else list(reversed(list(clusters)))
            for name, rw, bs, qd, _ in JOBS:
                for t in order:
                    r = bench(clusters[t], t, rw, bs, qd, args.runtime)
                    results[(name, t)].append(r)
                    print(f"round {rnd} {t} {name}: {r}", file=sys.stderr, flush=True)
    finally:
        for t, port in clusters.items():
            try:
                dev(dirs[t], port, t, "down")
            except Exception as e:  # keep stopping the others
                print(f"stopping {t}: {e}", file=sys.stderr)
    print("| job | metric | tcp (median) | shm (median) | shm / tcp | tcp p99 us | shm p99 us |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, _, _, _, metric in JOBS:
        med = {t: statistics.median(r[metric] for r in results[(name, t)]) for t in clusters}
        p99 = {t: statistics.median(r["p99_us"] for r in results[(name, t)]) for t in clusters}
        ratio = med["shm"] / med["tcp"] if med["tcp"] else float("nan")
        print(f"| {name} | {metric} | {med['tcp']:.0f} | {med['shm']:.0f} | {ratio:.2f} "
              f"| {p99['tcp']:.0f} | {p99['shm']:.0f} |")


if __name__ == "__main__":
    main()
