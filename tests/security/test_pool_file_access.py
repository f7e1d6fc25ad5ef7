"""Who gets a pool's bytes: pool files are the daemon's alone (mode 0600), and a client of another
user maps a pool only through the open file the daemon hands the sessions the access list grants
it (its fd channel, ec_protocol/pool/fd_passing.py), never by the file's path (docs/security.md).

The clients of another user are snippets run as `nobody` (the tests run as root here); without
root, or without that user, they are skipped."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ecd_testing import REPO, Daemon, auth_args, running_daemon, wait_until

from ec_client import AllocateItem, Client, Consumer, Producer, Status
from ec_daemon.server.server import SETTLE_PERIOD_S
from ec_daemon.tools.spawn import free_port
from ec_protocol.pool import fd_passing
from ec_protocol.pool.life_marks import held

TOKENS = {"encoder": "enc-0123456789abcdef", "decoder": "dec-0123456789abcdef"}
ACL = """
[[rule]]
pools = ["shared-*"]
produce = ["encoder"]
consume = ["encoder", "decoder"]

[[rule]]
pools = ["secret-pool"]
produce = ["encoder"]
"""
BLOCK = 4096
CAPACITY = 64 * BLOCK
OTHER_USER = "nobody"
# Long enough that a session ended sooner was ended by its life mark, not its lease.
LEASE_TTL_S = 60


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    auth = auth_args(tmp_path_factory.mktemp("auth"), TOKENS, ACL)
    args = ("--max-bytes", "64MiB", "--lease-ttl", str(LEASE_TTL_S), "--socket-mode", "0666")
    with running_daemon(*args, *auth) as daemon:
        # Others may reach the socket and look paths up (as in /run/ecd and /dev/shm), not list
        # or open what is there: the socket's mode and the tokens decide who is served.
        daemon.workdir.chmod(0o711)
        daemon.shm_dir.chmod(0o711)
        yield daemon


def as_(daemon: Daemon, name: str) -> Client:
    return Client(daemon.address, name=name, token=TOKENS[name], keepalive=False)


def other_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("running a client as another user needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("running a client as another user needs setpriv (util-linux)")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pytest.skip(f"no user {OTHER_USER!r} to run a client as")


def as_other_user(daemon: Daemon, code: str) -> subprocess.Popen[str]:
    """`code` running as another user, in its own process (ADDRESS, TOKENS, BLOCK, CAPACITY
    and say(), which prints a line at once, defined); its stdin and stdout piped."""
    user = other_user()
    prelude = textwrap.dedent(f"""
        import os, sys, time
        import torch
        from ec_client import AllocateItem, Client, Consumer, EcdError, Producer
        from ec_protocol.pool import fd_passing
        ADDRESS, TOKENS, BLOCK, CAPACITY = {daemon.address!r}, {TOKENS!r}, {BLOCK}, {CAPACITY}
        def say(*words):
            print(*words, flush=True)
    """)
    # setpriv rather than setuid in preexec_fn: the interpreter may lie where only root may look
    # (a virtualenv of root's Python), which setpriv still finds.
    become = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    return subprocess.Popen(
        [*become, sys.executable, "-c", prelude + textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "HOME": "/"},
        cwd="/",
    )


def finished(proc: subprocess.Popen[str], stdin: str = "") -> list[str]:
    """The lines a process printed, once it ended (successfully)."""
    out, err = proc.communicate(stdin, timeout=60)
    assert proc.returncode == 0, f"the other user's client failed ({proc.returncode}):\n{err}"
    return out.splitlines()


def put(client: Client, engine_id: str, key: str, tensor: torch.Tensor) -> None:
    """Store `tensor` in the pool (opened by `client`), and wait until it is."""
    producer = Producer(client, engine_id)
    producer.put(key, tensor)
    producer.flush()


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    said = proc.stdout.readline().strip()
    if not said:
        proc.wait(60)
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise AssertionError(f"the other user's client said nothing ({proc.returncode}):\n{err}")
    return said


def test_pool_files_are_the_daemons_alone(daemon: Daemon) -> None:
    user = other_user()
    with as_(daemon, "encoder") as encoder:
        path = encoder.open_pool("shared-mode", BLOCK, CAPACITY).path
    held = os.stat(path)
    assert (held.st_mode & 0o777, held.st_uid) == (0o600, os.getuid())
    assert held.st_uid != user.pw_uid
    said = finished(
        as_other_user(
            daemon,
            f"""
            try:
                open({path!r}, "rb")
            except PermissionError:
                say("denied")
            """,
        )
    )
    assert said == ["denied"]


def test_a_granted_consumer_of_another_user_reads_the_pool_through_the_file_handed_to_it(
    daemon: Daemon,
) -> None:
    with as_(daemon, "encoder") as encoder:
        encoder.open_pool("shared-read", BLOCK, CAPACITY)
        put(encoder, "shared-read", "from-the-daemons-user", torch.arange(2048, dtype=torch.int32))
        said = finished(
            as_other_user(
                daemon,
                """
                with Client(ADDRESS, name="reader", token=TOKENS["decoder"]) as c:
                    c.open_pool("shared-read")
                    t = Consumer(c, "shared-read").get("from-the-daemons-user", device="cpu")
                    say("read", int(t.sum()), t.dtype)
                """,
            )
        )
    assert said == [f"read {sum(range(2048))} torch.int32"]


def test_a_granted_producer_of_another_user_writes_the_pool_through_the_file_handed_to_it(
    daemon: Daemon,
) -> None:
    with as_(daemon, "encoder") as encoder:
        encoder.open_pool("shared-write", BLOCK, CAPACITY)
        finished(
            as_other_user(
                daemon,
                """
                with Client(ADDRESS, name="writer", token=TOKENS["encoder"]) as c:
                    c.open_pool("shared-write", BLOCK, CAPACITY)
                    producer = Producer(c, "shared-write")
                    producer.put("from-another-user", torch.full((1000,), 7, dtype=torch.int16))
                    producer.flush()
                """,
            )
        )
        t = Consumer(encoder, "shared-write").get("from-another-user", device="cpu")
    assert t is not None and t.dtype == torch.int16 and t.tolist() == [7] * 1000


def test_a_token_refused_the_pool_gets_neither_a_ticket_nor_its_file(daemon: Daemon) -> None:
    with as_(daemon, "encoder") as encoder:
        info = encoder.open_pool("secret-pool", BLOCK, CAPACITY)
        put(encoder, "secret-pool", "secret", torch.full((1024,), 42, dtype=torch.uint8))
    channel = fd_passing.fd_channel_path(daemon.socket)
    said = finished(
        as_other_user(
            daemon,
            f"""
            def refusal(call):
                try:
                    call()
                except EcdError as error:
                    return error.code.name
                except fd_passing.ChannelError as error:
                    return error.code
                except OSError as error:
                    return type(error).__name__
                return "granted"
            c = Client(ADDRESS, name="snoop", token=TOKENS["decoder"])
            say("open_pool", refusal(lambda: c.open_pool("secret-pool")))
            say("path", refusal(lambda: open({info.path!r}, "rb")))
            say("ticket", refusal(lambda: fd_passing.exchange({channel!r}, b"ticket made-up")))
            with open("/etc/passwd", "rb") as mine:  # a file it may open, not a pool's
                dup = lambda: fd_passing.exchange({channel!r}, b"dup r", mine.fileno())
                say("dup", refusal(dup))
            """,
        )
    )
    assert said == [
        "open_pool PERMISSION_DENIED",
        "path PermissionError",
        "ticket PERMISSION_DENIED",
        "dup NOT_FOUND",
    ]


def test_a_ticket_buys_the_pool_file_once(daemon: Daemon) -> None:
    with as_(daemon, "encoder") as encoder:
        # The first open of the pool in this process: its ticket was redeemed as the reply came.
        info = encoder.open_pool("shared-ticket", BLOCK, CAPACITY)
        assert info.fd_ticket
        with pytest.raises(fd_passing.ChannelError) as refused:
            fd_passing.exchange(
                fd_passing.fd_channel_path(daemon.socket), b"ticket " + info.fd_ticket.encode()
            )
    assert refused.value.code == "PERMISSION_DENIED"
    assert "unknown ticket" in refused.value.message


def test_a_read_only_file_buys_no_read_write_one(daemon: Daemon) -> None:
    with as_(daemon, "encoder") as encoder:
        info = encoder.open_pool("shared-read-only", BLOCK, CAPACITY)
    channel = fd_passing.fd_channel_path(daemon.socket)
    read_only = os.open(info.path, os.O_RDONLY)
    try:
        with pytest.raises(fd_passing.ChannelError) as refused:
            fd_passing.exchange(channel, b"dup rw", read_only)
        again = fd_passing.exchange(channel, b"dup r", read_only)
    finally:
        os.close(read_only)
    try:
        assert os.fstat(again).st_ino == os.stat(info.path).st_ino
    finally:
        os.close(again)
    assert refused.value.code == "PERMISSION_DENIED"
    assert "read-write open needs a read-write file" in refused.value.message


def test_another_users_lock_pins_hold_an_entry(daemon: Daemon) -> None:
    with as_(daemon, "encoder") as encoder:
        encoder.open_pool("shared-pins", BLOCK, CAPACITY)
        put(encoder, "shared-pins", "pinned", torch.ones(512, dtype=torch.uint8))
        holder = as_other_user(
            daemon,
            """
            from ec_protocol.pool.slot_locks import SlotPins
            c = Client(ADDRESS, name="holder", token=TOKENS["decoder"])
            c.open_pool("shared-pins")
            view = c.view("shared-pins")
            assert view.wait_synced(10)
            info = c.pool_info("shared-pins")
            pins = SlotPins(info.path, info.pool_uuid)
            assert pins.pin(view.slot(b"pinned"), b"pinned") is not None
            say("pinned")
            sys.stdin.readline()
            """,
        )
        try:
            assert line(holder) == "pinned"
            [pool] = encoder.stats("shared-pins").pools
            assert pool.entries_locked == 1
        finally:
            finished(holder, "done\n")
        wait_until(lambda: encoder.stats("shared-pins").pools[0].entries_locked == 0)


def test_another_users_client_that_dies_ends_its_session_at_once(daemon: Daemon) -> None:
    with as_(daemon, "encoder") as encoder:
        path = encoder.open_pool("shared-deaths", BLOCK, CAPACITY).path
        victim = as_other_user(
            daemon,
            """
            c = Client(ADDRESS, name="victim", token=TOKENS["encoder"])
            c.open_pool("shared-deaths", BLOCK, CAPACITY)
            c.allocate("shared-deaths", [AllocateItem("half-written", (4096,), "uint8")])
            say(c.session_id)
            time.sleep(120)
            """,
        )
        try:
            session_id = line(victim)
            # Its life mark is on the file the daemon handed it...
            with open(path, "rb") as pool_file:
                wait_until(lambda: held(pool_file.fileno(), session_id))
            # ...and the daemon, which probes marks every SETTLE_PERIOD_S, has seen it there (a
            # session never seen marked is left to its lease).
            time.sleep(5 * SETTLE_PERIOD_S)
        finally:
            victim.kill()
            victim.communicate(timeout=60)
        item = [AllocateItem("half-written", (4096,), "uint8")]
        # Within the lease (60 s): its life mark, on the file the daemon handed over, went.
        wait_until(
            lambda: encoder.allocate("shared-deaths", item)[0].status is Status.ALLOCATED,
            timeout_s=LEASE_TTL_S / 2,
        )


def test_another_users_client_carries_on_after_a_restart(daemon: Daemon) -> None:
    with as_(daemon, "encoder") as encoder:
        encoder.open_pool("shared-restart", BLOCK, CAPACITY)
    client = as_other_user(
        daemon,
        """
        with Client(ADDRESS, name="survivor", token=TOKENS["encoder"], wait_for_daemon_s=30) as c:
            c.open_pool("shared-restart", BLOCK, CAPACITY)
            producer = Producer(c, "shared-restart")
            producer.put("before", torch.full((100,), 1, dtype=torch.int64))
            producer.flush()
            say("put")
            sys.stdin.readline()  # the daemon restarts meanwhile
            producer.put("after", torch.full((100,), 2, dtype=torch.int64))
            producer.flush()
            before = Consumer(c, "shared-restart").get("before", device="cpu")
            say("read", int(before.sum()))
        """,
    )
    assert line(client) == "put"
    daemon.restart()
    assert finished(client, "go\n") == ["read 100"]
    said = finished(
        as_other_user(
            daemon,
            """
            with Client(ADDRESS, name="newcomer", token=TOKENS["decoder"]) as c:
                c.open_pool("shared-restart")
                consumer = Consumer(c, "shared-restart")
                say(*(int(consumer.get(k, device="cpu").sum()) for k in ("before", "after")))
            """,
        )
    )
    assert said == ["100 200"]


def test_a_client_over_tcp_gets_no_ticket_and_opens_the_pool_by_its_path() -> None:
    port = free_port()
    with (
        running_daemon("--max-bytes", "64MiB", "--tcp", f"127.0.0.1:{port}"),
        Client(f"127.0.0.1:{port}", name="over-tcp", keepalive=False) as c,
    ):
        info = c.open_pool("by-path", BLOCK, CAPACITY)
        assert info.fd_ticket == ""  # it could not redeem one: the channel is a Unix socket
        put(c, "by-path", "k", torch.full((10,), 3, dtype=torch.uint8))
        t = Consumer(c, "by-path").get("k", device="cpu")
    assert t is not None and t.tolist() == [3] * 10


def test_a_pool_group_beside_an_access_list_is_warned_about(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    auth = auth_args(tmp_path_factory.mktemp("auth"), TOKENS, ACL)
    group = str(os.getgid())
    with running_daemon("--max-bytes", "64MiB", "--pool-group", group, *auth) as daemon:
        log = daemon.log()
    assert "pool_group gives every member of its group every pool's bytes" in log
    assert f"pool_group={group}" in log


def test_the_fd_channel_lies_beside_the_socket_with_its_mode_and_goes_with_it() -> None:
    with running_daemon("--max-bytes", "64MiB", "--socket-mode", "0600") as daemon:
        channel = Path(fd_passing.fd_channel_path(daemon.socket))
        held = channel.stat()
        assert stat.S_ISSOCK(held.st_mode) and stat.S_IMODE(held.st_mode) == 0o600
        assert daemon.stop() == 0
        assert not channel.exists() and not daemon.socket.exists()
