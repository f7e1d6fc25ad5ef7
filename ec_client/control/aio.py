"""AsyncClient: the asyncio control client, for engines and tools that run an event loop.

    async with AsyncClient(name="router") as c:
        async for event in c.watch("qwen-vl-node1", snapshot=True): ...

It has Client's public calls with the same parameters (tests/unit/test_client_twins.py compares
the two), as coroutines where they wait on the daemon: see Client's docstrings for what each
answers. Both run the same plans (`_session`: retries, reopening, a Step that carries what is
owed) over the same requests and replies (`_wire`); this one performs their I/O with grpc.aio.
What Client does on threads runs on threads here too, their calls handed to the client's event
loop: the Steps of what is owed (`outbox`) and the ReadyViews (`view`). The keep-alive is a task.
`start()` (or `async with`) connects and opens the session, as Client's constructor does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from ec_client.control import _wire
from ec_client.control._base import BaseClient
from ec_client.control._connection import (
    UNREACHED,
    aio_channel,
    await_daemon,
    connection_problem,
)
from ec_client.control._session import Done, Pause, Plan, Probe, Reopen, Send, advance
from ec_client.control.outbox import OutboxBatch
from ec_client.control.ready_view import ReadyView
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_protocol.errors import EcdError
from ec_protocol.types import (
    AcquireResult,
    AllocateItem,
    AllocateResult,
    EntryInfo,
    ItemResult,
    Key,
    LeaseResult,
    LookupResult,
    PoolInfo,
    Stats,
    StepResult,
    WatchEvent,
)

T = TypeVar("T")


class AsyncWatchStream:
    """An open Watch call. Iterating it (`async for`) yields the events; `cancel()` ends the
    iteration quietly (as the end of the stream); any other failure raises EcdError."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[WatchEvent]:
        try:
            async for event in self._call:
                yield _wire.watch_event(event)
        except asyncio.CancelledError:
            if not self._cancelled:  # the task was cancelled, not the call
                raise
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise EcdError.from_rpc(exc) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class AsyncClient(BaseClient):
    # Its constructor and what never waits on the daemon are BaseClient's (`_base`): nothing is
    # sent before `start()`.

    def _begin(self, keepalive: bool) -> None:
        self._keepalive_enabled = keepalive
        self._lock = asyncio.Lock()
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._threads: _FromThreads | None = None

    async def start(self) -> AsyncClient:
        """Connect (within the connect timeout) and open the session."""
        await asyncio.to_thread(await_daemon, self.options, self.options.wait_for_daemon_s)
        self._threads = _FromThreads(self, asyncio.get_running_loop())
        self._channel = aio_channel(self.options)
        self._stub = pb_grpc.EncoderCacheStub(self._channel)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self.options.connect_timeout_s)
        except TimeoutError:
            await self._channel.close(None)
            problem = await asyncio.to_thread(connection_problem, self.options)
            raise self.options.unreachable(problem) from None
        await self._drive(self._state.open())
        if self._keepalive_enabled:
            self._keepalive = asyncio.create_task(self._keep_alive_loop())
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- session -------------------------------------------------------------------------------

    async def keep_alive(self) -> float:
        return await self._run(_wire.keep_alive())

    async def close(self, flush_timeout_s: float = 10.0) -> None:
        if self._state.closed:
            return
        if self._channel is None:  # start() found no daemon: no session to close
            self._state.closed = True
            await asyncio.to_thread(self._stop_threads)
            return
        with contextlib.suppress(TimeoutError):
            await self.flush(flush_timeout_s)
        if self._keepalive is not None:
            self._keepalive.cancel()
        # Off the loop: the outbox thread and the views' threads wait on it as they stop.
        await asyncio.to_thread(self._stop_threads)
        with contextlib.suppress(EcdError):
            await self._drive(self._state.close())
        if self._channel is not None:
            await self._channel.close(None)

    # ---- what is owed and the views of pools ---------------------------------------------------

    async def flush(self, timeout_s: float | None = None) -> None:
        # Off the loop: the Steps it waits for run on the loop.
        await asyncio.to_thread(self.outbox.flush, timeout_s)

    def view(self, engine_id: str) -> ReadyView:
        """Call on the client's event loop; the view can be read from any thread."""
        return self._views.get(engine_id)

    def known_ready(self, engine_id: str, keys: Sequence[Key]) -> None:
        self._views.known_ready(engine_id, keys)

    async def reopen_pool(self, engine_id: str) -> PoolInfo:
        return await self._drive(self._state.reopen_pool(engine_id))

    # ---- pools ---------------------------------------------------------------------------------

    async def open_pool(
        self,
        engine_id: str,
        block_size_bytes: int = 0,
        capacity_bytes: int = 0,
        compat_key: str = "",
        ephemeral: bool = False,
        max_entries: int = 0,
        cluster_namespace: str = "",
    ) -> PoolInfo:
        call, again = _wire.open_pool_calls(
            engine_id,
            block_size_bytes,
            capacity_bytes,
            compat_key,
            ephemeral,
            max_entries,
            cluster_namespace,
        )
        return await self._drive(self._state.open_pool(call, again))

    async def drop_pool(self, engine_id: str, force: bool = False) -> int:
        return await self._drive(self._state.drop_pool(engine_id, force))

    # ---- entries -------------------------------------------------------------------------------

    async def allocate(self, engine_id: str, items: Sequence[AllocateItem]) -> list[AllocateResult]:
        return await self._run(_wire.allocate(engine_id, items))

    async def commit(
        self,
        engine_id: str,
        keys: Sequence[Key],
        checksums: Sequence[int] | None = None,
        allocations: Sequence[int] | None = None,
    ) -> list[ItemResult]:
        return await self._run(_wire.commit(engine_id, keys, checksums, allocations))

    async def abort(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        return await self._run(_wire.abort(engine_id, keys))

    async def acquire(
        self, engine_id: str, keys: Sequence[Key], wait_ms: int = 0
    ) -> list[AcquireResult]:
        return await self._run(_wire.acquire(engine_id, keys, wait_ms))

    async def release(self, lease_ids: Sequence[int]) -> list[LeaseResult]:
        return await self._run(_wire.release(lease_ids))

    async def step(
        self,
        engine_id: str,
        *,
        releases: Sequence[int] = (),
        commits: Sequence[Key] = (),
        checksums: Sequence[int] | None = None,
        aborts: Sequence[Key] = (),
        acquires: Sequence[Key] = (),
        allocates: Sequence[AllocateItem] = (),
        local_only: bool = False,
    ) -> StepResult:
        own_commits = _wire.commit_items(commits, checksums)  # refused before anything is taken
        reading, writing = acquires, [item.key for item in allocates]
        batch = self.outbox.try_take(engine_id, reading, writing)
        if batch is None:  # a Commit or Abort of its keys is on its way: heard first
            batch = await self._take_off_loop(engine_id, reading, writing)
        call = batch.step(engine_id, releases, own_commits, aborts, acquires, allocates, local_only)
        return await self._send_batch(batch, call)

    async def lookup(self, engine_id: str, keys: Sequence[Key]) -> list[LookupResult]:
        return await self._run(_wire.lookup(engine_id, keys))

    async def evict(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        return await self._run(_wire.evict(engine_id, keys))

    async def delete(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        return await self._run(_wire.delete(engine_id, keys))

    async def list_entries(
        self, engine_id: str, limit: int = 0, start_after: Key = b""
    ) -> tuple[list[EntryInfo], bool]:
        return await self._run(_wire.list_entries(engine_id, limit, start_after))

    async def iter_entries(self, engine_id: str, page: int = 1000) -> AsyncIterator[EntryInfo]:
        start_after: bytes | None = b""
        while start_after is not None:
            entries, truncated = await self.list_entries(engine_id, page, start_after)
            for entry in entries:
                yield entry
            start_after = _wire.next_page(entries, truncated)

    # ---- observation ---------------------------------------------------------------------------

    async def stats(self, engine_id: str = "") -> Stats:
        return await self._run(_wire.stats(engine_id))

    async def health(self, service: str = "") -> str:
        self._state.check_open()
        try:
            reply = await health_pb2_grpc.HealthStub(self._channel).Check(
                _wire.health_request(service),
                timeout=self.options.connect_timeout_s,
                metadata=self.options.metadata,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            error = EcdError.from_rpc(exc)
            if error.code in UNREACHED:
                problem = await asyncio.to_thread(connection_problem, self.options)
                raise self.options.unreachable(problem) from None
            raise error from None
        return _wire.health_status(reply)

    def watch(
        self,
        engine_id: str = "",
        snapshot: bool = False,
        include_pending: bool = False,
    ) -> AsyncIterator[WatchEvent]:
        return aiter(self.open_watch(engine_id, snapshot, include_pending))

    def open_watch(
        self,
        engine_id: str = "",
        snapshot: bool = False,
        include_pending: bool = False,
    ) -> AsyncWatchStream:
        self._state.check_open()
        return AsyncWatchStream(
            self._stub.Watch(
                _wire.watch_request(engine_id, snapshot, include_pending),
                metadata=self.options.metadata,
            )
        )

    async def _take_off_loop(
        self, engine_id: str, reading: Sequence[Key], writing: Sequence[Key]
    ) -> OutboxBatch:
        """Outbox.take, waited for on a thread: it waits for a Step on its way, which this loop
        may be the one carrying. A caller cancelled meanwhile leaves what is owed owed: the
        batch the thread takes after all is given back."""
        taking = asyncio.ensure_future(
            asyncio.to_thread(self.outbox.take, engine_id, reading=reading, writing=writing)
        )
        try:
            return await asyncio.shield(taking)
        except asyncio.CancelledError:
            taking.add_done_callback(_give_back)
            raise

    # ---- the I/O of plans ------------------------------------------------------------------------

    async def _run(self, call: _wire.Call[T]) -> T:
        return await self._drive(self._state.call(call))

    async def _send_batch(self, batch: OutboxBatch, call: _wire.Call[StepResult]) -> StepResult:
        return await self._drive(self._state.step(batch, call))

    async def _drive(self, plan: Plan[T]) -> T:
        """Carry out a plan's steps with awaited calls until it returns."""
        reply: Any = None
        error: EcdError | None = None
        while not isinstance(step := advance(plan, reply, error), Done):
            reply, error = None, None
            try:
                reply = await self._do(step)
            except EcdError as exc:
                error = exc
            except BaseException:
                plan.close()  # a Step's ops hear that it was interrupted (_session.interrupted)
                raise
        result: T = step.value
        return result

    async def _do(self, step: Send | Pause | Probe | Reopen) -> Any:
        if isinstance(step, Send):
            call = step.call
            try:
                return await getattr(self._stub, call.method)(
                    call.build(step.session_id),
                    timeout=self.options.call_timeout_s + call.extra_timeout_s,
                    metadata=self.options.metadata,
                )
            except grpc.RpcError as exc:
                raise EcdError.from_rpc(exc) from None
            except grpc.aio.UsageError:  # a call after close(), e.g. from a task still running
                raise EcdError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this client's channel to ecd at {self.options.target} is closed",
                ) from None
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Probe):
            return await asyncio.to_thread(connection_problem, self.options)
        async with self._lock:
            if self._state.generation != step.generation:
                return None  # another task reopened the session meanwhile
            await self._drive(self._state.reopen())
        self._state.tell_restart()
        return None

    async def _keep_alive_loop(self) -> None:
        while not self._state.closed:
            await asyncio.sleep(max(self._state.lease_ttl_s / 3, 0.05))
            try:
                await self.keep_alive()
            except EcdError:
                continue

    # ---- what the client's threads see of it ---------------------------------------------------

    def _from_threads(self) -> _FromThreads:
        if self._threads is None:
            raise EcdError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the AsyncClient is not started: use `async with AsyncClient(...)` or "
                "`await client.start()` first",
            )
        return self._threads

    def _send_batch_from_thread(
        self, batch: OutboxBatch, call: _wire.Call[StepResult]
    ) -> StepResult:
        return self._from_threads().run(self._send_batch(batch, call))

    def _follow(self, engine_id: str) -> ReadyView:
        threads = self._from_threads()
        return ReadyView(threads, engine_id, lambda: threads.run(self.reopen_pool(engine_id)))

    def _stop_threads(self) -> None:
        self.outbox.close()
        self._views.close()


class _FromThreads:
    """An AsyncClient as its threads (the outbox's Steps, each ReadyView's) use it: every call runs
    on the client's event loop while the thread waits for its answer."""

    def __init__(self, client: AsyncClient, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._loop = loop

    def run(self, work: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(_awaited(work), self._loop).result()

    def open_watch(self, engine_id: str, snapshot: bool, include_pending: bool) -> _ThreadStream:
        async def opened() -> AsyncWatchStream:
            return self._client.open_watch(engine_id, snapshot, include_pending)

        return _ThreadStream(self, self._loop, self.run(opened()))


class _ThreadStream:
    """An AsyncWatchStream read from another thread (ReadyView's Stream)."""

    def __init__(
        self, threads: _FromThreads, loop: asyncio.AbstractEventLoop, stream: AsyncWatchStream
    ) -> None:
        self._threads = threads
        self._loop = loop
        self._stream = stream
        self._events = aiter(stream)

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            try:
                yield self._threads.run(anext(self._events))
            except StopAsyncIteration:
                return

    def cancel(self) -> None:
        self._loop.call_soon_threadsafe(self._stream.cancel)


def _give_back(taking: asyncio.Future[OutboxBatch]) -> None:
    """A batch taken for a Step that will not go (its caller was cancelled): owed again."""
    if not taking.cancelled() and taking.exception() is None:
        batch = taking.result()
        batch.give_back(batch)


async def _awaited(work: Awaitable[T]) -> T:
    return await work
