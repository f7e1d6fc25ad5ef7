"""Life marks: how the daemon sees at once that a client's process died, without waiting out
its lease (docs/design.md §4, *Single flight*).

A client holds a shared open-file-description lock (`F_OFD_SETLK`, as lock pins do:
ec_protocol/pool/slot_locks.py) on one byte of each pool file it opened, at an offset computed from
its session ID, far past the file's end: no record or block is ever there, and Linux locks bytes
past the end of a file as readily as any other. The kernel drops the lock the moment the last
descriptor of that open file goes, so at once when the process dies, however it dies (SIGKILL
included). The daemon probes the byte on a short sweep (`held`, an `F_OFD_GETLK`): a session
seen holding its mark once, and no longer holding it on any pool file, has lost its process;
the daemon ends it there and then (its PENDING entries aborted, so whoever waits for them
encodes instead; its pins released).

A session never seen holding a mark (a client on another machine over TCP, one that cannot open
the pool file, an older client) is ended by its lease alone, as before: a mark can only end a
session sooner, never keep one alive. A forked child inherits the open file description and
with it the lock, so a session's mark holds until the client and every such child are gone.
This module is torch-free: the daemon uses `held` too.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading

from ec_protocol.pool.fd_passing import open_pool_file
from ec_protocol.pool.slot_locks import _FLOCK, F_OFD_GETLK, F_OFD_SETLK

log = logging.getLogger("ec_client")

# Marks live in [2^62, 2^62 + 2^61): past the end of any pool file (their size is bounded far
# below 2^62), and within off_t, so a one-byte lock there is always valid.
_BASE = 1 << 62
_SPAN = 1 << 61


def life_offset(session_id: str) -> int:
    """Where `session_id`'s mark is, in every pool file: both sides compute it from the ID, so
    nothing is added to the protocol. Two sessions share a byte with odds of 2^-61: then a dead
    one may look alive, and is ended by its lease."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return _BASE + int.from_bytes(digest, "big") % _SPAN


def hold(fd: int, session_id: str) -> None:
    """Take `session_id`'s mark on the open file `fd` (read access is enough); OSError if the
    kernel refuses (a file system without OFD locks)."""
    query = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, life_offset(session_id), 1, 0)
    fcntl.fcntl(fd, F_OFD_SETLK, query)


def held(fd: int, session_id: str) -> bool:
    """Whether some other open file description holds `session_id`'s mark on this file now."""
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, life_offset(session_id), 1, 0)
    kind = _FLOCK.unpack(fcntl.fcntl(fd, F_OFD_GETLK, query))[0]
    return bool(kind != fcntl.F_UNLCK)


class LifeMarks:
    """A client's marks, one per pool it opened, each on a descriptor of its own (closing it is
    what drops the mark). Thread-safe; marking is best effort: a pool file this process cannot
    open (another machine, another mount namespace) leaves the session to its lease."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # engine_id -> (path, pool UUID, session_id, fd)
        self._fds: dict[str, tuple[str, str, str, int]] = {}

    def mark(self, engine_id: str, path: str, session_id: str, pool_uuid: str = "") -> None:
        """Hold `session_id`'s mark on the pool's file, `pool_uuid` (again, after a new session
        or a new file: the old mark goes). The file is opened as fd_passing.open_pool_file does:
        from the daemon if this process received it, else by its path."""
        with self._lock:
            old = self._fds.get(engine_id)
            if old is not None and old[:3] == (path, pool_uuid, session_id):
                return
            self._drop(engine_id)
            fd = -1
            try:
                fd = open_pool_file(path, pool_uuid, writable=False)
                hold(fd, session_id)
            except OSError as error:  # a ChannelError from the daemon too
                if fd >= 0:
                    os.close(fd)
                log.debug("no life mark on %s (the lease alone ends the session): %s", path, error)
                return
            self._fds[engine_id] = (path, pool_uuid, session_id, fd)

    def unmark(self, engine_id: str) -> None:
        with self._lock:
            self._drop(engine_id)

    def close(self) -> None:
        with self._lock:
            for engine_id in list(self._fds):
                self._drop(engine_id)

    def _drop(self, engine_id: str) -> None:
        held_fd = self._fds.pop(engine_id, None)
        if held_fd is not None:
            os.close(held_fd[3])
