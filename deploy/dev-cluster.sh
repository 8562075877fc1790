#!/usr/bin/env bash
# Flame local development cluster: one flame-mgr, three flame-osd and flame-nbd on
# 127.0.0.1, all state under one cluster directory.
#
#   deploy/dev-cluster.sh up       build (release) and start; create volume `demo`
#   deploy/dev-cluster.sh status   which daemons run, and `flame-admin status`
#   deploy/dev-cluster.sh logs     last lines of every log (`logs NAME`, `logs -f`)
#   deploy/dev-cluster.sh down     stop everything (data and configs are kept)
#
# Options (before or after the command):
#   --dir DIR         cluster directory (default: $FLAME_DEV_DIR, else .flame-dev/ in
#                     the repository root)
#   --port-base N     listen on ports N..N+39 instead of the default ports, so two
#                     dev clusters can run on one machine (each with its own --dir):
#                     manager N, flame-nbd N+1 (metrics N+2), OSD metrics N+3..N+5,
#                     osd.K data ports N+10+10K (+1 per shard). Default ports:
#                     manager 6800, flame-nbd 10809 (metrics 9300), OSD metrics
#                     9201..9203, osd.K 6900+10K. Fixed when the cluster directory is
#                     created (its configs hold the ports); later commands reuse it.
#   --no-build        `up` without running cargo build first
# Environment:
#   FLAME_PROFILE        cargo profile of the binaries: release (default) or debug
#   FLAME_DEV_TIMEOUT    seconds `up` waits for the OSDs (default 30)
#   FLAME_DEV_PORT_BASE  same as --port-base
#   FLAME_DEV_TRANSPORT  transport between flame-nbd and the OSDs and between OSDs:
#                        shm (default: shared memory, since every daemon of the
#                        dev cluster is on this host; it beats tcp on latency and
#                        IOPS in bench/comm_layer.py, see docs/benchmarks.md) or
#                        tcp. Written into the configs when the cluster directory
#                        is created.
#   RUST_LOG             daemon log filter (default info)
#
# `up` after `down` restarts the same cluster with its data: configs and data
# directories stay in the cluster directory until you delete it. `up` writes
# DIR/keys (the cluster's keyrings, from flame-admin auth init: the manager
# requires them), DIR/tls (the cluster CA and the manager's certificate, from
# flame-admin tls init: the manager serves HTTPS only; flame-nbd's certificate
# and a client certificate for this user in tls/client) and DIR/env: `source
# DIR/env` sets FLAME_MGR, FLAME_KEYRING and FLAME_MGR_CA, so flame-admin
# talks to this cluster's manager as client.admin, and FLAME_NBD_URI (the
# volume demo on flame-nbd's Unix socket), FLAME_NBD_TLS_URI and
# FLAME_NBD_TLS_DIR (over TLS, and the client credentials).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${FLAME_DEV_DIR:-$REPO/.flame-dev}"
PROFILE="${FLAME_PROFILE:-release}"
TIMEOUT_S="${FLAME_DEV_TIMEOUT:-30}"
BUILD=1
STARTED_ANY=0 # whether `up` started a daemon (for the hint on failure)
PORT_BASE="${FLAME_DEV_PORT_BASE:-}"
TRANSPORT="${FLAME_DEV_TRANSPORT:-shm}"
PORT_BASE_MIN=1024
PORT_BASE_MAX=65000 # N+39 must be a port

HOST=127.0.0.1
OSDS=3
SHARDS=2
DAEMONS=(mgr osd.0 osd.1 osd.2 nbd)

# Sets the endpoints from PORT_BASE ("" = the default ports; see docs/configuration.md).
set_ports() {
    if [[ -z "$PORT_BASE" ]]; then
        MGR_PORT=6800
        NBD_PORT=10809
        NBD_METRICS_PORT=9300
        OSD_PORT0=6900
        OSD_METRICS_PORT0=9201
    else
        MGR_PORT=$PORT_BASE
        NBD_PORT=$((PORT_BASE + 1))
        NBD_METRICS_PORT=$((PORT_BASE + 2))
        OSD_METRICS_PORT0=$((PORT_BASE + 3))
        OSD_PORT0=$((PORT_BASE + 10))
    fi
}
osd_port() { echo $((OSD_PORT0 + 10 * $1)); }
osd_metrics_port() { echo $((OSD_METRICS_PORT0 + $1)); }

die() {
    echo "dev-cluster: error: $*" >&2
    if [[ "${cmd:-}" == up ]] && ((STARTED_ANY)); then
        echo "dev-cluster: daemons that did start keep running; see '$0$(dev_flags) status', '... logs', '... down'" >&2
    fi
    exit 1
}
note() { echo "dev-cluster: $*"; }

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

# A bad command line: say what was wrong first, then the usage; exit status 2.
usage_error() {
    echo "dev-cluster: error: $*" >&2
    echo "dev-cluster: commands: up, down, status, logs (--help for the options)" >&2
    echo >&2
    usage >&2
    exit 2
}

cmd=""
extra=()
while (($#)); do
    case "$1" in
    --dir)
        (($# >= 2)) || die "--dir needs a directory"
        DIR="$2"
        shift 2
        ;;
    --dir=*)
        DIR="${1#--dir=}"
        shift
        ;;
    --port-base)
        (($# >= 2)) || die "--port-base needs a port number"
        PORT_BASE="$2"
        shift 2
        ;;
    --port-base=*)
        PORT_BASE="${1#--port-base=}"
        shift
        ;;
    --no-build)
        BUILD=0
        shift
        ;;
    -h | --help | help)
        usage
        exit 0
        ;;
    up | down | status | logs)
        [[ -z "$cmd" ]] || die "more than one command: $cmd and $1"
        cmd="$1"
        shift
        ;;
    -*)
        if [[ "$cmd" == logs ]]; then
            extra+=("$1")
            shift
        else
            usage_error "unknown option '$1'"
        fi
        ;;
    *)
        [[ -n "$cmd" ]] || usage_error "unknown command '$1'"
        extra+=("$1")
        shift
        ;;
    esac
done
[[ -n "$cmd" ]] || usage_error "no command given"
[[ "$TRANSPORT" == shm || "$TRANSPORT" == tcp ]] || usage_error "FLAME_DEV_TRANSPORT must be shm or tcp, not '$TRANSPORT'"
if [[ -n "$PORT_BASE" ]]; then
    if ! [[ "$PORT_BASE" =~ ^[0-9]{4,5}$ ]] || ((PORT_BASE < PORT_BASE_MIN || PORT_BASE > PORT_BASE_MAX)); then
        usage_error "--port-base must be a number from $PORT_BASE_MIN to $PORT_BASE_MAX, not '$PORT_BASE'"
    fi
fi
case "$PROFILE" in
release | debug) ;;
*) die "FLAME_PROFILE must be release or debug, not '$PROFILE'" ;;
esac

BIN="${CARGO_TARGET_DIR:-$REPO/target}/$PROFILE"
ADMIN="$BIN/flame-admin"

# Absolute cluster directory (it may not exist yet).
case "$DIR" in
/*) ;;
*) DIR="$PWD/$DIR" ;;
esac

# The port base is fixed when the cluster directory is created (its configs hold
# the ports): remembered in DIR/port-base ("default" for the default ports).
PORT_BASE_FILE="$DIR/port-base"
if [[ -f "$PORT_BASE_FILE" ]]; then
    saved="$(cat "$PORT_BASE_FILE")"
    [[ "$saved" == default ]] && saved=""
    if [[ -n "$PORT_BASE" && "$PORT_BASE" != "$saved" ]]; then
        die "the cluster in $DIR uses $([[ -n "$saved" ]] && echo "port base $saved" || echo "the default ports"), not $PORT_BASE (its configs hold its ports): drop --port-base, or delete $DIR to start afresh"
    fi
    PORT_BASE="$saved"
elif [[ -z "$PORT_BASE" && -f "$DIR/mgr.yaml" ]]; then
    # A directory made before port bases existed: the default ports.
    PORT_BASE=""
fi
set_ports

binary_of() {
    case "$1" in
    mgr) echo flame-mgr ;;
    osd.*) echo flame-osd ;;
    nbd) echo flame-nbd ;;
    esac
}

# The ports a daemon listens on, for conflict checks.
ports_of() {
    case "$1" in
    mgr) echo "$MGR_PORT" ;;
    osd.*)
        local n="${1#osd.}" s
        for ((s = 0; s < SHARDS; s++)); do echo $(($(osd_port "$n") + s)); done
        osd_metrics_port "$n"
        ;;
    nbd) echo "$NBD_PORT $NBD_METRICS_PORT" ;;
    esac
}

pidfile() { echo "$DIR/run/$1.pid"; }
logfile() { echo "$DIR/logs/$1.log"; }

# Prints the pid of a running daemon of this cluster, or fails. The pid must belong to
# the right binary (a stale pid file may name a reused pid).
running_pid() {
    local f pid
    f="$(pidfile "$1")"
    [[ -f "$f" ]] || return 1
    pid="$(cat "$f" 2>/dev/null)" || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$(binary_of "$1") --config" || return 1
    echo "$pid"
}

port_in_use() {
    (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null
}

write_config() { # name text: writes DIR/name.yaml unless it exists (user edits are kept)
    local f="$DIR/$1.yaml"
    [[ -f "$f" ]] && return 0
    printf '%s\n' "$2" >"$f"
}

write_configs() {
    local header="# Generated by deploy/dev-cluster.sh; edit freely, the file is kept.
# Every key is documented in docs/configuration.md. Paths are relative to the
# cluster directory (the daemons run there)."
    write_config mgr "$header
listen: \"$HOST:$MGR_PORT\"
data_dir: ./mgr
keyring: ./keys/cluster.keyring     # flame-admin auth init wrote it (keys/, mode 0700)
tls:                                # flame-admin tls init wrote them (tls/): the API is HTTPS only
  cert_file: ./tls/mgr.crt
  key_file: ./tls/mgr.key
heartbeat_grace_ms: 6000
failure_check_interval_ms: 1000
pool:
  size: 3
  min_size: 2
  pg_count: 128
  object_size: 4194304"
    # The cluster CA for the others, when the manager (new, or kept) serves TLS.
    local n ca_line="# mgr_tls_ca: null                # the manager serves plain HTTP"
    if mgr_tls; then
        ca_line="mgr_tls_ca: ./tls/ca.crt            # the cluster CA: the manager's certificate is checked against it"
    fi
    for ((n = 0; n < OSDS; n++)); do
        write_config "osd.$n" "$header
mgr: \"$HOST:$MGR_PORT\"
keyring: ./keys/osd.$n.keyring     # this OSD's own key (osd.$n): it acts only as osd.$n
$ca_line
listen: \"$HOST:$(osd_port "$n")\"        # shard i listens on this port + i
metrics_listen: \"$HOST:$(osd_metrics_port "$n")\"
data_dir: ./osd.$n
host: dev-host-$n                   # each OSD plays its own host (failure domain)
shards: $SHARDS
poll_mode: interrupt
transport: $TRANSPORT               # FLAME_DEV_TRANSPORT: tcp or shm (same-host shared memory)
direct_io: auto"
    done
    # The exports: a Unix socket for this user (nbd+unix://), and TCP with TLS
    # and client certificates from the cluster CA (nbds://) when there is one.
    local tcp_export="# listen: null                      # no TCP export without the cluster CA (tls/)"
    if mgr_tls; then
        tcp_export="listen: \"$HOST:$NBD_PORT\"           # the TCP export: TLS required (nbds://)
tls:
  cert_file: ./tls/nbd.crt          # flame-admin tls issue --as nbd
  key_file: ./tls/nbd.key
  client_ca_file: ./tls/ca.crt      # clients present a certificate from the cluster CA (tls/client/)"
    fi
    write_config nbd "$header
mgr: \"$HOST:$MGR_PORT\"
keyring: ./keys/client.nbd.keyring  # role client: reads the map, changes nothing
$ca_line
unix:
  path: \"$(nbd_socket)\"      # the local export: this user only (nbd+unix://)
$tcp_export
metrics_listen: \"$HOST:$NBD_METRICS_PORT\"
threads: 2
poll_mode: interrupt
transport: $TRANSPORT"
}

start_daemon() {
    local name="$1" bin p
    bin="$BIN/$(binary_of "$name")"
    # A daemon killed a moment ago may hold its ports for a few milliseconds more
    # (the kernel tears down its io_uring asynchronously): allow a short grace.
    local deadline=$((SECONDS + 5))
    for p in $(ports_of "$name"); do
        while port_in_use "$p"; do
            ((SECONDS < deadline)) || die "port $p (needed by $name) is in use by another process; stop it first"
            sleep 0.1
        done
    done
    rm -f "$(pidfile "$name")"
    STARTED_ANY=1
    # Remember where this run's lines start, so errors show this run only.
    local log
    log="$(logfile "$name")"
    touch "$log"
    stat -c %s "$log" >"$(logstart "$name")"
    echo "==== $(date -Is) dev-cluster.sh: starting $name ====" >>"$log"
    # setsid + nohup: the daemon leaves this script's session and survives it. The
    # inner shell writes its own pid, then execs the daemon under that same pid.
    (
        cd "$DIR"
        # shellcheck disable=SC2016 # $$ and $1.. expand in the inner shell
        setsid nohup bash -c 'echo $$ >"$1"; exec "$2" --config "$3"' \
            flame-start "run/$name.pid" "$bin" "$name.yaml" \
            >>"logs/$name.log" 2>&1 </dev/null &
    )
    # The inner shell writes the pid file, then execs: once the file is there, a
    # process that is gone has already exited.
    local i pid=""
    for ((i = 0; i < 200; i++)); do
        running_pid "$name" >/dev/null && break
        pid="$(cat "$(pidfile "$name")" 2>/dev/null)" || pid=""
        if [[ "$pid" =~ ^[0-9]+$ ]] && ! kill -0 "$pid" 2>/dev/null; then
            exited "$name" "exited at once"
        fi
        sleep 0.02
    done
    running_pid "$name" >/dev/null || exited "$name" "did not start"
    # A daemon with a bad config or a taken port exits at once: wait until it
    # listens (or dies), so that is reported now, with its own message.
    local first deadline=$((SECONDS + TIMEOUT_S))
    case "$name" in
    mgr) first=$MGR_PORT ;;
    osd.*) first="$(osd_port "${name#osd.}")" ;;
    nbd) first=$NBD_PORT ;;
    esac
    while ! port_in_use "$first"; do
        running_pid "$name" >/dev/null || exited "$name" "exited during start-up"
        ((SECONDS < deadline)) || exited "$name" "does not listen on port $first after ${TIMEOUT_S}s"
        sleep 0.05
    done
}

logstart() { echo "$DIR/run/$1.logstart"; }

# Prints the lines daemon $1 logged in this run (since `up` started it).
this_run_log() {
    local log start=0
    log="$(logfile "$1")"
    [[ -f "$log" ]] || return 0
    if [[ -f "$(logstart "$1")" ]]; then
        start="$(cat "$(logstart "$1")")"
        [[ "$start" =~ ^[0-9]+$ ]] || start=0
    fi
    tail -c +$((start + 1)) "$log" | tail -n 30
}

exited() { # name what: shows the daemon's log lines of this run, then dies
    echo "---- $(logfile "$1"), this run ----" >&2
    this_run_log "$1" >&2 || true
    echo "----" >&2
    die "$1 $2"
}

check_alive() { # fails loudly if a daemon we started has died
    local name
    for name in "${DAEMONS[@]}"; do
        running_pid "$name" >/dev/null || exited "$name" "exited during start-up"
    done
}

# Whether this cluster's manager serves TLS (its config has a `tls:` that is
# not null; a cluster directory from before TLS keeps plain HTTP).
mgr_tls() {
    grep -q '^tls:' "$DIR/mgr.yaml" 2>/dev/null &&
        ! grep -Eq '^tls:[[:space:]]*(null|~)[[:space:]]*(#.*)?$' "$DIR/mgr.yaml"
}
mgr_scheme() { if mgr_tls; then echo https; else echo http; fi; }

admin() {
    local ca=()
    if mgr_tls; then ca=(--mgr-ca "$DIR/tls/ca.crt"); fi
    "$ADMIN" --mgr "$HOST:$MGR_PORT" --keyring "$DIR/keys/client.admin.keyring" "${ca[@]}" "$@"
}

# The cluster's keys: created once (offline) before the manager first starts.
ensure_keys() {
    [[ -f "$DIR/keys/cluster.keyring" ]] && return 0
    "$ADMIN" auth init --dir "$DIR/keys" >/dev/null || die "flame-admin auth init failed"
    note "created the cluster's keys in $DIR/keys (cluster, client.admin)"
}

# The cluster CA and the manager's certificate: created once (offline), for a
# manager whose config asks for TLS.
ensure_tls() {
    mgr_tls || return 0
    local f have=0
    for f in ca.crt ca.key mgr.crt mgr.key; do
        [[ -f "$DIR/tls/$f" ]] && have=$((have + 1))
    done
    ((have == 4)) && return 0
    ((have == 0)) || die "$DIR/tls holds only some of ca.crt, ca.key, mgr.crt, mgr.key: move it away and run up again"
    "$ADMIN" tls init --dir "$DIR/tls" --name "$HOST" >/dev/null || die "flame-admin tls init failed"
    note "created the cluster CA and the manager's certificate in $DIR/tls"
}

# flame-nbd's Unix socket export.
nbd_socket() { echo "$DIR/run/nbd.sock"; }
# The client credentials `up` issues for this user (QEMU's tls-creds-x509 and
# libnbd's tls-certificates layout): every volume, read and write.
nbd_tls_dir() { echo "$DIR/tls/client"; }

# flame-nbd's certificate and a client certificate (client.dev, every volume)
# from the cluster CA: issued once, for a cluster whose manager has the CA.
ensure_nbd_tls() {
    mgr_tls || return 0
    if [[ ! -f "$DIR/tls/nbd.crt" ]]; then
        "$ADMIN" tls issue --dir "$DIR/tls" --as nbd --name "$HOST" >/dev/null ||
            die "flame-admin tls issue (flame-nbd's certificate) failed"
    fi
    local c
    c="$(nbd_tls_dir)"
    [[ -f "$c/client-key.pem" ]] && return 0
    if [[ ! -f "$DIR/tls/client.dev.crt" ]]; then
        "$ADMIN" tls client client.dev --dir "$DIR/tls" --volumes '*' --days 825 >/dev/null ||
            die "flame-admin tls client failed"
    fi
    mkdir -p "$c" && chmod 700 "$c"
    cp "$DIR/tls/ca.crt" "$c/ca-cert.pem"
    cp "$DIR/tls/client.dev.crt" "$c/client-cert.pem"
    cp -p "$DIR/tls/client.dev.key" "$c/client-key.pem"
    note "issued flame-nbd's certificate and a client certificate (client.dev) in $DIR/tls"
}

# An entity of the daemon's own (osd.N: role osd; client.nbd: role client,
# reads the map and changes nothing) and its keyring, added once the manager
# answers.
ensure_entity_key() { # entity
    local entity="$1"
    [[ -f "$DIR/keys/$entity.keyring" ]] && return 0
    local deadline=$((SECONDS + TIMEOUT_S))
    until admin auth ls >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "the manager did not answer within ${TIMEOUT_S}s; see $(logfile mgr)"
        sleep 0.2
    done
    local write=(--cluster-keyring "$DIR/keys/cluster.keyring" --out "$DIR/keys/$entity.keyring")
    if admin auth ls | awk '{ print $1 }' | grep -qx "$entity"; then
        admin auth key "$entity" "${write[@]}" >/dev/null || die "cannot write $entity's keyring"
    else
        admin auth add "$entity" "${write[@]}" >/dev/null || die "cannot add entity $entity"
    fi
}


# Prints "ADDR STATUS" for every OSD the manager knows (from the `osd ls` table:
# ID HOST ADDR SHARDS WEIGHT STATUS ...).
osd_table() {
    admin osd ls 2>/dev/null | awk 'NR > 1 && $1 ~ /^osd\./ { print $3, $6 }'
}

# Waits until this cluster's OSDs — by address, whatever else the manager knows
# (an extra OSD someone started, one of another cluster) — are up.
wait_ready() {
    local deadline=$((SECONDS + TIMEOUT_S)) table n addr missing others
    while :; do
        check_alive
        missing=()
        if table="$(osd_table)"; then
            for ((n = 0; n < OSDS; n++)); do
                addr="$HOST:$(osd_port "$n")"
                grep -qx "$addr up" <<<"$table" || missing+=("osd.$n ($addr)")
            done
        else
            missing=("the manager's answer")
        fi
        ((${#missing[@]} == 0)) && break
        ((SECONDS < deadline)) || {
            admin osd ls >&2 || true
            others="$(awk -v h="$HOST" -v p0="$(osd_port 0)" -v p1="$(osd_port $((OSDS - 1)))" \
                '{ split($1, a, ":"); if (a[1] != h || a[2] < p0 || a[2] > p1 || (a[2] - p0) % 10) n++ } END { print n + 0 }' <<<"$table")"
            die "not up after ${TIMEOUT_S}s: ${missing[*]}$( ((others > 0)) && echo "; the manager also knows $others OSD(s) that are not this cluster's") (logs: $DIR/logs/)"
        }
        sleep 0.3
    done
    local p
    for p in $(ports_of osd.0) $(ports_of osd.1) $(ports_of osd.2) $(ports_of nbd); do
        while ! port_in_use "$p"; do
            check_alive
            ((SECONDS < deadline)) || die "nothing listens on port $p after ${TIMEOUT_S}s (logs: $DIR/logs/)"
            sleep 0.2
        done
    done
}

# The options that name this cluster, for the commands printed to the user.
dev_flags() {
    local f=""
    [[ "$DIR" == "$REPO/.flame-dev" ]] || f+=" --dir $DIR"
    [[ -z "$PORT_BASE" ]] || f+=" --port-base $PORT_BASE"
    echo "$f"
}

print_usage_info() {
    local n
    cat <<EOF

Flame dev cluster is up — cluster directory: $DIR

  manager API    $(mgr_scheme)://$HOST:$MGR_PORT/v1/status    metrics $(mgr_scheme)://$HOST:$MGR_PORT/metrics
EOF
    if mgr_tls; then
        echo "                 (TLS: curl --cacert $DIR/tls/ca.crt ...; the cluster CA is $DIR/tls/ca.crt)"
    fi
    for ((n = 0; n < OSDS; n++)); do
        printf '  osd.%d          %s:%d-%d (shards)     metrics http://%s:%d/metrics\n' \
            "$n" "$HOST" "$(osd_port "$n")" $(($(osd_port "$n") + SHARDS - 1)) "$HOST" "$(osd_metrics_port "$n")"
    done
    cat <<EOF
  flame-nbd      nbd+unix:///demo?socket=$(nbd_socket)    (this user only)
                 nbds://$HOST:$NBD_PORT/demo    (TLS: client certificate in $(nbd_tls_dir))
                 metrics http://$HOST:$NBD_METRICS_PORT/metrics
  logs           $DIR/logs/        configs $DIR/*.yaml

Use the 4 GiB volume "demo" (NBD export name = volume name; \$FLAME_NBD_URI and
\$FLAME_NBD_TLS_URI in $DIR/env name it, \$FLAME_NBD_TLS_DIR the credentials):
  qemu-io -f raw "nbd+unix:///demo?socket=$(nbd_socket)" -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M'
  nbdcopy "nbds://$HOST:$NBD_PORT/demo?tls-certificates=$(nbd_tls_dir)" copy.img
  qemu-io --object tls-creds-x509,id=tls0,dir=$(nbd_tls_dir),endpoint=client \\
      --image-opts driver=nbd,server.type=inet,server.host=$HOST,server.port=$NBD_PORT,export=demo,tls-creds=tls0 \\
      -c 'read -P 0xab 0 1M'
  mkdir -p mnt && nbdfuse mnt/ "nbd+unix:///demo?socket=$(nbd_socket)" &     # volume appears as file mnt/nbd
      dd if=/dev/urandom of=mnt/nbd bs=1M count=16 conv=notrunc,fsync
      losetup --find --show mnt/nbd   # then mkfs.ext4 /dev/loopN and mount it (as root)
      fusermount3 -u mnt              # when done
  nbd-client -N demo -u $(nbd_socket) /dev/nbd0    # as this user (root), with the nbd module
  qemu-system-x86_64 ... -drive "file=nbd+unix:///demo?socket=$(nbd_socket),format=raw,cache=none"

Administer it (flame-admin needs this cluster's admin keyring and CA and talks
to 127.0.0.1:6800 unless FLAME_MGR or --mgr says otherwise; $DIR/env sets
FLAME_MGR=$HOST:$MGR_PORT, FLAME_KEYRING=$DIR/keys/client.admin.keyring and
FLAME_MGR_CA=$DIR/tls/ca.crt):
  export PATH="$BIN:\$PATH"; source $DIR/env
  flame-admin status
  flame-admin osd ls
  flame-admin volume create vm1 --size 10G
  flame-admin volume ls
  flame-admin locate demo 4M
  flame-admin volume create scratch --size 4G && flame-admin bench scratch --rw randwrite

  deploy/dev-cluster.sh$(dev_flags) status | logs | down
EOF
}

cmd_up() {
    local name pid started=0
    if ((BUILD)); then
        note "building $PROFILE binaries (cargo build --bins)..."
        # cargo's own progress (Compiling ... lines): a first build takes minutes.
        local flags=(--bins)
        [[ "$PROFILE" == release ]] && flags+=(--release)
        (cd "$REPO" && cargo build "${flags[@]}") || die "cargo build failed"
    fi
    for name in flame-mgr flame-osd flame-nbd flame-admin; do
        [[ -x "$BIN/$name" ]] || die "$BIN/$name missing: build it (cargo build --bins, with --release for FLAME_PROFILE=release)"
    done
    # Every port a daemon still to start needs must be free before any starts: an
    # OSD must never register with another cluster's manager on our manager's port.
    local p busy=()
    for name in "${DAEMONS[@]}"; do
        running_pid "$name" >/dev/null && continue
        for p in $(ports_of "$name"); do
            port_in_use "$p" && busy+=("$p ($name)")
        done
    done
    if ((${#busy[@]})); then
        # A daemon stopped a moment ago may hold its ports a little longer.
        sleep 1
        busy=()
        for name in "${DAEMONS[@]}"; do
            running_pid "$name" >/dev/null && continue
            for p in $(ports_of "$name"); do
                port_in_use "$p" && busy+=("$p ($name)")
            done
        done
        ((${#busy[@]} == 0)) || die "ports in use by another process: ${busy[*]}. Another dev cluster? Give this one its own ports: $0 --dir OTHER_DIR --port-base N up (e.g. N = 17000; see --help)"
    fi
    mkdir -p "$DIR/logs" "$DIR/run"
    [[ -f "$PORT_BASE_FILE" ]] || echo "${PORT_BASE:-default}" >"$PORT_BASE_FILE"
    write_configs
    ensure_keys
    ensure_tls
    ensure_nbd_tls
    {
        printf '%s\n' "# Generated by deploy/dev-cluster.sh: source it to point flame-admin at this cluster." \
            "export FLAME_MGR=$HOST:$MGR_PORT" "export FLAME_KEYRING=$DIR/keys/client.admin.keyring" \
            "# The volume demo on flame-nbd's Unix socket (this user only)." \
            "export FLAME_NBD_URI='nbd+unix:///demo?socket=$(nbd_socket)'"
        if mgr_tls; then
            printf '%s\n' "export FLAME_MGR_CA=$DIR/tls/ca.crt" \
                "# The volume demo over TLS, and the client credentials it needs (QEMU tls-creds-x509 dir)." \
                "export FLAME_NBD_TLS_URI='nbds://$HOST:$NBD_PORT/demo?tls-certificates=$(nbd_tls_dir)'" \
                "export FLAME_NBD_TLS_DIR=$(nbd_tls_dir)"
        else
            printf '%s\n' "unset FLAME_MGR_CA FLAME_NBD_TLS_URI FLAME_NBD_TLS_DIR"
        fi
    } >"$DIR/env"
    for name in "${DAEMONS[@]}"; do
        if pid="$(running_pid "$name")"; then
            note "$name already running (pid $pid)"
            continue
        fi
        case "$name" in
            nbd) ensure_entity_key client.nbd ;;
            osd.*) ensure_entity_key "$name" ;;
        esac
        start_daemon "$name"
        started=$((started + 1))
        note "started $name (pid $(running_pid "$name"), log $(logfile "$name"))"
    done
    ((started > 0)) || note "cluster in $DIR is already running"
    note "waiting up to ${TIMEOUT_S}s for $OSDS OSDs to be up..."
    wait_ready
    if admin volume info demo >/dev/null 2>&1; then
        note "volume demo exists"
    else
        admin volume create demo --size 4G >/dev/null || die "could not create volume demo"
        note "created volume demo (4 GiB)"
    fi
    print_usage_info
    if [[ -n "$PORT_BASE" ]]; then
        echo
        note "this cluster's manager is $HOST:$MGR_PORT: run 'source $DIR/env' (sets FLAME_MGR, FLAME_KEYRING and FLAME_MGR_CA) or pass --mgr $HOST:$MGR_PORT --keyring $DIR/keys/client.admin.keyring --mgr-ca $DIR/tls/ca.crt to flame-admin"
    fi
}


cmd_down() {
    [[ -d "$DIR" ]] || die "no cluster directory $DIR"
    local name pid pids=() names=()
    for name in nbd osd.2 osd.1 osd.0 mgr; do
        if pid="$(running_pid "$name")"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
            names+=("$name")
        fi
    done
    local deadline=$((SECONDS + 15)) i alive
    while :; do
        alive=0
        for i in "${!pids[@]}"; do
            kill -0 "${pids[$i]}" 2>/dev/null && alive=1
        done
        ((alive && SECONDS < deadline)) || break
        sleep 0.1
    done
    for i in "${!pids[@]}"; do
        if kill -0 "${pids[$i]}" 2>/dev/null; then
            note "${names[$i]} did not stop within 15s: SIGKILL"
            kill -KILL "${pids[$i]}" 2>/dev/null || true
        fi
        note "stopped ${names[$i]} (pid ${pids[$i]})"
    done
    rm -f "$DIR"/run/*.pid
    ((${#pids[@]})) || note "nothing was running in $DIR"
    note "data and configs kept in $DIR ('up' brings the same cluster back; delete the directory to start afresh)"
}

cmd_status() {
    [[ -d "$DIR" ]] || die "no cluster directory $DIR (start one with: deploy/dev-cluster.sh up)"
    local name pid all=0
    echo "cluster directory: $DIR"
    for name in "${DAEMONS[@]}"; do
        if pid="$(running_pid "$name")"; then
            printf '  %-6s running (pid %s)\n' "$name" "$pid"
        else
            printf '  %-6s stopped\n' "$name"
            all=3
        fi
    done
    if running_pid mgr >/dev/null && [[ -x "$ADMIN" ]]; then
        echo
        admin status || all=1
    fi
    return "$all"
}

cmd_logs() {
    [[ -d "$DIR/logs" ]] || die "no logs in $DIR"
    local follow=0 names=() a
    for a in "${extra[@]+"${extra[@]}"}"; do
        case "$a" in
        -f | --follow) follow=1 ;;
        *) names+=("$a") ;;
        esac
    done
    ((${#names[@]})) || names=("${DAEMONS[@]}")
    local files=()
    for a in "${names[@]}"; do
        [[ -f "$(logfile "$a")" ]] || die "no log for '$a' (daemons: ${DAEMONS[*]})"
        files+=("$(logfile "$a")")
    done
    if ((follow)); then
        exec tail -n 20 -F "${files[@]}"
    fi
    tail -n "$([[ ${#names[@]} -eq 1 ]] && echo 100 || echo 20)" "${files[@]}"
}

if [[ "$cmd" != logs ]] && ((${#extra[@]})); then
    die "unexpected arguments: ${extra[*]}"
fi
"cmd_$cmd"
