"""The peer directory: which daemons of other nodes this one follows, and which READY keys each
holds (docs/design.md §13). Pure: no I/O, no clock of its own; `peer_follower` feeds it from the
peers' Watch streams (a snapshot of READY keys, then commit, evict, abort, delete and drop
events).

What it knows is a hint for routing a local miss to a peer, never a promise: the pull pins the
entry on the peer (Acquire) before it reads, and a peer that no longer has it answers MISS. Keys
are kept as bytes, although 64-bit hashes would take less for long keys, because the
daemon also tells its own watchers (the vLLM connector's ready view) which keys its peers hold,
and takes them back one by one when a peer is lost; with each key its size (from the events),
so a pull can reserve the local entry before the peer answers. Each peer pool is also attached
once per connection (its PoolInfo: geometry, compat key, where its blocks are read), so that
only pools this daemon can read from count.

Scale. Memory grows with every (peer, READY key) pair: the key's bytes, its size, and the dict
and set entries holding them. Events: every commit and eviction anywhere reaches every other
daemon, so with N daemons each making r events/s, each daemon applies (N - 1) x r events/s and
the fleet N x (N - 1) x r; a peer that restarts or reconnects sends its whole snapshot again.
Applying them is mostly gRPC and protobuf. The figures per pair and per event, and where they
stop scaling, are in docs/performance.md (Across nodes). Beyond that, a directory service
(sharded by key, fed by the same Watch streams) should answer
`holdings` instead: it is the one question the pull asks (and `pools` the one the republished
keys ask), so it is the seam where that service plugs in.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ec_client.types import EventType, PoolInfo, WatchEvent


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


def peer_address(host: str, port: int) -> str:
    """`host:port`, `[host]:port` for an IPv6 address: a gRPC target, a transfer endpoint."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


Change = Callable[[str, bytes], None]


@dataclass
class _Peer:
    state: PeerState = PeerState.CONNECTING
    boot_epoch: str = ""
    error: str = ""
    pools: dict[str, dict[bytes, int]] = field(default_factory=dict)  # engine_id -> key -> nbytes
    # engine_id -> what its OpenPool (attach) answered; None: not readable (unknown to it, or
    # it refused the attach). Learned once per pool and connection, before its keys are applied.
    infos: dict[str, PoolInfo | None] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerView:
    """One peer as operators see it (`ecd stats`)."""

    address: str
    state: PeerState
    boot_epoch: str
    keys: int
    error: str  # why its last stream ended; empty while it never broke


@dataclass(frozen=True)
class Holding:
    """A peer holding a key READY: where to ask for it, its size, and where its pool is read."""

    address: str
    nbytes: int
    pool: PoolInfo


_ADDS = {EventType.SNAPSHOT, EventType.COMMITTED}
_REMOVES = {EventType.EVICTED, EventType.ABORTED, EventType.DELETED}


class PeerDirectory:
    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}
        self._listeners: list[Change] = []

    def listen(self, changed: Change) -> None:
        """Call `changed(engine_id, key)` after anything a peer holds of that key changed (a peer
        gained or lost it, or its pool became readable or not)."""
        self._listeners.append(changed)

    def add(self, address: str) -> None:
        self._peers.setdefault(address, _Peer())

    def remove(self, address: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            self._forget(peer)

    def opened(self, address: str, boot_epoch: str, is_self: bool = False) -> None:
        """A connection to the daemon with `boot_epoch` is open and its snapshot follows, unless
        that daemon is this one (then it is never followed)."""
        peer = self._peers.get(address)
        if peer is not None:
            self._set_epoch(peer, boot_epoch)
            peer.state = PeerState.SELF if is_self else PeerState.SYNCING
            peer.error = ""  # what broke the last connection is over

    def needs_pool(self, address: str, engine_id: str) -> bool:
        """Whether the peer's pool `engine_id` has not been attached on this connection yet."""
        peer = self._peers.get(address)
        return peer is not None and engine_id not in peer.infos

    def attached(self, address: str, engine_id: str, info: PoolInfo | None) -> None:
        """What attaching to the peer's pool answered (None: it cannot be read from)."""
        peer = self._peers.get(address)
        if peer is not None and peer.state in (PeerState.SYNCING, PeerState.SYNCED):
            peer.infos[engine_id] = info
            self._changed(engine_id, peer.pools.get(engine_id, {}))

    def apply(self, address: str, event: WatchEvent) -> None:
        peer = self._peers.get(address)
        if peer is None or peer.state not in (PeerState.SYNCING, PeerState.SYNCED):
            return
        self._set_epoch(peer, event.boot_epoch)
        pool = peer.pools.get(event.engine_id)
        if event.type is EventType.SYNCED:
            peer.state = PeerState.SYNCED
        elif event.type is EventType.POOL_DROPPED:
            peer.infos.pop(event.engine_id, None)  # a pool made anew may differ: attach again
            if peer.pools.pop(event.engine_id, None):
                self._changed(event.engine_id, pool or {})
        elif event.type in _ADDS:
            held = peer.pools.setdefault(event.engine_id, {})
            new = event.key not in held
            held[event.key] = event.nbytes
            if new:
                self._changed(event.engine_id, (event.key,))
        elif event.type in _REMOVES and pool is not None and pool.pop(event.key, None) is not None:
            self._changed(event.engine_id, (event.key,))

    def broken(self, address: str, why: str) -> None:
        """Its stream ended or its connection failed: what it held is unknown until it resyncs."""
        peer = self._peers.get(address)
        if peer is not None:
            self._forget(peer)
            peer.state = PeerState.DOWN
            peer.error = why

    def holdings(self, engine_id: str, key: bytes) -> list[Holding]:
        """The peers holding `key` READY in a pool `engine_id` that was attached."""
        found = []
        for address, peer in self._peers.items():
            nbytes = peer.pools.get(engine_id, {}).get(key)
            info = peer.infos.get(engine_id)
            if nbytes is not None and info is not None:
                found.append(Holding(address, nbytes, info))
        return found

    def pools(self, engine_id: str) -> Iterator[tuple[PoolInfo, Mapping[bytes, int]]]:
        """Each attached peer pool `engine_id` with its READY keys."""
        for peer in self._peers.values():
            info = peer.infos.get(engine_id)
            if info is not None:
                yield info, peer.pools.get(engine_id, {})

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

    def _set_epoch(self, peer: _Peer, boot_epoch: str) -> None:
        # A new epoch is a restarted daemon: nothing the old one held is known to have survived
        # until the new one's snapshot says so.
        if boot_epoch and boot_epoch != peer.boot_epoch:
            self._forget(peer)
            peer.boot_epoch = boot_epoch

    def _forget(self, peer: _Peer) -> None:
        pools = peer.pools
        peer.pools, peer.infos = {}, {}
        for engine_id, keys in pools.items():
            self._changed(engine_id, keys)

    def _changed(self, engine_id: str, keys: Iterable[bytes]) -> None:
        if self._listeners:
            for key in list(keys):
                for changed in self._listeners:
                    changed(engine_id, key)
