"""The TCP sockets a process listens on, read from Linux's /proc: the store's transfer engine
opens its own, and where they bind is not the daemon's to choose (docs/operations.md, Several
nodes), so the daemon looks at what it got. The cluster tests read the master's the same way."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import NamedTuple

_LISTEN = "0A"  # st column of /proc/net/tcp: TCP_LISTEN
WILDCARDS = frozenset({"0.0.0.0", "::"})


class Listener(NamedTuple):
    host: str  # as bound: "0.0.0.0" or "::" for every address of the host
    port: int


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address: the bytes of each 32-bit word in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(pid: int | str = "self") -> set[Listener]:
    """The TCP sockets process `pid` holds open in the listening state ("self": this one)."""
    proc = Path("/proc") / str(pid)
    inodes = set()
    for fd in (proc / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        lines = (proc / "net" / table).read_text().splitlines()[1:]
        for fields in (line.split() for line in lines):
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                host, port = local.split(":")
                found.add(Listener(_address(host), int(port, 16)))
    return found
