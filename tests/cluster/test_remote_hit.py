"""Remote hits: a get of a key a shared pool lacks, which the Mooncake Store has, is read from
the store straight into a local entry, whoever published it (another ecd node, or vLLM 0.33's own
store client), and checked against the pool (docs/design.md §13)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_testing import (
    BLOCK,
    NAMESPACE,
    POOL,
    Master,
    pool_stats,
    published_elsewhere,
    store_daemon,
    vllm_store_client,
)

from ec_client import Consumer, Status
from ec_daemon.cluster import codec


def test_a_key_another_node_published_is_read_from_the_store_bit_identical(master: Master) -> None:
    tensor = torch.randn(2048, 2048, dtype=torch.bfloat16)  # 8 MiB
    with published_elsewhere(master, {"mm-1": tensor}) as far, far.client() as consumer:
        consumer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        started = time.perf_counter()
        got = Consumer(consumer, "shared").get("mm-1", wait_ms=5000)
        remote_s = time.perf_counter() - started
        started = time.perf_counter()
        again = Consumer(consumer, "shared").get("mm-1")  # now here: a local hit
        local_s = time.perf_counter() - started
        print(f"remote hit of 8 MiB {1e3 * remote_s:.1f} ms, then local {1e3 * local_s:.1f} ms")
        stats = pool_stats(consumer, "shared")
    assert got is not None and torch.equal(got, tensor)
    assert again is not None and torch.equal(again, tensor)
    assert (stats.remote_hits, stats.remote_reads, stats.entries_ready) == (1, 1, 1)


def test_a_key_vllms_store_client_published_is_read_bit_identical(master: Master) -> None:
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        make_embedding_key,
    )

    tensor = torch.randn(64, 2048, dtype=torch.bfloat16)
    vllm = vllm_store_client(master)
    try:
        vllm.put_tensor(make_embedding_key(NAMESPACE, "from-vllm"), tensor)
        with store_daemon(master) as daemon, daemon.client() as client:
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
            got = Consumer(client, "shared").get("from-vllm", wait_ms=5000)
    finally:
        vllm.close()
    assert got is not None and torch.equal(got, tensor)


@pytest.mark.parametrize("value", ["rows of another width", "a header not the format's"])
def test_another_models_value_under_the_key_is_a_miss_never_committed(
    master: Master, value: str
) -> None:
    key = f"other-model-{value.split()[-2]}"
    vllm = vllm_store_client(master)
    try:
        if value == "rows of another width":  # rows of 2048 bytes, in a pool of 4096
            vllm.put_tensor(codec.store_key(NAMESPACE, key.encode()), torch.ones(8, 512))
        else:  # the size of 2 rows of the pool's, but not the format's magic
            raw = codec.HEADER.pack(0x46524E47, 12, 2, 2048) + bytes(2 * BLOCK)
            assert vllm.store.put(codec.store_key(NAMESPACE, key.encode()), raw) == 0
        with store_daemon(master) as daemon, daemon.client() as client:
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
            got = Consumer(client, "shared").get(key, wait_ms=200)
            stats = pool_stats(client, "shared")
    finally:
        vllm.close()
    assert got is None
    assert (stats.remote_reads, stats.remote_misses) == (1, 1)
    assert (stats.remote_hits, stats.entries_ready, stats.entries_pending) == (0, 0, 0)
    assert stats.held_blocks == 0 and stats.free_blocks == stats.num_blocks


def test_a_steps_acquire_of_a_key_the_store_has_is_answered_by_a_remote_hit(master: Master) -> None:
    rows = torch.randn(16, 2048, dtype=torch.bfloat16)
    with published_elsewhere(master, {"by-step": rows}) as far, far.client() as consumer:
        consumer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        [hit] = consumer.step("shared", acquires=[b"by-step"]).acquires  # how vLLM's connector asks
        consumer.release([hit.lease_id])
        stats = pool_stats(consumer, "shared")
    assert hit.status is Status.HIT and hit.spec is not None
    assert (hit.spec.shape, hit.spec.dtype) == ((16, 2048), "bfloat16")
    assert (stats.remote_hits, stats.hits, stats.misses) == (1, 1, 0)


def test_a_get_of_more_keys_than_one_read_takes_hits_them_all(master: Master) -> None:
    rows = {f"k{i}": torch.full((1, 2048), float(i), dtype=torch.bfloat16) for i in range(70)}
    with published_elsewhere(master, rows) as far, far.client() as consumer:
        consumer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        got = Consumer(consumer, "shared").get_many(list(rows), wait_ms=5000)
    assert all(got[k] is not None and torch.equal(got[k], t) for k, t in rows.items())


def test_concurrent_gets_on_a_node_read_the_store_once(master: Master) -> None:
    tensor = torch.randn(1024, 2048, dtype=torch.bfloat16)  # 4 MiB
    with published_elsewhere(master, {"once": tensor}) as far:
        clients = [far.client(name=f"engine-{i}") for i in range(4)]
        for client in clients:
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda c: Consumer(c, "shared").get("once", wait_ms=5000), clients))
        stats = pool_stats(clients[0], "shared")
        for client in clients:
            client.close()
    assert all(t is not None and torch.equal(t, tensor) for t in got)
    assert (stats.remote_reads, stats.remote_hits) == (1, 1)
