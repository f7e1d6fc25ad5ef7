"""How the node judges its store calls (ec_daemon/cluster/calls.py): a call is made on this
test's thread against a clock of its own, which the call itself advances to take its time."""

from __future__ import annotations

import threading

from core_testing import FakeClock

from ec_daemon.cluster.calls import CALL_BOUND_S, MasterState
from ec_daemon.cluster.mooncake import RPC_FAIL, answered


def joined(clock: FakeClock, back: list[str] | None = None) -> MasterState:
    """A state whose master answered, on `clock`; `back` hears each reconnection."""
    said = back if back is not None else []
    state = MasterState(on_back=lambda: said.append("back"), clock=clock)
    state.answered()
    return state


def taking(clock: FakeClock, seconds: float, result: object) -> object:
    clock.advance(seconds)
    return result


def test_a_call_whose_result_carries_an_rpc_failure_disconnects_the_node() -> None:
    clock = FakeClock()
    state = joined(clock)
    state.call("lookup", lambda: [0, RPC_FAIL], answered)
    assert not state.connected and "did not answer a lookup" in state.error


def test_a_call_whose_result_cannot_tell_disconnects_the_node_only_past_the_bound() -> None:
    clock = FakeClock()
    state = joined(clock)
    state.call("marker get", lambda: taking(clock, CALL_BOUND_S / 2, b""), lambda _: None)
    assert state.connected
    state.call("marker get", lambda: taking(clock, CALL_BOUND_S * 2, b""), lambda _: None)
    assert not state.connected and "marker get" in state.error


def test_a_call_running_past_the_bound_disconnects_the_node_while_it_runs() -> None:
    clock = FakeClock()
    state = joined(clock)
    inside, release = threading.Event(), threading.Event()
    seen: list[tuple[bool, str]] = []

    def hanging() -> list[int]:
        inside.set()
        assert release.wait(10)
        return [0]

    caller = threading.Thread(target=state.call, args=("lookup", hanging, answered))
    caller.start()
    assert inside.wait(10)
    seen.append((state.connected, state.error))
    clock.advance(CALL_BOUND_S + 0.1)
    seen.append((state.connected, state.error))
    release.set()
    caller.join(10)
    assert seen[0] == (True, "")
    assert seen[1][0] is False and "has not answered a lookup" in seen[1][1]


def test_a_late_call_whose_result_shows_an_answer_reconnects_the_node_and_says_so() -> None:
    clock = FakeClock()
    back: list[str] = []
    state = joined(clock, back)
    state.call("lookup", lambda: [RPC_FAIL], answered)
    state.call("lookup", lambda: taking(clock, CALL_BOUND_S * 30, [0]), answered)
    assert state.connected and state.error == ""
    assert back == ["back"]
