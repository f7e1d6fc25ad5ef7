"""TensorMover on the CPU, and what Producer and Consumer do with copies still in flight.

GPU copies finish after the call that launched them; here a launched copy is made "in flight"
by giving its Transfer an event stand-in that records when it is waited for.

Proves: a mover refuses tensors on another device than its own; a put that fails part-way
waits for the copies it launched before it aborts its entries, and a get's pins go back only once
its copies landed (a late copy would land in blocks handed to someone else, or read blocks being
rewritten); a get's loads are all checked before the first copy, so a refused one copies nothing
and gives its pins back at once; a failed wait does not stop the others from being waited for
first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
import pytest
import torch
from ecd_testing import Daemon, wait_until

from ec_client import Client, Consumer, EcdError, EntryState, Producer
from ec_client.control._session import Send
from ec_client.data.mapping import PoolMapping
from ec_client.data.mover import LARGE_COPY, Load, TensorMover, Transfer
from ec_protocol.pool.slot_locks import SlotPins
from ec_protocol.types import Extent, TensorSpec

POOL = "mover"
BLOCK = 4096


@pytest.fixture
def client(daemon: Daemon) -> Client:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 256 * BLOCK)
        yield c  # type: ignore[misc]


class InFlight:
    """An event stand-in: not fired until waited for; the wait is logged, and may fail."""

    def __init__(self, name: str, log: list[str], fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.log.append(f"landed {self.name}")
        if self.fails:
            raise RuntimeError(f"CUDA error while copying {self.name}")


def launches(
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    log: list[str],
    refused: str | None = "2",
    failing: Sequence[str] = (),
) -> None:
    """TensorMover.`method` copies for real, then reports its copy as still in flight. Copies
    are named by call number; the `refused` one raises before copying, the `failing` ones fail
    when waited for."""
    real: Callable[..., Any] = getattr(TensorMover, method)
    calls: list[int] = []

    def launch(self: TensorMover, *args: Any) -> Any:
        calls.append(1)
        name = str(len(calls))
        if name == refused:
            raise ValueError(f"copy {name} cannot start")
        result = real(self, *args)
        fence = InFlight(name, log, fails=name in failing)
        if isinstance(result, Transfer):
            return Transfer(fence)
        return result[0], Transfer(fence)

    monkeypatch.setattr(TensorMover, method, launch)


def logging_rpcs(client: Client, monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
    """Log "abort" and "release" when a call carrying them goes to the daemon, on its own or
    as a part of a Step (where a client's owed aborts and releases ride)."""
    real = client._do

    def do(step: Any) -> Any:
        call = step.call if isinstance(step, Send) else None
        if call is not None and call.method in ("Abort", "Release"):
            log.append(call.method.lower())
        elif call is not None and call.method == "Step":
            request = call.build(step.session_id)
            log.extend(part for part in ("abort", "release") if getattr(request, part + "s"))
        return real(step)

    monkeypatch.setattr(client, "_do", do)


def lock_pinning(client: Client, tensors: dict[str, torch.Tensor]) -> Consumer:
    """Commit `tensors`; returns a Consumer whose view knows each one's slot, so that a get
    of them lock-pins here (no Acquire, no Release)."""
    consumer = Consumer(client, POOL)
    Producer(client, POOL).put_many(tensors)
    client.flush(10)
    view = client.view(POOL)
    wait_until(lambda: view.slots_known(tensors))
    return consumer


def logging_unlocks(
    client: Client, monkeypatch: pytest.MonkeyPatch, log: list[str], keys: Sequence[str]
) -> None:
    """Log "unlock <key>" for each lock pin given back (`SlotPins.unpin_many`, which `unpin`
    calls too), the key of the slot read from the client's view."""
    view = client.view(POOL)
    key_of = {view.slot(key.encode()): key for key in keys}
    real = SlotPins.unpin_many

    def unpin_many(self: SlotPins, slots: Iterable[int]) -> None:
        slots = list(slots)
        log.extend(f"unlock {key_of[slot]}" for slot in slots)
        real(self, slots)

    monkeypatch.setattr(SlotPins, "unpin_many", unpin_many)


def test_a_mover_refuses_a_tensor_on_another_device(client: Client) -> None:
    mover = TensorMover(PoolMapping.open(client.pool_info(POOL)), "cpu")
    with pytest.raises(ValueError, match="on meta"):
        mover.save(torch.empty(16, device="meta"), [Extent(0, 1)])
    spec = TensorSpec((16,), "float32", 64)
    with pytest.raises(ValueError, match="on meta"):
        mover.load([Extent(0, 1)], spec, out=torch.empty(16, device="meta"))


@pytest.mark.parametrize("first_extent_bytes", [LARGE_COPY - BLOCK, LARGE_COPY])
def test_a_host_copy_small_or_large_keeps_every_byte(
    daemon: Daemon, first_extent_bytes: int
) -> None:
    # One copy per extent: the first one below LARGE_COPY goes through numpy, at it through
    # torch; the second extent, after a gap, is small and its last block partly used.
    nbytes = first_extent_bytes + 3 * BLOCK + 5
    with daemon.client() as c:
        c.open_pool("large", BLOCK, 2 * nbytes)
        mover = TensorMover(PoolMapping.open(c.pool_info("large")), "cpu")
        first = first_extent_bytes // BLOCK
        extents = [Extent(1, first), Extent(first + 3, 4)]
        tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        mover.save(tensor, extents).wait()
        loaded, transfer = mover.load(extents, TensorSpec((nbytes,), "uint8", nbytes))
        transfer.wait()
        assert torch.equal(loaded, tensor)


def test_a_put_that_fails_part_way_aborts_only_after_its_launched_copies_landed(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    launches(monkeypatch, "save", log)
    logging_rpcs(client, monkeypatch, log)
    tensors = {k: torch.full((1024,), i) for i, k in enumerate(["a", "b", "c"])}
    with pytest.raises(ValueError, match="copy 2 cannot"):
        Producer(client, POOL).put_many_async(tensors)
    assert log == ["landed 1", "abort"]
    assert [r.state for r in client.lookup(POOL, list(tensors))] == [EntryState.ABSENT] * 3


def test_a_get_whose_loads_are_refused_copies_nothing_and_releases_its_leases_at_once(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    Producer(client, POOL).put_many({k: torch.full((1024,), 7) for k in ["a", "b", "c"]})
    log: list[str] = []
    launches(monkeypatch, "load_many", log, refused="1")
    logging_rpcs(client, monkeypatch, log)
    with pytest.raises(ValueError, match="copy 1 cannot"):
        Consumer(client, POOL, watch=False).get_many_async(["a", "b", "c"])  # daemon pins
    assert log == ["release"]  # no copy was launched: nothing to wait for
    assert client.stats(POOL).pools[0].pins == 0


def test_a_get_whose_loads_are_refused_copies_nothing_and_unlocks_its_slots_at_once(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = lock_pinning(client, {k: torch.full((1024,), 7) for k in ["a", "b", "c"]})
    log: list[str] = []
    launches(monkeypatch, "load_many", log, refused="1")
    logging_unlocks(client, monkeypatch, log, ["a", "b", "c"])
    logging_rpcs(client, monkeypatch, log)
    with pytest.raises(ValueError, match="copy 1 cannot"):
        consumer.get_many_async(["a", "b", "c"])
    assert sorted(log) == ["unlock a", "unlock b", "unlock c"]
    assert consumer.endpoint.pins().held() == 0


def test_a_load_batch_with_one_unfit_out_copies_nothing(client: Client) -> None:
    """Every load of a batch is checked before the first copy: a refused batch leaves each
    `out` as it was (a get that raises has filled none of the caller's tensors)."""
    mover = TensorMover(PoolMapping.open(client.pool_info(POOL)), "cpu")
    mover.save(torch.full((BLOCK,), 7, dtype=torch.uint8), [Extent(0, 1)]).wait()
    spec = TensorSpec((BLOCK,), "uint8", BLOCK)
    fits, unfit = torch.zeros(BLOCK, dtype=torch.uint8), torch.zeros(BLOCK, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected a contiguous"):
        mover.load_many([Load([Extent(0, 1)], spec, fits), Load([Extent(0, 1)], spec, unfit)])
    assert not fits.any()
    tensors, transfer = mover.load_many([Load([Extent(0, 1)], spec, fits)])
    transfer.wait()
    assert tensors[0] is fits and bool((fits == 7).all())


def test_a_failed_save_copy_is_aborted_after_the_batchs_other_copies_landed(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    launches(monkeypatch, "save", log, refused=None, failing=["1"])
    logging_rpcs(client, monkeypatch, log)
    producer = Producer(client, POOL)
    handle = producer.put_many_async({k: torch.zeros(1024) for k in ["a", "b", "c"]})
    with pytest.raises(EcdError, match="copying 1") as failed:
        handle.wait(10)
    assert failed.value.code == grpc.StatusCode.DATA_LOSS
    assert log == ["landed 1", "landed 2", "landed 3", "abort"]
    # The copies that landed are committed: one bad copy does not sink the others.
    states = [r.state for r in client.lookup(POOL, ["a", "b", "c"])]
    assert states == [EntryState.ABSENT, EntryState.READY, EntryState.READY]
    assert producer.failed_commits == 1


def test_a_failed_load_copy_releases_the_pins_only_after_it_landed(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    Producer(client, POOL).put_many({k: torch.zeros(1024) for k in ["a", "b", "c"]})
    client.flush(10)
    log: list[str] = []
    launches(monkeypatch, "load_many", log, refused=None, failing=["1"])
    logging_rpcs(client, monkeypatch, log)
    handle = Consumer(client, POOL, watch=False).get_many_async(["a", "b", "c"])  # daemon pins
    client.flush(10)  # the release runs in the background once the copies landed
    assert log == ["landed 1", "release"]
    with pytest.raises(RuntimeError, match="copying 1"):
        handle.wait()
    assert client.stats(POOL).pools[0].pins == 0


def test_a_failed_load_copy_unlocks_the_slots_only_after_it_landed(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = lock_pinning(client, {k: torch.zeros(1024) for k in ["a", "b", "c"]})
    log: list[str] = []
    launches(monkeypatch, "load_many", log, refused=None, failing=["1"])
    logging_unlocks(client, monkeypatch, log, ["a", "b", "c"])
    logging_rpcs(client, monkeypatch, log)
    handle = consumer.get_many_async(["a", "b", "c"])
    client.flush(10)  # the unlocks run in the background once the copies landed
    assert log[0] == "landed 1"
    assert sorted(log[1:]) == ["unlock a", "unlock b", "unlock c"]
    with pytest.raises(RuntimeError, match="copying 1"):
        handle.wait()
    assert consumer.endpoint.pins().held() == 0
