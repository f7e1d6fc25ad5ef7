"""The serving benchmark's parts that need no server (`make bench-serve`: tests/e2e/serve_stream.py,
serve_table.py): its default stream leaves a connector repeats beyond vLLM's own encoder cache,
its rate is the calibration's throughput, and its table marks each configuration's targets and
says why a configuration did not run."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
from serve_stream import DEFAULT_REQUESTS, Stream, catalog_for
from serve_table import CALIBRATION, ECCPU, IMAGE_TOKENS, NO_CONNECTOR, calibrated_rate, table

# An OpenAI server on CPU: max_num_batched_tokens 2048 by default, the size of vLLM's encoder
# cache (vllm/engine/arg_utils.py get_batch_defaults; the benchmark's table reports each server's).
ENGINE_CACHE_TOKENS = 2048
STREAM = catalog_for(8, reuse=0.5)


def test_an_engine_cache_that_holds_the_whole_catalog_serves_every_repeat() -> None:
    stream = Stream(requests=40, catalog=6)
    images = stream.images()

    assert stream.in_engine_hits(capacity=6) == len(images) - len(set(images))


def test_an_engine_cache_of_one_image_serves_only_a_repeat_of_the_request_before() -> None:
    stream = Stream(requests=40, catalog=4)
    images = stream.images()

    back_to_back = sum(1 for before, now in pairwise(images) if now == before)
    assert stream.in_engine_hits(capacity=1) == back_to_back


def test_an_engine_cache_evicts_the_image_released_longest_ago() -> None:
    class Chosen(Stream):
        def images(self) -> list[int]:
            return [0, 1, 0, 2, 0, 1]

    # Image 2 evicts 1 (released before 0's repeat), not 0 (cached first): both later 0s hit.
    assert Chosen(requests=6, catalog=3).in_engine_hits(capacity=2) == 2


def test_the_default_stream_leaves_most_repeats_past_an_engines_own_cache() -> None:
    capacity = ENGINE_CACHE_TOKENS // IMAGE_TOKENS
    stream = catalog_for(DEFAULT_REQUESTS, reuse=0.5)
    repeats = stream.requests - len(set(stream.images()))

    assert repeats == DEFAULT_REQUESTS // 2
    assert stream.catalog >= 4 * capacity
    assert stream.in_engine_hits(capacity) < repeats / 3


def test_the_streams_rate_is_the_calibrations_closed_loop_throughput() -> None:
    calibration = row(CALIBRATION, 900, 1500, throughput=0.42, rate=None)

    assert calibrated_rate(calibration) == 0.42


def test_a_calibration_that_did_not_run_stops_the_run_saying_why() -> None:
    with pytest.raises(SystemExit, match="calibration did not run: TimeoutError: no answer"):
        calibrated_rate({"configuration": CALIBRATION, "error": "TimeoutError: no answer"})


def test_a_configuration_that_cuts_both_percentiles_by_the_targets_meets_them() -> None:
    rows = [row(NO_CONNECTOR, 1000, 2000), row("ecd, ec_both", 670, 1070)]

    assert cells(table(rows, STREAM, 4), "ecd, ec_both")["targets"] == "p50 met, p90 met"


def test_a_configuration_short_of_a_target_is_marked_not_met() -> None:
    rows = [row(NO_CONNECTOR, 1000, 2000), row("ecd, ec_both", 700, 1000)]

    assert cells(table(rows, STREAM, 4), "ecd, ec_both")["targets"] == "p50 not met, p90 met"


def test_a_configuration_slower_than_eccpuconnector_is_marked_so() -> None:
    rows = [row(NO_CONNECTOR, 1000, 2000), row(ECCPU, 500, 900), row("ecd, ec_both", 600, 900)]

    marks = cells(table(rows, STREAM, 4), "ecd, ec_both")["targets"]
    assert marks == "p50 met, p90 met, vs ECCPU not met"


def test_rows_compare_with_no_connectors_not_with_the_calibration_before_it() -> None:
    rows = [
        row(CALIBRATION, 4000, 8000, rate=None),
        row(NO_CONNECTOR, 1000, 2000),
        row("ecd, ec_both", 500, 1000),
    ]

    text = table(rows, STREAM, 4)
    assert cells(text, "ecd, ec_both")["TTFT p50"] == "500 ms (-50%)"
    assert cells(text, CALIBRATION)["targets"] == ""
    assert "Poisson at 0.500 requests/s" in text and "closed loop" not in text.split("|")[0]


def test_a_configuration_that_did_not_run_says_why_in_its_row() -> None:
    rows = [row(NO_CONNECTOR, 1000, 2000), {"configuration": "ecd-x", "error": "no Mooncake"}]

    assert cells(table(rows, STREAM, 4), "ecd-x")["TTFT p50"] == "did not run: no Mooncake"


def test_the_table_says_how_many_images_vllms_own_cache_holds() -> None:
    text = table([row(NO_CONNECTOR, 1000, 2000)], STREAM, 4)

    assert f"2048 tokens an engine, 3 images of {IMAGE_TOKENS} tokens" in text


def row(
    name: str, p50: float, p90: float, throughput: float = 0.5, rate: float | None = 0.5
) -> dict[str, Any]:
    """A configuration's row as serve_bench.run makes it, with the TTFT percentiles given."""
    return {
        "configuration": name,
        "rate": rate,
        "encoder_cache_tokens": ENGINE_CACHE_TOKENS,
        "encoder_calls": 4,
        "hit_rate": 0.5,
        "ttft_ms": {"50": p50, "90": p90, "99": p90},
        "e2el_ms": {"50": p50, "90": p90, "99": p90},
        "request_throughput": throughput,
        "load_average": (1.0, 1.0, 1.0),
    }


def cells(text: str, configuration: str) -> dict[str, str]:
    """`configuration`'s row of the markdown table in `text`, by column name."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| configuration |"))
    found = next(line for line in lines if line.startswith(f"| {configuration} |"))
    names = [cell.strip() for cell in header.strip("|").split("|")]
    return dict(zip(names, (cell.strip() for cell in found.strip("|").split("|")), strict=False))
