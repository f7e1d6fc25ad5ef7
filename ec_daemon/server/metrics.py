"""Prometheus metrics: pool occupancy and counters from the store, RPC latency by method.

Pool and daemon figures are not kept twice: a collector turns Store.stats() into metric families
at scrape time, so a scrape shows exactly what the Stats RPC and `ecd stats` report. Only the RPC
latency histograms are recorded as calls happen (through the service's `observe` hook).

The HTTP endpoint runs on a thread of its own, but the store belongs to the event loop
(it is not thread-safe: a snapshot taken while a handler mutates a pool could fail mid-iteration or
mix two moments), so the collector hands the snapshot over to the loop and waits for it.

The page names every pool, with its size and hits: with --metrics-token-file it is answered only
to `Authorization: Bearer <token>` with one of that file's tokens (what Prometheus sends with
`authorization: {credentials_file: FILE}`), 401 otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from ec_daemon.core.store import Store
from ec_daemon.server.auth import bearer, match
from ec_daemon.server.checks import StartupError
from ec_protocol.types import ClusterStats, PoolStats, Stats

# From a cached Lookup (a fraction of a millisecond over the socket) to an Acquire that waited for
# a producer (seconds).
RPC_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
)  # fmt: skip
SCRAPE_TIMEOUT_S = 5.0


def _block_bytes(pool: PoolStats, blocks: int) -> int:
    return blocks * pool.block_size_bytes


# Per-pool gauges (label engine_id): name, help, value.
POOL_GAUGES: tuple[tuple[str, str, Callable[[PoolStats], float]], ...] = (
    (
        "ecd_pool_capacity_bytes",
        "Bytes of the pool's blocks",
        lambda p: p.capacity_bytes,
    ),
    (
        "ecd_pool_reserved_bytes",
        "Bytes of the pool file: its blocks, header and slot table",
        lambda p: p.reserved_bytes,
    ),
    (
        "ecd_pool_max_entries",
        "Entries the pool can hold at once (its slot table)",
        lambda p: p.max_entries,
    ),
    (
        "ecd_pool_used_bytes",
        "Bytes of blocks held by entries",
        lambda p: _block_bytes(p, p.num_blocks - p.free_blocks),
    ),
    ("ecd_pool_free_bytes", "Bytes of free blocks", lambda p: _block_bytes(p, p.free_blocks)),
    (
        "ecd_pool_largest_free_extent_bytes",
        "Largest contiguous free run: the biggest entry that fits without eviction or splitting",
        lambda p: _block_bytes(p, p.largest_free_extent),
    ),
    ("ecd_pool_ready_bytes", "Tensor bytes of READY entries", lambda p: p.bytes_ready),
    ("ecd_pool_pinned_entries", "READY entries with pins", lambda p: p.entries_pinned),
    ("ecd_pool_pins", "Outstanding pins (Acquire leases)", lambda p: p.pins),
    (
        "ecd_pool_locked_entries",
        "Slots readers hold lock pins on (pins taken with no round trip)",
        lambda p: p.entries_locked,
    ),
    (
        "ecd_pool_held_bytes",
        "Bytes of blocks of removed entries not free yet (still pinned, locked or written)",
        lambda p: _block_bytes(p, p.held_blocks),
    ),
)

# Per-pool counters: PoolStats field, help. Exposed as ecd_pool_<field>_total.
POOL_COUNTERS: tuple[tuple[str, str], ...] = (
    ("hits", "Acquire items answered HIT, and hits clients answered under lock pins"),
    ("misses", "Acquire items answered MISS, and misses clients answered from their view"),
    ("no_space", "Allocate items answered NO_SPACE (what was left was PENDING or pinned)"),
    ("commits", "Entries committed"),
    ("aborts", "PENDING entries aborted"),
    ("remote_hits", "Entries read from the cluster's store (remote hits)"),
    ("remote_misses", "Reads from the cluster's store that fetched nothing"),
    ("remote_bytes", "Tensor bytes read from the cluster's store"),
    ("remote_reads", "Transfer-engine reads started for remote hits (one per remote hit)"),
)


def evictions_by_cause(pool: PoolStats) -> dict[str, int]:
    """A pool's evictions by why: to make room (space, entries), or an operator's Evict."""
    made_room = pool.evictions_for_space + pool.evictions_for_entries
    return {
        "space": pool.evictions_for_space,
        "entries": pool.evictions_for_entries,
        "operator": pool.evictions - made_room,
    }


def _buckets(pool: PoolStats) -> list[tuple[str, float]]:
    """The remote-hit latency histogram's cumulative buckets, Prometheus style."""
    bounds = [*map(str, pool.remote_seconds_bounds), "+Inf"]
    return list(zip(bounds, itertools.accumulate(pool.remote_seconds_counts), strict=True))


class StoreCollector(Collector):
    """Per-pool and daemon-wide figures, computed from one snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], Stats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        info = InfoMetricFamily("ecd_boot", "This daemon start: a new boot_epoch means a restart")
        info.add_metric([], {"boot_epoch": snap.boot_epoch, "version": snap.version})
        yield info
        yield GaugeMetricFamily("ecd_uptime_seconds", "Seconds since start", value=snap.uptime_s)
        yield GaugeMetricFamily(
            "ecd_budget_bytes",
            "Byte budget of the pools' capacities together (--max-bytes)",
            value=snap.max_bytes,
        )
        yield GaugeMetricFamily(
            "ecd_capacity_bytes",
            "Capacity of all pools together: the part of the budget in use",
            value=snap.capacity_bytes,
        )
        yield GaugeMetricFamily(
            "ecd_reserved_bytes",
            "Bytes of all pool files together: capacity plus headers and slot tables",
            value=snap.reserved_bytes,
        )
        yield GaugeMetricFamily("ecd_sessions", "Open client sessions", value=snap.sessions)
        yield CounterMetricFamily(
            "ecd_lease_expiries",
            "Sessions ended because their lease ran out (their client went silent)",
            value=snap.lease_expiries,
        )
        entries = GaugeMetricFamily(
            "ecd_pool_entries", "Entries by state", labels=["engine_id", "state"]
        )
        for pool in snap.pools:
            entries.add_metric([pool.engine_id, "pending"], pool.entries_pending)
            entries.add_metric([pool.engine_id, "ready"], pool.entries_ready)
        yield entries
        for name, doc, value in POOL_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["engine_id"])
            for pool in snap.pools:
                gauge.add_metric([pool.engine_id], value(pool))
            yield gauge
        evictions = CounterMetricFamily(
            "ecd_pool_evictions",
            "READY entries evicted, by cause: space (blocks for an allocation), entries (only a "
            "slot for one, every slot taken), operator (Evict)",
            labels=["engine_id", "cause"],
        )
        for pool in snap.pools:
            for cause, count in evictions_by_cause(pool).items():
                evictions.add_metric([pool.engine_id, cause], count)
        yield evictions
        for field, doc in POOL_COUNTERS:
            counter = CounterMetricFamily(f"ecd_pool_{field}", doc, labels=["engine_id"])
            for pool in snap.pools:
                counter.add_metric([pool.engine_id], getattr(pool, field))
            yield counter
        seconds = HistogramMetricFamily(
            "ecd_pool_remote_seconds",
            "Seconds a remote hit took, from its local allocation to its commit",
            labels=["engine_id"],
        )
        for pool in snap.pools:
            seconds.add_metric([pool.engine_id], _buckets(pool), pool.remote_seconds_sum)
        yield seconds
        if snap.cluster is not None:
            yield from cluster_metrics(snap.cluster)


# The store's counters (ClusterStats' fields), with what each counts.
CLUSTER_COUNTERS = (
    ("published", "Entries of shared pools written to the Mooncake Store"),
    (
        "already_stored",
        "Entries of shared pools offered to the store that it had: not written again",
    ),
    ("unpublishable", "Entries of shared pools the store's format cannot express (kept local)"),
    ("gone", "Entries evicted or removed before their turn to be published"),
    ("publish_failures", "Publishes the store refused or that failed"),
    ("dropped", "Commits not published because the publish queue was full"),
    ("lookup_failures", "Remote lookups or reads not made or failed: the master did not answer"),
    ("claims", "Pending markers written for this node's producers of shared pools"),
    ("claims_lost", "Pending markers found another node's: that key was encoded on both"),
    ("waits_hit", "Waits for a key another node was writing, ended by a remote hit"),
    ("waits_missed", "Waits for a key another node was writing, ended without its value"),
    ("leader_changes", "Times the lead of the store's masters passed to another master"),
    ("publishes_retried", "Publishes the master did not answer, queued again once it did"),
    ("republished", "Entries published again because the store had lost them"),
    ("republish_batches", "Batches of entries offered to the store again (one lookup each)"),
)


def cluster_metrics(cluster: ClusterStats) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "ecd_cluster_connected",
        "1 while the Mooncake Store's master answers this daemon, else 0",
        value=int(cluster.connected),
    )
    leader = GaugeMetricFamily(
        "ecd_cluster_leader",
        "1, labelled with the store's master that serves (with several, the leader last seen)",
        labels=["leader"],
    )
    leader.add_metric([cluster.leader], 1)
    yield leader
    for field, doc in CLUSTER_COUNTERS:
        yield CounterMetricFamily(f"ecd_cluster_{field}", doc, value=getattr(cluster, field))
    yield GaugeMetricFamily(
        "ecd_cluster_last_republish_timestamp_seconds",
        "Unix time the last republish that put entries ended (0: none since the daemon started)",
        value=cluster.last_republish,
    )


def snapshot_on_loop(store: Store, loop: asyncio.AbstractEventLoop) -> Callable[[], Stats]:
    """A snapshot function safe to call from another thread: it runs on the store's loop."""

    async def take() -> Stats:
        return store.stats()

    def snapshot() -> Stats:
        return asyncio.run_coroutine_threadsafe(take(), loop).result(SCRAPE_TIMEOUT_S)

    return snapshot


class Metrics:
    """The daemon's own registry rather than the process-global one, so that the endpoint shows
    exactly these series and nothing that an imported library registers."""

    def __init__(self, snapshot: Callable[[], Stats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(snapshot))
        ProcessCollector(registry=self.registry)  # memory, CPU, open file descriptors
        self._rpc_seconds = Histogram(
            "ecd_rpc_duration_seconds",
            "Time the daemon took to answer an RPC, by method",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._rpcs = Counter(
            "ecd_rpcs",
            "RPCs answered, by method and gRPC status code (OK, NOT_FOUND, ...)",
            ["method", "code"],
            registry=self.registry,
        )
        # The tokens of --metrics-token-file, set before serve; None: the page is open to all.
        self.page_tokens: Collection[str] | None = None

    def observe(self, method: str, code: str, seconds: float) -> None:
        self._rpc_seconds.labels(method).observe(seconds)
        self._rpcs.labels(method, code).inc()

    def serve(self, host: str, port: int) -> WSGIServer:
        """Start the /metrics endpoint on its own thread; stop it with shutdown(). With
        `page_tokens` set, the page is answered only to a bearer of one of them (as they are at
        each request: the daemon's SIGHUP replaces them)."""
        app = make_wsgi_app(self.registry)
        if self.page_tokens is not None:
            app = bearer_only(app, lambda: self.page_tokens or ())
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]

            class MetricsServer(ThreadingWSGIServer):
                address_family = family  # IPv4 or IPv6, as the host is

            server = make_server(str(address[0]), port, app, MetricsServer, QuietHandler)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror}; choose another "
                "--metrics-port (or 0 to turn metrics off) or stop what listens there"
            ) from exc
        threading.Thread(target=server.serve_forever, name="ecd-metrics", daemon=True).start()
        return server


class QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (the daemon's log is for events, not scrapes)."""

    def log_message(self, format: str, *args: object) -> None:
        pass


UNAUTHORIZED = (
    b"401 Unauthorized: send `Authorization: Bearer <token>` with a token of the daemon's "
    b"--metrics-token-file (Prometheus: authorization: {credentials_file: FILE})\n"
)


def bearer_only(app: WSGIApplication, tokens: Callable[[], Collection[str]]) -> WSGIApplication:
    """`app` for requests bearing one of `tokens()`; 401 for any other."""

    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        token = bearer(environ.get("HTTP_AUTHORIZATION", ""))
        if token and match(tokens(), token) is not None:
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="ecd metrics"'),
            ],
        )
        return [UNAUTHORIZED]

    return guarded
