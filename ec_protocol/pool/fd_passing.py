"""Pool files handed over by the daemon: how a client of another user opens a pool it was granted.

A pool file is the daemon's alone (mode 0600) unless the operator gives a group path access
(`--pool-group`), so its bytes reach only the processes the daemon hands an open file to. It
does so on its *fd channel*, a Unix socket beside its gRPC socket (`fd_channel_path`), with the
same mode and group, as open file descriptors passed with SCM_RIGHTS (grpc cannot pass them):

- `ticket TICKET`: OpenPool's reply carries a ticket, issued only once the caller's grant on the
  pool was checked, bound to its session and to the pool's file, good for one use within a few
  seconds. The answer is a new read-write open of the file.
- `dup r` or `dup rw`, with an open file of a pool attached: a new open of the same pool file,
  read-only or read-write (read-write only for a read-write file). Whoever holds an open pool
  file has its bytes already, so another open gives nothing more; the client needs one open file
  description per holder of locks (a life mark, each set of lock pins: see slot_locks.py), made
  long after OpenPool, and so asks for one without another ticket.

Each request is one SOCK_SEQPACKET message on a connection of its own, answered by one message:
`ok`, with the file attached, or `error CODE MESSAGE` (CODE a grpc status name). The client
keeps the file the ticket bought, one per pool file per process (`receive`), and every later
open of that pool file in the process (`open_pool_file`: the mapping, lock pins, life marks) is
a `dup` of it: one exchange over a local socket, at open only, never on the hot path. A pool
file no ticket was received for (a client over TCP, a daemon without the channel, the daemon's
own process) is opened by its path.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field

# Where the channel listens: beside the gRPC socket, named after it.
CHANNEL_SUFFIX = ".fd"
# A request or an answer is one datagram this size at most.
MESSAGE_BYTES = 1024
# How long a client waits for the daemon's answer: it is answered in one step of the daemon's
# loop, so this is only the bound on a daemon that stopped answering.
EXCHANGE_TIMEOUT_S = 10.0

OK = b"ok"
TICKET = b"ticket"
DUP = b"dup"
READ_ONLY = b"r"
READ_WRITE = b"rw"


def fd_channel_path(socket_path: str | os.PathLike[str]) -> str:
    """The fd channel of the daemon listening on `socket_path`."""
    return os.fspath(socket_path) + CHANNEL_SUFFIX


class ChannelError(OSError):
    """The daemon refused a pool file (`code`: the grpc status's name it gave), or could not be
    asked (UNAVAILABLE). An OSError, as a file that cannot be opened by its path raises."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def exchange(channel: str, request: bytes, attached: int | None = None) -> int:
    """Send one request (with `attached` passed along, if given) and return the file answered;
    ChannelError if the daemon refused or could not be asked."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(EXCHANGE_TIMEOUT_S)
        try:
            sock.connect(channel)
            if attached is None:
                sock.send(request)
            else:
                socket.send_fds(sock, [request], [attached])
            # MSG_CMSG_CLOEXEC: a file received is close-on-exec, as one opened here would be.
            answer, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError as error:
            raise ChannelError(
                "UNAVAILABLE", f"cannot get a pool file from ecd's fd channel {channel}: {error}"
            ) from None
    if answer == OK and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    word, _, rest = answer.decode(errors="replace").partition(" ")
    code, _, message = rest.partition(" ")
    if word != "error" or not code:
        code, message = "UNKNOWN", f"unexpected answer {answer[:80]!r}"
    raise ChannelError(code, f"ecd's fd channel {channel} refused a pool file: {message}")


def error_answer(code: str, message: str) -> bytes:
    """The channel's answer refusing a request (the daemon's side of `exchange`): `code` is a
    grpc status's name."""
    return f"error {code} {message}".encode()[:MESSAGE_BYTES]


@dataclass
class _Received:
    """A pool file the daemon handed this process, and who holds it: the clients (their
    sessions) that opened its pool. It is closed when the last of them closes, so a process
    whose clients are all closed holds no pool file (its tmpfs can be unmounted, a dropped
    pool's pages freed); the mappings and lock holders made from it hold opens of their own."""

    pool_uuid: str
    channel: str
    fd: int
    holders: set[object] = field(default_factory=set)


class _Registry:
    """The pool files this process received, one per path: the newest pool file there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, _Received] = {}

    def find(self, path: str, pool_uuid: str) -> _Received | None:
        with self._lock:
            received = self._by_path.get(path)
            return received if received is not None and received.pool_uuid == pool_uuid else None

    def hold(self, path: str, pool_uuid: str, holder: object) -> bool:
        """Add `holder` to the file received for this pool file, if any; whether there was one."""
        with self._lock:
            received = self._by_path.get(path)
            if received is None or received.pool_uuid != pool_uuid:
                return False
            received.holders.add(holder)
            return True

    def keep(self, path: str, received: _Received) -> None:
        """Keep `received` for `path`; the file kept there before (a pool file since replaced)
        is closed, so this process holds no dropped pool's pages for it."""
        with self._lock:
            old = self._by_path.get(path)
            if old is not None and old.pool_uuid == received.pool_uuid:
                old.holders |= received.holders
                os.close(received.fd)  # another thread received it meanwhile
                return
            self._by_path[path] = received
        if old is not None:
            os.close(old.fd)

    def forget(self, path: str) -> None:
        with self._lock:
            old = self._by_path.pop(path, None)
        if old is not None:
            os.close(old.fd)

    def release(self, holder: object) -> None:
        """`holder` holds no pool file any more: close those nobody else holds."""
        with self._lock:
            for received in self._by_path.values():
                received.holders.discard(holder)
            unheld = [path for path, received in self._by_path.items() if not received.holders]
            closed = [self._by_path.pop(path) for path in unheld]
        for received in closed:
            os.close(received.fd)


_received = _Registry()


def receive(channel: str, ticket: str, path: str, pool_uuid: str, holder: object) -> None:
    """Redeem OpenPool's ticket for the pool file at `path` (`pool_uuid`), unless this process
    holds it already, and count `holder` (a client's session: its state's id) among its holders
    until `release(holder)`; ChannelError if the daemon refuses or cannot be asked."""
    if _received.hold(path, pool_uuid, holder):
        return
    fd = exchange(channel, TICKET + b" " + ticket.encode())
    _received.keep(path, _Received(pool_uuid, channel, fd, {holder}))


def forget(path: str) -> None:
    """Close the pool file received for `path`, if any (its pool was dropped)."""
    _received.forget(path)


def release(holder: object) -> None:
    """`holder` (a client's session, closing) needs no received pool file any more: close each
    one no other holder in this process needs."""
    _received.release(holder)


def open_pool_file(path: str, pool_uuid: str, writable: bool) -> int:
    """A new open file of the pool file `pool_uuid` at `path` (close-on-exec): from the daemon,
    if this process received that file, else by its path. OSError as os.open raises it, or
    ChannelError from the daemon. The caller checks the file's header: the path may hold another
    pool file by now."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
    received = _received.find(path, pool_uuid)
    if received is None:
        return os.open(path, flags)
    request = DUP + b" " + (READ_WRITE if writable else READ_ONLY)
    try:
        return exchange(received.channel, request, received.fd)
    except ChannelError as error:
        if error.code != "UNAVAILABLE":
            raise
        # The daemon is away (restarting): a process that may open the file by its path carries
        # on as it would without the channel; one that may not learns why.
        try:
            return os.open(path, flags)
        except OSError:
            raise error from None
