"""The eviction policies alone: the order in which they propose victims."""

from __future__ import annotations

import pytest

from ec_daemon.eviction import POLICIES, FIFOPolicy, LRUPolicy


def test_fifo_proposes_in_commit_order_whatever_was_hit() -> None:
    policy = FIFOPolicy()
    for key in (b"a", b"b", b"c"):
        policy.on_ready(key)
    policy.on_access(b"a")
    assert list(policy.candidates()) == [b"a", b"b", b"c"]


def test_lru_proposes_the_least_recently_committed_or_hit_first() -> None:
    policy = LRUPolicy()
    for key in (b"a", b"b", b"c"):
        policy.on_ready(key)
    policy.on_access(b"a")
    assert list(policy.candidates()) == [b"b", b"c", b"a"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_removed_key_is_never_proposed(name: str) -> None:
    policy = POLICIES[name]()
    policy.on_ready(b"a")
    policy.on_ready(b"b")
    policy.on_removed(b"a")
    policy.on_removed(b"never-there")  # removing an unknown key is harmless
    assert list(policy.candidates()) == [b"b"]
