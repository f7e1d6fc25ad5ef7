"""Publishing: every commit of a shared pool reaches the Mooncake Store in the background, in
vLLM's format, and vLLM 0.33's own store client reads it (docs/design.md §13). One real
`mooncake_master` for the module; a daemon per test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from cluster_testing import (
    NAMESPACE,
    POOL,
    Master,
    cluster_stats,
    published,
    store_daemon,
    vllm_store_client,
)
from ecd_testing import wait_until

from ec_client import Client, Consumer, Producer
from ec_daemon.cluster import codec
from ec_protocol.types import ClusterStats


@pytest.fixture(scope="module")
def vllm_client(master: Master) -> Iterator[Any]:
    client = vllm_store_client(master)
    yield client
    client.close()


def wait_published(client: Client, count: int, timeout_s: float = 20.0) -> ClusterStats:
    wait_until(lambda: published(client) >= count, timeout_s)
    return cluster_stats(client)


def vllm_spec(tensor: torch.Tensor) -> Any:
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import TensorSpec

    return TensorSpec(tuple(tensor.shape), str(tensor.dtype), tensor.nbytes)


def test_vllm_store_client_reads_what_ecd_published_bit_identical(
    master: Master, vllm_client: Any
) -> None:
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        make_embedding_key,
    )

    tensor = torch.randn(2048, 2048, dtype=torch.bfloat16)  # 8 MiB
    with store_daemon(master) as daemon, daemon.client() as client:
        client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        Producer(client, "shared").put("mm-hash-1", tensor)
        stats = wait_published(client, 1)
        assert stats.connected and stats.publish_failures == 0
        key = make_embedding_key(NAMESPACE, "mm-hash-1")
        started = time.perf_counter()
        loaded = vllm_client.load_tensors({key: vllm_spec(tensor)}, "cpu")
        print(f"vLLM client read of an 8 MiB entry: {1e3 * (time.perf_counter() - started):.1f} ms")
    assert torch.equal(loaded[key], tensor)


def test_a_key_the_store_has_is_not_written_again(master: Master, vllm_client: Any) -> None:
    first, second = (
        torch.ones(4, 2048, dtype=torch.bfloat16),
        torch.zeros(4, 2048, dtype=torch.bfloat16),
    )
    with store_daemon(master) as daemon, daemon.client() as client:
        client.open_pool("again", **POOL, cluster_namespace=NAMESPACE)
        producer = Producer(client, "again")
        producer.put("written-once", first)
        wait_published(client, 1)
        client.delete("again", [b"written-once"])
        producer.put("written-once", second)
        wait_until(lambda: cluster_stats(client).already_stored == 1, 20)
        assert cluster_stats(client).published == 1
        key = codec.store_key(NAMESPACE, b"written-once")
        # read while the daemon lives: the store may have put the replica in its segment
        loaded = vllm_client.load_tensors({key: vllm_spec(first)}, "cpu")
    assert torch.equal(loaded[key], first)


def test_an_entry_the_format_cannot_express_is_not_published(
    master: Master, vllm_client: Any
) -> None:
    with store_daemon(master) as daemon, daemon.client() as client:
        client.open_pool("shapes", **POOL, cluster_namespace=NAMESPACE)
        producer = Producer(client, "shapes")
        producer.put("three-d", torch.ones(2, 2, 1024, dtype=torch.bfloat16))
        producer.put("int8", torch.ones(4, 4096, dtype=torch.int8))
        producer.put("two-d", torch.ones(4, 2048, dtype=torch.bfloat16))
        stats = wait_published(client, 1)  # in order: the others' turns came first
        keys = [codec.store_key(NAMESPACE, k) for k in (b"three-d", b"int8", b"two-d")]
        assert vllm_client.batch_exists(keys) == [False, False, True]
    assert stats.unpublishable == 2


def test_a_pool_without_a_namespace_stays_on_its_node(master: Master, vllm_client: Any) -> None:
    rows = torch.ones(4, 2048, dtype=torch.bfloat16)
    with store_daemon(master) as daemon, daemon.client() as client:
        client.open_pool("local", **POOL)
        client.open_pool("shared-too", **POOL, cluster_namespace=NAMESPACE + "-2")
        Producer(client, "local").put("stays", rows)
        Producer(client, "shared-too").put("goes", rows)
        stats = wait_published(client, 1)  # in order: the local commit came first
        keys = [codec.store_key(NAMESPACE + "-2", k) for k in (b"stays", b"goes")]
        assert vllm_client.batch_exists(keys) == [False, True]
    assert (stats.published, stats.gone, stats.unpublishable) == (1, 0, 0)


def test_a_daemon_whose_master_is_unreachable_serves_locally_and_joins_once_it_is_up() -> None:
    master = Master()  # its ports chosen, nothing listening there yet
    rows = torch.ones(4, 2048, dtype=torch.bfloat16)
    try:
        with store_daemon(master) as daemon, daemon.client() as client:
            client.open_pool("early", **POOL, cluster_namespace=NAMESPACE)
            Producer(client, "early").put("before", rows)
            assert torch.equal(Consumer(client, "early").get("before"), rows)
            stats = cluster_stats(client)
            assert not stats.connected and master.address in stats.error
            master.start()
            wait_until(lambda: cluster_stats(client).connected, 30)
            wait_published(client, 1)  # the commit made while the master was away
    finally:
        master.stop()
