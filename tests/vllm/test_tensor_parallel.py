"""TP=2: two worker processes, one per rank, their outputs folded by vLLM's ECOutputAggregator.

Proves: only rank 0 saves (and keeps outputs for saving), every rank loads; a load's pin is held
until both ranks reported its transfer ID; a rank repeating its report, or a late report of an
earlier load of the same item, releases nothing.
"""

from __future__ import annotations

from ecd_testing import Daemon
from vllm_testing import Engine, EngineFactory, WorkerReply, digest, encoder_output, request


def pins(daemon: Daemon, e: Engine) -> int:
    """The pins the daemon sees on the pool: leases and lock-pinned entries."""
    with daemon.client() as c:
        [pool] = c.stats(e.pool).pools
        return pool.pins + pool.entries_locked


def cached_engine(engine: EngineFactory) -> Engine:
    """A TP=2 ec_both engine whose pool holds img-a."""
    e = engine(tp=2)
    e.save("r0", "img-a")
    return e


def test_only_rank_0_saves_and_every_rank_loads(engine: EngineFactory) -> None:
    e = engine(tp=2)
    e.step(request("r1", "img-a"))  # encoded; its entry is being allocated
    saved = e.step()  # the order: rank 0 copies what it kept
    assert [r.saved_here for r in saved.replies] == [["img-a"], []]
    e.flush()
    _, loaded = e.admit(request("r2", "img-a"))
    expected = digest(encoder_output("img-a"))
    assert [r.loaded for r in loaded.replies] == [{"img-a": expected}] * 2


def loading(e: Engine, request_id: str = "r1") -> list[WorkerReply]:
    """A step that loads img-a (lock-pinned at once), run on both ranks, not yet reported."""
    step = e.schedule([request(request_id, "img-a")])
    assert step.load == {"img-a"}
    return e.run(step)


def reported(e: Engine, replies: list[WorkerReply]) -> None:
    e.finish(replies)
    e.answered()


def test_a_load_pin_is_held_until_both_ranks_reported(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = cached_engine(engine)
    rank0, rank1 = loading(e)
    reported(e, [rank0])
    assert pins(daemon, e) == 1
    reported(e, [rank1])
    assert pins(daemon, e) == 0


def test_a_rank_repeating_its_report_does_not_release_the_pin(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = cached_engine(engine)
    rank0, _ = loading(e)
    reported(e, [rank0])
    reported(e, [rank0])
    assert pins(daemon, e) == 1


def test_a_late_report_of_an_earlier_load_does_not_release_a_newer_pin(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = cached_engine(engine)
    first = loading(e, "r1")
    reported(e, first)  # the first pin is released
    second = loading(e, "r2")  # a new one taken for r2
    assert second[0].loaded and pins(daemon, e) == 1
    reported(e, first)  # the earlier load's reports, again
    assert pins(daemon, e) == 1
    reported(e, second)
    assert pins(daemon, e) == 0
