"""Following the peers' Watch streams into the PeerDirectory (docs/design.md §13).

One `PeerFollower` per peer address: it opens a session on the peer as any client would (the
same token and TLS files), watches every pool with a snapshot, and applies each event to the
directory. A KeepAlive every heartbeat both keeps that session and proves the peer alive: a
stream over a partitioned link would otherwise wait forever. Any failure (connection, stream,
heartbeat, a new boot epoch) forgets the peer's keys and reconnects with backoff; the next
stream's snapshot brings them back. `PeerSet` keeps one follower per current address and
re-resolves DNS names every interval.

The first event of each pool of a peer is preceded by an attach to that pool (OpenPool with no
geometry), whose PoolInfo tells whether and where this daemon can read it. While a stream is
followed, its session is also the one pulls use on that peer (`PeerSet.client`): pins taken on
the peer die with it when the peer is lost.

Followers run on the daemon's event loop: the stream's iterator yields to the loop as messages
arrive, so even a big snapshot does not hold it: the daemon's clients barely notice one, and
yielding more often did not help (docs/performance.md, Across nodes). A thread would need an
event loop of its own for grpc.aio, which one process should not have twice (docs/design.md §7).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NoReturn

import grpc

from ec_client.aio import AsyncClient
from ec_client.errors import EcdError
from ec_client.tls import TLSFiles
from ec_client.types import EventType, PoolInfo, Role
from ec_daemon.peers import PeerDirectory, PeerEntry, peer_addresses

log = logging.getLogger("ecd.peers")

Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve_host(host: str) -> list[str]:
    """The IP addresses of `host`: its IPv4 ones, or its IPv6 ones when it has no IPv4, so a
    dual-stack name does not count one daemon twice."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    by_family: dict[int, set[str]] = {}
    for family, _, _, _, sockaddr in infos:
        by_family.setdefault(family, set()).add(str(sockaddr[0]))
    return sorted(by_family.get(socket.AF_INET) or by_family.get(socket.AF_INET6) or ())


@dataclass(frozen=True)
class PeerAccess:
    """How this daemon calls its peers: as a client with a bearer token and/or TLS files (the
    CA that signed the peers' certificates; this daemon's certificate for mutual TLS)."""

    own_epoch: str  # this daemon's boot epoch: an address that answers with it is this daemon
    token: str | None = None
    tls: TLSFiles | None = None
    name: str = "ecd-peer"


@dataclass(frozen=True)
class FollowPolicy:
    connect_timeout_s: float = 2.0
    call_timeout_s: float = 2.0  # a heartbeat unanswered this long: the peer is down
    heartbeat_s: float = 1.0
    first_backoff_s: float = 0.1
    max_backoff_s: float = 5.0


class PeerLost(Exception):
    """The stream to a peer ended without a gRPC error (peer stopping, or restarted)."""


class PeerFollower:
    def __init__(
        self,
        address: str,
        directory: PeerDirectory,
        access: PeerAccess,
        policy: FollowPolicy = FollowPolicy(),
    ) -> None:
        self.address = address
        self._directory = directory
        self._access = access
        self._policy = policy
        self._followed = False  # whether the current attempt got as far as an open stream
        self.client: AsyncClient | None = None  # while a stream is followed

    async def run(self) -> None:
        """Follow until cancelled, or until the address turns out to be this daemon."""
        backoff = self._policy.first_backoff_s
        while True:
            self._followed = False
            try:
                if not await self._follow():
                    return
            except Exception as exc:  # whatever broke, the follower must live on and retry
                why = exc.message if isinstance(exc, EcdError) else str(exc) or repr(exc)
                # A lost stream is news; another failed attempt to reconnect is not.
                level = logging.WARNING if self._followed else logging.DEBUG
                log.log(level, "peer lost", extra={"peer": self.address, "why": why})
                self._directory.broken(self.address, why)
                if self._followed:
                    backoff = self._policy.first_backoff_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._policy.max_backoff_s)

    async def _follow(self) -> bool:
        """One connection, until it fails (raises); False when the peer is this daemon."""
        p, a = self._policy, self._access
        client = AsyncClient(
            self.address,
            name=a.name,
            role=Role.CONSUMER,
            connect_timeout_s=p.connect_timeout_s,
            call_timeout_s=p.call_timeout_s,
            token=a.token,
            tls=a.tls,
            keepalive=False,  # the heartbeat below keeps the session
            from_env=False,  # ECD_TOKEN_FILE, ECD_TLS_CERT... are the daemon's own settings
        )
        try:
            await client.start()
        except EcdError:
            # start() closes its channel when the peer is unreachable but not when the peer
            # refuses the session (a wrong token): close it in that case.
            with contextlib.suppress(grpc.aio.UsageError):
                await client.close()
            raise
        try:
            epoch = client.boot_epoch
            self._directory.opened(self.address, epoch, is_self=epoch == a.own_epoch)
            if epoch == a.own_epoch:
                return False
            self._followed = True
            self.client = client
            log.info("peer followed", extra={"peer": self.address, "boot_epoch": epoch})
            tasks = [
                asyncio.create_task(self._heartbeat(client, epoch)),
                asyncio.create_task(self._watch(client)),
            ]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            done.pop().result()  # raises: both loops only end by raising
        finally:
            self.client = None
            await client.close()

    async def _watch(self, client: AsyncClient) -> NoReturn:
        directory, address = self._directory, self.address
        async for event in client.watch("", snapshot=True):
            pool = event.engine_id
            if (
                pool
                and event.type is not EventType.POOL_DROPPED
                and directory.needs_pool(address, pool)
            ):
                directory.attached(address, pool, await self._attach(client, pool))
            directory.apply(address, event)
        raise PeerLost("the peer ended its Watch stream (stopping)")

    async def _attach(self, client: AsyncClient, engine_id: str) -> PoolInfo | None:
        """The peer's pool as OpenPool (attach by name) describes it; None when it will not say
        (dropped meanwhile, or a peer too old to attach by name)."""
        try:
            return await client.open_pool(engine_id, 0, 0)
        except EcdError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND and exc.reason != "pool_dropped":
                log.warning(
                    "peer pool cannot be attached: not read from",
                    extra={"peer": self.address, "engine_id": engine_id, "why": exc.message},
                )
            return None

    async def _heartbeat(self, client: AsyncClient, epoch: str) -> NoReturn:
        while True:
            await asyncio.sleep(min(self._policy.heartbeat_s, client.lease_ttl_s / 3))
            await client.keep_alive()
            if client.boot_epoch != epoch:  # the client reopened its session on a new daemon
                raise PeerLost(f"the peer restarted (boot epoch {client.boot_epoch})")


class PeerSet:
    """One follower per peer address; DNS names re-resolved every `interval_s`. A name that
    fails to resolve keeps the addresses it had (a DNS outage does not drop healthy peers)."""

    def __init__(
        self,
        entries: Sequence[PeerEntry],
        own_addresses: Collection[str],
        directory: PeerDirectory,
        access: PeerAccess,
        policy: FollowPolicy = FollowPolicy(),
        resolver: Resolver = resolve_host,
        interval_s: float = 30.0,
    ) -> None:
        self._entries = list(entries)
        self._own = own_addresses
        self._directory = directory
        self._access = access
        self._policy = policy
        self._resolver = resolver
        self._interval_s = interval_s
        self._lookups: dict[str, list[str]] = {}
        self._followers: dict[str, tuple[PeerFollower, asyncio.Task[None]]] = {}

    async def run(self) -> None:
        """Refresh every interval until cancelled; the followers stop with it."""
        try:
            while True:
                await self.refresh()
                await asyncio.sleep(self._interval_s)
        finally:
            await self.close()

    async def refresh(self) -> None:
        for name in {e.host for e in self._entries if e.is_name}:
            try:
                self._lookups[name] = await self._resolver(name)
            except OSError as exc:
                log.warning("peer name did not resolve", extra={"peer_name": name, "why": str(exc)})
        wanted = peer_addresses(self._entries, self._lookups, self._own)
        for address in set(self._followers) - wanted:
            self._followers.pop(address)[1].cancel()
            self._directory.remove(address)
        for address in wanted - set(self._followers):
            self._directory.add(address)
            follower = PeerFollower(address, self._directory, self._access, self._policy)
            self._followers[address] = (follower, asyncio.create_task(follower.run()))

    def client(self, address: str) -> AsyncClient | None:
        """The session on the peer at `address` while its stream is followed."""
        follower = self._followers.get(address)
        return follower[0].client if follower is not None else None

    async def close(self) -> None:
        tasks = [task for _, task in self._followers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._followers.clear()
