"""The fd channel: pool files handed to the clients granted them, as open files.

Pool files are the daemon's (mode 0600, unless `--pool-group` gives a group path access to all
of them), so a client of another user maps a pool through an open file the daemon passes it
(SCM_RIGHTS) on this Unix socket beside the gRPC one: gRPC cannot pass files. The protocol and
the client's side are ec_protocol/pool/fd_passing.py. What guards a pool's bytes:

- OpenPool issues a ticket (`Tickets`) only after the caller's token passed the pool's access
  list, and only to a caller on the Unix socket; it is bound to the session and the pool's file
  (its UUID), good once and for TICKET_TTL_S. Redeemed, it buys a read-write open of the file if
  the session is still live, holds the pool, and the file is still the pool's.
- A `dup` request must come with an open file of a current pool file: whoever holds one has the
  file's bytes already. It buys another open of the same file, read-write only for a read-write
  one.

It runs on the daemon's loop, never blocking it: one request per connection, each read when the
loop says it is readable; an answer is one small datagram on a fresh connection, whose send
buffer always has room for it, so sending it never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ec_daemon.core.errors import CoreError
from ec_daemon.core.store import Store
from ec_protocol.pool import fd_passing

log = logging.getLogger("ecd.fd_channel")

# How long a ticket may wait to be redeemed: the client redeems it as the reply arrives.
TICKET_TTL_S = 10.0
# How long a connection may take to send its request before it is closed unanswered.
REQUEST_TIMEOUT_S = 5.0
# How long to wait before accepting again after accept failed (no file descriptor left).
ACCEPT_RETRY_S = 0.1


@dataclass(frozen=True)
class Ticket:
    expires_at: float
    session_id: str
    engine_id: str
    pool_uuid: str


class Tickets:
    """The tickets issued and not yet redeemed nor expired (expired ones are forgotten at each
    issue and redemption: they are kept in the order they expire)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, ttl_s: float = TICKET_TTL_S
    ) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._issued: dict[str, Ticket] = {}

    def issue(self, session_id: str, engine_id: str, pool_uuid: str) -> str:
        """A new ticket for this session to the pool's file (its grant checked)."""
        now = self._expire()
        ticket = secrets.token_urlsafe(24)
        self._issued[ticket] = Ticket(now + self._ttl_s, session_id, engine_id, pool_uuid)
        return ticket

    def redeem(self, ticket: str) -> Ticket | None:
        """What the ticket was issued for, once; None if it never was, was redeemed, or
        expired."""
        self._expire()
        return self._issued.pop(ticket, None)

    def _expire(self) -> float:
        now = self._clock()
        while self._issued:
            first = next(iter(self._issued))
            if self._issued[first].expires_at > now:
                break
            del self._issued[first]
        return now

    def __len__(self) -> int:
        return len(self._issued)


def answer(store: Store, tickets: Tickets, request: bytes, fds: list[int]) -> int:
    """The open file a request buys; CoreError, or ValueError for a request not understood or
    not allowed, saying why not."""
    word, _, argument = request.partition(b" ")
    if word == fd_passing.TICKET and not fds:
        issued = tickets.redeem(argument.decode(errors="replace"))
        if issued is None:
            raise ValueError("unknown ticket: it was never issued, was used, or expired")
        return store.open_pool_file(issued.session_id, issued.engine_id, issued.pool_uuid)
    if word == fd_passing.DUP and len(fds) == 1:
        if argument not in (fd_passing.READ_ONLY, fd_passing.READ_WRITE):
            raise ValueError(f"a dup asks for r or rw, not {argument[:20]!r}")
        writable = argument == fd_passing.READ_WRITE
        if writable and fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            raise ValueError("a read-write open needs a read-write file attached")
        held = os.fstat(fds[0])
        return store.open_pool_file_again((held.st_dev, held.st_ino), writable)
    raise ValueError("expected `ticket TICKET`, or `dup r` or `dup rw` with one file attached")


async def readable(sock: socket.socket) -> None:
    """Until the loop finds `sock` readable (a connection waiting, a request arrived)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


class FdChannel:
    """The listening channel and the connections it serves."""

    def __init__(self, store: Store, tickets: Tickets, path: Path, listener: socket.socket) -> None:
        self.store = store
        self.tickets = tickets
        self.path = path
        self._listener = listener
        self._served: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.create_task(self._accept())

    @classmethod
    def listen(
        cls, store: Store, socket_path: Path, mode: int, gid: int | None
    ) -> FdChannel | None:
        """The channel beside the gRPC socket `socket_path`, with its mode and group; None, and
        a warning, where it cannot listen (clients then open pool files by their paths)."""
        path = Path(fd_passing.fd_channel_path(socket_path))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # we hold the socket lock: a dead daemon's channel
            listener.bind(str(path))
            os.chmod(path, mode)
            if gid is not None:
                os.chown(path, -1, gid)
            listener.listen(64)
            listener.setblocking(False)
        except OSError as error:
            listener.close()
            log.warning(
                "no fd channel: clients that may not open pool files by their paths cannot map "
                "them",
                extra={"path": str(path), "error": str(error)},
            )
            return None
        return cls(store, Tickets(), path, listener)

    async def close(self) -> None:
        """Stop serving, remove the channel's socket."""
        tasks = [self._accepting, *self._served]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()
        self.path.unlink(missing_ok=True)

    async def _accept(self) -> None:
        while True:
            await readable(self._listener)
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as error:  # out of file descriptors: the next try may succeed
                log.warning("fd channel: accept failed", extra={"error": str(error)})
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._served.add(task)
            task.add_done_callback(self._served.discard)

    async def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setblocking(False)
            try:
                await asyncio.wait_for(readable(conn), REQUEST_TIMEOUT_S)
                request, fds, _, _ = socket.recv_fds(
                    conn, fd_passing.MESSAGE_BYTES, 1, socket.MSG_CMSG_CLOEXEC
                )
            except (OSError, TimeoutError) as error:
                log.debug("fd channel: no request read", extra={"error": str(error)})
                return
            try:
                self._reply(conn, request, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _reply(self, conn: socket.socket, request: bytes, fds: list[int]) -> None:
        try:
            fd = answer(self.store, self.tickets, request, fds)
        except CoreError as error:
            reply = fd_passing.error_answer(error.code.value, error.message)
        except ValueError as error:
            reply = fd_passing.error_answer("PERMISSION_DENIED", str(error))
        except OSError as error:  # the attached file could not be looked at
            reply = fd_passing.error_answer("INVALID_ARGUMENT", str(error))
        else:
            try:
                socket.send_fds(conn, [fd_passing.OK], [fd])
            except OSError as error:  # the client went away
                log.debug("fd channel: answer not sent", extra={"error": str(error)})
            finally:
                os.close(fd)
            return
        with contextlib.suppress(OSError):
            conn.send(reply)
