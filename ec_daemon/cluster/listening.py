"""The TCP sockets a process holds, read from Linux's /proc: the store's transfer engine opens its
own, and where they bind is not the daemon's to choose (docs/operations.md, Several nodes), so
the daemon looks at what it got (`listeners`; the cluster tests read the master's the same way);
and the store client's connections to its master that wait on TCP's backed-off resend
(`resending`: ec_daemon.cluster.unstall)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import NamedTuple

_LISTEN = "0A"  # st column of /proc/net/tcp: TCP_LISTEN
_OPEN = frozenset({"01", "02"})  # TCP_ESTABLISHED, TCP_SYN_SENT
WILDCARDS = frozenset({"0.0.0.0", "::"})


class Listener(NamedTuple):
    host: str  # as bound: "0.0.0.0" or "::" for every address of the host
    port: int


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address: the bytes of each 32-bit word in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def socket_fds(pid: int | str = "self") -> dict[str, int]:
    """The sockets process `pid` holds open ("self": this one): each one's inode, and a file
    descriptor of it there."""
    found = {}
    for fd in (Path("/proc") / str(pid) / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            found[target[len("socket:[") : -1]] = int(fd.name)
    return found


def socket_inodes(pid: int | str = "self") -> set[str]:
    """The inodes of the sockets process `pid` holds open ("self": this one)."""
    return set(socket_fds(pid))


def _rows(proc: Path) -> list[list[str]]:
    """Every TCP socket of the process's network namespace, a row of /proc/net/tcp{,6} each."""
    rows = []
    for table in ("tcp", "tcp6"):
        rows += [line.split() for line in (proc / "net" / table).read_text().splitlines()[1:]]
    return rows


def listeners(pid: int | str = "self", inodes: set[str] | None = None) -> set[Listener]:
    """The TCP sockets process `pid` listens on ("self": this one), of `inodes` alone if given.
    Reading the tables costs ~13 ms here (the kernel writes every TCP socket of the network
    namespace into them)."""
    proc = Path("/proc") / str(pid)
    wanted = socket_inodes(pid) if inodes is None else inodes
    found = set()
    for fields in _rows(proc):
        local, state, inode = fields[1], fields[3], fields[9]
        if state == _LISTEN and inode in wanted:
            host, port = local.split(":")
            found.add(Listener(_address(host), int(port, 16)))
    return found


def resending(host: str, port: int) -> dict[str, int]:
    """This process's TCP connections to `host` (an IP address) and `port` that wait on TCP's
    resend (each one's inode, and a file descriptor of it): bytes sent, or a connection asked
    for, that went unanswered through at least one timeout of its retransmission timer (the
    `retrnsmt` column) or of its probe timer (the `timeout` column: bytes the host itself could
    not send, as when a firewall of its own drops them, are probed for instead). Such a
    connection goes on only when its timer fires, and the timer backs off, doubling each time
    (up to 2 minutes)."""
    wanted, own = ipaddress.ip_address(host), socket_fds()
    found = {}
    for fields in _rows(Path("/proc/self")):
        remote, state, inode = fields[2], fields[3], fields[9]
        retransmits, probes = int(fields[6], 16), int(fields[8])
        if state not in _OPEN or inode not in own or retransmits + probes == 0:
            continue
        address, remote_port = remote.split(":")
        if int(remote_port, 16) == port and _same(_address(address), wanted):
            found[inode] = own[inode]
    return found


def _same(address: str, wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a table's address is `wanted` (an IPv4 address may show as IPv4-mapped IPv6)."""
    parsed = ipaddress.ip_address(address)
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped
    return parsed == wanted
