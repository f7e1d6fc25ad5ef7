"""SessionTable: leases on life renewed by activity, expiry, unique lease IDs."""

from __future__ import annotations

import pytest
from core_testing import FakeClock

from ec_client.types import Role, TensorSpec
from ec_daemon.errors import Code, CoreError, Reason
from ec_daemon.index import Entry
from ec_daemon.sessions import CONSUME, PRODUCE, SessionTable


def test_a_session_lives_for_one_ttl_after_its_last_sign_of_life() -> None:
    clock = FakeClock()
    table = SessionTable(10.0, clock)
    session = table.open("encoder", 42, Role.PRODUCER)
    clock.advance(9)
    table.touch(session.id)
    clock.advance(9)
    assert table.expired() == []
    clock.advance(1)
    assert table.expired() == [session]


def test_an_expired_session_is_unknown() -> None:
    clock = FakeClock()
    table = SessionTable(1.0, clock)
    session = table.open("encoder", 42, Role.PRODUCER)
    clock.advance(1)
    with pytest.raises(CoreError) as info:
        table.get(session.id)
    assert info.value.code is Code.NOT_FOUND
    assert info.value.reason is Reason.UNKNOWN_SESSION
    assert "unknown session" in info.value.message


def test_lease_ids_are_never_reused() -> None:
    table = SessionTable(10.0, FakeClock())
    session = table.open("decoder", 7, Role.CONSUMER)
    entry = Entry(b"k", TensorSpec((1,), "uint8", 1), (), 0, "", "", 0.0)
    ids = {table.add_lease(session, "p", entry).id for _ in range(100)}
    assert len(ids) == 100


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="TTL"):
        SessionTable(0, FakeClock())


@pytest.mark.parametrize(
    ("role", "allowed"),
    [
        (Role.PRODUCER, {"produce"}),
        (Role.CONSUMER, {"consume"}),
        (Role.BOTH, {"produce", "consume"}),
        (Role.ADMIN, set()),
    ],
)
def test_a_session_may_do_what_its_role_allows(role: Role, allowed: set[str]) -> None:
    table = SessionTable(10.0, FakeClock())
    session = table.open("client", 1, role)
    for name, roles in (("produce", PRODUCE), ("consume", CONSUME)):
        if name in allowed:
            assert table.touch(session.id, roles) is session
        else:
            with pytest.raises(CoreError) as info:
                table.touch(session.id, roles)
            assert info.value.code is Code.PERMISSION_DENIED


def test_a_refused_call_does_not_renew_the_lease() -> None:
    clock = FakeClock()
    table = SessionTable(10.0, clock)
    session = table.open("decoder", 7, Role.CONSUMER)
    clock.advance(9)
    with pytest.raises(CoreError):
        table.touch(session.id, PRODUCE)
    clock.advance(1)
    assert table.expired() == [session]
