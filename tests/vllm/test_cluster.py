"""The connector and the daemon's Mooncake Store (docs/design.md §13): by default an engine's
pool is shared under the namespace vLLM's own store connector derives from the same config, when
its daemon has a store, so that vLLM's own store client finds what the engine saved under the
key it would use; the pool stays on its node otherwise or when `ecd_cluster_namespace` is "".
Engines on two daemons sharing a pool through the store encode a new image once: the second
waits for the first one's encode (single flight across nodes). A real `mooncake_master` and real
daemons; vLLM's real connector factory builds the scheduler side, and real worker processes save
and load."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cluster_testing import (
    Master,
    cluster_stats,
    needs_mooncake,
    published,
    running_master,
    store_daemon,
    vllm_store_client,
)
from ecd_testing import Daemon, auth_args, wait_until
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    TensorSpec,
    build_embedding_namespace,
    make_embedding_key,
)
from vllm_testing import (
    LONG_ENCODE_S,
    Engine,
    EngineFactory,
    EngineSpec,
    WorkerPool,
    digest,
    encoder_output,
    held_while,
    request,
)

from ec_client import Client
from ec_client.vllm.scheduler import PoolRefused

pytestmark = needs_mooncake

SHARED = "vl-shared"


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with running_master() as master:
        yield master


def pool_namespace(daemon: Daemon, pool: str) -> str:
    with daemon.client() as client:
        return client.open_pool(pool).cluster_namespace  # attach only: the pool as it is


def scheduler_on(daemon: Daemon, **spec: Any) -> tuple[Engine, EngineSpec]:
    engine_spec = EngineSpec(daemon.address, pool=SHARED, **spec)
    return Engine(engine_spec), engine_spec


def test_an_engines_pool_is_shared_under_vllms_namespace_on_a_daemon_with_a_store(
    master: Master,
) -> None:
    with store_daemon(master) as daemon:
        engine, spec = scheduler_on(daemon)
        try:
            expected = build_embedding_namespace(spec.vllm_config())
            assert pool_namespace(daemon, SHARED) == expected
        finally:
            engine.close()


def test_vllms_store_client_reads_what_an_engine_saved_under_the_key_vllm_would_use(
    master: Master, worker_pool: WorkerPool
) -> None:
    with store_daemon(master) as daemon, daemon.client() as client:
        spec = EngineSpec(daemon.address, pool=SHARED)
        engine = Engine(spec, worker_pool.take(spec))
        try:
            engine.save("p1", "img-a")
            wait_until(lambda: published(client) == 1, 20)
        finally:
            engine.close()
            worker_pool.give_back()
        expected = encoder_output("img-a")
        key = make_embedding_key(build_embedding_namespace(spec.vllm_config()), "img-a")
        vllm_client = vllm_store_client(master)
        try:
            wanted = TensorSpec(tuple(expected.shape), str(expected.dtype), expected.nbytes)
            loaded = vllm_client.load_tensors({key: wanted}, "cpu")
        finally:
            vllm_client.close()
    assert torch.equal(loaded[key], expected)


def test_an_engine_whose_token_may_not_see_every_pool_shares_its_own(
    master: Master, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stats of every pool needs an admin's token: the connector asks its pool's."""
    tokens = {"engine": "engine-secret-0123456789", "ops": "ops-secret-0123456789"}
    acl = f'[[rule]]\npools = ["{SHARED}"]\nproduce = ["engine"]\nconsume = ["engine"]\n'
    acl += '[[rule]]\npools = ["*"]\nadmin = ["ops"]\n'
    with store_daemon(master, *auth_args(tmp_path, tokens, acl)) as daemon:
        monkeypatch.setenv("ECD_TOKEN", tokens["engine"])
        engine, spec = scheduler_on(daemon)
        try:
            with daemon.client(token=tokens["ops"]) as client:
                shared = client.open_pool(SHARED).cluster_namespace
            assert shared == build_embedding_namespace(spec.vllm_config())
        finally:
            engine.close()


def test_an_empty_ecd_cluster_namespace_keeps_the_pool_on_a_daemon_with_a_store_local(
    master: Master,
) -> None:
    with store_daemon(master) as daemon:
        engine, _ = scheduler_on(daemon, extra={"ecd_cluster_namespace": ""})
        try:
            assert pool_namespace(daemon, SHARED) == ""
        finally:
            engine.close()


def test_an_engines_pool_stays_on_a_daemon_without_a_store(
    daemon: Daemon, engine: EngineFactory
) -> None:
    engine(workers=False, pool=SHARED)
    assert pool_namespace(daemon, SHARED) == ""


def test_an_engine_naming_another_namespace_for_a_shared_pool_is_refused_saying_so(
    engine: EngineFactory,
) -> None:
    engine(workers=False, pool=SHARED, extra={"ecd_cluster_namespace": "team-a"})
    with pytest.raises(PoolRefused) as refused:
        engine(workers=False, pool=SHARED, extra={"ecd_cluster_namespace": "team-b"})
    message = str(refused.value)
    assert "'team-a'" in message and "'team-b'" in message and "cluster namespace" in message


@pytest.fixture
def two_nodes(
    master: Master, worker_pool: WorkerPool, request: pytest.FixtureRequest
) -> Iterator[tuple[Engine, Engine, Client]]:
    """Two `ec_both` engines (or as the EngineSpec fields a test passes as the fixture's param
    say) on one shared pool by name, each on a daemon of its own (its own shm directory), the
    store between them; and a client of the second engine's daemon."""
    spec_fields = getattr(request, "param", {})
    with store_daemon(master) as a, store_daemon(master) as b, b.client() as client:
        engines = []
        for daemon in (a, b):
            spec = EngineSpec(daemon.address, pool=SHARED, **spec_fields)
            engines.append(Engine(spec, worker_pool.take(spec)))
        yield engines[0], engines[1], client
        for engine in engines:
            engine.close()
        worker_pool.give_back()


@pytest.mark.parametrize("offset_s", [0.0, 0.5, 1.5])
def test_two_engines_on_two_nodes_given_one_new_image_encode_it_once_the_second_loads_it(
    two_nodes: tuple[Engine, Engine, Client], offset_s: float
) -> None:
    """The second request comes `offset_s` after the first engine's Allocate landed in the store
    as a pending marker (its daemon counts the claim), while the first engine encodes for
    longer than the offset."""
    first, second, b = two_nodes
    asked = first.step(request("a1", "img"))  # held while its daemon asks the store
    encoding = first.schedule([request("a1", "img")])  # which has nothing: encoded
    assert asked.step.held == {"a1"} and encoding.encode == {"img": 16}
    first.answered()  # allocated: PENDING on its node, its marker on its way to the store
    with Client(first.spec.address) as a:
        wait_until(lambda: cluster_stats(a).claims == 1, 10)
    time.sleep(offset_s)
    held_while(second, "b1", LONG_ENCODE_S)
    first.finish(first.run(encoding))
    first.flush()  # committed, published: the second node reads it from the store
    wait_until(lambda: second.scheduler.view.has(b"img"), 10)
    _, result = second.admit(request("b1", "img"))
    assert result.step.load == {"img"} and not result.step.encode
    assert result.loaded == {"img": digest(encoder_output("img"))}
    stats = cluster_stats(b)
    assert (stats.waits_hit, stats.claims) == (1, 0)  # one encode saved, none done


@pytest.mark.parametrize(
    "two_nodes", [{"role": "ec_producer", "encoder_only": True}], ids=["encoders"], indirect=True
)
def test_two_encoder_engines_on_two_nodes_given_one_new_image_encode_it_once(
    two_nodes: tuple[Engine, Engine, Client],
) -> None:
    """An encoder engine needs the image nowhere but in the pool: the second one, on the other
    node, waits for the first one's encode, then neither encodes nor copies it."""
    first, second, b = two_nodes
    first.step(request("a1", "img"))  # held while its daemon asks the store
    encoding = first.schedule([request("a1", "img")])
    assert encoding.encode == {"img": 16}
    first.answered()
    with Client(first.spec.address) as a:
        wait_until(lambda: cluster_stats(a).claims == 1, 10)
    held_while(second, "b1", 0.5)
    first.finish(first.run(encoding))
    first.flush()
    _, result = second.admit(request("b1", "img"))
    assert result.step.load == {"img"} and not result.step.encode and result.loaded == {}
    assert (cluster_stats(b).waits_hit, cluster_stats(b).claims) == (1, 0)
