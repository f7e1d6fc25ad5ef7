"""AsyncClient: the asyncio control client, for engines and tools that run an event loop.

    async with AsyncClient(name="router") as c:
        async for event in c.watch("qwen-vl-node1", snapshot=True): ...

Same calls, results and recovery rules as Client (see `_connection`); the keep-alive is a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc

from ec_client import _wire
from ec_client._connection import (
    CHANNEL_OPTIONS,
    Backoff,
    Options,
    SessionState,
    TLSFiles,
    session_lost,
)
from ec_client._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
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
    ) -> None:
        self.options = Options.make(
            target, name, role, connect_timeout_s, call_timeout_s, token, tls
        )
        self._keepalive_enabled = keepalive
        self._state = SessionState()
        self._lock = asyncio.Lock()
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> AsyncClient:
        """Connect (within the connect timeout) and open the session."""
        # grpc.aio channels belong to the loop that made them, so each AsyncClient owns one.
        tls = self.options.tls
        self._channel = (
            grpc.aio.insecure_channel(self.options.target, options=CHANNEL_OPTIONS)
            if tls is None
            else grpc.aio.secure_channel(
                self.options.target, tls.credentials(), options=CHANNEL_OPTIONS
            )
        )
        self._stub = pb_grpc.EncoderCacheStub(self._channel)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), self.options.connect_timeout_s)
        except TimeoutError:
            await self._channel.close(None)
            raise self.options.unreachable() from None
        await self._open_session()
        if self._keepalive_enabled:
            self._keepalive = asyncio.create_task(self._keep_alive_loop())
        return self

    async def __aenter__(self) -> AsyncClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        # If the daemon is gone or already forgot us, the lease ends the session all the same.
        with contextlib.suppress(EcdError):
            await self._invoke(_wire.close_session(), self._state.session_id, retry=False)
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

    # ---- calls (see Client for what each does) -------------------------------------------------

    async def open_pool(
        self, engine_id: str, block_size_bytes: int, capacity_bytes: int, compat_key: str = ""
    ) -> PoolInfo:
        call = _wire.open_pool(engine_id, block_size_bytes, capacity_bytes, compat_key)
        info = await self._run(call)
        self._state.pool_opened(call, info)
        return info

    def pool_info(self, engine_id: str) -> PoolInfo:
        return self._state.pool_info(engine_id)

    async def drop_pool(self, engine_id: str, force: bool = False) -> int:
        dropped = await self._run(_wire.drop_pool(engine_id, force))
        self._state.pool_dropped(engine_id)
        return dropped

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

    async def watch(self, engine_id: str = "", snapshot: bool = False) -> AsyncIterator[WatchEvent]:
        stream = self._stub.Watch(
            _wire.watch_request(engine_id, snapshot), metadata=self.options.metadata
        )
        try:
            async for event in stream:
                yield _wire.watch_event(event)
        except grpc.RpcError as exc:
            raise EcdError.from_rpc(exc) from None
        finally:
            stream.cancel()

    # ---- the call machinery (mirrors Client) ---------------------------------------------------

    async def _invoke(self, call: _wire.Call[Any], session_id: str, retry: bool = True) -> Any:
        backoff = Backoff(self.options.connect_timeout_s, asyncio.get_running_loop().time)
        while True:
            try:
                return await getattr(self._stub, call.method)(
                    call.build(session_id),
                    timeout=self.options.call_timeout_s + call.extra_timeout_s,
                    metadata=self.options.metadata,
                )
            except grpc.RpcError as exc:
                error = EcdError.from_rpc(exc)
                unavailable = retry and error.code == grpc.StatusCode.UNAVAILABLE
                delay = backoff.next_delay() if unavailable else None
                if delay is None:
                    raise error from None
                await asyncio.sleep(delay)

    async def _run(self, call: _wire.Call[T]) -> T:
        generation = self._state.generation
        try:
            reply = await self._invoke(call, self._state.session_id)
        except EcdError as error:
            if not session_lost(error) or self._closed:
                raise
            await self._reopen(generation)
            reply = await self._invoke(call, self._state.session_id)
        if self._state.restarted(reply.boot_epoch):
            await self._reopen(generation)
        return call.parse(reply)

    async def _open_session(self) -> None:
        o = self.options
        self._state.opened(await self._invoke(_wire.open_session(o.name, os.getpid(), o.role), ""))

    async def _reopen(self, seen_generation: int) -> None:
        async with self._lock:
            if self._state.generation != seen_generation:
                return
            await self._open_session()
            for call in list(self._state.pools.values()):
                info = call.parse(await self._invoke(call, self._state.session_id))
                self._state.pool_opened(call, info)
        self._state.tell_restart()

    async def _keep_alive_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(max(self._state.lease_ttl_s / 3, 0.05))
            try:
                await self.keep_alive()
            except EcdError:
                continue
