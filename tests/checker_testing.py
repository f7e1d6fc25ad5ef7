"""A history of operations on a cluster under faults, and the checks run on it afterwards, as
Jepsen checks a database's (tests/cluster/test_checker.py records the history; this module is
pure: tests/unit/test_checker.py feeds it made-up histories).

An operation is recorded with its node, key, start and end (monotonic seconds) and outcome; a
value is known by its digest, and every value a writer puts is its own (derived from key, writer
and attempt), so a get's bytes name whose put they came from."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

# A wait may run past its wait_ms by this much: the Step's round trip and a remote read's end
# (the pull stops at --pull-timeout), on a loaded machine.
WAIT_SLACK_S = 3.0
# A claim is visible to other nodes once its marker is in the store: a round trip to the master
# after the Allocate, on the node's store thread (behind a publish at most).
CLAIM_VISIBLE_S = 1.0


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass(frozen=True)
class Op:
    """One operation. kind: "put" (outcome "ok", "exists"/"pending"/"no_space" for not written,
    "error" for unknown: it may have committed), "get" (outcome "value" with `value`, "none", or
    "error"), "acquire" (a Step's answer: "miss" grants the asker the encode, "pending", "hit",
    "error"), "final" (a get after healing: as a get)."""

    kind: str
    node: str
    key: str
    start: float
    end: float
    outcome: str
    value: str = ""  # the digest written (put) or read (get, final)
    wait_ms: int = 0


@dataclass(frozen=True)
class Fault:
    """A fault injected from `start` to `end`; `nodes` are those it touches ("master" included
    where the master or its links are)."""

    kind: str
    nodes: frozenset[str]
    start: float
    end: float


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    held: dict[str, set[str]] = field(default_factory=dict)  # after healing: key -> nodes READY


def _overlaps(a_start: float, a_end: float, b_start: float, b_end: float) -> bool:
    return a_start < b_end and b_start < a_end


def _writable(ops: Iterable[Op]) -> dict[str, set[str]]:
    """Per key, every value a put may have committed (those answered "ok" or "error")."""
    values: dict[str, set[str]] = {}
    for op in ops:
        if op.kind == "put" and op.outcome in ("ok", "error"):
            values.setdefault(op.key, set()).add(op.value)
    return values


def bad_reads(history: History) -> list[str]:
    """Gets that returned bytes no put under that key may have committed."""
    writable = _writable(history.ops)
    return [
        f"{op.node} read {op.key!r} as {op.value}, never put under it: {op}"
        for op in history.ops
        if op.kind in ("get", "final")
        and op.outcome == "value"
        and op.value not in writable.get(op.key, set())
    ]


def double_encodes(history: History) -> list[str]:
    """Two nodes granted one key's encode while the first one's claim was live, both nodes and
    the master untouched by any fault meanwhile: the second node's Step answered "miss" after the
    first's claim became visible (its put's start plus CLAIM_VISIBLE_S) and before its commit."""
    puts = [op for op in history.ops if op.kind == "put" and op.outcome == "ok"]
    found = []
    for asked in history.ops:
        if asked.kind != "acquire" or asked.outcome != "miss":
            continue
        for claim in puts:
            if claim.key != asked.key or claim.node == asked.node:
                continue
            visible = claim.start + CLAIM_VISIBLE_S
            if not (visible <= asked.start and asked.end <= claim.end):
                continue
            touched = {"master", claim.node, asked.node}
            if any(
                fault.nodes & touched and _overlaps(fault.start, fault.end, claim.start, asked.end)
                for fault in history.faults
            ):
                continue
            found.append(f"{asked.node} granted {asked.key!r} inside {claim.node}'s claim: {claim}")
    return found


def long_waits(history: History) -> list[str]:
    """Gets that returned later than their wait_ms plus WAIT_SLACK_S, but for those whose own
    daemon was killed meanwhile: the wait bound is the daemon's, and a get sent while its daemon
    is down waits for the restart (its client's calls wait for a connection), not on an entry."""
    killed = [f for f in history.faults if f.kind == "kill-node"]
    return [
        f"{op.node}'s get of {op.key!r} took {op.end - op.start:.2f} s for a wait of "
        f"{op.wait_ms} ms"
        for op in history.ops
        if op.kind == "get"
        and op.outcome != "error"
        and op.end - op.start > op.wait_ms / 1000 + WAIT_SLACK_S
        and not any(
            op.node in f.nodes and _overlaps(f.start, f.end, op.start, op.end) for f in killed
        )
    ]


def unreadable(history: History, nodes: Iterable[str]) -> list[str]:
    """Entries some node held after healing that a node's final get did not read."""
    read = {(op.node, op.key) for op in history.ops if op.kind == "final" and op.outcome == "value"}
    return [
        f"{key!r}, held by {sorted(holders)}, not read from {node}"
        for key, holders in sorted(history.held.items())
        if holders
        for node in nodes
        if (node, key) not in read
    ]


def violations(history: History, nodes: Iterable[str]) -> list[str]:
    return [
        *bad_reads(history),
        *double_encodes(history),
        *long_waits(history),
        *unreadable(history, list(nodes)),
    ]
