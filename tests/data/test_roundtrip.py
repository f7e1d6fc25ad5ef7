"""Tensors through a pool and back, in one process: every dtype, shapes, extents, partial blocks."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from ecd_testing import Daemon, assert_blocks_accounted

from ec_client import Client, Consumer, EcdError, Producer, PutStatus
from ec_client.data import mover
from ec_client.data.mover import byte_view
from ec_protocol.pool.layout import DTYPES, MAX_NDIM

POOL = "roundtrip"
BLOCK = 7168  # one Qwen2.5-VL embedding row: 3584 x bf16


@pytest.fixture
def client(daemon: Daemon) -> Client:
    with daemon.client(name="roundtrip") as c:
        c.open_pool(POOL, BLOCK, 2048 * BLOCK, "test")
        yield c  # type: ignore[misc]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as dtype: every bit pattern, NaNs and all."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(byte_view(a), byte_view(b))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_every_dtype_round_trips_bit_identical(client: Client, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    producer, consumer = Producer(client, POOL), Consumer(client, POOL)
    for i, shape in enumerate([(1,), (17, 3584), (2, 3, 5), (4096,)]):
        tensor = random_tensor(shape, dtype, seed=i)
        key = f"{dtype_name}-{i}"
        assert producer.put(key, tensor) is PutStatus.COMMITTING
        loaded = consumer.get(key)
        assert loaded is not None and same_bits(loaded, tensor), (dtype_name, shape)


def test_a_partial_last_block_keeps_exactly_the_tensor_bytes(client: Client) -> None:
    tensor = random_tensor((3 * BLOCK + 5,), torch.uint8)
    Producer(client, POOL).put("partial", tensor)
    [entry] = [e for e in client.iter_entries(POOL) if e.key == b"partial"]
    assert sum(e.count for e in entry.extents) == 4
    loaded = Consumer(client, POOL).get("partial")
    assert loaded is not None and same_bits(loaded, tensor)


def test_an_entry_spread_over_several_extents_reads_back_whole(client: Client) -> None:
    producer = Producer(client, POOL)
    row = torch.zeros(BLOCK // 2, dtype=torch.bfloat16)
    fillers = {f"fill-{i}": row.expand(100, -1).contiguous() for i in range(20)}  # 100 blocks each
    assert set(producer.put_many(fillers).values()) == {PutStatus.COMMITTING}
    producer.flush()  # committed (evictable) before the evictions
    client.evict(POOL, [f"fill-{i}" for i in range(0, 20, 2)])  # ten 100-block holes
    free_tail = client.stats(POOL).pools[0].largest_free_extent
    wide = random_tensor((free_tail + 150, BLOCK // 4), torch.float32)  # fits no single hole
    assert producer.put("wide", wide) is PutStatus.COMMITTING
    [entry] = [e for e in client.iter_entries(POOL) if e.key == b"wide"]
    assert len(entry.extents) > 1
    loaded = Consumer(client, POOL).get("wide")
    assert loaded is not None and same_bits(loaded, wide)
    assert_blocks_accounted(client, POOL)


def test_a_non_contiguous_tensor_is_stored_as_its_contiguous_copy(client: Client) -> None:
    base = random_tensor((64, 128), torch.float16)
    transposed = base.t()
    assert not transposed.is_contiguous()
    Producer(client, POOL).put("transposed", transposed)
    loaded = Consumer(client, POOL).get("transposed")
    assert loaded is not None and same_bits(loaded, transposed.contiguous())


def test_get_can_fill_a_caller_provided_tensor(client: Client) -> None:
    tensor = random_tensor((8, 3584), torch.bfloat16)
    Producer(client, POOL).put("into", tensor)
    out = torch.empty(8, 3584, dtype=torch.bfloat16)
    assert Consumer(client, POOL).get("into", out=out) is out
    assert same_bits(out, tensor)


def test_get_refuses_an_output_of_the_wrong_shape_and_releases_its_pin(client: Client) -> None:
    Producer(client, POOL).put("shape", torch.zeros(8, 16))
    with pytest.raises(ValueError, match="expected a contiguous"):
        Consumer(client, POOL).get("shape", out=torch.empty(16, 8))
    assert client.lookup(POOL, ["shape"])[0].pins == 0


def test_put_many_and_get_many_use_one_rpc_each_way(client: Client) -> None:
    tensors = {f"batch-{i}": random_tensor((i + 1, 3584), torch.bfloat16, i) for i in range(8)}
    before = client.stats(POOL).pools[0]
    assert Producer(client, POOL).put_many(tensors) == dict.fromkeys(tensors, PutStatus.COMMITTING)
    loaded = Consumer(client, POOL).get_many([*tensors, "absent"])
    assert loaded["absent"] is None
    assert all(same_bits(loaded[k], t) for k, t in tensors.items())  # type: ignore[arg-type]
    client.flush()  # the pins go back in the background, once the copies landed
    after = client.stats(POOL).pools[0]
    assert (after.commits - before.commits, after.hits - before.hits) == (8, 8)
    assert after.pins == 0


def test_putting_a_cached_key_answers_exists_and_keeps_the_first_bytes(client: Client) -> None:
    producer = Producer(client, POOL)
    first = random_tensor((4, 4), torch.float32, seed=1)
    assert producer.put("twice", first) is PutStatus.COMMITTING
    assert producer.put("twice", random_tensor((4, 4), torch.float32, seed=2)) is PutStatus.EXISTS
    loaded = Consumer(client, POOL).get("twice")
    assert loaded is not None and same_bits(loaded, first)


def test_a_full_pool_of_pinned_entries_answers_no_space(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool("tiny", 1024, 8 * 1024)
        producer = Producer(c, "tiny")
        producer.put("pinned", torch.zeros(8 * 1024, dtype=torch.uint8))
        producer.flush()
        c.acquire("tiny", ["pinned"])
        assert (
            Producer(c, "tiny").put("more", torch.zeros(10, dtype=torch.uint8))
            is PutStatus.NO_SPACE
        )


def test_an_unsupported_dtype_is_refused_before_anything_is_sent(client: Client) -> None:
    with pytest.raises(ValueError, match="cannot be stored"):
        Producer(client, POOL).put("q", torch.zeros(2, dtype=torch.complex32))


def test_an_unsupported_dtype_is_refused_naming_every_dtype_a_pool_holds(client: Client) -> None:
    with pytest.raises(ValueError) as info:
        Producer(client, POOL).put("bits", torch.zeros(2, dtype=torch.bits8))
    supported = str(info.value).split("supported: ")[1].split(", ")
    assert "float8_e8m0fnu" in supported and "float4_e2m1fn_x2" in supported
    assert supported == list(DTYPES)


def test_an_entry_of_a_dtype_this_torch_lacks_is_refused_naming_it(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    Producer(client, POOL).put("mx", random_tensor((4,), torch.float8_e8m0fnu))
    monkeypatch.delitem(mover._TORCH_DTYPES, "float8_e8m0fnu")  # as in an older torch
    why = re.escape(f"'float8_e8m0fnu' is not one torch {torch.__version__} has")
    with pytest.raises(ValueError, match=why):
        Consumer(client, POOL).get("mx")
    [entry] = client.iter_entries(POOL)
    assert entry.pins == 0


def test_a_nested_tensor_is_refused_saying_what_to_store_instead(client: Client) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are in prototype stage"
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match=r"nested tensor cannot be stored.*t\.unbind\(\)"):
        Producer(client, POOL).put("nested", nested)
    assert client.lookup(POOL, ["nested"])[0].state.name == "ABSENT"


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0, 16),
        torch.zeros(4, device="meta"),
        torch.eye(4).to_sparse(),
    ],
    ids=["empty", "meta", "sparse"],
)
def test_a_tensor_without_storable_bytes_is_refused_before_anything_is_sent(
    client: Client, tensor: torch.Tensor
) -> None:
    with pytest.raises(ValueError, match=r"cannot be stored|no data"):
        Producer(client, POOL).put("nothing", tensor)
    assert client.lookup(POOL, ["nothing"])[0].state.name == "ABSENT"


def test_a_0_dim_tensor_is_refused_before_anything_is_sent(client: Client) -> None:
    with pytest.raises(ValueError, match=r"0 dimensions .* store t.reshape\(1\)"):
        Producer(client, POOL).put("scalar", torch.tensor(1.0))
    assert client.lookup(POOL, ["scalar"])[0].state.name == "ABSENT"


def test_a_tensor_of_more_dimensions_than_a_pool_holds_is_refused_naming_the_limit(
    client: Client,
) -> None:
    with pytest.raises(ValueError) as info:
        Producer(client, POOL).put("deep", torch.zeros((1,) * (MAX_NDIM + 1)))
    assert f"{MAX_NDIM + 1} dimensions" in str(info.value)
    assert str(info.value).endswith(f"expected 1 to {MAX_NDIM}")  # no word of 0-dim tensors
    assert client.lookup(POOL, ["deep"])[0].state.name == "ABSENT"


def test_what_is_not_a_tensor_is_a_type_error_naming_what_it_is(client: Client) -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        Producer(client, POOL).put("listed", [1.0, 2.0])  # type: ignore[arg-type]


def test_a_wait_that_cannot_be_sent_is_refused_naming_wait_ms(client: Client) -> None:
    with pytest.raises(ValueError, match="wait_ms=-1: expected milliseconds from 0 to"):
        Consumer(client, POOL).get("k", wait_ms=-1)


def test_a_refused_put_is_answered_to_the_caller_not_logged(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    handle = Producer(client, POOL).put_many_async({"k" * 257: torch.ones(4)})
    assert handle.statuses == {"k" * 257: PutStatus.REFUSED}
    assert "k" * 257 not in caplog.text


def test_one_refused_item_does_not_sink_the_rest_of_its_batch(client: Client) -> None:
    too_big = torch.zeros(2049 * BLOCK, dtype=torch.uint8)  # larger than the whole pool
    handle = Producer(client, POOL).put_many_async(
        {"fits": random_tensor((10,), torch.float32), "too-big": too_big}
    )
    handle.wait()
    assert handle.statuses == {"fits": PutStatus.COMMITTING, "too-big": PutStatus.REFUSED}
    assert "needs 2049 blocks" in str(handle.refused["too-big"])
    fits = Consumer(client, POOL).get("fits")
    assert fits is not None and same_bits(fits, random_tensor((10,), torch.float32))


def test_putting_one_refused_tensor_raises_why(client: Client) -> None:
    with pytest.raises(EcdError) as raised:
        Producer(client, POOL).put("too-big", torch.zeros(2049 * BLOCK, dtype=torch.uint8))
    assert raised.value.code.name == "INVALID_ARGUMENT"
    assert "the pool has 2048" in str(raised.value)


def test_a_stored_checksum_is_verified_on_read(client: Client) -> None:
    Producer(client, POOL, checksum=True).put("crc", random_tensor((100,), torch.float32))
    consumer = Consumer(client, POOL, verify=True)
    assert consumer.get("crc") is not None
    [entry] = [e for e in client.iter_entries(POOL) if e.key == b"crc"]
    consumer.endpoint.mapping.region(entry.extents[0])[7] ^= 0xFF  # someone scribbles on it
    with pytest.raises(EcdError) as info:
        consumer.get("crc")
    assert info.value.code.name == "DATA_LOSS"
    crc32 = "0x[0-9a-f]{8}"  # 32 bits, not the stored form's 33
    assert re.search(rf"'crc'.*: checksum \(CRC-32\) {crc32} != stored {crc32}$", str(info.value))
    assert client.lookup(POOL, ["crc"])[0].pins == 0
