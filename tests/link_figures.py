"""What a shaped link between two test hosts (tests/hosts_testing.py) gives a read: its
request/response round trip, a plain TCP read of 8 MiB, and Mooncake's transfer engine's read of
8 MiB (`transfer_engine_bench`, the floor a remote hit can reach), for each round trip asked.

The whole round trip is put on what the holder receives (the reader's requests and ACKs), none
on what the reader receives (the bulk bytes): this kernel has no netem, and the test hosts'
delayer (tests/link_delay.py, Python over NFQUEUE) caps what passes through it near 40-50 MB/s,
so an 8 MiB read whose bytes went through it would measure the delayer. A request/response sees
the same round trip either way. Needs root (namespaces); says why and exits 2 where they cannot
be made (docs/performance.md, *Shaped links*).

    python tests/link_figures.py 0 0.1 1      # round trips in ms
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time

from hosts_testing import Hosts, hosts_missing, sweep

from ec_daemon.tools import transfer_floor

NBYTES = 8 << 20
PORT = 19000
PINGS = 50
READS = 12  # the first two are not counted (the connection's window grows)


def serve(address: str) -> None:
    """On the holder: answer b"p" with one byte, b"x" with NBYTES, connection after connection."""
    listener = socket.create_server((address, PORT))
    print("ready", flush=True)
    data = bytes(NBYTES)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while asked := conn.recv(1):
            conn.sendall(data if asked == b"x" else b"p")
        conn.close()


def read(address: str) -> None:
    """On the reader: the medians of PINGS one-byte round trips and of READS reads of NBYTES."""
    conn = socket.create_connection((address, PORT))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pings, reads = [], []
    for _ in range(PINGS):
        started = time.perf_counter()
        conn.send(b"p")
        conn.recv(1)
        pings.append(time.perf_counter() - started)
    view = memoryview(bytearray(NBYTES))
    for _ in range(READS):
        started = time.perf_counter()
        conn.send(b"x")
        got = 0
        while got < NBYTES:
            got += conn.recv_into(view[got:])
        reads.append(time.perf_counter() - started)
    print(statistics.median(pings) * 1e3, statistics.median(reads[2:]) * 1e3)


def measure(rtts: list[float]) -> None:
    hosts = Hosts()
    try:
        hosts.start()
        reader, holder = hosts.add("reader"), hosts.add("holder")
        here = (sys.executable, __file__)
        server = hosts.popen(holder, *here, "serve", holder.address, stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        print("rtt_asked_ms  round_trip_ms  tcp_8mib_ms  tcp_mb_s  floor_8mib_ms")
        for rtt in rtts:
            hosts.shape(holder, delay_ms=rtt)  # all of it on what the holder receives
            done = subprocess.run(
                [*reader.launcher, *here, "read", holder.address],
                capture_output=True,
                text=True,
                check=True,
            )
            ping_ms, read_ms = (float(x) for x in done.stdout.split())
            floor_ms = transfer_floor.read_ms(
                NBYTES,
                seconds=2,
                target=transfer_floor.Side(holder.address, holder.launcher),
                initiator=transfer_floor.Side(reader.address, reader.launcher),
            )
            print(
                f"{rtt:12} {ping_ms:14.3f} {read_ms:12.2f} {NBYTES / read_ms / 1e3:9.0f} "
                f"{floor_ms:14.2f}",
                flush=True,
            )
    finally:
        hosts.close()


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["read"]:
        read(sys.argv[2])
    elif missing := hosts_missing():
        print(f"no test hosts here: {missing}", file=sys.stderr)
        return 2
    else:
        sweep()
        measure([float(x) for x in sys.argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
