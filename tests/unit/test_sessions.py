"""SessionTable: leases on life renewed by activity, expiry, unique lease IDs."""

from __future__ import annotations

import pytest
from core_testing import FakeClock

from ec_daemon.core.errors import Code, CoreError, Reason
from ec_daemon.core.index import Entry
from ec_daemon.core.sessions import CONSUME, PRODUCE, SessionTable, tag
from ec_protocol.types import Role, TensorSpec


def test_a_session_lives_for_one_ttl_after_its_last_sign_of_life() -> None:
    clock = FakeClock()
    table = SessionTable(10.0, clock)
    session = table.open("encoder", 42, Role.PRODUCER, b"")
    clock.advance(9)
    table.touch(session.id)
    clock.advance(9)
    assert table.expired() == []
    clock.advance(1)
    assert table.expired() == [session]


def test_an_expired_session_is_unknown() -> None:
    clock = FakeClock()
    table = SessionTable(1.0, clock)
    session = table.open("encoder", 42, Role.PRODUCER, b"")
    clock.advance(1)
    with pytest.raises(CoreError) as info:
        table.get(session.id)
    assert info.value.code is Code.NOT_FOUND
    assert info.value.reason is Reason.UNKNOWN_SESSION
    assert "unknown session" in info.value.message


def test_lease_ids_are_never_reused() -> None:
    table = SessionTable(10.0, FakeClock())
    session = table.open("decoder", 7, Role.CONSUMER, b"")
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
    session = table.open("client", 1, role, b"")
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
    session = table.open("decoder", 7, Role.CONSUMER, b"")
    clock.advance(9)
    with pytest.raises(CoreError):
        table.touch(session.id, PRODUCE)
    clock.advance(1)
    assert table.expired() == [session]


def unknown_answer(call: object) -> tuple[Code, str, Reason]:
    with pytest.raises(CoreError) as info:
        call()  # type: ignore[operator]
    return info.value.code, info.value.message, info.value.reason


def test_a_session_named_by_another_caller_answers_as_one_that_does_not_exist() -> None:
    table = SessionTable(10.0, FakeClock())
    session = table.open("victim", 7, Role.CONSUMER, b"victim-identity")
    table.owned(session.id, b"victim-identity")  # its opener: fine
    foreign = unknown_answer(lambda: table.owned(session.id, b"someone-else"))
    table.remove(session)
    gone = unknown_answer(lambda: table.owned(session.id, b"someone-else"))
    assert foreign == gone
    assert foreign[0] is Code.NOT_FOUND and foreign[2] is Reason.UNKNOWN_SESSION


def test_a_session_tag_names_it_in_logs_without_being_its_id() -> None:
    table = SessionTable(10.0, FakeClock())
    first, second = (table.open("c", 1, Role.BOTH, b"").id for _ in range(2))
    assert tag(first) == tag(first) != tag(second)
    assert tag(first) not in first and len(tag(first)) < len(first) // 2
