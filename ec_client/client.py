"""Client: the synchronous control client (one session, one shared channel per process).

    with Client("unix:///run/ecd/ecd.sock", name="encoder-0") as c:   # opens a session
        info = c.open_pool("qwen-vl-node1", block_size_bytes=7168, capacity_bytes=8 << 30)

A background thread keeps the session alive (every lease TTL / 3). Recovery from daemon restarts
and lost sessions follows the rules in `_connection`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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

_channels: dict[tuple[int, str, TLSFiles | None], grpc.Channel] = {}
_channels_lock = threading.Lock()


def shared_channel(options: Options) -> grpc.Channel:
    """One channel per target per process (a forked child gets its own)."""
    key = (os.getpid(), options.target, options.tls)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            if options.tls is None:
                channel = grpc.insecure_channel(options.target, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.secure_channel(
                    options.target, options.tls.credentials(), options=CHANNEL_OPTIONS
                )
            _channels[key] = channel
        return channel


def check_health(channel: grpc.Channel, options: Options, service: str = "") -> str:
    """The standard gRPC health check, without a session (cheap enough for probes)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=options.connect_timeout_s,
            metadata=options.metadata,
            wait_for_ready=True,
        )
    except grpc.RpcError as exc:
        raise EcdError.from_rpc(exc) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class WatchStream:
    """An open Watch call. Iterating it yields the events; `cancel()`, from any thread, ends the
    iteration quietly (as the end of the stream); any other failure raises EcdError."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            for event in self._call:
                yield _wire.watch_event(event)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise EcdError.from_rpc(exc) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class Client:
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
        self._channel = shared_channel(self.options)
        self._stub = pb_grpc.EncoderCacheStub(self._channel)
        self._state = SessionState()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            raise self.options.unreachable() from None
        self._open_session()
        self._keepalive: threading.Thread | None = None
        if keepalive:
            self._keepalive = threading.Thread(
                target=self._keep_alive_loop, name="ecd-keepalive", daemon=True
            )
            self._keepalive.start()

    # ---- session -------------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._state.session_id

    @property
    def boot_epoch(self) -> str:
        return self._state.boot_epoch

    @property
    def lease_ttl_s(self) -> float:
        return self._state.lease_ttl_s

    @property
    def target(self) -> str:
        return self.options.target

    def on_restart(self, callback: Callable[[str], None]) -> None:
        """Call `callback(new_boot_epoch)` after the client re-established itself on a restarted
        daemon (new session, pools reopened)."""
        self._state.on_restart.append(callback)

    def keep_alive(self) -> float:
        """Renew the lease now; returns the lease TTL in seconds."""
        return self._run(_wire.keep_alive())

    def close(self) -> None:
        """Close the session: the daemon aborts its PENDING entries and releases its pins."""
        if self._closed.is_set():
            return
        self._closed.set()
        # If the daemon is gone or already forgot us, the lease ends the session all the same.
        with contextlib.suppress(EcdError):
            self._invoke(_wire.close_session(), self._state.session_id, retry=False)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pools ---------------------------------------------------------------------------------

    def open_pool(
        self, engine_id: str, block_size_bytes: int, capacity_bytes: int, compat_key: str = ""
    ) -> PoolInfo:
        call = _wire.open_pool(engine_id, block_size_bytes, capacity_bytes, compat_key)
        info = self._run(call)
        self._state.pool_opened(call, info)
        return info

    def pool_info(self, engine_id: str) -> PoolInfo:
        """What the daemon said about a pool this client opened (refreshed after a restart)."""
        return self._state.pool_info(engine_id)

    def drop_pool(self, engine_id: str, force: bool = False) -> int:
        dropped = self._run(_wire.drop_pool(engine_id, force))
        self._state.pool_dropped(engine_id)
        return dropped

    # ---- entries -------------------------------------------------------------------------------

    def allocate(self, engine_id: str, items: Sequence[AllocateItem]) -> list[AllocateResult]:
        return self._run(_wire.allocate(engine_id, items))

    def commit(
        self, engine_id: str, keys: Sequence[Key], checksums: Sequence[int] | None = None
    ) -> list[ItemResult]:
        return self._run(_wire.commit(engine_id, keys, checksums))

    def abort(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        return self._run(_wire.abort(engine_id, keys))

    def acquire(self, engine_id: str, keys: Sequence[Key], wait_ms: int = 0) -> list[AcquireResult]:
        return self._run(_wire.acquire(engine_id, keys, wait_ms))

    def release(self, lease_ids: Sequence[int]) -> list[LeaseResult]:
        return self._run(_wire.release(lease_ids))

    def lookup(self, engine_id: str, keys: Sequence[Key]) -> list[LookupResult]:
        return self._run(_wire.lookup(engine_id, keys))

    def evict(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        return self._run(_wire.evict(engine_id, keys))

    def delete(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        return self._run(_wire.delete(engine_id, keys))

    def list_entries(
        self, engine_id: str, limit: int = 0, start_after: Key = b""
    ) -> tuple[list[EntryInfo], bool]:
        return self._run(_wire.list_entries(engine_id, limit, start_after))

    def iter_entries(self, engine_id: str, page: int = 1000) -> Iterator[EntryInfo]:
        """Every entry of a pool in key order, a page per RPC."""
        start_after = b""
        while True:
            entries, truncated = self.list_entries(engine_id, page, start_after)
            yield from entries
            if not truncated or not entries:
                return
            start_after = entries[-1].key

    # ---- observation ---------------------------------------------------------------------------

    def stats(self, engine_id: str = "") -> Stats:
        return self._run(_wire.stats(engine_id))

    def health(self, service: str = "") -> str:
        """The daemon's health status name, e.g. SERVING or NOT_SERVING."""
        return check_health(self._channel, self.options, service)

    def watch(self, engine_id: str = "", snapshot: bool = False) -> Iterator[WatchEvent]:
        """Events of one pool (or all) as they happen; with snapshot, first every READY key and
        then a SYNCED event. Stop early by closing the returned generator."""
        return iter(self.open_watch(engine_id, snapshot))

    def open_watch(self, engine_id: str = "", snapshot: bool = False) -> WatchStream:
        """Like watch, as a stream that another thread can end with `cancel()`."""
        return WatchStream(
            self._stub.Watch(
                _wire.watch_request(engine_id, snapshot), metadata=self.options.metadata
            )
        )

    # ---- the call machinery --------------------------------------------------------------------

    def _invoke(self, call: _wire.Call[Any], session_id: str, retry: bool = True) -> Any:
        """One RPC, retried with backoff while the daemon is UNAVAILABLE; the raw reply."""
        backoff = Backoff(self.options.connect_timeout_s, time.monotonic)
        while True:
            try:
                return getattr(self._stub, call.method)(
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
                time.sleep(delay)

    def _run(self, call: _wire.Call[T]) -> T:
        generation = self._state.generation
        try:
            reply = self._invoke(call, self._state.session_id)
        except EcdError as error:
            if not session_lost(error) or self._closed.is_set():
                raise
            self._reopen(generation)
            reply = self._invoke(call, self._state.session_id)
        if self._state.restarted(reply.boot_epoch):
            self._reopen(generation)
        return call.parse(reply)

    def _open_session(self) -> None:
        o = self.options
        self._state.opened(self._invoke(_wire.open_session(o.name, os.getpid(), o.role), ""))

    def _reopen(self, seen_generation: int) -> None:
        """New session and pools after a restart or a lost lease; done once, however many threads
        noticed."""
        with self._lock:
            if self._state.generation != seen_generation:
                return
            self._open_session()
            for call in list(self._state.pools.values()):
                info = call.parse(self._invoke(call, self._state.session_id))
                self._state.pool_opened(call, info)
        self._state.tell_restart()

    def _keep_alive_loop(self) -> None:
        while not self._closed.wait(max(self._state.lease_ttl_s / 3, 0.05)):
            try:
                self.keep_alive()
            except EcdError:
                continue  # daemon down: the next round retries, and reopens when it is back
