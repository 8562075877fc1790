# Several NBD connections write different byte ranges of the same 4 KiB blocks
# concurrently (pipelined, via libnbd's async API); then every range must read back
# with the last value its connection wrote, from a fresh connection.
# Usage: multiconn.py URI CONNECTIONS BLOCKS ROUNDS
import sys
import nbd

uri, nconn, nblocks, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
slice_len = 4096 // nconn
hs = []
for _ in range(nconn):
    h = nbd.NBD()
    h.connect_uri(uri)
    hs.append(h)
assert hs[0].can_multi_conn(), "server does not advertise CAN_MULTI_CONN"

def value(conn, rnd):
    return (conn * 37 + rnd * 11 + 1) & 0xFF

for rnd in range(rounds):
    cookies = []
    # Interleave submissions across connections so they are in flight together.
    for blk in range(nblocks):
        for i, h in enumerate(hs):
            buf = bytes([value(i, rnd)]) * slice_len
            cookies.append((h, h.aio_pwrite(buf, blk * 4096 + i * slice_len)))
    for h in hs:
        while h.aio_in_flight() > 0:
            h.poll(-1)
    for h, c in cookies:
        h.aio_command_completed(c)  # raises on a failed write
for h in hs:
    h.flush()

check = nbd.NBD()
check.connect_uri(uri)
data = check.pread(nblocks * 4096, 0)
for blk in range(nblocks):
    for i in range(nconn):
        off = blk * 4096 + i * slice_len
        want = bytes([value(i, rounds - 1)]) * slice_len
        if data[off:off + slice_len] != want:
            print(f"MISMATCH block {blk} slice {i}: got {data[off]:#x}", file=sys.stderr)
            sys.exit(1)
for h in hs + [check]:
    h.shutdown()
print(f"ok {nconn} connections x {nblocks} blocks x {rounds} rounds")
