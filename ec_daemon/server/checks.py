"""Startup checks: fail fast, with the fix in the message, before the daemon promises anything."""

from __future__ import annotations

import fcntl
import grp
import os
import resource
import socket
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from ec_protocol.pool.layout import POOL_FILE_PREFIX, POOL_FILE_SUFFIX, most_overhead
from ec_protocol.units import format_size


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


def check_socket_path(path: Path) -> None:
    """The daemon makes its socket at --socket, replacing only a stale socket there (one a
    daemon that died left, which nothing answers on): anything else is refused before the daemon
    creates a thing (its lock file beside the path included), so that a typo (--socket
    /etc/ecd/ecd.toml) never destroys an operator's file, nor takes over a live socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError(
            f"--socket {path}: cannot look at the path: {exc.strerror}; point --socket at a "
            "path in a directory the daemon may write (such as /run/ecd/ecd.sock)"
        ) from exc
    if not stat.S_ISSOCK(mode):
        raise StartupError(
            f"--socket {path}: {_what_is_there(mode)} is there, not a socket; the daemon "
            "replaces only a stale socket, so point --socket at another path (such as "
            "/run/ecd/ecd.sock), or move what is there away"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return  # stale: nothing listens on it
        except OSError as exc:
            raise StartupError(
                f"--socket {path}: a socket is there that the daemon cannot tell is stale "
                f"({exc.strerror or 'no answer'}); remove it if no process uses it, or point "
                "--socket at another path"
            ) from exc
    raise StartupError(
        f"--socket {path}: a process answers on the socket there (another ecd daemon, or "
        "another program); stop it first, or point --socket at another path"
    )


def _what_is_there(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symlink"))
    return next((name for test, name in kinds if test(mode)), "a special file")


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mounts."""

    point: Path
    fstype: str
    options: frozenset[str]


# /proc/self/mounts rather than /proc/mounts: under systemd's ProcSubset=pid only the former exists.
MOUNTS = Path("/proc/self/mounts")
SHMEM_HUGE_POLICY = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def _unescape(field: str) -> str:
    """The kernel writes space, tab, newline and backslash in mount points as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def parse_mounts(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            point, fstype, options = _unescape(fields[1]), fields[2], fields[3]
            mounts.append(Mount(Path(point), fstype, frozenset(options.split(","))))
    return mounts


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount that holds `path`: the longest mount point above it, and of several mounts on
    the same point the last (it is stacked on top of the others)."""
    path = path.resolve()
    best: Mount | None = None
    for mount in mounts:
        if (mount.point == path or mount.point in path.parents) and (
            best is None or len(mount.point.parts) >= len(best.point.parts)
        ):
            best = mount
    return best


def tmpfs_warning(shm_dir: Path, mounts: list[Mount]) -> str | None:
    """Pool files on a disk file system are written back to disk: copies stall on I/O, and the
    cache competes with the page cache. Worth a warning, not a refusal (it works, slowly)."""
    mount = mount_of(shm_dir, mounts)
    if mount is None or mount.fstype == "tmpfs":
        return None
    return (
        f"shm directory {shm_dir} is on a {mount.fstype} file system (mounted at {mount.point}), "
        "not tmpfs: pool pages will be written back to disk and copies will stall; use /dev/shm, "
        "a tmpfs (mount -t tmpfs -o size=16G tmpfs DIR), or a Kubernetes emptyDir with "
        "medium: Memory"
    )


def memlock_warning(budget: int, limit: int) -> str | None:
    """Clients pin the pools for fast GPU copies (cudaHostRegister), which needs a memlock limit
    that covers them. The daemon locks nothing itself; its own limit stands in for the limit that
    engines started the same way (same container runtime, same systemd defaults) will get."""
    if limit == resource.RLIM_INFINITY or limit >= budget:
        return None
    return (
        f"memlock limit {format_size(limit)} is below the {format_size(budget)} pool budget: CUDA "
        "clients started with the same limits cannot register the pools and fall back to slower "
        "pageable copies; raise it for the engines and the daemon (ulimit -l unlimited, systemd "
        "LimitMEMLOCK=infinity, docker run --ulimit memlock=-1)"
    )


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
DEV = Path("/dev")


def gpu_present(nvidia_gpus: Path = NVIDIA_GPUS, dev: Path = DEV) -> bool:
    """Whether this machine has a GPU that clients could pin the pools for: one the NVIDIA
    driver lists (its /proc entries are there in a container given no GPU too, as the daemon's
    pod beside GPU engines is), or a GPU device node (NVIDIA's, AMD's /dev/kfd)."""
    try:
        if any(nvidia_gpus.iterdir()):
            return True
    except OSError:
        pass
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


@dataclass(frozen=True)
class Findings:
    """What the startup checks found that the daemon runs with, check name -> message with the
    fix: warnings, and notes (info) for what matters only on other machines. The memlock limit
    is a note on a machine with no GPU: nothing pins the pools there, so it is no problem now,
    but it would be for GPU engines started with the same limits."""

    warnings: dict[str, str]
    notes: dict[str, str]


def environment_findings(shm_dir: Path, budget: int, gpu: bool) -> Findings:
    """Problems the daemon can run with but should not (`gpu`: whether this machine has one)."""
    found = {
        "tmpfs": tmpfs_warning(shm_dir, parse_mounts(MOUNTS.read_text())),
        "memlock": memlock_warning(budget, resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]),
    }
    warnings = {name: message for name, message in found.items() if message is not None}
    notes = {} if gpu or "memlock" not in warnings else {"memlock": warnings.pop("memlock")}
    return Findings(warnings, notes)


def shmem_huge_policy(path: Path = SHMEM_HUGE_POLICY) -> str:
    """The selected word of shmem_enabled ("always [never] deny ..." -> "never"); "" without
    transparent huge pages in the kernel."""
    try:
        words = path.read_text().split()
    except OSError:
        return ""
    return next((w.strip("[]") for w in words if w.startswith("[")), "")


def check_hugepages(shm_dir: Path, mounts: list[Mount], policy: str) -> None:
    """With --hugepages, pool files must get 2 MiB pages (their first touches are several times
    faster: docs/performance.md): refuse to start rather than silently run on 4 KiB pages."""
    mount = mount_of(shm_dir, mounts)
    fix = (
        "mount a tmpfs with huge pages (mount -t tmpfs -o size=16G,huge=always tmpfs DIR, or "
        "mount -o remount,huge=always /dev/shm) and point --shm-dir there, or turn --hugepages off"
    )
    if mount is None:
        raise StartupError(f"--hugepages: cannot tell which file system holds {shm_dir}; {fix}")
    if mount.fstype == "hugetlbfs":
        raise StartupError(
            f"--hugepages: {shm_dir} is a hugetlbfs, whose files cannot be written with write(2) "
            f"as the daemon writes pool headers; {fix}"
        )
    if mount.fstype != "tmpfs":
        raise StartupError(f"--hugepages: {shm_dir} is on {mount.fstype}, not tmpfs; {fix}")
    if policy == "deny":
        raise StartupError(
            "--hugepages: huge pages are denied to every tmpfs by "
            f"{SHMEM_HUGE_POLICY} (deny); write 'never' or 'advise' there, then restart"
        )
    if policy != "force" and not mount.options & {"huge=always", "huge=within_size"}:
        raise StartupError(
            f"--hugepages: the tmpfs at {mount.point} is mounted without huge=always or "
            f"huge=within_size, so pool files would get 4 KiB pages; {fix}"
        )


def pool_files_bytes(shm_dir: Path) -> int:
    """Bytes already held by pool files a previous daemon left (they will be adopted)."""
    return sum(
        p.stat().st_blocks * 512 for p in shm_dir.glob(f"{POOL_FILE_PREFIX}*{POOL_FILE_SUFFIX}")
    )


def resolve_budget(shm_dir: Path, max_bytes: int | None, entries: int | None) -> int:
    """The global byte budget of pool capacity: as configured, or half of the shm directory when
    unset. Pool files hold a little more than their capacity (header and slot table, see
    ec_protocol.pool.layout), so the directory must hold the budget and that much more (for one pool
    of the whole budget; each further pool adds its 2 MiB header area, and a pool that finds the
    directory full is refused cleanly at creation).

    A budget the directory cannot hold fails now rather than as a full tmpfs later.
    """
    stat = os.statvfs(shm_dir)
    total = stat.f_blocks * stat.f_frsize
    available = stat.f_bavail * stat.f_frsize + pool_files_bytes(shm_dir)
    if max_bytes is None:
        budget = min(total // 2, available - most_overhead(available, entries))
        if budget <= 0:
            raise StartupError(
                f"{shm_dir} is full: no room for any pool; free space there or enlarge it"
            )
        return budget
    if max_bytes <= 0:
        raise StartupError(f"--max-bytes must be positive, got {max_bytes}")
    files = max_bytes + most_overhead(max_bytes, entries)
    if files > available:
        raise StartupError(
            f"--max-bytes {format_size(max_bytes)} of pool capacity takes up to "
            f"{format_size(files)} of pool files (with their headers and slot tables), which "
            f"exceeds the {format_size(available)} available in {shm_dir}; lower --max-bytes or "
            "enlarge the directory (docker run --shm-size, a Kubernetes emptyDir sizeLimit, or "
            "mount -o remount,size=... /dev/shm)"
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
    shm directory (the second would silently take over the socket, or fight over pool files).

    A clean stop removes the lock file (`release(remove=True)`), as it removes the socket. It
    unlinks the file while it still holds the lock, and `acquire` checks after taking a lock
    that the file it locked is still the one at the path: a daemon starting meanwhile may have
    opened the old file and locked it the moment the holder let go, a lock nobody else would
    look at, since the next daemon creates a new file at the path. Such a lock is dropped and
    the file at the path locked instead, so two daemons never both hold "the" lock. Waiting is
    never part of it: a lock held is refused at once (LOCK_NB)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._fd = -1

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._lock_the_file_at_the_path():
            pass
        try:  # the pid is for operators asking who holds the lock
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            self.release()
            raise StartupError(f"cannot write {self.path}: {exc.strerror}") from exc

    def _lock_the_file_at_the_path(self) -> bool:
        """Lock the file at the path; False when the file locked was removed meanwhile (by the
        holder, at its clean stop) and the caller must try again."""
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
        try:
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                return True
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1
        return False

    def release(self, remove: bool = False) -> None:
        """Let go of the lock; with remove, remove its file first, while still holding it (see
        the class)."""
        if self._fd >= 0:
            if remove:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1
