#!/usr/bin/env python3
"""fio through flame-nbd (3 replicas) next to qemu-nbd serving one local file.

Runs each fio job against both servers in the same run, alternating, `--repeat`
times, and prints a table of medians (IOPS, MiB/s, p50/p99 latency) and the
Flame / qemu-nbd ratio. Every job is bounded by --runtime and --size.

Usage (a running dev cluster with a volume; see README):
    bench/nbd_vs_qemu.py --flame nbd://127.0.0.1:10809/bench --runtime 10 --repeat 3

It starts qemu-nbd itself on 127.0.0.1:10810 over a file in a temp directory
(--cache=none, --aio=native where supported), and stops it at the end.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

JOBS = [
    # name, rw, bs, iodepth
    ("4k randwrite QD1", "randwrite", "4k", 1),
    ("4k randwrite QD32", "randwrite", "4k", 32),
    ("4k randread QD1", "randread", "4k", 1),
    ("4k randread QD32", "randread", "4k", 32),
    ("1M seqwrite QD4", "write", "1M", 4),
    ("1M seqread QD4", "read", "1M", 4),
]


def need(tool):
    if shutil.which(tool) is None:
        sys.exit(f"{tool} is not installed (apt-get install fio qemu-utils)")


def fio(uri, rw, bs, iodepth, runtime, size):
    cmd = [
        "fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
        f"--iodepth={iodepth}", f"--runtime={runtime}", "--time_based", f"--size={size}",
        "--output-format=json", "--randrepeat=0", "--norandommap", "--group_reporting",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=runtime * 4 + 60).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    lat = side["clat_ns"]["percentile"]
    return {
        "iops": side["iops"],
        "mibs": side["bw_bytes"] / (1 << 20),
        "p50_us": lat.get("50.000000", 0) / 1000,
        "p99_us": lat.get("99.000000", 0) / 1000,
    }


def prefill(uri, size):
    # Reads of never-written data are not what we want to measure: write it all once.
    subprocess.run(
        ["fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=1M",
         "--iodepth=8", f"--size={size}", "--output-format=json"],
        check=True, capture_output=True, timeout=600,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flame", required=True, help="NBD URI of a Flame volume")
    ap.add_argument("--runtime", type=int, default=10, help="seconds per fio run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per job and server")
    ap.add_argument("--size", default="1G", help="bytes of the device fio touches")
    ap.add_argument("--qemu-port", type=int, default=10810)
    ap.add_argument("--json", action="store_true", help="print raw results as JSON too")
    args = ap.parse_args()
    for t in ("fio", "qemu-nbd", "qemu-img"):
        need(t)
    tmp = tempfile.mkdtemp(prefix="flame-bench-")
    image = os.path.join(tmp, "disk.raw")
    subprocess.run(["qemu-img", "create", "-f", "raw", image, args.size], check=True, capture_output=True)
    qemu = subprocess.Popen(
        ["qemu-nbd", "--persistent", "--shared=8", "--cache=none", "--format=raw",
         "--bind=127.0.0.1", f"--port={args.qemu_port}", "--export-name=bench", image],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    qemu_uri = f"nbd://127.0.0.1:{args.qemu_port}/bench"
    try:
        time.sleep(1)
        if qemu.poll() is not None:
            sys.exit("qemu-nbd did not start")
        prefill(qemu_uri, args.size)
        prefill(args.flame, args.size)
        results = {}
        for name, rw, bs, qd in JOBS:
            for server, uri in (("flame", args.flame), ("qemu", qemu_uri)):
                results.setdefault((name, server), [])
            for _ in range(args.repeat):
                for server, uri in (("flame", args.flame), ("qemu", qemu_uri)):
                    results[(name, server)].append(fio(uri, rw, bs, qd, args.runtime, args.size))
        print(f"\nfio --ioengine=nbd, {args.runtime}s per run, median of {args.repeat} runs, size {args.size}")
        hdr = f"| {'job':<18} | {'server':<9} | {'IOPS':>9} | {'MiB/s':>8} | {'p50 us':>8} | {'p99 us':>8} | {'IOPS ratio':>10} |"
        print(hdr)
        print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
        raw = {}
        for name, *_ in JOBS:
            med = {}
            for server in ("flame", "qemu"):
                runs = results[(name, server)]
                med[server] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                raw[f"{name} / {server}"] = runs
            ratio = med["flame"]["iops"] / med["qemu"]["iops"] if med["qemu"]["iops"] else float("nan")
            for server in ("flame", "qemu"):
                m = med[server]
                label = "flame-nbd" if server == "flame" else "qemu-nbd"
                r = f"{ratio:.2f}x" if server == "flame" else ""
                print(f"| {name:<18} | {label:<9} | {m['iops']:>9.0f} | {m['mibs']:>8.1f} | {m['p50_us']:>8.1f} | {m['p99_us']:>8.1f} | {r:>10} |")
        if args.json:
            print(json.dumps(raw, indent=1))
    finally:
        qemu.send_signal(signal.SIGTERM)
        try:
            qemu.wait(10)
        except subprocess.TimeoutExpired:
            qemu.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
