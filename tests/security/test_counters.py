"""The hits and misses a client owes (StepRequest.hits, .misses) on a real daemon with tokens and an
access list: only a consumer of the pool may owe them, a Step carries a bounded number, a hit
counts only for an entry the pool holds, and whatever is sent, Stats and the metrics page still
answer."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from ecd_testing import Daemon, auth_args, running_daemon
from prometheus_client.parser import text_string_to_metric_families

from ec_client import AllocateItem, Client
from ec_daemon.tools.spawn import free_port
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_protocol.types import MAX_MISSES_PER_STEP, PoolStats

TOKENS = {
    "engine": "engine-0123456789abcdef",
    "stranger": "stranger-0123456789abcdef",  # a valid token no rule grants anything
    "ops": "ops-0123456789abcdef",
}
ACL = """
[[rule]]
pools = ["count-*"]
produce = ["engine"]
consume = ["engine"]

[[rule]]
pools = ["*"]
admin = ["ops"]
"""
POOL = "count-pool"
BLOCK = 4096
READY = b"ready"


@dataclass
class Secured:
    daemon: Daemon
    metrics_port: int


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    args = auth_args(tmp_path_factory.mktemp("counters"), TOKENS, ACL)
    port = free_port()
    metrics = ("--metrics-host", "127.0.0.1", "--metrics-port", str(port))
    with running_daemon("--max-bytes", "64MiB", *args, *metrics) as daemon:
        with Client(daemon.address, name="engine", token=TOKENS["engine"]) as engine:
            engine.open_pool(POOL, BLOCK, 64 * BLOCK)
            engine.allocate(POOL, [AllocateItem(READY, (16,), "uint8")])
            engine.commit(POOL, [READY])
        yield Secured(daemon, port)


@dataclass
class Caller:
    """Raw Steps (the client library never sends hostile counts) under one token's session."""

    stub: pb_grpc.EncoderCacheStub
    metadata: tuple[tuple[str, str], ...]
    session_id: str = ""

    def step(self, **parts: object) -> pb.StepReply:
        request = pb.StepRequest(session_id=self.session_id, engine_id=POOL, **parts)  # type: ignore[arg-type]
        reply: pb.StepReply = self.stub.Step(request, timeout=10, metadata=self.metadata)
        return reply

    def refused(self, **parts: object) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            self.step(**parts)
        return info.value


def caller(daemon: Daemon, name: str) -> Iterator[Caller]:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.EncoderCacheStub(channel)
        metadata = (("authorization", f"Bearer {TOKENS[name]}"),)
        opened = stub.OpenSession(pb.OpenSessionRequest(client_name=name), metadata=metadata)
        yield Caller(stub, metadata, opened.session_id)


@pytest.fixture
def engine(secured: Secured) -> Iterator[Caller]:
    yield from caller(secured.daemon, "engine")


@pytest.fixture
def stranger(secured: Secured) -> Iterator[Caller]:
    yield from caller(secured.daemon, "stranger")


def counted(secured: Secured) -> PoolStats:
    """The pool's counters as Stats shows them, once the metrics page agrees (both answer)."""
    with Client(secured.daemon.address, name="ops", token=TOKENS["ops"], keepalive=False) as ops:
        [pool] = ops.stats(POOL).pools
    url = f"http://127.0.0.1:{secured.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        samples = {
            (s.name, s.labels.get("engine_id")): s.value
            for family in text_string_to_metric_families(reply.read().decode())
            for s in family.samples
        }
    assert samples[("ecd_pool_hits_total", POOL)] == pool.hits
    assert samples[("ecd_pool_misses_total", POOL)] == pool.misses
    return pool


def test_a_token_granted_nothing_may_not_owe_hits_or_misses(
    secured: Secured, stranger: Caller
) -> None:
    before = counted(secured)
    for parts in ({"hits": [READY] * 4096}, {"misses": 10}):
        error = stranger.refused(**parts)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, parts
        assert "'stranger' may not consume in pool 'count-pool' (Step)" in str(error.details())
    after = counted(secured)
    assert (after.hits, after.misses) == (before.hits, before.misses)


@pytest.mark.parametrize("misses", [2**64 - 1, MAX_MISSES_PER_STEP + 1])
def test_a_step_owing_more_misses_than_the_protocol_allows_is_refused(
    secured: Secured, engine: Caller, misses: int
) -> None:
    before = counted(secured)
    error = engine.refused(misses=misses)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{misses} misses in one Step, over the protocol's {MAX_MISSES_PER_STEP}" in str(
        error.details()
    )
    assert counted(secured).misses == before.misses  # and Stats and the metrics still answer


def test_a_step_owing_the_protocols_misses_counts_them_all(
    secured: Secured, engine: Caller
) -> None:
    before = counted(secured)
    engine.step(misses=MAX_MISSES_PER_STEP)
    assert counted(secured).misses == before.misses + MAX_MISSES_PER_STEP


def test_hits_naming_entries_the_pool_does_not_hold_count_nothing(
    secured: Secured, engine: Caller
) -> None:
    before = counted(secured)
    engine.step(hits=[b"absent", READY, b"never-there"])
    assert counted(secured).hits == before.hits + 1
