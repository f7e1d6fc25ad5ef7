"""PinPolicy alone, with a clock the test moves: which requests of a step are pinned at once."""

from __future__ import annotations

import pytest
from core_testing import FakeClock

from ec_client.vllm.pins import PinPolicy


def steps(policy: PinPolicy, clock: FakeClock, seconds: float, count: int = 3) -> None:
    for _ in range(count):
        policy.step_began()
        clock.advance(seconds)
    policy.step_began()


def test_auto_always_pins_the_first_request_of_a_step_at_once() -> None:
    policy = PinPolicy("auto", 0.0, FakeClock())
    policy.step_began()
    assert policy.may_pin_now()
    policy.pinned(0.001)
    assert not policy.may_pin_now()  # no share of the step: the rest go in the background
    policy.step_began()
    assert policy.may_pin_now()


def pins_at_once(policy: PinPolicy, seconds_each: float = 0.0009) -> int:
    """How many requests of this step the policy pins at once."""
    pinned = 0
    while policy.may_pin_now():
        policy.pinned(seconds_each)
        pinned += 1
    return pinned


@pytest.mark.parametrize(
    ("step_s", "pinned"),
    [(0.100, 22), (0.010, 2)],  # 20 ms of pins a step at 100 ms steps, 2 ms at 10 ms
    ids=["100ms-steps", "10ms-steps"],
)
def test_auto_pins_while_the_waiting_stays_within_its_share_of_the_step(
    step_s: float, pinned: int
) -> None:
    clock = FakeClock()
    policy = PinPolicy("auto", 0.2, clock)
    steps(policy, clock, step_s)
    assert pins_at_once(policy) == pinned


def test_an_idle_gap_between_steps_does_not_open_the_budget() -> None:
    clock = FakeClock()
    policy = PinPolicy("auto", 0.2, clock)
    steps(policy, clock, 0.010)
    clock.advance(60.0)  # the engine had nothing to do for a minute
    policy.step_began()
    assert pins_at_once(policy) <= 3  # a 16 ms step at most: 3.2 ms of pins, not 2.4 s


def test_ahead_never_pins_at_once_and_every_always_does() -> None:
    ahead, every = PinPolicy("ahead", 1.0, FakeClock()), PinPolicy("every", 0.0, FakeClock())
    for policy in (ahead, every):
        policy.step_began()
    assert not ahead.may_pin_now()
    for _ in range(100):
        assert every.may_pin_now()
        every.pinned(0.5)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, ahead, every"):
        PinPolicy("first", 0.2, FakeClock())
