"""The core's view of a pool file changed by someone else: what verify_pools refuses, and how a
refused pool is created again once its file is gone."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from core_testing import FakeClock, make_store, open_pool

from ec_client.layout import MAGIC, pool_file_name
from ec_daemon.errors import CoreError, Reason
from ec_daemon.store import Store

BLOCK = 4096


@pytest.fixture
def store(shm_dir: Path) -> Store:
    s = make_store(shm_dir, FakeClock())
    open_pool(s, "p", BLOCK, 16 * BLOCK, "model-a")
    return s


def test_a_pool_file_removed_by_someone_else_is_refused(store: Store, shm_dir: Path) -> None:
    (shm_dir / pool_file_name("p")).unlink()
    assert store.verify_pools() == ["p"]


def test_a_pool_file_replaced_by_a_copy_is_refused_and_kept(store: Store, shm_dir: Path) -> None:
    path = shm_dir / pool_file_name("p")
    shutil.copyfile(path, shm_dir / "copy")
    os.replace(shm_dir / "copy", path)
    assert store.verify_pools() == ["p"]
    with pytest.raises(CoreError) as refused:
        open_pool(store, "p", BLOCK, 16 * BLOCK, "model-a")
    assert refused.value.reason is Reason.POOL_UNVERIFIED
    assert path.exists()


def test_an_untouched_pool_file_verifies(store: Store) -> None:
    assert store.verify_pools() == []


def test_a_refused_pool_is_created_again_once_its_file_is_removed(
    store: Store, shm_dir: Path
) -> None:
    path = shm_dir / pool_file_name("p")
    with path.open("r+b") as f:
        f.write(b"garbage!")
    assert store.verify_pools() == ["p"]
    with pytest.raises(CoreError):
        open_pool(store, "p", BLOCK, 16 * BLOCK, "model-a")
    path.unlink()  # what the refusal asks the operator to do
    info = open_pool(store, "p", BLOCK, 16 * BLOCK, "model-a")
    assert info.created and path.exists()
    assert store.verify_pools() == []
    store.check()


def test_a_pool_file_of_an_older_layout_is_refused_at_adoption_and_kept(
    store: Store, shm_dir: Path
) -> None:
    path = shm_dir / pool_file_name("p")
    store.close()
    with path.open("r+b") as f:
        f.seek(len(MAGIC))
        f.write(struct.pack("<I", 1))  # what a version 1 daemon wrote
    restarted = make_store(shm_dir, FakeClock())
    restarted.adopt_pools()
    with pytest.raises(CoreError) as refused:
        open_pool(restarted, "p", BLOCK, 16 * BLOCK, "model-a")
    assert refused.value.reason is Reason.POOL_UNVERIFIED
    assert "layout 1" in refused.value.message and "older ecd" in refused.value.message
    assert path.exists()
