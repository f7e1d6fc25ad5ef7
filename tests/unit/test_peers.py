"""PeerDirectory and peer addresses, pure: events and lookups given by hand."""

from __future__ import annotations

import pytest
from peer_testing import holders

from ec_client import EventType, PoolInfo, WatchEvent
from ec_daemon.peers import PeerDirectory, PeerEntry, PeerState, peer_addresses

A, B = "10.0.0.1:7878", "10.0.0.2:7878"


def event(kind: EventType, key: bytes = b"", pool: str = "vl", epoch: str = "e1") -> WatchEvent:
    return WatchEvent(kind, pool, key, 16, epoch)


def apply(directory: PeerDirectory, address: str, event: WatchEvent) -> None:
    """The event applied, its pool attached and readable (a follower attaches each pool of a
    peer it hears of, and holders() counts only those)."""
    directory.apply(address, event)
    if directory.needs_pool(address, event.engine_id):
        directory.attached(address, event.engine_id, readable(event.engine_id))


def readable(engine_id: str) -> PoolInfo:
    return PoolInfo(engine_id, "", 16, 64, 0, 0, "", "", 64, False)


def following(*addresses: str, epoch: str = "e1") -> PeerDirectory:
    directory = PeerDirectory()
    for address in addresses:
        directory.add(address)
        directory.opened(address, epoch)
    return directory


def state(directory: PeerDirectory, address: str) -> PeerState:
    return next(v.state for v in directory.views() if v.address == address)


# ---- addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "entry"),
    [
        ("10.0.0.7:7878", PeerEntry("10.0.0.7", 7878)),
        ("[fd00::7]:7878", PeerEntry("fd00::7", 7878)),
        (" ecd.ecd.svc.cluster.local:7878 ", PeerEntry("ecd.ecd.svc.cluster.local", 7878)),
    ],
)
def test_peer_entries_parse_ipv4_ipv6_and_names(text: str, entry: PeerEntry) -> None:
    assert PeerEntry.parse(text) == entry


@pytest.mark.parametrize("text", ["node1", "node1:", ":7878", "node1:0", "node1:65536", "n:x"])
def test_a_malformed_peer_entry_is_refused_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not HOST:PORT \(e\.g\. 10\.0\.0\.7:7878"):
        PeerEntry.parse(text)


def test_a_name_counts_one_peer_per_address_it_resolves_to_and_ips_count_as_given() -> None:
    entries = [PeerEntry("ecd-peers", 7878), PeerEntry("10.0.0.9", 7000), PeerEntry("fd00::1", 1)]
    lookups = {"ecd-peers": ["10.0.0.1", "10.0.0.2", "fd00::2"]}
    assert peer_addresses(entries, lookups, own=()) == {
        "10.0.0.1:7878",
        "10.0.0.2:7878",
        "[fd00::2]:7878",
        "10.0.0.9:7000",
        "[fd00::1]:1",
    }


def test_this_daemons_own_address_is_not_a_peer() -> None:
    entries = [PeerEntry("ecd-peers", 7878)]
    lookups = {"ecd-peers": ["10.0.0.1", "10.0.0.2"]}
    assert peer_addresses(entries, lookups, own=["10.0.0.2:7878"]) == {"10.0.0.1:7878"}


def test_a_name_not_resolved_yet_contributes_no_peer() -> None:
    entries = [PeerEntry("ecd-peers", 7878), PeerEntry("10.0.0.9", 7878)]
    assert peer_addresses(entries, {}, own=()) == {"10.0.0.9:7878"}


# ---- the directory -------------------------------------------------------------------------------


def test_snapshot_and_committed_keys_are_held_and_evicted_aborted_deleted_ones_are_not() -> None:
    d = following(A)
    for kind, key in [
        (EventType.SNAPSHOT, b"s"),
        (EventType.SYNCED, b""),
        *[(EventType.COMMITTED, k) for k in (b"c", b"e", b"x")],
        (EventType.EVICTED, b"e"),
        (EventType.DELETED, b"x"),
        (EventType.ABORTED, b"never-ready"),
    ]:
        apply(d, A, event(kind, key))
    assert {k for k in (b"s", b"c", b"e", b"x", b"never-ready") if holders(d, "vl", k)} == {
        b"s",
        b"c",
    }
    assert state(d, A) is PeerState.SYNCED


def test_keys_are_known_per_pool() -> None:
    d = following(A)
    apply(d, A, event(EventType.COMMITTED, b"k", pool="vl"))
    assert holders(d, "vl", b"k") == [A]
    assert holders(d, "other", b"k") == []


def test_holders_lists_every_peer_holding_the_key() -> None:
    d = following(A, B)
    apply(d, A, event(EventType.COMMITTED, b"both"))
    apply(d, B, event(EventType.SNAPSHOT, b"both"))
    apply(d, B, event(EventType.SNAPSHOT, b"b-only"))
    assert sorted(holders(d, "vl", b"both")) == [A, B]
    assert holders(d, "vl", b"b-only") == [B]


def test_keys_seen_during_the_snapshot_are_held_before_it_ends() -> None:
    d = following(A)
    apply(d, A, event(EventType.SNAPSHOT, b"k"))
    assert state(d, A) is PeerState.SYNCING
    assert holders(d, "vl", b"k") == [A]


def test_a_broken_stream_forgets_that_peers_keys_only() -> None:
    d = following(A, B)
    apply(d, A, event(EventType.COMMITTED, b"k"))
    apply(d, B, event(EventType.COMMITTED, b"k"))
    d.broken(A, "connection reset")
    assert holders(d, "vl", b"k") == [B]
    [view] = [v for v in d.views() if v.address == A]
    assert (view.state, view.keys, view.error) == (PeerState.DOWN, 0, "connection reset")


def test_a_peer_followed_again_no_longer_shows_what_broke_it_before() -> None:
    d = following(A)
    d.broken(A, "Connection refused")
    d.opened(A, "e2")
    d.apply(A, event(EventType.SYNCED, epoch="e2"))
    [view] = d.views()
    assert (view.state, view.error) == (PeerState.SYNCED, "")


def test_events_from_a_stream_that_broke_are_ignored_until_a_new_one_opens() -> None:
    d = following(A)
    d.broken(A, "reset")
    apply(d, A, event(EventType.COMMITTED, b"late"))
    assert holders(d, "vl", b"late") == []
    d.opened(A, "e1")
    apply(d, A, event(EventType.SNAPSHOT, b"late"))
    assert holders(d, "vl", b"late") == [A]


def test_a_new_boot_epoch_forgets_what_the_old_daemon_held() -> None:
    d = following(A, epoch="old")
    apply(d, A, event(EventType.COMMITTED, b"k", epoch="old"))
    apply(d, A, event(EventType.COMMITTED, b"k2", epoch="new"))
    assert holders(d, "vl", b"k") == []
    assert holders(d, "vl", b"k2") == [A]
    assert d.views()[0].boot_epoch == "new"


def test_reopening_to_a_restarted_peer_forgets_its_old_keys() -> None:
    d = following(A, epoch="old")
    apply(d, A, event(EventType.COMMITTED, b"k", epoch="old"))
    d.opened(A, "new")
    assert holders(d, "vl", b"k") == []


def test_a_dropped_pool_forgets_its_keys_and_no_other() -> None:
    d = following(A)
    apply(d, A, event(EventType.COMMITTED, b"k", pool="vl"))
    apply(d, A, event(EventType.COMMITTED, b"k", pool="kept"))
    apply(d, A, event(EventType.POOL_DROPPED, pool="vl"))
    assert holders(d, "vl", b"k") == []
    assert holders(d, "kept", b"k") == [A]


def test_an_address_found_to_be_this_daemon_holds_nothing() -> None:
    d = following(A)
    apply(d, A, event(EventType.COMMITTED, b"k"))
    d.opened(A, "mine", is_self=True)
    apply(d, A, event(EventType.COMMITTED, b"k2", epoch="mine"))
    assert holders(d, "vl", b"k") == holders(d, "vl", b"k2") == []
    assert state(d, A) is PeerState.SELF


def test_a_removed_peer_is_gone_from_views_and_holders() -> None:
    d = following(A, B)
    apply(d, A, event(EventType.COMMITTED, b"k"))
    d.remove(A)
    apply(d, A, event(EventType.COMMITTED, b"k2"))
    assert [v.address for v in d.views()] == [B]
    assert holders(d, "vl", b"k") == holders(d, "vl", b"k2") == []


def test_views_report_state_epoch_and_key_counts_across_pools() -> None:
    d = following(A, epoch="ep-a")
    d.add(B)
    for pool, key in [("p1", b"a"), ("p1", b"b"), ("p2", b"a")]:
        apply(d, A, event(EventType.SNAPSHOT, key, pool=pool, epoch="ep-a"))
    views = {v.address: (v.state, v.boot_epoch, v.keys) for v in d.views()}
    assert views == {A: (PeerState.SYNCING, "ep-a", 3), B: (PeerState.CONNECTING, "", 0)}
