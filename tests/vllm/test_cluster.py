"""The connector and the daemon's Mooncake Store (docs/design.md §13): by default an engine's
pool is shared under the namespace vLLM's own store connector derives from the same config, when
its daemon has a store, and stays on its node otherwise or when `ecd_cluster_namespace` is "".
A real `mooncake_master` and real daemons; vLLM's real connector factory builds the scheduler
side."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from cluster_testing import Master, running_master, store_daemon
from ecd_testing import Daemon
from peer_testing import needs_mooncake
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    build_embedding_namespace,
)
from vllm_testing import Engine, EngineFactory, EngineSpec

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
