"""Errors and per-item outcomes of the core, free of gRPC: the service maps them to status codes."""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Why a whole request failed; each value names the gRPC status code it becomes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"


class Reason(enum.Enum):
    """A machine-readable refinement of a Code that clients act on (sent as trailing metadata)."""

    UNKNOWN_SESSION = "unknown_session"
    UNKNOWN_POOL = "unknown_pool"
    POOL_DROPPED = "pool_dropped"  # dropped while this client held it: only OpenPool makes it anew
    POOL_MISMATCH = "pool_mismatch"
    POOL_UNVERIFIED = "pool_unverified"
    BUDGET = "budget"
    SHM_FULL = "shm_full"
    BAD_REQUEST = "bad_request"
    ROLE = "role"  # the session's role does not allow the call
    SHUTTING_DOWN = "shutting_down"  # the daemon stopped during the call; nothing was applied


class CoreError(Exception):
    """A request the core refuses as a whole; the message says what was wrong and what was
    expected."""

    def __init__(self, code: Code, message: str, reason: Reason = Reason.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
