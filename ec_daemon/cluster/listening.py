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


def socket_inodes(pid: int | str = "self") -> set[str]:
    """The inodes of the sockets process `pid` holds open ("self": this one)."""
    inodes = set()
    for fd in (Path("/proc") / str(pid) / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listeners(pid: int | str = "self", inodes: set[str] | None = None) -> set[Listener]:
    """The TCP sockets process `pid` listens on ("self": this one), of `inodes` alone if given.
    Reading the tables costs ~13 ms here (the kernel writes every TCP socket of the network
    namespace into them)."""
    proc = Path("/proc") / str(pid)
    wanted = socket_inodes(pid) if inodes is None else inodes
    found = set()
    for table in ("tcp", "tcp6"):
        lines = (proc / "net" / table).read_text().splitlines()[1:]
        for fields in (line.split() for line in lines):
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in wanted:
                host, port = local.split(":")
                found.add(Listener(_address(host), int(port, 16)))
    return found
