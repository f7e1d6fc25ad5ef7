"""EcdError: every failure the client library reports, with the gRPC status code and the
daemon's message (which says what was wrong and what was expected)."""

from __future__ import annotations

from typing import Any

import grpc


class EcdError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason  # the daemon's ecd-reason, e.g. "unknown_session"; "" if none

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> EcdError:
        # Sync errors are grpc.Call objects, aio errors are AioRpcError: both have these methods.
        call: Any = error
        code = call.code() if hasattr(call, "code") else grpc.StatusCode.UNKNOWN
        details = (call.details() if hasattr(call, "details") else None) or str(error)
        metadata = (call.trailing_metadata() if hasattr(call, "trailing_metadata") else None) or ()
        reason = next((str(v) for k, v in metadata if k == "ecd-reason"), "")
        return cls(code, details, reason)

    @classmethod
    def copy_failed(cls, key: object, cause: BaseException) -> EcdError:
        """A copy between a tensor and the pool failed (a device error): the entry is not
        written (a save is aborted) or not read (a load's pin is released)."""
        return cls(grpc.StatusCode.DATA_LOSS, f"copy of {key!r} failed: {cause}", "copy_failed")
