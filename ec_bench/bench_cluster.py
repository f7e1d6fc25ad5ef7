"""`ecd bench --suite cluster`: the cluster tier on a Mooncake Store (docs/design.md §13), with a
master and two daemons on loopback that the command spawns, and store clients in the bench's own
process:

- remote hit: a get on one daemon of an 8 MiB entry only the other daemon put (one lookup at the
  master, one read into the local entry, then the copy out), against a local get of the same
  entry on the same daemon, and against vLLM's own store client reading it (vLLM 0.33's
  `mooncake_store_embedding`: `batch_get_into` a registered read buffer, the header checked, the
  bytes copied out), side by side, sample by sample; and against the floor, the transfer
  engine's own read of 8 MiB on the same link (`transfer_engine_bench`), once a run;
- directory: simulated nodes, each a store client that publishes entries of its own into its
  own segment, 1, 10 and 100 of them: the daemon's resident memory and entries against the
  entries in the store, and the master's memory per entry;
- lookups: batched lookups (`batch_get_replica_desc`, as a remote hit asks, 64 keys a call) one
  master answers per second from 1, 8 and 64 store clients, each on a thread of its own (the
  call releases the interpreter's lock);
- republish: small entries published by one daemon, then the master SIGKILLed and started again
  with an empty directory: how long until the daemon has published them all again, and the
  calls the master answered meanwhile (its own counters, new with the process).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ec_bench.bench import Report, _wait, pool_dropped, progress
from ec_client import Client, Consumer, Producer, Role
from ec_protocol.types import ClusterStats
from ec_protocol.units import format_size

if TYPE_CHECKING:
    import torch

POOL = "ecd-bench"
NAMESPACE = "ecd-bench@model:bench@dtype:bfloat16"
HIDDEN = 2048  # bfloat16: rows of 4096 bytes, the pool's block
BLOCK = HIDDEN * 2
HEADER = struct.Struct("<IIQQ")  # the value's header (ec_daemon.cluster.codec)
MAGIC = 0x4D4F4F4E
LOOKUP_BATCH = 64
MIN_SEGMENT = 16 << 20  # the least a store client may mount (Mooncake 0.3)


@dataclass(frozen=True)
class Cluster:
    """What the suite runs against: a master, and two daemons joined to it (address, pid)."""

    master: str  # HOST:PORT
    metadata: str  # the metadata server's URL
    master_pid: int
    near: tuple[str, int]  # puts the entries others read
    far: tuple[str, int]  # reads them
    master_metrics: str  # the URL of the master's metrics
    # Where the other nodes reach this process's store clients (vLLM's read, the simulated
    # nodes' segments): loopback, or the bench's own host on the test hosts' links
    # (tests/link_figures.py).
    client_host: str = "127.0.0.1"


def rss(pid: int) -> int:
    """The process's resident bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far, user and system (a figure a loaded machine's scheduling
    does not stretch, as it does wall-clock time)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def store_client(cluster: Cluster, segment: int) -> Any:
    """A store client of this process joined to the master, lending it `segment` bytes (0:
    none), as vLLM's `create_mooncake_embedding_store_client` joins."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    ret = store.setup(
        cluster.client_host, cluster.metadata, segment, MIN_SEGMENT, "tcp", "", cluster.master
    )
    if ret != 0:
        raise RuntimeError(f"a store client could not join {cluster.master} (setup: {ret})")
    return store


def replicate_config(segment: str = "") -> Any:
    from mooncake.store import ObjectDataType, ReplicateConfig

    config = ReplicateConfig()  # as vLLM's store connector puts its values
    config.data_type = ObjectDataType.TENSOR
    if segment:
        config.preferred_segment = segment
    return config


def store_key(key: str) -> str:
    return f"{NAMESPACE}@id:{key}"  # vLLM's make_embedding_key


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ---- a remote hit ----------------------------------------------------------------------------


class VllmRead:
    """A read as vLLM 0.33's store client does one (`MooncakeEmbeddingStoreClient._load_chunk`):
    `batch_get_into` its registered read buffer, the header checked, the bytes copied out."""

    def __init__(self, store: Any, nbytes: int) -> None:
        import torch

        self.store = store
        self.buffer = torch.empty(HEADER.size + nbytes, dtype=torch.uint8)
        if store.register_buffer(self.buffer.data_ptr(), self.buffer.nbytes) != 0:
            raise RuntimeError("the store client refused the read buffer")

    def __call__(self, key: str, out: torch.Tensor) -> None:
        [result] = self.store.batch_get_into([key], [self.buffer.data_ptr()], [self.buffer.nbytes])
        if result != self.buffer.nbytes:
            raise RuntimeError(f"vLLM's read of {key!r} answered {result}")
        magic, _, tokens, hidden = HEADER.unpack(self.buffer[: HEADER.size].numpy().tobytes())
        if magic != MAGIC or tokens * hidden * out.element_size() != out.nbytes:
            raise RuntimeError(f"vLLM's read of {key!r} found another header")
        out.view(-1).view(self.buffer.dtype).copy_(self.buffer[HEADER.size :])

    def close(self) -> None:
        self.store.unregister_buffer(self.buffer.data_ptr())


def _drop_local_copy(client: Client, key: str) -> None:
    """Delete this node's copy of `key`, until the client's view no longer offers it."""
    client.flush()  # the last get's pin goes back first
    client.delete(POOL, [key])
    _wait_for_view(client, key, False)


def _wait_for_view(client: Client, key: str, present: bool) -> None:
    """Until the client's view offers `key` (present) or no longer does: a get with no wait_ms
    is answered by the view alone, which hears of a commit a moment after a remote hit's
    answer."""
    view, raw = client.view(POOL), key.encode()
    _wait(lambda: view.has(raw) is present, "the local copy to " + ("come" if present else "go"))


def bench_remote_hit(
    cluster: Cluster,
    near: Client,
    far: Client,
    floor: Callable[[int], float],
    runs: int,
    samples: int,
    report: Report,
) -> None:
    """Medians over runs of each run's median remote hit, local get and vLLM read of one 8 MiB
    entry, taken in turn sample by sample, and of each run's ratios of those medians; every
    read's bytes checked (untimed). `floor` (milliseconds a read of so many bytes takes the
    transport alone) is measured once a run, after its samples: the machine's load moves it as
    much as the hit."""
    import torch

    tensor = torch.randn(2048, HIDDEN, dtype=torch.bfloat16)
    size = tensor.numel() * tensor.element_size()
    for client in (near, far):
        client.open_pool(POOL, BLOCK, 4 * size + (16 << 20), cluster_namespace=NAMESPACE)
    key = "far-8m"
    Producer(near, POOL).put(key, tensor)
    near.flush()
    _wait(lambda: _published(near) >= 1, "the entry to be published")
    consumer, out = Consumer(far, POOL), torch.empty_like(tensor)
    consumer.get(key, "cpu", 5000, out)  # the first read from a node pays its handshake
    vllm = VllmRead(store_client(cluster, 0), size)
    try:
        vllm(store_key(key), out)  # and the bench's own client's
        [before] = far.stats(POOL).pools
        rows = []
        for _ in progress(range(runs), "cluster: remote hit"):
            local: list[float] = []
            remote: list[float] = []
            theirs: list[float] = []
            for _ in range(samples):
                _drop_local_copy(far, key)
                for samples_of, read in (
                    (remote, lambda: consumer.get(key, "cpu", 5000, out)),
                    (local, lambda: consumer.get(key, "cpu", 0, out)),
                    (theirs, lambda: vllm(store_key(key), out)),
                ):
                    if samples_of is local:  # untimed: the view hears of the remote hit's commit
                        _wait_for_view(far, key, True)
                    out.zero_()
                    samples_of.append(timed(read))
                    if not torch.equal(out, tensor):
                        raise RuntimeError("a read of the entry returned other bytes")
            rows.append(
                {
                    "local_ms": statistics.median(local) * 1e3,
                    "remote_ms": statistics.median(remote) * 1e3,
                    "vllm_ms": statistics.median(theirs) * 1e3,
                    "floor_ms": floor(size),
                }
            )
        [after] = far.stats(POOL).pools
    finally:
        vllm.close()
        vllm.store.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    hits = after.remote_hits - before.remote_hits
    report.add(
        "cluster_hit",
        {
            "size": format_size(size),
            **med,
            "fetch_ms": (after.remote_seconds_sum - before.remote_seconds_sum) / hits * 1e3,
            "remote_vs_local": statistics.median(r["remote_ms"] / r["local_ms"] for r in rows),
            "remote_vs_vllm": statistics.median(r["remote_ms"] / r["vllm_ms"] for r in rows),
            "remote_vs_floor": statistics.median(r["remote_ms"] / r["floor_ms"] for r in rows),
            "reads_per_hit": (after.remote_reads - before.remote_reads) / hits,
        },
    )


def _published(client: Client) -> int:
    stats = client.stats().cluster
    if stats is None:
        raise RuntimeError("the daemon has no store: it needs --store-master")
    return stats.published


# ---- simulated nodes -------------------------------------------------------------------------


class Nodes:
    """Store clients, each a simulated node: it lends the store a segment and publishes
    `entries` one-row entries of its own into it. They live in a child process of their own
    (`nodes_process`), killed at the end: closing a store client can hang (Mooncake 0.3.13 joins
    its handshake thread), and a hundred of them hold ~3 GB and ~2,000 threads."""

    def __init__(self, cluster: Cluster, entries: int) -> None:
        import numpy as np

        self.cluster = cluster
        self.entries = entries
        self.stores: list[Any] = []
        # One value repeated: what is measured is the directory, not the bytes.
        self.source = np.zeros(HEADER.size + BLOCK, dtype=np.uint8)
        self.source[: HEADER.size] = np.frombuffer(HEADER.pack(MAGIC, 12, 1, HIDDEN), np.uint8)
        self.segment = max(MIN_SEGMENT, 2 * entries * self.source.nbytes)

    def grow(self, count: int) -> None:
        """Start nodes until there are `count`, each publishing its entries."""
        address, nbytes = self.source.ctypes.data, self.source.nbytes
        while len(self.stores) < count:
            store = store_client(self.cluster, self.segment)
            self.stores.append(store)
            if store.register_buffer(address, nbytes) != 0:
                raise RuntimeError("a simulated node's store client refused its buffer")
            keys = node_keys(len(self.stores) - 1, self.entries)
            results = store.batch_put_from(
                keys,
                [address] * len(keys),
                [nbytes] * len(keys),
                replicate_config(store.get_hostname()),
            )
            if set(results) != {0}:
                raise RuntimeError(f"a simulated node's publish answered {set(results)}")

    def lookups(self, count: int, seconds: float) -> tuple[int, list[float]]:
        """The first `count` nodes ask for 64 keys of the first node's in a loop, each on a
        thread of its own, all starting together: calls answered in `seconds`, and each call's
        time."""
        stores, keys = self.stores[:count], node_keys(0, self.entries)[:LOOKUP_BATCH]
        start = threading.Barrier(count + 1)
        deadline = [0.0]
        counts = [0] * count
        calls: list[list[float]] = [[] for _ in stores]

        def ask(i: int) -> None:
            start.wait()
            while (now := time.perf_counter()) < deadline[0]:
                found = stores[i].batch_get_replica_desc(keys)
                calls[i].append(time.perf_counter() - now)
                if len(found) != len(keys):
                    raise RuntimeError(f"a lookup found {len(found)} of {len(keys)} keys")
                counts[i] += 1

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        deadline[0] = time.perf_counter() + seconds
        start.wait()
        for thread in threads:
            thread.join()
        return sum(counts), [t for c in calls for t in c]


def node_keys(node: int, entries: int) -> list[str]:
    return [store_key(f"node{node}-{i}") for i in range(entries)]


def _serve_nodes(cluster: Cluster, entries: int, pipe: Connection) -> None:
    """The child process's loop: ("grow", count) or ("lookups", count, seconds), answered in
    turn (an exception is answered as its text)."""
    nodes = Nodes(cluster, entries)
    while True:
        ask = pipe.recv()
        try:
            if ask[0] == "grow":
                nodes.grow(ask[1])
                answer: Any = None
            else:
                answer = nodes.lookups(*ask[1:])
        except Exception as exc:
            answer = RuntimeError(str(exc))
        pipe.send(answer)


class NodesProcess:
    """The parent's handle on the simulated nodes' process."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe

    def ask(self, *what: Any) -> Any:
        self.pipe.send(what)
        answer = self.pipe.recv()
        if isinstance(answer, Exception):
            raise answer
        return answer


@contextmanager
def nodes_process(cluster: Cluster, entries: int) -> Iterator[NodesProcess]:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_serve_nodes, args=(cluster, entries, there), daemon=True)
    process.start()
    try:
        yield NodesProcess(here)
    finally:
        process.kill()
        process.join()


def bench_directory(
    cluster: Cluster,
    far: Client,
    nodes: NodesProcess,
    entries: int,
    counts: list[int],
    report: Report,
) -> None:
    """For each count of simulated nodes: the reading daemon's resident memory and entries, and
    the master's, once the nodes published and the daemon read one entry of the last of them."""
    consumer = Consumer(far, POOL)
    master_before = rss(cluster.master_pid)
    for count in progress(counts, "cluster: directory"):
        nodes.ask("grow", count)
        key = f"node{count - 1}-0"
        if consumer.get(key, "cpu", 5000) is None:  # a remote hit: the directory is in use
            raise RuntimeError(f"a simulated node's entry {key!r} was not read")
        far.flush()
        [pool] = far.stats(POOL).pools
        stored = count * entries
        master = rss(cluster.master_pid)
        report.add(
            "cluster_directory",
            {
                "nodes": count,
                "entries_in_store": stored,
                "daemon_rss_mib": rss(cluster.far[1]) / (1 << 20),
                "daemon_entries": pool.entries_ready,
                "master_rss_mib": master / (1 << 20),
                "master_b_per_entry": (master - master_before) / stored,
            },
        )


# ---- lookups at the master -------------------------------------------------------------------


def bench_lookups(
    nodes: NodesProcess, counts: list[int], seconds: float, runs: int, report: Report
) -> None:
    """For each count of clients: lookups per second the master answers, each client on a
    thread of its own asking for 64 keys a call (all present), for `seconds`; medians of runs."""
    nodes.ask("grow", max(counts))
    for count in progress(counts, "cluster: lookups"):
        rates, latencies = [], []
        for _ in range(runs):
            done, calls = nodes.ask("lookups", count, seconds)
            rates.append(done * LOOKUP_BATCH / seconds)
            latencies.append(statistics.median(calls))
        report.add(
            "cluster_lookups",
            {
                "clients": count,
                "batch": LOOKUP_BATCH,
                "lookups_per_s": statistics.median(rates),
                "call_p50_us": statistics.median(latencies) * 1e6,
            },
        )


# ---- the directory comes back ----------------------------------------------------------------

REPUBLISH_POOL = "ecd-bench-republish"
REPUBLISH_HIDDEN = 128  # entries of one row of 128 bfloat16: 256 bytes, one block each
REPUBLISH_BATCH = 256  # entries a put_many
# Entries a republish offers the store a batch (ec_daemon.cluster.node.REPUBLISH_BATCH): a pool's
# walk is over after ceil(entries / this) batches, whatever the store took or refused (a store
# the earlier suites filled may refuse some, counted at no publish: the pool was not shared when
# they were committed).
WALK_BATCH = 512
REPUBLISH_POOL_ENTRIES = 50_000  # entries a pool (a daemon's pools hold 65,536 by default at most)
REPUBLISH_CHECKED = 256  # entries read back from the other daemon, bit for bit


def master_calls(url: str) -> dict[str, int]:
    """The calls the master answered since it started, by kind (its `master_*_requests_total`
    counters), those it answered at least once."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    calls: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("master_") and name.endswith("_requests_total") and float(value):
            calls[name.removeprefix("master_").removesuffix("_requests_total")] = int(float(value))
    return calls


def _node_stats(client: Client) -> ClusterStats:
    stats = client.stats().cluster
    if stats is None:
        raise RuntimeError("the daemon has no store: it needs --store-master")
    return stats


def _republished(client: Client) -> int:
    return _node_stats(client).republished


def _batches(client: Client) -> int:
    return _node_stats(client).republish_batches


def bench_republish(
    cluster: Cluster,
    restart_master: Callable[[], None],
    near: Client,
    far: Client,
    entries: int,
    report: Report,
) -> None:
    """`entries` entries of one small row in pools of `near` (REPUBLISH_POOL_ENTRIES a pool),
    written before the pools were shared, then shared: the node walks them and publishes them
    all; then the master killed and started again with an empty directory: seconds from its
    start until `near` published the first of them again (the loss seen) and all of them, the
    CPU time `near` spent meanwhile, the calls the master answered in that time, and a sample of
    them read on `far` (remote hits, bit-identical)."""
    import torch

    data = torch.randn(entries, 1, REPUBLISH_HIDDEN, dtype=torch.bfloat16)
    block = REPUBLISH_HIDDEN * data.element_size()
    keys = [f"republish-{i}" for i in range(entries)]
    pools = [f"{REPUBLISH_POOL}-{n}" for n in range(-(-entries // REPUBLISH_POOL_ENTRIES))]
    with pool_dropped(near, far, pools=pools):
        for n, pool in enumerate(pools):
            held = range(n * REPUBLISH_POOL_ENTRIES, min((n + 1) * REPUBLISH_POOL_ENTRIES, entries))
            # Not shared yet: a commit of a shared pool is published one by one, and its
            # Allocate claims the key in the store first.
            near.open_pool(pool, block, len(held) * block, max_entries=len(held))
            producer = Producer(near, pool)
            for first in progress(held[::REPUBLISH_BATCH], f"cluster: republish ({pool})"):
                batch = range(first, min(first + REPUBLISH_BATCH, held.stop))
                producer.put_many({keys[i]: data[i] for i in batch})
            producer.flush()
        before = _batches(near)
        walked = before + sum(
            -(-min(REPUBLISH_POOL_ENTRIES, entries - n * REPUBLISH_POOL_ENTRIES) // WALK_BATCH)
            for n in range(len(pools))
        )
        for pool in pools:
            near.open_pool(pool, cluster_namespace=NAMESPACE)  # walked, and published
        _wait(lambda: _batches(near) >= walked, "every pool to be walked", 120)

        republished, cpu = _republished(near), cpu_seconds(cluster.near[1])
        restart_master()
        started = time.perf_counter()
        seen = 0.0
        while (done := _republished(near) - republished) < entries:
            if done and not seen:
                seen = time.perf_counter() - started
            if time.perf_counter() - started > 120:
                raise RuntimeError(f"{done} of {entries} entries republished after 120 s")
            time.sleep(0.1)  # a Stats call each: the daemon it asks is the one measured
        took = time.perf_counter() - started
        cpu = cpu_seconds(cluster.near[1]) - cpu
        calls = master_calls(cluster.master_metrics)
        far.open_pool(pools[0], block, REPUBLISH_CHECKED * block, cluster_namespace=NAMESPACE)
        consumer = Consumer(far, pools[0])
        # The other daemon's first store call since the restart may still go to the old
        # master's connection (an empty answer) as its store client reconnects.
        _wait(lambda: consumer.get(keys[0], "cpu", 1000) is not None, "a read on the other node")
        sample = range(0, entries, -(-entries // REPUBLISH_CHECKED))  # at most that many
        for i in sample:
            got = consumer.get(keys[i], "cpu", 5000)
            if got is None or not torch.equal(got, data[i]):
                raise RuntimeError(f"entry {keys[i]!r} was not read back after the republish")
    report.add(
        "cluster_republish",
        {
            "entries": entries,
            "seen_s": seen or took,
            "republished_s": took,
            "entries_per_s": entries / max(took - seen, 1e-3),
            "daemon_cpu_s": cpu,
            "master_calls": sum(calls.values()),
            "exist_calls": calls.get("batch_exist_key", 0),
            "put_start_calls": calls.get("put_start", 0) + calls.get("batch_put_start", 0),
            "read_back": len(sample),
        },
    )


# ---- the suite -------------------------------------------------------------------------------


def run_cluster(
    cluster: Cluster,
    restart_master: Callable[[], None],
    floor: Callable[[int], float],
    args: Any,
    report: Report,
) -> None:
    """The cluster suite against `cluster`, whose master `restart_master` kills and starts
    again with an empty directory, and whose link's transport alone reads so many bytes in
    `floor` milliseconds."""
    with (
        Client(cluster.near[0], name="ecd-bench", role=Role.BOTH) as near,
        Client(cluster.far[0], name="ecd-bench-far", role=Role.BOTH) as far,
        pool_dropped(near, far),
    ):
        bench_remote_hit(cluster, near, far, floor, args.runs, args.cluster_samples, report)
        with nodes_process(cluster, args.cluster_entries) as nodes:
            bench_directory(cluster, far, nodes, args.cluster_entries, args.cluster_nodes, report)
            bench_lookups(nodes, args.cluster_clients, args.cluster_seconds, args.runs, report)
        bench_republish(cluster, restart_master, near, far, args.republish_entries, report)
