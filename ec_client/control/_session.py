"""The decisions every client call makes, once for Client and AsyncClient alike.

A call is a *plan*: a generator that yields the I/O it needs (`Send` an RPC, `Pause`, `Reopen`
the session) and receives the outcome (the reply, or an EcdError thrown into it). Client drives
plans with blocking gRPC calls and threads, AsyncClient with grpc.aio and asyncio; neither holds
any rule of its own. The rules:

- UNAVAILABLE (daemon down or restarting): retry with exponential backoff within the client's
  patience, counted from the first failure, then raise "cannot reach ecd at ADDRESS for N s:
  why". At the first failure a plain connection (`Probe`) asks why:
  - nothing wrong found (the daemon is there, or the cause lies beyond what a connection shows):
    retry for connect_timeout_s, or wait_for_daemon_s if longer;
  - no socket, nothing listening on it, TLS refused: the daemon is not there, and the call
    waits wait_for_daemon_s for it to come back (0 by default: it fails at once, in the words
    of the probe); a call that asked to wait (Acquire's wait_ms), at least within that wait
    (at most connect_timeout_s).
  A call whose own wait ends before its patience is answered then as the daemon would have
  answered a wait in vain (`Call.waited_out`: every key a MISS), not raised: the caller asked
  for an answer within its wait.
- A call the daemon cut off because it was shutting down (UNAVAILABLE with reason
  shutting_down, which a waiting Acquire gets at once, or CANCELLED at the end of the shutdown
  grace): a restart is under way, so the call is retried for connect_timeout_s (or
  wait_for_daemon_s if longer) from then, missing socket or not, if it is safe to retry
  (`Call.safe_to_retry`), so that a restart goes unnoticed; otherwise raised, saying the call
  may or may not have taken effect.
  Acquire counts as safe: an attempt cut off after pinning leaves a pin in a daemon that is
  going away, and its session with it (at worst, with a daemon that did not stop after all,
  the pin is held until this session ends).
- NOT_FOUND with reason unknown_session (lease ran out, or the daemon restarted): open a new
  session, reopen the pools this client had opened, tell on_restart callbacks, retry once.
- The client opens its pools again by itself (a new session, a pool file replaced, a Watch
  stream that ended) with OpenPool's `reopen`: the daemon attaches, or makes the pool again
  where it lost it, but never makes anew one dropped while this client held it (an operator's
  `ecd drop` sticks): that is FAILED_PRECONDITION pool_dropped, raised to the caller; only the
  application's own open_pool makes it again.
- A call after the client's close() is FAILED_PRECONDITION "this client is closed", before
  anything is sent (whether or not the daemon would need the session to answer it).
- A reply whose boot epoch differs from the session's: the daemon restarted; do the same.
- A reopen happens once however many callers noticed: `Reopen` carries the generation the
  caller saw, and the driver skips it when the session moved on meanwhile.
- A call its driver gives up on (the caller's asyncio task cancelled, anything raised that is not
  the daemon's answer) is closed (`interrupted`): a Step's ops then hear CANCELLED, as for a Step
  that may or may not have reached the daemon, so that what can be owed again is, and none of
  them waits for an answer that will never come.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from ec_client.control import _wire
from ec_client.control._connection import (
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    Options,
    unix_socket_path,
)
from ec_client.control.outbox import OutboxBatch
from ec_protocol.errors import EcdError
from ec_protocol.pool import fd_passing
from ec_protocol.pool.life_marks import LifeMarks
from ec_protocol.types import PoolInfo, StepResult

T = TypeVar("T")

log = logging.getLogger("ec_client")


@dataclass(frozen=True)
class Send:
    """Make this RPC now; the driver sends back the raw reply or throws the EcdError."""

    call: _wire.Call[Any]
    session_id: str


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Probe:
    """Look at the connection (`_connection.connection_problem`); the driver sends back what
    stops it, or None."""


@dataclass(frozen=True)
class Reopen:
    """Drive `SessionState.reopen()` under the client's lock, unless the session's generation
    is no longer `generation` (another caller reopened it meanwhile)."""

    generation: int


@dataclass(frozen=True)
class Done:
    """The plan returned `value`."""

    value: Any


Step = Send | Pause | Probe | Reopen
Plan = Generator[Step, Any, T]


def advance(plan: Plan[Any], reply: Any, error: EcdError | None) -> Step | Done:
    """Resume a plan with the outcome of its last step: its next step, or Done."""
    try:
        return plan.send(reply) if error is None else plan.throw(error)
    except StopIteration as done:
        return Done(done.value)


class Backoff:
    """Delays between retries of an UNAVAILABLE call, bounded by the connect deadline."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._deadline = clock() + budget_s
        self._delay = FIRST_BACKOFF_S

    def next_delay(self) -> float | None:
        """Seconds to wait before the next try, or None when the deadline has passed."""
        left = self._deadline - self._clock()
        if left <= 0:
            return None
        delay = min(self._delay, left)
        self._delay = min(self._delay * 2, MAX_BACKOFF_S)
        return delay


RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def cut_off_at_shutdown(error: EcdError) -> bool:
    """The daemon ended the call as it stopped. A CANCELLED that reaches a plan comes from the
    daemon (the client cancels nothing it sends): one still running at the end of the grace."""
    return error.code == grpc.StatusCode.CANCELLED or error.reason == "shutting_down"


def interrupted() -> EcdError:
    """What the ops of a Step hear when its driver gave up on it before the answer came."""
    return EcdError(
        grpc.StatusCode.CANCELLED,
        "the Step was interrupted before its answer came: it may or may not have taken effect",
    )


def _joined(call: _wire.Call[T], parts: list[T]) -> T:
    """The results of the parts of a split call (at least one), joined in order."""
    return functools.reduce(call.join, parts) if call.join is not None else parts[0]


def not_opened(engine_id: str) -> EcdError:
    return EcdError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"pool {engine_id!r} was not opened by this client; call open_pool first",
    )


def client_closed() -> EcdError:
    """What a call on a client after its close() hears: its session is gone (the daemon would
    name it unknown, and a new session is not this client's to open), and the daemon's answer to
    a call that needs none would hide that the application uses a client it closed."""
    return EcdError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "this client is closed (by close() or the end of its `with` block): make a new client "
        "for more calls",
    )


def session_lost(error: EcdError) -> bool:
    return error.code == grpc.StatusCode.NOT_FOUND and error.reason == "unknown_session"


@dataclass
class SessionState:
    """The client's view of its session, what it must redo on a restarted daemon, and the plans
    of its calls."""

    options: Options
    session_id: str = ""
    boot_epoch: str = ""
    lease_ttl_s: float = 0.0
    generation: int = 0  # bumped at every (re)open, so concurrent callers reopen only once
    max_batch: int = 0  # the daemon's, told at every (re)open; 0: not told, batches go whole
    closed: bool = False
    # OpenPool with reopen, as the application opened each pool: sent again on reopen.
    pools: dict[str, _wire.Call[PoolInfo]] = field(default_factory=dict)
    pool_infos: dict[str, PoolInfo] = field(default_factory=dict)
    on_restart: list[Callable[[str], None]] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic  # for the plans' deadlines
    # The session's life mark on each pool file it opened: the daemon ends the session the
    # moment this process dies, rather than one lease later (ec_protocol/pool/life_marks.py).
    life: LifeMarks = field(default_factory=LifeMarks)

    def check_open(self) -> None:
        """Raise "this client is closed" once close() began (the calls that open no plan, a
        Watch and a health check, ask too)."""
        if self.closed:
            raise client_closed()

    # ---- plans -----------------------------------------------------------------------------

    def call(self, call: _wire.Call[T], answered: list[T] | None = None) -> Plan[T]:
        """One API call with every recovery rule applied, sent in batches the daemon accepts
        (`Call.split` at its max_batch, one round trip each, in order); returns the parsed
        result, the parts' joined. `answered`: where each part's result goes once it is
        answered (those of the parts that went before one that failed).

        A batch refused as over the limit after a reopen learnt a smaller one is split anew."""
        self.check_open()
        parts = [] if answered is None else answered
        limit = self.max_batch
        if not limit or call.split is None or call.split(limit) is None:  # the norm: one part
            try:
                parts.append((yield from self._call_one(call)))
                return parts[0]
            except EcdError as error:
                if not self._over(error, limit):
                    raise
        rest: _wire.Call[T] | None = call
        while rest is not None:
            limit = self.max_batch  # 0 (a reopen found a daemon that does not say): whole
            cut = rest.split(limit) if limit and rest.split is not None else None
            part, after = cut if cut is not None else (rest, None)
            try:
                parts.append((yield from self._call_one(part)))
            except EcdError as error:
                if self._over(error, limit):
                    continue  # `rest` again, split at the new limit
                raise
            rest = after
        return _joined(call, parts)

    def _over(self, error: EcdError, limit: int) -> bool:
        """A batch sent at `limit` (0: none known) was refused as over the daemon's limit, which
        a reopen since learnt is smaller: worth splitting at it."""
        return error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
            self.max_batch > 0 and (limit == 0 or self.max_batch < limit)
        )

    def _call_one(self, call: _wire.Call[T]) -> Plan[T]:
        """One RPC with every recovery rule applied; returns the parsed result."""
        generation = self.generation
        try:
            reply = yield from self.send(call)
        except EcdError as error:
            if not session_lost(error):
                raise
            if self.closed:  # closed while this call was on its way
                raise client_closed() from None
            yield Reopen(generation)
            reply = yield from self.send(call)
        if self.restarted(reply.boot_epoch):
            yield Reopen(generation)
        return call.parse(reply)

    def send(self, call: _wire.Call[Any], retry: bool = True) -> Plan[Any]:
        """One RPC, retried with backoff while the daemon is UNAVAILABLE, within the client's
        patience (see the module's rules); the raw reply, or, for a call whose own wait ran out
        while the daemon was away, the one standing in for it (`Call.waited_out`)."""
        o = self.options
        wait_ends = self.clock() + call.extra_timeout_s  # the call's own wait (Acquire's)
        backoff: Backoff | None = None  # from the first failure (or the shutdown) on
        patience = 0.0  # what backoff allows, for the error's words
        waits_out = False  # the call's own wait ends before its patience: answered then
        problem: str | None = None  # what the probe at the first failure found
        shut_down = False  # the daemon cut an attempt off as it stopped
        while True:
            try:
                return (yield Send(call, self.session_id))
            except EcdError as error:
                if cut_off_at_shutdown(error):
                    if not call.safe_to_retry:
                        raise o.cut_off(call.method) from None
                    if not shut_down:  # a restart is under way: patience from now on
                        shut_down, backoff = True, None
                        patience = max(o.connect_timeout_s, o.wait_for_daemon_s)
                if not retry or error.code not in RETRIED:
                    raise
                if backoff is None:
                    if not shut_down:
                        problem = yield Probe()
                        patience = self._patience(call, problem)
                    wait_left = wait_ends - self.clock()
                    waits_out = call.waited_out is not None and wait_left <= patience
                    backoff = Backoff(wait_left if waits_out else patience, self.clock)
                delay = backoff.next_delay()
                if delay is None:
                    if waits_out and call.waited_out is not None:
                        return call.waited_out(o.waited_out(problem))
                    if shut_down:
                        raise o.gone_at_shutdown(call.method, patience) from None
                    if error.reason:  # the daemon's own UNAVAILABLE, which says why
                        raise
                    if patience:  # why now, after waiting: not necessarily why at first
                        problem = (yield Probe()) or problem
                    raise o.unreachable(problem, patience) from None
                yield Pause(delay)

    def step(self, batch: OutboxBatch, call: _wire.Call[StepResult]) -> Plan[StepResult]:
        """A Step that carries what the client owes the pool (`batch`, see `outbox`): every op
        hears its answer, or, if the Step (or the part of a split one that carried it) failed,
        the error, which is raised too; returns the caller's answers."""
        answered: list[StepResult] = []
        try:
            result = yield from self.call(call, answered)
        except EcdError as error:
            batch.fail(error, _joined(call, answered) if answered else None)
            raise
        except GeneratorExit:  # the driver gave up on the call (see `interrupted`)
            batch.fail(interrupted(), _joined(call, answered) if answered else None)
            raise
        return batch.resolve(result)

    def _patience(self, call: _wire.Call[Any], problem: str | None) -> float:
        """Seconds to keep retrying a call the daemon did not answer: the client's
        wait_for_daemon_s, and at least connect_timeout_s while it may be there (`problem`:
        what stops a connection, None when nothing does); a call that asked to wait, at least
        that long (up to connect_timeout_s) with no daemon there."""
        o = self.options
        if problem is None:
            return max(o.wait_for_daemon_s, o.connect_timeout_s)
        return max(o.wait_for_daemon_s, min(call.extra_timeout_s, o.connect_timeout_s))

    def open(self) -> Plan[None]:
        """Open a new session."""
        o = self.options
        reply = yield from self.send(_wire.open_session(o.name, os.getpid(), o.role))
        self.session_id = reply.session_id
        self.boot_epoch = reply.boot_epoch
        self.lease_ttl_s = reply.lease_ttl_ms / 1000
        self.max_batch = reply.max_batch
        self.generation += 1

    def reopen(self) -> Plan[None]:
        """A new session and the pools of the old one, after a restart or a lost lease. A pool
        that cannot be opened again (dropped, refused) is skipped: the calls that use it get the
        daemon's own answer, which says why."""
        yield from self.open()
        for engine_id, call in list(self.pools.items()):
            try:
                info = call.parse((yield from self.send(call)))
            except EcdError as error:
                if error.code == grpc.StatusCode.UNAVAILABLE or session_lost(error):
                    raise
                log.warning("ecd: pool %s not reopened after a restart: %s", engine_id, error)
                continue
            self.pool_opened(call, info)

    def close(self) -> Plan[None]:
        """End the session; if the daemon is gone or already forgot it, the lease ends it all
        the same, so failures are not retried."""
        self.closed = True
        try:
            yield from self.send(_wire.close_session(), retry=False)
        finally:
            self.life.close()
            fd_passing.release(id(self))

    def open_pool(self, call: _wire.Call[PoolInfo], again: _wire.Call[PoolInfo]) -> Plan[PoolInfo]:
        """OpenPool, remembered (as `again`: the same with reopen) so that a reopened session
        opens the pool again."""
        info = yield from self.call(call)
        self.pool_opened(again, info)
        return info

    def reopen_pool(self, engine_id: str) -> Plan[PoolInfo]:
        again = self.pools.get(engine_id)
        if again is None:
            raise not_opened(engine_id)
        info = yield from self.call(again)
        self.pool_opened(again, info)
        return info

    def drop_pool(self, engine_id: str, force: bool) -> Plan[int]:
        dropped = yield from self.call(_wire.drop_pool(engine_id, force))
        self.pools.pop(engine_id, None)
        info = self.pool_infos.pop(engine_id, None)
        self.life.unmark(engine_id)
        if info is not None:  # this process holds no dropped pool's pages
            fd_passing.forget(info.path)
        return dropped

    # ---- what the plans remember ---------------------------------------------------------------

    def pool_opened(self, call: _wire.Call[PoolInfo], info: PoolInfo) -> None:
        self.pools[info.engine_id] = call
        self.pool_infos[info.engine_id] = info
        self._receive_pool_file(info)
        self.life.mark(info.engine_id, info.path, self.session_id, info.pool_uuid)

    def _receive_pool_file(self, info: PoolInfo) -> None:
        """Redeem the reply's ticket for the pool's file (ec_protocol/pool/fd_passing.py), so that
        this process maps the pool whether or not it may open the file by its path: one exchange
        on a local socket, at once (the ticket is good for seconds), even for AsyncClient, whose
        loop it holds as briefly as the life mark's open. Without one, or refused, the file is
        opened by its path."""
        socket_path = unix_socket_path(self.options.target)
        if not info.fd_ticket or socket_path is None:
            return
        channel = fd_passing.fd_channel_path(socket_path)
        try:
            fd_passing.receive(channel, info.fd_ticket, info.path, info.pool_uuid, id(self))
        except fd_passing.ChannelError as error:
            log.warning("ecd: pool %s opened by its path: %s", info.engine_id, error)

    def pool_info(self, engine_id: str) -> PoolInfo:
        info = self.pool_infos.get(engine_id)
        if info is None:
            raise not_opened(engine_id)
        return info

    def restarted(self, epoch: str) -> bool:
        return bool(self.boot_epoch) and bool(epoch) and epoch != self.boot_epoch

    def tell_restart(self) -> None:
        for callback in list(self.on_restart):
            callback(self.boot_epoch)
