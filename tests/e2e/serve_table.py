"""The serving benchmark's table (serve_bench.py, `make bench-serve`): each configuration's TTFT
and throughput against no connector's, whether it met the issue's targets, the machine's load as
its stream began, and why a configuration did not run; and the rate the calibration row sets.
Pure: no server, no vLLM, so `make test` checks it (tests/ops/test_serve_bench.py)."""

from __future__ import annotations

from typing import Any

import tiny_model
from serve_stream import Stream

IMAGE_TOKENS = tiny_model.VIT_L_336.image_tokens
# vLLM #56242's figures for its store-backed encoder cache, the issue's targets: TTFT p50 and
# p90 at least this much below no connector's, and at least as low as ECCPUConnector's.
TARGET_P50, TARGET_P90 = -0.32, -0.46
NO_CONNECTOR, ECCPU = "no connector", "vLLM ECCPUConnector, ec_both"
CALIBRATION = "no connector, closed loop (the rate's calibration)"


def calibrated_rate(calibration: dict[str, Any]) -> float:
    """The stream's Poisson rate: the calibration row's throughput (the no-connector server's,
    closed loop); a calibration that did not run stops the benchmark, saying why."""
    if "error" in calibration:
        why = calibration["error"]
        raise SystemExit(f"bench-serve: no rate, the calibration did not run: {why}")
    return float(calibration["request_throughput"])


def table(rows: list[dict[str, Any]], stream: Stream, concurrency: int) -> str:
    """The results as a markdown table: TTFT and throughput also against no connector's (when it
    ran), whether each configuration met the targets, the machine's load average (1 min) as each
    configuration's stream began; a configuration that did not run says why."""
    ran = {row["configuration"]: row for row in rows if "ttft_ms" in row}
    base, eccpu = ran.get(NO_CONNECTOR), ran.get(ECCPU)
    lines = [
        f"{stream.requests} requests, one image each from a catalog of {stream.catalog} "
        f"(Zipf {stream.zipf}): {stream.reuse():.0%} of the requests' images seen before.",
    ]
    if sizes := {row["encoder_cache_tokens"] for row in ran.values()}:
        images = min(sizes) // IMAGE_TOKENS
        repeats = round(stream.reuse() * stream.requests)
        lines.append(
            f"vLLM's own encoder cache: {'/'.join(map(str, sorted(sizes)))} tokens an engine, "
            f"{images} images of {IMAGE_TOKENS} tokens; one request at a time it serves "
            f"{stream.in_engine_hits(images)} of the stream's {repeats} repeats."
        )
    rates = {row["rate"] for row in ran.values() if row["configuration"] != CALIBRATION}
    lines += [
        "Arrivals: "
        + ", ".join("closed loop" if r is None else f"Poisson at {r:.3f} requests/s" for r in rates)
        + f", at most {concurrency} in flight (a Poisson rate unless given: the calibration "
        "row's throughput).",
        f"Targets: TTFT p50 and p90 at least {-TARGET_P50:.0%} and {-TARGET_P90:.0%} below no "
        "connector's, and no higher than ECCPUConnector's.",
        "",
        "| configuration | TTFT p50 | p90 | p99 | end to end p50 | p90 | requests/s "
        "| encoder calls | hit rate | targets | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['configuration']} | did not run: {row['error']} ||||||||||")
            continue
        ttft, e2el = row["ttft_ms"], row["e2el_ms"]
        calibration = row["configuration"] == CALIBRATION
        against = base if base is not None and row is not base and not calibration else None
        lines.append(
            f"| {row['configuration']} "
            f"| {ttft['50']:.0f} ms{versus(ttft['50'], against and against['ttft_ms']['50'])} "
            f"| {ttft['90']:.0f} ms{versus(ttft['90'], against and against['ttft_ms']['90'])} "
            f"| {ttft['99']:.0f} ms | {e2el['50']:.0f} ms | {e2el['90']:.0f} ms "
            f"| {row['request_throughput']:.3f}"
            f"{versus(row['request_throughput'], against and against['request_throughput'])} "
            f"| {row['encoder_calls']} | {row['hit_rate']:.0%} | {targets(row, base, eccpu)} "
            f"| {row['load_average'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def targets(row: dict[str, Any], base: dict[str, Any] | None, eccpu: dict[str, Any] | None) -> str:
    """Which targets `row` met: its TTFT p50 and p90 against no connector's, and both against
    ECCPUConnector's; nothing for the baselines' own rows and the calibration."""
    if row is base or row["configuration"] == CALIBRATION:
        return ""
    if base is None:
        return "no baseline ran"
    ttft = row["ttft_ms"]
    found = [
        f"p50 {met(ttft['50'] <= (1 + TARGET_P50) * base['ttft_ms']['50'])}",
        f"p90 {met(ttft['90'] <= (1 + TARGET_P90) * base['ttft_ms']['90'])}",
    ]
    if eccpu is not None and row is not eccpu:
        low = all(ttft[p] <= eccpu["ttft_ms"][p] for p in ("50", "90"))
        found.append(f"vs ECCPU {met(low)}")
    return ", ".join(found)


def met(ok: bool) -> str:
    return "met" if ok else "not met"


def versus(value: float, baseline: float | None) -> str:
    """`value`'s change against `baseline`'s, as " (-12%)"; nothing with no baseline."""
    return "" if not baseline else f" ({value / baseline - 1:+.0%})"
