"""The operator's client commands against a real daemon (or none): what they print, their exit
status, and errors that name the daemon's address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ecd_testing import REPO, Daemon, auth_args, run_ecd, running_daemon
from pki_testing import make_pki, tls_args

from ec_client import AllocateItem, EntryState, Status, __version__
from ec_daemon.tools.spawn import free_port

POOL = "cli-pool"
BLOCK = 7168
MiB = 1 << 20


def ecd(daemon: Daemon, *args: str) -> tuple[int, str, str]:
    result = run_ecd(*args, "--address", daemon.address)
    return result.returncode, result.stdout, result.stderr


def test_ecd_version_prints_the_version() -> None:
    result = run_ecd("--version")
    assert (result.returncode, result.stdout) == (0, f"ecd {__version__}\n")


def test_ecd_health_on_a_missing_socket_fails_at_once_naming_it(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/absent/ecd.sock"
    # A --timeout longer than run_ecd's own (30 s): waiting it out would fail this test.
    result = run_ecd("health", "--address", address, "--timeout", "120")
    assert result.returncode == 1
    assert address in result.stdout and "no socket at" in result.stdout


@pytest.mark.parametrize(
    "command", [["stats"], ["ls", POOL], ["evict", POOL, "k"], ["delete", POOL, "k"]]
)
def test_every_client_command_on_a_missing_socket_fails_at_once_naming_it(
    tmp_path: Path, command: list[str]
) -> None:
    address = f"unix://{tmp_path}/absent/ecd.sock"
    result = run_ecd(*command, "--address", address, "--timeout", "120")
    assert result.returncode == 1
    assert address in result.stderr and "no socket at" in result.stderr


def test_a_pool_that_does_not_exist_is_named_as_such(daemon: Daemon) -> None:
    status, _, err = ecd(daemon, "ls", "no-such-pool")
    assert status == 1
    assert "'no-such-pool' does not exist" in err and "ecd stats" in err
    assert "OpenPool first" not in err


def test_ecd_delete_drops_a_pinned_entry_that_ecd_evict_refuses(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("pinned", (BLOCK,), "uint8")])
        c.commit(POOL, ["pinned"])
        [hit] = c.acquire(POOL, ["pinned"])
        status, out, _ = ecd(daemon, "evict", POOL, "pinned")
        assert status == 1 and "pinned 1 time(s)" in out and "ecd delete" in out
        status, out, _ = ecd(daemon, "delete", POOL, "pinned", "never-made", "--json")
        assert status == 1  # one key of the two was not there
        assert [r["status"] for r in json.loads(out)] == ["ok", "not_found"]
        assert c.lookup(POOL, ["pinned"])[0].state is EntryState.ABSENT
        assert c.release([hit.lease_id])[0].status is Status.OK
        [pool] = c.stats(POOL).pools
        assert pool.free_blocks == pool.num_blocks  # its block came back at the release


def test_ecd_stats_shows_each_pools_capacity_file_size_and_compat_key(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * MiB, "Qwen2.5-VL-7B|bf16|3584")
        c.open_pool("anonymous", 4096, 4 * MiB)
        status, out, _ = ecd(daemon, "stats")
        assert status == 0
        [header, row] = [line for line in out.splitlines() if "CAPACITY" in line or POOL in line]
        assert header.split()[:3] == ["POOL", "CAPACITY", "FILE"]
        assert row.split()[:5] == [POOL, "64.0", "MiB", "66.0", "MiB"]
        assert row.split()[-1] == "Qwen2.5-VL-7B|bf16|3584"
        assert "budget 68.0 MiB of 256.0 MiB in pool capacity; pool files 72.0 MiB" in out
        status, out, _ = ecd(daemon, "stats", POOL, "--json")
        [pool] = json.loads(out)["pools"]
        assert pool["compat_key"] == "Qwen2.5-VL-7B|bf16|3584"
        assert pool["reserved_bytes"] - pool["capacity_bytes"] == 2 * MiB


def test_ecd_stats_counts_the_sessions_of_others_not_its_own(daemon: Daemon) -> None:
    with daemon.client():
        status, out, _ = ecd(daemon, "stats")
        assert status == 0 and " sessions 1 " in out
        status, out, _ = ecd(daemon, "stats", "--json")
        assert json.loads(out)["sessions"] == 1
    status, out, _ = ecd(daemon, "stats", "--json")
    assert json.loads(out)["sessions"] == 0


def test_ecd_stats_marks_an_ephemeral_pool(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool("run-1_dp0", BLOCK, 4 * MiB, ephemeral=True)
        status, out, _ = ecd(daemon, "stats")
        assert status == 0 and "run-1_dp0 (ephemeral)" in out
        status, out, _ = ecd(daemon, "stats", "run-1_dp0", "--json")
        assert json.loads(out)["pools"][0]["ephemeral"] is True


def test_a_key_that_is_not_hex_after_0x_is_a_usage_error(daemon: Daemon) -> None:
    status, _, err = ecd(daemon, "delete", POOL, "0xZZ")
    assert status == 2
    assert err.startswith("usage: ecd delete")
    assert "'0xZZ' is not a key" in err and "Traceback" not in err


def test_an_unknown_flag_gets_the_subcommands_usage(daemon: Daemon) -> None:
    status, _, err = ecd(daemon, "stats", "--bogus")
    assert status == 2
    assert err.startswith("usage: ecd stats")
    assert "unrecognized arguments: --bogus" in err


def test_a_listing_piped_into_a_reader_that_leaves_early_ends_quietly(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, 16, 4096 * 16)
        keys = [f"key-{i:04d}-" + "x" * 60 for i in range(2000)]
        c.allocate(POOL, [AllocateItem(k, (16,), "uint8") for k in keys])
        c.commit(POOL, keys)
    ls = subprocess.Popen(
        [sys.executable, "-m", "ec_daemon", "ls", POOL, "--address", daemon.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    assert ls.stdout is not None and ls.stderr is not None
    assert ls.stdout.readline().startswith(b"STATE")
    ls.stdout.close()  # as `| head -1` does
    err = ls.stderr.read().decode()
    assert ls.wait(30) == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_ecd_drop_deletes_a_pool_and_gives_its_capacity_back(daemon: Daemon) -> None:
    with daemon.client() as c:
        info = c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("k", (BLOCK,), "uint8")])
        status, _, err = ecd(daemon, "drop", POOL)
        assert status == 1 and "PENDING" in err and "force" in err
        status, out, _ = ecd(daemon, "drop", POOL, "--force")
        assert status == 0 and f"dropped pool {POOL!r} and its 1 entries" in out
        assert not c.stats().pools and not Path(info.path).exists()


def test_ecd_ls_puts_the_key_last_so_a_long_key_pads_no_other_column(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        long_key, short_key = "k" * 256, "short"
        c.allocate(POOL, [AllocateItem(k, (16,), "uint8") for k in (long_key, short_key)])
        status, out, _ = ecd(daemon, "ls", POOL)
    assert status == 0
    header, *rows = out.splitlines()
    assert header.split()[-1] == "KEY"
    short_row = next(r for r in rows if r.endswith(short_key))
    assert len(short_row) < 100


def test_ecd_ls_with_no_pool_lists_the_pools(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.open_pool("empty", 4096, 4 * MiB)
        c.allocate(POOL, [AllocateItem(k, (BLOCK,), "uint8") for k in ("a", "b", "pending")])
        c.commit(POOL, ["a", "b"])
        status, out, err = ecd(daemon, "ls")
        assert status == 0, err
        header, *rows = out.splitlines()
        assert header.split() == ["POOL", "READY", "PENDING", "BYTES", "CAPACITY", "BLOCK"]
        assert sorted(row.split()[:3] for row in rows) == [
            ["cli-pool", "2", "1"],
            ["empty", "0", "0"],
        ]
        status, out, _ = ecd(daemon, "ls", "--json")
        listed = {p["engine_id"]: p for p in json.loads(out)}
        assert listed[POOL]["bytes_ready"] == 2 * BLOCK
        assert listed["empty"]["capacity_bytes"] == 4 * MiB


CLIENT_COMMANDS = ["health", "stats", "ls", "evict", "delete", "drop"]


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_every_client_commands_help_names_the_variables_it_reads_and_its_timeouts_default(
    command: str,
) -> None:
    text = " ".join(run_ecd(command, "--help", check=True).stdout.split())
    for variable in ("ECD_ADDRESS", "ECD_TOKEN", "ECD_TLS_CA", "ECD_TLS_CERT", "ECD_TLS_KEY"):
        assert variable in text, variable
    assert "--timeout TIMEOUT seconds to reach the daemon [default: 5]" in text


@pytest.mark.parametrize("command", ["stats", "ls", "evict", "delete", "drop"])
def test_a_command_on_a_pool_names_it_pool_and_says_what_it_is(command: str) -> None:
    usage, _, arguments = run_ecd(command, "--help", check=True).stdout.partition("positional")
    assert "POOL" in usage and "engine" not in usage
    [pool] = [line.split() for line in arguments.splitlines() if line.split()[:1] == ["POOL"]]
    assert len(pool) > 1, "POOL without a help line"


def test_client_commands_take_the_daemons_token_as_a_flag(tmp_path: Path) -> None:
    token = "a-token-of-thirty-two-characters!"
    auth = auth_args(
        tmp_path, {"operator": token}, '[[rule]]\npools = ["*"]\nadmin = ["operator"]\n'
    )
    with running_daemon("--max-bytes", "64MiB", *auth) as daemon:
        status, _, err = ecd(daemon, "stats")
        assert status == 1 and "UNAUTHENTICATED" in err, err
        status, out, err = ecd(daemon, "stats", "--token", token)
        assert status == 0 and "sessions 0" in out, err


def test_client_commands_take_the_tls_files_as_flags(tmp_path: Path) -> None:
    ca, server, client = make_pki(tmp_path)
    port = free_port()
    files = ("--tls-ca", str(ca), "--tls-cert", str(client.cert), "--tls-key", str(client.key))
    with running_daemon(*tls_args(port, server, client_ca=ca)):
        for command in ("health", "stats"):
            result = run_ecd(command, "--address", f"127.0.0.1:{port}", *files)
            assert result.returncode == 0, result.stdout + result.stderr


def test_ecd_health_checks_one_health_service_of_the_daemon(daemon: Daemon) -> None:
    status, out, _ = ecd(daemon, "health", "--service", "ecd.v1.EncoderCache")
    assert (status, out) == (0, "SERVING\n")
    status, out, _ = ecd(daemon, "health", "--service", "ecd.cluster")  # a daemon with no store
    assert status == 1
    assert out.startswith("SERVICE_UNKNOWN") and "no health service 'ecd.cluster'" in out


def refuse_at_restart(daemon: Daemon, *pools: str) -> dict[str, Path]:
    """Pools whose files a restart refuses: each named `hdr` has its header written over (the
    file no longer reads as an ecd pool file), each other one is cut short (its header intact)."""
    with daemon.client() as c:
        paths = {pool: Path(c.open_pool(pool, BLOCK, 64 * BLOCK).path) for pool in pools}
    daemon.kill()
    for pool, path in paths.items():
        if "hdr" in pool:
            with path.open("r+b") as f:
                f.write(b"\0" * 64)
        else:
            os.truncate(path, path.stat().st_size // 2)
    daemon.start()
    return paths


def test_ecd_stats_and_ls_list_a_refused_pool_file_with_its_reason(daemon: Daemon) -> None:
    [path] = refuse_at_restart(daemon, "p-hdr").values()
    with daemon.client() as c:
        [refused] = c.stats().refused
    assert (refused.engine_id, refused.path) == ("p-hdr", str(path))
    assert "bad magic" in refused.reason
    for command in ("stats", "ls"):
        status, out, err = ecd(daemon, command)
        assert status == 0, err
        [row] = [line for line in out.splitlines() if line.startswith("p-hdr ")]
        assert str(path) in row and "bad magic" in row, out
    status, out, _ = ecd(daemon, "ls", "--json")
    [listed] = json.loads(out)
    assert listed["engine_id"] == "p-hdr" and "bad magic" in listed["refused"]


def test_ecd_drop_removes_a_refused_pool_file_with_force_for_one_not_the_pools(
    daemon: Daemon,
) -> None:
    paths = refuse_at_restart(daemon, "p-cut", "p-hdr")
    status, _, err = ecd(daemon, "drop", "p-cut")  # its header still names it: ecd's cache
    assert status == 0, err
    assert not paths["p-cut"].exists()
    status, _, err = ecd(daemon, "drop", "p-hdr")
    assert status == 1 and "someone else's data" in err and "--force" in err, err
    assert paths["p-hdr"].exists()
    status, _, err = ecd(daemon, "drop", "p-hdr", "--force")
    assert status == 0, err
    assert not paths["p-hdr"].exists()
    with daemon.client() as c:
        assert c.stats().refused == ()
        assert all(c.open_pool(pool, BLOCK, 64 * BLOCK).created for pool in paths)
