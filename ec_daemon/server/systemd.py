"""The two pieces of systemd's protocol the daemon speaks: sd_notify and the watchdog interval.

Both are no-ops outside systemd (no NOTIFY_SOCKET), so the daemon runs the same everywhere.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to systemd; False when not run by systemd with Type=notify."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1 (half of WatchdogSec), or None when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
