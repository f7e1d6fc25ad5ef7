"""Following real peer daemons over TCP into a PeerDirectory (the follower runs in the test's
event loop; stage 2 runs it inside the daemon): keys appear and go with the peer's commits and
evictions, a dead or stalled peer is forgotten, a restarted one is followed with its new epoch,
tokens and TLS are presented as any client presents them, and DNS names are re-resolved."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from ecd_testing import Daemon, running_daemon
from peer_testing import eventually, free_port, holders
from pki_testing import make_pki

from ec_client import AllocateItem, AsyncClient, EcdError, Status, TLSFiles
from ec_daemon.peer_follower import FollowPolicy, PeerAccess, PeerFollower, PeerSet
from ec_daemon.peers import PeerDirectory, PeerEntry, PeerState, PeerView

BLOCK = 4096
POOL = "vl"
FAST = FollowPolicy(
    connect_timeout_s=0.5,
    call_timeout_s=0.5,
    heartbeat_s=0.2,
    first_backoff_s=0.05,
    max_backoff_s=0.5,
)
TOKEN = "peer-0123456789abcdef"


def tcp_daemon(address: str, *extra: str) -> contextlib.AbstractContextManager[Daemon]:
    return running_daemon("--tcp", address, "--max-bytes", "64MiB", "--lease-ttl", "2", *extra)


@pytest.fixture
def peer() -> Iterator[tuple[Daemon, str]]:
    """A daemon listening on TCP, and its address."""
    address = f"127.0.0.1:{free_port()}"
    with tcp_daemon(address) as daemon:
        yield daemon, address


@contextlib.asynccontextmanager
async def following(
    address: str, directory: PeerDirectory, access: PeerAccess | None = None
) -> AsyncIterator[asyncio.Task[None]]:
    directory.add(address)
    follower = PeerFollower(address, directory, access or PeerAccess(own_epoch="me"), FAST)
    task = asyncio.create_task(follower.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def store(client: AsyncClient, keys: Sequence[bytes]) -> None:
    """READY entries (their bytes do not matter to the directory)."""
    items = [AllocateItem(k, (BLOCK,), "uint8") for k in keys]
    assert {r.status for r in await client.allocate(POOL, items)} == {Status.ALLOCATED}
    assert {r.status for r in await client.commit(POOL, keys)} == {Status.OK}


def view(directory: PeerDirectory, address: str) -> PeerView:
    return next(v for v in directory.views() if v.address == address)


def synced(directory: PeerDirectory, address: str) -> bool:
    return view(directory, address).state is PeerState.SYNCED


async def test_keys_ready_on_a_peer_appear_in_the_directory_and_evicted_ones_go(
    peer: tuple[Daemon, str],
) -> None:
    daemon, address = peer
    directory = PeerDirectory()
    async with AsyncClient(daemon.address, name="producer") as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await store(c, [b"before"])
        async with following(address, directory):
            await eventually(lambda: synced(directory, address), "the snapshot")
            assert holders(directory, POOL, b"before") == [address]

            await store(c, [b"after-1", b"after-2"])
            await eventually(lambda: holders(directory, POOL, b"after-2") == [address], "commits")
            await c.evict(POOL, [b"before", b"after-1"])
            await eventually(lambda: not holders(directory, POOL, b"after-1"), "evictions")
            assert holders(directory, POOL, b"before") == []
            assert holders(directory, POOL, b"after-2") == [address]
            assert view(directory, address).keys == 1


async def test_a_killed_peer_is_forgotten_and_its_restart_followed_with_the_new_epoch(
    peer: tuple[Daemon, str],
) -> None:
    daemon, address = peer
    directory = PeerDirectory()
    async with AsyncClient(daemon.address, name="producer", keepalive=False) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await store(c, [b"k"])
        old_epoch = c.boot_epoch
    async with following(address, directory):
        await eventually(lambda: holders(directory, POOL, b"k") == [address], "the snapshot")

        await asyncio.to_thread(daemon.kill)
        await eventually(lambda: view(directory, address).state is PeerState.DOWN, "down")
        assert holders(directory, POOL, b"k") == []

        await asyncio.to_thread(daemon.start)  # re-adopts its pool: k is READY again
        await eventually(lambda: synced(directory, address), "the restarted peer")
        assert view(directory, address).boot_epoch not in ("", old_epoch)
        assert holders(directory, POOL, b"k") == [address]


async def test_a_stalled_peer_is_declared_down_and_followed_again_when_it_resumes(
    peer: tuple[Daemon, str],
) -> None:
    daemon, address = peer
    assert daemon.proc is not None
    directory = PeerDirectory()
    async with AsyncClient(daemon.address, name="producer", keepalive=False) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await store(c, [b"k"])
    async with following(address, directory):
        await eventually(lambda: synced(directory, address), "the snapshot")
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # a partition: the connection stays, silent
        try:
            await eventually(lambda: view(directory, address).state is PeerState.DOWN, "down")
            assert holders(directory, POOL, b"k") == []
            assert "Deadline" in view(directory, address).error
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        await eventually(lambda: synced(directory, address), "the resumed peer")
        assert holders(directory, POOL, b"k") == [address]


async def test_an_address_that_is_this_daemon_is_marked_self_and_not_followed(
    peer: tuple[Daemon, str],
) -> None:
    daemon, address = peer
    async with AsyncClient(daemon.address, name="me", keepalive=False) as c:
        own_epoch = c.boot_epoch
    directory = PeerDirectory()
    async with following(address, directory, PeerAccess(own_epoch=own_epoch)) as task:
        await asyncio.wait_for(task, timeout=15)
        assert view(directory, address).state is PeerState.SELF


async def test_a_follower_ignores_the_daemons_own_token_and_tls_settings_in_its_environment(
    peer: tuple[Daemon, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ECD_TOKEN_FILE, ECD_TLS_CERT and ECD_TLS_KEY configure a daemon's own server (a token
    file of NAME TOKEN lines, its certificate): its calls to peers must not take them as a
    client's."""
    _, address = peer
    _, server, _ = make_pki(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"peer {TOKEN}\n")
    monkeypatch.setenv("ECD_TOKEN_FILE", str(tokens))
    monkeypatch.setenv("ECD_TLS_CERT", str(server.cert))
    monkeypatch.setenv("ECD_TLS_KEY", str(server.key))
    directory = PeerDirectory()
    async with following(address, directory):  # a plaintext peer requiring no token
        await eventually(lambda: synced(directory, address), "the peer, in plaintext")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, TLSFiles]]:
    """A daemon requiring a token and a client certificate: its address, and what to present."""
    directory = tmp_path_factory.mktemp("peer-auth")
    ca, server, client = make_pki(directory)
    tokens = directory / "tokens"
    tokens.write_text(f"peer {TOKEN}\n")
    address = f"127.0.0.1:{free_port()}"
    tls = ("--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca))
    with tcp_daemon(address, "--token-file", str(tokens), *tls):
        yield address, ca, TLSFiles(ca=ca, cert=client.cert, key=client.key)


async def test_a_follower_presents_its_token_and_client_certificate(
    secured: tuple[str, Path, TLSFiles],
) -> None:
    address, _, mutual = secured
    directory = PeerDirectory()
    access = PeerAccess(own_epoch="me", token=TOKEN, tls=mutual)
    async with following(address, directory, access):
        await eventually(lambda: synced(directory, address), "the secured peer")


async def test_a_follower_without_the_token_stays_down_and_says_why(
    secured: tuple[str, Path, TLSFiles],
) -> None:
    address, _, mutual = secured
    directory = PeerDirectory()
    async with following(address, directory, PeerAccess(own_epoch="me", tls=mutual)):
        await eventually(lambda: bool(view(directory, address).error), "a failed attempt")
        assert view(directory, address).state is PeerState.DOWN
        assert "token" in view(directory, address).error


# ---- addresses from a DNS name ---------------------------------------------------------------


def port_free_on(*hosts: str) -> int:
    """A port free on every one of `hosts` (loopback addresses of this machine)."""
    while True:
        port = free_port(hosts[0])
        with contextlib.ExitStack() as stack:
            try:
                for host in hosts[1:]:
                    s = stack.enter_context(socket.socket())
                    s.bind((host, port))
            except OSError:
                continue
            return port


class FakeDns:
    """Answers for one name, changed by the test; `None` makes the lookup fail."""

    def __init__(self, answer: list[str] | None) -> None:
        self.answer = answer

    async def __call__(self, name: str) -> list[str]:
        assert name == "ecd-peers"
        if self.answer is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return self.answer


async def test_a_name_is_followed_at_each_address_it_resolves_to_as_they_change() -> None:
    port = port_free_on("127.0.0.1", "127.0.0.2", "127.0.0.3")
    one, two, me = (f"127.0.0.{i}:{port}" for i in (1, 2, 3))
    dns = FakeDns(["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    directory = PeerDirectory()
    peers = PeerSet(
        [PeerEntry("ecd-peers", port)],
        own_addresses=[me],
        directory=directory,
        access=PeerAccess(own_epoch="me"),
        policy=FAST,
        resolver=dns,
    )
    with tcp_daemon(one), tcp_daemon(two):
        try:
            await peers.refresh()
            assert {v.address for v in directory.views()} == {one, two}
            await eventually(lambda: synced(directory, one) and synced(directory, two), "both")

            dns.answer = None  # a DNS outage keeps the peers it had
            await peers.refresh()
            assert {v.address for v in directory.views()} == {one, two}

            dns.answer = ["127.0.0.1"]  # a pod left the Service
            await peers.refresh()
            assert [v.address for v in directory.views()] == [one]
            assert synced(directory, one)
        finally:
            await peers.close()


async def test_a_call_on_a_closed_async_client_is_an_ecd_error_not_a_grpc_one(
    daemon: Daemon,
) -> None:
    # As a pull's Release is, when the follower closed its client to a peer that died meanwhile.
    client = await AsyncClient(daemon.address, name="closing", keepalive=False).start()
    await client.close()
    with pytest.raises(EcdError, match=r"channel to ecd at .* is closed"):
        await client.release([1])
