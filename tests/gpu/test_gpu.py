"""The CUDA path, on a machine with a GPU: `make gpu-check` (or `make test-gpu`).

Each ordering test holds a stream busy (torch.cuda._sleep) so that a missing wait would let a
copy run early, then uses the result without a host sync and compares bytes with torch.equal.

Proves: saves wait for the kernels that produced the tensor, and a Commit is sent only once the
pool holds the tensor's bytes; the caller's stream waits for a load; a load never overwrites
memory the caller's queued kernels still read (neither a new output recycled by the allocator
nor a caller's `out`), and the same for every load of a batch (`load_many`, one event); loads
do not queue behind saves; copies across registration chunk boundaries are bit-identical; a
failed registration leaves no CUDA error behind; the pool is registered; closing a mapping waits
for copies in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from ecd_testing import Daemon, wait_until
from stream_testing import SLEEP, cache_block

from ec_client import Client, Consumer, EntryState, PoolMapping, Producer, PutStatus, TensorMover
from ec_client.control.outbox import OutboxBatch
from ec_client.data import mapping as mapping_module
from ec_client.data.cuda_runtime import cuda_runtime
from ec_client.data.mover import byte_view, spec_of
from ec_protocol.types import CommitItem, Extent, StepResult

POOL = "gpu"
BLOCK = 7168
MiB = 1 << 20


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with daemon.client(name="gpu") as c:
        c.open_pool(POOL, BLOCK, 200 * MiB // BLOCK * BLOCK)
        yield c


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """nbytes of random bytes on the CPU, distinct per seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def mapping_of(client: Client) -> PoolMapping:
    return PoolMapping.open(client.pool_info(POOL))


def known(client: Client, keys: Iterable[str]) -> None:
    """Wait until the client's view knows the slots of `keys`: a get of them is a local hit."""
    view = client.view(POOL)
    wait_until(lambda: view.slots_known(keys))


def ready(endpoint_user: Producer | Consumer) -> TensorMover:
    """Its CUDA mover, made now: registering the pool (host calls that may wait for the device)
    must not happen while a test holds a stream busy."""
    return endpoint_user.endpoint.mover("cuda")


def test_a_cuda_mover_registers_the_pool(client: Client) -> None:
    mapping = mapping_of(client)
    failed = PoolMapping.registrations.failed
    TensorMover(mapping, "cuda")
    assert mapping.cuda_registered
    assert PoolMapping.registrations.failed == failed


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_gpu_save_and_gpu_load_are_bit_identical(client: Client, dtype: torch.dtype) -> None:
    tensor = torch.randn(1024, 3584, device="cuda").to(dtype)
    assert Producer(client, POOL).put(f"t-{dtype}", tensor) is PutStatus.COMMITTING
    loaded = Consumer(client, POOL).get(f"t-{dtype}", device="cuda")
    assert loaded is not None and loaded.device.type == "cuda"
    assert torch.equal(byte_view(loaded), byte_view(tensor))


def test_a_save_waits_for_the_kernels_that_produce_the_tensor(client: Client) -> None:
    expected = pattern(8 * MiB, 1)
    tensor = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    source = expected.cuda()
    producer = Producer(client, POOL)
    ready(producer)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    tensor.copy_(source)  # queued behind the sleep: the tensor is all zeros until then
    assert producer.put("produced", tensor) is PutStatus.COMMITTING
    loaded = Consumer(client, POOL).get("produced")
    assert loaded is not None and torch.equal(loaded, expected)


def test_a_commit_is_sent_only_once_the_pool_holds_the_tensors_bytes(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = pattern(16 * MiB, 2)
    tensor = torch.zeros(16 * MiB, dtype=torch.uint8, device="cuda")
    source = expected.cuda()
    torch.cuda.synchronize()
    mapping = mapping_of(client)
    allocated: list[Extent] = []
    at_commit: list[torch.Tensor] = []
    real_step, real_commit_items = client.step, OutboxBatch.commit_items

    def step(*args: Any, **kwargs: Any) -> StepResult:  # the put's Allocate rides in a Step
        result = real_step(*args, **kwargs)
        for answer in result.allocates:
            allocated.extend(answer.extents)
        return result

    def commit_items(batch: OutboxBatch) -> list[CommitItem]:  # a Step carrying a Commit
        items = real_commit_items(batch)
        if items:
            at_commit.append(torch.cat([mapping.region(x).clone() for x in allocated])[: 16 * MiB])
        return items

    monkeypatch.setattr(client, "step", step)
    monkeypatch.setattr(OutboxBatch, "commit_items", commit_items)
    producer = Producer(client, POOL)
    ready(producer)
    torch.cuda._sleep(SLEEP)
    tensor.copy_(source)
    handle = producer.put_many_async({"late": tensor})
    assert client.lookup(POOL, ["late"])[0].state is EntryState.PENDING
    handle.wait()
    assert len(at_commit) == 1 and torch.equal(at_commit[0], expected)
    assert client.lookup(POOL, ["late"])[0].state is EntryState.READY


def test_the_callers_stream_waits_for_a_load(client: Client) -> None:
    expected = pattern(32 * MiB, 3)
    producer = Producer(client, POOL)
    producer.put("ordered", expected)
    producer.flush()  # committed: READY for the Acquire below
    expected_gpu = expected.cuda()
    [hit] = client.acquire(POOL, ["ordered"])
    assert hit.spec is not None
    mover = ready(Consumer(client, POOL))
    cache_block(mover.load_stream, 32 * MiB)
    cache_block(torch.cuda.current_stream(), 32 * MiB)  # for torch.equal's result
    torch.cuda.synchronize()
    with torch.cuda.stream(mover.load_stream):
        torch.cuda._sleep(SLEEP)  # the copy queues behind this
    loaded, transfer = mover.load(hit.extents, hit.spec)
    same = torch.equal(loaded, expected_gpu)  # on the caller's stream, no host sync before it
    transfer.wait()
    client.release([hit.lease_id])
    assert same


def test_a_new_load_output_never_takes_memory_the_callers_queued_kernels_still_read(
    client: Client,
) -> None:
    Producer(client, POOL).put("fresh", pattern(32 * MiB, 4))
    consumer = Consumer(client, POOL)
    ready(consumer)
    stale = torch.full((8 * MiB,), 1.0, device="cuda")  # 32 MiB, as large as the entry
    cache_block(torch.cuda.current_stream(), 32 * MiB)  # for `doubled`
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    doubled = stale * 2  # reads `stale` once the sleep is over
    del stale  # its memory is free again for the caller's stream at once
    loaded = consumer.get("fresh", device="cuda")
    assert loaded is not None
    assert torch.equal(doubled, torch.full((8 * MiB,), 2.0, device="cuda"))


def test_a_load_into_out_waits_for_the_callers_queued_work_on_it(client: Client) -> None:
    expected = pattern(8 * MiB, 5)
    Producer(client, POOL).put("into", expected)
    out = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
    consumer = Consumer(client, POOL)
    ready(consumer)
    cache_block(torch.cuda.current_stream(), 8 * MiB)  # for the clone
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    before = out.clone()  # queued: must still see the ones
    assert consumer.get("into", device="cuda", out=out) is out
    assert torch.equal(before, torch.ones_like(before))
    assert torch.equal(out, expected.cuda())


def test_the_callers_stream_waits_for_every_load_of_a_batch(client: Client) -> None:
    expected = {f"batch-{i}": pattern(8 * MiB, 20 + i) for i in range(3)}
    producer = Producer(client, POOL)
    producer.put_many(expected)
    producer.flush()
    known(client, expected)
    expected_gpu = {key: tensor.cuda() for key, tensor in expected.items()}
    consumer = Consumer(client, POOL)
    mover = ready(consumer)
    for _ in expected:
        cache_block(mover.load_stream, 8 * MiB)  # the batch's outputs
    cache_block(torch.cuda.current_stream(), 8 * MiB)  # for torch.equal's results
    torch.cuda.synchronize()
    with torch.cuda.stream(mover.load_stream):
        torch.cuda._sleep(SLEEP)  # the batch's copies queue behind this
    handle = consumer.get_many_async(list(expected), device="cuda")  # one load_many
    same = [torch.equal(handle.tensors[key], expected_gpu[key]) for key in expected]  # no sync
    handle.wait()
    assert same == [True] * len(expected)


def test_a_batch_load_into_outs_waits_for_the_callers_queued_work_on_them(
    client: Client,
) -> None:
    expected = {f"outs-{i}": pattern(4 * MiB, 30 + i) for i in range(3)}
    producer = Producer(client, POOL)
    producer.put_many(expected)
    producer.flush()
    known(client, expected)
    outs = {key: torch.ones(4 * MiB, dtype=torch.uint8, device="cuda") for key in expected}
    consumer = Consumer(client, POOL)
    ready(consumer)
    for _ in expected:
        cache_block(torch.cuda.current_stream(), 4 * MiB)  # for the clones
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    before = [out.clone() for out in outs.values()]  # queued: must still see the ones
    consumer.get_many_async(list(expected), device="cuda", out=outs).wait()
    assert all(torch.equal(b, torch.ones_like(b)) for b in before)
    assert all(torch.equal(outs[key], expected[key].cuda()) for key in expected)


def test_a_load_does_not_queue_behind_a_save_waiting_for_compute(client: Client) -> None:
    mapping = mapping_of(client)
    mover = TensorMover(mapping, "cuda")
    entry = 4 * MiB // BLOCK
    source = torch.zeros(entry * BLOCK, dtype=torch.uint8, device="cuda")
    mapping.region(Extent(entry, entry)).copy_(pattern(entry * BLOCK, 6))
    cache_block(mover.load_stream, entry * BLOCK)
    torch.cuda.synchronize()
    torch.cuda._sleep(4 * SLEEP)  # the compute stream is busy
    compute_done = torch.cuda.Event()
    compute_done.record()
    saving = mover.save(source, [Extent(0, entry)])  # waits for the compute stream
    _, loading = mover.load([Extent(entry, entry)], spec_of(source))
    while not loading.done():
        assert not compute_done.query(), "the load waited for the compute stream"
    assert not compute_done.query()
    saving.wait()


def test_copies_across_registration_chunks_are_bit_identical(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mapping_module, "CUDA_REGISTER_CHUNK", MiB)  # 14 MiB chunks: the least
    tensor = pattern(32 * MiB, 7).cuda()  # over three chunks
    Producer(client, POOL).put("chunks", tensor)
    assert mapping_of(client).cuda_registered
    loaded = Consumer(client, POOL).get("chunks", device="cuda")
    assert loaded is not None and torch.equal(loaded, tensor)


def test_a_failed_registration_leaves_no_cuda_error_for_the_next_kernel(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mapping_module, "CUDA_REGISTER_CHUNK", MiB)
    mapping = mapping_of(client)
    torch.cuda.init()
    runtime = cuda_runtime()
    assert runtime is not None, "libcudart is not loaded in this process"
    second_chunk = mapping.flat.data_ptr() + mapping.chunk_bytes
    assert runtime.cudaHostRegister(second_chunk, mapping.chunk_bytes, 0) == 0
    try:
        with pytest.warns(RuntimeWarning, match="already"):
            registered = mapping.register_cuda(torch.device("cuda", torch.cuda.current_device()))
        assert not registered
        assert torch.equal(torch.ones(4, device="cuda") + 1, torch.full((4,), 2.0, device="cuda"))
        Producer(client, POOL).put("pageable", pattern(MiB, 8).cuda())
        loaded = Consumer(client, POOL).get("pageable", device="cuda")
        assert loaded is not None and torch.equal(loaded.cpu(), pattern(MiB, 8))
    finally:
        runtime.cudaHostUnregister(second_chunk)


def test_an_unindexed_cuda_device_shares_the_current_devices_mover(client: Client) -> None:
    endpoint = Consumer(client, POOL).endpoint
    assert endpoint.mover("cuda") is endpoint.mover(f"cuda:{torch.cuda.current_device()}")


def test_closing_a_mapping_waits_for_copies_in_flight(client: Client) -> None:
    mapping = mapping_of(client)
    mover = TensorMover(mapping, "cuda")
    assert mover.load_stream is not None
    cache_block(mover.load_stream, 16 * BLOCK)  # for the load's output
    torch.cuda.synchronize()
    with torch.cuda.stream(mover.load_stream):
        torch.cuda._sleep(SLEEP)
    _, transfer = mover.load([Extent(0, 16)], spec_of(torch.empty(16 * BLOCK, dtype=torch.uint8)))
    mapping.close()
    assert transfer.done()
