"""Client and AsyncClient are twins: the same public calls with the same parameters, the async
one's a coroutine (or an async iterator) wherever it waits on the daemon. Each side's idioms
aside: AsyncClient's `start` (its constructor cannot connect, Client's does)."""

from __future__ import annotations

import inspect
from typing import Any

from ec_client import AsyncClient, Client

IDIOMS = {"start"}
# Calls that never wait on the daemon, plain methods on both sides (watch and open_watch open a
# stream and return it; its iteration waits).
LOCAL = {"on_restart", "pool_info", "view", "known_ready", "watch", "open_watch"}


def public(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and name not in IDIOMS
    }


def parameters(function: Any) -> list[tuple[str, Any, Any, Any]]:
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in inspect.signature(function).parameters.values()
    ]


def test_both_clients_have_the_same_public_calls_and_properties() -> None:
    assert sorted(public(AsyncClient)) == sorted(public(Client))


def test_each_call_takes_the_same_parameters_in_both_clients() -> None:
    twins = public(AsyncClient)
    for name, member in public(Client).items():
        if isinstance(member, property):
            assert isinstance(twins[name], property), name
        else:
            assert parameters(twins[name]) == parameters(member), name
    assert parameters(AsyncClient.__init__) == parameters(Client.__init__)


def test_the_async_client_awaits_every_call_that_waits_on_the_daemon() -> None:
    for name, member in public(AsyncClient).items():
        if isinstance(member, property):
            continue
        waits = inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        assert waits == (name not in LOCAL), name
