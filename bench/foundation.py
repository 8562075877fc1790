#!/usr/bin/env python3
"""Flame through flame-nbd (3 replicas) next to qemu-nbd and the raw disk, in one run.

The comparisons of issue 5 ("Foundation v2"), interleaved round by round:

  flame         a fresh cluster of its own (mgr, 3 OSDs with 2 shards, flame-nbd),
                release binaries, default OSD settings (checksums on)
  flame-nocsum  the same cluster with `checksums: false` on every OSD: what the
                per-block crc32c costs
  flame-best    the same cluster with the communication layer's best settings
                (issue 7): --best-osd / --best-nbd YAML lines (default: `transport:
                shm` between flame-nbd and the OSDs and between OSDs) and
                --best-poll-mode for every daemon
  qemu-nbd      `qemu-nbd --cache=none --aio=native` over one file on the same disk
  raw           fio itself, `--ioengine=libaio --direct=1`, on one file of the same
                disk: the device's own speed

Each job runs once per variant per round; the variant order rotates every round. The
table shows medians over --repeat rounds, daemon CPU per I/O (flame variants: CPU
time of every daemon during the run / I/Os completed), the ratio against qemu-nbd and,
for writes, against the three-copy bound: every Flame copy is on this one disk, so
the best Flame can do is raw ÷ 3.

Usage (nothing else heavy should run; it waits for a quiet machine like
bench/poll_modes.py, whose cluster and measuring code it reuses):
    bench/foundation.py --runtime 10 --repeat 3 --size 1G

Every fio run is bounded by --runtime (time_based) and --size; every cluster is
stopped (SIGTERM, then SIGKILL) before the next one starts.
"""
import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import poll_modes as pm  # noqa: E402  (same directory; shared cluster/fio helpers)

JOBS = [
    # name, rw, bs, iodepth
    ("4k randwrite QD1", "randwrite", "4k", 1),
    ("4k randwrite QD32", "randwrite", "4k", 32),
    ("4k randread QD1", "randread", "4k", 1),
    ("4k randread QD32", "randread", "4k", 32),
    ("1M seqwrite QD4", "write", "1M", 4),
    ("1M seqread QD4", "read", "1M", 4),
]
VARIANTS = ("flame", "flame-base", "flame-nocsum", "flame-best", "qemu-nbd", "raw")
# Variants shown by default (flame-best is asked for by name).
DEFAULT_VARIANTS = ("flame", "flame-nocsum", "qemu-nbd", "raw")


class FlameCluster(pm.Cluster):
    """poll_modes' cluster with the default poll mode and optional OSD overrides."""

    def __init__(self, bin_dir, ports, base_dir, osd_extra, nbd_extra="", mode="interrupt"):
        super().__init__(bin_dir, ports, mode, base_dir)
        self.osd_extra = osd_extra
        self.nbd_extra = nbd_extra
        self.older_nbd_config = False

    def write_configs(self):
        super().write_configs()
        if self.older_nbd_config:
            # A build from before flame-nbd's Unix socket and TLS settings
            # (it refuses keys it does not know): its TCP export was clear.
            path = os.path.join(self.dir, "nbd.yaml")
            with open(path) as f:
                lines = [l for l in f if not l.startswith(("tcp_without_tls:", "unix:"))]
            with open(path, "w") as f:
                f.writelines(lines)
        for n in range(pm.OSDS):
            with open(os.path.join(self.dir, f"osd.{n}.yaml"), "a") as f:
                f.write(self.osd_extra)
        with open(os.path.join(self.dir, "nbd.yaml"), "a") as f:
            f.write(self.nbd_extra)


def fio_side(out, rw):
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    lat = side["clat_ns"]["percentile"]
    return {
        "iops": side["iops"],
        "mibs": side["bw_bytes"] / (1 << 20),
        "p50_us": lat.get("50.000000", 0) / 1000,
        "p99_us": lat.get("99.000000", 0) / 1000,
        "ios": side["total_ios"],
    }


def fio_common(rw, bs, qd, runtime, size):
    return [f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--runtime={runtime}", "--time_based",
            f"--size={size}", "--output-format=json", "--randrepeat=0", "--norandommap",
            "--group_reporting"]


def run_flame(args, ports, bin_dir, osd_extra, nbd_extra="", mode="interrupt", older_nbd_config=False):
    """One fresh cluster, every job once. Returns {job: result}."""
    uri = f"nbd://{pm.HOST}:{ports.nbd}/{pm.VOLUME}"
    cluster = FlameCluster(bin_dir, ports, args.dir, osd_extra, nbd_extra, mode)
    cluster.older_nbd_config = older_nbd_config
    out = {}
    try:
        cluster.start(args.start_timeout)
        cluster.create_volume(args.size)
        pm.prefill(uri, args.size, 600)
        for name, rw, bs, qd in JOBS:
            r = pm.measure(cluster, uri, rw, bs, qd, args.runtime, args.size)
            r["mibs"] = r["iops"] * (1 if bs == "1M" else 4 / 1024)
            out[name] = r
    finally:
        cluster.stop()
        cluster.cleanup(args.keep)
    return out


def run_qemu(args, image, port):
    qemu = subprocess.Popen(
        ["qemu-nbd", "--persistent", "--shared=8", "--cache=none", "--aio=native", "--format=raw",
         f"--bind={pm.HOST}", f"--port={port}", "--export-name=bench", image],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"nbd://{pm.HOST}:{port}/bench"
    out = {}
    try:
        deadline = time.monotonic() + 10
        while not pm.port_listening(port):
            if qemu.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("qemu-nbd did not start")
            time.sleep(0.1)
        for name, rw, bs, qd in JOBS:
            cmd = ["fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", *fio_common(rw, bs, qd, args.runtime, args.size)]
            o, _, _ = pm.run_fio(cmd, args.runtime * 4 + 60)
            out[name] = fio_side(o, rw)
    finally:
        qemu.send_signal(signal.SIGTERM)
        try:
            qemu.wait(10)
        except subprocess.TimeoutExpired:
            qemu.kill()
            qemu.wait(10)
    return out


def run_raw(args, image):
    out = {}
    for name, rw, bs, qd in JOBS:
        cmd = ["fio", "--name=b", "--ioengine=libaio", "--direct=1", f"--filename={image}",
               *fio_common(rw, bs, qd, args.runtime, args.size)]
        o, _, _ = pm.run_fio(cmd, args.runtime * 4 + 60)
        out[name] = fio_side(o, rw)
    return out


def med(runs, key):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else float("nan")


def print_table(results, args, commit):
    print(f"\nFlame foundation benchmark — commit {commit}; fio {args.runtime}s per run, "
          f"median of {args.repeat} rounds, {args.size} touched")
    hdr = (f"| {'job':<17} | {'variant':<12} | {'IOPS':>8} | {'MiB/s':>7} | {'p50 µs':>8} | {'p99 µs':>8} "
           f"| {'CPU µs/IO':>9} | {'÷ qemu-nbd':>10} | {'÷ raw/3':>8} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for name, rw, _, _ in JOBS:
        qemu = med(results.get((name, "qemu-nbd"), []), "iops")
        raw = med(results.get((name, "raw"), []), "iops")
        for v in VARIANTS:
            runs = results.get((name, v), [])
            if not runs:
                continue
            iops = med(runs, "iops")
            cpu = med(runs, "cpu_us_per_io")
            have_q = qemu > 0 and not math.isnan(qemu)
            have_raw = raw > 0 and not math.isnan(raw)
            vs_q = f"{iops / qemu:.2f}×" if v.startswith("flame") and have_q else ""
            vs_b = f"{iops / (raw / 3):.2f}×" if v.startswith("flame") and "write" in rw and have_raw else ""
            cpu_s = f"{cpu:.1f}" if v.startswith("flame") else ""
            print(f"| {name:<17} | {v:<12} | {iops:>8.0f} | {med(runs, 'mibs'):>7.1f} | {med(runs, 'p50_us'):>8.1f} "
                  f"| {med(runs, 'p99_us'):>8.1f} | {cpu_s:>9} | {vs_q:>10} | {vs_b:>8} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per fio run")
    ap.add_argument("--repeat", type=int, default=3, help="rounds")
    ap.add_argument("--size", default="1G", help="bytes of each device fio touches")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--best-osd", default="transport: shm\n",
                    help="YAML lines added to every OSD config of flame-best")
    ap.add_argument("--best-nbd", default="transport: shm\n",
                    help="YAML lines added to the flame-nbd config of flame-best")
    ap.add_argument("--best-poll-mode", default="interrupt", choices=("interrupt", "adaptive", "busy"),
                    help="poll_mode of every daemon in flame-best")
    ap.add_argument("--base-bin", default=None,
                    help="flame-base: the release binaries of another build (a before/after run, "
                         "interleaved with flame), e.g. a worktree's target/release")
    ap.add_argument("--base-current-config", action="store_true",
                    help="flame-base takes today's flame-nbd config (a base built after the NBD "
                         "export needed tcp_without_tls)")
    ap.add_argument("--base-port", type=int, default=16600)
    ap.add_argument("--dir", default=None, help="where clusters and the test file live (default: a temp dir)")
    ap.add_argument("--start-timeout", type=float, default=60)
    ap.add_argument("--quiet-busy-pct", type=float, default=15)
    ap.add_argument("--quiet-timeout", type=float, default=600)
    ap.add_argument("--build", action="store_true", help="cargo build --release first")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        sys.exit(f"unknown variants {bad}; known: {VARIANTS}")
    for tool in ("fio", "qemu-nbd", "qemu-img"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed (apt-get install fio qemu-utils)")
    ports = pm.Ports(args.base_port)
    qemu_port = args.base_port + 90
    clash = sorted((set(ports.all()) | {qemu_port}) & pm.DEV_CLUSTER_PORTS)
    if clash or not (1024 < min(ports.all()) and max(ports.all() + [qemu_port]) < 65536):
        sys.exit(f"--base-port {args.base_port} gives unusable or dev-cluster ports {clash}")
    bin_dir = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(pm.REPO, "target")), "release")
    pm.ensure_binaries(bin_dir, args.build)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=pm.REPO, capture_output=True,
                            text=True, timeout=10).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *pm.CRATE_DIRS, "Cargo.toml", "Cargo.lock"],
                           cwd=pm.REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    if dirty:
        commit += " + uncommitted changes"
        pm.log(f"WARNING: uncommitted changes in the crates are built into the binaries:\n{dirty}")

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    work = tempfile.mkdtemp(prefix="flame-foundation-", dir=args.dir)
    snap = os.path.join(work, "bin")
    os.mkdir(snap)
    for n in pm.BINARIES:
        shutil.copy2(os.path.join(bin_dir, n), os.path.join(snap, n))
    base_snap = None
    if "flame-base" in variants:
        if not args.base_bin:
            sys.exit("flame-base needs --base-bin DIR (another build's release binaries)")
        base_snap = os.path.join(work, "base-bin")
        os.mkdir(base_snap)
        for n in pm.BINARIES:
            shutil.copy2(os.path.join(args.base_bin, n), os.path.join(base_snap, n))
    args.dir = work
    image = os.path.join(work, "disk.raw")
    results = {}
    try:
        subprocess.run(["qemu-img", "create", "-f", "raw", image, args.size], check=True, capture_output=True)
        # Reads of a never-written file are not what we measure: fill it once.
        pm.run_fio(["fio", "--name=fill", "--ioengine=libaio", "--direct=1", f"--filename={image}",
                    "--rw=write", "--bs=1M", "--iodepth=8", f"--size={args.size}", "--output-format=json"], 600)
        for rnd in range(args.repeat):
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for v in order:
                quiet = pm.wait_quiet(args.quiet_busy_pct, args.quiet_timeout)
                pm.log(f"round {rnd + 1}/{args.repeat}: {v} (machine {quiet:.0f}% busy before)")
                pm.wait_ports_free(ports.all() + [qemu_port], 60)
                if v == "flame":
                    got = run_flame(args, ports, snap, "")
                elif v == "flame-base":
                    got = run_flame(args, ports, base_snap, "", older_nbd_config=not args.base_current_config)
                elif v == "flame-nocsum":
                    got = run_flame(args, ports, snap, "checksums: false\n")
                elif v == "flame-best":
                    got = run_flame(args, ports, snap, args.best_osd.replace("\\n", "\n"),
                                    args.best_nbd.replace("\\n", "\n"), args.best_poll_mode)
                elif v == "qemu-nbd":
                    got = run_qemu(args, image, qemu_port)
                else:
                    got = run_raw(args, image)
                for name, r in got.items():
                    results.setdefault((name, v), []).append(r)
                    cpu = f"  {r['cpu_us_per_io']:.1f} CPU us/IO" if "cpu_us_per_io" in r else ""
                    pm.log(f"  {name:<17} {v:<12} {r['iops']:>8.0f} IOPS  p50 {r['p50_us']:>7.1f} us{cpu}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results, args, commit)
    if args.json:
        print(json.dumps({f"{k[0]} / {k[1]}": v for k, v in results.items()}, indent=1, default=str))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        sys.exit(f"interrupted ({e}); every daemon this script started has been stopped")
