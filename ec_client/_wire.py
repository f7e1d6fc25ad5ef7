"""Each client call as data: which RPC, how to build its request, how to read its reply.

Client (sync) and AsyncClient (asyncio) only differ in how they run a Call, so every request is
built and every reply parsed here, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ec_client._proto.ecd.v1 import ecd_pb2 as pb
from ec_client.types import (
    AcquireResult,
    AllocateItem,
    AllocateResult,
    EntryInfo,
    EntryState,
    EventType,
    Extent,
    ItemResult,
    Key,
    LeaseResult,
    LookupResult,
    PoolInfo,
    PoolStats,
    Role,
    Stats,
    Status,
    TensorSpec,
    WatchEvent,
    key_bytes,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC: `build(session_id)` makes the request (the session may be reopened between
    retries), `parse(reply)` makes the result."""

    method: str
    build: Callable[[str], Any]
    parse: Callable[[Any], T]
    extra_timeout_s: float = 0.0  # on top of the client's call timeout (Acquire's wait)


def status(value: int) -> Status:
    return Status[pb.ItemStatus.Name(value).removeprefix("ITEM_")]


def state(value: int) -> EntryState:
    return EntryState[pb.EntryState.Name(value).removeprefix("ENTRY_")]


def extents(values: Sequence[pb.Extent]) -> tuple[Extent, ...]:
    return tuple(Extent(e.start, e.count) for e in values)


def spec(value: pb.TensorSpec) -> TensorSpec:
    return TensorSpec(tuple(value.shape), value.dtype, value.nbytes)


def keys(values: Sequence[Key]) -> list[bytes]:
    return [key_bytes(k) for k in values]


def item_results(reply: Any) -> list[ItemResult]:
    return [ItemResult(r.key, status(r.status), r.message) for r in reply.results]


ROLES = {
    Role.PRODUCER: pb.ROLE_PRODUCER,
    Role.CONSUMER: pb.ROLE_CONSUMER,
    Role.BOTH: pb.ROLE_BOTH,
    Role.ADMIN: pb.ROLE_ADMIN,
}


def open_session(name: str, pid: int, role: Role) -> Call[pb.OpenSessionReply]:
    return Call(
        "OpenSession",
        lambda _: pb.OpenSessionRequest(client_name=name, pid=pid, role=ROLES[role]),
        lambda reply: reply,
    )


def keep_alive() -> Call[float]:
    return Call(
        "KeepAlive",
        lambda sid: pb.KeepAliveRequest(session_id=sid),
        lambda reply: reply.lease_ttl_ms / 1000,
    )


def close_session() -> Call[tuple[int, int]]:
    return Call(
        "CloseSession",
        lambda sid: pb.CloseSessionRequest(session_id=sid),
        lambda reply: (reply.aborted, reply.released),
    )


def open_pool(
    engine_id: str, block_size_bytes: int, capacity_bytes: int, compat_key: str
) -> Call[PoolInfo]:
    def parse(reply: pb.OpenPoolReply) -> PoolInfo:
        p = reply.pool
        return PoolInfo(
            engine_id=p.engine_id,
            path=p.path,
            block_size_bytes=p.block_size_bytes,
            num_blocks=p.num_blocks,
            data_offset=p.data_offset,
            file_size=p.file_size,
            pool_uuid=p.pool_uuid,
            compat_key=p.compat_key,
            max_entries=p.max_entries,
            created=reply.created,
        )

    return Call(
        "OpenPool",
        lambda sid: pb.OpenPoolRequest(
            session_id=sid,
            engine_id=engine_id,
            block_size_bytes=block_size_bytes,
            capacity_bytes=capacity_bytes,
            compat_key=compat_key,
        ),
        parse,
    )


def drop_pool(engine_id: str, force: bool) -> Call[int]:
    return Call(
        "DropPool",
        lambda _: pb.DropPoolRequest(engine_id=engine_id, force=force),
        lambda reply: reply.entries_dropped,
    )


def allocate(engine_id: str, items: Sequence[AllocateItem]) -> Call[list[AllocateResult]]:
    request_items = []
    for item in items:
        s = item.spec
        request_items.append(
            pb.AllocateItem(
                key=key_bytes(item.key),
                tensor=pb.TensorSpec(shape=list(s.shape), dtype=s.dtype, nbytes=s.nbytes),
            )
        )
    return Call(
        "Allocate",
        lambda sid: pb.AllocateRequest(session_id=sid, engine_id=engine_id, items=request_items),
        lambda reply: [
            AllocateResult(r.key, status(r.status), r.message, extents(r.extents))
            for r in reply.results
        ],
    )


def commit(
    engine_id: str, keys_: Sequence[Key], checksums: Sequence[int] | None
) -> Call[list[ItemResult]]:
    sums = list(checksums) if checksums is not None else [0] * len(keys_)
    if len(sums) != len(keys_):
        raise ValueError(f"{len(keys_)} keys but {len(sums)} checksums")
    items = [pb.CommitItem(key=k, checksum=c) for k, c in zip(keys(keys_), sums, strict=True)]
    return Call(
        "Commit",
        lambda sid: pb.CommitRequest(session_id=sid, engine_id=engine_id, items=items),
        item_results,
    )


def abort(engine_id: str, keys_: Sequence[Key]) -> Call[list[ItemResult]]:
    raw = keys(keys_)
    return Call(
        "Abort",
        lambda sid: pb.AbortRequest(session_id=sid, engine_id=engine_id, keys=raw),
        item_results,
    )


def acquire(engine_id: str, keys_: Sequence[Key], wait_ms: int) -> Call[list[AcquireResult]]:
    raw = keys(keys_)

    def parse(reply: pb.AcquireReply) -> list[AcquireResult]:
        return [
            AcquireResult(
                key=r.key,
                status=status(r.status),
                message=r.message,
                lease_id=r.lease_id,
                extents=extents(r.extents),
                spec=spec(r.tensor) if r.HasField("tensor") else None,
                checksum=r.checksum,
            )
            for r in reply.results
        ]

    return Call(
        "Acquire",
        lambda sid: pb.AcquireRequest(
            session_id=sid, engine_id=engine_id, keys=raw, wait_ms=wait_ms
        ),
        parse,
        extra_timeout_s=wait_ms / 1000,
    )


def release(lease_ids: Sequence[int]) -> Call[list[LeaseResult]]:
    ids = list(lease_ids)
    return Call(
        "Release",
        lambda sid: pb.ReleaseRequest(session_id=sid, lease_ids=ids),
        lambda reply: [LeaseResult(r.lease_id, status(r.status), r.message) for r in reply.results],
    )


def lookup(engine_id: str, keys_: Sequence[Key]) -> Call[list[LookupResult]]:
    raw = keys(keys_)
    return Call(
        "Lookup",
        lambda _: pb.LookupRequest(engine_id=engine_id, keys=raw),
        lambda reply: [
            LookupResult(r.key, state(r.state), r.nbytes, r.pins) for r in reply.results
        ],
    )


def evict(engine_id: str, keys_: Sequence[Key]) -> Call[list[ItemResult]]:
    raw = keys(keys_)
    return Call("Evict", lambda _: pb.EvictRequest(engine_id=engine_id, keys=raw), item_results)


def delete(engine_id: str, keys_: Sequence[Key]) -> Call[list[ItemResult]]:
    raw = keys(keys_)
    return Call("Delete", lambda _: pb.DeleteRequest(engine_id=engine_id, keys=raw), item_results)


def list_entries(
    engine_id: str, limit: int, start_after: Key
) -> Call[tuple[list[EntryInfo], bool]]:
    def parse(reply: pb.ListEntriesReply) -> tuple[list[EntryInfo], bool]:
        entries = [
            EntryInfo(
                key=e.key,
                state=state(e.state),
                spec=spec(e.tensor),
                extents=extents(e.extents),
                pins=e.pins,
                producer=e.producer,
                checksum=e.checksum,
                age_s=e.age_s,
            )
            for e in reply.entries
        ]
        return entries, reply.truncated

    return Call(
        "ListEntries",
        lambda _: pb.ListEntriesRequest(
            engine_id=engine_id, limit=limit, start_after=key_bytes(start_after)
        ),
        parse,
    )


def stats(engine_id: str) -> Call[Stats]:
    pool_fields = [f.name for f in dataclasses.fields(PoolStats)]

    def parse(reply: pb.StatsReply) -> Stats:
        return Stats(
            boot_epoch=reply.boot_epoch,
            uptime_s=reply.uptime_s,
            max_bytes=reply.max_bytes,
            reserved_bytes=reply.reserved_bytes,
            sessions=reply.sessions,
            lease_expiries=reply.lease_expiries,
            version=reply.version,
            pools=tuple(
                PoolStats(**{name: getattr(p, name) for name in pool_fields}) for p in reply.pools
            ),
        )

    return Call("Stats", lambda _: pb.StatsRequest(engine_id=engine_id), parse)


def watch_request(engine_id: str, snapshot: bool) -> pb.WatchRequest:
    return pb.WatchRequest(engine_id=engine_id, snapshot=snapshot)


def watch_event(event: pb.WatchEvent) -> WatchEvent:
    return WatchEvent(
        type=EventType[pb.EventType.Name(event.type).removeprefix("EVENT_")],
        engine_id=event.engine_id,
        key=event.key,
        nbytes=event.nbytes,
        boot_epoch=event.boot_epoch,
    )
