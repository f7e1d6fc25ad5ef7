"""Where GPU runs put their pools: /dev/shm when it has room, else the temp directory.

The GPU machine is lent bare and may be a container whose /dev/shm is Docker's default 64 MB;
a pool that does not fit there would fail at creation (ENOSPC) and sink the whole run. Pools in
a disk-backed temp directory are slower to first touch but behave the same for CUDA (mapped,
populated, registered), which is all the GPU suite and benchmark need.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ecd_testing
import pytest

SHM = Path("/dev/shm")


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def pool_base(need_bytes: int) -> Path:
    """/dev/shm if it exists with `need_bytes` free, else the temp directory."""
    if SHM.is_dir() and free_bytes(SHM) >= need_bytes:
        return SHM
    return Path(tempfile.gettempdir())


@contextlib.contextmanager
def pools_with_room(need_bytes: int) -> Iterator[Path]:
    """Daemons started meanwhile (ecd_testing.running_daemon) keep their pools under
    pool_base(need_bytes); yields that directory."""
    base = pool_base(need_bytes)

    def shm_dir(prefix: str = "ecd-") -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=base))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ecd_testing, "new_shm_dir", shm_dir)
        yield base
