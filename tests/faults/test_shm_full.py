"""The shm directory full: at daemon start, at pool creation, and at a restart.

Each test mounts its own 16 MiB tmpfs (root only: the tests skip, saying so, where mounting is not
allowed) and fills it from the test process, as another tenant of a shared /dev/shm would.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ecd_testing import Daemon, unmap_pools
from workload_testing import assert_intact, make_tensor, read_back, ready_keys

from ec_client import EcdError, Producer, PutStatus

pytestmark = pytest.mark.fault_kind("shm directory full")

BLOCK = 4096
TMPFS_SIZE = 16 << 20


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs -o size=16m tmpfs DIR)")
    mount_point = Path(tempfile.mkdtemp(prefix="ecd-full-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        unmap_pools()  # our mappings would keep the mount busy
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
        mount_point.rmdir()


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ecd-full-work-"))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the file system of `directory` until fewer than `leave` bytes are free."""
    filler = directory / "filler"
    with open(filler, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            while True:
                stat = os.statvfs(directory)
                if leave and stat.f_bavail * stat.f_frsize - chunk < leave:
                    break
                try:
                    f.write(b"\xff" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    return filler


def daemon_on(shm_dir: Path, workdir: Path, *args: str) -> Daemon:
    return Daemon(workdir, shm_dir, (*args, "--lease-ttl", "2"))


def test_a_daemon_started_on_a_full_shm_dir_exits_with_a_message_naming_it(
    small_tmpfs: Path, workdir: Path
) -> None:
    fill(small_tmpfs)
    daemon = daemon_on(small_tmpfs, workdir, "--max-bytes", "8MiB")
    with pytest.raises(RuntimeError, match="exited with 2"):
        daemon.start()
    assert "cannot start" in daemon.log() and str(small_tmpfs) in daemon.log()
    assert "Traceback" not in daemon.log()


def test_a_budget_the_shm_dir_cannot_hold_stops_the_daemon_at_startup(
    small_tmpfs: Path, workdir: Path
) -> None:
    fill(small_tmpfs, leave=4 << 20)
    daemon = daemon_on(small_tmpfs, workdir, "--max-bytes", "8MiB")
    with pytest.raises(RuntimeError, match="exited with 2"):
        daemon.start()
    assert "exceeds the" in daemon.log() and "--max-bytes" in daemon.log()
    assert "Traceback" not in daemon.log()


def test_creating_a_pool_on_a_full_shm_dir_is_resource_exhausted_and_existing_pools_serve_on(
    small_tmpfs: Path, workdir: Path
) -> None:
    daemon = daemon_on(small_tmpfs, workdir, "--max-bytes", "14MiB").start()
    try:
        with daemon.client() as c:
            c.open_pool("first", BLOCK, 4 << 20)
            filler = fill(small_tmpfs)
            with pytest.raises(EcdError) as caught:
                c.open_pool("second", BLOCK, 2 << 20)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert caught.value.reason == "shm_full"
            assert str(small_tmpfs) in caught.value.message and "is full" in caught.value.message
            assert not (small_tmpfs / "ecd-second.pool").exists()  # nothing half-made left
            # The existing pool's pages were allocated up front: it fills without a SIGBUS.
            tensors = {f"k{i}": make_tensor(f"k{i}", 256 << 10) for i in range(15)}
            assert set(Producer(c, "first", checksum=True).put_many(tensors).values()) == {
                PutStatus.COMMITTING
            }
            assert_intact(c, "first")
            assert c.health() == "SERVING"
            # Space back: the same request succeeds.
            filler.unlink()
            assert c.open_pool("second", BLOCK, 2 << 20).created
    finally:
        daemon.kill()


def test_a_daemon_restarted_on_a_full_shm_dir_serves_its_pools(
    small_tmpfs: Path, workdir: Path
) -> None:
    daemon = daemon_on(small_tmpfs, workdir, "--max-bytes", "auto").start()
    try:
        with daemon.client() as c:
            c.open_pool("kept", BLOCK, 4 << 20)
            tensors = {f"k{i}": make_tensor(f"k{i}", 200_000) for i in range(12)}
            Producer(c, "kept", checksum=True).put_many(tensors)
        fill(small_tmpfs)
        daemon.restart()  # SIGKILL, then start on the full directory
        with daemon.client() as c:
            c.open_pool("kept", BLOCK, 4 << 20)
            assert len(ready_keys(c, "kept")) == 12
            assert read_back(c, "kept", [k.encode() for k in tensors]) == 12
            assert_intact(c, "kept")
            with pytest.raises(EcdError) as caught:
                c.open_pool("new", BLOCK, 1 << 20)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        daemon.kill()
