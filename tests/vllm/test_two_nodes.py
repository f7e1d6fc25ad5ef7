"""Two engines on two nodes: an encoder engine (ec_producer) on one daemon, a prefill/decode
engine (ec_consumer) on another, the daemons peers of each other (docs/design.md §13). The connector
needs no setting of its own for it: its ready view counts what the peer holds, and the items
are pulled by the pins it takes in the background, never by a round trip on the scheduler
thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ecd_testing import Daemon, wait_until
from peer_testing import needs_mooncake, peered_daemons
from vllm_testing import Engine, EngineSpec, WorkerPool, digest, encoder_output, request

from ec_client import Client

pytestmark = needs_mooncake

SHARED = "vl-pool"
Make = Callable[..., Engine]


@pytest.fixture
def nodes(worker_pool: WorkerPool) -> Iterator[tuple[Daemon, Daemon, Make]]:
    """Two peered daemons and engine(daemon, **spec) -> an Engine on that daemon."""
    engines: list[Engine] = []

    def make(daemon: Daemon, **spec: Any) -> Engine:
        engine_spec = EngineSpec(daemon.address, **spec)
        built = Engine(engine_spec, worker_pool.take(engine_spec))
        engines.append(built)
        return built

    with peered_daemons(2) as (a, b):
        yield a, b, make
        for built in engines:
            built.close()
        worker_pool.give_back()


def test_a_consumer_engine_loads_what_an_engine_on_another_node_saved(
    nodes: tuple[Daemon, Daemon, Make],
) -> None:
    a, b, make = nodes
    producer = make(a, role="ec_producer", pool=SHARED)
    consumer = make(b, role="ec_consumer", pool=SHARED)
    producer.save("p1", "img-a")
    view = consumer.scheduler.view
    wait_until(lambda: view.has(b"img-a") and not view.has_local(b"img-a"), 15)

    held, result = consumer.admit(request("c1", "img-a"))

    assert held == 1  # pinned (and pulled) by the background Step, not on the scheduler thread
    assert set(consumer.scheduler.rpcs) <= {"flush", "report"}  # background Steps only
    assert not result.step.encode
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}
    with Client(b.address) as client:
        [pool] = client.stats(SHARED).pools
        assert (pool.remote_hits, pool.remote_reads) == (1, 1)
