"""The decisions every client call makes (ec_client/control/_session.py), driven by a scripted
daemon: no gRPC, no sockets. The same plans run under Client and AsyncClient, so this is where their
rules are pinned down.

Proves: UNAVAILABLE is retried with growing pauses until the connect deadline; a call that finds
no daemon fails at once by default, or waits wait_for_daemon_s for it and then says for how long
and why; an Acquire whose wait ends while the daemon is away answers MISS; a lost session is
reopened, with its pools, and the call retried once; a reply from a restarted daemon reopens the
session and still answers; a call the daemon cut off at shutdown is retried when it is safe and
otherwise raised saying it may have taken effect; a pool that cannot be reopened is skipped;
two callers that notice one restart reopen it once; a Step carrying what the client owes
hands each op its answer, or the error, or, when its driver gives up on it, CANCELLED.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from ec_client.control import _wire
from ec_client.control._connection import Options
from ec_client.control._session import Done, Pause, Plan, Probe, Reopen, Send, SessionState, advance
from ec_client.control.outbox import Answered, DeferredOp, OutboxBatch
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.errors import EcdError
from ec_protocol.types import AllocateItem, Role, Status

UNAVAILABLE = EcdError(grpc.StatusCode.UNAVAILABLE, "connection refused")
SESSION_LOST = EcdError(grpc.StatusCode.NOT_FOUND, "unknown session", "unknown_session")
CUT_OFF = EcdError(grpc.StatusCode.CANCELLED, "cancelled")
POOL_GONE = EcdError(grpc.StatusCode.NOT_FOUND, "pool 'p' does not exist", "unknown_pool")


class ScriptedDaemon:
    """Answers each Send with the next outcome of the script (a reply or an EcdError), and drives
    Reopen steps as the clients do; records the methods sent and the pauses taken."""

    def __init__(self, state: SessionState, *script: Any, problem: str | None = None) -> None:
        """problem: what a Probe of the connection finds (None: nothing wrong)."""
        self.state = state
        self.script = list(script)
        self.problem = problem
        self.sent: list[str] = []
        self.requests: list[Any] = []  # each Send's request, as built
        self.pauses: list[float] = []

    def run(self, plan: Plan[Any], reply: Any = None, error: EcdError | None = None) -> Any:
        """Drive the plan to its end; reply or error: the outcome of a Send it already made."""
        while True:
            step = advance(plan, reply, error)
            reply, error = None, None
            if isinstance(step, Done):
                return step.value
            if isinstance(step, Send):
                self.sent.append(step.call.method)
                self.requests.append(step.call.build(step.session_id))
                outcome = self.script.pop(0)
                if isinstance(outcome, EcdError):
                    error = outcome
                else:
                    reply = outcome
            elif isinstance(step, Pause):
                self.pauses.append(step.seconds)
                if isinstance(self.state.clock, FakeClock):
                    self.state.clock.now += step.seconds
            elif isinstance(step, Probe):
                reply = self.problem
            elif isinstance(step, Reopen) and step.generation == self.state.generation:
                try:
                    self.run(self.state.reopen())
                except EcdError as exc:
                    error = exc
                else:
                    self.state.tell_restart()


class FakeClock:
    """The plans' clock: time passes only in their pauses."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def session(epoch: str = "epoch-1", sid: str = "s1") -> pb.OpenSessionReply:
    return pb.OpenSessionReply(session_id=sid, boot_epoch=epoch, lease_ttl_ms=10_000)


def lookup_reply(epoch: str = "epoch-1") -> pb.LookupReply:
    return pb.LookupReply(
        boot_epoch=epoch, results=[pb.LookupResult(key=b"k", state=pb.ENTRY_READY)]
    )


def pool_reply(epoch: str = "epoch-1") -> pb.OpenPoolReply:
    return pb.OpenPoolReply(
        boot_epoch=epoch,
        pool=pb.PoolInfo(engine_id="p", block_size_bytes=4096, num_blocks=16),
    )


def opened(connect_timeout_s: float = 5.0, wait_for_daemon_s: float = 0.0) -> SessionState:
    """A state with an open session on epoch-1 and pool p opened, on a FakeClock."""
    options = Options.make(
        "unix:///x",
        "test",
        Role.BOTH,
        connect_timeout_s,
        5.0,
        None,
        None,
        wait_for_daemon_s=wait_for_daemon_s,
    )
    state = SessionState(options, clock=FakeClock())
    daemon = ScriptedDaemon(state, session(), pool_reply())
    daemon.run(state.open())
    asked = ("p", 4096, 16 * 4096, "", False)
    daemon.run(state.open_pool(_wire.open_pool(*asked), _wire.open_pool(*asked, reopen=True)))
    assert not daemon.requests[-1].reopen
    return state


def test_unavailable_is_retried_with_growing_pauses_until_it_answers() -> None:
    state = opened()
    daemon = ScriptedDaemon(state, UNAVAILABLE, UNAVAILABLE, lookup_reply())
    [result] = daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert result.key == b"k"
    assert daemon.sent == ["Lookup"] * 3
    assert daemon.pauses == [0.05, 0.1]


def test_unavailable_past_the_connect_deadline_is_raised() -> None:
    state = opened(connect_timeout_s=0.0)
    daemon = ScriptedDaemon(state, UNAVAILABLE)
    with pytest.raises(EcdError) as raised:
        daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE and daemon.pauses == []


NOTHING_LISTENS = "nothing listens on /x: the daemon that made it has stopped"


def test_a_call_finding_no_daemon_fails_at_once_by_default_in_the_probes_words() -> None:
    state = opened()
    daemon = ScriptedDaemon(state, UNAVAILABLE, problem=NOTHING_LISTENS)
    with pytest.raises(EcdError) as raised:
        daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert raised.value.message == f"cannot reach ecd at unix:///x: {NOTHING_LISTENS}"
    assert daemon.pauses == []


def test_a_call_finding_no_daemon_waits_up_to_wait_for_daemon_s_for_it_to_come_back() -> None:
    state = opened(wait_for_daemon_s=30.0)
    down = [UNAVAILABLE] * 8  # 0.05 + 0.1 + ... + 1 + 1: about 4 s
    daemon = ScriptedDaemon(state, *down, lookup_reply(), problem=NOTHING_LISTENS)
    [result] = daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert result.key == b"k" and len(daemon.pauses) == 8


def test_a_call_whose_daemon_stays_away_past_wait_for_daemon_s_says_for_how_long_and_why() -> None:
    state = opened(wait_for_daemon_s=3.0)
    daemon = ScriptedDaemon(state, *[UNAVAILABLE] * 100, problem=NOTHING_LISTENS)
    with pytest.raises(EcdError) as raised:
        daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert raised.value.message == f"cannot reach ecd at unix:///x for 3 s: {NOTHING_LISTENS}"
    assert sum(daemon.pauses) == pytest.approx(3.0)


@pytest.mark.parametrize("outage", [UNAVAILABLE, CUT_OFF], ids=["unreachable", "cut off"])
@pytest.mark.parametrize("patience", [0.0, 30.0], ids=["fail fast", "wait_for_daemon_s 30"])
def test_an_acquire_whose_wait_ends_while_the_daemon_is_away_answers_every_key_a_miss(
    outage: EcdError, patience: float
) -> None:
    state = opened(wait_for_daemon_s=patience)
    daemon = ScriptedDaemon(state, outage, *[UNAVAILABLE] * 100, problem=NOTHING_LISTENS)
    results = daemon.run(state.call(_wire.acquire("p", ["a", "b"], wait_ms=1000)))
    assert [(r.key, r.status) for r in results] == [(b"a", Status.MISS), (b"b", Status.MISS)]
    assert "was away until the wait ran out" in results[0].message
    assert sum(daemon.pauses) == pytest.approx(1.0)


def test_an_acquire_whose_patience_ends_before_its_wait_fails_as_any_call() -> None:
    state = opened(connect_timeout_s=5.0)
    daemon = ScriptedDaemon(state, *[UNAVAILABLE] * 100, problem=NOTHING_LISTENS)
    with pytest.raises(EcdError) as raised:
        daemon.run(state.call(_wire.acquire("p", ["a"], wait_ms=60_000)))
    assert raised.value.message == f"cannot reach ecd at unix:///x for 5 s: {NOTHING_LISTENS}"


def test_a_lost_session_is_reopened_with_its_pools_and_the_call_retried_once() -> None:
    state = opened()
    restarts: list[str] = []
    state.on_restart.append(restarts.append)
    daemon = ScriptedDaemon(
        state,
        SESSION_LOST,
        session("epoch-2", "s2"),
        pool_reply("epoch-2"),
        lookup_reply("epoch-2"),
    )
    daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert daemon.sent == ["Lookup", "OpenSession", "OpenPool", "Lookup"]
    assert (state.session_id, state.boot_epoch, restarts) == ("s2", "epoch-2", ["epoch-2"])
    [reopened] = [r for r in daemon.requests if isinstance(r, pb.OpenPoolRequest)]
    # By itself: the daemon may make a pool it lost again, never one dropped under this client.
    assert reopened.reopen and reopened.block_size_bytes == 4096


def test_a_pool_reopened_when_its_file_changed_is_opened_with_reopen() -> None:
    state = opened()
    daemon = ScriptedDaemon(state, pool_reply())
    daemon.run(state.reopen_pool("p"))
    assert daemon.requests[-1].reopen


def test_a_reply_from_a_restarted_daemon_reopens_the_session_and_still_answers() -> None:
    state = opened()
    daemon = ScriptedDaemon(
        state, lookup_reply("epoch-2"), session("epoch-2", "s2"), pool_reply("epoch-2")
    )
    [result] = daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert result.key == b"k"
    assert daemon.sent == ["Lookup", "OpenSession", "OpenPool"]
    assert state.boot_epoch == "epoch-2"


def test_a_safe_call_cut_off_at_shutdown_is_retried() -> None:
    state = opened()
    daemon = ScriptedDaemon(state, CUT_OFF, lookup_reply())
    daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert daemon.sent == ["Lookup", "Lookup"]


def test_an_unsafe_call_cut_off_at_shutdown_says_it_may_have_taken_effect() -> None:
    state = opened()
    daemon = ScriptedDaemon(state, CUT_OFF)
    with pytest.raises(EcdError, match="may or may not have taken effect") as raised:
        daemon.run(state.call(_wire.commit("p", ["k"], None)))
    assert raised.value.reason == "shutting_down" and daemon.sent == ["Commit"]


def test_a_safe_call_whose_daemon_does_not_come_back_says_it_shut_down() -> None:
    state = opened(connect_timeout_s=0.0)
    daemon = ScriptedDaemon(state, CUT_OFF)
    with pytest.raises(EcdError, match="shut down during Lookup"):
        daemon.run(state.call(_wire.lookup("p", ["k"])))


def test_a_pool_that_cannot_be_reopened_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    state = opened()
    daemon = ScriptedDaemon(
        state, SESSION_LOST, session("epoch-2", "s2"), POOL_GONE, lookup_reply("epoch-2")
    )
    with caplog.at_level(logging.WARNING, "ec_client"):
        daemon.run(state.call(_wire.lookup("p", ["k"])))
    assert daemon.sent == ["Lookup", "OpenSession", "OpenPool", "Lookup"]
    assert "pool p not reopened" in caplog.text


def test_a_restart_noticed_by_two_callers_is_reopened_once() -> None:
    state = opened()
    second = state.call(_wire.lookup("p", ["k"]))
    assert isinstance(advance(second, None, None), Send)  # its Lookup is on its way
    daemon = ScriptedDaemon(
        state,
        SESSION_LOST,
        session("epoch-2", "s2"),
        pool_reply("epoch-2"),
        lookup_reply("epoch-2"),
    )
    daemon.run(state.call(_wire.lookup("p", ["k"])))  # the first caller notices and reopens
    daemon.script.append(lookup_reply("epoch-2"))
    daemon.run(second, error=SESSION_LOST)  # the second learns of it too, late
    assert daemon.sent == ["Lookup", "OpenSession", "OpenPool", "Lookup", "Lookup"]


def test_a_step_carrying_deferred_ops_answers_each_and_returns_the_callers() -> None:
    state = opened()
    heard: list[Any] = []
    batch = OutboxBatch(commits=[DeferredOp(on_result=heard.append, key=b"owed")])
    reply = pb.StepReply(
        boot_epoch="epoch-1",
        commits=[pb.ItemResult(key=k, status=pb.ITEM_OK) for k in (b"owed", b"mine")],
    )
    call = batch.step("p", commits=[(b"mine", 0, 0)])
    result = ScriptedDaemon(state, reply).run(state.step(batch, call))
    assert [r.key for r in heard] == [b"owed"]
    assert [r.key for r in result.commits] == [b"mine"]


def test_a_step_that_fails_tells_every_debt_and_raises() -> None:
    state = opened(connect_timeout_s=0.0)
    heard: list[object] = []
    batch = OutboxBatch(releases=[DeferredOp(on_result=heard.append, lease_id=7)])
    with pytest.raises(EcdError) as raised:
        ScriptedDaemon(state, UNAVAILABLE).run(state.step(batch, batch.step("p")))
    assert heard == [raised.value]


def test_a_step_its_driver_gives_up_on_tells_every_op_it_was_interrupted() -> None:
    state = opened()
    heard: list[object] = []
    batch = OutboxBatch(commits=[DeferredOp(on_result=heard.append, key=b"owed")])
    plan = state.step(batch, batch.step("p"))
    assert isinstance(advance(plan, None, None), Send)  # on its way
    plan.close()  # e.g. the caller's asyncio task was cancelled while it waited
    [error] = heard
    assert isinstance(error, EcdError) and error.code is grpc.StatusCode.CANCELLED
    assert "may or may not have taken effect" in error.message


def lookups(*keys: bytes, epoch: str = "epoch-1") -> pb.LookupReply:
    return pb.LookupReply(
        boot_epoch=epoch, results=[pb.LookupResult(key=k, state=pb.ENTRY_READY) for k in keys]
    )


def limited(max_batch: int) -> SessionState:
    """A state whose daemon said it takes batches of at most max_batch items."""
    state = SessionState(Options.make("unix:///x", "test", Role.BOTH, 5.0, 5.0, None, None))
    reply = session()
    reply.max_batch = max_batch
    ScriptedDaemon(state, reply).run(state.open())
    return state


def test_a_batch_over_the_daemons_limit_goes_in_parts_answered_in_order() -> None:
    state = limited(2)
    daemon = ScriptedDaemon(state, lookups(b"a", b"b"), lookups(b"c", b"d"), lookups(b"e"))
    results = daemon.run(state.call(_wire.lookup("p", ["a", "b", "c", "d", "e"])))
    assert [r.key for r in results] == [b"a", b"b", b"c", b"d", b"e"]
    assert daemon.sent == ["Lookup"] * 3


def test_a_part_refused_after_a_restart_lowered_the_limit_is_split_again() -> None:
    state = limited(4)
    over = EcdError(grpc.StatusCode.RESOURCE_EXHAUSTED, "batch of 4 items is over the limit of 2")
    smaller = session("epoch-2", "s2")
    smaller.max_batch = 2
    daemon = ScriptedDaemon(
        state,
        SESSION_LOST,  # the daemon restarted, now with --max-batch 2
        smaller,
        over,
        lookups(b"a", b"b", epoch="epoch-2"),
        lookups(b"c", b"d", epoch="epoch-2"),
    )
    results = daemon.run(state.call(_wire.lookup("p", ["a", "b", "c", "d"])))
    assert [r.key for r in results] == [b"a", b"b", b"c", b"d"]
    assert daemon.sent == ["Lookup", "OpenSession", "Lookup", "Lookup", "Lookup"]


def test_a_split_step_that_fails_part_way_tells_each_op_what_its_part_heard() -> None:
    state = limited(1)
    heard: dict[bytes, Any] = {}
    returned: list[Answered] = []
    batch = OutboxBatch(
        commits=[
            DeferredOp(on_result=lambda r, k=k: heard.update({k: r}), key=k) for k in (b"x", b"y")
        ],
        answered=Answered(misses=3),
        returned=returned.append,
    )
    first = pb.StepReply(boot_epoch="epoch-1", commits=[pb.ItemResult(key=b"x", status=pb.ITEM_OK)])
    refused = EcdError(grpc.StatusCode.PERMISSION_DENIED, "no", "role")
    daemon = ScriptedDaemon(state, first, refused)
    with pytest.raises(EcdError):
        daemon.run(state.step(batch, batch.step("p")))
    assert heard[b"x"].status is Status.OK and heard[b"y"] is refused
    assert returned == [Answered(misses=3)]  # rode on the part that failed: owed again


def test_a_step_over_the_limit_splits_each_part_and_carries_the_counts_on_its_last() -> None:
    item = AllocateItem(b"new", (8,), "uint8")
    call = _wire.step("p", acquires=[b"a", b"b", b"c"], allocates=[item], misses=5, hits=[b"h"])
    assert call.split is not None
    cut = call.split(2)
    assert cut is not None
    first, rest = (part.build("s") for part in cut)
    assert (list(first.acquires), len(first.allocates), first.misses) == ([b"a", b"b"], 1, 0)
    assert (list(rest.acquires), len(rest.allocates), rest.misses) == ([b"c"], 0, 5)
    assert list(rest.hits) == [b"h"] and not first.hits
    assert cut[1].split is not None and cut[1].split(2) is None  # the rest fits


def test_a_local_only_step_over_the_limit_is_local_only_in_each_part() -> None:
    call = _wire.step("p", acquires=[b"a", b"b", b"c"], local_only=True)
    assert call.split is not None
    cut = call.split(2)
    assert cut is not None
    assert [part.build("s").local_only for part in cut] == [True, True]
