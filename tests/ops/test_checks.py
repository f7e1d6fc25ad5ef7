"""Startup checks: each refuses or warns, with the fix in the message, on real directories; the
mount table is passed in only where a case cannot be arranged on this machine."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from ecd_testing import Daemon, run_ecd, running_daemon

from ec_daemon.server import checks
from ec_daemon.server.checks import Mount, StartupError
from ec_protocol.pool.layout import most_overhead

MiB = 1 << 20
ENTRIES = None  # auto


def fstype(path: Path) -> str:
    """The file system type as coreutils sees it: an oracle independent of parse_mounts."""
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


def mounts(*lines: str) -> list[Mount]:
    return checks.parse_mounts("\n".join(lines))


# ---- shm directory and budget --------------------------------------------------------------------


def test_missing_shm_dir_fails_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match=r"does not exist.*emptyDir with medium: Memory"):
        checks.check_shm_dir(tmp_path / "absent")


def test_shm_dir_where_files_cannot_be_created_fails() -> None:
    # Even root cannot create files in /proc.
    with pytest.raises(StartupError, match="cannot create files in shm directory /proc"):
        checks.check_shm_dir(Path("/proc"))


def test_budget_larger_than_the_directory_fails(shm_dir: Path) -> None:
    stat = os.statvfs(shm_dir)
    available = stat.f_bavail * stat.f_frsize
    with pytest.raises(StartupError, match=r"exceeds.*--shm-size"):
        checks.resolve_budget(shm_dir, available + 64 * MiB, ENTRIES)
    assert checks.resolve_budget(shm_dir, 64 * MiB, ENTRIES) == 64 * MiB


def test_a_budget_as_large_as_the_directory_fails_since_pool_files_hold_more(
    shm_dir: Path,
) -> None:
    stat = os.statvfs(shm_dir)
    with pytest.raises(StartupError, match=r"headers and slot tables.*exceeds") as refused:
        checks.resolve_budget(shm_dir, stat.f_bavail * stat.f_frsize, ENTRIES)
    assert " B " not in str(refused.value)  # sizes as an operator reads them: "12.0 GiB"


def test_the_automatic_budget_is_half_the_directory_and_leaves_room_for_the_files(
    shm_dir: Path,
) -> None:
    stat = os.statvfs(shm_dir)
    budget = checks.resolve_budget(shm_dir, None, ENTRIES)
    assert budget <= stat.f_blocks * stat.f_frsize // 2
    assert budget + most_overhead(budget, ENTRIES) <= stat.f_bavail * stat.f_frsize


# ---- tmpfs ---------------------------------------------------------------------------------------


def test_tmpfs_warning_agrees_with_the_file_system(shm_dir: Path, tmp_path: Path) -> None:
    """On this machine's real mount table: a warning exactly where the directory is not tmpfs."""
    table = checks.parse_mounts(checks.MOUNTS.read_text())
    assert fstype(shm_dir) == "tmpfs"
    for directory in (shm_dir, tmp_path, Path(__file__).parent):
        warning = checks.tmpfs_warning(directory, table)
        assert (warning is None) == (fstype(directory) == "tmpfs"), directory
        if warning:
            assert "not tmpfs" in warning and "mount -t tmpfs" in warning


def test_tmpfs_warning_names_the_mount(tmp_path: Path) -> None:
    table = mounts(
        "/dev/vda / ext4 rw,relatime 0 0",
        f"tmpfs {tmp_path} tmpfs rw,size=1g 0 0",
        f"/dev/vdb {tmp_path}/disk xfs rw 0 0",
    )
    (tmp_path / "disk" / "pools").mkdir(parents=True)
    assert checks.tmpfs_warning(tmp_path, table) is None
    assert checks.tmpfs_warning(tmp_path / "x" / "y", table) is None  # longest prefix: tmpfs
    warning = checks.tmpfs_warning(tmp_path / "disk" / "pools", table)
    assert warning is not None and f"xfs file system (mounted at {tmp_path}/disk)" in warning


def test_mount_points_with_spaces_and_stacked_mounts(tmp_path: Path) -> None:
    spaced = tmp_path / "my pools"
    spaced.mkdir()
    escaped = str(spaced).replace(" ", "\\040")
    table = mounts(
        "/dev/vda / ext4 rw 0 0",
        f"/dev/vdb {escaped} ext4 rw 0 0",
        f"tmpfs {escaped} tmpfs rw 0 0",  # mounted over the disk: this one is visible
    )
    mount = checks.mount_of(spaced, table)
    assert mount is not None and mount.point == spaced and mount.fstype == "tmpfs"
    # A symlink to the directory is judged by where it leads.
    link = tmp_path / "link"
    link.symlink_to(spaced)
    assert checks.mount_of(link, table) == mount


# ---- memlock -------------------------------------------------------------------------------------


def test_memlock_warning_compares_the_limit_with_the_budget() -> None:
    assert checks.memlock_warning(8 * MiB, resource.RLIM_INFINITY) is None
    assert checks.memlock_warning(8 * MiB, 8 * MiB) is None
    warning = checks.memlock_warning(1 << 30, 8 * MiB)
    assert warning is not None
    assert "8.0 MiB" in warning and "1.0 GiB" in warning
    assert "LimitMEMLOCK=infinity" in warning and "ulimit -l" in warning


@contextlib.contextmanager
def memlock_soft_limit(limit: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_environment_findings_read_the_real_limit(shm_dir: Path) -> None:
    with memlock_soft_limit(4 * MiB):
        found = checks.environment_findings(shm_dir, 64 * MiB, gpu=True)
        assert "4.0 MiB" in found.warnings["memlock"]
        assert "memlock" not in checks.environment_findings(shm_dir, 4 * MiB, gpu=True).warnings
    assert "tmpfs" not in checks.environment_findings(shm_dir, 4 * MiB, gpu=True).warnings


def test_a_low_memlock_limit_is_a_note_not_a_warning_on_a_machine_with_no_gpu(
    shm_dir: Path,
) -> None:
    with memlock_soft_limit(4 * MiB):
        found = checks.environment_findings(shm_dir, 64 * MiB, gpu=False)
    assert "memlock" not in found.warnings
    assert "4.0 MiB" in found.notes["memlock"]


def test_a_gpu_is_found_by_its_driver_or_its_device_node(tmp_path: Path) -> None:
    nvidia_gpus, dev = tmp_path / "gpus", tmp_path / "dev"
    nvidia_gpus.mkdir()
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the driver's control node, on a machine with no GPU too
    assert not checks.gpu_present(nvidia_gpus, dev)
    assert not checks.gpu_present(tmp_path / "no-driver", dev)
    (nvidia_gpus / "0000:3b:00.0").mkdir()
    assert checks.gpu_present(nvidia_gpus, dev)
    for node in ("nvidia0", "kfd"):
        (dev / node).touch()
        assert checks.gpu_present(tmp_path / "no-driver", dev)
        (dev / node).unlink()


def test_daemon_says_a_low_memlock_limit_once_at_the_level_for_this_machine() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    budget = 512 * MiB
    low = soft != resource.RLIM_INFINITY and soft < budget
    level = "warning" if checks.gpu_present() else "info"
    with running_daemon("--max-bytes", "512MiB") as daemon:
        said = [line for line in daemon.log().splitlines() if "check=memlock" in line]
    assert len(said) == (1 if low else 0), said
    assert all(f"level={level} " in line for line in said), said


# ---- what is at --socket ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_serve_refuses_a_socket_path_where_something_else_is_and_leaves_it_as_it_was(
    tmp_path: Path, shm_dir: Path, kind: str
) -> None:
    """One typo (--socket /etc/ecd/ecd.toml) must not destroy an operator's file: refused before
    the daemon creates anything (its lock file beside the path either), in one line."""
    path = tmp_path / ("precious.txt" if kind == "file" else "adir")
    if kind == "file":
        path.write_text("the operator's\n")
    else:
        path.mkdir()
        (path / "inside").write_text("kept\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_ecd("serve", "--socket", str(path), "--shm-dir", str(shm_dir), timeout_s=15)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert "cannot start" in line and str(path) in line and f"a {kind} is there" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no socket, no .lock
    if kind == "file":
        assert path.read_text() == "the operator's\n"
    else:
        assert (path / "inside").read_text() == "kept\n"


def test_serve_refuses_a_socket_a_process_answers_on(tmp_path: Path, shm_dir: Path) -> None:
    path = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        result = run_ecd("serve", "--socket", str(path), "--shm-dir", str(shm_dir), timeout_s=15)
        assert result.returncode == 2, result.stderr
        assert "a process answers on the socket there" in result.stderr
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert not path.with_name("live.sock.lock").exists()


def test_a_stale_socket_at_the_path_passes_the_check(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # closed, never listened: what a killed daemon leaves
    checks.check_socket_path(path)
    checks.check_socket_path(tmp_path / "absent.sock")


# ---- the single-daemon locks ---------------------------------------------------------------------


def test_a_clean_stop_removes_the_lock_files_and_a_kill_leaves_them_harmless() -> None:
    with running_daemon("--max-bytes", "64MiB") as daemon:
        locks = [
            daemon.socket.with_name(daemon.socket.name + ".lock"),
            daemon.shm_dir / ".ecd.lock",
        ]
        assert all(lock.is_file() for lock in locks)
        assert daemon.stop() == 0
        assert not any(lock.exists() for lock in locks)
        daemon.start()
        daemon.kill()
        assert all(lock.is_file() for lock in locks)  # left by the kill: the next start takes them
        daemon.start()


def test_a_second_daemon_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    first = checks.DirectoryLock(tmp_path / "x.lock", "socket x")
    first.acquire()
    with pytest.raises(StartupError, match=r"another ecd daemon already uses socket x"):
        checks.DirectoryLock(tmp_path / "x.lock", "socket x").acquire()
    first.release(remove=True)
    checks.DirectoryLock(tmp_path / "x.lock", "socket x").acquire()


def test_a_lock_on_a_file_its_holder_removed_meanwhile_is_not_taken_for_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder stops cleanly between a starting daemon's open of the lock file and its
    flock: the starter must not hold the old file while a third daemon locks the new one."""
    path = tmp_path / "x.lock"
    holder = checks.DirectoryLock(path, "socket x")
    holder.acquire()
    flock = fcntl.flock

    def holder_stops_first(fd: int, operation: int) -> None:
        holder.release(remove=True)  # once: later calls find it released already
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", holder_stops_first)
    starter = checks.DirectoryLock(path, "socket x")
    starter.acquire()
    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(StartupError, match="another ecd daemon"):
        checks.DirectoryLock(path, "socket x").acquire()
    assert path.read_text() == f"{os.getpid()}\n"


# ---- huge pages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["huge=always", "huge=within_size"])
def test_hugepages_accepts_a_huge_tmpfs(tmp_path: Path, option: str) -> None:
    checks.check_hugepages(tmp_path, mounts(f"tmpfs {tmp_path} tmpfs rw,{option} 0 0"), "never")


def test_hugepages_accepts_any_tmpfs_when_the_kernel_forces_them(tmp_path: Path) -> None:
    checks.check_hugepages(tmp_path, mounts(f"tmpfs {tmp_path} tmpfs rw 0 0"), "force")


@pytest.mark.parametrize(
    ("line", "policy", "message"),
    [
        ("tmpfs {d} tmpfs rw,huge=never 0 0", "never", "without huge=always"),
        ("tmpfs {d} tmpfs rw,huge=advise 0 0", "always", "without huge=always"),
        ("tmpfs {d} tmpfs rw,huge=always 0 0", "deny", "denied to every tmpfs"),
        ("hugetlbfs {d} hugetlbfs rw,pagesize=2M 0 0", "never", "hugetlbfs"),
        ("/dev/vda {d} ext4 rw 0 0", "never", "on ext4, not tmpfs"),
    ],
)
def test_hugepages_refuses_what_gives_small_pages(
    tmp_path: Path, line: str, policy: str, message: str
) -> None:
    with pytest.raises(StartupError, match=message) as refused:
        checks.check_hugepages(tmp_path, mounts(line.format(d=tmp_path)), policy)
    assert "--hugepages" in str(refused.value)


def test_shmem_huge_policy_reads_the_selected_word(tmp_path: Path) -> None:
    sysfs = tmp_path / "shmem_enabled"
    sysfs.write_text("always within_size advise [never] deny force\n")
    assert checks.shmem_huge_policy(sysfs) == "never"
    assert checks.shmem_huge_policy(tmp_path / "absent") == ""
    real = checks.shmem_huge_policy()
    assert real == "" or real in checks.SHMEM_HUGE_POLICY.read_text()


def test_daemon_refuses_hugepages_on_a_plain_tmpfs(tmp_path: Path, shm_dir: Path) -> None:
    mount = checks.mount_of(shm_dir, checks.parse_mounts(checks.MOUNTS.read_text()))
    assert mount is not None
    if mount.options & {"huge=always", "huge=within_size"}:
        pytest.skip("/dev/shm is mounted with huge pages here")
    args = ["--socket", str(tmp_path / "s.sock"), "--shm-dir", str(shm_dir), "--hugepages", "true"]
    result = run_ecd("serve", *args)
    assert result.returncode == 2
    assert "cannot start" in result.stderr and "--hugepages" in result.stderr
    assert "huge=always" in result.stderr


@pytest.fixture
def huge_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs mounted huge=always, where this machine lets us mount one."""
    point = tmp_path / "huge"
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,huge=always", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the table tests cover it"
        )
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_daemon_serves_hugepages_from_a_huge_tmpfs(tmp_path: Path, huge_tmpfs: Path) -> None:
    daemon = Daemon(tmp_path, huge_tmpfs, ("--max-bytes", "32MiB", "--hugepages", "true"))
    try:
        daemon.start()
        with daemon.client(keepalive=False) as client:
            info = client.open_pool("huge", block_size_bytes=4096, capacity_bytes=16 * MiB)
        assert Path(info.path).parent == huge_tmpfs
    finally:
        assert daemon.stop() == 0
