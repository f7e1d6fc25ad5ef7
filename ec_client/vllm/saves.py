"""SaveBook: the scheduler side's saves of freshly encoded outputs, from plan to commit (no I/O:
the caller sends what it owes and asks).

    planned     an input was scheduled for encoding this step (update_state_after_alloc)
    allocating  its Allocate is on its way (in the step's background Step): the step's metadata
                names it a save *intent*, so the saving worker keeps the encoder's output
    ordered     Allocate answered ALLOCATED: the next step's metadata orders the copy into the
                PENDING entry's extents (the worker copies the output it kept)
    copying     the order went out; the saving rank copies
    landed      that rank reported the copy done: commit at once (update_connector_output),
                naming the allocation the bytes went into (the key may have been deleted and
                allocated again since: a Commit by key alone would make that one READY)
    failed      the copy failed or never happened: abort with the next Step

A key whose Commit or Abort was sent and not answered yet is not planned again (it is encoded,
not saved): an Allocate of it could reach the daemon before that op (the op's Step failed and it
is owed again, or a daemon came back between two Steps), and an Abort arriving after the new
Allocate would free the blocks a worker is then ordered to copy into, for another entry to take.

Allocate answering EXISTS (already cached), PENDING (another engine is writing it), NO_SPACE or an
error, or its Step failing, *cancels* the intent: the next metadata tells the worker to drop the
output it kept. A key is in at most one state. Only the saving rank's report moves a key out of
`copying`, so an entry is committed only after its bytes landed.

Why intents: the Allocate's answer cannot be waited for on the scheduler thread (docs/design.md
§12), and the extents are not known before it; the worker keeps the output (a reference to the
GPU tensor) one step longer instead, so nothing is lost while the answer travels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from ec_client.vllm.metadata import SaveOrder
from ec_protocol.types import AllocateResult, Status, TensorSpec

log = logging.getLogger("ec_client.vllm")


class SaveBook:
    def __init__(self) -> None:
        self._planned: dict[str, TensorSpec] = {}
        self._allocating: dict[str, TensorSpec] = {}
        self._ordered: dict[str, SaveOrder] = {}
        self._cancelled: set[str] = set()
        self._copying: set[str] = set()
        self._allocations: dict[str, int] = {}  # ordered or copying: the allocation's ID
        self._landed: dict[str, int] = {}  # key -> allocation
        self._failed: list[str] = []
        # Commits and aborts taken (sent) whose answer has not been heard: kept across `void`,
        # since their Step may still reach the daemon's new session.
        self._unanswered: set[str] = set()

    def plan(self, key: str, spec: TensorSpec) -> None:
        if self.saving(key) or key in self._failed:  # a key is in at most one state
            return
        self._planned[key] = spec

    def saving(self, key: str) -> bool:
        """Whether this engine encoded `key` and its save is on its way, from its plan to its
        commit's answer: vLLM's own encoder cache has the output (the scheduler's hold for a
        PENDING key is not for this one: LoadBook.admit)."""
        return (
            key in self._planned
            or key in self._allocating
            or key in self._ordered
            or key in self._copying
            or key in self._landed
            or key in self._unanswered
        )

    def take_planned(self) -> dict[str, TensorSpec]:
        """The step's planned saves, whose Allocate the caller sends: allocating from now on."""
        planned, self._planned = self._planned, {}
        self._allocating.update(planned)
        return planned

    def drop_planned(self) -> None:
        """The daemon is away, so no Allocate goes out: the step's planned saves are not saved.
        They were never intents (no metadata named them), so no worker keeps their outputs,
        and nothing of them is left for a later step."""
        self._planned.clear()

    def allocated(self, keys: Sequence[str], results: Sequence[AllocateResult]) -> None:
        """The answer to an Allocate of `keys`: orders for the next metadata, the rest
        cancelled."""
        for key, result in zip(keys, results, strict=True):
            spec = self._allocating.pop(key, None)
            if spec is None:
                continue  # voided meanwhile
            if result.status is Status.ALLOCATED:
                self._ordered[key] = SaveOrder(result.extents, spec)
                self._allocations[key] = result.allocation
                continue
            if result.status.is_error:
                log.warning("ecd refused to allocate %s: %s", key, result.message)
            self._cancelled.add(key)

    def give_up(self, keys: Iterable[str]) -> None:
        """Their Allocate did not reach the daemon: nothing is saved, the intents cancelled."""
        for key in keys:
            if self._allocating.pop(key, None) is not None:
                self._cancelled.add(key)

    def take_orders(self) -> tuple[dict[str, SaveOrder], set[str]]:
        """For this step's metadata: the copies to make now (copying from now on), and the
        intents that will not be saved."""
        orders, self._ordered = self._ordered, {}
        cancelled, self._cancelled = self._cancelled, set()
        self._copying.update(orders)
        return orders, cancelled

    def intents(self) -> set[str]:
        """The saves whose Allocate is on its way: the worker keeps their outputs."""
        return set(self._allocating)

    def report(self, saved: Iterable[str], failed: Iterable[str]) -> None:
        """The saving rank's report. Keys not being copied (a report from before a restart, or a
        repeated one) change nothing."""
        for key in saved:
            allocation = self._finish(key)
            if allocation is not None:
                self._landed[key] = allocation
        for key in failed:
            if self._finish(key) is not None:
                self._failed.append(key)

    def _finish(self, key: str) -> int | None:
        """The copy of `key` is over: its allocation, or None if it was not being copied."""
        if key not in self._copying:
            return None
        self._copying.discard(key)
        return self._allocations.pop(key)

    def take_landed(self) -> list[tuple[str, int]]:
        """The commits owed, (key, allocation), for the caller to send: no longer owed here,
        unanswered until `answered`."""
        landed, self._landed = self._landed, {}
        self._unanswered.update(landed)
        return list(landed.items())

    def take_failed(self) -> list[str]:
        """The aborts owed, for the caller to send: no longer owed here, unanswered until
        `answered`."""
        failed, self._failed = self._failed, []
        self._unanswered.update(failed)
        return failed

    def answered(self, key: str) -> None:
        """The Commit or Abort of `key` taken last was answered (or failed, and is owed again
        by `requeue` first): the key may be planned again."""
        self._unanswered.discard(key)

    def requeue(self, landed: Iterable[tuple[str, int]] = (), failed: Iterable[str] = ()) -> None:
        """Outbox again: a Commit or Abort did not reach the daemon (or, `failed`, an entry an
        answer from before a new session allocated for nobody): sent with the next Step."""
        self._landed.update(landed)
        self._failed.extend(failed)

    def void(self) -> None:
        """The daemon dropped our PENDING entries (it restarted, our session ended, or the pool
        was dropped): nothing left to commit or abort; every intent and order is cancelled."""
        self._cancelled.update(self._allocating, self._ordered)
        self._allocating.clear()
        self._ordered.clear()
        self._copying.clear()
        self._allocations.clear()
        self._landed.clear()
        self._failed.clear()

    def busy(self) -> bool:
        return bool(
            self._planned
            or self._allocating
            or self._ordered
            or self._cancelled
            or self._copying
            or self._landed
            or self._failed
        )
