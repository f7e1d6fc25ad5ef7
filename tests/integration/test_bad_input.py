"""Malformed requests, sent as raw protobuf so that nothing in the client library filters them.

Each case must be answered with the right status and a message naming the problem, and leave the
daemon serving with every block accounted for.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from ecd_testing import Daemon, assert_blocks_accounted, running_daemon

from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_protocol.types import MAX_HITS_PER_STEP

POOL = "bad-input"
BLOCK = 1024
MAX_BATCH = 64

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class Wire:
    stub: pb_grpc.EncoderCacheStub
    session: str

    def allocate(
        self,
        key: bytes,
        shape: list[int],
        dtype: str = "uint8",
        nbytes: int | None = None,
        **fields: object,
    ) -> pb.AllocateReply:
        size = nbytes if nbytes is not None else (shape[0] if shape else 0)
        item = pb.AllocateItem(key=key, tensor=pb.TensorSpec(shape=shape, dtype=dtype, nbytes=size))
        request = pb.AllocateRequest(session_id=self.session, engine_id=POOL, items=[item])
        for name, value in fields.items():
            setattr(request, name, value)
        return self.stub.Allocate(request)

    def commit(self, key: bytes) -> pb.CommitReply:
        return self.stub.Commit(
            pb.CommitRequest(
                session_id=self.session, engine_id=POOL, items=[pb.CommitItem(key=key)]
            )
        )


@pytest.fixture(scope="module")
def bad_daemon() -> Iterator[Daemon]:
    with running_daemon("--max-bytes", "64MiB", "--max-batch", str(MAX_BATCH)) as daemon:
        yield daemon


@pytest.fixture
def wire(bad_daemon: Daemon) -> Iterator[Wire]:
    with grpc.insecure_channel(bad_daemon.address) as channel:
        stub = pb_grpc.EncoderCacheStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(client_name="bad")).session_id
        stub.OpenPool(
            pb.OpenPoolRequest(
                session_id=session,
                engine_id=POOL,
                block_size_bytes=BLOCK,
                capacity_bytes=256 * BLOCK,
                compat_key="model",
            )
        )
        yield Wire(stub, session)
        stub.CloseSession(pb.CloseSessionRequest(session_id=session))


def open_pool(
    w: Wire,
    engine_id: str = "p2",
    block: int = BLOCK,
    capacity: int = 64 * BLOCK,
    compat: str = "",
    max_entries: int = 0,
    namespace: str = "",
) -> object:
    return w.stub.OpenPool(
        pb.OpenPoolRequest(
            session_id=w.session,
            engine_id=engine_id,
            block_size_bytes=block,
            capacity_bytes=capacity,
            compat_key=compat,
            max_entries=max_entries,
            cluster_namespace=namespace,
        )
    )


def double_commit(w: Wire) -> pb.CommitReply:
    w.allocate(b"twice", [10])
    w.commit(b"twice")
    return w.commit(b"twice")


def commit_after_abort(w: Wire) -> pb.CommitReply:
    w.allocate(b"aborted", [10])
    w.stub.Abort(pb.AbortRequest(session_id=w.session, engine_id=POOL, keys=[b"aborted"]))
    return w.commit(b"aborted")


def double_release(w: Wire) -> pb.ReleaseReply:
    w.allocate(b"released", [10])
    w.commit(b"released")
    [hit] = w.stub.Acquire(
        pb.AcquireRequest(session_id=w.session, engine_id=POOL, keys=[b"released"])
    ).results
    release = pb.ReleaseRequest(session_id=w.session, lease_ids=[hit.lease_id])
    w.stub.Release(release)
    return w.stub.Release(release)


def acquire(w: Wire, keys: list[bytes], wait_ms: int = 0) -> pb.AcquireReply:
    return w.stub.Acquire(
        pb.AcquireRequest(session_id=w.session, engine_id=POOL, keys=keys, wait_ms=wait_ms)
    )


# (case, request, expected status: of the call, or of its single item, and words of the message)
CASES = [
    ("engine_id with a path", lambda w: open_pool(w, engine_id="../x"), INVALID, "engine_id"),
    ("empty engine_id", lambda w: open_pool(w, engine_id=""), INVALID, "engine_id"),
    ("negative max_entries", lambda w: open_pool(w, max_entries=-1), INVALID, "max_entries -1"),
    (
        "engine_id ending in a newline",
        lambda w: open_pool(w, engine_id="p\n"),
        INVALID,
        "engine_id",
    ),
    ("engine_id too long", lambda w: open_pool(w, engine_id="a" * 129), INVALID, "engine_id"),
    ("zero block size", lambda w: open_pool(w, block=0), INVALID, "block_size_bytes"),
    ("negative block size", lambda w: open_pool(w, block=-7168), INVALID, "block_size_bytes"),
    ("capacity below one block", lambda w: open_pool(w, capacity=10), INVALID, "capacity_bytes"),
    ("capacity over the budget", lambda w: open_pool(w, capacity=1 << 40), EXHAUSTED, "budget"),
    (
        "cluster_namespace too long",
        lambda w: open_pool(w, namespace="n" * 513),
        INVALID,
        "cluster_namespace is longer than 512",
    ),
    (
        "cluster_namespace with a control character",
        lambda w: open_pool(w, namespace="ns\n"),
        INVALID,
        "control character",
    ),
    (
        "more blocks than extents can number",
        lambda w: open_pool(w, block=1, capacity=1 << 33),
        INVALID,
        "use larger blocks",
    ),
    (
        "capacity without a block size",
        lambda w: open_pool(w, block=0, capacity=1 << 20),
        INVALID,
        "attach",
    ),
    (
        "attach to a pool that does not exist",
        lambda w: open_pool(w, block=0, capacity=0),
        NOT_FOUND,
        "does not exist",
    ),
    (
        "attach with another compat_key",
        lambda w: open_pool(w, engine_id=POOL, block=0, capacity=0, compat="other"),
        PRECONDITION,
        "compat_key 'model'",
    ),
    (
        "geometry mismatch",
        lambda w: open_pool(w, engine_id=POOL, block=2048, capacity=256 * BLOCK, compat="model"),
        PRECONDITION,
        "block_size_bytes=1024",
    ),
    (
        "compat key mismatch",
        lambda w: open_pool(w, engine_id=POOL, capacity=256 * BLOCK, compat="other"),
        PRECONDITION,
        "compat_key",
    ),
    ("key over 256 bytes", lambda w: w.allocate(b"k" * 257, [10]), INVALID, "too long"),
    ("empty key", lambda w: w.allocate(b"", [10]), INVALID, "empty key"),
    ("zero nbytes", lambda w: w.allocate(b"z", [0], nbytes=0), INVALID, "not positive"),
    ("negative nbytes", lambda w: w.allocate(b"n", [10], nbytes=-10), INVALID, "positive"),
    (
        "nbytes disagrees with shape",
        lambda w: w.allocate(b"d", [10, 10], "float16", nbytes=100),
        INVALID,
        "expected 200",
    ),
    ("unknown dtype", lambda w: w.allocate(b"u", [10], "float128"), INVALID, "unknown dtype"),
    ("no shape", lambda w: w.allocate(b"s", [], nbytes=10), INVALID, "dimensions"),
    ("larger than the pool", lambda w: w.allocate(b"huge", [1 << 30]), INVALID, "blocks"),
    (
        "unknown pool",
        lambda w: w.allocate(b"k", [10], engine_id="nope"),
        NOT_FOUND,
        "does not exist",
    ),
    (
        "unknown session",
        lambda w: w.allocate(b"k", [10], session_id="nope"),
        NOT_FOUND,
        "unknown session",
    ),
    (
        "unknown lease",
        lambda w: w.stub.Release(pb.ReleaseRequest(session_id=w.session, lease_ids=[987654321])),
        NOT_FOUND,
        "unknown lease",
    ),
    ("double commit", double_commit, PRECONDITION, "READY"),
    ("commit after abort", commit_after_abort, NOT_FOUND, "no PENDING entry"),
    (
        "commit of a key never allocated",
        lambda w: w.commit(b"never"),
        NOT_FOUND,
        "no PENDING entry",
    ),
    ("double release", double_release, NOT_FOUND, "already released"),
    (
        "batch over the limit",
        lambda w: acquire(w, [b"k%d" % i for i in range(MAX_BATCH + 1)]),
        EXHAUSTED,
        "over the limit",
    ),
    (
        "hits over the protocol's limit",
        lambda w: step_hits(w, MAX_HITS_PER_STEP + 1),
        EXHAUSTED,
        "send the rest in the next Step",
    ),
    ("wait too long", lambda w: acquire(w, [b"k"], wait_ms=10**9), INVALID, "wait_ms"),
    ("bad key in an acquire", lambda w: acquire(w, [b""]), INVALID, "empty key"),
]


def step_hits(w: Wire, count: int) -> pb.StepReply:
    """A Step carrying `count` hits answered under lock pins (keys the pool need not hold)."""
    hits = [b"h%d" % i for i in range(count)]
    return w.stub.Step(pb.StepRequest(session_id=w.session, engine_id=POOL, hits=hits))


def test_a_steps_hits_are_bounded_by_the_protocol_not_by_max_batch(wire: Wire) -> None:
    """A busy engine's hits under lock pins fill Steps whatever --max-batch says."""
    assert MAX_HITS_PER_STEP > MAX_BATCH
    step_hits(wire, MAX_HITS_PER_STEP)  # answered, not refused


def outcome(call: object) -> tuple[grpc.StatusCode, str]:
    """The status of a failed call, or of the single (last) item of its reply."""
    try:
        reply = call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    results = getattr(reply, "results", None)
    if not results:
        return OK, ""
    item = results[-1]
    name = pb.ItemStatus.Name(item.status).removeprefix("ITEM_")
    return getattr(grpc.StatusCode, name, OK), item.message


@pytest.mark.parametrize(("case", "call", "status", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_the_right_status_and_a_message_naming_the_problem(
    bad_daemon: Daemon, wire: Wire, case: str, call: object, status: grpc.StatusCode, words: str
) -> None:
    code, message = outcome(lambda: call(wire))  # type: ignore[operator]
    assert code == status, f"{case}: {code} {message!r}"
    assert words in message, f"{case}: message {message!r} does not say {words!r}"
    with bad_daemon.client(name="checker") as c:
        assert c.health() == "SERVING"
        assert_blocks_accounted(c, POOL)
    assert bad_daemon.running


def test_one_bad_item_fails_alone_in_its_batch(wire: Wire) -> None:
    items = [
        pb.AllocateItem(key=b"good-1", tensor=pb.TensorSpec(shape=[10], dtype="uint8", nbytes=10)),
        pb.AllocateItem(key=b"", tensor=pb.TensorSpec(shape=[10], dtype="uint8", nbytes=10)),
        pb.AllocateItem(key=b"good-2", tensor=pb.TensorSpec(shape=[10], dtype="uint8", nbytes=11)),
        pb.AllocateItem(key=b"good-3", tensor=pb.TensorSpec(shape=[10], dtype="uint8", nbytes=10)),
    ]
    reply = wire.stub.Allocate(
        pb.AllocateRequest(session_id=wire.session, engine_id=POOL, items=items)
    )
    assert [pb.ItemStatus.Name(r.status) for r in reply.results] == [
        "ITEM_ALLOCATED",
        "ITEM_INVALID_ARGUMENT",
        "ITEM_INVALID_ARGUMENT",
        "ITEM_ALLOCATED",
    ]
    assert [r.key for r in reply.results] == [b"good-1", b"", b"good-2", b"good-3"]


def test_errors_carry_the_reason_and_boot_epoch_as_trailing_metadata(wire: Wire) -> None:
    with pytest.raises(grpc.RpcError) as info:
        wire.allocate(b"k", [10], session_id="gone")
    metadata = dict(info.value.trailing_metadata())  # type: ignore[attr-defined]
    assert metadata["ecd-reason"] == "unknown_session"
    assert len(metadata["ecd-boot-epoch"]) == 16
