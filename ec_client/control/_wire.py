"""Each client call as data: which RPC, how to build its request, how to read its reply.

Client (sync) and AsyncClient (asyncio) only differ in how they run a Call, so every request is
built and every reply parsed here, once.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from grpc_health.v1 import health_pb2

from ec_protocol import types as api
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.pool.layout import tensor_nbytes

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 (an item of a batch)
R = TypeVar("R")
V = TypeVar("V", bound="DataclassInstance")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC: `build(session_id)` makes the request (the session may be reopened between
    retries), `parse(reply)` makes the result."""

    method: str
    build: Callable[[str], Any]
    parse: Callable[[Any], T]
    extra_timeout_s: float = 0.0  # on top of the client's call timeout (Acquire's wait)
    # Sending it again after an attempt that may have been applied changes nothing that
    # matters: reads, opens, Allocate (the same session's retry gets the same extents) and
    # Acquire (see _session on CANCELLED).
    safe_to_retry: bool = False
    # For a call that asked to wait (Acquire's wait_ms): the reply standing in for the daemon's
    # when it stayed away until the wait ran out (why), as the caller asked: an answer within
    # its wait, even if that answer is "nothing came".
    waited_out: Callable[[str], Any] | None = None
    # A batch call's first `limit` items and the rest, as calls of their own, or None when it
    # fits (the daemon refuses a batch over its --max-batch whole); `join` makes the parts'
    # results one, in order.
    split: Callable[[int], tuple[Call[T], Call[T]] | None] | None = None
    join: Callable[[T, T], T] | None = None


# Enum values by wire number, looked up once (a per-item Name() lookup costs microseconds).
STATUS: dict[int, api.Status] = {getattr(pb, "ITEM_" + s.name): s for s in api.Status}
STATE: dict[int, api.EntryState] = {getattr(pb, "ENTRY_" + s.name): s for s in api.EntryState}
EVENT: dict[int, api.EventType] = {getattr(pb, "EVENT_" + t.name): t for t in api.EventType}
ROLES: dict[api.Role, pb.Role] = {r: getattr(pb, "ROLE_" + r.name) for r in api.Role}


def batched(make: Callable[[Sequence[I]], Call[list[R]]], items: Sequence[I]) -> Call[list[R]]:
    """make(items), split at the daemon's batch limit into calls of the parts (each made when
    the part before it was answered), their results joined in order."""

    def split(limit: int) -> tuple[Call[list[R]], Call[list[R]]] | None:
        if len(items) <= limit:
            return None
        return make(items[:limit]), batched(make, items[limit:])

    return dataclasses.replace(make(items), split=split, join=operator.add)


def mirror(value_type: type[V], message: Any, **given: Any) -> V:
    """The value whose fields are the message's fields of the same names (they are declared to
    match: tests/unit/test_types.py), with `given` for the fields the message lacks or nests."""
    names = [f.name for f in dataclasses.fields(value_type) if f.name not in given]
    return value_type(**{name: getattr(message, name) for name in names}, **given)


def status(value: int) -> api.Status:
    return STATUS[value]


def state(value: int) -> api.EntryState:
    return STATE[value]


def extents(values: Sequence[pb.Extent]) -> tuple[api.Extent, ...]:
    return tuple(api.Extent(e.start, e.count) for e in values)


def spec(value: pb.TensorSpec) -> api.TensorSpec:
    return api.TensorSpec(tuple(value.shape), value.dtype, value.nbytes)


def keys(values: Sequence[api.Key]) -> list[bytes]:
    return [api.key_bytes(k) for k in values]


def open_session(name: str, pid: int, role: api.Role) -> Call[pb.OpenSessionReply]:
    return Call(
        "OpenSession",
        lambda _: pb.OpenSessionRequest(client_name=name, pid=pid, role=ROLES[role]),
        lambda reply: reply,
        safe_to_retry=True,
    )


def keep_alive() -> Call[float]:
    return Call(
        "KeepAlive",
        lambda sid: pb.KeepAliveRequest(session_id=sid),
        lambda reply: reply.lease_ttl_ms / 1000,
        safe_to_retry=True,
    )


def close_session() -> Call[tuple[int, int]]:
    return Call(
        "CloseSession",
        lambda sid: pb.CloseSessionRequest(session_id=sid),
        lambda reply: (reply.aborted, reply.released),
    )


def open_pool(
    engine_id: str,
    block_size_bytes: int,
    capacity_bytes: int,
    compat_key: str,
    ephemeral: bool,
    max_entries: int = 0,
    reopen: bool = False,
    cluster_namespace: str = "",
) -> Call[api.PoolInfo]:
    """reopen: the client opening again by itself a pool it opened (see _session), which never
    makes anew one dropped while it held it."""

    def parse(reply: pb.OpenPoolReply) -> api.PoolInfo:
        return mirror(api.PoolInfo, reply.pool, created=reply.created, fd_ticket=reply.fd_ticket)

    return Call(
        "OpenPool",
        lambda sid: pb.OpenPoolRequest(
            session_id=sid,
            engine_id=engine_id,
            block_size_bytes=block_size_bytes,
            capacity_bytes=capacity_bytes,
            compat_key=compat_key,
            ephemeral=ephemeral,
            max_entries=max_entries,
            reopen=reopen,
            cluster_namespace=cluster_namespace,
        ),
        parse,
        safe_to_retry=True,
    )


def open_pool_calls(
    engine_id: str,
    block_size_bytes: int,
    capacity_bytes: int,
    compat_key: str,
    ephemeral: bool,
    max_entries: int,
    cluster_namespace: str,
) -> tuple[Call[api.PoolInfo], Call[api.PoolInfo]]:
    """OpenPool as the application asks it, and as the client sends it again by itself (with
    reopen): what both clients' open_pool hand SessionState.open_pool."""
    asked = (engine_id, block_size_bytes, capacity_bytes, compat_key, ephemeral, max_entries)
    return (
        open_pool(*asked, cluster_namespace=cluster_namespace),
        open_pool(*asked, reopen=True, cluster_namespace=cluster_namespace),
    )


def drop_pool(engine_id: str, force: bool) -> Call[int]:
    return Call(
        "DropPool",
        lambda sid: pb.DropPoolRequest(engine_id=engine_id, force=force, session_id=sid),
        lambda reply: reply.entries_dropped,
    )


# ---- the parts of the item RPCs: each Step part is built and read as its own RPC's items -------


# Items are added to their request's repeated field and filled in place: several times cheaper
# than building each with keywords and handing it over, on the per-item hot path (see
# docs/performance.md, Per-item costs).


def add_allocates(into: Any, items: Sequence[api.AllocateItem]) -> None:
    add = into.add
    for item in items:
        added = add()
        added.key = api.key_bytes(item.key)
        tensor = added.tensor
        tensor.shape.extend(item.shape)
        tensor.dtype = item.dtype
        tensor.nbytes = (
            item.nbytes if item.nbytes is not None else tensor_nbytes(item.shape, item.dtype)
        )


def add_commits(into: Any, commits: Sequence[api.CommitItem]) -> None:
    add = into.add
    for key, checksum, allocation in commits:
        added = add()
        added.key = key
        added.checksum = checksum
        added.allocation = allocation


def commit_items(
    keys_: Sequence[api.Key],
    checksums: Sequence[int] | None,
    allocations: Sequence[int] | None = None,
) -> list[api.CommitItem]:
    """The commits of keys; a checksum of 0 means none, an allocation of 0 (or none given) the
    session's PENDING allocation of the key, whichever it is."""
    sums = list(checksums) if checksums is not None else [0] * len(keys_)
    ids = list(allocations) if allocations is not None else [0] * len(keys_)
    if len(sums) != len(keys_) or len(ids) != len(keys_):
        raise ValueError(f"{len(keys_)} keys but {len(sums)} checksums and {len(ids)} allocations")
    return list(zip(keys(keys_), sums, ids, strict=True))


def item_results(results: Sequence[pb.ItemResult]) -> list[api.ItemResult]:
    return [api.ItemResult(r.key, status(r.status), r.message) for r in results]


def runs(message: Any) -> tuple[api.Extent, ...]:
    """A result's extents: packed as start, count pairs (Step), or as messages."""
    packed = message.runs
    if len(packed) == 2:  # the norm: an entry is one extent
        return (api.Extent(packed[0], packed[1]),)
    if packed:
        return tuple(map(api.Extent, packed[0::2], packed[1::2]))
    return extents(message.extents)


def allocate_results(results: Sequence[pb.AllocateResult]) -> list[api.AllocateResult]:
    return [
        api.AllocateResult(r.key, STATUS[r.status], r.message, runs(r), r.allocation)
        for r in results
    ]


def acquire_results(results: Sequence[pb.AcquireResult]) -> list[api.AcquireResult]:
    parsed = []
    for r in results:
        tensor = r.tensor  # its dtype is empty unless the item is a HIT
        parsed.append(
            api.AcquireResult(
                r.key,
                STATUS[r.status],
                r.message,
                r.lease_id,
                runs(r),
                spec(tensor) if tensor.dtype else None,
                r.checksum,
            )
        )
    return parsed


def lease_results(results: Sequence[pb.LeaseResult]) -> list[api.LeaseResult]:
    return [api.LeaseResult(r.lease_id, status(r.status), r.message) for r in results]


def allocate(engine_id: str, items: Sequence[api.AllocateItem]) -> Call[list[api.AllocateResult]]:
    def make(part: Sequence[api.AllocateItem]) -> Call[list[api.AllocateResult]]:
        def build(sid: str) -> pb.AllocateRequest:
            request = pb.AllocateRequest(session_id=sid, engine_id=engine_id)
            add_allocates(request.items, part)
            return request

        return Call(
            "Allocate", build, lambda reply: allocate_results(reply.results), safe_to_retry=True
        )

    return batched(make, items)


def commit(
    engine_id: str,
    keys_: Sequence[api.Key],
    checksums: Sequence[int] | None,
    allocations: Sequence[int] | None = None,
) -> Call[list[api.ItemResult]]:
    def make(part: Sequence[api.CommitItem]) -> Call[list[api.ItemResult]]:
        def build(sid: str) -> pb.CommitRequest:
            request = pb.CommitRequest(session_id=sid, engine_id=engine_id)
            add_commits(request.items, part)
            return request

        return Call("Commit", build, lambda reply: item_results(reply.results))

    return batched(make, commit_items(keys_, checksums, allocations))


def keyed(method: str, engine_id: str, keys_: Sequence[api.Key]) -> Call[list[api.ItemResult]]:
    """Abort, Evict or Delete: a batch of keys of one pool, an ItemResult each."""
    request_type = getattr(pb, f"{method}Request")

    def make(part: Sequence[bytes]) -> Call[list[api.ItemResult]]:
        def build(sid: str) -> Any:
            request = request_type(engine_id=engine_id, keys=part)
            if "session_id" in request_type.DESCRIPTOR.fields_by_name:
                request.session_id = sid
            return request

        return Call(method, build, lambda reply: item_results(reply.results))

    return batched(make, keys(keys_))


def abort(engine_id: str, keys_: Sequence[api.Key]) -> Call[list[api.ItemResult]]:
    return keyed("Abort", engine_id, keys_)


MAX_WAIT_MS = (1 << 32) - 1  # wait_ms travels as a uint32


def acquire(
    engine_id: str, keys_: Sequence[api.Key], wait_ms: int
) -> Call[list[api.AcquireResult]]:
    """ValueError, before anything is sent, for a wait_ms the request cannot carry."""
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise ValueError(f"wait_ms={wait_ms}: expected milliseconds from 0 to {MAX_WAIT_MS}")
    ends = time.monotonic() + wait_ms / 1000  # one wait for every part of a split batch

    def make(part: Sequence[bytes]) -> Call[list[api.AcquireResult]]:
        left_ms = min(wait_ms, max(0, math.ceil((ends - time.monotonic()) * 1000)))

        def waited_out(why: str) -> pb.AcquireReply:
            return pb.AcquireReply(
                results=[pb.AcquireResult(key=k, status=pb.ITEM_MISS, message=why) for k in part]
            )

        return Call(
            "Acquire",
            lambda sid: pb.AcquireRequest(
                session_id=sid, engine_id=engine_id, keys=part, wait_ms=left_ms
            ),
            lambda reply: acquire_results(reply.results),
            extra_timeout_s=left_ms / 1000,
            safe_to_retry=True,
            waited_out=waited_out if left_ms else None,
        )

    return batched(make, keys(keys_))


def release(lease_ids: Sequence[int]) -> Call[list[api.LeaseResult]]:
    def make(part: Sequence[int]) -> Call[list[api.LeaseResult]]:
        return Call(
            "Release",
            lambda sid: pb.ReleaseRequest(session_id=sid, lease_ids=part),
            lambda reply: lease_results(reply.results),
        )

    return batched(make, list(lease_ids))


def step(
    engine_id: str,
    releases: Sequence[int] = (),
    commits: Sequence[api.CommitItem] = (),
    aborts: Sequence[api.Key] = (),
    acquires: Sequence[api.Key] = (),
    allocates: Sequence[api.AllocateItem] = (),
    misses: int = 0,
    hits: Sequence[bytes] = (),
    local_only: bool = False,
) -> Call[api.StepResult]:
    """A Step; `commits` as CommitItems (commit_items); `misses` and `hits`, those the
    client answered itself since its last Step to the pool (StepRequest.misses, .hits);
    `local_only`: its acquires answered by the node's pools alone (StepRequest.local_only).

    Built here, not when sent (only its session is filled in then): items that cannot be
    encoded raise now, before anything was sent, so that what the Step was to carry for the
    client's outbox is given back whole (OutboxBatch.step)."""
    request = pb.StepRequest(
        engine_id=engine_id,
        releases=releases,
        aborts=keys(aborts),
        acquires=keys(acquires),
        misses=misses,
        hits=hits,
        local_only=local_only,
    )
    add_commits(request.commits, commits)
    add_allocates(request.allocates, allocates)
    return step_call(
        request, max(len(releases), len(commits), len(aborts), len(acquires), len(allocates))
    )


STEP_PARTS = ("releases", "commits", "aborts", "acquires", "allocates")


def step_call(request: pb.StepRequest, largest: int) -> Call[api.StepResult]:
    """The Step of `request`, whose largest part has `largest` items."""

    def build(sid: str) -> pb.StepRequest:
        request.session_id = sid
        return request

    def split(limit: int) -> tuple[Call[api.StepResult], Call[api.StepResult]] | None:
        """Each part's first `limit` items, and a Step of the rest that carries the hits and
        misses (counted by the daemon only in a Step that succeeds: where an earlier part
        fails, they never went, and are owed again whole)."""
        if largest <= limit:
            return None
        first = pb.StepRequest(engine_id=request.engine_id, local_only=request.local_only)
        rest = pb.StepRequest(
            engine_id=request.engine_id,
            misses=request.misses,
            hits=request.hits,
            local_only=request.local_only,
        )
        for part in STEP_PARTS:
            items = getattr(request, part)
            getattr(first, part).extend(items[:limit])
            getattr(rest, part).extend(items[limit:])
        return step_call(first, _largest(first)), step_call(rest, _largest(rest))

    return Call(
        "Step",
        build,
        lambda reply: api.StepResult(
            lease_results(reply.releases),
            item_results(reply.commits),
            item_results(reply.aborts),
            acquire_results(reply.acquires),
            allocate_results(reply.allocates),
            reply.pool_uuid,
        ),
        # Its acquires and allocates are safe to send again; a release, commit or abort sent
        # again after it was applied answers an error (NOT_FOUND, READY already), which is what
        # its op would hear of a Step cut off anyway (it may or may not have taken effect): so a
        # put or get cut off as the daemon stops carries on at the next daemon.
        safe_to_retry=True,
        split=split,
        join=joined_steps,
    )


def _largest(request: pb.StepRequest) -> int:
    return max(len(getattr(request, part)) for part in STEP_PARTS)


def joined_steps(first: api.StepResult, then: api.StepResult) -> api.StepResult:
    """The answers of a Step sent as two, in order; no pool_uuid if they name two files."""
    return api.StepResult(
        first.releases + then.releases,
        first.commits + then.commits,
        first.aborts + then.aborts,
        first.acquires + then.acquires,
        first.allocates + then.allocates,
        first.pool_uuid if first.pool_uuid == then.pool_uuid else "",
    )


def lookup(engine_id: str, keys_: Sequence[api.Key]) -> Call[list[api.LookupResult]]:
    def make(part: Sequence[bytes]) -> Call[list[api.LookupResult]]:
        return Call(
            "Lookup",
            lambda _: pb.LookupRequest(engine_id=engine_id, keys=part),
            lambda reply: [
                api.LookupResult(r.key, state(r.state), r.nbytes, r.pins) for r in reply.results
            ],
            safe_to_retry=True,
        )

    return batched(make, keys(keys_))


def evict(engine_id: str, keys_: Sequence[api.Key]) -> Call[list[api.ItemResult]]:
    return keyed("Evict", engine_id, keys_)


def delete(engine_id: str, keys_: Sequence[api.Key]) -> Call[list[api.ItemResult]]:
    return keyed("Delete", engine_id, keys_)


def list_entries(
    engine_id: str, limit: int, start_after: api.Key
) -> Call[tuple[list[api.EntryInfo], bool]]:
    def parse(reply: pb.ListEntriesReply) -> tuple[list[api.EntryInfo], bool]:
        entries = [
            mirror(
                api.EntryInfo,
                e,
                state=state(e.state),
                spec=spec(e.tensor),
                extents=extents(e.extents),
            )
            for e in reply.entries
        ]
        return entries, reply.truncated

    return Call(
        "ListEntries",
        lambda _: pb.ListEntriesRequest(
            engine_id=engine_id, limit=limit, start_after=api.key_bytes(start_after)
        ),
        parse,
        safe_to_retry=True,
    )


def next_page(entries: Sequence[api.EntryInfo], truncated: bool) -> bytes | None:
    """The start_after of the page of entries after this one, None after the last page."""
    return entries[-1].key if truncated and entries else None


def stats(engine_id: str) -> Call[api.Stats]:
    def parse(reply: pb.StatsReply) -> api.Stats:
        return mirror(
            api.Stats,
            reply,
            pools=tuple(pool_stats(p) for p in reply.pools),
            cluster=(
                mirror(api.ClusterStats, reply.cluster) if reply.HasField("cluster") else None
            ),
            refused=tuple(mirror(api.RefusedPool, r) for r in reply.refused),
        )

    return Call("Stats", lambda _: pb.StatsRequest(engine_id=engine_id), parse, safe_to_retry=True)


def pool_stats(message: pb.PoolStats) -> api.PoolStats:
    return mirror(
        api.PoolStats,
        message,
        remote_seconds_bounds=tuple(message.remote_seconds_bounds),
        remote_seconds_counts=tuple(message.remote_seconds_counts),
    )


def watch_request(engine_id: str, snapshot: bool, include_pending: bool = False) -> pb.WatchRequest:
    return pb.WatchRequest(engine_id=engine_id, snapshot=snapshot, include_pending=include_pending)


def watch_event(event: pb.WatchEvent) -> api.WatchEvent:
    return api.WatchEvent(
        type=EVENT[event.type],
        engine_id=event.engine_id,
        key=event.key,
        nbytes=event.nbytes,
        boot_epoch=event.boot_epoch,
        slot=event.slot if event.HasField("slot") else None,
    )


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def health_status(reply: health_pb2.HealthCheckResponse) -> str:
    """The status's name: SERVING, NOT_SERVING, ..."""
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
