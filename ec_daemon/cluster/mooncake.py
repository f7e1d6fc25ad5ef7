"""The Mooncake Store client, as the cluster tier uses it: `MooncakeDistributedStore` (the
`mooncake-transfer-engine` wheel), joined and called on one thread of the daemon's own, never on
the event loop (its calls block; a failed call waits seconds for a master gone).

Its `setup` holds the interpreter's lock for as long as it runs, and runs about 90 s when the
master or the metadata server cannot be reached (Mooncake 0.3.x): a daemon that called it then
would freeze, event loop included. So `connect` first checks, with a short timeout of its own,
that both accept a connection, and calls `setup` only then (a master that dies in between still
freezes the daemon for that long: a limit of this slice, docs/design.md §13).

Its transfer engine listens on ports of its own (a handshake port; with TCP, a data port too),
bound to every address of the host (Mooncake 0.3.x has no setting for one address): `connect`
tells it the address to give the others (`settings.host`), and once joined logs the ports that
listen beyond that address, for the operator to confine (a firewall, a NetworkPolicy).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol
from urllib.parse import urlsplit

from ec_daemon.cluster.leader import NoLeader, etcd_endpoints, read_view
from ec_daemon.cluster.listening import WILDCARDS, listeners, socket_inodes

log = logging.getLogger("ecd.cluster")

REACH_TIMEOUT_S = 1.0
# The store client's own buffer for calls that do not name registered memory: this node only
# reads and writes registered pool regions and header buffers, so it needs little.
LOCAL_BUFFER_BYTES = 16 << 20
# Mooncake's error codes that mean the master did not answer (types.h, ErrorCode).
RPC_FAIL, RPC_TIMEOUT = -900, -901
# What installs the store client and mooncake_master into a daemon's environment: the wheel the
# mooncake extra of pyproject.toml pins (tests/ops/test_docs.py keeps the two equal). The
# project itself installs from its checkout (pip install '.[mooncake]'), never by a name from the
# package index, where `ecd` is another project.
MOONCAKE_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
INSTALL_HINT = f"pip install '{MOONCAKE_WHEEL}' (the mooncake extra of encoder-cache-daemon)"


@dataclass(frozen=True)
class StoreSettings:
    """How this node joins the store (ecd serve --store-*)."""

    master: str  # HOST:PORT of the master, or etcd://HOST:PORT[;...] of several (leader.py)
    metadata: str  # the metadata server's URL
    host: str  # where the store's other clients reach this node's transfer engine
    segment_bytes: int  # memory lent to the store for every node's entries
    protocol: str = "tcp"
    devices: str = ""


class StoreClient(Protocol):
    """What the cluster tier calls on the store (a test may stand in a fake)."""

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def batch_put_from_multi_buffers(
        self, keys: list[str], buffers: list[list[int]], sizes: list[list[int]], config: Any
    ) -> list[int]: ...

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], buffers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]: ...

    def register_buffer(self, address: int, length: int) -> int: ...

    # Small values of ecd's own (the pending markers, ec_daemon.cluster.pending), through the
    # client's own buffer.
    def put(self, key: str, value: bytes, config: Any = ...) -> int: ...

    def get_hostname(self) -> str: ...

    def get(self, key: str) -> bytes: ...

    def get_batch(self, keys: list[str]) -> list[bytes]: ...

    # Replaces the value (a put keeps a key's first one): a writer's beat.
    def upsert(self, key: str, value: bytes, config: Any = ...) -> int: ...

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...

    def unregister_buffer(self, address: int) -> int: ...

    def close(self) -> int: ...

    # 0 while the client's own pings reach its master (the leader it follows), else not 0: no
    # round trip.
    def health_check(self) -> int: ...


class Unreachable(Exception):
    """The store cannot be joined now; the message says why."""


def reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Unreachable unless HOST:PORT accepts a TCP connection within timeout_s."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except (OSError, ValueError) as exc:
        raise Unreachable(f"{address}: {exc}") from None


def leading_master(master: str) -> str:
    """HOST:PORT of the master that serves for `master` (--store-master): itself, or with
    several masters the leader etcd names; Unreachable if none leads."""
    endpoints = etcd_endpoints(master)
    if not endpoints:
        return master
    try:
        return read_view(endpoints).leader
    except NoLeader as exc:
        raise Unreachable(str(exc)) from None


def connect(settings: StoreSettings) -> tuple[StoreClient, Any]:
    """A store client joined to the store, and the replication config puts take; Unreachable
    when the master (with several, the leader) or the metadata server does not answer, or the
    store refuses this node."""
    reachable(leading_master(settings.master))
    url = urlsplit(settings.metadata)
    if url.scheme in ("http", "https") and url.hostname:
        reachable(f"{url.hostname}:{url.port or (443 if url.scheme == 'https' else 80)}")
    # The library reads its MC_* settings when it is loaded, so defaults go in first.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    # The address the transfer engine publishes for the others to reach this node (its
    # handshake and, with TCP, its data port): without it, that of the host's first network
    # interface other than loopback, whatever settings.host says. Read at setup.
    os.environ["MC_TCP_BIND_ADDRESS"] = settings.host
    try:
        from mooncake.store import MooncakeDistributedStore, ObjectDataType, ReplicateConfig
    except ImportError as exc:
        raise Unreachable(
            f"the Mooncake Store client cannot be loaded ({exc}): {INSTALL_HINT}"
        ) from None
    store = MooncakeDistributedStore()
    before = socket_inodes()
    ret = store.setup(
        settings.host,
        settings.metadata,
        settings.segment_bytes,
        LOCAL_BUFFER_BYTES,
        settings.protocol,
        settings.devices,
        settings.master,
    )
    if ret != 0:
        raise Unreachable(f"the store refused this node (setup answered {ret}; its log says why)")
    # Only what setup opened: the daemon's own listeners bind where its settings say.
    opened = listeners(inodes=socket_inodes() - before)
    unconfined = sorted(x.port for x in opened if x.host in WILDCARDS)
    if unconfined:
        log.warning(
            "the store's transfer engine listens on every address of this host, not only the "
            "one it was given: confine its ports with a firewall or a NetworkPolicy",
            extra={
                "ports": unconfined,
                "transfer_host": settings.host,
                "segment": store.get_hostname(),
            },
        )
    config = ReplicateConfig()  # as vLLM's store connector puts its values
    config.data_type = ObjectDataType.TENSOR
    return store, config


def end_process_left_open() -> NoReturn:
    """End the daemon's process at once (exit status 0), once it stopped, when its store client
    follows a leader through etcd (ClusterNode leaves it open).

    Such a client's teardown (its close, its freeing, or the library's own at the interpreter's
    exit) waits for its leader monitor's wait on etcd to end, up to 30 s (Mooncake 0.3.x),
    holding the interpreter's lock: a stop would hang that long. Its segment goes as a killed
    node's does: the masters drop it after their --client_ttl."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def own_segment(store: StoreClient) -> Any:
    """A put's placement in this node's own segment (the master places values anywhere by
    default)."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.preferred_segment = store.get_hostname()
    return config


def answered(results: Sequence[int]) -> bool:
    """Whether a batch's results show the master answered (no RPC failure among them)."""
    return not any(r in (RPC_FAIL, RPC_TIMEOUT) for r in results)
