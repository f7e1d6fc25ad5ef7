"""The core's view of a pool file changed by someone else: what verify_pools refuses, and how a
refused pool is created again once its file is gone."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from core_testing import FakeClock, make_store, open_pool

from ec_daemon.core.errors import CoreError, Reason
from ec_daemon.core.pool import _TABLE_CHUNK_SLOTS, PoolFile
from ec_daemon.core.store import Store
from ec_protocol.pool.layout import MAGIC, Geometry, SlotRecord, pool_file_name, read_record

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


def test_an_adopted_slot_table_is_read_whole_across_the_parts_it_is_read_in(
    shm_dir: Path,
) -> None:
    slots = 2 * _TABLE_CHUNK_SLOTS + 5  # two whole parts and a short one
    created = PoolFile.create(shm_dir, "p", Geometry(BLOCK, slots, slots), "", 0o600, None)
    written = {}
    for slot in (0, _TABLE_CHUNK_SLOTS - 1, _TABLE_CHUNK_SLOTS, slots - 1):
        record = SlotRecord(f"k{slot}".encode(), "uint8", (BLOCK,), BLOCK, 7, slot, ((slot, 1),))
        created.write_slot(slot, record)
        written[slot] = read_record(record.pack())
    created.close()
    adopted, records, doomed, unreadable = PoolFile.adopt(shm_dir / pool_file_name("p"))
    adopted.close()
    assert records == list(written.items()) and doomed == [] and unreadable == 0
