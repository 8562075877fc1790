#!/usr/bin/env python3
"""The reactor's idle strategies side by side: poll_mode interrupt vs adaptive vs busy.

For every round and every mode it starts a complete, fresh cluster of its own —
flame-mgr, three flame-osd (shards: 2) and flame-nbd (threads: 2), all from
target/release, all with `poll_mode: <mode>` — in a temp directory, on 127.0.0.1
ports of its own (--base-port, default 16400; never the dev-cluster ports). It
creates a volume, pre-writes it (so reads hit real data), runs each fio job
(--ioengine=nbd, --time_based) and stops the cluster (SIGTERM, then SIGKILL after
a bounded wait) before the next mode. The order of the modes rotates every round.

Around every fio run it samples the CPU time (utime + stime, /proc/PID/stat) of
every daemon, so the table shows what each I/O costs the daemons in CPU next to
IOPS and latency:

    CPU us/IO = (daemon CPU seconds during the fio run) / (I/Os fio completed)
    cores     = daemon CPU seconds / wall seconds of the fio run

The fio run's wall time includes fio's start-up (~0.1-0.3 s), during which busy
daemons spin and interrupt daemons sleep; that is part of what each mode costs.
It prints medians over --repeat rounds and ratios against `interrupt`.

Usage (no running cluster needed; nothing else heavy should run meanwhile):
    bench/poll_modes.py --runtime 10 --repeat 3

Before every cluster start it waits (bounded by --quiet-timeout) until the rest of
the machine is quiet: no cargo/rustc/linker processes, and less than
--quiet-busy-pct of the machine's CPU used by other processes. A fio run during
which other processes used more than that is measured again (--retries). Each run's
JSON (--json) records how much CPU the rest of the machine used during it.
"""
import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("interrupt", "adaptive", "busy")
JOBS = [
    # name, rw, bs, iodepth
    ("4k randwrite QD1", "randwrite", "4k", 1),
    ("4k randread QD1", "randread", "4k", 1),
    ("4k randread QD32", "randread", "4k", 32),
    ("4k randwrite QD32", "randwrite", "4k", 32),
]
HOST = "127.0.0.1"
OSDS = 3
SHARDS = 2
NBD_THREADS = 2
VOLUME = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 1
# Process names that mean "someone else is building or linking".
BUSY_NAMES = ("cargo", "rustc", "rust-lld", "ld", "ld.lld", "cc1", "cc1plus", "collect2", "clippy-driver")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The workspace crates whose sources go into the binaries (the uncommitted-changes check).
CRATE_DIRS = ("flame-common", "flame-mgr", "flame-osd", "flame-client")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- ports & layout

class Ports:
    """This benchmark's endpoints: base+0 mgr, base+8/9 nbd metrics/data,
    base+10*(N+1)+shard osd.N data, base+50+N osd.N metrics."""

    def __init__(self, base):
        self.mgr = base
        self.nbd_metrics = base + 8
        self.nbd = base + 9
        self.osd = [base + 10 * (n + 1) for n in range(OSDS)]
        self.osd_metrics = [base + 50 + n for n in range(OSDS)]

    def all(self):
        ports = [self.mgr, self.nbd, self.nbd_metrics] + self.osd_metrics
        for p in self.osd:
            ports += [p + s for s in range(SHARDS)]
        return ports


DEV_CLUSTER_PORTS = {6800, 10809, 9300} | {9201 + n for n in range(8)} | {
    6900 + 10 * n + s for n in range(8) for s in range(8)}


def port_free(port):
    # SO_REUSEADDR as the daemons set it (Rust's TcpListener does): TIME_WAIT
    # leftovers of the previous cluster do not count as busy, a listener does.
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((HOST, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_ports_free(ports, timeout_s):
    # A daemon stopped a moment ago may hold its port a few ms longer (its io_uring
    # is torn down asynchronously by the kernel).
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [p for p in ports if not port_free(p)]
        if not busy:
            return
        if time.monotonic() >= deadline:
            sys.exit(f"ports {busy} on {HOST} are in use by another process; pick another --base-port")
        time.sleep(0.1)


def port_listening(port):
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


# ---------------------------------------------------------------- /proc sampling

def proc_cpu_s(pid):
    """utime + stime of a process (all its threads), in seconds; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): utime is field 14, stime field 15.
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def proc_ctx_switches(pid):
    """{tid: (voluntary, involuntary)} context switches of a process's threads."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        vol = invol = 0
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        invol = int(line.split()[1])
        except OSError:
            continue
        out[tid] = (vol, invol)
    return out


def ctx_delta(before, after):
    """Switches between two samples: per thread, so threads that come and go (short
    helper threads) do not make the sum jump; a thread born in between counts fully."""
    vol = invol = 0
    for tid, (v1, i1) in after.items():
        v0, i0 = before.get(tid, (0, 0))
        vol += max(v1 - v0, 0)
        invol += max(i1 - i0, 0)
    return vol, invol


def machine_cpu_s():
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice
    idle = fields[3] + fields[4]
    total = sum(fields[:8])
    return ((total - idle) / CLK_TCK, total / CLK_TCK)


def other_builders():
    """Names and pids of build tools running on the machine (other engineers)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm in BUSY_NAMES:
            found.append(f"{comm}[{d}]")
    return found


def wait_quiet(max_busy_pct, timeout_s, own_pids=()):
    """Waits until no build runs and the rest of the machine (all but `own_pids`, our
    running daemons) is mostly idle. Returns the others' busy % of the last sample."""
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        b0, t0 = machine_cpu_s()
        o0 = sum(proc_cpu_s(p) or 0 for p in own_pids)
        time.sleep(2)
        b1, t1 = machine_cpu_s()
        o1 = sum(proc_cpu_s(p) or 0 for p in own_pids)
        busy_pct = 100 * max((b1 - b0) - (o1 - o0), 0) / max(t1 - t0, 1e-9)
        builders = other_builders()
        if not builders and busy_pct <= max_busy_pct:
            return busy_pct
        if time.monotonic() >= deadline:
            log(f"WARNING: machine still busy after {timeout_s}s ({busy_pct:.0f}% CPU, {builders[:4]}); measuring anyway")
            return busy_pct
        if not warned:
            log(f"waiting for a quiet machine (others use {busy_pct:.0f}% CPU, builds: {builders[:4]})...")
            warned = True
        time.sleep(3)


# ---------------------------------------------------------------- the cluster

class Cluster:
    """One mgr, OSDS OSDs and flame-nbd started by us, in a temp directory. Only the
    PIDs of processes we started are ever signalled."""

    def __init__(self, bin_dir, ports, mode, base_dir, auth=True):
        self.bin = bin_dir
        self.ports = ports
        self.mode = mode
        # With keys (the default, as deployed): `flame-admin auth init` in
        # DIR/keys, every daemon with its keyring, every OSD connection
        # authenticated at HELLO. Without: the manager with `auth: none`.
        self.auth = auth
        self.dir = tempfile.mkdtemp(prefix=f"flame-poll-{mode}-", dir=base_dir)
        self.procs = {}  # name -> Popen
        self.logs = {}

    def admin(self, *args, timeout=30):
        keyring = ["--keyring", os.path.join(self.dir, "keys", "client.admin.keyring")] if self.auth else []
        return subprocess.run(
            [os.path.join(self.bin, "flame-admin"), "--mgr", f"{HOST}:{self.ports.mgr}", *keyring, *args],
            capture_output=True, text=True, timeout=timeout,
        )

    def auth_yaml(self, daemon, n=None):
        """The YAML lines that give `daemon` (mgr, osd, nbd) its key, or turn
        authentication off on the manager."""
        if not self.auth:
            return "auth: none\n" if daemon == "mgr" else ""
        keyring = {"mgr": "cluster", "osd": f"osd.{n}", "nbd": "client.admin"}[daemon]
        return f"keyring: ./keys/{keyring}.keyring\n"

    def add_osd_key(self, n):
        """OSD n's own key (osd.N), added once the manager answers."""
        if not self.auth:
            return
        keys = os.path.join(self.dir, "keys")
        r = self.admin("auth", "add", f"osd.{n}", "--cluster-keyring", os.path.join(keys, "cluster.keyring"),
                       "--out", os.path.join(keys, f"osd.{n}.keyring"), timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"flame-admin auth add osd.{n} failed: {r.stderr.strip()}")

    def init_keys(self):
        if not self.auth:
            return
        r = subprocess.run(
            [os.path.join(self.bin, "flame-admin"), "auth", "init", "--dir", os.path.join(self.dir, "keys")],
            capture_output=True, text=True, timeout=30,
        )
        if r.returncode != 0:
            raise RuntimeError(f"flame-admin auth init failed: {r.stderr.strip()}")

    def write_configs(self):
        p = self.ports
        cfg = {
            "mgr": f"""listen: "{HOST}:{p.mgr}"
data_dir: ./mgr
heartbeat_grace_ms: 6000
failure_check_interval_ms: 1000
pool:
  size: 3
  min_size: 2
  pg_count: 128
  object_size: 4194304
""" + self.auth_yaml("mgr"),
            "nbd": f"""mgr: "{HOST}:{p.mgr}"
listen: "{HOST}:{p.nbd}"
tcp_without_tls: true
unix: null
metrics_listen: "{HOST}:{p.nbd_metrics}"
threads: {NBD_THREADS}
poll_mode: {self.mode}
""" + self.auth_yaml("nbd"),
        }
        for n in range(OSDS):
            cfg[f"osd.{n}"] = f"""mgr: "{HOST}:{p.mgr}"
listen: "{HOST}:{p.osd[n]}"
metrics_listen: "{HOST}:{p.osd_metrics[n]}"
data_dir: ./osd.{n}
host: bench-host-{n}
shards: {SHARDS}
poll_mode: {self.mode}
direct_io: auto
""" + self.auth_yaml("osd", n)
        for name, text in cfg.items():
            with open(os.path.join(self.dir, f"{name}.yaml"), "w") as f:
                f.write(text)

    def start_one(self, name, binary):
        path = os.path.join(self.dir, f"{name}.log")
        log_f = open(path, "ab")
        self.logs[name] = path
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "info")
        # A session of its own: a Ctrl-C meant for this script reaches the daemons
        # only through our orderly stop().
        self.procs[name] = subprocess.Popen(
            [os.path.join(self.bin, binary), "--config", f"{name}.yaml"],
            cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log_f, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        log_f.close()

    def check_alive(self):
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = ""
                try:
                    with open(self.logs[name], errors="replace") as f:
                        tail = "".join(f.readlines()[-20:])
                except OSError:
                    pass
                raise RuntimeError(f"{name} exited with {p.returncode} during the run:\n{tail}")

    def start(self, timeout_s):
        self.init_keys()
        self.write_configs()
        deadline = time.monotonic() + timeout_s
        self.start_one("mgr", "flame-mgr")
        while not port_listening(self.ports.mgr):
            self.check_alive()
            if time.monotonic() >= deadline:
                raise RuntimeError("flame-mgr did not listen in time")
            time.sleep(0.1)
        for n in range(OSDS):
            self.add_osd_key(n)
            self.start_one(f"osd.{n}", "flame-osd")
        self.start_one("nbd", "flame-nbd")
        while True:
            self.check_alive()
            r = self.admin("--json", "status", timeout=10)
            if r.returncode == 0:
                try:
                    if json.loads(r.stdout).get("osds_up") == OSDS:
                        break
                except ValueError:
                    pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"only some OSDs up after {timeout_s}s: {r.stdout.strip()} {r.stderr.strip()}")
            time.sleep(0.3)
        for port in [self.ports.nbd] + [p + s for p in self.ports.osd for s in range(SHARDS)]:
            while not port_listening(port):
                self.check_alive()
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"nothing listens on {HOST}:{port} after {timeout_s}s")
                time.sleep(0.1)

    def create_volume(self, size):
        r = self.admin("volume", "create", VOLUME, "--size", size)
        if r.returncode != 0:
            raise RuntimeError(f"volume create failed: {r.stderr.strip()}")

    def pids(self):
        return {name: p.pid for name, p in self.procs.items()}

    def stop(self, grace_s=10):
        """SIGTERM every daemon we started, SIGKILL whatever is left after grace_s."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log(f"pid {p.pid} did not stop within {grace_s}s: SIGKILL")
                p.kill()
                p.wait(10)
        self.procs = {}

    def cleanup(self, keep):
        if keep:
            log(f"kept cluster directory {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- fio

def run_fio(args_list, timeout_s):
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = subprocess.run(args_list, check=True, capture_output=True, text=True, timeout=timeout_s).stdout
    wall = time.monotonic() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    fio_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return out, wall, fio_cpu


def prefill(uri, size, timeout_s):
    # Reads of never-written data are not what we measure: write it all once. The
    # export may take a moment to appear in flame-nbd's map: retry briefly.
    deadline = time.monotonic() + 20
    while True:
        try:
            run_fio(["fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=1M",
                     "--iodepth=8", f"--size={size}", "--output-format=json"], timeout_s)
            return
        except subprocess.CalledProcessError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"prefill failed: {e.stderr.strip()[-500:]}")
            time.sleep(0.5)


def measure(cluster, uri, rw, bs, qd, runtime, size):
    """One fio run with daemon and machine CPU sampled around it."""
    pids = cluster.pids()
    cpu0 = {n: proc_cpu_s(p) for n, p in pids.items()}
    cs0 = {n: proc_ctx_switches(p) for n, p in pids.items()}
    m0 = machine_cpu_s()
    cmd = ["fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", f"--runtime={runtime}", "--time_based", f"--size={size}",
           "--output-format=json", "--randrepeat=0", "--norandommap", "--group_reporting"]
    out, wall, fio_cpu = run_fio(cmd, runtime * 4 + 60)
    m1 = machine_cpu_s()
    cpu1 = {n: proc_cpu_s(p) for n, p in pids.items()}
    cs1 = {n: proc_ctx_switches(p) for n, p in pids.items()}
    cluster.check_alive()
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    lat = side["clat_ns"]["percentile"]
    ios = side["total_ios"]
    daemon_cpu = {n: cpu1[n] - cpu0[n] for n in pids}
    total_cpu = sum(daemon_cpu.values())
    machine_busy = m1[0] - m0[0]
    vol = invol = 0
    for n in pids:
        v, i = ctx_delta(cs0[n], cs1[n])
        vol += v
        invol += i
    return {
        "iops": side["iops"],
        "p50_us": lat.get("50.000000", 0) / 1000,
        "p99_us": lat.get("99.000000", 0) / 1000,
        "mean_us": side["clat_ns"]["mean"] / 1000,
        "ios": ios,
        "wall_s": wall,
        "daemon_cpu_s": total_cpu,
        "cpu_us_per_io": total_cpu * 1e6 / ios if ios else float("nan"),
        "daemon_cores": total_cpu / wall,
        "fio_cpu_s": fio_cpu,
        # CPU the rest of the machine (not our daemons, not fio) used meanwhile:
        # interference from other work. Kernel softirq time charged to no process
        # also lands here.
        "other_cpu_s": max(machine_busy - total_cpu - fio_cpu, 0.0),
        "vcsw_per_io": vol / ios if ios else float("nan"),
        "ivcsw_per_io": invol / ios if ios else float("nan"),
        "per_daemon_cpu_s": daemon_cpu,
    }


# ---------------------------------------------------------------- main

BINARIES = ("flame-mgr", "flame-osd", "flame-nbd", "flame-admin")


def ensure_binaries(bin_dir, build):
    names = BINARIES
    missing = [n for n in names if not os.access(os.path.join(bin_dir, n), os.X_OK)]
    if build or missing:
        log("cargo build --release --bins (waits for the shared target dir's lock if someone else builds)")
        subprocess.run(["cargo", "build", "--release", "--bins", "--quiet"], cwd=REPO, check=True, timeout=3600)
    missing = [n for n in names if not os.access(os.path.join(bin_dir, n), os.X_OK)]
    if missing:
        sys.exit(f"missing binaries in {bin_dir}: {missing}")


def fmt_ratio(x):
    return "" if x is None else f"{x:.2f}x"


def print_table(results, modes, runtime, repeat, size, commit):
    keys = ("iops", "p50_us", "p99_us", "mean_us", "cpu_us_per_io", "daemon_cores",
            "vcsw_per_io", "other_cpu_s")
    print(f"\n{time.strftime('%Y-%m-%d')}, commit {commit} (HEAD when the binaries were copied)")
    print(f"fio --ioengine=nbd, {runtime}s per run, median of {repeat} runs, size {size}; "
          f"{OSDS} OSDs x {SHARDS} shards + flame-nbd ({NBD_THREADS} threads) + fio on {NCPU} CPUs")
    hdr = (f"| {'job':<17} | {'poll_mode':<9} | {'IOPS':>7} | {'p50 us':>7} | {'p99 us':>7} | "
           f"{'CPU us/IO':>9} | {'cores':>5} | {'sleeps/IO':>9} | {'p50 vs intr':>11} | "
           f"{'p99 vs intr':>11} | {'CPU/IO vs intr':>14} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    medians = {}
    for name, *_ in JOBS:
        for mode in modes:
            runs = results.get((name, mode), [])
            if runs:
                medians[(name, mode)] = {k: statistics.median(r[k] for r in runs) for k in keys}
        base = medians.get((name, "interrupt"))
        for mode in modes:
            m = medians.get((name, mode))
            if m is None:
                continue
            rp50 = rp99 = rcpu = None
            if base and mode != "interrupt":
                rp50 = m["p50_us"] / base["p50_us"] if base["p50_us"] else None
                rp99 = m["p99_us"] / base["p99_us"] if base["p99_us"] else None
                rcpu = m["cpu_us_per_io"] / base["cpu_us_per_io"] if base["cpu_us_per_io"] else None
            print(f"| {name:<17} | {mode:<9} | {m['iops']:>7.0f} | {m['p50_us']:>7.1f} | {m['p99_us']:>7.1f} | "
                  f"{m['cpu_us_per_io']:>9.1f} | {m['daemon_cores']:>5.2f} | {m['vcsw_per_io']:>9.2f} | "
                  f"{fmt_ratio(rp50):>11} | {fmt_ratio(rp99):>11} | {fmt_ratio(rcpu):>14} |")
    disturbed = sum(1 for runs in results.values() for r in runs if r.get("disturbed"))
    worst_other = max((r["other_cpu_s"] / r["wall_s"] for runs in results.values() for r in runs), default=0)
    print(f"\nCPU us/IO and cores: utime+stime of mgr + {OSDS} OSDs + flame-nbd during the fio run. "
          f"sleeps/IO: voluntary context switches of the daemons' threads per I/O. "
          f"Largest CPU share used by other processes during any run: {worst_other:.2f} cores; "
          f"runs still disturbed after retries: {disturbed}.")
    return medians


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per fio run (default 10)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; every round runs every mode and job (default 3)")
    ap.add_argument("--size", default="512M", help="volume size and bytes fio touches (default 512M)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of interrupt,adaptive,busy")
    ap.add_argument("--base-port", type=int, default=16400, help="first of this benchmark's ports (default 16400)")
    ap.add_argument("--dir", default=None, help="parent of the clusters' temp directories (default: system temp dir; "
                                                 "use a real disk, not tmpfs, to measure O_DIRECT)")
    ap.add_argument("--build", action="store_true", help="run cargo build --release --bins first (else only if missing)")
    ap.add_argument("--start-timeout", type=int, default=30, help="seconds a cluster may take to come up")
    ap.add_argument("--quiet-timeout", type=int, default=900,
                    help="seconds to wait for other builds/tests to finish before each cluster (default 900)")
    ap.add_argument("--quiet-busy-pct", type=float, default=15.0,
                    help="'quiet' = other processes use at most this %% of all CPUs (default 15)")
    ap.add_argument("--retries", type=int, default=2,
                    help="re-measure a run disturbed by other processes up to this many times (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the clusters' directories (logs, configs)")
    ap.add_argument("--json", action="store_true", help="print every run's raw results as JSON too")
    args = ap.parse_args()

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        sys.exit(f"--modes: unknown {bad}; choose from {MODES}")
    if args.runtime < 1 or args.repeat < 1:
        sys.exit("--runtime and --repeat must be >= 1")
    if shutil.which("fio") is None:
        sys.exit("fio is not installed (apt-get install fio; it needs the nbd engine, fio >= 3.19)")
    ports = Ports(args.base_port)
    clash = sorted(set(ports.all()) & DEV_CLUSTER_PORTS)
    if clash or not (1024 < min(ports.all()) and max(ports.all()) < 65536):
        sys.exit(f"--base-port {args.base_port} gives unusable or dev-cluster ports {clash}")
    wait_ports_free(ports.all(), 5)
    bin_dir = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")), "release")
    ensure_binaries(bin_dir, args.build)
    # SIGTERM/SIGHUP to this script unwind through the finally blocks like Ctrl-C.
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    # Run a private copy: a rebuild by someone else in the middle of the run must not
    # give later modes other binaries than earlier ones.
    try:
        args.commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True, timeout=10).stdout.strip() or "?"
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *CRATE_DIRS, "Cargo.toml", "Cargo.lock"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        if dirty:
            # cargo builds the work tree: uncommitted changes are in the binaries too.
            args.commit += " + uncommitted changes"
            log(f"WARNING: uncommitted changes in the crates are built into the binaries:\n{dirty}")
    except (OSError, subprocess.SubprocessError):
        args.commit = "?"
    try:
        head_time = int(subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=REPO, capture_output=True,
                                       text=True, timeout=10).stdout.strip())
        oldest = min(os.path.getmtime(os.path.join(bin_dir, n)) for n in BINARIES)
        if oldest < head_time:
            log(f"WARNING: binaries in {bin_dir} are older than commit {args.commit}: "
                "the table's commit may not be what ran (use --build)")
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    snap_dir = tempfile.mkdtemp(prefix="flame-poll-bin-", dir=args.dir)
    try:
        for n in BINARIES:
            shutil.copy2(os.path.join(bin_dir, n), os.path.join(snap_dir, n))
        run_all(args, modes, ports, snap_dir)
    finally:
        shutil.rmtree(snap_dir, ignore_errors=True)


def run_all(args, modes, ports, bin_dir):
    uri = f"nbd://{HOST}:{ports.nbd}/{VOLUME}"
    results = {}
    raw = []
    t_start = time.monotonic()
    for rnd in range(args.repeat):
        # Rotate the mode order each round so no mode always runs first or last.
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        for mode in order:
            quiet = wait_quiet(args.quiet_busy_pct, args.quiet_timeout)
            wait_ports_free(ports.all(), 60)
            cluster = Cluster(bin_dir, ports, mode, args.dir)
            failed = False
            try:
                log(f"round {rnd + 1}/{args.repeat}: poll_mode {mode}: starting cluster in {cluster.dir} "
                    f"(machine {quiet:.0f}% busy before)")
                cluster.start(args.start_timeout)
                cluster.create_volume(args.size)
                prefill(uri, args.size, 600)
                for name, rw, bs, qd in JOBS:
                    # A run during which other processes used more than the quiet
                    # threshold is repeated (at most --retries times) once they calm down.
                    for attempt in range(args.retries + 1):
                        r = measure(cluster, uri, rw, bs, qd, args.runtime, args.size)
                        other_pct = 100 * r["other_cpu_s"] / r["wall_s"] / NCPU
                        r["disturbed"] = other_pct > args.quiet_busy_pct
                        if not r["disturbed"] or attempt == args.retries:
                            break
                        log(f"  {name} {mode}: other processes used {other_pct:.0f}% CPU meanwhile; measuring again")
                        wait_quiet(args.quiet_busy_pct, args.quiet_timeout, cluster.pids().values())
                    results.setdefault((name, mode), []).append(r)
                    raw.append({"round": rnd, "mode": mode, "job": name, **r})
                    log(f"  {name:<17} {mode:<9} {r['iops']:>8.0f} IOPS  p50 {r['p50_us']:>7.1f} us  "
                        f"p99 {r['p99_us']:>7.1f} us  {r['cpu_us_per_io']:>6.1f} CPU us/IO  "
                        f"{r['daemon_cores']:.2f} cores  other {r['other_cpu_s'] / r['wall_s']:.2f} cores"
                        + ("  DISTURBED" if r["disturbed"] else ""))
            except (RuntimeError, subprocess.SubprocessError) as e:
                log(f"round {rnd + 1} mode {mode} failed: {e}")
                failed = True
            finally:
                cluster.stop()
                cluster.cleanup(args.keep or failed)
    log(f"done in {time.monotonic() - t_start:.0f}s")
    print_table(results, modes, args.runtime, args.repeat, args.size, args.commit)
    if args.json:
        print(json.dumps(raw, indent=1))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        sys.exit(f"interrupted ({e}); every daemon this script started has been stopped")
