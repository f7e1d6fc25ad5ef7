"""Test support for the hostile-input suite (tests/fuzz): example counts, the status codes a
daemon may answer a client's mistake with, and the tally of cases sent.

ECD_FUZZ_PROFILE selects how many examples each fuzz test runs: "sample" (the default, part of
`make test`) or "long" (`make test-fuzz`, at least 10,000 cases in all). The profiles apply to
the fuzz tests only, never to the other hypothesis tests of the run.
"""

from __future__ import annotations

import os
import urllib.request
from collections import Counter
from collections.abc import Callable

import grpc
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families

PROFILE = os.environ.get("ECD_FUZZ_PROFILE", "sample")
# Examples per fuzz test: (each RPC's request fuzzer, malformed bodies, raw socket bytes).
EXAMPLES = {"sample": (12, 30, 40), "long": (650, 600, 1500)}
if PROFILE not in EXAMPLES:
    raise ValueError(f"ECD_FUZZ_PROFILE={PROFILE!r}: expected one of {', '.join(EXAMPLES)}")
PER_RPC, MALFORMED, RAW = EXAMPLES[PROFILE]
# What `make test-fuzz` must have sent, all fuzz tests together.
LONG_MINIMUM_CASES = 10_000

for name, (per_rpc, _, _) in EXAMPLES.items():
    settings.register_profile(
        f"ecd-fuzz-{name}",
        max_examples=per_rpc,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


def fuzz_settings(max_examples: int) -> settings:
    """The selected profile, with this test's example count."""
    return settings(settings.get_profile(f"ecd-fuzz-{PROFILE}"), max_examples=max_examples)


# The status codes a daemon may answer a malformed or ill-timed request with (docs/design.md
# §6). Never INTERNAL or UNKNOWN: those would mean a client's mistake reached a bug.
DOCUMENTED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)

# Cases sent, by kind ("rpc Allocate", "socket garbage", ...), printed at the end of the run.
CASES: Counter[str] = Counter()
# What the answers were ("Allocate ITEM_ALLOCATED", "Commit NOT_FOUND", ...): evidence that the
# fuzzers reach real state rather than bouncing off the first check.
ANSWERS: Counter[str] = Counter()


# Cases between two reads of the metrics page. Stats is a call of a few ms, read after every
# case; the page is tens of ms to fetch and parse, growing with the pools the fuzzers open (at
# 650 examples, read after every case, the sequence test ran past its 300 s timeout on its own).
METRICS_EVERY = 50


class Observer:
    """Checks that Stats and the metrics page still answer: a daemon can stay up and SERVING
    while what a client did makes every Stats fail for everyone (a Step's misses of 2**64-1
    once did: its counter no longer fit StatsReply). `stats` is a call of Stats.

    Stats is read after every case, the page after every METRICS_EVERY cases and at `finish`;
    a page that fails lists the cases sent since it last answered."""

    def __init__(self, stats: Callable[[], object], metrics_port: int) -> None:
        self.stats = stats
        self.url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.since: list[object] = []  # the cases sent since the page last answered

    def after(self, case: object) -> None:
        """Checks after one case: `case` is what was sent (formatted only if the page fails)."""
        self.stats()
        self.since.append(case)
        if len(self.since) >= METRICS_EVERY:
            self.finish()

    def finish(self) -> None:
        """Reads the metrics page now."""
        try:
            with urllib.request.urlopen(self.url, timeout=10) as reply:  # an error page raises
                families = list(text_string_to_metric_families(reply.read().decode()))
        except Exception as exc:
            raise AssertionError(f"the metrics page failed ({exc}) after:\n{self.sent()}") from exc
        assert any(family.name == "ecd_pool_misses" for family in families), self.sent()
        self.since.clear()

    def sent(self) -> str:
        return "\n".join(map(str, self.since)) or "(none)"
