"""Access control on a real daemon: bearer tokens, per-pool access lists, TLS and mutual TLS,
file and socket permissions, size limits."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ecd_testing import Daemon, auth_args, running_daemon
from pki_testing import make_pki, tls_args

from ec_client import AllocateItem, Client, EcdError, Status, TLSFiles, check_health
from ec_daemon.tools.spawn import free_port

TOKENS = {
    "encoder": "enc-0123456789abcdef",
    "decoder": "dec-0123456789abcdef",
    "ops": "ops-0123456789abcdef",
}
ACL = """
[[rule]]
pools = ["vl-*"]
produce = ["encoder"]
consume = ["encoder", "decoder"]

[[rule]]
pools = ["*"]
admin = ["ops"]
"""
BLOCK = 4096


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    auth = auth_args(tmp_path_factory.mktemp("auth"), TOKENS, ACL)
    with running_daemon("--max-bytes", "64MiB", *auth) as daemon:
        yield daemon


def as_(daemon: Daemon, name: str) -> Client:
    return Client(daemon.address, name=name, token=TOKENS[name], keepalive=False)


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(EcdError) as info:
        call()  # type: ignore[operator]
    return info.value.code


def test_a_call_without_a_token_is_unauthenticated(secured: Daemon) -> None:
    with pytest.raises(EcdError) as info:
        Client(secured.address, name="anonymous", keepalive=False)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in info.value.message


def test_a_call_with_an_unknown_token_is_unauthenticated(secured: Daemon) -> None:
    with pytest.raises(EcdError) as info:
        Client(secured.address, token="not-a-real-token-at-all", keepalive=False)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "unknown bearer token" in info.value.message


def test_health_needs_no_token_so_probes_work(secured: Daemon) -> None:
    assert secured.running
    assert check_health(secured.address, timeout_s=2) == "SERVING"


def test_granted_producers_and_consumers_share_a_pool(secured: Daemon) -> None:
    with as_(secured, "encoder") as encoder, as_(secured, "decoder") as decoder:
        encoder.open_pool("vl-node1", BLOCK, 64 * BLOCK)
        decoder.open_pool("vl-node1", BLOCK, 64 * BLOCK)
        encoder.allocate("vl-node1", [AllocateItem("img", (16,), "uint8")])
        encoder.commit("vl-node1", ["img"])
        [hit] = decoder.acquire("vl-node1", ["img"])
        assert hit.status is Status.HIT
        decoder.release([hit.lease_id])


def test_a_consumer_may_not_produce(secured: Daemon) -> None:
    with as_(secured, "encoder") as encoder, as_(secured, "decoder") as decoder:
        encoder.open_pool("vl-node1", BLOCK, 64 * BLOCK)
        decoder.open_pool("vl-node1", BLOCK, 64 * BLOCK)
        items = [AllocateItem("forged", (16,), "uint8")]
        assert code_of(lambda: decoder.allocate("vl-node1", items)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )


def test_a_consumer_may_attach_to_a_pool_but_not_create_one(secured: Daemon) -> None:
    with (
        as_(secured, "encoder") as encoder,
        as_(secured, "decoder") as decoder,
        as_(secured, "ops") as ops,
    ):
        with pytest.raises(EcdError) as info:
            decoder.open_pool("vl-made-by-a-consumer", BLOCK, 64 * BLOCK)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "'decoder' may not produce in pool 'vl-made-by-a-consumer'" in info.value.message
        assert "creating a pool needs produce" in info.value.message
        assert "vl-made-by-a-consumer" not in {p.engine_id for p in ops.stats().pools}
        encoder.open_pool("vl-made-by-a-consumer", BLOCK, 64 * BLOCK)
        assert decoder.open_pool("vl-made-by-a-consumer", BLOCK, 64 * BLOCK).created is False
        assert decoder.open_pool("vl-made-by-a-consumer").num_blocks == 64


def test_nobody_but_an_admin_may_evict(secured: Daemon) -> None:
    with as_(secured, "encoder") as encoder, as_(secured, "ops") as ops:
        encoder.open_pool("vl-node1", BLOCK, 64 * BLOCK)
        encoder.allocate("vl-node1", [AllocateItem("victim", (16,), "uint8")])
        encoder.commit("vl-node1", ["victim"])
        denied = code_of(lambda: encoder.evict("vl-node1", ["victim"]))
        assert denied == grpc.StatusCode.PERMISSION_DENIED
        assert [r.status for r in ops.evict("vl-node1", ["victim"])] == [Status.OK]


def test_pools_outside_every_grant_are_closed(secured: Daemon) -> None:
    with as_(secured, "decoder") as decoder:
        with pytest.raises(EcdError) as info:
            decoder.open_pool("other-model")
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "'decoder' may not produce or consume in pool 'other-model'" in info.value.message


def test_stats_of_every_pool_is_for_admins(secured: Daemon) -> None:
    with as_(secured, "decoder") as decoder, as_(secured, "ops") as ops:
        assert code_of(decoder.stats) == grpc.StatusCode.PERMISSION_DENIED
        assert ops.stats().max_bytes == 64 << 20


def trusted(tokens: Path) -> tuple[str, ...]:
    """A token file with no access list: every token an admin, as the daemon is told."""
    return ("--token-file", str(tokens), "--trust-all-tokens", "true")


def test_a_token_file_without_an_access_list_is_refused_at_startup(
    tmp_path: Path, shm_dir: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"encoder {TOKENS['encoder']}\n")
    tokens.chmod(0o600)
    daemon = Daemon(tmp_path, shm_dir, ("--token-file", str(tokens)))
    with pytest.raises(RuntimeError) as info:
        daemon.start()
    assert f"token file {tokens} without an access list makes every token an admin" in str(
        info.value
    )
    assert "add --acl-file" in str(info.value) and "--trust-all-tokens" in str(info.value)
    assert daemon.proc is not None and daemon.proc.returncode == 2


def test_trust_all_tokens_makes_every_token_an_admin_and_says_so(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"encoder {TOKENS['encoder']}\ndecoder {TOKENS['decoder']}\n")
    tokens.chmod(0o600)
    with running_daemon("--max-bytes", "64MiB", *trusted(tokens)) as daemon:
        [warning] = [ln for ln in daemon.log().splitlines() if "every token is an admin" in ln]
        assert "level=warning" in warning and str(tokens) in warning
        with Client(daemon.address, token=TOKENS["encoder"], keepalive=False) as encoder:
            encoder.open_pool("secret", BLOCK, 64 * BLOCK)
        with Client(daemon.address, token=TOKENS["decoder"], keepalive=False) as decoder:
            decoder.drop_pool("secret")
            assert decoder.stats().pools == ()


def test_trust_all_tokens_with_an_access_list_is_refused_as_a_contradiction(
    tmp_path: Path, shm_dir: Path
) -> None:
    auth = auth_args(tmp_path, TOKENS, ACL)
    daemon = Daemon(tmp_path, shm_dir, (*auth, "--trust-all-tokens", "true"))
    with pytest.raises(RuntimeError, match="give one of them"):
        daemon.start()


def test_a_bad_token_file_stops_the_daemon_at_startup(tmp_path: Path, shm_dir: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("encoder short\n")
    daemon = Daemon(tmp_path, shm_dir, ("--token-file", str(tokens)))
    with pytest.raises(RuntimeError, match="shorter than 16"):
        daemon.start()
    assert daemon.proc is not None and daemon.proc.returncode == 2


def test_a_hash_inside_a_token_is_part_of_the_token(tmp_path: Path) -> None:
    token = "abcdefghijklmnopq#rstuvwxyz0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# comment\nweak {token}\n")
    tokens.chmod(0o600)
    with running_daemon("--max-bytes", "64MiB", *trusted(tokens)) as daemon:
        with Client(daemon.address, token=token, keepalive=False) as c:
            assert c.health() == "SERVING"
        with pytest.raises(EcdError) as info:
            Client(daemon.address, token=token.split("#")[0], keepalive=False)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_token_line_of_three_words_is_refused_naming_the_line(
    tmp_path: Path, shm_dir: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"encoder {TOKENS['encoder']}  # ok\ndecoder {TOKENS['decoder']} old\n")
    daemon = Daemon(tmp_path, shm_dir, ("--token-file", str(tokens)))
    with pytest.raises(RuntimeError, match=f"{tokens}:2: expected `NAME TOKEN`"):
        daemon.start()


def test_a_token_file_others_may_read_is_warned_about(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"encoder {TOKENS['encoder']}\n")
    tokens.chmod(0o644)
    with running_daemon("--max-bytes", "64MiB", *trusted(tokens)) as daemon:
        assert "token file is readable by every user" in daemon.log()


def test_tls_on_tcp_serves_clients_that_trust_the_ca_and_not_plaintext(tmp_path: Path) -> None:
    ca, server, _ = make_pki(tmp_path)
    port = free_port()
    with running_daemon(*tls_args(port, server)):
        with Client(f"127.0.0.1:{port}", tls=TLSFiles(ca=ca), keepalive=False) as c:
            assert c.health() == "SERVING"
        with pytest.raises(EcdError) as info:
            Client(f"127.0.0.1:{port}", keepalive=False, connect_timeout_s=1)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_files_may_be_named_by_strings(tmp_path: Path) -> None:
    ca, server, client = make_pki(tmp_path)
    port = free_port()
    named = TLSFiles(ca=str(ca), cert=str(client.cert), key=str(client.key))
    with (
        running_daemon(*tls_args(port, server, client_ca=ca)),
        Client(f"127.0.0.1:{port}", tls=named, keepalive=False) as c,
    ):
        assert c.health() == "SERVING"
    assert named == TLSFiles(ca=ca, cert=client.cert, key=client.key)  # one channel for both


def test_mutual_tls_refuses_clients_without_a_certificate(tmp_path: Path) -> None:
    ca, server, client = make_pki(tmp_path)
    port = free_port()
    with running_daemon(*tls_args(port, server, client_ca=ca)):
        mutual = TLSFiles(ca=ca, cert=client.cert, key=client.key)
        with Client(f"127.0.0.1:{port}", tls=mutual, keepalive=False) as c:
            assert c.stats().sessions == 1
        with pytest.raises(EcdError):
            Client(f"127.0.0.1:{port}", tls=TLSFiles(ca=ca), keepalive=False, connect_timeout_s=1)


def test_tls_misconfigurations_are_named_with_why_not_as_a_daemon_that_is_not_running(
    tmp_path: Path,
) -> None:
    ca, server, _ = make_pki(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _, stranger = make_pki(tmp_path / "other")
    port = free_port()
    target = f"127.0.0.1:{port}"
    cases = {
        "another CA": (TLSFiles(ca=other_ca), "TLS handshake failed: the daemon's certificate"),
        "plaintext": (None, "it serves TLS; give the client the CA"),
        "no client certificate": (TLSFiles(ca=ca), "requires a client certificate"),
        "an untrusted client certificate": (
            TLSFiles(ca=ca, cert=stranger.cert, key=stranger.key),
            "it does not trust the client's certificate",
        ),
    }
    with running_daemon(*tls_args(port, server, client_ca=ca)):
        for case, (tls, why) in cases.items():
            with pytest.raises(EcdError) as info:
                Client(target, tls=tls, keepalive=False, connect_timeout_s=0.5)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, case
            assert target in info.value.message and why in info.value.message, case
            assert "is the daemon running" not in info.value.message, case
            with pytest.raises(EcdError, match=why):
                check_health(target, timeout_s=0.5, tls=tls)


def test_a_client_reads_the_daemons_token_file_and_picks_its_token_by_name(
    secured: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "tokens"
    shared.write_text("# the daemon's file\n" + "".join(f"{n} {t}\n" for n, t in TOKENS.items()))
    monkeypatch.setenv("ECD_TOKEN_FILE", str(shared))
    with pytest.raises(EcdError) as ambiguous:
        Client(secured.address, keepalive=False)
    assert ambiguous.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds 3 tokens (encoder, decoder, ops)" in ambiguous.value.message
    assert "ECD_TOKEN_NAME" in ambiguous.value.message
    monkeypatch.setenv("ECD_TOKEN_NAME", "ops")
    with Client(secured.address, keepalive=False) as ops:
        assert ops.stats().max_bytes == 64 << 20  # admin: the ops token was sent
    own = tmp_path / "decoder-token"
    own.write_text(f"decoder {TOKENS['decoder']}\n")
    monkeypatch.delenv("ECD_TOKEN_NAME")
    monkeypatch.setenv("ECD_TOKEN_FILE", str(own))
    with Client(secured.address, keepalive=False) as decoder:
        assert code_of(decoder.stats) == grpc.StatusCode.PERMISSION_DENIED  # decoder, not admin


def test_a_token_that_cannot_be_sent_is_refused_by_the_client_with_a_message(
    secured: Daemon,
) -> None:
    with pytest.raises(EcdError) as info:
        Client(secured.address, token="two\nlines", keepalive=False)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "spaces or control characters" in info.value.message


def test_pool_files_and_socket_take_the_configured_group_and_modes() -> None:
    gid = os.getgid()
    args = (
        "--max-bytes",
        "64MiB",
        "--socket-group",
        str(gid),
        "--socket-mode",
        "0600",
        "--pool-group",
        str(gid),
        "--pool-mode",
        "0660",
    )
    with running_daemon(*args) as daemon, daemon.client() as c:
        info = c.open_pool("grouped", BLOCK, 64 * BLOCK)
        pool_stat, socket_stat = os.stat(info.path), os.stat(daemon.socket)
        assert (stat.S_IMODE(pool_stat.st_mode), pool_stat.st_gid) == (0o660, gid)
        assert (stat.S_IMODE(socket_stat.st_mode), socket_stat.st_gid) == (0o600, gid)


def test_a_pool_larger_than_the_per_pool_limit_is_refused() -> None:
    with running_daemon("--max-bytes", "64MiB", "--max-pool-bytes", "1MiB") as d, d.client() as c:
        with pytest.raises(EcdError) as info:
            c.open_pool("big", BLOCK, 2 << 20)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "per-pool limit" in info.value.message
        assert c.open_pool("small", BLOCK, 1 << 20).num_blocks == 256


def test_a_message_over_the_size_limit_is_resource_exhausted() -> None:
    with (
        running_daemon("--max-bytes", "64MiB", "--max-message-bytes", "64KiB") as d,
        d.client() as c,
    ):
        c.open_pool("p", BLOCK, 64 * BLOCK)
        keys = [b"k" * 200] * 1000  # ~200 KB of keys, under the batch limit
        with pytest.raises(EcdError) as info:
            c.lookup("p", keys)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.health() == "SERVING"


def test_a_step_needs_the_grant_of_each_of_its_parts(secured: Daemon) -> None:
    with as_(secured, "encoder") as encoder, as_(secured, "decoder") as decoder:
        encoder.open_pool("vl-step", 4096, 64 * 4096)
        decoder.open_pool("vl-step", 4096, 64 * 4096)
        item = AllocateItem("k", (4096,), "uint8")
        assert encoder.step("vl-step", allocates=[item]).allocates[0].status is Status.ALLOCATED
        # The decoder may consume, so a Step that only acquires is fine, one that allocates not.
        assert decoder.step("vl-step", acquires=["k"]).acquires[0].status is Status.PENDING
        refused = code_of(lambda: decoder.step("vl-step", acquires=["k"], allocates=[item]))
        assert refused == grpc.StatusCode.PERMISSION_DENIED
