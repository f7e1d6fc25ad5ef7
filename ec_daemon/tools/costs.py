"""What the daemon spends per item of a batch, measured in process (`ecd bench --suite costs`).

The service's handlers are called directly, with a store on a private directory, no gRPC in the
way: what is left is the daemon's own work per item (validation, the core, the reply's messages),
the part that grows with the number of images in a scheduler step. Each RPC's time is divided by
the batch's items; medians over rounds. The client's side of the same batches is measured by
`ec_bench.bench.bench_costs`.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ec_daemon.core.pools import PoolSettings
from ec_daemon.core.store import Store, StoreConfig
from ec_daemon.server.events import EventHub
from ec_daemon.server.service import EncoderCacheService
from ec_daemon.server.validate import Limits
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.types import Role

ROWS, WIDTH, BLOCK = 256, 3584, 7168  # one Qwen2.5-VL image: 256 rows of 3584 bf16


class _Context:
    """The one thing the handlers ask of grpc's context on success."""

    def invocation_metadata(self) -> tuple[()]:
        return ()


def measure(items: int = 32, rounds: int = 200) -> dict[str, float]:
    """Microseconds per item of Allocate, Commit, Acquire and Release; medians over `rounds`
    batches of `items`."""
    return asyncio.run(_measure(items, rounds))


async def _measure(items: int, rounds: int) -> dict[str, float]:
    shm_dir = Path(tempfile.mkdtemp(prefix="ecd-costs-", dir="/dev/shm"))
    hub = EventHub()
    store = Store(StoreConfig(PoolSettings(shm_dir, 1 << 32)), time.monotonic, hub.publish)
    service = EncoderCacheService(store, hub, Limits())
    context: Any = _Context()
    session = store.open_session("costs", 0, Role.BOTH)
    store.open_pool(session, "costs", BLOCK, 4 * items * ROWS * BLOCK, "")
    times: dict[str, list[float]] = {}

    async def timed(name: str, request: Any) -> Any:
        """The handler's share of one RPC: parse the body, handle, serialize the reply."""
        raw = request.SerializeToString()
        handler = getattr(service, name)
        started = time.perf_counter()
        reply = await handler(type(request).FromString(raw), context)
        reply.SerializeToString()
        times.setdefault(name, []).append((time.perf_counter() - started) / items)
        return reply

    spec = pb.TensorSpec(shape=[ROWS, WIDTH], dtype="bfloat16", nbytes=ROWS * BLOCK)
    try:
        for r in range(rounds):
            keys = [f"img-{r}-{i:04d}-0123456789abcdef".encode() for i in range(items)]
            allocates = [pb.AllocateItem(key=k, tensor=spec) for k in keys]
            await timed(
                "Allocate",
                pb.AllocateRequest(session_id=session, engine_id="costs", items=allocates),
            )
            commits = [pb.CommitItem(key=k) for k in keys]
            await timed(
                "Commit", pb.CommitRequest(session_id=session, engine_id="costs", items=commits)
            )
            acquired = await timed(
                "Acquire", pb.AcquireRequest(session_id=session, engine_id="costs", keys=keys)
            )
            leases = [a.lease_id for a in acquired.results]
            await timed("Release", pb.ReleaseRequest(session_id=session, lease_ids=leases))
            store.evict("costs", keys)
    finally:
        store.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
    return {name: statistics.median(samples) * 1e6 for name, samples in times.items()}
