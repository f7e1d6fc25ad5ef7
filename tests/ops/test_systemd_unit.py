"""deploy/systemd: the unit passes systemd's own checks, keeps the promises the daemon relies on,
and the daemon speaks the sd_notify protocol that Type=notify and WatchdogSec= expect."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from ecd_testing import REPO, running_daemon

from ec_daemon.server.config import Config

SYSTEMD = REPO / "deploy" / "systemd"
UNIT = SYSTEMD / "ecd.service"
INSTALLED_BINARY = "/usr/local/bin/ecd"
# The venv's `ecd`: the same program the unit starts, at a path that exists here.
LOCAL_BINARY = str(Path(sys.executable).with_name("ecd"))


def tool(name: str) -> str:
    """Path of a systemd tool; fail (as root, who can install it) or skip (as anyone else)."""
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} is missing: install Debian's systemd package (deploy/ci/install-tools.sh)"
    if os.geteuid() != 0:
        pytest.skip(f"{why}; not root, so `make test` could not install it")
    pytest.fail(f"{why}; `make test` runs that script first")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows a key several times)."""
    unit: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        unit[section][key.strip()].append(value.strip())
    return unit


def verify(unit_text: str, tmp_path: Path) -> tuple[int, str]:
    """`systemd-analyze verify` of the unit, with ExecStart pointing at a binary that exists here
    (verify rejects a missing one). Clean means exit 0 and no output: systemd only warns, with exit
    0, about unknown keys and unparsable values."""
    assert INSTALLED_BINARY in unit_text
    path = tmp_path / "ecd.service"
    path.write_text(unit_text.replace(INSTALLED_BINARY, LOCAL_BINARY))
    result = subprocess.run(
        [tool("systemd-analyze"), "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, (result.stdout + result.stderr).strip()


def test_unit_verifies_clean(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == (0, "")


@pytest.mark.parametrize(
    ("good", "broken"),
    [
        ("ProtectSystem=strict", "ProtectSytem=strict"),  # unknown key
        ("Type=notify", "Type=notfy"),  # bad value
        ("WatchdogSec=30s", "WatchdogSec=soon"),
    ],
)
def test_verify_catches_a_broken_directive(tmp_path: Path, good: str, broken: str) -> None:
    """The check above can fail: the same unit with one directive broken does not pass."""
    text = UNIT.read_text()
    assert good in text
    _, output = verify(text.replace(good, broken), tmp_path)
    assert output, f"systemd-analyze verify accepted {broken!r}"
    assert broken.split("=")[1] in output or broken.split("=")[0] in output


def test_unit_is_hardened(tmp_path: Path) -> None:
    """systemd's own exposure score (0 safest, 10 worst) stays at 2.0 or below."""
    path = tmp_path / "ecd.service"
    path.write_text(UNIT.read_text().replace(INSTALLED_BINARY, LOCAL_BINARY))
    command = ["security", "--offline=yes", "--man=no", "--threshold=20", str(path)]
    result = subprocess.run(
        [tool("systemd-analyze"), *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def test_unit_keeps_the_daemons_promises(serve_config: Callable[..., Config]) -> None:
    unit = parse_unit(UNIT.read_text())
    service = {key: values[-1] for key, values in unit["Service"].items()}
    assert service["Type"] == "notify"
    assert service["Restart"] == "on-failure"
    # Pool files must outlive the process: no transient user, no removal of its IPC objects.
    assert "DynamicUser" not in service or service["DynamicUser"] == "no"
    assert service["RemoveIPC"] == "no"
    assert service["User"] == service["Group"] == "ecd"
    assert service["ProtectSystem"] == "strict"
    assert service["NoNewPrivileges"] == "yes"
    watchdog_s = int(service["WatchdogSec"].removesuffix("s"))
    assert 10 <= watchdog_s <= 120

    # The command line as the daemon parses it, with the shipped ecd.toml as /etc/ecd/ecd.toml.
    command = service["ExecStart"].split()
    assert command[:2] == [INSTALLED_BINARY, "serve"]
    argv = [str(SYSTEMD / "ecd.toml") if a == "/etc/ecd/ecd.toml" else a for a in command[2:]]
    assert "--config" in argv
    config = serve_config(argv)
    # The socket lives in the unit's RuntimeDirectory, owned by the unit's group.
    assert config.socket == Path("/run") / service["RuntimeDirectory"] / "ecd.sock"
    assert config.socket_group == service["Group"] and config.socket_mode == 0o660
    # Pool files are the daemon's alone: engines get the pools they are granted over the socket.
    assert (config.pool_group, config.pool_mode) == ("", 0o600)
    # ProtectSystem=strict leaves only listed paths writable: the pool directory must be one.
    assert str(config.shm_dir) in service["ReadWritePaths"].split()
    # systemd's stop timeout leaves the daemon its grace period for in-flight RPCs.
    assert int(service["TimeoutStopSec"].removesuffix("s")) > config.shutdown_grace
    assert service["LimitMEMLOCK"] == "infinity"


def test_sysusers_file_creates_the_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    subprocess.run(
        [tool("systemd-sysusers"), f"--root={tmp_path}", str(SYSTEMD / "ecd.sysusers")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    users = [line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()]
    [ecd] = [u for u in users if u[0] == "ecd"]
    assert ecd[-1] == "/usr/sbin/nologin"
    groups = (tmp_path / "etc" / "group").read_text()
    assert any(line.split(":")[0] == "ecd" for line in groups.splitlines())


def test_daemon_notifies_ready_watchdog_and_stopping(tmp_path: Path) -> None:
    """What systemd sees of a Type=notify service with WatchdogSec=: READY=1 once serving,
    WATCHDOG=1 at half the interval, STOPPING=1 on SIGTERM, exit 0."""
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(notify_path))
        notify.settimeout(10)
        env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}  # 0.2 s
        with running_daemon("--max-bytes", "64MiB", env=env) as daemon:
            states = [notify.recv(4096).decode() for _ in range(3)]
            assert states[0] == "READY=1", states
            assert states[1:] == ["WATCHDOG=1", "WATCHDOG=1"]
            started = time.monotonic()
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            while (state := notify.recv(4096).decode()) == "WATCHDOG=1":
                assert time.monotonic() - started < 10
            assert state == "STOPPING=1"
            assert daemon.stop() == 0


def test_the_commented_cluster_settings_are_ones_the_daemon_takes(
    tmp_path: Path, serve_config: Callable[..., Config]
) -> None:
    """Uncommented, the example lines of ecd.toml (the store's) load: no misspelled key, no
    value the daemon refuses, none missing that another needs."""
    text = re.sub(r"(?m)^# (\w+ = )", r"\1", (SYSTEMD / "ecd.toml").read_text())
    config_file = tmp_path / "ecd.toml"
    config_file.write_text(text)
    config = serve_config(["--config", str(config_file)])
    assert config.store_master == "10.0.0.5:50051"
    assert config.store_metadata == "http://10.0.0.5:8080/metadata"
    assert config.store_segment_bytes == 4 << 30
    assert config.transfer_host and config.pull_timeout == 1.0
