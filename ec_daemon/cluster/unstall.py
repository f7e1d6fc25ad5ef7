"""A link to the master that healed while the store client still waits on it (docs/design.md §13,
Loss noticed at once): the node back within a second of the heal, not when TCP next resends.

A call the store client sent over a link that then dropped every packet is resent by the kernel
on a timer that doubles each time (0.2 s, 0.4 s, ... up to 2 minutes); a connection asked for
meanwhile is asked again the same way. Once the link heals, such a connection goes on only when
its timer next fires: 3.1-3.8 s after the heal of a 10 s cut, measured. The node's thread, which
owns the store client, waits in that call all along, and nothing it could call hurries the
kernel's timer.

So while the node is disconnected, a watch of its own (a thread: a probe blocks up to its
timeout) asks every PROBE_S whether the master's port accepts a new connection. Once it does,
the link is back, and the watch shuts down the store client's connections to the master that
still wait on a resend: the call waiting on one fails at once, as when a master is killed, the
node's thread goes on, and its next call reaches the master over a new connection (the client
reconnects by itself). It looks once more when the node is connected again: the client calls
over several connections, and another one still waiting on a resend would hold the next call
made on it. Nothing on the request path: the watch probes only while the node is disconnected,
and shuts only connections that went unanswered through a timeout of TCP's, never one that
works (a master that is slow, or stopped, has its kernel acknowledge what it is sent: its calls
are left to return).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

from ec_daemon.cluster.listening import resending
from ec_daemon.cluster.mooncake import Unreachable, reachable

log = logging.getLogger("ecd.cluster")

# How often a disconnected node's watch asks, and how long a new connection may take to be
# accepted: a master is on the cluster's network (well under a millisecond away here). On a link
# whose round trip is longer the probe never succeeds, and the node is back when TCP resends.
PROBE_S = 0.25


def unstall(address: str, timeout_s: float = PROBE_S) -> int:
    """If HOST:PORT accepts a new connection within timeout_s, shut down this process's
    connections to it that wait on a resend; how many were shut (0 when it does not accept)."""
    try:
        reachable(address, timeout_s)
    except Unreachable:
        return 0
    host, _, port = address.rpartition(":")
    try:
        found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return 0
    ips = {str(info[4][0]) for info in found}
    return sum(_shut(fd, inode) for ip in ips for inode, fd in resending(ip, int(port)).items())


def _shut(fd: int, inode: str) -> bool:
    """Shut down the socket behind this process's descriptor `fd` if it is still socket `inode`
    (through a duplicate: the descriptor stays the store client's, for it to close)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:  # closes the duplicate alone
            if str(os.fstat(sock.fileno()).st_ino) != inode:  # the number was reused meanwhile
                return False
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile, or not a socket any more
        return False
    return True


class Watch:
    """A thread that, while `disconnected()`, unstalls the master `master()` names (HOST:PORT;
    empty: none known yet) every PROBE_S, and once more when the node is connected again."""

    def __init__(self, disconnected: Callable[[], bool], master: Callable[[], str]) -> None:
        self._disconnected = disconnected
        self._master = master
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ecd-cluster-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(2 * PROBE_S)  # at most one probe under way

    def _run(self) -> None:
        away = False
        while not self._stopping.wait(PROBE_S):
            address = self._master()
            if not address:
                continue
            if self._disconnected():
                away = True
            elif away:
                away = False  # back: the last look
            else:
                continue
            shut = unstall(address)
            if shut:
                log.info(
                    "the store's master accepts connections again: the store client's "
                    "connections to it that waited on a resend are shut, for new ones",
                    extra={"master": address, "connections": shut},
                )
