"""Where the daemon listens by default, shared by the daemon and its clients.

The daemon takes the first usable directory of: /run/ecd (systemd's RuntimeDirectory=ecd),
$XDG_RUNTIME_DIR/ecd, /tmp/ecd-<uid>. A client, unless ECD_ADDRESS says otherwise, connects to the
first of those sockets that exists, so a development daemon and its clients meet without any
configuration.
"""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "ecd.sock"


def socket_dirs() -> list[Path]:
    dirs = [Path("/run/ecd")]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        dirs.append(Path(runtime) / "ecd")
    dirs.append(Path(f"/tmp/ecd-{os.getuid()}"))
    return dirs


def daemon_socket_path() -> Path:
    """The socket a daemon started without --socket listens on (its directory may need creating)."""
    for directory in socket_dirs():
        if directory.is_dir() and os.access(directory, os.W_OK | os.X_OK):
            return directory / SOCKET_NAME
        if directory.parent.is_dir() and os.access(directory.parent, os.W_OK | os.X_OK):
            return directory / SOCKET_NAME
    return socket_dirs()[-1] / SOCKET_NAME


def default_target() -> str:
    """ECD_ADDRESS, else the first default socket that exists, else where a daemon would listen."""
    address = os.environ.get("ECD_ADDRESS")
    if address:
        return address
    for directory in socket_dirs():
        if (directory / SOCKET_NAME).exists():
            return f"unix://{directory / SOCKET_NAME}"
    return f"unix://{daemon_socket_path()}"
