"""python -m ec_bench.vllm: the scheduler side's cost, ecd against ECCPUConnector.

The scheduler side is the part of a connector that runs inside vLLM's scheduler loop, so its
cost is paid by every request of the engine. This drives one engine's scheduler side through the
calls vLLM makes (ec_client.vllm.offline) with pretend workers: their reports are made up, every
copy done at once, and each step's forward pass takes `--step-ms` (a sleep: the daemon's answers
to background Steps arrive meanwhile, as in an engine). Two arrival patterns:

- burst: `--items` requests of one image each arrive in one step, a fraction of them (`--hits`)
  already cached and the rest new; then steps follow until nothing is owed.
- trickle: one request with a cached image arrives at every step, `--items / 8` of them.

The engine is an `ec_both` one unless `--role` names another: as `ec_producer` an encoder-only
engine (`--mm-encoder-only`), whose cached images are neither encoded nor copied, the pins on them
given back at once.

Per step it records the Steps (RPCs) sent and the microseconds spent in the connector's calls
(ensure_cache_available, has_cache_item, update_state_after_alloc, build_connector_meta,
take_unavailable_requests, update_connector_output, request_finished), time blocked on the
daemon included. From those and the step time it derives each request's time to first token as
far as the connector decides it: a request arriving at a step's start gets its first token at the
end of the step that schedules it, each step lasting its scheduler time plus the forward pass.

ECCPUConnector runs the same sequences through its own scheduler side (in-process bookkeeping
over a /dev/shm region, no daemon) for comparison. The cached items are saved by an unmeasured
first pass; ecd's measured pass starts once its ready view heard their slots (the COMMITTED
events, a moment after the commits), as it has in an engine whose images were saved earlier.

Each run's pools hold every image of the run (`--capacity`, by default sized for it), and the
heap is frozen once the connector exists, as in vLLM's EngineCore. The collector is otherwise
left alone, as an engine leaves it: the Requests a burst is made of bring its young generation
to its threshold, so about one collection lands in each measured pass, wherever its
allocations cross the line, and it costs each connector what it then finds young (one connector
more than the other: docs/performance.md). `--collect-first` collects just before each measured
pass instead, so that what is measured is the connectors' own work.

Needs a running daemon: `--address`, default ECD_ADDRESS or the default socket (`make run`).
With `--json`, one line: {"ecd": {"scheduler_us", "steps", "held_steps", "held_requests", "rpcs",
"ttft_cached_ms", "ttft_new_ms"}, "eccpu": {"scheduler_us", "steps", "ttft_cached_ms",
"ttft_new_ms"}}
for the burst at the first `--step-ms` (medians over `--runs`; the contenders take turns, run by
run, so that a machine's drift moves both sides of a ratio alike).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import grpc
import torch
from vllm.config.ec_transfer import ECRole
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
from vllm.v1.request import Request

from ec_client.vllm.connector import ECDaemonConnector
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata, WorkerRank
from ec_client.vllm.offline import finish_step, image_request, offline_config, schedule_step
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import tensor_nbytes
from ec_protocol.units import format_size, parse_size


@dataclass
class StepCost:
    """One step as the scheduler thread lived it."""

    micros: float  # in the connector's calls, time blocked on the daemon included
    rpcs: Counter[str] = field(default_factory=Counter)
    scheduled: set[str] = field(default_factory=set)  # request IDs the step scheduled
    arrived: set[str] = field(default_factory=set)  # request IDs that arrived at its start


@dataclass(frozen=True)
class Workload:
    items: int
    hits: int
    rows: int
    width: int
    capacity: int
    step_s: float
    role: ECRole = "ec_both"


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


def drive(
    connector: ECConnectorBase, arrivals: Sequence[list[Request]], report: Report, step_s: float
) -> list[StepCost]:
    """`arrivals[i]` arrive at step i; held-back requests come again at later steps; steps go on
    until nothing is held and nothing owed. A scheduled request finishes in its step (one
    output token). Returns the cost of each step."""
    waiting: list[Request] = []
    costs: list[StepCost] = []
    for i in range(len(arrivals) + 20):
        new = arrivals[i] if i < len(arrivals) else []
        waiting += new
        if i >= len(arrivals) and not waiting and not connector.has_pending_push_work():
            return costs
        rpcs = rpc_counts(connector)
        started = time.perf_counter()
        step = schedule_step(connector, waiting)
        scheduled = time.perf_counter()
        worker_meta = report(step.metadata)  # the workers' time: not the scheduler's
        time.sleep(step_s)  # the forward pass
        output = ECConnectorOutput(ec_connector_worker_meta=worker_meta) if worker_meta else None
        resumed = time.perf_counter()
        finish_step(connector, output)
        done = {r.request_id for r in waiting if r.request_id not in step.held}
        for request in waiting:
            if request.request_id in done:
                connector.request_finished(request)
        finished = time.perf_counter()
        waiting = [r for r in waiting if r.request_id in step.held]
        micros = (scheduled - started + finished - resumed) * 1e6
        arrived = {r.request_id for r in new}
        costs.append(StepCost(micros, rpc_counts(connector) - rpcs, done, arrived))
    raise RuntimeError("the sequence did not settle")


@dataclass(frozen=True)
class Outcome:
    """One run, as the connector's share of the requests' time sees it."""

    scheduler_us: float  # all steps together
    steps: int  # the engine's steps, from the arrivals until nothing was held or owed
    held_steps: int  # the most steps any request was held back
    held_requests: int  # requests held back at least one step
    rpcs: int
    ttft_cached_ms: float  # mean time to first token, requests with a cached image
    ttft_new_ms: float  # the same, requests with a new image


def outcome(costs: list[StepCost], cached: set[str], step_s: float) -> Outcome:
    ends: list[float] = []
    now = 0.0
    for cost in costs:
        now += cost.micros / 1e6 + step_s
        ends.append(now)
    starts = [end - (cost.micros / 1e6 + step_s) for end, cost in zip(ends, costs, strict=True)]
    arrival = {r: i for i, cost in enumerate(costs) for r in cost.arrived}
    first = {r: i for i, cost in reversed(list(enumerate(costs))) for r in cost.scheduled}
    ttft = {r: (ends[first[r]] - starts[arrival[r]]) * 1e3 for r in arrival}
    held = [first[r] - arrival[r] for r in arrival]
    new = [t for r, t in ttft.items() if r not in cached]
    return Outcome(
        scheduler_us=sum(c.micros for c in costs),
        steps=len(costs),
        held_steps=max(held, default=0),
        held_requests=sum(1 for h in held if h),
        rpcs=sum(sum(c.rpcs.values()) for c in costs),
        ttft_cached_ms=statistics.mean(t for r, t in ttft.items() if r in cached),
        ttft_new_ms=statistics.mean(new) if new else 0.0,
    )


def slots_known(connector: ECConnectorBase, keys: list[str], timeout_s: float = 5.0) -> None:
    """Wait until ecd's ready view knows the slots of `keys` (lock pins need them)."""
    if not isinstance(connector, ECDaemonConnector):
        return
    view = connector.scheduler_side.view
    if not view.synced:  # never reached: its whole run would be encodes, not the bench asked for
        address = connector.scheduler_side.config.address or "the default socket"
        raise SystemExit(
            f"ecd is not reachable at {address}: start it (ecd serve, make run) or name it "
            "with --address"
        )
    deadline = time.monotonic() + timeout_s
    while not all(view.slot(key.encode()) is not None for key in keys):
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon's COMMITTED events did not come")
        time.sleep(0.001)


def one_run(
    connector_name: str,
    workload: Workload,
    pattern: str,
    address: str | None,
    collect_first: bool = False,
) -> Outcome:
    """One measured pass of `pattern`, after an unmeasured fill of its cached items. With
    `collect_first` (`--collect-first`), the garbage collector runs just before that pass."""
    run = uuid.uuid4().hex[:8]
    extra: dict[str, Any] = {"ec_cpu_bytes": workload.capacity}
    if address:
        extra["ecd_address"] = address
    config = offline_config(
        extra,
        instance_id=f"bench-{run}",
        connector=connector_name,
        role=workload.role,
        encoder_only=workload.role == "ec_producer",
        width=workload.width,
        dtype=torch.bfloat16,
    )
    try:
        connector = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    except EcdError as error:
        if error.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        raise SystemExit(
            f"ecd has no room for the bench's pool of {format_size(workload.capacity)}: "
            f"{error.message}. Give the bench a smaller --capacity, or the daemon a larger "
            "--max-bytes"
        ) from None
    # As vLLM's EngineCore does once its scheduler (the connector's scheduler side with it)
    # exists (vllm.utils.gc_utils.freeze_gc_heap): the heap built so far is left out of the
    # garbage collector's passes, so that a collection during the steps scans what the steps
    # allocated, not all of torch and vLLM.
    gc.collect()
    gc.freeze()
    report = ecd_report if isinstance(connector, ECDaemonConnector) else eccpu_report

    def requests(keys: list[str]) -> list[Request]:
        return [image_request(f"req-{run}-{key}", [key], workload.rows) for key in keys]

    try:
        hits = workload.hits if pattern == "burst" else workload.items // 8
        cached = [f"{run}-hit-{i}" for i in range(hits)]
        drive(connector, [requests(cached)], report, workload.step_s)  # fill: not measured
        slots_known(connector, cached)
        if pattern == "burst":
            new = [f"{run}-miss-{i}" for i in range(workload.items - hits)]
            arrivals = [requests(cached + new)]
        else:
            arrivals = [requests([key]) for key in cached]
        if collect_first:
            # The young objects so far (the arrivals' Requests above all, hundreds of them) go
            # now: no collection they would trigger lands in the connector's calls below.
            gc.collect()
        costs = drive(connector, arrivals, report, workload.step_s)
        return outcome(costs, {f"req-{run}-{key}" for key in cached}, workload.step_s)
    finally:
        connector.shutdown()


def room_for(items: int, rows: int, width: int) -> int:
    """A pool that holds every item a run saves (its cached ones and its new ones) with a
    quarter to spare for block rounding, and at least 512 MiB. A pool too small for the run
    would have both connectors skip the saves they find no room for, and ECCPUConnector's
    allocator spends per block (1369-row images: 64 take 628 MB): the comparison would then be
    of what each skips, not of the burst."""
    need = items * tensor_nbytes((rows, width), "bfloat16") * 5 // 4
    return max(512 << 20, -(-need // (1 << 20)) << 20)


def median_outcome(outcomes: list[Outcome]) -> Outcome:
    return Outcome(
        *(statistics.median(getattr(o, f) for o in outcomes) for f in Outcome.__annotations__)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ec_bench.vllm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--address", help="the daemon (default: ECD_ADDRESS or default socket)")
    parser.add_argument("--items", type=int, default=64, help="requests, one image each")
    parser.add_argument("--hits", type=float, default=0.5, help="fraction already cached")
    parser.add_argument("--rows", type=int, default=256, help="embeddings per image")
    parser.add_argument("--width", type=int, default=3584, help="embedding width (bf16)")
    parser.add_argument(
        "--capacity",
        default="auto",
        help="pool size (default: room for every item of the run, at least 512MiB)",
    )
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--step-ms", default="10", help="forward-pass time(s), comma-separated")
    parser.add_argument("--patterns", default="burst,trickle", help="burst, trickle")
    parser.add_argument("--no-eccpu", action="store_true", help="skip ECCPUConnector")
    parser.add_argument(
        "--collect-first",
        action="store_true",
        help="run the garbage collector before each measured pass: the connectors' own work, "
        "without the collection the bench's own allocations trigger during the pass",
    )
    parser.add_argument(
        "--role",
        default="ec_both",
        choices=get_args(ECRole),
        help="the engine's ec_role (ec_producer: an encoder-only engine, whose cached images "
        "are neither encoded nor loaded)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (see above)")
    args = parser.parse_args(argv)
    hits = round(args.items * args.hits)
    capacity = (
        room_for(args.items, args.rows, args.width)
        if args.capacity == "auto"
        else parse_size(args.capacity)
    )
    step_times = [float(s) for s in args.step_ms.split(",")]
    patterns = args.patterns.split(",")
    contenders = ["ECDaemonConnector"] + ([] if args.no_eccpu else ["ECCPUConnector"])
    results: dict[tuple[str, str, float], Outcome] = {}
    warm = Workload(args.items, hits, args.rows, args.width, capacity, 0.01, args.role)
    for name in contenders:
        one_run(name, warm, "burst", args.address)
    for step_ms in step_times:
        workload = Workload(
            args.items, hits, args.rows, args.width, capacity, step_ms / 1e3, args.role
        )
        for pattern in patterns:
            # The contenders take turns, run by run: a machine that slows down or speeds up
            # meanwhile (a noisy VM does, by tens of percent) moves both sides of the ratio.
            runs: dict[str, list[Outcome]] = {name: [] for name in contenders}
            for _ in range(args.runs):
                for name in contenders:
                    runs[name].append(
                        one_run(name, workload, pattern, args.address, args.collect_first)
                    )
            for name in contenders:
                results[(name, pattern, step_ms)] = median_outcome(runs[name])
    if args.json:
        print(json.dumps(summary(results, step_times[0])))
        return
    print(
        f"burst: {args.items} requests x 1 image ({hits} cached, {args.items - hits} new); "
        f"trickle: {args.items // 8} requests x 1 cached image, one a step; "
        f"{args.rows} x {args.width} bf16 each; pools of {format_size(capacity)}; "
        f"medians of {args.runs} runs"
    )
    print(
        f"{'connector':18} {'pattern':8} {'step ms':>7} {'sched us':>9} {'steps':>5} "
        f"{'held':>4} {'held req':>8} {'RPCs':>5} {'TTFT cached ms':>14} {'TTFT new ms':>11}"
    )
    for (name, pattern, step_ms), o in results.items():
        print(
            f"{name:18} {pattern:8} {step_ms:7.0f} {o.scheduler_us:9.0f} {o.steps:5.0f} "
            f"{o.held_steps:4.0f} {o.held_requests:8.0f} {o.rpcs:5.0f} "
            f"{o.ttft_cached_ms:14.2f} {o.ttft_new_ms:11.2f}"
        )


def summary(results: dict[tuple[str, str, float], Outcome], step_ms: float) -> dict[str, Any]:
    """The JSON line: the burst at the first step time, ecd against ECCPU."""
    ecd = results[("ECDaemonConnector", "burst", step_ms)]
    line: dict[str, Any] = {
        "ecd": {
            "scheduler_us": round(ecd.scheduler_us),
            "steps": ecd.steps,
            "held_steps": ecd.held_steps,
            "held_requests": ecd.held_requests,
            "rpcs": ecd.rpcs,
            **ttft(ecd),
        }
    }
    eccpu = results.get(("ECCPUConnector", "burst", step_ms))
    if eccpu is not None:
        line["eccpu"] = {
            "scheduler_us": round(eccpu.scheduler_us),
            "steps": eccpu.steps,
            **ttft(eccpu),
        }
    return line


def ttft(o: Outcome) -> dict[str, float]:
    return {"ttft_cached_ms": round(o.ttft_cached_ms, 2), "ttft_new_ms": round(o.ttft_new_ms, 2)}


if __name__ == "__main__":
    main()
