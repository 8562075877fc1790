# shellcheck shell=bash
# Sourced INSIDE the test VM (scripts/vm.sh) by the rdma guest scripts: gives the
# guest a Soft-RoCE device, rxe0, on a guest-local netdev, and exports what Flame's
# rdma transport reads to use it (FLAME_RDMA_DEVICE, FLAME_RDMA_GID_INDEX).
#
#   soft_roce_up     dummy0 (the `dummy` module's interface, loaded at boot) gets
#                    $SOFT_ROCE_ADDR/24 and goes up; `rdma link add rxe0 type rxe
#                    netdev dummy0`; waits until the port is ACTIVE and its GID
#                    table holds the IPv4-mapped RoCE v2 GID of that address;
#                    checks that libibverbs (rdma-core's librxe provider) lists
#                    the device. Fails loudly (exit 1) when any piece is missing.
#
# RoCE v2 carries verbs in UDP (port 4791) over IP, so the netdev needs an
# address; the rxe driver loops a packet for one of its own addresses back
# inside the kernel, so every queue pair here talks to another on the same
# device and nothing leaves the guest (which has no network device anyway).
# The kernel modules (ib_core, ib_uverbs, udp_tunnel, ip6_udp_tunnel,
# crc32_generic: rxe's ICRC asks the crypto API for "crc32", rdma_rxe, dummy)
# are in scripts/vm.sh's default set.

SOFT_ROCE_DEV=rxe0
SOFT_ROCE_NETDEV=dummy0
SOFT_ROCE_ADDR="${SOFT_ROCE_ADDR:-10.99.0.1}"

soft_roce_fail() {
    echo "soft_roce: FAILED: $*" >&2
    dmesg | grep -iE 'rxe|infiniband|rdma' | tail -n 20 >&2
    exit 1
}

soft_roce_up() {
    local tool
    for tool in ip rdma ibv_devices ibv_devinfo; do
        command -v "$tool" >/dev/null ||
            soft_roce_fail "'$tool' is missing on the host (apt-get install iproute2 rdma-core ibverbs-providers ibverbs-utils)"
    done
    compgen -G '/usr/lib/*/libibverbs/librxe-rdmav*.so' >/dev/null ||
        soft_roce_fail "rdma-core's rxe provider (librxe) is missing on the host (apt-get install ibverbs-providers)"
    [[ -d /sys/module/rdma_rxe ]] || soft_roce_fail "the rdma_rxe module is not loaded (scripts/vm.sh's module set)"
    if ! ip link show "$SOFT_ROCE_NETDEV" >/dev/null 2>&1; then
        ip link add "$SOFT_ROCE_NETDEV" type dummy || soft_roce_fail "cannot create $SOFT_ROCE_NETDEV"
    fi
    ip addr add "$SOFT_ROCE_ADDR/24" dev "$SOFT_ROCE_NETDEV" || soft_roce_fail "ip addr add on $SOFT_ROCE_NETDEV"
    ip link set "$SOFT_ROCE_NETDEV" up || soft_roce_fail "ip link set $SOFT_ROCE_NETDEV up"
    rdma link add "$SOFT_ROCE_DEV" type rxe netdev "$SOFT_ROCE_NETDEV" ||
        soft_roce_fail "rdma link add $SOFT_ROCE_DEV type rxe netdev $SOFT_ROCE_NETDEV"
    # ::ffff:a.b.c.d, as the kernel prints it in the GID table.
    local a b c d want port=/sys/class/infiniband/$SOFT_ROCE_DEV/ports/1
    IFS=. read -r a b c d <<<"$SOFT_ROCE_ADDR"
    want="$(printf '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$a" "$b" "$c" "$d")"
    local i n gid_index="" state="" gid="" type=""
    # Bounded: 100 rounds of 0.1 s; the GID table fills in asynchronously. Read
    # with builtins: every exec costs a visible fraction of a second in this
    # emulated guest.
    for ((i = 0; i < 100; i++)); do
        state=""
        read -r state <"$port/state" 2>/dev/null || true
        if [[ "$state" == *ACTIVE* ]]; then
            for ((n = 0; n < 16; n++)); do
                gid="" type=""
                read -r gid <"$port/gids/$n" 2>/dev/null || true
                [[ "$gid" == "$want" ]] || continue
                read -r type <"$port/gid_attrs/types/$n" 2>/dev/null || true
                if [[ "$type" == "RoCE v2" ]]; then
                    gid_index=$n
                    break 2
                fi
            done
        fi
        sleep 0.1
    done
    [[ -n "$gid_index" ]] ||
        soft_roce_fail "$SOFT_ROCE_DEV: port not ACTIVE with a RoCE v2 GID for $SOFT_ROCE_ADDR after 10 s (state: $state)"
    ibv_devices | grep -qw "$SOFT_ROCE_DEV" || soft_roce_fail "libibverbs does not list $SOFT_ROCE_DEV: $(ibv_devices 2>&1)"
    # Pinning registered memory: root in the guest, but say so explicitly.
    ulimit -l unlimited || soft_roce_fail "ulimit -l unlimited"
    export FLAME_RDMA_DEVICE="$SOFT_ROCE_DEV" FLAME_RDMA_PORT=1 FLAME_RDMA_GID_INDEX="$gid_index"
    local mtu=""
    read -r mtu <"/sys/class/net/$SOFT_ROCE_NETDEV/mtu" 2>/dev/null || mtu="?"
    echo "soft_roce: $SOFT_ROCE_DEV on $SOFT_ROCE_NETDEV ($SOFT_ROCE_ADDR, MTU $mtu), port 1 $state, GID index $gid_index ($want)"
}
