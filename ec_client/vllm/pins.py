"""PinPolicy: when the scheduler thread pins a request's cached items at once, and when in the
background (the request then waits one step).

A pin at once costs a round trip on the scheduler thread, which every request of the step waits
for; a pin in the background costs the request itself a whole step. One round trip is worth
far less than a step to a lone request, but a burst of cached requests
pinned one by one adds up: what decides is the step's length. So, `auto`:

- the first request of a step with cached items is always pinned at once (a lone request never
  waits a step);
- later ones too, while the step's time spent waiting on pins stays under `share` of the
  engine's step time (measured between steps); beyond that, in the background.

`ahead` never pins at once (no round trip on the scheduler thread at all), `every` always does.
The measured trade-off at several step lengths is in docs/performance.md (The vLLM scheduler side).
"""

from __future__ import annotations

from collections.abc import Callable

MODES = ("auto", "ahead", "every")  # the first is the default
SMOOTHING = 0.2  # weight of the newest sample in the running averages
# An idle engine does not step: the gap before its next step is no step time. A sample counts
# for at most this many times the average, so a gap cannot open the pins' budget wide for long.
MAX_STEP_GROWTH = 4.0


class PinPolicy:
    def __init__(self, mode: str, share: float, clock: Callable[[], float]) -> None:
        if mode not in MODES:
            raise ValueError(f"pin mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.share = share
        self._clock = clock
        self._step_began: float | None = None
        self._step_s = 0.0  # running average of the time between steps (0: not known yet)
        self._pin_s = 0.0  # running average of a pin's round trip
        self._waited_s = 0.0  # this step's time spent waiting on pins

    def step_began(self) -> None:
        """A scheduler step's metadata was built: a new step starts."""
        now = self._clock()
        if self._step_began is not None:
            sample = now - self._step_began
            if self._step_s:
                sample = min(sample, MAX_STEP_GROWTH * self._step_s)
            self._step_s = _average(self._step_s, sample)
        self._step_began = now
        self._waited_s = 0.0

    def may_pin_now(self) -> bool:
        if self.mode != "auto":
            return self.mode == "every"
        if self._waited_s == 0.0:
            return True
        return self._waited_s + self._pin_s <= self.share * self._step_s

    def pinned(self, seconds: float) -> None:
        """A pin at once took `seconds` of the scheduler thread."""
        self._waited_s += seconds
        self._pin_s = _average(self._pin_s, seconds)


def _average(current: float, sample: float) -> float:
    return sample if current == 0.0 else current + SMOOTHING * (sample - current)
