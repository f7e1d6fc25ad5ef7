"""SaveBook: the scheduler side's saves of freshly encoded outputs, plan to commit (no RPCs).

    planned   an input was scheduled for encoding this step (update_state_after_alloc)
    copying   Allocate answered ALLOCATED: a PENDING entry, the order went to the saving rank
    landed    that rank reported the copy done: commit at the next flush
    failed    the copy failed or never happened: abort at the next flush

A key is in at most one state. Only the saving rank's report moves a key out of `copying`, so an
entry is committed only after its bytes landed. Allocate answering EXISTS (already cached),
PENDING (another engine is writing it) or NO_SPACE (everything is pinned or being written) means
no save: the item is simply not cached by us.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ec_client.types import AllocateResult, Status, TensorSpec
from ec_client.vllm.metadata import SaveOrder

log = logging.getLogger("ec_client.vllm")


class SaveBook:
    def __init__(self) -> None:
        self._planned: dict[str, TensorSpec] = {}
        self._copying: set[str] = set()
        self._landed: list[str] = []
        self._failed: list[str] = []

    def plan(self, key: str, spec: TensorSpec) -> None:
        if key in self._planned or key in self._copying or key in self._landed:
            return
        self._planned[key] = spec

    def take_planned(self) -> dict[str, TensorSpec]:
        planned, self._planned = self._planned, {}
        return planned

    def allocated(
        self, planned: dict[str, TensorSpec], results: Sequence[AllocateResult]
    ) -> dict[str, SaveOrder]:
        """Record one Allocate of `planned`; returns the orders for the saving rank."""
        orders = {}
        for (key, spec), result in zip(planned.items(), results, strict=True):
            if result.status is Status.ALLOCATED:
                self._copying.add(key)
                orders[key] = SaveOrder(result.extents, spec)
            elif result.status.is_error:
                log.warning("ecd refused to allocate %s: %s", key, result.message)
        return orders

    def report(self, saved: Iterable[str], failed: Iterable[str]) -> None:
        """The saving rank's report. Keys not being copied (a report from before a restart, or a
        repeated one) change nothing."""
        for key in saved:
            self._finish(key, self._landed)
        for key in failed:
            self._finish(key, self._failed)

    def _finish(self, key: str, outcome: list[str]) -> None:
        if key in self._copying:
            self._copying.discard(key)
            outcome.append(key)

    def take_landed(self) -> list[str]:
        landed, self._landed = self._landed, []
        return landed

    def take_failed(self) -> list[str]:
        failed, self._failed = self._failed, []
        return failed

    def requeue(self, landed: Iterable[str] = (), failed: Iterable[str] = ()) -> None:
        """A Commit or Abort did not reach the daemon: try again at the next flush."""
        self._landed.extend(landed)
        self._failed.extend(failed)

    def void(self) -> None:
        """The daemon dropped our PENDING entries (it restarted, our session ended, or the pool
        was dropped): nothing left to commit or abort."""
        self._copying.clear()
        self._landed.clear()
        self._failed.clear()

    def busy(self) -> bool:
        return bool(self._copying or self._landed or self._failed)
