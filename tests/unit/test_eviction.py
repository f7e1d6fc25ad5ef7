"""The eviction policies alone: the order in which they propose victims."""

from __future__ import annotations

import pytest

from ec_daemon.core.eviction import POLICIES, FIFOPolicy, LRUPolicy


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


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_keys_ready_at_once_line_up_as_they_would_one_by_one(name: str) -> None:
    one_by_one, at_once = POLICIES[name](), POLICIES[name]()
    for policy in (one_by_one, at_once):
        policy.on_ready(b"b")
        policy.on_ready(b"z")
        policy.on_access(b"b")
    keys = [b"c", b"a", b"b", b"d"]  # b already in line: it keeps its place
    for key in keys:
        one_by_one.on_ready(key)
    at_once.on_ready_many(iter(keys))
    assert list(at_once.candidates()) == list(one_by_one.candidates())
    at_once.on_access(b"c")
    one_by_one.on_access(b"c")
    assert list(at_once.candidates()) == list(one_by_one.candidates())
