"""The values of ec_protocol.types against their protobuf messages: each is declared once, so the
two must agree field for field wherever they are mapped by name."""

from __future__ import annotations

import dataclasses

from ec_client.control import _wire
from ec_daemon.server import wire
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.types import (
    EntryInfo,
    EntryState,
    EventType,
    PoolInfo,
    PoolStats,
    RefusedPool,
    Role,
    Stats,
    Status,
    WatchEvent,
)


def fields(value: type) -> set[str]:
    return {f.name for f in dataclasses.fields(value)}


def test_pool_stats_has_exactly_the_fields_of_its_message() -> None:
    assert fields(PoolStats) == set(pb.PoolStats.DESCRIPTOR.fields_by_name)


def test_watch_event_has_exactly_the_fields_of_its_message() -> None:
    assert fields(WatchEvent) == set(pb.WatchEvent.DESCRIPTOR.fields_by_name)


def test_a_watch_event_crosses_the_wire_unchanged_with_or_without_its_slot() -> None:
    for slot in (None, 0, 7):
        event = WatchEvent(EventType.COMMITTED, "pool", b"key", 64, "epoch", slot=slot)
        assert _wire.watch_event(wire.watch_event_pb(event)) == event


def test_entry_info_has_the_fields_of_its_message_with_spec_for_tensor() -> None:
    assert fields(EntryInfo) == set(pb.EntryInfo.DESCRIPTOR.fields_by_name) - {"tensor"} | {"spec"}


def test_stats_has_the_fields_of_its_reply() -> None:
    assert fields(Stats) == set(pb.StatsReply.DESCRIPTOR.fields_by_name)


def test_refused_pool_has_exactly_the_fields_of_its_message() -> None:
    assert fields(RefusedPool) == set(pb.RefusedPool.DESCRIPTOR.fields_by_name)


def test_pool_info_has_the_fields_of_its_message_and_what_its_open_pool_answered() -> None:
    assert fields(PoolInfo) == set(pb.PoolInfo.DESCRIPTOR.fields_by_name) | {
        "created",
        "fd_ticket",
    }


def test_every_enum_value_has_its_wire_value_and_back() -> None:
    for values, prefix, enum in (
        (Status, "ITEM_", pb.ItemStatus),
        (EntryState, "ENTRY_", pb.EntryState),
        (EventType, "EVENT_", pb.EventType),
        (Role, "ROLE_", pb.Role),
    ):
        wire = [n for n in enum.DESCRIPTOR.values_by_name if not n.endswith("UNSPECIFIED")]
        names = {n.removeprefix(prefix) for n in wire}
        assert names == {v.name for v in values}, enum
    assert set(_wire.STATUS.values()) == set(Status)
    assert set(_wire.EVENT.values()) == set(EventType)
