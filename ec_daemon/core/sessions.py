"""Client sessions, their leases on life, and the pins (leases on entries) they hold.

A session stays alive while its client keeps it alive (KeepAlive at least every TTL/3). When it
closes or its TTL runs out, the store aborts the PENDING entries it allocated and releases the
pins it holds, so nothing a dead client held stays held longer than one TTL.

A pin is named by a lease ID that is never reused within a daemon's life, so a late or repeated
Release cannot drop a pin that someone else took since.

A session answers only to the caller that opened it: it keeps that caller's identity
(ec_daemon.server.auth.identity: its token, its client certificate), and a call naming the
session with another identity gets exactly what a call naming no live session gets (`owned`), so
a session ID seen elsewhere (a log, a process listing) neither works nor tells whether the session
exists. Logs name a session by its `tag`, never by its ID.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ec_daemon.core.errors import Code, CoreError, Reason
from ec_daemon.core.index import Entry
from ec_protocol.types import Role

# What a session's role lets it do with entries (see Role): a consumer-only engine cannot write
# into a pool by mistake, nor an operator tool hold pins.
PRODUCE = frozenset({Role.PRODUCER, Role.BOTH})
CONSUME = frozenset({Role.CONSUMER, Role.BOTH})


@dataclass(eq=False)
class Lease:
    """One pin of one entry, held by one session."""

    id: int
    engine_id: str
    entry: Entry


def tag(session_id: str) -> str:
    """What logs call a session: a prefix of its ID's hash, enough to follow one session through
    a log, useless as the ID (which nobody can work back from it)."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:12]


@dataclass(eq=False)
class Session:
    id: str
    name: str
    pid: int
    role: Role
    expires_at: float
    owner: bytes  # the identity of the caller that opened it (ec_daemon.server.auth.identity)
    pending: set[tuple[str, bytes]] = field(default_factory=set)  # (engine_id, key) it allocated
    leases: dict[int, Lease] = field(default_factory=dict)
    pools: set[str] = field(default_factory=set)  # engine_ids it opened: an ephemeral one's holders


def unknown_session(session_id: str) -> CoreError:
    return CoreError(
        Code.NOT_FOUND,
        f"unknown session {session_id!r}: it was closed, its lease ran out, or the "
        "daemon restarted; open a new session",
        Reason.UNKNOWN_SESSION,
    )


class SessionTable:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._lease_ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def open(self, name: str, pid: int, role: Role, owner: bytes) -> Session:
        session = Session(uuid.uuid4().hex, name, pid, role, self._clock() + self.ttl_s, owner)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The live session; NOT_FOUND (reason unknown_session) if it closed or expired."""
        session = self._sessions.get(session_id)
        if session is None or session.expires_at <= self._clock():
            raise unknown_session(session_id)
        return session

    def owned(self, session_id: str, caller: bytes) -> None:
        """Raise what `get` raises for a session that is not live unless the session is live and
        `caller` opened it: another caller learns nothing, not even that the session exists."""
        if not hmac.compare_digest(self.get(session_id).owner, caller):
            raise unknown_session(session_id)

    def find(self, session_id: str) -> Session | None:
        """The session with this ID if the table still holds it, expired or not."""
        return self._sessions.get(session_id)

    def touch(self, session_id: str, may: frozenset[Role] | None = None) -> Session:
        """The live session, its lease renewed: any RPC of a session is a sign of life.

        `may`: the roles allowed to make this call (PRODUCE or CONSUME); PERMISSION_DENIED for
        a session opened with another role.
        """
        session = self.get(session_id)
        if may is not None and session.role not in may:
            allowed = " or ".join(sorted(r.value for r in may))
            raise CoreError(
                Code.PERMISSION_DENIED,
                f"session of {session.name!r} was opened with role {session.role.value}; this "
                f"call needs role {allowed}: open the session with that role",
                Reason.ROLE,
            )
        session.expires_at = self._clock() + self.ttl_s
        return session

    def remove(self, session: Session) -> None:
        """Forget a session (closed or expired); the caller first undoes what it held."""
        self._sessions.pop(session.id, None)

    def expired(self) -> list[Session]:
        now = self._clock()
        return [s for s in self._sessions.values() if s.expires_at <= now]

    def add_lease(self, session: Session, engine_id: str, entry: Entry) -> Lease:
        lease = Lease(next(self._lease_ids), engine_id, entry)
        session.leases[lease.id] = lease
        return lease

    def leases_on(self, engine_id: str) -> list[tuple[Session, Lease]]:
        return [
            (session, lease)
            for session in self._sessions.values()
            for lease in session.leases.values()
            if lease.engine_id == engine_id
        ]
