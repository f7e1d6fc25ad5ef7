"""The peer directory: which daemons of other nodes this one follows, and which READY keys each
holds (DESIGN §13). Pure: no I/O, no clock of its own; `peer_follower` feeds it from the peers'
Watch streams (a snapshot of READY keys, then commit, evict, abort, delete and drop events).

What it knows is a hint for routing a local miss to a peer, never a promise: the pull pins the
entry on the peer (Acquire) before it reads, and a peer that no longer has it answers MISS. Keys
are kept as bytes, although 64-bit hashes would take ~77 B whatever the key's length, because the
daemon will also tell its own watchers (the vLLM connector's ready view) which keys its peers
hold, and take them back one by one when a peer is lost.

Scale. Memory is about 170 bytes per (peer, READY key) for a 64-byte key such as an mm_hash hex
digest (measured in a follower: 168 B; ~330 B for a 256-byte key): 8 peers of 65,536 entries each
~90 MB, 32 peers ~350 MB. Events: every commit and eviction anywhere reaches every other daemon,
so with N daemons each making r events/s, each daemon applies (N - 1) x r events/s and the fleet
N x (N - 1) x r; a peer that restarts or reconnects sends its whole snapshot again. Applying them
is mostly gRPC and protobuf: a follower took in a 50,000-key snapshot at 7,000-10,000 events/s
here (2 cores shared with the peer daemon), so 1,000 events/s costs a daemon about a tenth of a
core. Beyond about a million (peer, key) pairs (~170 MB), or a few thousand events/s per
daemon, a directory service (sharded by key, fed by the same Watch streams) should answer
`holders` instead: it is the one question the pull asks, so it is the seam where that service
plugs in.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ec_client.types import EventType, WatchEvent


@dataclass(frozen=True)
class PeerEntry:
    """One configured peer: HOST:PORT, HOST an IP address (one peer) or a DNS name (one peer per
    address it resolves to, such as a Kubernetes headless Service in front of a DaemonSet)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> PeerEntry:
        host, sep, port = text.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"peer {text!r} is not HOST:PORT (e.g. 10.0.0.7:7878, [fd00::7]:7878 or "
                "ecd-peers.ecd.svc.cluster.local:7878)"
            )
        return cls(host, int(port))

    @property
    def is_name(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return True
        return False


def peer_address(ip: str, port: int) -> str:
    """A gRPC target for one peer: `ip:port`, `[ip]:port` for IPv6."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def peer_addresses(
    entries: Sequence[PeerEntry], lookups: Mapping[str, Collection[str]], own: Collection[str]
) -> frozenset[str]:
    """Every peer's address: IP entries as they are, each name as one address per IP it
    resolved to (`lookups`: name -> IPs; a name not looked up yet contributes nothing), less
    this daemon's own addresses (`own`, as `peer_address` spells them)."""
    addresses = {
        peer_address(ip, entry.port)
        for entry in entries
        for ip in (lookups.get(entry.host, ()) if entry.is_name else (entry.host,))
    }
    return frozenset(addresses - set(own))


class PeerState(enum.Enum):
    CONNECTING = "connecting"  # never reached yet
    SYNCING = "syncing"  # stream open, snapshot arriving (keys seen so far are known)
    SYNCED = "synced"  # snapshot done, following live events
    DOWN = "down"  # its stream broke: keys forgotten, reconnecting with backoff
    SELF = "self"  # the address is this daemon's own (same boot epoch): not followed


@dataclass
class _Peer:
    state: PeerState = PeerState.CONNECTING
    boot_epoch: str = ""
    error: str = ""
    pools: dict[str, set[bytes]] = field(default_factory=dict)  # engine_id -> READY keys

    def forget(self) -> None:
        self.pools.clear()


@dataclass(frozen=True)
class PeerView:
    """One peer as operators see it (`ecd stats`)."""

    address: str
    state: PeerState
    boot_epoch: str
    keys: int
    error: str  # why its last stream ended; empty while it never broke


_ADDS = {EventType.SNAPSHOT, EventType.COMMITTED}
_REMOVES = {EventType.EVICTED, EventType.ABORTED, EventType.DELETED}


class PeerDirectory:
    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}

    def add(self, address: str) -> None:
        self._peers.setdefault(address, _Peer())

    def remove(self, address: str) -> None:
        self._peers.pop(address, None)

    def opened(self, address: str, boot_epoch: str, is_self: bool = False) -> None:
        """A connection to the daemon with `boot_epoch` is open and its snapshot follows, unless
        that daemon is this one (then it is never followed)."""
        peer = self._peers.get(address)
        if peer is not None:
            self._set_epoch(peer, boot_epoch)
            peer.state = PeerState.SELF if is_self else PeerState.SYNCING

    def apply(self, address: str, event: WatchEvent) -> None:
        peer = self._peers.get(address)
        if peer is None or peer.state not in (PeerState.SYNCING, PeerState.SYNCED):
            return
        self._set_epoch(peer, event.boot_epoch)
        if event.type is EventType.SYNCED:
            peer.state = PeerState.SYNCED
        elif event.type is EventType.POOL_DROPPED:
            peer.pools.pop(event.engine_id, None)
        elif event.type in _ADDS:
            peer.pools.setdefault(event.engine_id, set()).add(event.key)
        elif event.type in _REMOVES and event.engine_id in peer.pools:
            peer.pools[event.engine_id].discard(event.key)

    def broken(self, address: str, why: str) -> None:
        """Its stream ended or its connection failed: what it held is unknown until it resyncs."""
        peer = self._peers.get(address)
        if peer is not None:
            peer.forget()
            peer.state = PeerState.DOWN
            peer.error = why

    def holders(self, engine_id: str, key: bytes) -> list[str]:
        """Addresses of the peers known to hold `key` READY in their pool `engine_id`."""
        return [
            address for address, peer in self._peers.items() if key in peer.pools.get(engine_id, ())
        ]

    def views(self) -> list[PeerView]:
        return [
            PeerView(
                address,
                peer.state,
                peer.boot_epoch,
                sum(len(keys) for keys in peer.pools.values()),
                peer.error,
            )
            for address, peer in sorted(self._peers.items())
        ]

    @staticmethod
    def _set_epoch(peer: _Peer, boot_epoch: str) -> None:
        # A new epoch is a restarted daemon: nothing the old one held is known to have survived
        # until the new one's snapshot says so.
        if boot_epoch and boot_epoch != peer.boot_epoch:
            peer.forget()
            peer.boot_epoch = boot_epoch
