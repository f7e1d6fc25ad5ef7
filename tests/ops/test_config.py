"""Configuration: flags over ECD_* environment over the TOML file over defaults, as
`ecd serve --print-config` reports it (value and source per setting), sizes with units, and errors
that name the setting and where it came from."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from ecd_testing import DEFAULT_ARGS, run_ecd, running_daemon

from ec_daemon.server import config

GiB = 1 << 30


def serve(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None, toml: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m ec_daemon serve` as an operator would, with only these settings."""
    argv = ["serve", *flags]
    if toml is not None:
        path = tmp_path / "ecd.toml"
        path.write_text(toml)
        argv += ["--config", str(path)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(config.ENV_PREFIX)}
    return run_ecd(*argv, env={**clean, **(env or {})})


def print_config(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None, toml: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`ecd serve --print-config`."""
    return serve(tmp_path, "--print-config", *flags, env=env, toml=toml)


def table(result: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    """setting -> (value, source)"""
    assert result.returncode == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        name, value, source = line.split(maxsplit=2)
        rows[name] = (value, source)
    return rows


LAYERS = {
    "flag": ("--max-bytes", "3GiB"),
    "env": ("ECD_MAX_BYTES", "2GiB"),
    "file": ("max_bytes", '"1GiB"'),
}


@pytest.mark.parametrize(
    ("given", "value", "source"),
    [
        (("flag", "env", "file"), str(3 * GiB), "flag --max-bytes"),
        (("env", "file"), str(2 * GiB), "env ECD_MAX_BYTES"),
        (("file",), str(1 * GiB), "file {toml}"),
        ((), "auto", "default"),
    ],
)
def test_precedence(tmp_path: Path, given: tuple[str, ...], value: str, source: str) -> None:
    """The same setting in every layer: the highest layer given wins and is named as the source."""
    flags = LAYERS["flag"] if "flag" in given else ()
    env = dict([LAYERS["env"]]) if "env" in given else None
    toml = f"{LAYERS['file'][0]} = {LAYERS['file'][1]}\n" if "file" in given else None
    rows = table(print_config(tmp_path, *flags, env=env, toml=toml))
    assert rows["max_bytes"] == (value, source.format(toml=tmp_path / "ecd.toml"))
    # Settings nobody gave keep their defaults, and say so.
    assert rows["lease_ttl"] == ("10.0", "default")


def test_each_layer_sets_a_different_setting(tmp_path: Path) -> None:
    rows = table(
        print_config(
            tmp_path,
            "--eviction",
            "fifo",
            env={"ECD_LEASE_TTL": "3.5", "ECD_HUGEPAGES": "no"},
            toml='pool_mode = 0o640\nmax_message_bytes = "1.5MiB"\nsocket_group = "ecd"\n',
        )
    )
    assert rows["eviction"] == ("fifo", "flag --eviction")
    assert rows["lease_ttl"] == ("3.5", "env ECD_LEASE_TTL")
    assert rows["hugepages"] == ("false", "env ECD_HUGEPAGES")
    assert rows["pool_mode"][0] == "0o640" and rows["pool_mode"][1].startswith("file ")
    assert rows["max_message_bytes"][0] == str(3 << 19)
    assert rows["socket_group"][0] == "ecd"


@pytest.mark.parametrize(
    ("flags", "env", "toml", "message"),
    [
        (("--max-bytes", "8 parsecs"), None, None, "max_bytes from flag --max-bytes"),
        ((), {"ECD_LEASE_TTL": "soon"}, None, "lease_ttl from env ECD_LEASE_TTL"),
        ((), None, "max_batch = 10\ncolour = 'blue'\n", "unknown settings in"),
        ((), None, 'eviction = "random"\n', "eviction from file"),
        ((), {"ECD_HUGEPAGES": "maybe"}, None, "hugepages from env ECD_HUGEPAGES"),
        # modes: permission bits, in octal
        ((), None, "socket_mode = 1777\n", "'1777' is 0o1777: expected permission bits"),
        ((), None, "socket_mode = 690\n", "'690' is not an octal mode"),
        ((), {"ECD_SOCKET_MODE": "0x1b6"}, None, "socket_mode from env ECD_SOCKET_MODE"),
        (("--pool-mode", "0440"), None, None, "leaves the owner without read and write"),
        ((), None, '"pool_mode" = 640\n', 'write the mode as an octal string, e.g. "0660"'),
        # numbers in range, finite, and with one another
        (("--lease-ttl", "0"), None, None, "'0' is not a number of seconds more than 0"),
        (("--lease-ttl", "-5"), None, None, "lease_ttl from flag --lease-ttl"),
        (("--lease-ttl", "nan"), None, None, "'nan' is not a number of seconds"),
        (("--pool-check-interval", "0"), None, None, "seconds at least 0.1"),
        (("--metrics-port", "70000"), None, None, "'70000' is not a TCP port"),
        (("--max-bytes", "0"), None, None, "'0' is not a size above 0"),
        (
            ("--max-bytes", "1GiB", "--max-pool-bytes", "2GiB"),
            None,
            None,
            "no pool could be that large",
        ),
        (("--max-byte", "1GiB"), None, None, "unrecognized arguments: --max-byte"),
        # the store: a master and its metadata server, together
        (("--store-master", "10.0.0.1:50051"), None, None, "store_master and store_metadata go"),
        ((), {"ECD_STORE_METADATA": "http://m:8080/metadata"}, None, "go together"),
        (("--store-master", "master"), None, None, "'master' is not HOST:PORT"),
        # several masters: found through etcd, at endpoints that are HOST:PORT each
        (("--store-master", "redis://r:6379"), None, None, "found through etcd only"),
        ((), {"ECD_STORE_MASTER": "etcd://e1:2379;e2"}, None, "etcd endpoint 'e2' is not HOST"),
        ((), None, 'store_master = "etcd://"\n', "etcd endpoint '' is not HOST:PORT"),
        (("--store-segment-bytes", "-1"), None, None, "'-1' is not a size"),
    ],
)
def test_bad_values_name_the_setting_and_its_source(
    tmp_path: Path,
    flags: tuple[str, ...],
    env: dict[str, str] | None,
    toml: str | None,
    message: str,
) -> None:
    result = print_config(tmp_path, *flags, env=env, toml=toml)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("written", "mode"),
    [('"0660"', "0o660"), ('"660"', "0o660"), ("660", "0o660"), ("0o660", "0o660"), ("0", "0o0")],
)
def test_a_mode_in_the_file_is_read_as_octal_however_it_is_written(
    tmp_path: Path, written: str, mode: str
) -> None:
    rows = table(print_config(tmp_path, toml=f"socket_mode = {written}  # for group ecd\n"))
    assert rows["socket_mode"][0] == mode


def test_a_daemon_configured_with_a_bare_600_makes_its_socket_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "ecd.toml"
    path.write_text("socket_mode = 600\n")  # the default is 0660
    with running_daemon(*DEFAULT_ARGS, "--config", str(path)) as daemon:
        assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600


def test_the_store_master_may_be_the_etcd_endpoints_of_several_masters(tmp_path: Path) -> None:
    masters = "etcd://10.0.0.1:2379;10.0.0.2:2379"
    rows = table(
        print_config(tmp_path, "--store-master", masters, "--store-metadata", "P2PHANDSHAKE")
    )
    assert rows["store_master"] == (masters, "flag --store-master")


def test_reference_table_lists_every_setting_as_help_does() -> None:
    """The settings table of docs/operations.md comes from `ecd serve --print-config
    --markdown`: one row per setting, with the flag, the environment variable and the default
    that `ecd serve --help` shows."""
    help_text = run_ecd("serve", "--help", check=True).stdout
    markdown = run_ecd("serve", "--print-config", "--markdown", check=True).stdout
    rows = markdown.splitlines()[2:]
    assert len(rows) == len(config.SETTINGS)
    for row, setting in zip(rows, config.SETTINGS, strict=True):
        cells = [c.strip().strip("`") for c in row.strip("|").split("|")]
        assert cells[:3] == [setting.name, setting.flag, setting.env]
        assert setting.flag in help_text and setting.env in help_text
        assert cells[3] == setting.show(setting.default)


@pytest.mark.parametrize(
    ("flags", "env", "toml", "source"),
    [
        (["--tcp", "10.0.0.7:7878", "--peer", "10.0.0.8:7878"], None, None, "flag --peer"),
        ([], {"ECD_PEERS": "10.0.0.8:7878"}, None, "env ECD_PEERS"),
        ([], None, 'peers = ["10.0.0.8:7878"]\n', "file"),
        (["--peer-token-file", "/etc/ecd/peer.token"], None, None, "flag --peer-token-file"),
    ],
    ids=["flag", "env", "file", "token"],
)
def test_a_peer_setting_stops_the_daemon_naming_the_store_that_replaced_peers(
    tmp_path: Path, flags: list[str], env: dict[str, str] | None, toml: str | None, source: str
) -> None:
    own = ("--socket", str(tmp_path / "ecd.sock"), "--shm-dir", str(tmp_path))
    result = serve(tmp_path, *own, *flags, env=env, toml=toml)
    assert result.returncode == 2
    assert f"from {source}" in result.stderr
    assert "no longer a setting" in result.stderr
    assert "--store-master HOST:PORT --store-metadata URL" in result.stderr


def test_a_transfer_setting_of_the_peers_stops_the_daemon_naming_the_stores_own(
    tmp_path: Path,
) -> None:
    own = ("--socket", str(tmp_path / "ecd.sock"), "--shm-dir", str(tmp_path))
    result = serve(tmp_path, *own, env={"ECD_TRANSFER_PROTOCOL": "rdma"})
    assert result.returncode == 2
    assert "transfer_protocol from env ECD_TRANSFER_PROTOCOL is no longer a setting" in (
        result.stderr
    )
    assert "--store-protocol" in result.stderr


def test_an_unknown_ecd_variable_is_warned_about_naming_the_nearest_setting() -> None:
    with running_daemon(*DEFAULT_ARGS, env={"ECD_MAX_BYTE": "1GiB"}) as daemon:
        log = daemon.log()
    assert "unknown environment variable" in log
    assert "ECD_MAX_BYTE (did you mean ECD_MAX_BYTES?)" in log


def test_print_config_warns_of_an_unknown_ecd_variable_too(tmp_path: Path) -> None:
    """The variable meant to set max_bytes is why --print-config shows its default."""
    result = print_config(tmp_path, env={"ECD_MAX_BYTE": "1GiB"})
    assert table(result)["max_bytes"] == ("auto", "default")
    assert "ECD_MAX_BYTE (did you mean ECD_MAX_BYTES?)" in result.stderr, result.stderr


def test_an_unknown_setting_in_the_file_is_refused_naming_the_nearest_setting(
    tmp_path: Path,
) -> None:
    result = print_config(tmp_path, toml='max_byte = "1GiB"\ncolour = "blue"\n')
    assert result.returncode == 2
    assert "unknown settings in" in result.stderr
    assert "colour, max_byte (did you mean max_bytes?)" in result.stderr, result.stderr


def test_a_test_daemon_takes_no_setting_from_the_environment_the_suite_runs_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ECD_LOG_FORMAT", "json")  # a developer's shell
    monkeypatch.setenv("ECD_E2E_JSON", "/tmp/figures.json")  # a suite's knob
    with running_daemon(*DEFAULT_ARGS) as daemon:
        log = daemon.log()
    assert log.startswith("ts=")  # text, the default
    assert "unknown environment variable" not in log


def test_help_says_which_size_units_are_powers_of_1000() -> None:
    result = run_ecd("serve", "--help")
    assert "GB or G, MB or M: powers of 1000, so 8G is 8 * 10^9 bytes" in " ".join(
        result.stdout.split()
    )
