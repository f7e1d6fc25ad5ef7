"""The checks the cluster's fault runs end with (tests/checker_testing.py), on made-up histories:
each finds what it is for and nothing in a history that breaks no guarantee."""

from __future__ import annotations

from checker_testing import (
    CLAIM_VISIBLE_S,
    WAIT_SLACK_S,
    Fault,
    History,
    Op,
    bad_reads,
    double_encodes,
    long_waits,
    unreadable,
    violations,
)

NODES = ("n1", "n2", "n3")


def put(
    node: str, key: str, value: str, start: float = 0.0, end: float = 0.1, outcome: str = "ok"
) -> Op:
    return Op("put", node, key, start, end, outcome, value)


def got(node: str, key: str, value: str = "", kind: str = "get", wait_ms: int = 0) -> Op:
    return Op(kind, node, key, 1.0, 1.1, "value" if value else "none", value, wait_ms)


def test_a_get_may_return_nothing_or_any_value_put_under_its_key_even_by_a_put_that_failed() -> (
    None
):
    history = History(
        [
            put("n1", "a", "v1"),
            put("n2", "a", "v2", outcome="error"),  # its daemon died: it may have committed
            got("n3", "a", "v1"),
            got("n3", "a", "v2"),
            got("n3", "a"),
        ]
    )
    assert bad_reads(history) == []


def test_a_get_returning_bytes_never_put_under_its_key_is_a_violation() -> None:
    history = History(
        [
            put("n1", "a", "v1"),
            put("n1", "b", "v2"),
            put("n1", "c", "v3", outcome="exists"),  # not written: the key was there
            got("n2", "a", "v2"),  # another key's bytes
            got("n2", "c", "v3"),
            got("n2", "a", "torn"),
        ]
    )
    assert len(bad_reads(history)) == 3


def test_an_encode_granted_inside_another_nodes_visible_claim_is_a_violation() -> None:
    claim = put("n1", "k", "v1", start=0.0, end=CLAIM_VISIBLE_S + 2.0)
    asked = Op("acquire", "n2", "k", CLAIM_VISIBLE_S + 0.5, CLAIM_VISIBLE_S + 0.6, "miss")
    assert len(double_encodes(History([claim, asked]))) == 1


def test_an_encode_granted_before_the_claim_was_visible_or_after_it_ended_is_none() -> None:
    claim = put("n1", "k", "v1", start=0.0, end=CLAIM_VISIBLE_S + 2.0)
    early = Op("acquire", "n2", "k", 0.1, 0.2, "miss")  # both asked at once: counted claims_lost
    late = Op("acquire", "n3", "k", CLAIM_VISIBLE_S + 2.5, CLAIM_VISIBLE_S + 2.6, "miss")
    waited = Op("acquire", "n3", "k", CLAIM_VISIBLE_S + 0.5, CLAIM_VISIBLE_S + 0.6, "pending")
    assert double_encodes(History([claim, early, late, waited])) == []


def test_an_encode_granted_while_a_fault_cut_either_node_or_the_master_is_none() -> None:
    claim = put("n1", "k", "v1", start=0.0, end=CLAIM_VISIBLE_S + 2.0)
    asked = Op("acquire", "n2", "k", CLAIM_VISIBLE_S + 0.5, CLAIM_VISIBLE_S + 0.6, "miss")
    for touched in ({"n1"}, {"n2", "master"}, {"master"}):
        cut = Fault("cut-master", frozenset(touched), 0.5, 0.8)
        assert double_encodes(History([claim, asked], [cut])) == []
    elsewhere = Fault("cut-node", frozenset({"n3"}), 0.5, 0.8)
    assert len(double_encodes(History([claim, asked], [elsewhere]))) == 1


def test_a_wait_that_outlived_its_bound_is_a_violation_and_one_within_it_is_none() -> None:
    within = Op("get", "n1", "a", 0.0, 1.0 + WAIT_SLACK_S - 0.1, "none", "", 1000)
    beyond = Op("get", "n1", "a", 0.0, 1.0 + WAIT_SLACK_S + 0.1, "none", "", 1000)
    failed = Op("get", "n1", "a", 0.0, 60.0, "error", "", 1000)  # its daemon killed under it
    assert long_waits(History([within, failed])) == []
    assert len(long_waits(History([beyond]))) == 1


def test_a_get_held_across_its_own_daemons_kill_is_no_long_wait_and_one_elsewhere_is() -> None:
    beyond = Op("get", "n1", "a", 0.0, 1.0 + WAIT_SLACK_S + 2.0, "none", "", 1000)
    own = Fault("kill-node", frozenset({"n1"}), 0.5, 2.0)
    other = Fault("kill-node", frozenset({"n2"}), 0.5, 2.0)
    cut = Fault("cut-master", frozenset({"n1", "master"}), 0.5, 2.0)
    assert long_waits(History([beyond], [own])) == []
    assert len(long_waits(History([beyond], [other, cut]))) == 1


def test_an_entry_held_after_healing_must_be_read_on_every_node() -> None:
    history = History(
        [
            put("n1", "a", "v1"),
            got("n1", "a", "v1", "final"),
            got("n2", "a", "v1", "final"),
            got("n3", "a", kind="final"),
        ],
        held={"a": {"n1"}},
    )
    assert unreadable(history, NODES) == ["'a', held by ['n1'], not read from n3"]


def test_a_history_that_breaks_no_guarantee_has_no_violations() -> None:
    history = History(
        [put("n1", "a", "v1"), got("n2", "a", "v1"), got("n3", "b")]
        + [got(node, "a", "v1", "final") for node in NODES],
        [Fault("kill-node", frozenset({"n2"}), 0.0, 0.5)],
        held={"a": {"n1", "n2"}},
    )
    assert violations(history, NODES) == []
