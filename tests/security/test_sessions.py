"""A session answers only to the caller that opened it, on a real daemon: another token (or, with
mutual TLS, another client certificate) naming a session ID it learned gets exactly what a
session that does not exist gets, and the session's owner loses nothing; logs never carry a
session ID."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from ecd_testing import Daemon, auth_args, running_daemon
from google.protobuf.message import Message
from pki_testing import Pair, make_pki_for, tls_args

from ec_client import AllocateItem, Client, EntryState, Status, TLSFiles
from ec_daemon.core.sessions import tag
from ec_daemon.tools.spawn import free_port
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc

TOKENS = {"victim": "victim-0123456789abcdef", "intruder": "intruder-0123456789abcdef"}
# Both may do everything in the pool: only the session's owner stands between them.
ACL = """
[[rule]]
pools = ["shared-*"]
produce = ["victim", "intruder"]
consume = ["victim", "intruder"]
admin = ["victim", "intruder"]
"""
BLOCK = 4096
READY, PENDING = b"ready", b"pending"

Answer = tuple[grpc.StatusCode, str, str]

# Every RPC that names a session, as the intruder sends it: the victim's session ID, lease, pool.
REQUESTS: dict[str, Callable[[str, int, str], Message]] = {
    "Release": lambda s, lease, pool: pb.ReleaseRequest(session_id=s, lease_ids=[lease]),
    "KeepAlive": lambda s, lease, pool: pb.KeepAliveRequest(session_id=s),
    "CloseSession": lambda s, lease, pool: pb.CloseSessionRequest(session_id=s),
    "Step": lambda s, lease, pool: pb.StepRequest(
        session_id=s, engine_id=pool, releases=[lease], aborts=[PENDING], acquires=[READY]
    ),
    "Acquire": lambda s, lease, pool: pb.AcquireRequest(session_id=s, engine_id=pool, keys=[READY]),
    "Commit": lambda s, lease, pool: pb.CommitRequest(
        session_id=s, engine_id=pool, items=[pb.CommitItem(key=PENDING)]
    ),
    "Abort": lambda s, lease, pool: pb.AbortRequest(session_id=s, engine_id=pool, keys=[PENDING]),
    "Allocate": lambda s, lease, pool: pb.AllocateRequest(
        session_id=s,
        engine_id=pool,
        items=[pb.AllocateItem(key=b"forged", tensor=pb.TensorSpec(shape=[16], dtype="uint8"))],
    ),
    "OpenPool": lambda s, lease, pool: pb.OpenPoolRequest(session_id=s, engine_id=pool),
    "DropPool": lambda s, lease, pool: pb.DropPoolRequest(session_id=s, engine_id=pool),
}
# What the intruder could do to the victim in each protocol, before sessions had owners.
SESSION_RPCS = ("Release", "KeepAlive", "CloseSession")


def test_every_rpc_that_names_a_session_is_tried() -> None:
    service = pb.DESCRIPTOR.services_by_name["EncoderCache"]
    naming = {m.name for m in service.methods if "session_id" in m.input_type.fields_by_name}
    assert naming == REQUESTS.keys()


@dataclass
class Intruder:
    """Raw calls on a channel of the intruder's own, with its own credentials."""

    stub: pb_grpc.EncoderCacheStub
    metadata: tuple[tuple[str, str], ...] = ()

    def answer(self, rpc: str, request: Message) -> Answer:
        with pytest.raises(grpc.RpcError) as info:
            getattr(self.stub, rpc)(request, timeout=10, metadata=self.metadata)
        error = info.value
        trailing = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
        return error.code(), error.details(), str(trailing.get("ecd-reason", ""))

    def assert_answered_as_no_session(
        self, rpc: str, victim: Client, lease: int, pool: str
    ) -> None:
        """The call naming the victim's session is refused exactly as one naming a session that
        never was (the message repeats the ID it was given, nothing else)."""
        stolen = self.answer(rpc, REQUESTS[rpc](victim.session_id, lease, pool))
        nobody = uuid.uuid4().hex
        absent = self.answer(rpc, REQUESTS[rpc](nobody, lease, pool))
        assert stolen == (absent[0], absent[1].replace(nobody, victim.session_id), absent[2])
        assert stolen[0] == grpc.StatusCode.NOT_FOUND and stolen[2] == "unknown_session", stolen


def victim_state(victim: Client, pool: str) -> int:
    """A READY entry the victim pins (the lease returned) and a PENDING one it is writing."""
    victim.open_pool(pool, BLOCK, 64 * BLOCK)
    victim.allocate(pool, [AllocateItem(READY, (16,), "uint8")])
    victim.commit(pool, [READY])
    victim.allocate(pool, [AllocateItem(PENDING, (16,), "uint8")])
    [hit] = victim.acquire(pool, [READY])
    assert hit.status is Status.HIT
    return hit.lease_id


def assert_victim_intact(victim: Client, session_id: str, lease: int, pool: str) -> None:
    """Its session, pin and PENDING entry are as it left them: its own calls still work."""
    ready, pending = victim.lookup(pool, [READY, PENDING])
    assert (ready.pins, pending.state) == (1, EntryState.PENDING)
    assert [r.status for r in victim.release([lease])] == [Status.OK]
    assert [r.status for r in victim.commit(pool, [PENDING])] == [Status.OK]
    assert victim.session_id == session_id  # never reopened: the daemon kept it


# ---- bearer tokens -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    args = auth_args(tmp_path_factory.mktemp("sessions"), TOKENS, ACL)
    with running_daemon("--max-bytes", "64MiB", *args) as daemon:
        yield daemon


def by_token(daemon: Daemon, name: str) -> Iterator[Intruder]:
    with grpc.insecure_channel(daemon.address) as channel:
        yield Intruder(
            pb_grpc.EncoderCacheStub(channel), (("authorization", f"Bearer {TOKENS[name]}"),)
        )


@pytest.fixture
def intruder(secured: Daemon) -> Iterator[Intruder]:
    yield from by_token(secured, "intruder")


@pytest.mark.parametrize("rpc", list(REQUESTS))
def test_another_token_naming_a_session_is_answered_as_if_there_were_none(
    secured: Daemon, intruder: Intruder, rpc: str
) -> None:
    pool = f"shared-{rpc.lower()}"
    with Client(secured.address, name="victim", token=TOKENS["victim"], keepalive=False) as victim:
        session_id, lease = victim.session_id, victim_state(victim, pool)
        intruder.assert_answered_as_no_session(rpc, victim, lease, pool)
        assert_victim_intact(victim, session_id, lease, pool)


def test_the_same_token_on_another_connection_is_the_sessions_owner(secured: Daemon) -> None:
    """A client that reconnects (or a second channel of it) keeps its session: the session is
    bound to the token, not to a connection."""
    with Client(secured.address, name="victim", token=TOKENS["victim"], keepalive=False) as victim:
        for again in by_token(secured, "victim"):
            request = pb.KeepAliveRequest(session_id=victim.session_id)
            again.stub.KeepAlive(request, timeout=10, metadata=again.metadata)


# ---- mutual TLS --------------------------------------------------------------------------------


def test_another_client_certificate_naming_a_session_is_answered_as_if_there_were_none(
    tmp_path: Path,
) -> None:
    ca, server, [owner, other] = make_pki_for(tmp_path, ("victim", "intruder"))
    port = free_port()
    target = f"127.0.0.1:{port}"
    with running_daemon(*tls_args(port, server, client_ca=ca)):
        tls = TLSFiles(ca=ca, cert=owner.cert, key=owner.key)
        with Client(target, name="victim", tls=tls, keepalive=False) as victim:
            session_id, lease = victim.session_id, victim_state(victim, "mtls-pool")
            with grpc.secure_channel(target, credentials(ca, other)) as channel:
                intruder = Intruder(pb_grpc.EncoderCacheStub(channel))
                for rpc in SESSION_RPCS:
                    intruder.assert_answered_as_no_session(rpc, victim, lease, "mtls-pool")
            assert_victim_intact(victim, session_id, lease, "mtls-pool")


def credentials(ca: Path, pair: Pair) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        ca.read_bytes(), pair.key.read_bytes(), pair.cert.read_bytes()
    )


# ---- logs --------------------------------------------------------------------------------------


def test_no_log_line_above_debug_carries_a_session_id() -> None:
    args = ("--log-format", "json", "--log-level", "info", "--max-bytes", "64MiB")
    with running_daemon(*args, "--lease-ttl", "1") as daemon:
        with daemon.client(name="closes") as closes:
            ids = [closes.session_id]
        silent = Client(daemon.address, name="silent", keepalive=False)  # its lease runs out
        ids.append(silent.session_id)
        deadline = time.monotonic() + 10
        while "session lease expired" not in daemon.log():
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        lines = [json.loads(text) for text in daemon.log().splitlines()]
    about_sessions = [line for line in lines if line["msg"].startswith("session ")]
    assert {line["session"] for line in about_sessions} == {tag(i) for i in ids}
    shown = [line for line in lines if line["level"] != "debug"]
    assert not [line for line in shown for i in ids if i in json.dumps(line)]
