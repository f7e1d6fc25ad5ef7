"""The daemon's side of the wire: ecd.v1 messages to the core's inputs and the core's answers
(the values of `ec_protocol.types`) to messages, one function per value; a CoreError to a gRPC
error; request bodies parsed and the service registered. `ec_client/control/_wire.py` is the same on
the client's side. No handling here: `service.py` validates, calls the store and answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from ec_daemon.core.errors import Code, CoreError
from ec_daemon.core.store import Store
from ec_daemon.server import validate
from ec_protocol import types as api
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb

GRPC_CODE = {code: getattr(grpc.StatusCode, code.value) for code in Code}


async def abort(store: Store, context: grpc.aio.ServicerContext[Any, Any], exc: CoreError) -> None:
    context.set_trailing_metadata(
        (("ecd-reason", exc.reason.value), ("ecd-boot-epoch", store.boot_epoch))
    )
    await context.abort(GRPC_CODE[exc.code], exc.message)


# ---- from messages to the core's inputs ------------------------------------------------------

ROLES: dict[pb.Role, api.Role] = {
    pb.ROLE_UNSPECIFIED: api.Role.BOTH,  # clients that do not say are trusted with both
    pb.ROLE_PRODUCER: api.Role.PRODUCER,
    pb.ROLE_CONSUMER: api.Role.CONSUMER,
    pb.ROLE_BOTH: api.Role.BOTH,
    pb.ROLE_ADMIN: api.Role.ADMIN,
}


def checked_specs(items: Sequence[pb.AllocateItem]) -> list[tuple[bytes, api.TensorSpec] | str]:
    return [
        spec if isinstance(spec, str) else (item.key, spec)
        for item in items
        for spec in (validate.tensor_spec(item.key, item.tensor),)
    ]


def checked_commits(items: Sequence[pb.CommitItem]) -> list[api.CommitItem | str]:
    """(key, checksum, allocation) per item, or what is wrong with its key."""
    return [
        (item.key, item.checksum, item.allocation) if isinstance(key, bytes) else key
        for item, key in zip(items, checked_keys([i.key for i in items]), strict=True)
    ]


def checked_keys(keys: Sequence[bytes]) -> list[bytes | str]:
    return [key if (problem := validate.key_problem(key)) is None else problem for key in keys]


# ---- from ec_protocol.types to messages, one function per value ---------------------------------

STATUS_PB: dict[api.Status, pb.ItemStatus] = {s: getattr(pb, "ITEM_" + s.name) for s in api.Status}
STATE_PB: dict[api.EntryState, pb.EntryState] = {
    s: getattr(pb, "ENTRY_" + s.name) for s in api.EntryState
}
EVENT_PB: dict[api.EventType, pb.EventType] = {
    t: getattr(pb, "EVENT_" + t.name) for t in api.EventType
}


def extents_pb(extents: Sequence[api.Extent]) -> list[pb.Extent]:
    return [pb.Extent(start=e.start, count=e.count) for e in extents]


def runs_pb(extents: Sequence[api.Extent]) -> list[int]:
    """Extents packed as start, count pairs (a Step's replies): no message per extent."""
    return [n for e in extents for n in (e.start, e.count)]


def spec_pb(spec: api.TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(shape=spec.shape, dtype=spec.dtype, nbytes=spec.nbytes)


# Results are filled into messages added to their reply (`reply.results.add()`): much cheaper
# than building each one with keywords and handing it over, on the per-item hot path (see
# docs/performance.md, Per-item costs).


def put_item_result(into: pb.ItemResult, r: api.ItemResult) -> None:
    into.key, into.status, into.message = r.key, STATUS_PB[r.status], r.message


def put_extents(
    into: pb.AllocateResult | pb.AcquireResult, extents: tuple[api.Extent, ...], packed: bool
) -> None:
    """A Step's reply packs them as `runs`; Allocate's and Acquire's keep `extents` messages."""
    if packed:
        into.runs.extend(runs_pb(extents))
    else:
        into.extents.extend(extents_pb(extents))


def put_allocate_result(into: pb.AllocateResult, r: api.AllocateResult, packed: bool) -> None:
    into.key, into.status, into.message = r.key, STATUS_PB[r.status], r.message
    put_extents(into, r.extents, packed)
    into.allocation = r.allocation


def put_acquire_result(into: pb.AcquireResult, r: api.AcquireResult, packed: bool) -> None:
    into.key, into.status, into.message = r.key, STATUS_PB[r.status], r.message
    if r.spec is not None:
        into.lease_id, into.checksum = r.lease_id, r.checksum
        put_extents(into, r.extents, packed)
        tensor = into.tensor
        tensor.shape.extend(r.spec.shape)
        tensor.dtype, tensor.nbytes = r.spec.dtype, r.spec.nbytes


def put_lease_result(into: pb.LeaseResult, r: api.LeaseResult) -> None:
    into.lease_id, into.status, into.message = r.lease_id, STATUS_PB[r.status], r.message


def lookup_result_pb(r: api.LookupResult) -> pb.LookupResult:
    return pb.LookupResult(key=r.key, state=STATE_PB[r.state], nbytes=r.nbytes, pins=r.pins)


def entry_info_pb(e: api.EntryInfo) -> pb.EntryInfo:
    return pb.EntryInfo(
        **mirrored(e, "state", "spec", "extents"),
        state=STATE_PB[e.state],
        tensor=spec_pb(e.spec),
        extents=extents_pb(e.extents),
    )


def mirrored(value: Any, *skip: str) -> dict[str, Any]:
    """A value's fields by name, for the message whose fields are declared to match
    (tests/unit/test_types.py), less those the message keeps elsewhere."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name not in skip}


def pool_info_pb(p: api.PoolInfo) -> pb.PoolInfo:
    # `created` and `fd_ticket` travel in OpenPoolReply
    return pb.PoolInfo(**mirrored(p, "created", "fd_ticket"))


def stats_pb(s: api.Stats) -> pb.StatsReply:
    return pb.StatsReply(
        **mirrored(s, "pools", "cluster", "refused"),
        pools=[pb.PoolStats(**mirrored(p)) for p in s.pools],
        cluster=pb.ClusterStats(**mirrored(s.cluster)) if s.cluster is not None else None,
        refused=[pb.RefusedPool(**mirrored(r)) for r in s.refused],
    )


def watch_event_pb(e: api.WatchEvent) -> pb.WatchEvent:
    return pb.WatchEvent(**mirrored(e, "type"), type=EVENT_PB[e.type])  # a slot None stays unset


def invalid_item(key: bytes, message: str) -> api.ItemResult:
    return api.ItemResult(key, api.Status.INVALID_ARGUMENT, message)


def invalid_allocate(key: bytes, message: str) -> api.AllocateResult:
    return api.AllocateResult(key, api.Status.INVALID_ARGUMENT, message, ())


def invalid_acquire(key: bytes, message: str) -> api.AcquireResult:
    return api.AcquireResult(key, api.Status.INVALID_ARGUMENT, message, 0, (), None, 0)


# ---- request bodies, parsed here --------------------------------------------------------------


class Service(Protocol):
    """What registration needs of a service: its store (errors carry its boot epoch) and a
    handler per RPC, named as the RPC."""

    store: Store


def add_to_server(service: Service, server: grpc.aio.Server) -> None:
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
