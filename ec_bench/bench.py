"""`ecd bench`: a load generator against a running daemon, or one it spawns (--spawn).

Machines running this are noisy, so every figure is a median over several runs, and speeds are
reported as ratios to a baseline measured side by side in the same run:
- latency: a put, a get and a miss of one 256 KiB entry, as multiples of a health-check round
  trip measured in the same run (docs/design.md §12: a put or a get waits on one round trip, a
  miss on none);
- control: RPC round trips of 64-item batches against a plain health-check RPC on the channel;
- data: put/get bandwidth against a raw torch copy_ of the same bytes into the same pool mapping;
  the gets read entries already READY whose slots the client's view knows, as a consumer reads
  cached entries (a get right after its own put waits for the commit first: the handoff figure);
- load: puts and gets per second with 1 and several client processes;
- handoff: from a producer's commit to a waiting consumer's wake-up, across processes; and from
  its Allocate to the other process's view hearing the entry PENDING (the single-flight window);
- restart: a warm restart (docs/design.md §8): a pool filled with 10,000 or 100,000 one-block
  entries, the daemon SIGKILLed and started again on the same shm directory, timed until it is
  SERVING and an old key is a hit, against a start with nothing to adopt; and a put's cost per
  item at the start and the end of the fill. It kills its daemon, so it needs --spawn.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from ec_client import AllocateItem, Client, EcdError, Role, StepResult
from ec_client.control import _connection
from ec_protocol.types import AllocateResult, Extent, Key, Status
from ec_protocol.units import format_size

if TYPE_CHECKING:
    import torch

    from ec_client.data.consumer import Consumer
    from ec_client.data.mover import TensorMover
    from ec_client.data.producer import Producer

T = TypeVar("T")
POOL = "ecd-bench"
BLOCK = 4096


# ---- measuring ---------------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timed(fn: Callable[..., object], *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def progress(items: Sequence[T], label: str) -> Iterator[T]:
    """Yield items while drawing a progress bar on stderr, if it is a terminal: into a pipe or a
    log, every state of the bar would be a line of noise."""
    if not sys.stderr.isatty():
        yield from items
        return
    width = 30
    for i, item in enumerate(items):
        done = int(width * i / max(len(items), 1))
        sys.stderr.write(f"\r{label:<28} [{'#' * done}{'.' * (width - done)}] {i}/{len(items)}")
        sys.stderr.flush()
        yield item
    sys.stderr.write(f"\r{label:<28} [{'#' * width}] {len(items)}/{len(items)}\n")


def table(title: str, headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


@dataclass
class Report:
    """Every figure of a run, printed as tables and optionally saved as JSON."""

    sections: dict[str, list[dict[str, Any]]]

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.sections.setdefault(section, []).append(row)


# ---- control plane ----------------------------------------------------------------------------


def _allocate_commit(client: Client, items: list[AllocateItem], keys: list[str]) -> None:
    client.allocate(POOL, items)
    client.commit(POOL, keys)


def _acquire_release(client: Client, keys: list[str]) -> None:
    client.release([r.lease_id for r in client.acquire(POOL, keys)])


def bench_control(client: Client, runs: int, iterations: int, report: Report) -> None:
    """Round trips of 64-item Allocate+Commit and Acquire+Release against a health check."""
    client.open_pool(POOL, BLOCK, 8192 * BLOCK)
    per_run: list[dict[str, float]] = []
    for run in progress(range(runs), "control plane"):
        health = [timed(client.health) for _ in range(iterations)]
        write, read = [], []
        for i in range(iterations):
            keys = [f"c{run}-{i}-{j}" for j in range(64)]
            items = [AllocateItem(k, (BLOCK,), "uint8") for k in keys]
            write.append(timed(_allocate_commit, client, items, keys))
            read.append(timed(_acquire_release, client, keys))
            client.evict(POOL, keys)
        per_run.append(
            {
                "health_p50": percentile(health, 50),
                "health_p99": percentile(health, 99),
                "write_p50": percentile(write, 50),
                "write_p99": percentile(write, 99),
                "read_p50": percentile(read, 50),
                "read_p99": percentile(read, 99),
                "write_items_s": 64 * len(write) / sum(write),
                "read_items_s": 64 * len(read) / sum(read),
            }
        )
    med = {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
    for name in ("write", "read"):
        report.add(
            "control",
            {
                "op": "Allocate+Commit x64" if name == "write" else "Acquire+Release x64",
                "p50_us": med[f"{name}_p50"] * 1e6,
                "p99_us": med[f"{name}_p99"] * 1e6,
                "p50_vs_health": med[f"{name}_p50"] / med["health_p50"],
                "p99_vs_health": med[f"{name}_p99"] / med["health_p99"],
                "items_per_s": med[f"{name}_items_s"],
            },
        )
    report.add(
        "control",
        {
            "op": "Health.Check",
            "p50_us": med["health_p50"] * 1e6,
            "p99_us": med["health_p99"] * 1e6,
            "p50_vs_health": 1.0,
            "p99_vs_health": 1.0,
            "items_per_s": 1 / med["health_p50"],
        },
    )


# ---- per-item costs ------------------------------------------------------------------------------


def client_costs(items: int, rounds: int) -> dict[str, float]:
    """Microseconds per item the client spends on a Step carrying one batch of Allocate, Commit,
    Acquire or Release: building the request, serializing it, parsing the daemon's reply (made
    up here, as the daemon packs it). Medians over rounds."""
    from ec_client.control import _wire
    from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb

    keys = [f"img-{i:04d}-0123456789abcdef" for i in range(items)]
    rows, width = 256, 3584
    spec = pb.TensorSpec(shape=[rows, width], dtype="bfloat16", nbytes=rows * width * 2)
    replies = {
        "Allocate": pb.StepReply(
            allocates=[
                pb.AllocateResult(key=k.encode(), status=pb.ITEM_ALLOCATED, runs=[i * rows, rows])
                for i, k in enumerate(keys)
            ]
        ),
        "Commit": pb.StepReply(
            commits=[pb.ItemResult(key=k.encode(), status=pb.ITEM_OK) for k in keys]
        ),
        "Acquire": pb.StepReply(
            acquires=[
                pb.AcquireResult(
                    key=k.encode(), status=pb.ITEM_HIT, lease_id=i + 1, runs=[i * rows, rows]
                )
                for i, k in enumerate(keys)
            ]
        ),
        "Release": pb.StepReply(
            releases=[pb.LeaseResult(lease_id=i + 1, status=pb.ITEM_OK) for i in range(items)]
        ),
    }
    for result in replies["Acquire"].acquires:
        result.tensor.CopyFrom(spec)
    serialized = {name: reply.SerializeToString() for name, reply in replies.items()}
    calls: dict[str, Callable[[], _wire.Call[StepResult]]] = {
        "Allocate": lambda: _wire.step(
            "pool", allocates=[AllocateItem(k, (rows, width), "bfloat16") for k in keys]
        ),
        "Commit": lambda: _wire.step("pool", commits=_wire.commit_items(keys, None)),
        "Acquire": lambda: _wire.step("pool", acquires=keys),
        "Release": lambda: _wire.step("pool", releases=range(1, items + 1)),
    }
    costs = {}
    for name, make in calls.items():
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            call = make()
            call.build("session").SerializeToString()
            call.parse(pb.StepReply.FromString(serialized[name]))
            samples.append((time.perf_counter() - started) / items)
        costs[name] = statistics.median(samples) * 1e6
    return costs


def bench_costs(daemon: dict[str, float], items: int, rounds: int, report: Report) -> None:
    """The daemon's and the client's microseconds per item, side by side (`daemon`: measured
    in process by ec_daemon.tools.costs)."""
    client = client_costs(items, rounds)
    for name, micros in client.items():
        report.add(
            "costs",
            {"op": f"{name} x{items}", "daemon_us_item": daemon[name], "client_us_item": micros},
        )


# ---- latency of one put, get, miss ---------------------------------------------------------------


def bench_latency(client: Client, runs: int, iterations: int, size: int, report: Report) -> None:
    """p50 and p99 of put, get and miss of one entry, each over a health check's, per run."""
    import torch

    from ec_client import Consumer, Producer

    client.open_pool(POOL, BLOCK, max(size, BLOCK) * (iterations + 8) + (16 << 20))
    producer, consumer = Producer(client, POOL), Consumer(client, POOL)
    client.view(POOL).wait_synced(10)
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
    out = torch.empty_like(tensor)
    per_run: list[dict[str, float]] = []
    for run in progress(range(runs), "latency"):
        keys = [f"l{run}-{i}" for i in range(iterations)]
        health = [timed(client.health) for _ in range(iterations)]
        put = [timed(producer.put, key, tensor) for key in keys]
        producer.flush()
        get = [timed(consumer.get, key, "cpu", 0, out) for key in keys]
        miss = [timed(consumer.get, f"absent-{key}") for key in keys]
        client.flush()
        client.evict(POOL, keys)
        row = {}
        for name, samples in (("health", health), ("put", put), ("get", get), ("miss", miss)):
            row[f"{name}_p50"] = percentile(samples, 50)
            row[f"{name}_p99"] = percentile(samples, 99)
        per_run.append(row)
    med = {k: statistics.median(r[k] for r in per_run) for k in per_run[0]}
    for name in ("put", "get", "miss", "health"):
        report.add(
            "latency",
            {
                "op": f"{name} {format_size(size)}" if name != "health" else "Health.Check",
                "p50_us": med[f"{name}_p50"] * 1e6,
                "p99_us": med[f"{name}_p99"] * 1e6,
                "p50_vs_health": med[f"{name}_p50"] / med["health_p50"],
                "p99_vs_health": med[f"{name}_p99"] / med["health_p99"],
            },
        )


# ---- data path ---------------------------------------------------------------------------------


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"still waiting for {what} after {timeout_s} s")
        time.sleep(0.0005)


def _save_and_wait(mover: TensorMover, tensor: torch.Tensor, extents: Sequence[Extent]) -> None:
    mover.save(tensor, extents).wait()


def _get_into(consumer: Consumer, outs: dict[Key, torch.Tensor]) -> None:
    consumer.get_many_async(list(outs), out=outs).wait()


def _cached(client: Client, producer: Producer, keys: Sequence[str]) -> None:
    """Wait until `keys`, just put, are READY and the client's view knows their slots: a get
    of them is then a cached read (a lock pin, no round trip), not a wait for our own commit."""
    producer.flush()
    view = client.view(POOL)
    _wait(lambda: view.slots_known(keys), "their slots")


def _regions(size: int, batch: int) -> int:
    """How many distinct destinations the raw copies of `size` bytes go to."""
    return max(2 * batch, min(256, (256 << 20) // size))


def _all_allocated(
    client: Client, keys: Sequence[str], results: Sequence[AllocateResult], asked: str
) -> None:
    """RESOURCE_EXHAUSTED, saying what `asked` for, unless every key was ALLOCATED (they are
    aborted then)."""
    short = [r for r in results if r.status is not Status.ALLOCATED]
    if short:
        client.abort(POOL, keys)
        raise EcdError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the bench's pool gave {len(results) - len(short)} of the {len(keys)} scratch "
            f"regions {asked} needs ({short[0].key!r}: {short[0].status.value}: "
            f"{short[0].message or 'no room'}): ask for fewer",
        )


def bench_data(client: Client, sizes: Sequence[int], runs: int, batch: int, report: Report) -> None:
    """Put/get bandwidth, single and batched, as ratios to a raw copy_ into the same mapping.

    Every copy, raw or not, goes to a region not touched just before, so no figure is flattered
    by a cache that holds the destination (256 KiB fits in L2).
    """
    import torch

    from ec_client import Consumer, Producer
    from ec_client.data.mapping import PoolMapping
    from ec_client.data.mover import TensorMover

    # Room for the scratch regions of a run, or for its puts (2 * batch entries), whichever is
    # more, and for what eviction has not yet taken back.
    capacity = max(max(_regions(size, batch), 2 * batch + 4) * size for size in sizes) + (64 << 20)
    info = client.open_pool(POOL, BLOCK, capacity)
    producer, consumer = Producer(client, POOL), Consumer(client, POOL)
    mapping = PoolMapping.open(info)
    mover = TensorMover(mapping)
    for size in sizes:
        regions = _regions(size, batch)
        source = torch.randint(0, 256, (size,), dtype=torch.uint8)
        sources = {f"b{i}": source.clone() for i in range(batch)}
        outs = [torch.zeros_like(source) for _ in range(batch)]  # zeros: pages touched now
        rows: list[dict[str, float]] = []
        for run in progress(range(runs), f"data {format_size(size)}"):
            scratch_keys = [f"raw-{run}-{i}" for i in range(regions)]
            scratch = client.allocate(
                POOL, [AllocateItem(k, (size,), "uint8") for k in scratch_keys]
            )
            _all_allocated(client, scratch_keys, scratch, f"--batch {batch}")
            views = [mapping.region(r.extents[0])[:size] for r in scratch]
            raw_in = statistics.median(timed(v.copy_, source) for v in views)
            # Out of the pool, raw or not, into the batch's destinations in turn (get_many fills
            # them all): one destination every time would stay in the CPU's cache at sizes a
            # batch of them does not fit, and flatter the raw copy.
            raw_out = statistics.median(
                timed(outs[i % batch].copy_, v) for i, v in enumerate(views)
            )
            copy_in = statistics.median(
                timed(_save_and_wait, mover, source, r.extents) for r in scratch
            )
            client.abort(POOL, scratch_keys)
            singles = [f"one-{run}-{i}" for i in range(batch)]
            put = statistics.median(timed(producer.put, k, source) for k in singles)
            _cached(client, producer, singles)
            get = statistics.median(
                timed(consumer.get, k, "cpu", 0, outs[i]) for i, k in enumerate(singles)
            )
            keys = [f"many-{run}-{i}" for i in range(batch)]
            put_many = timed(producer.put_many, dict(zip(keys, sources.values(), strict=True)))
            targets: dict[Key, torch.Tensor] = dict(zip(keys, outs, strict=True))
            _cached(client, producer, keys)
            get_many = timed(_get_into, consumer, targets)
            producer.flush()  # commits go in the background: let them land before evicting
            client.flush()
            client.evict(POOL, [*singles, *keys])
            rows.append(
                {
                    "copy_phase": raw_in / copy_in,
                    "put": raw_in / put,
                    "get": raw_out / get,
                    "put_many": batch * raw_in / put_many,
                    "get_many": batch * raw_out / get_many,
                    "raw_gbs": size / raw_in / 1e9,
                    "put_gbs": size / put / 1e9,
                    "rpc_share_put": max(0.0, 1 - copy_in / put),
                }
            )
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        report.add("data", {"size": format_size(size), **med})


# ---- several processes ---------------------------------------------------------------------------


def _load_worker(address: str, worker: int, size: int, seconds: float, queue: Any) -> None:
    import torch

    from ec_client import Consumer, Producer

    with Client(address, name=f"bench-{worker}") as client:
        client.open_pool(POOL, BLOCK, 1 << 30)
        producer, consumer = Producer(client, POOL), Consumer(client, POOL)
        tensor = torch.ones(size, dtype=torch.uint8)
        out = torch.empty_like(tensor)
        puts = gets = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            key = f"w{worker}-{puts}"
            producer.put(key, tensor)
            puts += 1
            consumer.get(key, out=out)
            gets += 1
            if puts % 64 == 0:
                client.evict(POOL, [f"w{worker}-{i}" for i in range(puts - 64, puts)])
        queue.put((puts, gets))


def bench_load(
    address: str,
    client: Client,
    processes: Sequence[int],
    size: int,
    seconds: float,
    report: Report,
) -> None:
    client.open_pool(POOL, BLOCK, 1 << 30)
    context = multiprocessing.get_context("spawn")
    for count in progress(processes, "client processes"):
        queue = context.Queue()
        workers = [
            context.Process(target=_load_worker, args=(address, w, size, seconds, queue))
            for w in range(count)
        ]
        for w in workers:
            w.start()
        totals = [queue.get(timeout=seconds + 120) for _ in workers]
        for w in workers:
            w.join()
        report.add(
            "load",
            {
                "processes": count,
                "size": format_size(size),
                "puts_per_s": sum(p for p, _ in totals) / seconds,
                "gets_per_s": sum(g for _, g in totals) / seconds,
            },
        )


def _handoff_consumer(address: str, count: int, keys: Any, wakes: Any, heard: Any) -> None:
    """Wait on each key the producer announces; report when each wait returned. Meanwhile the
    process's view of the pool (a thread of its own, as in a vLLM engine) notes when it first
    has each key PENDING: all of them, in order, at the end."""
    with Client(address, name="bench-consumer") as client:
        client.open_pool(POOL, BLOCK, 64 * BLOCK)
        view = client.view(POOL)
        view.wait_synced(10)
        heard_at: list[float] = []

        def follow() -> None:
            for i in range(count):
                key = f"h{i}".encode()
                while True:
                    since = view.changes  # read before the look: an event after it wakes us
                    if view.pending(key) or view.has(key):
                        break
                    view.wait_change(since, 1.0)
                heard_at.append(time.monotonic())

        follower = threading.Thread(target=follow)
        follower.start()
        keys.put("synced")
        while (key := keys.get()) is not None:
            [result] = client.acquire(POOL, [key], wait_ms=10_000)
            wakes.put((time.monotonic(), result.status.value))
            client.release([result.lease_id])
        follower.join()
        heard.put(heard_at)


def bench_handoff(address: str, client: Client, count: int, report: Report) -> None:
    """Commit in this process, wake in another: CLOCK_MONOTONIC is shared by processes. And the
    single-flight window (docs/vllm.md, *Several engines, one image*): from an Allocate's answer
    here to the other process's view having the entry PENDING (may be below zero: the event can
    come before the answer is read)."""
    client.open_pool(POOL, BLOCK, 64 * BLOCK)
    context = multiprocessing.get_context("spawn")
    keys, wakes, heard = context.Queue(), context.Queue(), context.Queue()
    consumer = context.Process(target=_handoff_consumer, args=(address, count, keys, wakes, heard))
    consumer.start()
    if keys.get(timeout=60) != "synced":
        raise RuntimeError("handoff consumer did not follow the pool")
    latencies, allocated = [], []
    for i in progress(range(count), "handoff"):
        key = f"h{i}"
        client.allocate(POOL, [AllocateItem(key, (BLOCK,), "uint8")])
        allocated.append(time.monotonic())
        keys.put(key)
        time.sleep(0.02)  # the consumer is inside Acquire, waiting on the PENDING key, by now
        committed = time.monotonic()
        client.commit(POOL, [key])
        woke, status = wakes.get(timeout=60)
        if status != "hit":
            raise RuntimeError(f"handoff consumer got {status} for {key}")
        latencies.append(woke - committed)
        client.evict(POOL, [key])
    keys.put(None)
    pending_heard = [h - a for h, a in zip(heard.get(timeout=60), allocated, strict=True)]
    consumer.join()
    report.add(
        "handoff",
        {
            "samples": count,
            "p50_us": percentile(latencies, 50) * 1e6,
            "p99_us": percentile(latencies, 99) * 1e6,
            "pending_heard_p50_us": percentile(pending_heard, 50) * 1e6,
            "pending_heard_p99_us": percentile(pending_heard, 99) * 1e6,
            "pending_heard_max_us": max(pending_heard) * 1e6,
        },
    )


# ---- a warm restart ----------------------------------------------------------------------------

RESTART_BLOCK = 8 << 10
RESTART_ENTRY = 7 << 10  # one block
RESTART_BATCH = 256  # items per put_many while filling
RESTART_WINDOW = 10  # batches whose per-item cost is the fill's start, and its end


class Restartable(Protocol):
    """A daemon process that can be SIGKILLed and started again on the same socket and shm
    directory (ec_daemon.tools.spawn.SpawnedDaemon)."""

    @property
    def address(self) -> str: ...

    def start(self) -> None: ...

    def wait_serving(self, timeout_s: float) -> None: ...

    def exited(self) -> str | None: ...

    def kill(self) -> None: ...


Spawner = Callable[[Sequence[str]], AbstractContextManager[Restartable]]


def restart_flags(entries: int) -> list[str]:
    """`ecd serve` flags for a daemon whose pool holds `entries` one-block entries: a budget of
    that pool and a slot for each entry (the default slot table holds one per 32 KiB)."""
    return [
        "--max-bytes", str(entries * RESTART_BLOCK),
        "--entries-per-pool", str(entries),
        "--log-level", "warning",
    ]  # fmt: skip


def _serving_again(
    daemon: Restartable, key: str | None, timeout_s: float = 300.0
) -> tuple[float, float]:
    """Start the daemon: seconds from its process's start to health SERVING (polled every
    5 ms), and to an Acquire of `key`, an entry of a previous process, answering HIT through a
    new client (0.0 without a key)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.initial_reconnect_backoff_ms", 5), ("grpc.max_reconnect_backoff_ms", 20)]
    started = time.perf_counter()
    daemon.start()
    with grpc.insecure_channel(daemon.address, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if (problem := daemon.exited()) is not None:
                raise RuntimeError(problem)
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"the daemon is not SERVING after {timeout_s} s")
            with contextlib.suppress(grpc.RpcError):
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            time.sleep(0.005)
    serving = time.perf_counter() - started
    if key is None:
        return serving, 0.0
    # A new channel, as a client that connects now has: the process's shared one may still be
    # backing off from the daemon that was killed, which is the client's delay, not the daemon's.
    _connection.forget_shared_channel(daemon.address)
    with Client(daemon.address, name="ecd-bench-restart", keepalive=False) as client:
        client.open_pool(POOL)
        [result] = client.acquire(POOL, [key])
        if result.status.value != "hit":
            raise RuntimeError(f"after the restart, {key!r} is {result.status.value}, not a hit")
        served = time.perf_counter() - started
        client.release([result.lease_id])
    return serving, served


def _fill(address: str, entries: int, tensor: torch.Tensor) -> list[float]:
    """Put `entries` one-block entries in batches; the microseconds per item of each whole
    batch, in order."""
    from ec_client import Producer, PutStatus

    costs = []
    with Client(address, name="ecd-bench-fill") as client:
        client.open_pool(POOL, RESTART_BLOCK, entries * RESTART_BLOCK)
        producer = Producer(client, POOL)
        for first in progress(range(0, entries, RESTART_BATCH), f"fill {entries}"):
            batch: dict[Key, torch.Tensor] = {
                f"r{i}": tensor for i in range(first, min(entries, first + RESTART_BATCH))
            }
            started = time.perf_counter()
            statuses = producer.put_many(batch)
            if len(batch) == RESTART_BATCH:
                costs.append((time.perf_counter() - started) / RESTART_BATCH * 1e6)
            if set(statuses.values()) != {PutStatus.COMMITTING}:
                raise RuntimeError(f"filling the pool: {set(statuses.values())}")
        producer.flush()
        [pool] = client.stats(POOL).pools
        if pool.entries_ready != entries:
            raise RuntimeError(f"filled {pool.entries_ready} entries, not {entries}")
    return costs


def _check_restored(address: str, entries: int, key: str, tensor: torch.Tensor) -> None:
    from ec_client import Consumer

    with Client(address, name="ecd-bench-check") as client:
        client.open_pool(POOL)
        [pool] = client.stats(POOL).pools
        if pool.entries_ready != entries:
            raise RuntimeError(f"{pool.entries_ready} entries after the restart, not {entries}")
        got = Consumer(client, POOL).get(key)
        if got is None or not bool((got == tensor).all()):
            raise RuntimeError(f"after the restart, {key!r} holds other bytes")


def bench_restart(spawn: Spawner, counts: Sequence[int], runs: int, report: Report) -> None:
    """For each count: a daemon started `runs` times with nothing to adopt, then its pool
    filled with that many one-block 7 KiB entries (256 per put_many, the per-item cost of the
    first and last batches kept), then `runs` times SIGKILLed and started again on the same
    shm directory and socket, timed until it is SERVING and until a new client's Acquire of an
    old key is a hit; medians. Every entry is checked READY after each restart, one read back."""
    import torch

    tensor = torch.randint(0, 256, (RESTART_ENTRY,), dtype=torch.uint8)
    for entries in counts:
        with spawn(restart_flags(entries)) as daemon:
            daemon.start()  # not measured: a first start may compile the daemon's bytecode
            daemon.wait_serving(120.0)
            daemon.kill()
            empty = []
            for _ in progress(range(runs), f"start, empty ({entries})"):
                empty.append(_serving_again(daemon, None)[0])
                daemon.kill()
            daemon.start()
            daemon.wait_serving(15.0)
            costs = _fill(daemon.address, entries, tensor)
            serving, served = [], []
            for run in progress(range(runs), f"restart, {entries} entries"):
                daemon.kill()
                key = f"r{run * entries // runs}"
                seconds = _serving_again(daemon, key)
                serving.append(seconds[0])
                served.append(seconds[1])
                _check_restored(daemon.address, entries, key, tensor)
        report.add(
            "restart",
            {
                "entries": entries,
                "put_us_item_first": statistics.median(costs[:RESTART_WINDOW]),
                "put_us_item_last": statistics.median(costs[-RESTART_WINDOW:]),
                "empty_start_s": statistics.median(empty),
                "serving_s": statistics.median(serving),
                "serving_max_s": max(serving),
                "hit_s": statistics.median(served),
            },
        )


# ---- the command ---------------------------------------------------------------------------------


SECTIONS = {
    "costs": (
        "Per item, in process: the daemon's handlers and the client's build + parse (medians)",
        ["op", "daemon_us_item", "client_us_item"],
    ),
    "latency": (
        "One entry at a time: put, get and a miss, against a health check (medians of runs)",
        ["op", "p50_us", "p99_us", "p50_vs_health", "p99_vs_health"],
    ),
    "control": (
        "Control plane, 64-item batches (medians of runs)",
        ["op", "p50_us", "p99_us", "p50_vs_health", "p99_vs_health", "items_per_s"],
    ),
    "data": (
        "Data path, bandwidth as a ratio to raw copy_ into the same mapping (medians)",
        [
            "size",
            "copy_phase",
            "put",
            "get",
            "put_many",
            "get_many",
            "raw_gbs",
            "put_gbs",
            "rpc_share_put",
        ],
    ),
    "load": (
        "Concurrent client processes, put+get loop",
        ["processes", "size", "puts_per_s", "gets_per_s"],
    ),
    "handoff": (
        "Handoff: producer commit -> waiting consumer wakes (other process); producer's Allocate "
        "answered -> the other process's view has it PENDING (the single-flight window)",
        [
            "samples",
            "p50_us",
            "p99_us",
            "pending_heard_p50_us",
            "pending_heard_p99_us",
            "pending_heard_max_us",
        ],
    ),
    "restart": (
        "Warm restart: SIGKILL, start again on the same shm directory; seconds from the process's "
        "start to SERVING and to an old key's hit (medians), against a start with nothing to "
        "adopt; a put's microseconds per item in the first and last 256-item batches of the fill",
        [
            "entries",
            "put_us_item_first",
            "put_us_item_last",
            "empty_start_s",
            "serving_s",
            "serving_max_s",
            "hit_s",
        ],
    ),
    "cluster_hit": (
        "Cluster: a remote hit (an entry only another daemon put: one lookup at the master, one "
        "read into a local entry, the copy out) vs a local get of it and vLLM's store client "
        "reading it, and the floor: the transfer engine's own read of as many bytes on the same "
        "link (transfer_engine_bench, once a run) (medians of runs; fetch_ms: the daemon's mean "
        "lookup + read)",
        [
            "size",
            "local_ms",
            "remote_ms",
            "vllm_ms",
            "floor_ms",
            "fetch_ms",
            "remote_vs_local",
            "remote_vs_vllm",
            "remote_vs_floor",
            "reads_per_hit",
        ],
    ),
    "cluster_directory": (
        "Cluster: simulated nodes publishing entries of their own; the reading daemon's "
        "resident memory and entries, and the master's",
        [
            "nodes",
            "entries_in_store",
            "daemon_rss_mib",
            "daemon_entries",
            "master_rss_mib",
            "master_b_per_entry",
        ],
    ),
    "cluster_lookups": (
        "Cluster: batched lookups one master answers (store clients on threads; medians)",
        ["clients", "batch", "lookups_per_s", "call_p50_us"],
    ),
    "cluster_republish": (
        "Cluster: the master killed and started again empty; seconds from its start until the "
        "daemon published again the first and the last of its entries, its rate in between, "
        "the CPU time it spent, and the calls the master answered meanwhile (a sample read back "
        "on the other daemon)",
        [
            "entries",
            "seen_s",
            "republished_s",
            "entries_per_s",
            "daemon_cpu_s",
            "master_calls",
            "exist_calls",
            "put_start_calls",
            "read_back",
        ],
    ),
}


def render(report: Report) -> str:
    parts = []
    for name, (title, columns) in SECTIONS.items():
        rows = report.sections.get(name)
        if rows:
            parts.append(table(title, columns, ([row[c] for c in columns] for row in rows)))
    return "\n\n".join(parts)


@contextlib.contextmanager
def pool_dropped(*clients: Client, pools: Sequence[str] = (POOL,)) -> Iterator[None]:
    """Drop the bench's pools when the suites end, finished or failed: the daemon is left as the
    bench found it (a pool left behind would hold budget, and refuse the next run's geometry)."""
    try:
        yield
    finally:
        for client in clients:
            for pool in pools:
                try:
                    client.drop_pool(pool, force=True)
                except EcdError as exc:
                    # NOT_FOUND: no suite made it; pool_dropped: a client before this one did
                    if exc.code != grpc.StatusCode.NOT_FOUND and exc.reason != "pool_dropped":
                        raise


def run(address: str, args: Any, report: Report) -> None:
    """The suites that need one daemon, added to `report`."""
    if args.suite & {"latency", "control", "data", "load", "handoff", "all"}:
        with Client(address, name="ecd-bench", role=Role.BOTH) as client:
            _daemon_suites(address, client, args.suite, args, report)


def finish(report: Report, output: str | None) -> None:
    """Print every figure of the run, and write them as JSON to `output` if given."""
    print(render(report))
    if output:
        Path(output).write_text(json.dumps(report.sections, indent=2))


def _daemon_suites(
    address: str, client: Client, suites: set[str], args: Any, report: Report
) -> None:
    # Each suite in turn, its pool dropped after it: suites ask for pools of different sizes.
    if suites & {"latency", "all"}:
        with pool_dropped(client):
            bench_latency(client, args.runs, args.iterations, args.load_size, report)
    if suites & {"control", "all"}:
        with pool_dropped(client):
            bench_control(client, args.runs, args.iterations, report)
    if suites & {"data", "all"}:
        with pool_dropped(client):
            bench_data(client, args.sizes, args.runs, args.batch, report)
    if suites & {"load", "all"}:
        with pool_dropped(client):
            bench_load(address, client, args.processes, args.load_size, args.seconds, report)
    if suites & {"handoff", "all"}:
        with pool_dropped(client):
            bench_handoff(address, client, args.iterations, report)
