"""SchedulerSide in-process (the vLLM scheduler side of ECDaemonConnector), handed a fake client:
the real Outbox whose Steps a fake daemon answers, and a ready view the test fills. Requests are
vLLM's own (ec_client.vllm.offline), as vLLM tests ECCPUScheduler with stand-in requests; the
end-to-end tests (tests/vllm) drive the same calls against a real daemon and real workers.

Proves: in an engine that saves, a miss the view answered is not asked (its count rides on the
next Step); in one that only
consumes, an item its view lacks is asked in one background Step (loaded, held while PENDING, or
encoded); an item READY whose slot is not known is
pinned by one background Step and its request admitted at the next call; a lease pin is released
once every loading rank reported; a landed save is committed at once and READY in the view, and
its commit on its way keeps the engine stepping no longer; what a
Step that did not reach the daemon carried is owed again, what the daemon refused is not; while
the daemon was never reached nothing is sent and every request is admitted, and once it is
reached the cache is used; a new session voids lease pins and fails the loads under them; at
shutdown what is owed (the hit and miss counts too) is sent before the client closes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from ecd_testing import count_record_parses, wait_until
from vllm.config import VllmConfig
from vllm.config.ec_transfer import ECRole
from vllm.v1.outputs import ECConnectorOutput

from ec_client.control.outbox import Outbox, OutboxBatch
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.metadata import ECDaemonWorkerMetadata, WorkerRank
from ec_client.vllm.offline import image_request, offline_config
from ec_client.vllm.scheduler import SchedulerSide
from ec_daemon.core.pool import PoolFile
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import Geometry, SlotRecord
from ec_protocol.types import (
    AcquireResult,
    AllocateItem,
    AllocateResult,
    ClusterStats,
    Extent,
    ItemResult,
    Key,
    LeaseResult,
    PoolInfo,
    Stats,
    Status,
    StepResult,
    TensorSpec,
)

WIDTH = 64
ROWS = 4
UNAVAILABLE = EcdError(grpc.StatusCode.UNAVAILABLE, "cannot reach ecd")


class FakeView:
    """The pool's READY keys as the test sets them (`ready`: key -> slot, None if not heard)."""

    def __init__(self) -> None:
        self.ready: dict[bytes, int | None] = {}
        self.writing: set[bytes] = set()  # PENDING: another engine is encoding them
        self.synced = True
        self.listeners: list[Callable[[bytes, int], None]] = []
        self.changes = 0
        self.waits: list[tuple[int, float]] = []  # wait_change's (since, timeout_s), in order

    def has(self, key: bytes) -> bool:
        return self.synced and key in self.ready

    def pending(self, key: bytes) -> bool:
        return self.synced and key in self.writing

    def wait_change(self, since: int, timeout_s: float) -> bool:
        self.waits.append((since, timeout_s))
        return since != self.changes

    def slot(self, key: bytes) -> int | None:
        return self.ready.get(key) if self.synced else None

    def add(self, key: bytes) -> None:
        self.ready.setdefault(key, None)

    def discard(self, key: bytes) -> None:
        self.ready.pop(key, None)

    def wait_synced(self, timeout_s: float) -> bool:
        return self.synced

    def on_committed(self, listener: Callable[[bytes, int], None]) -> None:
        self.listeners.append(listener)

    def committed(self, key: bytes, slot: int) -> None:
        """As the Watch event of an entry committed here comes (on the view's thread)."""
        self.ready[key] = slot
        for listener in self.listeners:
            listener(key, slot)

    def close(self) -> None:
        pass


@dataclass
class Sent:
    """One Step as the fake daemon received it."""

    releases: list[int]
    commits: list[tuple[bytes, int]]  # (key, the allocation it names)
    aborts: list[bytes]
    acquires: list[str]
    allocates: list[str]
    misses: int


class FakeClient:
    """A client of a fake daemon: the real Outbox (its thread sends every Step), each Step recorded
    and answered here: releases, commits, aborts OK; an acquire PENDING if the test put its key
    in `writing`, a HIT with the next lease ID if in `cached`, else a MISS; an allocate
    ALLOCATED, as allocation 1000, 1001, ... in the order asked (`allocations`). With `error`
    set, every Step fails with it."""

    def __init__(self) -> None:
        self.session_id = "session-1"
        self.target = "unix:///fake/ecd.sock"
        self.info = PoolInfo(
            "pool", "/nonexistent/pool", WIDTH * 2, 8192, 0, 0, "uuid-1", "", 0, True
        )
        self.fake_view = FakeView()
        self.cached: dict[str, TensorSpec] = {}
        self.writing: set[str] = set()  # keys an acquire finds PENDING (another engine's)
        self.error: EcdError | None = None
        self.sent: list[Sent] = []
        self.closed = False
        self.ephemeral: bool | None = None  # as the pool was opened
        self.namespace: str | None = None  # the cluster_namespace the pool was opened with
        self.store: ClusterStats | None = None  # Stats' cluster: the daemon's store, if any
        self.stats_asked = 0
        self._next_lease = 100
        self.allocations: dict[str, int] = {}  # key -> the allocation answered for it, last
        self.before_answer: Callable[[], None] = lambda: None  # as the daemon reads a Step
        self.answered_of = ""  # the pool file a Step's answer names (StepReply.pool_uuid)
        self.outbox = Outbox(self._send, linger_s=60.0)  # nothing goes alone during a test

    def _send(
        self,
        engine_id: str,
        batch: OutboxBatch,
        acquires: Sequence[Key],
        allocates: Sequence[AllocateItem],
    ) -> StepResult:
        self.before_answer()
        self.sent.append(
            Sent(
                batch.release_ids(),
                [(key, allocation) for key, _, allocation in batch.commit_items()],
                batch.abort_keys(),
                [str(k) for k in acquires],
                [str(item.key) for item in allocates],
                batch.answered.misses,
            )
        )
        if self.error is not None:
            batch.fail(self.error)
            raise self.error
        return batch.resolve(
            StepResult(
                [LeaseResult(d.lease_id, Status.OK, "") for d in batch.releases],
                [ItemResult(d.key, Status.OK, "") for d in batch.commits],
                [ItemResult(d.key, Status.OK, "") for d in batch.aborts],
                [self._acquire(str(k)) for k in acquires],
                [self._allocate(str(i.key)) for i in allocates],
                self.answered_of,
            )
        )

    def _allocate(self, key: str) -> AllocateResult:
        self.allocations[key] = 1000 + len(self.allocations)
        return AllocateResult(
            key.encode(), Status.ALLOCATED, "", (Extent(0, 1),), self.allocations[key]
        )

    def _acquire(self, key: str) -> AcquireResult:
        if key in self.writing:
            return AcquireResult(key.encode(), Status.PENDING, "", 0, (), None, 0)
        spec = self.cached.get(key)
        if spec is None:
            return AcquireResult(key.encode(), Status.MISS, "", 0, (), None, 0)
        self._next_lease += 1
        return AcquireResult(
            key.encode(), Status.HIT, "", self._next_lease, (Extent(0, 1),), spec, 0
        )

    # ---- what SchedulerSide calls ----

    def open_pool(
        self,
        engine_id: str,
        block_size_bytes: int,
        capacity_bytes: int,
        compat_key: str,
        ephemeral: bool = False,
        *,
        cluster_namespace: str = "",
    ) -> PoolInfo:
        self.ephemeral = ephemeral
        self.namespace = cluster_namespace
        return self.info

    def stats(self, engine_id: str = "") -> Stats:
        self.stats_asked += 1
        return Stats("epoch-1", 0.0, 0, 0, 0, 1, 0, "test", (), cluster=self.store)

    def pool_info(self, engine_id: str) -> PoolInfo:
        return self.info

    def view(self, engine_id: str) -> FakeView:
        return self.fake_view

    def flush(self, timeout_s: float | None = None) -> None:
        self.outbox.flush(timeout_s)

    def drop_pool(self, engine_id: str, force: bool = False) -> int:
        return 0

    def close(self, flush_timeout_s: float = 10.0) -> None:
        self.closed = True
        self.outbox.close()


def connector_config(
    role: ECRole, tp: int = 1, encoder_only: bool = False, **extra: object
) -> tuple[VllmConfig, ConnectorConfig]:
    vllm_config = offline_config(
        {"ecd_address": "unix:///fake/ecd.sock", "ec_cpu_bytes": 1 << 20, **extra},
        instance_id=f"test-{uuid.uuid4().hex[:8]}",
        role=role,
        width=WIDTH,
        tp=tp,
        encoder_only=encoder_only,
    )
    return vllm_config, ConnectorConfig.from_vllm(vllm_config)


@pytest.fixture
def client() -> Iterator[FakeClient]:
    fake = FakeClient()
    yield fake
    fake.outbox.close()


def scheduler(
    client: FakeClient,
    role: ECRole = "ec_both",
    tp: int = 1,
    encoder_only: bool = False,
    **extra: object,
) -> SchedulerSide:
    vllm_config, config = connector_config(role, tp, encoder_only, **extra)
    return SchedulerSide(vllm_config, config, connect=lambda: client)


def spec(side: SchedulerSide) -> TensorSpec:
    return TensorSpec((ROWS, WIDTH), side.config.dtype, ROWS * WIDTH * 2)


def report(
    side: SchedulerSide,
    saved: Sequence[str] = (),
    failed: Sequence[str] = (),
    loaded: Sequence[tuple[int, WorkerRank]] = (),
) -> None:
    meta = ECDaemonWorkerMetadata(list(saved), list(failed), list(loaded))
    side.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=meta))


def load_under_lease(side: SchedulerSide, client: FakeClient, key: str) -> int:
    """A cached `key` pinned by an Acquire and its copy ordered to the workers (request "r1"):
    the transfer ID."""
    client.fake_view.ready[key.encode()] = None
    client.cached[key] = spec(side)
    request = image_request("r1", [key], ROWS)
    assert not side.ensure_cache_available(request, 0)
    side.build_connector_meta()
    client.flush(5)
    assert side.ensure_cache_available(request, 0) and side.has_cache_item(key)
    side.update_state_after_alloc(request, 0)
    [order] = side.build_connector_meta().loads.values()
    return order.transfer_id


def save_ordered(side: SchedulerSide, client: FakeClient, key: str, request_id: str = "p1") -> None:
    """A new `key` encoded and saved: its Allocate answered, its copy ordered to the workers."""
    request = image_request(request_id, [key], ROWS)
    assert side.ensure_cache_available(request, 0) and not side.has_cache_item(key)
    side.update_state_after_alloc(request, 0)
    side.build_connector_meta()
    client.flush(5)
    assert key in side.build_connector_meta().saves


def test_a_private_pool_is_opened_ephemeral_so_that_an_engine_killed_leaks_it_not(
    client: FakeClient,
) -> None:
    scheduler(client)  # no ecd_pool: a per-run name nobody else knows
    assert client.ephemeral is True


def test_a_named_pool_is_not_opened_ephemeral_it_outlives_the_engine(client: FakeClient) -> None:
    vllm_config = offline_config(
        {"ecd_address": "unix:///fake/ecd.sock", "ec_cpu_bytes": 1 << 20, "ecd_pool": "shared"},
        instance_id=f"test-{uuid.uuid4().hex[:8]}",
        width=WIDTH,
    )
    SchedulerSide(vllm_config, ConnectorConfig.from_vllm(vllm_config), connect=lambda: client)
    assert client.ephemeral is False


STORE = ClusterStats("127.0.0.1:50051", True, "", 0, 0, 0, 0, 0, 0, 0)


def test_a_pool_is_shared_under_vllms_namespace_when_the_daemon_has_a_store(
    client: FakeClient,
) -> None:
    client.store = STORE
    side = scheduler(client)
    assert client.namespace == side.config.cluster_namespace
    assert client.namespace.startswith("embedding@model:offline/tiny-vlm@")


def test_in_a_pool_shared_through_a_store_a_new_item_is_asked_in_one_background_step(
    client: FakeClient,
) -> None:
    client.store = STORE
    side = scheduler(client)
    request = image_request("r1", ["img-new"], ROWS)
    assert not side.ensure_cache_available(request, 0)  # held: the store may have it
    assert client.sent == []  # nothing asked on the scheduler's call
    side.build_connector_meta()
    side.client.flush(5)  # type: ignore[union-attr]
    assert [sent.acquires for sent in client.sent] == [["img-new"]]
    assert side.ensure_cache_available(request, 0)  # a miss everywhere: encoded
    side.update_state_after_alloc(request, 0)
    side.build_connector_meta()  # its save's Allocate: a Step that would carry misses owed
    side.client.flush(5)  # type: ignore[union-attr]
    # The daemon counted the Acquire's miss: it is not owed again.
    assert [(sent.allocates, sent.misses) for sent in client.sent[1:]] == [(["img-new"], 0)]


def test_a_pool_stays_on_its_node_when_the_daemon_has_no_store(client: FakeClient) -> None:
    scheduler(client)
    assert client.namespace == ""


def test_an_empty_cluster_namespace_keeps_the_pool_on_its_node_whatever_the_daemon(
    client: FakeClient,
) -> None:
    client.store = STORE
    scheduler(client, ecd_cluster_namespace="")
    assert (client.namespace, client.stats_asked) == ("", 0)


def test_a_cluster_namespace_given_is_asked_as_it_is_with_no_stats(client: FakeClient) -> None:
    scheduler(client, ecd_cluster_namespace="team-a@embedding")
    assert (client.namespace, client.stats_asked) == ("team-a@embedding", 0)


def test_in_an_engine_that_saves_a_miss_the_view_answered_is_not_asked_and_rides_on_the_next_step(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_both")
    request = image_request("r1", ["img-new"], ROWS)
    assert side.ensure_cache_available(request, 0) and not side.has_cache_item("img-new")
    side.update_state_after_alloc(request, 0)
    assert client.sent == []
    side.build_connector_meta()
    client.flush(5)
    assert [s.acquires for s in client.sent if s.acquires] == []  # nothing was asked
    assert sum(s.misses for s in client.sent) == 1  # the miss's count, with the save's Allocate


def test_shutdown_sends_the_counts_owed_before_the_client_closes(client: FakeClient) -> None:
    side = scheduler(client, role="ec_both", ecd_pool="kept")  # a pool that stays
    request = image_request("r1", ["img-new"], ROWS)
    assert side.ensure_cache_available(request, 0)
    side.update_state_after_alloc(request, 0)  # a miss the view answered, owed
    side.shutdown()  # as vLLM's Scheduler.shutdown, the step cut short
    assert client.closed  # and this fake's close sends nothing
    assert sum(s.misses for s in client.sent) == 1


def consume(side: SchedulerSide, client: FakeClient, key: str) -> bool:
    """One step of a request (r1) for `key` in an engine whose view lacks it: its first pass is
    held, its Step answered; whether the next pass admits it."""
    request = image_request("r1", [key], ROWS)
    assert not side.ensure_cache_available(request, 0)  # held: the daemon is asked
    assert client.sent == [] or client.sent[-1].acquires != [key]  # not on this call
    side.build_connector_meta()
    client.flush(5)
    assert client.sent[-1].acquires == [key]
    return side.ensure_cache_available(request, 0)


def test_an_engine_that_only_consumes_loads_an_item_committed_before_its_view_heard_of_it(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_consumer")
    client.cached["img-a"] = spec(side)  # the encoder engine's commit; no Watch event yet
    assert consume(side, client, "img-a") and side.has_cache_item("img-a")


def test_an_item_whose_rows_are_not_the_models_width_is_encoded_never_loaded(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_consumer")
    rows = spec(side)  # another model's output under the key: the same bytes, half as wide
    client.cached["img-a"] = dataclasses.replace(rows, shape=(ROWS * 2, WIDTH // 2))
    assert consume(side, client, "img-a") and not side.has_cache_item("img-a")


def test_an_engine_that_only_consumes_holds_an_item_being_written_before_its_view_heard_of_it(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_consumer")
    client.writing.add("img-a")  # the encoder engine's Allocate; no Watch event yet
    assert not consume(side, client, "img-a")  # PENDING: held on
    client.fake_view.writing.add(b"img-a")  # the view hears of it
    request = image_request("r1", ["img-a"], ROWS)
    assert not side.ensure_cache_available(request, 0)
    client.fake_view.writing.discard(b"img-a")  # committed
    client.fake_view.ready[b"img-a"] = None
    client.writing.discard("img-a")
    client.cached["img-a"] = spec(side)
    side.build_connector_meta()
    client.flush(5)
    assert side.ensure_cache_available(request, 0) and side.has_cache_item("img-a")


def test_an_engine_that_only_consumes_encodes_an_item_the_daemon_lacks_too_and_owes_no_miss(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_consumer")
    assert consume(side, client, "img-new")  # a miss: encoded
    side.update_state_after_alloc(image_request("r1", ["img-new"], ROWS), 0)
    assert not side.has_cache_item("img-new")
    assert client.outbox.take(side.config.pool).answered.misses == 0  # the Acquire counted it


def test_an_item_ready_with_no_known_slot_is_acquired_in_one_background_step_and_its_request_admitted_at_the_next_call(  # noqa: E501
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_consumer")
    client.fake_view.ready[b"img-a"] = None  # committed a moment ago: its slot not heard yet
    client.cached["img-a"] = spec(side)
    request = image_request("r1", ["img-a"], ROWS)
    assert not side.ensure_cache_available(request, 0)  # held: its pin is on its way
    assert client.sent == []  # nothing asked of the daemon on the scheduler's call
    side.build_connector_meta()
    client.flush(5)
    assert [s.acquires for s in client.sent] == [["img-a"]]
    assert side.ensure_cache_available(request, 0) and side.has_cache_item("img-a")


def test_the_release_of_a_lease_pin_is_owed_once_every_loading_rank_reported(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_consumer", tp=2)
    transfer_id = load_under_lease(side, client, "img-a")
    assert [s.acquires for s in client.sent] == [["img-a"]]
    report(side, loaded=[(transfer_id, WorkerRank(0, 0))])
    side.request_finished(image_request("r1", ["img-a"], ROWS))
    client.flush(5)
    assert [s.releases for s in client.sent[1:]] == []  # rank 1 is still copying
    assert side.has_pending_push_work()
    report(side, loaded=[(transfer_id, WorkerRank(0, 1))])
    client.flush(5)
    assert [s.releases for s in client.sent[1:]] == [[client._next_lease]]
    assert not side.has_pending_push_work()


def test_an_encoder_engine_promises_an_item_the_pool_holds_and_orders_no_copy_of_it(
    client: FakeClient,
) -> None:
    """An encoder-only engine's workers never load (vLLM calls no start_load_caches there): a
    cached item needs no encode and no copy, its pin goes at once."""
    side = scheduler(client, role="ec_producer", encoder_only=True)
    client.fake_view.ready[b"img-a"] = None
    client.cached["img-a"] = spec(side)
    request = image_request("p1", ["img-a"], ROWS)
    assert not side.ensure_cache_available(request, 0)  # pinned in the background
    side.build_connector_meta()
    client.flush(5)
    assert side.ensure_cache_available(request, 0) and side.has_cache_item("img-a")
    side.update_state_after_alloc(request, 0)
    meta = side.build_connector_meta()
    client.flush(5)
    assert not meta.loads and not meta.saves and not meta.save_intents
    assert [s.releases for s in client.sent if s.releases] == [[client._next_lease]]
    assert not any(s.allocates for s in client.sent) and not side.has_pending_push_work()


def test_an_encoder_engine_holds_a_request_for_an_item_another_engine_is_writing(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_producer", encoder_only=True)
    client.fake_view.writing.add(b"img-a")
    request = image_request("p1", ["img-a"], ROWS)
    assert not side.ensure_cache_available(request, 0)
    client.fake_view.writing.discard(b"img-a")  # aborted: encoded here
    assert side.ensure_cache_available(request, 0) and not side.has_cache_item("img-a")


def test_an_encoder_engine_answers_a_request_only_once_the_daemon_has_its_entry_pending(
    client: FakeClient,
) -> None:
    """The disaggregated proxy sends the request on to the prefill/decode engine once the
    encoder engine answered it; that engine encodes an image the daemon has no entry for. So
    the answer (vLLM's, after request_finished) waits for the Allocate on its way."""
    side = scheduler(client, role="ec_producer", encoder_only=True)
    answering = threading.Event()
    client.before_answer = lambda: answering.wait(5)  # the daemon has not read the Step yet
    request = image_request("p1", ["img-a"], ROWS)
    assert side.ensure_cache_available(request, 0)
    side.update_state_after_alloc(request, 0)
    side.build_connector_meta()  # the Allocate goes out
    threading.Timer(0.1, answering.set).start()
    side.request_finished(request)
    assert [s.allocates for s in client.sent] == [["img-a"]]  # the daemon has it PENDING
    assert side.answer_waits == 1
    assert "img-a" in side.build_connector_meta().saves  # the answer was taken: copy ordered


def test_an_answer_whose_allocate_was_answered_during_the_forward_pass_waits_for_nothing(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_producer", encoder_only=True)
    request = image_request("p1", ["img-a"], ROWS)
    assert side.ensure_cache_available(request, 0)
    side.update_state_after_alloc(request, 0)
    side.build_connector_meta()
    client.flush(5)
    side.request_finished(request)
    assert side.answer_waits == 0


def test_the_answers_of_one_step_wait_for_its_allocate_no_longer_than_the_connect_timeout(
    client: FakeClient,
) -> None:
    """A daemon that does not answer delays the engine by ecd_connect_timeout_s at most, not
    that long per request: the next engine may then encode the images again, nothing worse."""
    side = scheduler(client, role="ec_producer", ecd_connect_timeout_s=1.0)
    answering = threading.Event()
    client.before_answer = lambda: answering.wait(10)
    requests = [image_request(f"p{i}", [f"img-{i}"], ROWS) for i in range(2)]
    for request in requests:
        assert side.ensure_cache_available(request, 0)
        side.update_state_after_alloc(request, 0)
    side.build_connector_meta()  # one Step allocates both
    started = time.monotonic()
    for request in requests:
        side.request_finished(request)
    waited = time.monotonic() - started
    assert side.answer_waits == 2 and client.sent == []  # answered with the Step unread
    assert 0.9 < waited < 1.7  # the Step's timeout once, not once per request (2 s)
    answering.set()


def test_a_request_for_an_item_this_engine_just_encoded_is_not_held_while_its_save_commits(
    client: FakeClient,
) -> None:
    side = scheduler(client)
    save_ordered(side, client, "img-a")  # p1 encoded it; its copy into our entry is ordered
    client.fake_view.writing.add(b"img-a")  # the view heard our own entry PENDING
    request = image_request("r2", ["img-a"], ROWS)
    # Admitted with no pin: vLLM finds the output in its own encoder cache first.
    assert side.ensure_cache_available(request, 0) and not side.has_cache_item("img-a")
    side.build_connector_meta()
    client.flush(5)
    assert [s.acquires for s in client.sent if s.acquires] == []  # nothing asked for it


def test_a_landed_saves_commit_is_sent_at_once_and_its_key_becomes_ready_in_the_view(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_producer")
    save_ordered(side, client, "img-a")
    assert [s.allocates for s in client.sent] == [["img-a"]]
    report(side, saved=["img-a"])
    client.flush(5)  # no build_connector_meta between: the report's own Step
    # naming the allocation the bytes were copied into, not whichever of the key is PENDING
    assert [s.commits for s in client.sent[1:]] == [[(b"img-a", client.allocations["img-a"])]]
    assert client.fake_view.has(b"img-a")


def test_a_commit_on_its_way_keeps_the_engine_stepping_no_longer(client: FakeClient) -> None:
    side = scheduler(client, role="ec_producer")
    save_ordered(side, client, "img-a")
    answering = threading.Event()
    client.before_answer = lambda: answering.wait(5)  # the daemon has not read the Step yet
    report(side, saved=["img-a"])
    assert not side.has_pending_push_work()  # Outbox's thread delivers it: no empty step
    answering.set()
    client.flush(5)
    assert [s.commits for s in client.sent[1:]] == [[(b"img-a", client.allocations["img-a"])]]
    assert client.fake_view.has(b"img-a")


def test_nothing_is_committed_before_the_workers_reported_the_copy_landed(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_producer")
    save_ordered(side, client, "img-a")
    side.build_connector_meta()
    client.flush(5)
    assert not any(s.commits for s in client.sent)
    assert side.has_pending_push_work()  # the copy is not reported yet


def test_a_failed_saves_abort_is_sent_at_once_and_its_key_never_becomes_ready(
    client: FakeClient,
) -> None:
    side = scheduler(client, role="ec_producer")
    save_ordered(side, client, "img-a")
    report(side, failed=["img-a"])
    client.flush(5)
    assert [s.aborts for s in client.sent[1:]] == [[b"img-a"]]
    assert not client.fake_view.has(b"img-a")


def test_a_step_that_did_not_reach_the_daemon_owes_its_releases_and_commits_again(
    client: FakeClient,
) -> None:
    side = scheduler(client)
    transfer_id = load_under_lease(side, client, "img-a")
    lease_id = client._next_lease
    save_ordered(side, client, "img-b")
    side.request_finished(image_request("r1", ["img-a"], ROWS))
    client.error = UNAVAILABLE
    report(side, saved=["img-b"], loaded=[(transfer_id, WorkerRank(0, 0))])
    client.flush(5)
    commit = (b"img-b", client.allocations["img-b"])
    assert (client.sent[-1].releases, client.sent[-1].commits) == ([lease_id], [commit])
    client.error = None  # the daemon is back
    assert side.has_pending_push_work()  # owed again
    side.build_connector_meta()
    client.flush(5)
    assert (client.sent[-1].releases, client.sent[-1].commits) == ([lease_id], [commit])
    assert client.fake_view.has(b"img-b") and not side.has_pending_push_work()


def test_a_key_is_not_allocated_again_while_its_abort_is_unanswered(client: FakeClient) -> None:
    """The Abort's Step fails and the Abort is owed again, but a Step asked meanwhile reaches
    the daemon first: an Allocate of the key there would be freed by the Abort that follows,
    under the copy its worker is ordered to make."""
    side = scheduler(client, role="ec_producer")
    save_ordered(side, client, "img-a")
    abort_read = threading.Event()
    steps = 0

    def daemon_away_then_back() -> None:
        nonlocal steps
        steps += 1
        if steps == 1:  # the Step carrying the Abort: it fails once read
            abort_read.wait(5)
            client.error = UNAVAILABLE
        else:
            client.error = None

    client.before_answer = daemon_away_then_back
    report(side, failed=["img-a"])  # its copy failed: the Abort goes
    again = image_request("p2", ["img-a"], ROWS)  # the same image, before the answer
    assert side.ensure_cache_available(again, 0)
    side.update_state_after_alloc(again, 0)
    side.build_connector_meta()
    abort_read.set()
    client.flush(5)
    for _ in range(3):  # the Abort owed again goes; then the key may be saved again
        side.ensure_cache_available(image_request("p3", ["img-a"], ROWS), 0)
        side.update_state_after_alloc(image_request("p3", ["img-a"], ROWS), 0)
        side.build_connector_meta()
        client.flush(5)
    aborts = [i for i, step in enumerate(client.sent) if b"img-a" in step.aborts]
    allocates = [i for i, step in enumerate(client.sent) if "img-a" in step.allocates]
    assert len(aborts) == 2  # failed once, then delivered
    allocated_again = min(i for i in allocates if i > aborts[0])
    assert allocated_again > aborts[-1]


def test_what_a_step_the_daemon_refused_carried_is_not_sent_again(client: FakeClient) -> None:
    side = scheduler(client, role="ec_producer")
    save_ordered(side, client, "img-a")
    client.error = EcdError(grpc.StatusCode.PERMISSION_DENIED, "consumers may not commit")
    report(side, saved=["img-a"])
    client.flush(5)
    client.error = None
    sent = len(client.sent)
    side.build_connector_meta()
    client.flush(5)
    assert len(client.sent) == sent and not side.has_pending_push_work()


def test_while_the_daemon_was_never_reached_every_request_is_admitted_and_nothing_is_sent() -> None:
    def unreachable() -> FakeClient:
        raise UNAVAILABLE

    vllm_config, config = connector_config("ec_both")
    side = SchedulerSide(vllm_config, config, connect=unreachable)
    request = image_request("r1", ["img-a"], ROWS)
    assert side.ensure_cache_available(request, 0) and not side.has_cache_item("img-a")
    side.update_state_after_alloc(request, 0)
    meta = side.build_connector_meta()
    assert meta.pool is None and not meta.saves and not meta.save_intents
    assert side.client is None and not side.rpcs and not side.has_pending_push_work()
    side.shutdown()


def test_a_daemon_reached_in_the_background_is_used_from_then_on(client: FakeClient) -> None:
    tries: list[int] = []

    def connect() -> FakeClient:
        tries.append(1)
        if len(tries) == 1:
            raise UNAVAILABLE  # not started yet
        return client

    vllm_config, config = connector_config("ec_consumer")
    side = SchedulerSide(vllm_config, config, connect=connect)
    wait_until(lambda: side.view.synced, timeout_s=5)
    client.fake_view.ready[b"img-a"] = None
    client.cached["img-a"] = spec(side)
    assert not side.ensure_cache_available(image_request("r1", ["img-a"], ROWS), 0)
    side.build_connector_meta()
    client.flush(5)
    assert [s.acquires for s in client.sent] == [["img-a"]]
    side.shutdown()
    assert client.closed


def test_a_new_session_voids_lease_pins(client: FakeClient) -> None:
    side = scheduler(client, role="ec_consumer")
    transfer_id = load_under_lease(side, client, "img-a")
    sent = len(client.sent)
    client.session_id = "session-2"  # the daemon restarted: our lease pins are gone
    assert side.take_unavailable_requests() == {"r1"}  # its load may have read evicted bytes
    assert not side.has_cache_item("img-a")
    report(side, loaded=[(transfer_id, WorkerRank(0, 0))])
    side.request_finished(image_request("r1", ["img-a"], ROWS))
    side.build_connector_meta()
    client.flush(5)
    assert len(client.sent) == sent  # nothing released: the new session holds no such pin


def test_an_answer_from_before_a_new_session_gives_back_what_it_took(client: FakeClient) -> None:
    side = scheduler(client, role="ec_consumer")
    client.fake_view.ready[b"img-a"] = None
    client.cached["img-a"] = spec(side)
    request = image_request("r1", ["img-a"], ROWS)
    assert not side.ensure_cache_available(request, 0)
    side.build_connector_meta()
    client.flush(5)
    first_lease = client._next_lease
    client.session_id = "session-2"  # a restart between the Step's answer and its reading
    # Its pin is not ours to use: the request encodes the item, and the pin goes back.
    assert side.ensure_cache_available(request, 0) and not side.has_cache_item("img-a")
    side.build_connector_meta()
    client.flush(5)
    assert client.sent[-1].releases == [first_lease] and client.sent[-1].acquires == []


@pytest.mark.parametrize("named", [True, False], ids=["the answer names its file", "it does not"])
def test_an_answer_from_a_pool_recreated_before_the_daemon_read_the_step_pins_nothing(
    client: FakeClient, tmp_path: Path, named: bool
) -> None:
    # The client learns of a recreated pool only when it reopens it: until then an answer of
    # the same session may come from the new file, whose extents the workers do not map. The
    # daemon names the file it answered of; where it cannot, the path's file is looked at.
    geometry = Geometry(WIDTH * 2, num_blocks=64, num_slots=8)
    pool = PoolFile.create(tmp_path, "pool", geometry, "model", 0o600, None)
    pool.close()
    client.info = dataclasses.replace(
        client.info, path=str(pool.path), pool_uuid=str(pool.header.pool_uuid)
    )
    side = scheduler(client)

    def recreated() -> None:  # once, as the daemon reads the first Step
        client.before_answer = lambda: None
        pool.path.unlink()
        new = PoolFile.create(tmp_path, "pool", geometry, "model", 0o600, None)
        new.close()
        if named:
            client.answered_of = str(new.header.pool_uuid)

    client.before_answer = recreated
    client.fake_view.ready[b"img-a"] = None  # pinned by an Acquire
    client.cached["img-a"] = spec(side)
    cached, new = image_request("r1", ["img-a"], ROWS), image_request("r2", ["img-b"], ROWS)
    assert not side.ensure_cache_available(cached, 0)
    assert side.ensure_cache_available(new, 0)
    side.update_state_after_alloc(new, 0)  # to encode and save
    side.build_connector_meta()
    client.flush(5)
    assert side.ensure_cache_available(cached, 0) and not side.has_cache_item("img-a")
    meta = side.build_connector_meta()
    assert not meta.saves and not meta.loads
    client.flush(5)
    # The first flush may send the counted miss alone before Outbox's thread sends the ask.
    [asked] = [sent for sent in client.sent if sent.acquires]
    given_back = client.sent[-1]
    assert asked.acquires == ["img-a"] and asked.allocates == ["img-b"]
    assert given_back.releases == [client._next_lease] and given_back.aborts == [b"img-b"]


def test_an_answer_that_comes_during_a_pass_is_taken_when_the_pass_ends(
    client: FakeClient,
) -> None:
    # Answers are taken once a pass, at its first request: its later requests would find
    # nothing new, at a cost each. What comes meanwhile waits for build_connector_meta.
    side = scheduler(client, role="ec_both")  # its miss of img-new answered by the view
    client.fake_view.ready[b"img-a"] = None  # pinned by an Acquire
    client.cached["img-a"] = spec(side)
    waiting = image_request("r1", ["img-a"], ROWS)
    assert not side.ensure_cache_available(waiting, 0)
    side.build_connector_meta()
    assert side.ensure_cache_available(image_request("r0", ["img-new"], ROWS), 0)  # a new pass
    client.flush(5)  # the Acquire's answer comes in the middle of the pass
    assert not side.ensure_cache_available(waiting, 0)
    side.build_connector_meta()  # ends the pass: takes it
    assert side.ensure_cache_available(waiting, 0) and side.has_cache_item("img-a")


def test_an_entry_heard_committed_is_read_ahead_so_that_its_lock_pin_parses_nothing(
    client: FakeClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = PoolFile.create(
        tmp_path, "pool", Geometry(WIDTH * 2, num_blocks=64, num_slots=8), "model", 0o600, None
    )
    client.info = dataclasses.replace(
        client.info, path=str(pool.path), pool_uuid=str(pool.header.pool_uuid)
    )
    side = scheduler(client, role="ec_consumer")
    entry = spec(side)
    pool.write_slot(
        3, SlotRecord(b"img-a", entry.dtype, entry.shape, entry.nbytes, 0, 1, ((0, ROWS),))
    )
    parsed = count_record_parses(monkeypatch)
    client.fake_view.committed(b"img-a", 3)
    assert parsed == [b"img-a"]  # read ahead, on the view's thread
    request = image_request("r1", ["img-a"], ROWS)
    assert side.ensure_cache_available(request, 0) and side.has_cache_item("img-a")
    assert parsed == [b"img-a"]  # the lock pin found the same bytes under its lock: no parse
    assert pool.slot_locked(3)
    side.shutdown()
    pool.close()


def test_a_step_with_nothing_to_run_waits_for_the_view_while_a_request_is_held_for_an_encode(
    client: FakeClient,
) -> None:
    side = scheduler(client)
    client.fake_view.writing.add(b"img")
    side.build_connector_meta(scheduled_nothing=True)  # the step before: nothing either
    client.fake_view.changes = 7  # as the pass begins
    assert not side.ensure_cache_available(image_request("r1", ["img"], ROWS), 0)
    side.build_connector_meta(scheduled_nothing=True)
    assert client.fake_view.waits == [(7, side.config.idle_wait_s)]


def test_the_first_empty_step_after_one_that_ran_requests_does_not_wait(
    client: FakeClient,
) -> None:
    side = scheduler(client)  # async scheduling: that step's outputs are still to be handled
    client.fake_view.writing.add(b"img")
    side.build_connector_meta(scheduled_nothing=False)
    assert not side.ensure_cache_available(image_request("r1", ["img"], ROWS), 0)
    side.build_connector_meta(scheduled_nothing=True)
    assert client.fake_view.waits == []


def test_a_step_that_runs_something_never_waits_for_the_view(client: FakeClient) -> None:
    side = scheduler(client)
    client.fake_view.writing.add(b"img")
    side.build_connector_meta(scheduled_nothing=True)
    assert not side.ensure_cache_available(image_request("r1", ["img"], ROWS), 0)
    side.build_connector_meta(scheduled_nothing=False)
    assert client.fake_view.waits == []


def test_a_step_with_nothing_held_never_waits_for_the_view(client: FakeClient) -> None:
    side = scheduler(client)
    side.build_connector_meta(scheduled_nothing=True)
    assert side.ensure_cache_available(image_request("r1", ["img"], ROWS), 0)
    side.build_connector_meta(scheduled_nothing=True)
    assert client.fake_view.waits == []


def test_a_step_whose_pins_are_on_their_way_does_not_wait_for_the_view(
    client: FakeClient,
) -> None:
    side = scheduler(client)
    client.fake_view.ready[b"img"] = None  # READY, its slot not heard yet: an Acquire pins it
    client.cached["img"] = spec(side)
    side.build_connector_meta(scheduled_nothing=True)
    assert not side.ensure_cache_available(image_request("r1", ["img"], ROWS), 0)
    side.build_connector_meta(scheduled_nothing=True)
    assert client.fake_view.waits == []
