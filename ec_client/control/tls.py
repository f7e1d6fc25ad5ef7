"""TLSFiles: the PEM files of a client's TLS connection over TCP."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

StrPath = str | os.PathLike[str]


def _path(value: StrPath | None) -> Path | None:
    return None if value is None else Path(value)


@dataclass(frozen=True, init=False)
class TLSFiles:
    """PEM files for a TLS connection over TCP: the CA that signed the daemon's certificate and,
    for mutual TLS, this client's certificate and key, each a str or path-like. Defaults:
    ECD_TLS_CA, ECD_TLS_CERT, ECD_TLS_KEY.

    Held as Paths, so that files named by a str and by a Path are the same TLSFiles (and share
    a channel)."""

    ca: Path | None
    cert: Path | None
    key: Path | None

    def __init__(
        self, ca: StrPath | None = None, cert: StrPath | None = None, key: StrPath | None = None
    ) -> None:
        object.__setattr__(self, "ca", _path(ca))
        object.__setattr__(self, "cert", _path(cert))
        object.__setattr__(self, "key", _path(key))

    @classmethod
    def from_env(cls) -> TLSFiles | None:
        paths = [os.environ.get(f"ECD_TLS_{name}") for name in ("CA", "CERT", "KEY")]
        if not any(paths):
            return None
        ca, cert, key = (p or None for p in paths)
        return cls(ca, cert, key)

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))
