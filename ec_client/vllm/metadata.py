"""What travels between the two sides of the connector each step.

Down (scheduler -> every worker, inside vLLM's SchedulerOutput): the pool to map and this step's
orders: which entries to fill from the encoder outputs (saves) and which pinned entries to copy
into the encoder cache (loads). Up (workers -> scheduler, inside ECConnectorOutput, folded across
ranks with `aggregate`): which saves landed or failed and which loads each rank finished.

Everything here is plain data, pickled by vLLM's executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from ec_protocol.types import Extent, PoolInfo, TensorSpec


@dataclass(frozen=True)
class SaveOrder:
    """Copy the encoder output into these extents of a PENDING entry. `spec` is what the
    scheduler allocated for; an output of any other shape or dtype is not saved."""

    extents: tuple[Extent, ...]
    spec: TensorSpec


@dataclass(frozen=True)
class LoadOrder:
    """Copy this pinned entry into the encoder cache. The pin stays until every rank reported
    `transfer_id`; the id is new for every dispatch, so a late report of an earlier dispatch of
    the same entry cannot release this one's pin."""

    transfer_id: int
    extents: tuple[Extent, ...]
    spec: TensorSpec


@dataclass
class ECDaemonConnectorMetadata(ECConnectorMetadata):
    """One step's orders. `pool` is sent every step (a few hundred bytes) so a worker maps the
    pool on first use and remaps when the daemon recreated it (new UUID), with no handshake.

    `save_intents` are outputs to be saved whose entries are still being allocated: the saving
    worker keeps them (a reference to the tensor) until a later step's `saves` orders their copy
    or `cancelled` says they will not be saved (see saves.py)."""

    pool: PoolInfo | None  # None until the scheduler side first reached the daemon
    saves: dict[str, SaveOrder] = field(default_factory=dict)
    loads: dict[str, LoadOrder] = field(default_factory=dict)
    save_intents: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)


class WorkerRank(NamedTuple):
    """A worker's place in the engine: its pipeline stage, and its rank within that stage's
    TP x PCP group. No two workers of an engine share one, so a load's reports can be counted
    per worker whatever the parallelism."""

    pipeline: int
    tensor: int


@dataclass
class ECDaemonWorkerMetadata(ECConnectorWorkerMetadata):
    """What workers finished since their last report.

    `loaded` holds (transfer_id, rank) pairs, so the scheduler counts distinct ranks: a rank
    that reports the same transfer twice still counts once. Only the saving rank reports saves.
    """

    saved: list[str] = field(default_factory=list)
    failed_saves: list[str] = field(default_factory=list)
    loaded: list[tuple[int, WorkerRank]] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECDaemonWorkerMetadata:
        if not isinstance(other, ECDaemonWorkerMetadata):
            raise TypeError(f"cannot fold {type(other).__name__} into ECDaemonWorkerMetadata")
        return ECDaemonWorkerMetadata(
            saved=self.saved + other.saved,
            failed_saves=self.failed_saves + other.failed_saves,
            loaded=self.loaded + other.loaded,
        )
