"""The suite's figures, measured in one run: a request's latency when its image loads from ecd
against the same request encoding it (vLLM's prefix cache reset between the two, so the hit
prefills anew: the figure compares the cache with the encoder, not with vLLM's reuse of the
encode's KV blocks), and an engine's start time with and without the connector. In the suite's
report (printed at its end, and in ECD_E2E_JSON when set). With the tiny model the encoder is
cheap, so a hit and an encode should cost about the same: the figure shows the connector adds no
latency of its own, not what a real encoder saves."""

from __future__ import annotations

import statistics
from typing import Any

import pytest
from e2e_testing import Engines

# Engines take a minute or more each to start on a busy 2-core machine.
pytestmark = pytest.mark.timeout(1200)

REQUESTS = 10
IMAGES = tuple(range(101, 101 + REQUESTS))  # not seen by any other test's engines


def test_figures_hit_latency_against_encoding_and_start_times(
    engines: Engines, figures: dict[str, Any]
) -> None:
    plain = engines.start(None)
    plain.close()
    engine = engines.start("ec_both")

    encoded = engine.generate(*IMAGES)
    engine.reset_caches()
    loaded = engine.generate(*IMAGES)

    assert (encoded.encoded, loaded.encoded) == (REQUESTS, 0)
    assert loaded.tokens == encoded.tokens
    figures |= {
        "requests": REQUESTS,
        "encode_latency_ms_p50": 1000 * statistics.median(encoded.latency_s),
        "hit_latency_ms_p50": 1000 * statistics.median(loaded.latency_s),
        "start_s_without_connector": plain.start_s,
        "start_s_with_connector": engine.start_s,
    }
    figures["hit_over_encode"] = figures["hit_latency_ms_p50"] / figures["encode_latency_ms_p50"]
