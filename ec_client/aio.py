"""AsyncClient: the asyncio control client, for engines and tools that run an event loop.

    async with AsyncClient(name="router") as c:
        async for event in c.watch("qwen-vl-node1", snapshot=True): ...

The same calls, results and recovery rules as Client (every method does what Client's of the
same name does; see its docstrings for what each can answer): both run the plans of `_session`,
this one with grpc.aio. The keep-alive is a task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc

from ec_client import _wire
from ec_client._connection import (
    Options,
    TLSFiles,
    aio_channel,
    await_daemon,
    connection_problem,
)
from ec_client._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_client._session import Done, Pause, Plan, Probe, Reopen, Send, SessionState, advance
from ec_client.errors import EcdError
from ec_client.types import (
    AcquireResult,
    AllocateItem,
    AllocateResult,
    EntryInfo,
    ItemResult,
    Key,
    LeaseResult,
    LookupResult,
    PoolInfo,
    Role,
    Stats,
    StepResult,
    WatchEvent,
)

T = TypeVar("T")


class AsyncClient:
    def __init__(
        self,
        target: str | None = None,
        *,
        name: str | None = None,
        role: Role | str = Role.BOTH,
        connect_timeout_s: float = 5.0,
        call_timeout_s: float = 30.0,
        token: str | None = None,
        tls: TLSFiles | None = None,
        keepalive: bool = True,
        from_env: bool = True,
        wait_for_daemon_s: float = 0.0,
    ) -> None:
        """from_env: take a token and TLS files not given from ECD_TOKEN, ECD_TOKEN_FILE and
        ECD_TLS_* (as Client does). wait_for_daemon_s: as Client's."""
        self.options = Options.make(
            target, name, role, connect_timeout_s, call_timeout_s, token, tls, from_env
        )
        self._keepalive_enabled = keepalive
        self._state = SessionState(self.options)
        self._lock = asyncio.Lock()
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._wait_for_daemon_s = wait_for_daemon_s

    async def start(self) -> AsyncClient:
        """Connect (within the connect timeout) and open the session."""
        await asyncio.to_thread(await_daemon, self.options, self._wait_for_daemon_s)
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

    async def close(self) -> None:
        if self._state.closed:
            return
        if self._channel is None:  # start() found no daemon: no session to close
            self._state.closed = True
            return
        if self._keepalive is not None:
            self._keepalive.cancel()
        with contextlib.suppress(EcdError):
            await self._drive(self._state.close())
        if self._channel is not None:
            await self._channel.close(None)

    @property
    def session_id(self) -> str:
        return self._state.session_id

    @property
    def boot_epoch(self) -> str:
        return self._state.boot_epoch

    @property
    def lease_ttl_s(self) -> float:
        return self._state.lease_ttl_s

    def on_restart(self, callback: Callable[[str], None]) -> None:
        self._state.on_restart.append(callback)

    async def keep_alive(self) -> float:
        return await self._run(_wire.keep_alive())

    # ---- calls ---------------------------------------------------------------------------------

    async def open_pool(
        self,
        engine_id: str,
        block_size_bytes: int = 0,
        capacity_bytes: int = 0,
        compat_key: str = "",
    ) -> PoolInfo:
        call = _wire.open_pool(engine_id, block_size_bytes, capacity_bytes, compat_key)
        return await self._drive(self._state.open_pool(call))

    def pool_info(self, engine_id: str) -> PoolInfo:
        return self._state.pool_info(engine_id)

    async def drop_pool(self, engine_id: str, force: bool = False) -> int:
        return await self._drive(self._state.drop_pool(engine_id, force))

    async def allocate(self, engine_id: str, items: Sequence[AllocateItem]) -> list[AllocateResult]:
        return await self._run(_wire.allocate(engine_id, items))

    async def commit(
        self, engine_id: str, keys: Sequence[Key], checksums: Sequence[int] | None = None
    ) -> list[ItemResult]:
        return await self._run(_wire.commit(engine_id, keys, checksums))

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
    ) -> StepResult:
        return await self._run(
            _wire.step(
                engine_id,
                releases,
                _wire.commit_pairs(commits, checksums),
                aborts,
                acquires,
                allocates,
            )
        )

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

    async def stats(self, engine_id: str = "") -> Stats:
        return await self._run(_wire.stats(engine_id))

    async def watch(
        self, engine_id: str = "", snapshot: bool = False, include_remote: bool = False
    ) -> AsyncIterator[WatchEvent]:
        stream = self._stub.Watch(
            _wire.watch_request(engine_id, snapshot, include_remote),
            metadata=self.options.metadata,
        )
        try:
            async for event in stream:
                yield _wire.watch_event(event)
        except grpc.RpcError as exc:
            raise EcdError.from_rpc(exc) from None
        finally:
            stream.cancel()

    # ---- the I/O of plans ------------------------------------------------------------------------

    async def _run(self, call: _wire.Call[T]) -> T:
        return await self._drive(self._state.call(call))

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
