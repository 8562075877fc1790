#!/usr/bin/env python3
"""The communication layer's comparisons (issue 7) in ONE run: each pair, interleaved.

A *comparison* is a set of configurations that differ only in a few YAML keys of the
daemons' configs (a "config diff"), plus the fio jobs that show the difference. For
every round, every comparison and every configuration of it (the order rotates every
round), it starts a complete, fresh cluster of its own — flame-mgr, three flame-osd
(shards: 2) and flame-nbd (threads: 2), from a private copy of target/release — on
127.0.0.1 ports of its own (--base-port, default 16600), creates and pre-writes a
volume, runs each job with fio's nbd engine and stops the cluster (SIGTERM, then
SIGKILL after a bounded wait). Daemon CPU time comes from /proc around every fio
run. It prints, per comparison, medians over the rounds of IOPS, p50, p99, CPU
µs per I/O, and the ratio of each configuration against the comparison's baseline.

The transport is a parameter (--transports tcp,shm): every comparison runs on each,
with `transport: <t>` in the OSD and flame-nbd configs (shm needs the i7-shm work).

Adding a comparison is one entry in COMPARISONS: its configurations as
{daemon: {key: value}} diffs over BASE (daemon = osd | nbd | mgr; nested dicts
become nested YAML), its baseline, its jobs. A configuration whose keys the
binaries do not know yet (their owner's branch is not merged) makes the daemon
refuse its config; that comparison is then reported as skipped, not failed.
Only the comparisons named by --comparisons run (default: those whose keys exist
on main today).

Machine hygiene is bench/poll_modes.py's (shared code): wait for a quiet machine
before every cluster (no cargo/rustc/linker, others below --quiet-busy-pct), and
measure again a run that other processes disturbed (--retries). With
--quiet-timeout 0 it measures on a busy machine and says so in the table.

Usage:
    bench/comm_layer.py --comparisons threading,poll --transports tcp --runtime 10 --repeat 3
    bench/comm_layer.py --list
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import poll_modes as pm  # noqa: E402  (the shared cluster, fio and /proc helpers)

# Jobs: (name, rw, bs, iodepth).
LAT_QD1 = [("4k randwrite QD1", "randwrite", "4k", 1), ("4k randread QD1", "randread", "4k", 1)]
IOPS_QD32 = [("4k randwrite QD32", "randwrite", "4k", 32), ("4k randread QD32", "randread", "4k", 32)]
SIZES = [("4k", "4k"), ("64k", "64k"), ("1m", "1M")]
CONVERT_JOBS = [(f"{n} {rw} QD1", rw, bs, 1) for n, bs in SIZES for rw in ("randwrite", "randread")]

# What every daemon gets unless a configuration overrides it.
BASE = {
    "osd": {"poll_mode": "interrupt", "direct_io": "auto", "shards": pm.SHARDS},
    "nbd": {"poll_mode": "interrupt", "threads": pm.NBD_THREADS},
    "mgr": {},
}

# The table. `needs`: the branch whose keys a comparison uses (informational;
# the run detects unknown keys by the daemon refusing its config).
COMPARISONS = {
    "threading": {
        "title": "penetrating vs staged (thesis: latency -44.96 ... -79.58 %)",
        "configs": {
            "penetrating": {"osd": {"threading": "penetrating"}},
            "staged": {"osd": {"threading": "staged", "network_threads": 1}},
        },
        "baseline": "penetrating",
        "jobs": LAT_QD1 + IOPS_QD32,
    },
    "poll": {
        "title": "adaptive vs busy vs interrupt (thesis: -40.40 % CPU vs busy, -36.17 % latency vs interrupt)",
        "configs": {
            "interrupt": {"osd": {"poll_mode": "interrupt"}, "nbd": {"poll_mode": "interrupt"}},
            "adaptive": {"osd": {"poll_mode": "adaptive"}, "nbd": {"poll_mode": "adaptive"}},
            "busy": {"osd": {"poll_mode": "busy"}, "nbd": {"poll_mode": "busy"}},
        },
        "baseline": "interrupt",
        "jobs": LAT_QD1 + IOPS_QD32,
    },
    "pool": {
        "title": "contention-free (percpu) vs locked pool (thesis: IOPS +32 ... +34 %)",
        "needs": "i7-pool",
        "configs": {
            "percpu": {"osd": {"memory_pool": {"mode": "percpu"}}, "nbd": {"memory_pool": {"mode": "percpu"}}},
            "locked": {"osd": {"memory_pool": {"mode": "locked"}}, "nbd": {"memory_pool": {"mode": "locked"}}},
        },
        "baseline": "locked",
        "jobs": IOPS_QD32,
    },
    "convert": {
        "title": "convert vs inline, 4 KiB ... 1 MiB (thesis: latency -6.42 ... -42.43 %)",
        "needs": "i7-convert",
        "configs": {
            "inline": {"nbd": {"transfer_mode": "inline"}},
            # Every size of the jobs converts (the default thresholds are what
            # this comparison is for choosing).
            "convert": {"nbd": {"transfer_mode": "convert",
                                "convert_threshold_bytes": {"tcp": 4096, "shm": 4096, "rdma": 4096}}},
        },
        "baseline": "inline",
        "jobs": CONVERT_JOBS,
    },
    "auth": {
        "title": "authenticated connections vs auth: none (issue 15: within noise, <= 2 %)",
        "configs": {
            "none": {"cluster": {"auth": False}},
            "auth": {},
        },
        "baseline": "none",
        "jobs": LAT_QD1 + IOPS_QD32,
    },
    "reply": {
        "title": "fetch vs push replies (RFP paper: 1.6-4x throughput)",
        "needs": "i7-convert",
        "configs": {
            "push": {"nbd": {"reply_mode": "push"}},
            # On tcp a fetch is an emulated READ served by the OSD's connection
            # thread: allowed only with these measurement switches.
            "fetch": {"nbd": {"reply_mode": "fetch", "fetch_over_emulated": "true"},
                      "osd": {"reply_area_over_emulated": "true"}},
        },
        "baseline": "push",
        "jobs": LAT_QD1 + IOPS_QD32,
    },
}
DEFAULT_COMPARISONS = ("threading", "poll", "pool", "convert", "reply", "auth")
TRANSPORTS = ("tcp", "shm", "rdma")


def merge(base, diff):
    """Deep merge of nested dicts (diff wins)."""
    out = dict(base)
    for k, v in diff.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def to_yaml(d, indent=0):
    lines = []
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(" " * indent + f"{k}:")
            lines.append(to_yaml(v, indent + 2))
        else:
            lines.append(" " * indent + f"{k}: {v}")
    return "\n".join(lines)


class ConfigRefused(RuntimeError):
    """A daemon refused its configuration (an unknown key: the owner's branch is not in)."""


class Cluster(pm.Cluster):
    """poll_modes' cluster with configs built from BASE + a configuration's diff."""

    def __init__(self, bin_dir, ports, label, diff, transport, base_dir):
        # `cluster`: settings of the whole cluster rather than of one daemon's
        # YAML (`auth`: keys made and given to every daemon, or `auth: none`).
        auth = diff.get("cluster", {}).get("auth", True)
        super().__init__(bin_dir, ports, label.replace("/", "-"), base_dir, auth=auth)
        self.diff = {d: v for d, v in diff.items() if d != "cluster"}
        self.transport = transport

    def write_configs(self):
        p = self.ports
        tdiff = {} if self.transport == "tcp" else {"osd": {"transport": self.transport},
                                                    "nbd": {"transport": self.transport}}
        cfgs = {d: merge(merge(BASE[d], tdiff.get(d, {})), self.diff.get(d, {})) for d in BASE}
        text = {
            "mgr": f'listen: "{pm.HOST}:{p.mgr}"\ndata_dir: ./mgr\nheartbeat_grace_ms: 6000\n'
                   "failure_check_interval_ms: 1000\npool:\n  size: 3\n  min_size: 2\n  pg_count: 128\n"
                   "  object_size: 4194304\n" + self.auth_yaml("mgr") + to_yaml(cfgs["mgr"]),
            "nbd": f'mgr: "{pm.HOST}:{p.mgr}"\nlisten: "{pm.HOST}:{p.nbd}"\ntcp_without_tls: true\nunix: null\n'
                   f'metrics_listen: "{pm.HOST}:{p.nbd_metrics}"\n' + self.auth_yaml("nbd")
                   + to_yaml(cfgs["nbd"]),
        }
        for n in range(pm.OSDS):
            text[f"osd.{n}"] = (f'mgr: "{pm.HOST}:{p.mgr}"\nlisten: "{pm.HOST}:{p.osd[n]}"\n'
                                f'metrics_listen: "{pm.HOST}:{p.osd_metrics[n]}"\ndata_dir: ./osd.{n}\n'
                                f"host: bench-host-{n}\n" + self.auth_yaml("osd", n) + to_yaml(cfgs["osd"]))
        for name, t in text.items():
            with open(os.path.join(self.dir, f"{name}.yaml"), "w") as f:
                f.write(t + "\n")

    def check_alive(self):
        try:
            super().check_alive()
        except RuntimeError as e:
            # Exit status 2 = the daemon refused its configuration.
            if "exited with 2" in str(e):
                raise ConfigRefused(str(e)) from e
            raise


def pct(x):
    return "" if x is None else f"{(x - 1) * 100:+.1f}%"


def print_tables(results, plan, args, busy_note):
    keys = ("iops", "p50_us", "p99_us", "cpu_us_per_io", "daemon_cores")
    print(f"\n{time.strftime('%Y-%m-%d')}, commit {args.commit}; fio --ioengine=nbd, {args.runtime}s per run, "
          f"median of {args.repeat} rounds, size {args.size}; {pm.OSDS} OSDs x {pm.SHARDS} shards + flame-nbd "
          f"({pm.NBD_THREADS} threads) + fio on {pm.NCPU} CPUs. {busy_note}")
    for transport, comp in plan:
        c = COMPARISONS[comp]
        base = c["baseline"]
        print(f"\n### {comp} on {transport}: {c['title']}\n")
        if results.get(("skipped", transport, comp)):
            print(f"skipped: {results[('skipped', transport, comp)]}")
            continue
        hdr = (f"| {'job':<18} | {'config':<11} | {'IOPS':>7} | {'p50 us':>8} | {'p99 us':>8} | "
               f"{'CPU us/IO':>9} | {'cores':>5} | {'IOPS vs base':>12} | {'p50 vs base':>11} | "
               f"{'p99 vs base':>11} | {'CPU/IO vs base':>14} |")
        print(hdr)
        print("|" + "|".join("-" * len(x) for x in hdr.split("|")[1:-1]) + "|")
        for job, *_ in c["jobs"]:
            med = {}
            for cfg in c["configs"]:
                runs = results.get((transport, comp, cfg, job), [])
                if runs:
                    med[cfg] = {k: statistics.median(r[k] for r in runs) for k in keys}
            b = med.get(base)
            for cfg, m in med.items():
                r = {}
                for k in ("iops", "p50_us", "p99_us", "cpu_us_per_io"):
                    r[k] = m[k] / b[k] if b and cfg != base and b[k] else None
                print(f"| {job:<18} | {cfg:<11} | {m['iops']:>7.0f} | {m['p50_us']:>8.1f} | {m['p99_us']:>8.1f} | "
                      f"{m['cpu_us_per_io']:>9.1f} | {m['daemon_cores']:>5.2f} | {pct(r['iops']):>12} | "
                      f"{pct(r['p50_us']):>11} | {pct(r['p99_us']):>11} | {pct(r['cpu_us_per_io']):>14} |")
    print("\nCPU us/IO, cores: utime+stime of mgr + OSDs + flame-nbd during the fio run (/proc). "
          "Ratios: median of the configuration vs median of the comparison's baseline.")


def run_all(args, plan, ports, bin_dir):
    uri = f"nbd://{pm.HOST}:{ports.nbd}/{pm.VOLUME}"
    results, raw = {}, []
    t0 = time.monotonic()
    max_other = 0.0
    for rnd in range(args.repeat):
        for transport, comp in plan:
            if results.get(("skipped", transport, comp)):
                continue
            c = COMPARISONS[comp]
            names = list(c["configs"])
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for cfg in order:
                quiet = pm.wait_quiet(args.quiet_busy_pct, args.quiet_timeout)
                max_other = max(max_other, quiet)
                pm.wait_ports_free(ports.all(), 60)
                cl = Cluster(bin_dir, ports, f"{comp}-{cfg}", c["configs"][cfg], transport, args.dir)
                failed = False
                try:
                    pm.log(f"round {rnd + 1}/{args.repeat} {transport} {comp}={cfg}: starting "
                           f"(others {quiet:.0f}% busy)")
                    cl.start(args.start_timeout)
                    cl.create_volume(args.size)
                    pm.prefill(uri, args.size, 600)
                    for job, rw, bs, qd in c["jobs"]:
                        for attempt in range(args.retries + 1):
                            r = pm.measure(cl, uri, rw, bs, qd, args.runtime, args.size)
                            other = 100 * r["other_cpu_s"] / r["wall_s"] / pm.NCPU
                            r["disturbed"] = other > args.quiet_busy_pct
                            if not r["disturbed"] or attempt == args.retries:
                                break
                            pm.log(f"  {job} {cfg}: others used {other:.0f}% CPU; measuring again")
                            pm.wait_quiet(args.quiet_busy_pct, args.quiet_timeout, cl.pids().values())
                        max_other = max(max_other, 100 * r["other_cpu_s"] / r["wall_s"] / pm.NCPU)
                        results.setdefault((transport, comp, cfg, job), []).append(r)
                        raw.append({"round": rnd, "transport": transport, "comparison": comp, "config": cfg,
                                    "job": job, **r})
                        pm.log(f"  {job:<18} {cfg:<11} {r['iops']:>8.0f} IOPS  p50 {r['p50_us']:>8.1f} us  "
                               f"p99 {r['p99_us']:>8.1f} us  {r['cpu_us_per_io']:>6.1f} CPU us/IO"
                               + ("  DISTURBED" if r["disturbed"] else ""))
                except ConfigRefused as e:
                    why = f"{comp}={cfg} refused by the binaries (needs {c.get('needs', '?')}): {str(e)[-300:]}"
                    pm.log(why)
                    results[("skipped", transport, comp)] = why
                except (RuntimeError, subprocess.SubprocessError) as e:
                    pm.log(f"{transport} {comp}={cfg} round {rnd + 1} failed: {e}")
                    failed = True
                finally:
                    cl.stop()
                    cl.cleanup(args.keep or failed)
                if results.get(("skipped", transport, comp)):
                    break
    pm.log(f"done in {time.monotonic() - t0:.0f}s")
    note = (f"Other processes used up to {max_other:.0f}% of the machine's CPU around the runs"
            + (" (BUSY machine: absolute numbers are pessimistic, ratios noisy)." if max_other > args.quiet_busy_pct
               else " (quiet)."))
    print_tables(results, plan, args, note)
    if args.json:
        print(json.dumps(raw, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comparisons", default=",".join(DEFAULT_COMPARISONS),
                    help=f"comma-separated, of {','.join(COMPARISONS)} (default {','.join(DEFAULT_COMPARISONS)})")
    ap.add_argument("--transports", default="tcp", help="comma-separated, of tcp,shm,rdma (default tcp)")
    ap.add_argument("--list", action="store_true", help="print the comparisons and their config diffs, and exit")
    ap.add_argument("--runtime", type=int, default=10, help="seconds per fio run (default 10)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--size", default="256M", help="volume size and bytes fio touches (default 256M)")
    ap.add_argument("--base-port", type=int, default=16600, help="first of this benchmark's ports (default 16600)")
    ap.add_argument("--dir", default=None, help="parent of the clusters' temp directories (a real disk for O_DIRECT)")
    ap.add_argument("--build", action="store_true", help="cargo build --release --bins first (else only if missing)")
    ap.add_argument("--start-timeout", type=int, default=30)
    ap.add_argument("--quiet-timeout", type=int, default=900,
                    help="seconds to wait for a quiet machine before each cluster (0: measure at once)")
    ap.add_argument("--quiet-busy-pct", type=float, default=15.0)
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the clusters' directories")
    ap.add_argument("--json", action="store_true", help="also print every run's raw results")
    args = ap.parse_args()

    if args.list:
        for name, c in COMPARISONS.items():
            print(f"{name}: {c['title']} (baseline {c['baseline']}"
                  + (f", needs {c['needs']}" if c.get("needs") else "") + ")")
            for cfg, diff in c["configs"].items():
                print(f"  {cfg}: {json.dumps(diff)}")
            print(f"  jobs: {', '.join(j[0] for j in c['jobs'])}")
        return
    comps = [c.strip() for c in args.comparisons.split(",") if c.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [c for c in comps if c not in COMPARISONS] + [t for t in transports if t not in TRANSPORTS]
    if bad or not comps or not transports:
        sys.exit(f"unknown comparisons/transports {bad}; see --list")
    if args.runtime < 1 or args.repeat < 1:
        sys.exit("--runtime and --repeat must be >= 1")
    if shutil.which("fio") is None:
        sys.exit("fio is not installed (it needs the nbd engine, fio >= 3.19)")
    ports = pm.Ports(args.base_port)
    clash = sorted(set(ports.all()) & pm.DEV_CLUSTER_PORTS)
    if clash or not (1024 < min(ports.all()) and max(ports.all()) < 65536):
        sys.exit(f"--base-port {args.base_port} gives unusable or dev-cluster ports {clash}")
    pm.wait_ports_free(ports.all(), 5)
    bin_dir = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(pm.REPO, "target")), "release")
    pm.ensure_binaries(bin_dir, args.build)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        args.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=pm.REPO, capture_output=True,
                                     text=True, timeout=10).stdout.strip() or "?"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *pm.CRATE_DIRS, "Cargo.toml", "Cargo.lock"],
                               cwd=pm.REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        if dirty:
            args.commit += " + uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        args.commit = "?"
    plan = [(t, c) for t in transports for c in comps]
    # A private copy of the binaries: a rebuild meanwhile must not change later runs.
    snap = tempfile.mkdtemp(prefix="flame-comm-bin-", dir=args.dir)
    try:
        for n in pm.BINARIES:
            shutil.copy2(os.path.join(bin_dir, n), os.path.join(snap, n))
        run_all(args, plan, ports, snap)
    finally:
        shutil.rmtree(snap, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        sys.exit(f"interrupted ({e}); every daemon this script started has been stopped")
