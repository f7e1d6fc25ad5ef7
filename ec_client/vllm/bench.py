"""python -m ec_client.vllm.bench: the scheduler side's cost per step, ecd against ECCPUConnector.

The scheduler side is the part of a connector that runs inside vLLM's scheduler loop, so its
cost is paid by every request of the engine. This drives one engine's scheduler side through the
calls vLLM makes (ec_client.vllm.offline) with no workers: their reports are made up, every copy
done at once. The sequence: `--items` requests of one image each arrive in one step, a fraction
of them (`--hits`) already cached and the rest new; then steps follow until nothing is owed.
Per step it records the RPCs made, by kind, and the microseconds spent in the connector's calls
(ensure_cache_available, has_cache_item, update_state_after_alloc, build_connector_meta,
take_unavailable_requests, update_connector_output, request_finished), and prints medians over
`--runs`.

ECCPUConnector runs the same sequence through its own scheduler side (in-process bookkeeping
over a /dev/shm region, no daemon) for comparison.

Needs a running daemon: `--address`, default ECD_ADDRESS or the default socket (`make run`).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.cpu.common import (
    ECCPUConnectorMetadata,
    ECCPUWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.outputs import ECConnectorOutput

from ec_client.units import parse_size
from ec_client.vllm.connector import ECDaemonConnector
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata, WorkerRank
from ec_client.vllm.offline import finish_step, image_request, offline_config, schedule_step


@dataclass
class StepCost:
    micros: float
    rpcs: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Workload:
    items: int
    hits: int
    rows: int
    width: int
    capacity: int

    def keys(self, run: str) -> tuple[list[str], list[str]]:
        """(keys cached before the step, keys of the step's requests: the cached ones first)."""
        cached = [f"{run}-hit-{i}" for i in range(self.hits)]
        return cached, cached + [f"{run}-miss-{i}" for i in range(self.items - self.hits)]


Report = Callable[[ECConnectorMetadata], ECConnectorWorkerMetadata | None]


def ecd_report(meta: ECConnectorMetadata) -> ECConnectorWorkerMetadata | None:
    """Workers that copied everything at once (one rank)."""
    assert isinstance(meta, ECDaemonConnectorMetadata)
    if not (meta.saves or meta.loads):
        return None
    loaded = [(order.transfer_id, WorkerRank(0, 0)) for order in meta.loads.values()]
    return ECDaemonWorkerMetadata(saved=list(meta.saves), loaded=loaded)


def eccpu_report(meta: ECConnectorMetadata) -> ECConnectorWorkerMetadata | None:
    assert isinstance(meta, ECCPUConnectorMetadata)
    if not (meta.saves or meta.loads):
        return None
    loads = [transfer_id for transfer_id, _, _ in meta.loads.values()]
    return ECCPUWorkerMetadata(completed_saves=list(meta.saves), completed_loads=loads)


def rpc_counts(connector: ECConnectorBase) -> Counter[str]:
    if isinstance(connector, ECDaemonConnector):
        return connector.scheduler_side.rpcs.copy()
    return Counter()


def drive(connector: ECConnectorBase, keys: list[str], rows: int, report: Report) -> list[StepCost]:
    """One request per key in the first step, held-back ones again in later steps, until
    nothing is held and nothing owed; the cost of each step. A scheduled request finishes in
    its step (one output token)."""
    waiting = [image_request(f"req-{uuid.uuid4().hex[:8]}-{key}", [key], rows) for key in keys]
    costs: list[StepCost] = []
    for _ in range(10):
        if not waiting and not connector.has_pending_push_work():
            return costs
        rpcs = rpc_counts(connector)
        started = time.perf_counter()
        step = schedule_step(connector, waiting)
        scheduled = time.perf_counter()
        worker_meta = report(step.metadata)  # the workers' time: not the scheduler's
        output = ECConnectorOutput(ec_connector_worker_meta=worker_meta) if worker_meta else None
        resumed = time.perf_counter()
        finish_step(connector, output)
        for request in waiting:
            if request.request_id not in step.held:
                connector.request_finished(request)
        finished = time.perf_counter()
        waiting = [r for r in waiting if r.request_id in step.held]
        micros = (scheduled - started + finished - resumed) * 1e6
        costs.append(StepCost(micros, rpc_counts(connector) - rpcs))
    raise RuntimeError("the sequence did not settle in 10 steps")


def one_run(connector_name: str, workload: Workload, address: str | None) -> list[StepCost]:
    run = uuid.uuid4().hex[:8]
    extra: dict[str, Any] = {"ec_cpu_bytes": workload.capacity}
    if address:
        extra["ecd_address"] = address
    config = offline_config(
        extra,
        instance_id=f"bench-{run}",
        connector=connector_name,
        width=workload.width,
        dtype=torch.bfloat16,
    )
    connector = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    report = ecd_report if isinstance(connector, ECDaemonConnector) else eccpu_report
    try:
        cached, requested = workload.keys(run)
        drive(connector, cached, workload.rows, report)  # fill the cache: not measured
        return drive(connector, requested, workload.rows, report)
    finally:
        connector.shutdown()


def summarize(name: str, runs: list[list[StepCost]]) -> None:
    steps = min(len(r) for r in runs)
    print(f"{name}: {steps} steps, median of {len(runs)} runs")
    for i in range(steps):
        micros = statistics.median(r[i].micros for r in runs)
        rpcs = runs[0][i].rpcs
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(rpcs.items())) or "none"
        print(f"  step {i + 1}: {micros:9.0f} us   RPCs: {kinds}")
    total = statistics.median(sum(s.micros for s in r) for r in runs)
    rpcs_total = sum(sum(s.rpcs.values()) for s in runs[0])
    print(f"  all steps: {total:9.0f} us   {rpcs_total} RPCs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ec_client.vllm.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--address", help="the daemon (default: ECD_ADDRESS or default socket)")
    parser.add_argument("--items", type=int, default=64, help="requests, one image each")
    parser.add_argument("--hits", type=float, default=0.5, help="fraction already cached")
    parser.add_argument("--rows", type=int, default=256, help="embeddings per image")
    parser.add_argument("--width", type=int, default=3584, help="embedding width (bf16)")
    parser.add_argument("--capacity", default="512MiB", help="pool size")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-eccpu", action="store_true", help="skip ECCPUConnector")
    args = parser.parse_args(argv)
    hits = round(args.items * args.hits)
    workload = Workload(args.items, hits, args.rows, args.width, parse_size(args.capacity))
    print(
        f"{args.items} requests x 1 image ({hits} cached, {args.items - hits} new), "
        f"{args.rows} x {args.width} bf16 each"
    )
    names = ["ECDaemonConnector"] + ([] if args.no_eccpu else ["ECCPUConnector"])
    for name in names:
        one_run(name, workload, args.address)  # warm-up: imports, first pool
        summarize(name, [one_run(name, workload, args.address) for _ in range(args.runs)])


if __name__ == "__main__":
    main()
