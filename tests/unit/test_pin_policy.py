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


def test_auto_pins_more_while_the_waiting_stays_within_its_share_of_the_step() -> None:
    clock = FakeClock()
    policy = PinPolicy("auto", 0.2, clock)
    steps(policy, clock, 0.100)  # 100 ms steps: 20 ms of pins a step
    pinned = 0
    while policy.may_pin_now():
        policy.pinned(0.0009)
        pinned += 1
    assert pinned == 22


def test_auto_pins_fewer_when_steps_are_short() -> None:
    clock = FakeClock()
    policy = PinPolicy("auto", 0.2, clock)
    steps(policy, clock, 0.010)  # 10 ms steps: 2 ms of pins a step
    pinned = 0
    while policy.may_pin_now():
        policy.pinned(0.0009)
        pinned += 1
    assert pinned == 2


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
