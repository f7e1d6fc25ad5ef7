"""How clients reach the daemon: options (target, name, role, timeouts, token, TLS) and the
channel options. The rules for each call live in `_session`."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from ec_client.address import default_target
from ec_client.errors import EcdError
from ec_client.types import Role

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a daemon restart instead of grpc's default of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


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
        from_env: bool = True,
    ) -> Options:
        """from_env: a token or TLS files not given come from ECD_TOKEN, ECD_TOKEN_FILE and
        ECD_TLS_*. Not for a daemon calling its peers: its own settings share those names."""
        if from_env:
            token = token or os.environ.get("ECD_TOKEN") or _token_from_file()
            tls = tls or TLSFiles.from_env()
        return cls(
            target=target or default_target(),
            name=name or f"pid-{os.getpid()}",
            role=Role(role),
            connect_timeout_s=connect_timeout_s,
            call_timeout_s=call_timeout_s,
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            tls=tls,
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


_channels: dict[tuple[int, str, TLSFiles | None], grpc.Channel] = {}
_channels_lock = threading.Lock()


def shared_channel(options: Options) -> grpc.Channel:
    """The process's channel to this target: one per target per process (a forked child gets
    its own), so every Client in a process shares its connection."""
    key = (os.getpid(), options.target, options.tls)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            channel = _channels[key] = (
                grpc.insecure_channel(options.target, options=CHANNEL_OPTIONS)
                if options.tls is None
                else grpc.secure_channel(
                    options.target, options.tls.credentials(), options=CHANNEL_OPTIONS
                )
            )
        return channel


def aio_channel(options: Options) -> grpc.aio.Channel:
    """A new grpc.aio channel: these belong to the event loop that made them, so each
    AsyncClient owns one."""
    if options.tls is None:
        return grpc.aio.insecure_channel(options.target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(
        options.target, options.tls.credentials(), options=CHANNEL_OPTIONS
    )
