"""Daemons on loopback pulling entries from each other (docs/design.md §13): each its own shm
directory, TCP port and Mooncake transfer engine, the peer of every other. Engines see the same
API: a get on one node of a key put on another is a hit, bit-identical, after one
transfer-engine read."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch
from ecd_testing import assert_blocks_accounted, run_ecd, wait_until
from peer_testing import needs_mooncake, peered_daemons, tcp_address, wait_peers_synced

from ec_client import Client, Consumer, EcdError, Producer, Status

pytestmark = needs_mooncake

POOL = "vl"
BLOCK = 4096
CAPACITY = 160 << 20


def open_pool(client: Client, compat_key: str = "model") -> None:
    client.open_pool(POOL, BLOCK, CAPACITY, compat_key)


def put(client: Client, key: str, nbytes: int) -> torch.Tensor:
    tensor = torch.randint(0, 256, (nbytes // 64, 64), dtype=torch.uint8)
    Producer(client, POOL).put(key, tensor)
    client.flush()
    return tensor


def digest(tensor: torch.Tensor | None) -> str:
    assert tensor is not None
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def remote_view_has(client: Client, key: str) -> bool:
    view = client.view(POOL)
    return view.has(key.encode()) and not view.has_local(key.encode())


def test_a_remote_hit_counts_as_a_hit_and_a_remote_hit_not_a_miss() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca), open_pool(cb)
        wait_peers_synced(cb, 1)
        put(ca, "img", 1 << 20)
        wait_until(lambda: remote_view_has(cb, "img"))

        assert Consumer(cb, POOL).get("img") is not None  # a Step's acquire, pulled
        cb.flush()

        [pool] = cb.stats(POOL).pools
        assert (pool.hits, pool.misses, pool.remote_hits) == (1, 0, 1)


def test_an_entry_put_on_one_node_is_read_bit_identical_on_another_after_one_read() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca), open_pool(cb)
        wait_peers_synced(cb, 1)
        stored = put(ca, "img", 8 << 20)
        wait_until(lambda: remote_view_has(cb, "img"))

        got = Consumer(cb, POOL).get("img")  # wait_ms 0: the pull is waited for all the same

        assert digest(got) == digest(stored)
        assert got is not None and got.shape == stored.shape and got.dtype == stored.dtype
        [pool] = cb.stats(POOL).pools
        assert (pool.remote_hits, pool.remote_reads, pool.remote_misses) == (1, 1, 0)
        assert pool.remote_bytes == stored.numel()
        cb.flush()
        wait_until(lambda: ca.stats(POOL).pools[0].pins == 0)  # the peer's pin went back
        for client in (ca, cb):
            assert_blocks_accounted(client, POOL)


def test_attaching_by_name_to_a_pool_only_a_peer_has_says_so_with_its_geometry() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca)
        wait_peers_synced(cb, 1)
        put(ca, "img", 4096)  # the peer's pool is learnt of with its first entry
        wait_until(lambda: peer_pool_known(cb))
        with pytest.raises(EcdError) as info:
            cb.open_pool(POOL)
        assert info.value.code.name == "NOT_FOUND"
        assert "not on this node, but a peer has it" in info.value.message
        assert f"block_size_bytes {BLOCK}, capacity_bytes {CAPACITY}" in info.value.message


def peer_pool_known(client: Client) -> bool:
    """The daemon has attached its peer's pool POOL (an attach by name then names the peer's)."""
    try:
        client.open_pool(POOL)
    except EcdError as error:
        return "a peer has it" in error.message
    raise AssertionError("the pool exists here")


def test_many_askers_of_a_key_on_one_node_share_one_pull() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca:
        open_pool(ca)
        stored = put(ca, "img", 64 << 20)
        clients = [b.client(name=f"consumer-{i}") for i in range(6)]
        try:
            for client in clients:
                open_pool(client)
            wait_peers_synced(clients[0], 1)
            wait_until(lambda: remote_view_has(clients[0], "img"))
            got: list[str] = []

            def get(client: Client) -> None:
                got.append(digest(Consumer(client, POOL, watch=False).get("img")))

            threads = [threading.Thread(target=get, args=(c,)) for c in clients]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)

            assert got == [digest(stored)] * len(clients)
            [pool] = clients[0].stats(POOL).pools
            assert (pool.remote_hits, pool.remote_reads) == (1, 1)
        finally:
            for client in clients:
                client.close()


def test_entries_cross_between_three_nodes_from_whichever_holds_them() -> None:
    with peered_daemons(3) as (a, b, c), a.client() as ca, b.client() as cb, c.client() as cc:
        for client in (ca, cb, cc):
            open_pool(client)
        wait_peers_synced(cc, 2)
        stored = put(ca, "img", 4 << 20)
        wait_until(lambda: remote_view_has(cb, "img"))
        assert digest(Consumer(cb, POOL).get("img")) == digest(stored)  # from a

        a.kill()  # now only b holds it
        wait_until(lambda: [p.state for p in cc.stats().peers].count("synced") == 1, 15)
        wait_until(lambda: remote_view_has(cc, "img"))
        assert digest(Consumer(cc, POOL).get("img")) == digest(stored)  # from b
        assert cc.stats(POOL).pools[0].remote_hits == 1
        assert_blocks_accounted(cc, POOL)


def test_a_restarted_peer_is_followed_with_its_new_epoch_and_read_again() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca), open_pool(cb)
        stored = put(ca, "before", 1 << 20)
        wait_until(lambda: remote_view_has(cb, "before"))
        old_epoch = ca.boot_epoch

        a.restart()  # SIGKILL; the new daemon re-adopts the pool, a new transfer endpoint
        wait_until(lambda: cb.stats().peers[0].boot_epoch not in ("", old_epoch), 20)
        wait_peers_synced(cb, 1)
        wait_until(lambda: remote_view_has(cb, "before"))
        assert digest(Consumer(cb, POOL).get("before")) == digest(stored)
        after = put(ca, "after", 1 << 20)  # ca rode out the restart
        wait_until(lambda: remote_view_has(cb, "after"))
        assert digest(Consumer(cb, POOL).get("after")) == digest(after)


def test_a_peer_pool_written_by_another_model_is_never_read_from() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca, compat_key="model-a")
        open_pool(cb, compat_key="model-b")
        wait_peers_synced(cb, 1)
        put(ca, "img", 1 << 20)
        wait_until(lambda: cb.stats().peers[0].keys == 1)  # b knows a holds it...

        assert not cb.view(POOL).has(b"img")  # ...but does not offer it
        assert Consumer(cb, POOL).get("img", wait_ms=200) is None
        [pool] = cb.stats(POOL).pools
        assert (pool.remote_reads, pool.remote_misses, pool.entries_pending) == (0, 0, 0)


def test_a_key_a_peer_holds_is_offered_until_the_last_holder_lets_it_go() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca), open_pool(cb)
        put(ca, "img", 64 << 10)
        wait_until(lambda: remote_view_has(cb, "img"))
        assert [r.status for r in ca.evict(POOL, ["img"])] == [Status.OK]
        wait_until(lambda: not cb.view(POOL).has(b"img"))
        assert Consumer(cb, POOL).get("img") is None


def test_stats_and_ecd_stats_list_the_peers_and_the_remote_figures() -> None:
    with peered_daemons(2) as (a, b), a.client() as ca, b.client() as cb:
        open_pool(ca), open_pool(cb)
        wait_peers_synced(cb, 1)
        put(ca, "img", 64 << 10)
        wait_until(lambda: remote_view_has(cb, "img"))
        assert Consumer(cb, POOL).get("img") is not None

        [peer] = cb.stats().peers
        assert (peer.address, peer.state, peer.boot_epoch) == (
            tcp_address(a),
            "synced",
            ca.boot_epoch,
        )
        shown = run_ecd("stats", "--address", b.address)
        assert shown.returncode == 0, shown.stderr
        assert tcp_address(a) in shown.stdout and "SYNCED" in shown.stdout
        assert "REMOTE_HITS/MISSES" in shown.stdout and " 1/0 " in shown.stdout


def test_a_daemon_with_peers_but_no_tcp_port_refuses_to_start_and_says_why(tmp_path: Path) -> None:
    done = run_ecd(
        "serve",
        "--socket",
        str(tmp_path / "ecd.sock"),
        "--shm-dir",
        str(tmp_path),
        "--peer",
        "127.0.0.1:7000",
    )
    assert done.returncode == 2
    assert "--peer needs --tcp" in done.stderr + done.stdout


@pytest.mark.parametrize("tcp", ["0.0.0.0:7878", "[::]:7878"])
def test_a_daemon_on_every_address_needs_its_transfer_host(tmp_path: Path, tcp: str) -> None:
    done = run_ecd(
        "serve",
        "--socket",
        str(tmp_path / "ecd.sock"),
        "--shm-dir",
        str(tmp_path),
        "--tcp",
        tcp,
        "--peer",
        "127.0.0.1:7000",
    )
    assert done.returncode == 2
    assert "--transfer-host" in done.stderr + done.stdout
