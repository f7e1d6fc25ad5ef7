"""What Client and AsyncClient share: options, channels, the retry policy, the session state.

Recovery rules, applied the same way by both clients:
- UNAVAILABLE (daemon down or restarting): retry with exponential backoff until the connect
  deadline has passed since the first failure, then raise.
- NOT_FOUND with reason unknown_session (lease ran out, or the daemon restarted): open a new
  session, reopen the pools this client had opened, tell on_restart callbacks, retry once.
- A reply whose boot epoch differs from the session's: the daemon restarted; do the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ec_client import _wire
from ec_client._proto.ecd.v1 import ecd_pb2 as pb
from ec_client.address import default_target
from ec_client.errors import EcdError
from ec_client.types import PoolInfo, Role

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a daemon restart instead of grpc's default of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS connection over TCP: the CA that signed the daemon's certificate and,
    for mutual TLS, this client's certificate and key. Defaults: ECD_TLS_CA, ECD_TLS_CERT,
    ECD_TLS_KEY."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @classmethod
    def from_env(cls) -> TLSFiles | None:
        paths = [os.environ.get(f"ECD_TLS_{name}") for name in ("CA", "CERT", "KEY")]
        if not any(paths):
            return None
        ca, cert, key = (Path(p) if p else None for p in paths)
        return cls(ca, cert, key)

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


@dataclass(frozen=True)
class Options:
    target: str
    name: str
    role: Role
    connect_timeout_s: float
    call_timeout_s: float
    metadata: tuple[tuple[str, str], ...]
    tls: TLSFiles | None = None

    @classmethod
    def make(
        cls,
        target: str | None,
        name: str | None,
        role: Role | str,
        connect_timeout_s: float,
        call_timeout_s: float,
        token: str | None,
        tls: TLSFiles | None = None,
    ) -> Options:
        token = token or os.environ.get("ECD_TOKEN") or _token_from_file()
        return cls(
            target=target or default_target(),
            name=name or f"pid-{os.getpid()}",
            role=Role(role),
            connect_timeout_s=connect_timeout_s,
            call_timeout_s=call_timeout_s,
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            tls=tls or TLSFiles.from_env(),
        )

    def unreachable(self) -> EcdError:
        return EcdError(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot reach ecd at {self.target} within {self.connect_timeout_s:g} s: is the daemon "
            "running (make run, or systemctl status ecd) and is ECD_ADDRESS right?",
        )


def _token_from_file() -> str | None:
    path = os.environ.get("ECD_TOKEN_FILE")
    return Path(path).read_text().strip() if path else None


class Backoff:
    """Delays between retries of an UNAVAILABLE call, bounded by the connect deadline."""

    def __init__(self, budget_s: float, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._deadline = clock() + budget_s
        self._delay = FIRST_BACKOFF_S

    def next_delay(self) -> float | None:
        """Seconds to wait before the next try, or None when the deadline has passed."""
        left = self._deadline - self._clock()
        if left <= 0:
            return None
        delay = min(self._delay, left)
        self._delay = min(self._delay * 2, MAX_BACKOFF_S)
        return delay


def session_lost(error: EcdError) -> bool:
    return error.code == grpc.StatusCode.NOT_FOUND and error.reason == "unknown_session"


@dataclass
class SessionState:
    """The client's view of its session, and what it must redo on a restarted daemon."""

    session_id: str = ""
    boot_epoch: str = ""
    lease_ttl_s: float = 0.0
    generation: int = 0  # bumped at every (re)open, so concurrent callers reopen only once
    pools: dict[str, _wire.Call[PoolInfo]] = field(default_factory=dict)  # replayed on reopen
    pool_infos: dict[str, PoolInfo] = field(default_factory=dict)
    on_restart: list[Callable[[str], None]] = field(default_factory=list)

    def opened(self, reply: pb.OpenSessionReply) -> None:
        self.session_id = reply.session_id
        self.boot_epoch = reply.boot_epoch
        self.lease_ttl_s = reply.lease_ttl_ms / 1000
        self.generation += 1

    def pool_opened(self, call: _wire.Call[PoolInfo], info: PoolInfo) -> None:
        self.pools[info.engine_id] = call
        self.pool_infos[info.engine_id] = info

    def pool_dropped(self, engine_id: str) -> None:
        self.pools.pop(engine_id, None)
        self.pool_infos.pop(engine_id, None)

    def pool_info(self, engine_id: str) -> PoolInfo:
        info = self.pool_infos.get(engine_id)
        if info is None:
            raise EcdError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pool {engine_id!r} was not opened by this client; call open_pool first",
            )
        return info

    def restarted(self, epoch: str) -> bool:
        return bool(self.boot_epoch) and bool(epoch) and epoch != self.boot_epoch

    def tell_restart(self) -> None:
        for callback in list(self.on_restart):
            callback(self.boot_epoch)
