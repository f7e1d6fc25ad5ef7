"""Life marks (ec_protocol/pool/life_marks.py): a client's lock on one byte of a pool file per
session, seen by the daemon's probe through a descriptor of its own, and gone with the client's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ec_protocol.pool.life_marks import LifeMarks, held, life_offset


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A pool-like file, and the daemon's descriptor of it."""
    path = tmp_path / "pool"
    path.write_bytes(b"\0" * 4096)
    fd = os.open(path, os.O_RDWR)
    yield str(path), fd
    os.close(fd)


def test_a_marked_session_is_seen_and_its_mark_goes_with_the_client(
    probe: tuple[str, int],
) -> None:
    path, fd = probe
    marks = LifeMarks()
    marks.mark("p", path, "session-1")
    assert held(fd, "session-1") and not held(fd, "session-2")
    marks.close()
    assert not held(fd, "session-1")


def test_a_new_session_moves_the_mark(probe: tuple[str, int]) -> None:
    path, fd = probe
    marks = LifeMarks()
    marks.mark("p", path, "old")
    marks.mark("p", path, "new")  # the daemon restarted, or the lease ran out
    assert held(fd, "new") and not held(fd, "old")
    marks.unmark("p")  # the pool was dropped
    assert not held(fd, "new")


def test_a_file_the_client_cannot_open_leaves_the_session_to_its_lease(
    probe: tuple[str, int], tmp_path: Path
) -> None:
    marks = LifeMarks()
    marks.mark("p", str(tmp_path / "elsewhere"), "session-1")  # no error: best effort
    assert not held(probe[1], "session-1")


def test_marks_lie_past_the_end_of_any_pool_file_and_differ_per_session() -> None:
    offsets = {life_offset(f"{n:032x}") for n in range(1000)}
    assert len(offsets) == 1000
    assert all(1 << 62 <= offset < (1 << 62) + (1 << 61) for offset in offsets)
