"""SIGHUP on a real daemon: it reads its token file, access list and metrics token file again and
serves on, with what changed logged by token name (never a token). A token removed is refused
from its next call on, its sessions' calls and Watch streams included; a file that cannot be
used leaves those in use as they were, and an error says which file and why."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ecd_testing import Daemon, auth_args, running_daemon, wait_until

from ec_client import AllocateItem, Client, EcdError, EventType, Status, check_health
from ec_daemon.tools.spawn import free_port

TOKENS = {
    "encoder": "enc-0123456789abcdef",
    "decoder": "dec-0123456789abcdef",
    "ops": "ops-0123456789abcdef",
}
KEPT = {"encoder": TOKENS["encoder"], "ops": TOKENS["ops"]}  # the decoder's token removed
ACL = """
[[rule]]
pools = ["vl-*"]
produce = ["encoder"]
consume = ["encoder", "decoder", "reader"]

[[rule]]
pools = ["*"]
admin = ["ops"]
"""
POOL = "vl-node1"
BLOCK = 4096
RELOADED = "SIGHUP: token files and access list reloaded"
NOT_RELOADED = "SIGHUP: not reloaded, the token files and access list in use are kept"


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon("--max-bytes", "64MiB", *auth_args(tmp_path, TOKENS, ACL)) as daemon:
        with as_(daemon, "ops", TOKENS["ops"]) as ops:
            ops.open_pool(POOL, BLOCK, 64 * BLOCK)
        yield daemon


def as_(daemon: Daemon, name: str, token: str) -> Client:
    return Client(daemon.address, name=name, token=token, keepalive=False)


def write_tokens(daemon: Daemon, tokens: dict[str, str]) -> None:
    path = Path(daemon.args[daemon.args.index("--token-file") + 1])
    path.write_text("".join(f"{name} {token}\n" for name, token in tokens.items()))


def hang_up(daemon: Daemon, message: str = RELOADED) -> str:
    """Send SIGHUP and wait for its log line (the line returned): one more than before."""
    before = daemon.log().count(message)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: daemon.log().count(message) > before or not daemon.running)
    assert daemon.running, f"the daemon died of SIGHUP (exit {daemon.proc.returncode})"
    [line] = [line for line in daemon.log().splitlines() if message in line][before:]
    return line


def unauthenticated(call: object) -> str:
    with pytest.raises(EcdError) as info:
        call()  # type: ignore[operator]
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    return info.value.message


def test_sighup_without_tokens_is_logged_and_the_daemon_serves_on() -> None:
    with running_daemon("--max-bytes", "64MiB") as daemon:
        assert daemon.proc is not None
        hang_up(daemon, "SIGHUP: nothing to reload")
        assert daemon.running and daemon.socket.exists()
        assert check_health(daemon.address, timeout_s=2) == "SERVING"


def test_sighup_serves_a_token_added_and_refuses_one_removed(secured: Daemon) -> None:
    reader = "rdr-0123456789abcdef"
    with as_(secured, "decoder", TOKENS["decoder"]) as decoder:
        decoder.open_pool(POOL)
        write_tokens(secured, {**KEPT, "reader": reader})
        line = hang_up(secured)
        assert "added=reader removed=decoder" in line and "rules=2" in line
        assert not any(token in secured.log() for token in [*TOKENS.values(), reader])
        assert secured.running
        # The removed token's session: refused from its next call on.
        assert unauthenticated(lambda: decoder.lookup(POOL, [b"k"])) == "unknown bearer token"
    unauthenticated(lambda: as_(secured, "decoder", TOKENS["decoder"]))
    with as_(secured, "reader", reader) as c:
        assert c.open_pool(POOL).created is False


def test_sessions_of_tokens_kept_carry_on_after_sighup(secured: Daemon) -> None:
    with as_(secured, "encoder", TOKENS["encoder"]) as encoder:
        encoder.open_pool(POOL)
        encoder.allocate(POOL, [AllocateItem("before", (16,), "uint8")])
        write_tokens(secured, KEPT)
        hang_up(secured)
        encoder.commit(POOL, ["before"])  # the same session, allocated before the reload
        [hit] = encoder.acquire(POOL, ["before"])
        assert hit.status is Status.HIT


def test_sighup_logs_a_name_whose_token_changed_as_rotated(secured: Daemon) -> None:
    rotated = "dec-fedcba9876543210"
    write_tokens(secured, {**TOKENS, "decoder": rotated})
    line = hang_up(secured)
    assert 'added="" removed="" rotated=decoder' in line and rotated not in secured.log()
    unauthenticated(lambda: as_(secured, "decoder", TOKENS["decoder"]))
    with as_(secured, "decoder", rotated) as decoder:
        assert decoder.open_pool(POOL).created is False


def test_a_watch_stream_of_a_removed_token_ends_unauthenticated(secured: Daemon) -> None:
    with (
        as_(secured, "decoder", TOKENS["decoder"]) as decoder,
        as_(secured, "encoder", TOKENS["encoder"]) as encoder,
    ):
        removed, kept = iter(decoder.watch(POOL, snapshot=True)), iter(encoder.watch(POOL))
        assert next(removed).type is EventType.SYNCED  # subscribed before the reload
        write_tokens(secured, KEPT)
        hang_up(secured)
        assert unauthenticated(lambda: next(removed)) == "unknown bearer token"
        encoder.open_pool(POOL)
        encoder.allocate(POOL, [AllocateItem("after", (16,), "uint8")])
        encoder.commit(POOL, ["after"])
        event = next(kept)
        assert (event.type, event.key) == (EventType.COMMITTED, b"after")


def test_sighup_applies_a_changed_access_list(secured: Daemon) -> None:
    acl = Path(secured.args[secured.args.index("--acl-file") + 1])
    acl.write_text(ACL.replace('produce = ["encoder"]', 'produce = ["encoder", "decoder"]'))
    with as_(secured, "decoder", TOKENS["decoder"]) as decoder:
        decoder.open_pool(POOL)
        item = AllocateItem("k", (16,), "uint8")
        with pytest.raises(EcdError) as denied:
            decoder.allocate(POOL, [item])
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        hang_up(secured)
        [allocated] = decoder.allocate(POOL, [item])
        assert allocated.status is Status.ALLOCATED


@pytest.mark.parametrize(
    ("which", "text", "why"),
    [
        ("--token-file", "decoder short\n", "token of 'decoder' is shorter than 16 chars"),
        ("--token-file", "a b c\n", ":1: expected `NAME TOKEN` or `TOKEN`, found 3 words"),
        ("--acl-file", "[[rule]\n", "cannot read access list"),
        ("--acl-file", '[[rule]]\nproduce = ["decoder"]\n', "rule 1 needs `pools`"),
    ],
    ids=["short token", "three words", "not toml", "rule without pools"],
)
def test_a_bad_file_at_sighup_keeps_the_ones_in_use(
    secured: Daemon, which: str, text: str, why: str
) -> None:
    path = Path(secured.args[secured.args.index(which) + 1])
    path.write_text(text)
    line = hang_up(secured, NOT_RELOADED)
    assert "level=error" in line and str(path) in line and why in line
    assert secured.running
    with as_(secured, "decoder", TOKENS["decoder"]) as decoder:  # the old token, the old grants
        decoder.open_pool(POOL)
        with pytest.raises(EcdError) as denied:
            decoder.allocate(POOL, [AllocateItem("k", (16,), "uint8")])
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_sighup_rotates_the_metrics_token(tmp_path: Path) -> None:
    old, new = "metrics-0123456789abcdef", "metrics-fedcba9876543210"
    page_token = tmp_path / "metrics-token"
    page_token.write_text(old + "\n")
    page_token.chmod(0o600)
    port = free_port()
    args = ("--max-bytes", "64MiB", "--metrics-port", str(port))
    with running_daemon(*args, "--metrics-token-file", str(page_token)) as daemon:
        assert scrape_status(port, old) == 200
        page_token.write_text(new + "\n")
        assert "metrics_tokens=1" in hang_up(daemon)
        assert (scrape_status(port, old), scrape_status(port, new)) == (401, 200)


def scrape_status(port: int, token: str) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_watch_stream_whose_grant_was_withdrawn_ends_permission_denied(secured: Daemon) -> None:
    acl = Path(secured.args[secured.args.index("--acl-file") + 1])
    with as_(secured, "decoder", TOKENS["decoder"]) as decoder:
        stream = iter(decoder.watch(POOL, snapshot=True))
        assert next(stream).type is EventType.SYNCED
        acl.write_text(ACL.replace('"encoder", "decoder", "reader"', '"encoder", "reader"'))
        assert "rules=2" in hang_up(secured)
        with pytest.raises(EcdError) as info:
            next(stream)
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "'decoder' may not consume in pool 'vl-node1'" in info.value.message
