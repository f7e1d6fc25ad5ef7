"""Two engines on one node sharing one pool by name (`ecd_pool`): an encoder engine
(ec_producer) and a prefill/decode engine (ec_consumer), with no network transfer at all.

Proves: the consumer loads what the producer saved, bit-identical, without encoding it; it
waits for an item the producer is writing (PENDING in the pool) instead of encoding it twice,
by default, and with ecd_wait_ms also for an item the producer has not even allocated yet; it
asks the daemon about an item its view has not heard of (loaded if committed, waited for if
being written, encoded after one held step if the daemon lacks it too); a
producer does not save what the pool has; an engine that could misread the pool (other model,
width or capacity) is refused at start with a message that says why; unnamed pools are private
to their engine and dropped when it stops.
"""

from __future__ import annotations

from typing import Any

import pytest
from ecd_testing import Daemon, wait_until
from vllm_testing import EngineFactory, digest, encoder_output, request

from ec_client.vllm.scheduler import PoolRefused, PoolView

SHARED = "node-pool"


def test_a_consumer_engine_loads_what_a_producer_engine_saved_through_the_shared_pool(
    engine: EngineFactory,
) -> None:
    producer = engine(role="ec_producer", pool=SHARED)
    consumer = engine(role="ec_consumer", pool=SHARED)
    produced = producer.step(request("p1", "img-a"))
    assert produced.step.encode == {"img-a": 16}
    producer.flush()
    wait_until(lambda: consumer.scheduler.view.has(b"img-a"))
    _, result = consumer.admit(request("c1", "img-a"))
    assert not result.step.encode
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}


def test_a_consumer_with_ecd_wait_ms_waits_for_an_item_the_producer_is_still_encoding(
    engine: EngineFactory,
) -> None:
    producer = engine(role="ec_producer", pool=SHARED)
    consumer = engine(role="ec_consumer", pool=SHARED, extra={"ecd_wait_ms": "10000"})
    waiting = request("c1", "img-a")
    assert consumer.step(waiting).step.held == {"c1"}  # not in the pool: wait for it
    producer.save("p1", "img-a")
    wait_until(lambda: consumer.scheduler.view.has(b"img-a"))
    _, result = consumer.admit(waiting)
    assert result.step.load == {"img-a"} and not result.step.encode


def test_a_consumer_waits_for_an_item_the_producer_is_writing_and_loads_it(
    engine: EngineFactory,
) -> None:
    producer = engine(role="ec_producer", pool=SHARED)
    consumer = engine(role="ec_consumer", pool=SHARED)
    encoding = producer.schedule([request("p1", "img-a")])
    producer.answered()  # allocated: PENDING in the pool, the copy still to come
    wait_until(lambda: consumer.scheduler.view.pending(b"img-a"))
    waiting = request("c1", "img-a")
    assert consumer.step(waiting).step.held == {"c1"}  # not encoded: its save is on its way
    producer.finish(producer.run(encoding))
    producer.flush()
    wait_until(lambda: consumer.scheduler.view.has(b"img-a"))
    _, result = consumer.admit(waiting)
    assert result.step.load == {"img-a"} and not result.step.encode
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}


def test_a_consumer_without_ecd_wait_ms_encodes_an_item_the_daemon_lacks_after_one_held_step(
    engine: EngineFactory,
) -> None:
    consumer = engine(role="ec_consumer", pool=SHARED)
    held, result = consumer.admit(request("c1", "img-a"))
    assert held == 1  # asked of the daemon in the background
    assert result.step.encode == {"img-a": 16} and not result.step.metadata.saves


class Unheard:
    """A view that has not heard of `key` yet (its Watch events on their way, as under load
    after the encoder engine answered): the lag the tests cannot bring about on cue."""

    def __init__(self, view: PoolView, key: bytes) -> None:
        self._view, self._key = view, key

    def has(self, key: bytes) -> bool:
        return key != self._key and self._view.has(key)

    def pending(self, key: bytes) -> bool:
        return key != self._key and self._view.pending(key)

    def slot(self, key: bytes) -> int | None:
        return None if key == self._key else self._view.slot(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


def test_a_consumer_whose_view_has_not_heard_of_a_committed_item_loads_it(
    engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = engine(role="ec_producer", pool=SHARED)
    consumer = engine(role="ec_consumer", pool=SHARED)
    producer.save("p1", "img-a")
    monkeypatch.setattr(
        consumer.scheduler.connection, "view", Unheard(consumer.scheduler.view, b"img-a")
    )
    held, result = consumer.admit(request("c1", "img-a"))
    assert held == 1 and not result.step.encode
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}


def test_a_consumer_whose_view_has_not_heard_of_an_item_being_written_waits_for_it(
    engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = engine(role="ec_producer", pool=SHARED)
    consumer = engine(role="ec_consumer", pool=SHARED)
    encoding = producer.schedule([request("p1", "img-a")])
    producer.answered()  # allocated: PENDING in the pool
    monkeypatch.setattr(
        consumer.scheduler.connection, "view", Unheard(consumer.scheduler.view, b"img-a")
    )
    waiting = request("c1", "img-a")
    assert consumer.step(waiting).step.held == {"c1"}  # asked
    assert consumer.step(waiting).step.held == {"c1"}  # answered PENDING: held on
    producer.finish(producer.run(encoding))
    producer.flush()
    _, result = consumer.admit(waiting)
    assert result.step.load == {"img-a"} and not result.step.encode
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}


def test_a_producer_does_not_save_an_item_the_pool_already_has(engine: EngineFactory) -> None:
    first = engine(role="ec_producer", pool=SHARED)
    second = engine(role="ec_producer", pool=SHARED)
    first.save("p1", "img-a")
    wait_until(lambda: second.scheduler.view.has(b"img-a"))
    before = second.scheduler.rpcs.copy()
    result = second.step(request("p2", "img-a"))  # a producer encodes whatever it is sent
    assert result.step.encode and not result.step.metadata.saves
    assert second.scheduler.rpcs == before


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("model", "other-org/other-vlm", "compat_key"),
        ("width", 128, "block_size_bytes"),
        ("capacity", 2 << 20, "num_blocks"),
    ],
)
def test_an_engine_that_would_misread_a_shared_pool_is_refused_with_a_clear_error(
    engine: EngineFactory, field: str, value: object, reason: str
) -> None:
    engine(workers=False, pool=SHARED)
    with pytest.raises(PoolRefused) as refused:
        engine(workers=False, pool=SHARED, **{field: value})
    message = str(refused.value)
    assert reason in message and SHARED in message and "ecd_pool" in message


def test_an_unnamed_pool_is_private_to_its_engine_and_dropped_when_it_stops(
    engine: EngineFactory, daemon: Daemon
) -> None:
    first, second = engine(workers=False), engine(workers=False)
    assert first.pool != second.pool
    assert first.pool == f"{first.spec.instance_id}_dp0"  # vLLM's naming
    first.close()
    with daemon.client() as c:
        assert {p.engine_id for p in c.stats().pools} == {second.pool}
