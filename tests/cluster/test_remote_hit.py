"""Remote hits: a get of a key a shared pool lacks, which the Mooncake Store has, is read from
the store straight into a local entry, whoever published it (another ecd node, or vLLM 0.33's own
store client), and checked against the pool (docs/design.md §13)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


# A pool whose blocks are not one row: 1 MiB blocks, rows of 8 KiB (4096 bf16).
MIB_BLOCKS: dict[str, Any] = dict(POOL, block_size_bytes=1 << 20)
WHOLE_OR_PART = pytest.mark.parametrize(
    "rows", [1024, 1000], ids=["whole blocks", "its last block in part"]
)


@WHOLE_OR_PART
def test_a_key_another_node_published_is_read_whatever_the_pools_block_size(
    master: Master, rows: int
) -> None:
    tensors = {f"img-{i}": torch.randn(rows, 4096, dtype=torch.bfloat16) for i in range(2)}
    with (
        published_elsewhere(master, tensors, MIB_BLOCKS) as far,
        far.client() as consumer,
    ):
        consumer.open_pool("shared", **MIB_BLOCKS, cluster_namespace=NAMESPACE)
        got = Consumer(consumer, "shared").get_many(list(tensors), wait_ms=5000)
        stats = pool_stats(consumer, "shared")
    assert all(got[k] is not None and torch.equal(got[k], t) for k, t in tensors.items())
    assert (stats.remote_hits, stats.remote_misses) == (2, 0)


@pytest.mark.parametrize(
    ("pool", "shape"),
    [(POOL, (64, 2048)), (MIB_BLOCKS, (1024, 4096)), (MIB_BLOCKS, (1000, 4096))],
    ids=["blocks of one row", "blocks of 1 MiB, whole", "blocks of 1 MiB, the last in part"],
)
def test_a_key_vllms_store_client_published_is_read_bit_identical(
    master: Master, pool: dict[str, Any], shape: tuple[int, int]
) -> None:
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        make_embedding_key,
    )

    tensor = torch.randn(shape, dtype=torch.bfloat16)
    vllm = vllm_store_client(master)
    try:
        vllm.put_tensor(make_embedding_key(NAMESPACE, "from-vllm"), tensor)
        with store_daemon(master) as daemon, daemon.client() as client:
            client.open_pool("shared", **pool, cluster_namespace=NAMESPACE)
            got = Consumer(client, "shared").get("from-vllm", wait_ms=5000)
            stats = pool_stats(client, "shared")
    finally:
        vllm.close()
    assert got is not None and torch.equal(got, tensor)
    assert (stats.remote_hits, stats.remote_misses) == (1, 0)


@pytest.mark.parametrize("value", ["a header not the format's", "a size not its header's"])
def test_a_value_not_in_the_format_under_the_key_is_a_miss_never_committed(
    master: Master, value: str
) -> None:
    magic, rows = (0x46524E47, 2) if value == "a header not the format's" else (codec.MAGIC, 3)
    key = f"not-the-format-{rows}"
    raw = codec.HEADER.pack(magic, 12, rows, 2048) + bytes(2 * BLOCK)  # 2 rows of bf16
    vllm = vllm_store_client(master)
    try:
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


def test_a_get_with_no_wait_ms_that_asks_the_daemon_is_answered_by_this_node_alone(
    master: Master,
) -> None:
    # watch=False: every get asks the daemon (a Step), as a get does while its view has not
    # synced; without wait_ms it is still a miss for a key only another node has.
    tensor = torch.randn(16, 2048, dtype=torch.bfloat16)
    with published_elsewhere(master, {"img-1": tensor}) as far, far.client() as consumer:
        consumer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        unwatched = Consumer(consumer, "shared", watch=False)
        local = unwatched.get("img-1")
        stats = pool_stats(consumer, "shared")
        waited = unwatched.get("img-1", wait_ms=5000)  # the store has it: read with a wait_ms
    assert local is None
    assert (stats.remote_reads, stats.misses) == (0, 1)
    assert waited is not None and torch.equal(waited, tensor)


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
