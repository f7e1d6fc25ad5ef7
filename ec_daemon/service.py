"""The gRPC service ecd.v1.EncoderCache: validate, translate, call the store, translate back.

No cache logic lives here. Whole-request failures become gRPC errors with the status code of the
CoreError, its message, and trailing metadata `ecd-reason` (what clients act on, such as
unknown_session) and `ecd-boot-epoch`; per-item failures become per-item statuses.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from ec_client import __version__
from ec_client._proto.ecd.v1 import ecd_pb2 as pb
from ec_client._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_daemon import validate
from ec_daemon.auth import Guard
from ec_daemon.errors import Code, CoreError, ItemStatus
from ec_daemon.events import EventHub, StreamEnd
from ec_daemon.index import Entry, EntryState, Event, EventType, Outcome, TensorSpec
from ec_daemon.sessions import Role
from ec_daemon.store import AcquireOutcome, Store

log = logging.getLogger("ecd.service")

T = TypeVar("T")
R = TypeVar("R")
Request = TypeVar("Request")
Reply = TypeVar("Reply")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext[Any, Any]], Awaitable[Reply]]

GRPC_CODE = {code: getattr(grpc.StatusCode, code.value) for code in Code}
DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 100_000


def rpc(method: Handler[Request, Reply]) -> Handler[Request, Reply]:
    """Check the caller's token and grants, turn CoreError into a gRPC error, time the call."""

    @functools.wraps(method)
    async def handle(
        self: EncoderCacheService, request: Request, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Reply:
        started = time.perf_counter()
        try:
            self.authorize(method.__name__, request, context)
            return await method(self, request, context)
        except CoreError as exc:
            await abort(self.store, context, exc)
            raise AssertionError("context.abort returned") from exc
        finally:
            self.observe(method.__name__, time.perf_counter() - started)

    return handle


async def abort(store: Store, context: grpc.aio.ServicerContext[Any, Any], exc: CoreError) -> None:
    context.set_trailing_metadata(
        (("ecd-reason", exc.reason.value), ("ecd-boot-epoch", store.boot_epoch))
    )
    await context.abort(GRPC_CODE[exc.code], exc.message)


def per_item(
    checked: list[T | str], run: Callable[[list[T]], list[R]], invalid: Callable[[str], R]
) -> list[R]:
    """Run the valid items as one batch and put invalid ones (a str saying why) back in order."""
    results = iter(run([c for c in checked if not isinstance(c, str)]))
    return [invalid(c) if isinstance(c, str) else next(results) for c in checked]


def checked_keys(keys: list[bytes]) -> list[bytes | str]:
    return [key if (problem := validate.key_problem(key)) is None else problem for key in keys]


ITEM_STATUS: dict[ItemStatus, pb.ItemStatus] = {
    status: getattr(pb, "ITEM_" + status.value) for status in ItemStatus
}


def item_status(status: ItemStatus) -> pb.ItemStatus:
    return ITEM_STATUS[status]


def extents_pb(entry: Entry) -> list[pb.Extent]:
    return [pb.Extent(start=e.start, count=e.count) for e in entry.extents]


def spec_pb(spec: TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(shape=list(spec.shape), dtype=spec.dtype, nbytes=spec.nbytes)


def state_pb(entry: Entry | None) -> pb.EntryState:
    if entry is None:
        return pb.ENTRY_ABSENT
    return pb.ENTRY_READY if entry.state is EntryState.READY else pb.ENTRY_PENDING


def item_results(keys: list[bytes], outcomes: list[Outcome]) -> list[pb.ItemResult]:
    return [
        pb.ItemResult(key=key, status=item_status(o.status), message=o.message)
        for key, o in zip(keys, outcomes, strict=True)
    ]


def invalid_outcome(message: str) -> Outcome:
    return Outcome(ItemStatus.INVALID_ARGUMENT, message)


ROLES = {
    pb.ROLE_UNSPECIFIED: Role.UNSPECIFIED,
    pb.ROLE_PRODUCER: Role.PRODUCER,
    pb.ROLE_CONSUMER: Role.CONSUMER,
    pb.ROLE_BOTH: Role.BOTH,
    pb.ROLE_ADMIN: Role.ADMIN,
}

EVENT_TYPES = {
    EventType.COMMITTED: pb.EVENT_COMMITTED,
    EventType.EVICTED: pb.EVENT_EVICTED,
    EventType.ABORTED: pb.EVENT_ABORTED,
    EventType.DELETED: pb.EVENT_DELETED,
    EventType.POOL_DROPPED: pb.EVENT_POOL_DROPPED,
}


class EncoderCacheService(pb_grpc.EncoderCacheServicer):
    def __init__(
        self,
        store: Store,
        hub: EventHub,
        limits: validate.Limits,
        observe: Callable[[str, float], None] = lambda method, seconds: None,
        guard: Guard | None = None,
    ) -> None:
        self.store = store
        self.hub = hub
        self.limits = limits
        self.observe = observe
        self.guard = guard or Guard(None, None)

    def authorize(
        self, rpc: str, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        engine_id = getattr(request, "engine_id", "")
        self.guard.check(rpc, engine_id, tuple(context.invocation_metadata() or ()))

    @property
    def epoch(self) -> str:
        return self.store.boot_epoch

    # ---- sessions ------------------------------------------------------------------------------

    @rpc
    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSessionReply:
        if request.role not in ROLES:
            raise CoreError(Code.INVALID_ARGUMENT, f"unknown role {request.role}")
        name = validate.client_name(request.client_name)
        session = self.store.open_session(name, request.pid, ROLES[request.role])
        log.info(
            "session opened", extra={"session": session.id, "client": name, "pid": request.pid}
        )
        return pb.OpenSessionReply(
            boot_epoch=self.epoch,
            session_id=session.id,
            lease_ttl_ms=int(self.store.sessions.ttl_s * 1000),
        )

    @rpc
    async def KeepAlive(
        self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KeepAliveReply:
        self.store.keep_alive(request.session_id)
        return pb.KeepAliveReply(
            boot_epoch=self.epoch, lease_ttl_ms=int(self.store.sessions.ttl_s * 1000)
        )

    @rpc
    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionReply:
        end = self.store.close_session(request.session_id)
        log.info(
            "session closed",
            extra={
                "session": end.session.id,
                "client": end.session.name,
                "aborted": end.aborted,
                "released": end.released,
            },
        )
        return pb.CloseSessionReply(
            boot_epoch=self.epoch, aborted=end.aborted, released=end.released
        )

    # ---- pools ---------------------------------------------------------------------------------

    @rpc
    async def OpenPool(
        self, request: pb.OpenPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenPoolReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.pool_request(request.block_size_bytes, request.capacity_bytes, request.compat_key)
        self.store.sessions.touch(request.session_id)
        pool, created = self.store.open_pool(
            engine_id, request.block_size_bytes, request.capacity_bytes, request.compat_key
        )
        header = pool.file.header
        geometry = header.geometry
        return pb.OpenPoolReply(
            boot_epoch=self.epoch,
            created=created,
            pool=pb.PoolInfo(
                engine_id=engine_id,
                path=str(pool.file.path),
                block_size_bytes=geometry.block_size_bytes,
                num_blocks=geometry.num_blocks,
                data_offset=geometry.data_offset,
                file_size=geometry.file_size,
                pool_uuid=str(header.pool_uuid),
                compat_key=header.compat_key,
                max_entries=geometry.num_slots,
            ),
        )

    @rpc
    async def DropPool(
        self, request: pb.DropPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DropPoolReply:
        dropped = self.store.drop_pool(validate.engine_id(request.engine_id), request.force)
        return pb.DropPoolReply(boot_epoch=self.epoch, entries_dropped=dropped)

    # ---- entries -------------------------------------------------------------------------------

    @rpc
    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AllocateReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.items), self.limits)
        checked: list[tuple[bytes, TensorSpec] | str] = []
        for item in request.items:
            spec = validate.tensor_spec(item.key, item.tensor)
            checked.append(spec if isinstance(spec, str) else (item.key, spec))
        outcomes = per_item(
            checked,
            lambda items: self.store.allocate(request.session_id, engine_id, items),
            invalid_outcome,
        )
        return pb.AllocateReply(
            boot_epoch=self.epoch,
            results=[
                pb.AllocateResult(
                    key=item.key,
                    status=item_status(o.status),
                    message=o.message,
                    extents=extents_pb(o.entry)
                    if o.status is ItemStatus.ALLOCATED and o.entry
                    else [],
                )
                for item, o in zip(request.items, outcomes, strict=True)
            ],
        )

    @rpc
    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CommitReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.items), self.limits)
        checked: list[tuple[bytes, int] | str] = [
            (item.key, item.checksum) if isinstance(k, bytes) else k
            for item, k in zip(
                request.items, checked_keys([i.key for i in request.items]), strict=True
            )
        ]
        outcomes = per_item(
            checked,
            lambda items: self.store.commit(request.session_id, engine_id, items),
            invalid_outcome,
        )
        keys = [item.key for item in request.items]
        return pb.CommitReply(boot_epoch=self.epoch, results=item_results(keys, outcomes))

    @rpc
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortReply:
        outcomes = self._keyed(
            request.engine_id,
            list(request.keys),
            lambda e, keys: self.store.abort(request.session_id, e, keys),
        )
        return pb.AbortReply(
            boot_epoch=self.epoch, results=item_results(list(request.keys), outcomes)
        )

    @rpc
    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EvictReply:
        outcomes = self._keyed(request.engine_id, list(request.keys), self.store.evict)
        return pb.EvictReply(
            boot_epoch=self.epoch, results=item_results(list(request.keys), outcomes)
        )

    @rpc
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteReply:
        outcomes = self._keyed(request.engine_id, list(request.keys), self.store.delete)
        return pb.DeleteReply(
            boot_epoch=self.epoch, results=item_results(list(request.keys), outcomes)
        )

    def _keyed(
        self,
        engine_id: str,
        keys: list[bytes],
        run: Callable[[str, list[bytes]], list[Outcome]],
    ) -> list[Outcome]:
        """A batch of keys against one pool: validate, run the valid ones, keep the order."""
        engine_id = validate.engine_id(engine_id)
        validate.batch(len(keys), self.limits)
        return per_item(checked_keys(keys), lambda valid: run(engine_id, valid), invalid_outcome)

    @rpc
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AcquireReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.keys), self.limits)
        wait_ms = validate.wait_ms(request.wait_ms)
        checked = checked_keys(list(request.keys))
        self.store.sessions.touch(request.session_id)
        if wait_ms:
            # Lookup and waiter registration happen in one synchronous step: no commit can slip
            # between them. Pins are taken only after the wait, so a caller that gives up while
            # waiting holds nothing.
            valid = [k for k in checked if isinstance(k, bytes)]
            pending = [
                key
                for key, entry in zip(valid, self.store.lookup(engine_id, valid), strict=True)
                if entry is not None and entry.state is EntryState.PENDING
            ]
            if pending:
                await self.hub.wait_settled(engine_id, pending, wait_ms / 1000)
        results = per_item(
            checked,
            lambda keys: self.store.acquire(request.session_id, engine_id, keys),
            lambda message: AcquireOutcome(invalid_outcome(message)),
        )
        return pb.AcquireReply(
            boot_epoch=self.epoch,
            results=[
                acquire_result_pb(key, r.outcome, r.lease_id)
                for key, r in zip(request.keys, results, strict=True)
            ],
        )

    @rpc
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReleaseReply:
        validate.batch(len(request.lease_ids), self.limits)
        outcomes = self.store.release(request.session_id, list(request.lease_ids))
        return pb.ReleaseReply(
            boot_epoch=self.epoch,
            results=[
                pb.LeaseResult(lease_id=lease_id, status=item_status(o.status), message=o.message)
                for lease_id, o in zip(request.lease_ids, outcomes, strict=True)
            ],
        )

    @rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LookupReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.keys), self.limits)
        entries = self.store.lookup(engine_id, list(request.keys))
        return pb.LookupReply(
            boot_epoch=self.epoch,
            results=[
                pb.LookupResult(
                    key=key,
                    state=state_pb(entry),
                    nbytes=entry.spec.nbytes if entry else 0,
                    pins=entry.pins if entry else 0,
                )
                for key, entry in zip(request.keys, entries, strict=True)
            ],
        )

    @rpc
    async def ListEntries(
        self, request: pb.ListEntriesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListEntriesReply:
        engine_id = validate.engine_id(request.engine_id)
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        entries, truncated = self.store.list_entries(engine_id, request.start_after, limit)
        now = self.store.now()
        return pb.ListEntriesReply(
            boot_epoch=self.epoch,
            truncated=truncated,
            entries=[
                pb.EntryInfo(
                    key=e.key,
                    state=state_pb(e),
                    tensor=spec_pb(e.spec),
                    extents=extents_pb(e),
                    pins=e.pins,
                    producer=e.producer,
                    checksum=e.checksum,
                    age_s=now - (e.committed_at if e.state is EntryState.READY else e.created_at),
                )
                for e in entries
            ],
        )

    # ---- observation ---------------------------------------------------------------------------

    @rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatsReply:
        engine_id = validate.engine_id(request.engine_id) if request.engine_id else ""
        snap = self.store.snapshot(engine_id)
        return pb.StatsReply(
            boot_epoch=snap.boot_epoch,
            uptime_s=snap.uptime_s,
            max_bytes=snap.max_bytes,
            reserved_bytes=snap.reserved_bytes,
            sessions=snap.sessions,
            lease_expiries=snap.lease_expiries,
            version=__version__,
            pools=[
                pb.PoolStats(
                    engine_id=p.engine_id,
                    capacity_bytes=p.geometry.capacity_bytes,
                    block_size_bytes=p.geometry.block_size_bytes,
                    num_blocks=p.geometry.num_blocks,
                    free_blocks=p.free_blocks,
                    free_extents=p.free_extents,
                    largest_free_extent=p.largest_free_extent,
                    entries_pending=p.entries_pending,
                    entries_ready=p.entries_ready,
                    entries_pinned=p.entries_pinned,
                    pins=p.pins,
                    hits=p.counters.hits,
                    misses=p.counters.misses,
                    evictions=p.counters.evictions,
                    no_space=p.counters.no_space,
                    commits=p.counters.commits,
                    aborts=p.counters.aborts,
                    bytes_ready=p.bytes_ready,
                )
                for p in snap.pools
            ],
        )

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchEvent]:
        try:
            self.authorize("Watch", request, context)
            engine_id = validate.engine_id(request.engine_id) if request.engine_id else ""
            pools = [self.store.pool(engine_id)] if engine_id else self.store.pools()
        except CoreError as exc:
            await abort(self.store, context, exc)
            return
        # Subscribe and take the snapshot in one synchronous step, so no event falls between.
        subscription = self.hub.subscribe(engine_id)
        snapshot = [
            (pool.engine_id, entry)
            for pool in pools
            for entry in pool.index.entries()
            if request.snapshot and entry.state is EntryState.READY
        ]
        try:
            if request.snapshot:
                for pool_id, entry in snapshot:
                    yield pb.WatchEvent(
                        boot_epoch=self.epoch,
                        type=pb.EVENT_SNAPSHOT,
                        engine_id=pool_id,
                        key=entry.key,
                        nbytes=entry.spec.nbytes,
                    )
                yield pb.WatchEvent(
                    boot_epoch=self.epoch, type=pb.EVENT_SYNCED, engine_id=engine_id
                )
            while True:
                event = await subscription.queue.get()
                if event is StreamEnd.SHUTDOWN:
                    return
                if event is StreamEnd.OVERFLOW:
                    await abort(
                        self.store,
                        context,
                        CoreError(
                            Code.RESOURCE_EXHAUSTED,
                            f"watcher fell more than {subscription.limit} events behind; "
                            "resubscribe with snapshot=true",
                        ),
                    )
                    return
                yield watch_event_pb(self.epoch, event)
        finally:
            self.hub.unsubscribe(subscription)


def watch_event_pb(epoch: str, event: Event) -> pb.WatchEvent:
    return pb.WatchEvent(
        boot_epoch=epoch,
        type=EVENT_TYPES[event.type],
        engine_id=event.engine_id,
        key=event.key,
        nbytes=event.nbytes,
    )


def acquire_result_pb(key: bytes, outcome: Outcome, lease_id: int) -> pb.AcquireResult:
    result = pb.AcquireResult(key=key, status=item_status(outcome.status), message=outcome.message)
    if outcome.status is ItemStatus.HIT and outcome.entry is not None:
        entry = outcome.entry
        result.lease_id = lease_id
        result.extents.extend(extents_pb(entry))
        result.tensor.CopyFrom(spec_pb(entry.spec))
        result.checksum = entry.checksum
    return result


def add_to_server(service: EncoderCacheService, server: grpc.aio.Server) -> None:
    """Register the service, parsing request bodies here rather than in grpc: a body that is not
    a valid message is the client's mistake (INVALID_ARGUMENT), where grpc would answer UNKNOWN."""
    descriptor = pb.DESCRIPTOR.services_by_name["EncoderCache"]
    handlers = {}
    for method in descriptor.methods:
        request_type = getattr(pb, method.input_type.name)
        serialize = getattr(pb, method.output_type.name).SerializeToString
        implementation = getattr(service, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _parsed_stream(service.store, request_type, implementation),
                response_serializer=serialize,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsed_unary(service.store, request_type, implementation),
                response_serializer=serialize,
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
    )


async def _parse(
    store: Store, request_type: Any, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        await abort(
            store,
            context,
            CoreError(
                Code.INVALID_ARGUMENT,
                f"request body is not a valid {request_type.DESCRIPTOR.full_name}: {exc}",
            ),
        )


def _parsed_unary(
    store: Store, request_type: Any, implementation: Callable[..., Awaitable[Any]]
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await implementation(await _parse(store, request_type, raw, context), context)

    return handle


def _parsed_stream(
    store: Store, request_type: Any, implementation: Callable[..., AsyncIterator[Any]]
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        async for reply in implementation(await _parse(store, request_type, raw, context), context):
            yield reply

    return handle
