"""Load: many client processes mixing put, get and lookup on overlapping keys over the Unix
socket, against one daemon, with the daemon's Stats printed every period.

Every tensor's bytes encode its key and a version unique to the put that wrote it
(workload_testing.expected_bytes), so a get that returns the wrong entry, a stale or torn one, is
caught. At the end:
- no corrupted entry: every get that hit returned exactly the bytes of some put of that key, and
  every READY entry reads back bit-identical;
- no lost entry: replaying the daemon's Watch events (every commit, eviction, deletion) gives
  exactly the READY entries it lists, so nothing disappeared without an eviction;
- no growth of the daemon's memory (RSS after warm-up vs at the end) or file descriptors;
- p50/p99 latency of put, get and lookup and the total ops/s, printed as a table and written to
  ECD_LOAD_JSON if set.

Configuration: ECD_LOAD_CLIENTS (32), ECD_LOAD_DURATION seconds (60), ECD_LOAD_KEYS (2000),
ECD_LOAD_POOL_MIB (512), ECD_LOAD_STATS_PERIOD seconds (10). Run by `make test-load` only
(marker `load`); a smoke run: ECD_LOAD_CLIENTS=4 ECD_LOAD_DURATION=5 make test-load.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from ecd_testing import assert_blocks_accounted, running_daemon
from workload_testing import (
    ClientProcess,
    assert_intact,
    daemon_fds,
    daemon_rss_bytes,
    make_tensor,
    ready_keys,
)

from ec_client import Client, Producer
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.load, pytest.mark.timeout(1800)]

CLIENTS = int(os.environ.get("ECD_LOAD_CLIENTS", "32"))
DURATION = float(os.environ.get("ECD_LOAD_DURATION", "60"))
KEYS = int(os.environ.get("ECD_LOAD_KEYS", "2000"))
STATS_PERIOD = float(os.environ.get("ECD_LOAD_STATS_PERIOD", "10"))
POOL = "load"
BLOCK = 64 << 10
# About half the working set: the pool evicts all along.
CAPACITY = int(os.environ.get("ECD_LOAD_POOL_MIB", "512")) << 20
MIN_BYTES, MAX_BYTES = 64 << 10, 1 << 20
# Growth allowed between the sample after warm-up and the one at the end.
RSS_SLACK = 1.10, 16 << 20  # factor, plus bytes
FD_SLACK = 2

WORKER = """
import collections
rng = random.Random(SEED)
c = Client(ADDRESS, name=f"load-{ID}")
c.open_pool(POOL, BLOCK, CAPACITY)
producer, consumer = Producer(c, POOL), Consumer(c, POOL)
latency = {"put": [], "get": [], "lookup": []}
outcomes = collections.Counter()
corrupt = []
say("ready")
sys.stdin.readline()
end = time.monotonic() + DURATION
seq = 0
while time.monotonic() < end:
    # Half the operations go to a hot tenth of the keys, so clients race on the same keys.
    hot = rng.random() < 0.5
    key = f"k{rng.randrange(KEYS // 10 if hot else KEYS)}"
    op = rng.choices(["put", "get", "lookup"], weights=[1, 2, 1])[0]
    if op == "put":
        seq += 1
        nbytes = 8 * rng.randrange(MIN_BYTES // 8, MAX_BYTES // 8 + 1)
        tensor = make_tensor(key, nbytes, "uint8", version=(ID << 32) | seq)
        started = time.perf_counter()
        status = producer.put(key, tensor)
        latency["put"].append(time.perf_counter() - started)
        outcomes[f"put {status.value}"] += 1
    elif op == "get":
        started = time.perf_counter()
        tensor = consumer.get(key)
        latency["get"].append(time.perf_counter() - started)
        outcomes["get " + ("miss" if tensor is None else "hit")] += 1
        if tensor is not None:
            problem = check_entry_bytes(key, tensor_bytes(tensor), version=None)
            if problem:
                corrupt.append(problem)
    else:
        started = time.perf_counter()
        [result] = c.lookup(POOL, [key])
        latency["lookup"].append(time.perf_counter() - started)
        outcomes[f"lookup {result.state.value}"] += 1
c.close()
with open(RESULTS, "w") as f:
    json.dump({"latency": latency, "outcomes": outcomes, "corrupt": corrupt}, f)
say("done")
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Watcher:
    """Every event of the pool from a snapshot on, collected by a thread (raw stub: the test
    depends on the wire contract only)."""

    def __init__(self, address: str) -> None:
        self.events: list[tuple[int, bytes]] = []
        self.synced = threading.Event()
        self._channel = grpc.insecure_channel(address)
        stub = pb_grpc.EncoderCacheStub(self._channel)
        self._call = stub.Watch(pb.WatchRequest(engine_id=POOL, snapshot=True))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._call:
                if event.type == pb.EVENT_SYNCED:
                    self.synced.set()
                else:
                    self.events.append((event.type, event.key))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                self.events.append((-1, str(error).encode()))

    def seen(self, kind: int, key: bytes) -> bool:
        return (kind, key) in self.events[-1000:]

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)
        self._channel.close()

    def replay(self) -> set[bytes]:
        """The READY keys the events add up to."""
        alive: set[bytes] = set()
        for kind, key in list(self.events):
            assert kind != -1, f"the Watch stream failed: {key.decode()}"
            if kind in (pb.EVENT_SNAPSHOT, pb.EVENT_COMMITTED):
                assert key not in alive, f"{key!r} committed twice without leaving in between"
                alive.add(key)
            elif kind in (pb.EVENT_EVICTED, pb.EVENT_DELETED):
                alive.discard(key)
            elif kind == pb.EVENT_POOL_DROPPED:
                alive.clear()
        return alive


def stats_line(client: Client, pid: int, started: float) -> str:
    stats = client.stats(POOL)
    [p] = stats.pools
    return (
        f"t={time.monotonic() - started:5.1f}s sessions={stats.sessions} ready={p.entries_ready} "
        f"pending={p.entries_pending} pins={p.pins} free_blocks={p.free_blocks} "
        f"commits={p.commits} hits={p.hits} misses={p.misses} evictions={p.evictions} "
        f"no_space={p.no_space} rss={daemon_rss_bytes(pid) / 2**20:.1f}MiB fds={daemon_fds(pid)}"
    )


def test_many_clients_racing_on_overlapping_keys_lose_and_corrupt_nothing(
    tmp_path: Path,
) -> None:
    args = ("--max-bytes", "1GiB", "--lease-ttl", "10", "--log-level", "info")
    with running_daemon(*args) as daemon, daemon.client(name="observer") as c:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        c.open_pool(POOL, BLOCK, CAPACITY)
        watcher = Watcher(daemon.address)
        assert watcher.synced.wait(10)
        fds_idle = daemon_fds(pid)

        workers = [ClientProcess() for _ in range(CLIENTS)]
        for i, worker in enumerate(workers):
            worker.expect("warm", timeout_s=300)
            worker.run(
                WORKER,
                ADDRESS=daemon.address,
                POOL=POOL,
                BLOCK=BLOCK,
                CAPACITY=CAPACITY,
                ID=i,
                SEED=i,
                KEYS=KEYS,
                DURATION=DURATION,
                MIN_BYTES=MIN_BYTES,
                MAX_BYTES=MAX_BYTES,
                RESULTS=str(tmp_path / f"worker-{i}.json"),
            )
        for worker in workers:
            worker.expect("ready", timeout_s=120)

        print(f"\n{CLIENTS} clients, {DURATION:g} s, {KEYS} keys, pool {CAPACITY >> 20} MiB")
        for worker in workers:
            worker.send("go")
        started = time.monotonic()
        warm_at = started + min(STATS_PERIOD, DURATION / 4)
        end_sample_at = started + DURATION - min(1.0, DURATION / 10)
        warm: tuple[int, int] | None = None
        end: tuple[int, int] | None = None
        next_line = started + STATS_PERIOD
        while end is None:
            now = time.monotonic()
            if warm is None and now >= warm_at:
                warm = (daemon_rss_bytes(pid), daemon_fds(pid))
            if now >= end_sample_at:
                end = (daemon_rss_bytes(pid), daemon_fds(pid))
            if now >= next_line:
                print(stats_line(c, pid, started), flush=True)
                next_line += STATS_PERIOD
            time.sleep(0.05)
        results = []
        for i, worker in enumerate(workers):
            worker.finish(timeout_s=DURATION + 120)
            results.append(json.loads((tmp_path / f"worker-{i}.json").read_text()))
            worker.close()
        elapsed = time.monotonic() - started
        print(stats_line(c, pid, started), flush=True)

        # Nothing lost: the events add up to what the daemon lists as READY.
        Producer(c, POOL).put("sentinel", make_tensor("sentinel", 8))
        deadline = time.monotonic() + 30
        while not watcher.seen(pb.EVENT_COMMITTED, b"sentinel"):
            assert time.monotonic() < deadline, "the Watch stream fell behind"
            time.sleep(0.05)
        watcher.close()
        ready = ready_keys(c, POOL)
        replayed = watcher.replay()
        assert replayed == set(ready), (
            f"lost: {sorted(replayed - set(ready))[:5]}, unannounced: "
            f"{sorted(set(ready) - replayed)[:5]}"
        )
        [pool] = c.stats(POOL).pools
        evicted = sum(1 for kind, _ in watcher.events if kind == pb.EVENT_EVICTED)
        assert pool.evictions == evicted
        # Nothing corrupted: what every get saw, and what is stored now.
        corrupt = [p for r in results for p in r["corrupt"]]
        assert not corrupt, corrupt[:5]
        c.delete(POOL, ["sentinel"])
        assert_intact(c, POOL, version=None)
        assert_blocks_accounted(c, POOL)

        # No growth of memory or descriptors under steady load; descriptors back once idle.
        assert warm is not None
        rss_limit = warm[0] * RSS_SLACK[0] + RSS_SLACK[1]
        assert end[0] <= rss_limit, f"daemon RSS grew from {warm[0]} to {end[0]} bytes"
        assert end[1] <= warm[1] + FD_SLACK, f"daemon fds grew from {warm[1]} to {end[1]}"
        deadline = time.monotonic() + 10
        while daemon_fds(pid) > fds_idle and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon_fds(pid) <= fds_idle, f"{daemon_fds(pid)} fds once idle, {fds_idle} before"

        report = summarize(results, elapsed, pool.evictions, warm, end)
        print_table(report)
        if os.environ.get("ECD_LOAD_JSON"):
            Path(os.environ["ECD_LOAD_JSON"]).write_text(json.dumps(report, indent=2))
        assert report["ops"] > 0


def summarize(
    results: list[dict[str, Any]],
    elapsed: float,
    evictions: int,
    warm: tuple[int, int],
    end: tuple[int, int],
) -> dict[str, Any]:
    latency: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
    outcomes: Counter[str] = Counter()
    for r in results:
        for op, values in r["latency"].items():
            latency[op].extend(values)
        outcomes.update(r["outcomes"])
    ops = sum(len(v) for v in latency.values())
    return {
        "clients": CLIENTS,
        "duration_s": DURATION,
        "elapsed_s": round(elapsed, 2),
        "keys": KEYS,
        "ops": ops,
        "ops_per_s": round(ops / DURATION, 1),
        "latency_ms": {
            op: {
                "n": len(values),
                "p50": round(1000 * percentile(values, 0.50), 3),
                "p99": round(1000 * percentile(values, 0.99), 3),
                "mean": round(1000 * statistics.fmean(values), 3) if values else None,
            }
            for op, values in latency.items()
        },
        "outcomes": dict(sorted(outcomes.items())),
        "evictions": evictions,
        "corrupted": 0,
        "lost": 0,
        "daemon_rss_mib": {"after_warmup": warm[0] / 2**20, "end": end[0] / 2**20},
        "daemon_fds": {"after_warmup": warm[1], "end": end[1]},
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'op':<8} {'n':>8} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for op, row in report["latency_ms"].items():
        print(f"{op:<8} {row['n']:>8} {row['p50']:>9.3f} {row['p99']:>9.3f} {row['mean']:>9.3f}")
    print(
        f"total    {report['ops']:>8} ops in {report['duration_s']:g} s = "
        f"{report['ops_per_s']} ops/s with {report['clients']} clients"
    )
    print("outcomes: " + ", ".join(f"{k}={v}" for k, v in report["outcomes"].items()))
    rss, fds = report["daemon_rss_mib"], report["daemon_fds"]
    print(
        f"daemon RSS {rss['after_warmup']:.1f} -> {rss['end']:.1f} MiB, fds {fds['after_warmup']} "
        f"-> {fds['end']}, evictions {report['evictions']}, lost 0, corrupted 0"
    )
