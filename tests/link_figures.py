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

With `--cluster`, `ecd bench --suite cluster` itself over such links, for each round trip asked:
a master and a node that puts (their links shaped as the holder's above) and a node that reads,
each on a host of its own, and the suite's store clients (vLLM's read, the simulated nodes) on the
reading node's host: this process moves into that host's network namespace once the hosts run.
The suite's flags follow `--`, as `ecd bench` takes them:

    python tests/link_figures.py --cluster 0.1 1 -- --runs 3 --cluster-samples 10
"""

from __future__ import annotations

import ctypes
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

from hosts_testing import Host, Hosts, hosts_missing, master_on, node_on, sweep

from ec_bench import bench, bench_cluster
from ec_daemon.cli import build_parser
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


CLONE_NEWNET = 0x40000000


def enter(host: Host) -> None:
    """Move this process into `host`'s network namespace: its calling thread, and every thread
    and process it starts from now on (the store clients' threads, the suite's child
    processes). Unix sockets are on the filesystem: the daemons' stay reachable."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{host.netns}") as netns:
        if libc.setns(netns.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter the network namespace {host.netns}")


def cluster(rtt: float, args: Any) -> None:
    """The cluster suite on test hosts of its own, over a link of round trip `rtt` ms (see the
    module); this process ends in the reading host's namespace."""
    hosts = Hosts()
    try:
        hosts.start()
        on_master, holder, reader = hosts.add("master"), hosts.add("holder"), hosts.add("reader")
        # Every link but the reader's own carries the round trip, all of it on what the holder
        # and the master receive: the read's requests, the lookups and the publishes.
        hosts.shape(holder, delay_ms=rtt)
        hosts.shape(on_master, delay_ms=rtt)
        quiet = ("--max-bytes", "4GiB", "--log-level", "warning")
        with ExitStack() as stack:
            master = stack.enter_context(master_on(on_master))
            # As `ecd bench` spawns them: the reading node lends the store nothing, so every
            # value it reads is the holder's, across the shaped link.
            near = stack.enter_context(
                node_on(holder, master, "--store-segment-bytes", "256MiB", *quiet)
            )
            far = stack.enter_context(node_on(reader, master, "--store-segment-bytes", "0", *quiet))
            assert master.proc is not None and near.proc is not None and far.proc is not None
            enter(reader)
            suite = bench_cluster.Cluster(
                master.address,
                master.metadata,
                master.proc.pid,
                (near.address, near.proc.pid),
                (far.address, far.proc.pid),
                f"http://{on_master.address}:{master.admin_port}/metrics",
                client_host=reader.address,
            )

            def restart_master() -> None:
                master.stop()
                master.start()

            def floor(nbytes: int) -> float:
                return transfer_floor.read_ms(
                    nbytes,
                    seconds=2,
                    target=transfer_floor.Side(holder.address, holder.launcher),
                    initiator=transfer_floor.Side(reader.address, reader.launcher),
                )

            report = bench.Report({})
            bench_cluster.run_cluster(suite, restart_master, floor, args, report)
            print(f"== round trip asked: {rtt} ms", flush=True)
            bench.finish(report, None)
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
    elif sys.argv[1:2] == ["--cluster"]:
        # Each round trip in a process of its own, on fresh hosts: a process keeps the
        # namespace it entered, and a second suite in one process, after the first had
        # restarted its master, died silently midway.
        given = sys.argv[2:]
        split = given.index("--") if "--" in given else len(given)
        for rtt in given[:split]:
            one = [sys.executable, __file__, "--cluster-at", rtt, *given[split:]]
            if subprocess.run(one, check=False).returncode != 0:
                return 1
    elif sys.argv[1:2] == ["--cluster-at"]:
        sweep()
        args = build_parser().parse_args(["bench", "--suite", "cluster", *sys.argv[4:]])
        cluster(float(sys.argv[2]), args)
    else:
        sweep()
        measure([float(x) for x in sys.argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
