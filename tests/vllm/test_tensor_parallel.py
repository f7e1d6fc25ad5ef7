"""TP=2: two worker processes, one per rank, their outputs folded by vLLM's ECOutputAggregator.

Proves: only rank 0 saves, every rank loads; a load's pin is held until both ranks reported its
transfer ID; a rank repeating its report, or a late report of an earlier load of the same item,
releases nothing.
"""

from __future__ import annotations

from ecd_testing import Daemon
from vllm_testing import Engine, EngineFactory, digest, encoder_output, request


def pins(daemon: Daemon, e: Engine) -> int:
    with daemon.client() as c:
        return c.stats(e.pool).pools[0].pins


def cached_engine(engine: EngineFactory) -> Engine:
    """A TP=2 ec_both engine whose pool holds img-a."""
    e = engine(tp=2)
    e.save("r0", "img-a")
    return e


def test_only_rank_0_saves_and_every_rank_loads(engine: EngineFactory) -> None:
    e = engine(tp=2)
    saved = e.step(request("r1", "img-a"))
    assert [r.saved_here for r in saved.replies] == [["img-a"], []]
    e.settle()
    _, loaded = e.admit(request("r2", "img-a"))
    expected = digest(encoder_output("img-a"))
    assert [r.loaded for r in loaded.replies] == [{"img-a": expected}] * 2


def test_a_load_pin_is_held_until_both_ranks_reported(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = cached_engine(engine)
    r1 = request("r1", "img-a")
    e.step(r1)  # held back while the pin is taken
    rank0, rank1 = e.run(e.schedule([r1]))
    e.finish([rank0])
    e.step()  # a flush: nothing to release yet
    assert pins(daemon, e) == 1
    e.finish([rank1])
    e.step()
    assert pins(daemon, e) == 0


def test_a_rank_repeating_its_report_does_not_release_the_pin(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = cached_engine(engine)
    r1 = request("r1", "img-a")
    e.step(r1)
    rank0, _ = e.run(e.schedule([r1]))
    e.finish([rank0])
    e.finish([rank0])
    e.step()
    assert pins(daemon, e) == 1


def test_a_late_report_of_an_earlier_load_does_not_release_a_newer_pin(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = cached_engine(engine)
    r1, r2 = request("r1", "img-a"), request("r2", "img-a")
    e.step(r1)
    first = e.run(e.schedule([r1]))
    e.finish(first)
    e.step(r2)  # the first pin is released, a new one taken for r2
    second = e.run(e.schedule([r2]))
    assert second[0].loaded and pins(daemon, e) == 1
    e.finish(first)  # the earlier load's reports, again
    e.step()
    assert pins(daemon, e) == 1
    e.finish(second)
    e.step()
    assert pins(daemon, e) == 0
