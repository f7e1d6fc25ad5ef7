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


def assert_still_observable(stats: Callable[[], object], metrics_port: int) -> None:
    """Stats (`stats`, a call of it) and the metrics page still answer: a daemon can stay up
    and SERVING while what a client did makes every Stats fail for everyone (a Step's misses of
    2**64-1 once did: its counter no longer fit StatsReply)."""
    stats()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:  # an error page raises
        families = list(text_string_to_metric_families(reply.read().decode()))
    assert any(family.name == "ecd_pool_misses" for family in families)
