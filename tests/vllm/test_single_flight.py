"""Single flight across engines: an image another engine on the node is encoding is waited for,
however long its encode takes, and loaded, not encoded again; the waiting engine does not spin.

Two `ec_both` engines on one pool by name. "Another engine is encoding it" is the first engine
having scheduled the encode (its Allocate answered: PENDING in the pool, heard by the second
engine's view a moment later) and not yet committed it: the test holds the first engine's
workers back for longer than the 2 s the connector used to wait, as a real encoder under load, a
video or a queue in front of the encoder would. A producer process SIGKILLed with the item
PENDING lets the waiter encode at once, not one lease later.
"""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
from ecd_testing import Daemon, python_killed_after, wait_until
from vllm_testing import LONG_ENCODE_S, EngineFactory, digest, encoder_output, held_while, request

SHARED = "node-pool"


@pytest.mark.parametrize("offset_s", [0.0, 0.5])
def test_two_engines_given_one_new_image_encode_it_once_the_second_loads_it(
    engine: EngineFactory, offset_s: float
) -> None:
    first = engine(role="ec_both", pool=SHARED)
    second = engine(role="ec_both", pool=SHARED)
    encoding = first.schedule([request("a1", "img")])
    assert encoding.encode == {"img": 16}
    first.answered()  # allocated: PENDING
    wait_until(lambda: second.scheduler.view.pending(b"img"))
    time.sleep(offset_s)  # the second request comes this long into the first one's encode
    held_while(second, "b1", LONG_ENCODE_S)
    first.finish(first.run(encoding))
    first.flush()
    wait_until(lambda: second.scheduler.view.has(b"img"))
    _, result = second.admit(request("b1", "img"))
    assert result.step.load == {"img"} and not result.step.encode
    assert result.loaded == {"img": digest(encoder_output("img"))}


def test_an_engine_holding_a_request_for_anothers_encode_steps_about_twenty_times_a_second(
    engine: EngineFactory,
) -> None:
    first = engine(role="ec_both", pool=SHARED)
    second = engine(role="ec_both", pool=SHARED)  # ecd_idle_wait_ms: 50 by default
    first.schedule([request("a1", "img")])
    first.answered()
    wait_until(lambda: second.scheduler.view.pending(b"img"))
    steps = held_while(second, "b1", 1.0)
    assert steps <= 25  # 1 s / 50 ms, and a little for the steps' own time
    assert second.scheduler.idle_waits >= steps - 1  # all but the first empty step waited


def test_the_commit_an_engine_waits_for_wakes_it_at_once(engine: EngineFactory) -> None:
    first = engine(role="ec_both", pool=SHARED)
    # An idle wait far longer than the test: only the commit can end it in time.
    second = engine(role="ec_both", pool=SHARED, extra={"ecd_idle_wait_ms": 30000})
    encoding = first.schedule([request("a1", "img")])
    first.answered()
    wait_until(lambda: second.scheduler.view.pending(b"img"))
    second.schedule()  # an empty step before: the next empty one may wait
    woke: list[float] = []
    idle = threading.Thread(
        target=lambda: (second.schedule([request("b1", "img")]), woke.append(time.monotonic()))
    )
    idle.start()
    wait_until(lambda: second.scheduler.idle_waits == 1)
    first.finish(first.run(encoding))
    first.flush()  # its save ordered, landed and committed: the event is on its way
    committed_at = time.monotonic()
    idle.join(timeout=10)
    assert woke and woke[0] - committed_at < 0.5
    _, result = second.admit(request("b1", "img"))
    assert result.step.load == {"img"}


def test_a_producer_killed_mid_encode_lets_the_waiting_engine_encode_at_once(
    engine: EngineFactory, daemon: Daemon
) -> None:
    code = textwrap.dedent(f"""
        import time
        from vllm_testing import Engine, EngineSpec, request
        producer = Engine(EngineSpec({daemon.address!r}, role="ec_both", pool={SHARED!r}))
        producer.schedule([request("a1", "img")])
        producer.answered()
        print("encoding", flush=True)
        time.sleep(120)
    """)
    with python_killed_after(code, "encoding"):
        waiter = engine(role="ec_both", pool=SHARED)
        wait_until(lambda: waiter.scheduler.view.pending(b"img"))
        held_while(waiter, "b1", 0.5)  # the daemon has seen the producer's life mark by now
    killed_at = time.monotonic()
    steps, result = waiter.admit(request("b1", "img"), max_steps=100)
    encoded_after = time.monotonic() - killed_at
    assert result.step.encode == {"img": 16}
    assert encoded_after < 1.0, f"{steps} steps"  # the daemon's lease (2 s here) is not waited
