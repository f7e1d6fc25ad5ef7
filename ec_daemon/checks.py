"""Startup checks: fail fast, with the fix in the message, before the daemon promises anything."""

from __future__ import annotations

import fcntl
import grp
import os
import uuid
from pathlib import Path

from ec_client.layout import POOL_FILE_PREFIX, POOL_FILE_SUFFIX
from ec_client.units import format_size


class StartupError(RuntimeError):
    """The daemon cannot start as configured; the message says why and what to change."""


def check_shm_dir(shm_dir: Path) -> None:
    if not shm_dir.is_dir():
        raise StartupError(
            f"shm directory {shm_dir} does not exist; create it (a tmpfs such as /dev/shm, or a "
            "Kubernetes emptyDir with medium: Memory) or point --shm-dir elsewhere"
        )
    probe = shm_dir / f".ecd-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise StartupError(
            f"cannot create files in shm directory {shm_dir}: {exc.strerror}; run the daemon as "
            "a user that may write there, or point --shm-dir elsewhere"
        ) from exc


def pool_files_bytes(shm_dir: Path) -> int:
    """Bytes already held by pool files a previous daemon left (they will be adopted)."""
    return sum(
        p.stat().st_blocks * 512 for p in shm_dir.glob(f"{POOL_FILE_PREFIX}*{POOL_FILE_SUFFIX}")
    )


def resolve_budget(shm_dir: Path, max_bytes: int | None) -> int:
    """The global byte budget: as configured, or half of the shm directory when unset.

    A budget the directory cannot hold fails now rather than as a full tmpfs later.
    """
    stat = os.statvfs(shm_dir)
    total = stat.f_blocks * stat.f_frsize
    available = stat.f_bavail * stat.f_frsize + pool_files_bytes(shm_dir)
    if max_bytes is None:
        return min(total // 2, available)
    if max_bytes <= 0:
        raise StartupError(f"--max-bytes must be positive, got {max_bytes}")
    if max_bytes > available:
        raise StartupError(
            f"--max-bytes {format_size(max_bytes)} exceeds the {format_size(available)} "
            f"available in {shm_dir}; lower --max-bytes or enlarge the directory (docker run "
            "--shm-size, a Kubernetes emptyDir sizeLimit, or mount -o remount,size=... /dev/shm)"
        )
    return max_bytes


def group_id(name: str) -> int | None:
    if not name:
        return None
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError as exc:
        raise StartupError(f"unknown group {name!r}") from exc


class DirectoryLock:
    """An exclusive flock held for the daemon's life, so two daemons never share a socket or an
    shm directory (the second would silently take over the socket, or fight over pool files)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._fd = -1

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._fd)
            self._fd = -1
            raise StartupError(
                f"another ecd daemon already uses {self.what} (lock {self.path} is held); stop "
                "it first, or give this one its own --socket and --shm-dir"
            ) from exc
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
