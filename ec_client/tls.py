"""TLSFiles: the PEM files of a TLS connection over TCP, shared by clients and by the daemon
calling its peers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc


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
