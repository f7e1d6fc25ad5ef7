"""One real vLLM engine in a process of its own, driven by the test over a socket.

The test (e2e_testing.Engine) starts `python -c "import e2e_engine; e2e_engine.main()" SPEC FD`:
SPEC is an EngineSpec as JSON, FD one end of a socket pair that carries pickled commands and
answers.
vLLM's own logs go to stdout/stderr, which the test sends to a file. The engine is vLLM's
default: `LLM`, whose engine core runs in a process of its own (multiprocessing on), with its
worker in another.

Encoder calls are counted where they happen, in the worker: `count_encoder_outputs` (sent there
by vLLM's collective_rpc, by reference: this module is importable in every process) wraps the
model's `embed_multimodal`, the V2 runner's one entry into the vision encoder, and counts the
outputs it returns, one per image. The same wrapper slows the encoder, in the test only, when
the spec names an `encode_delay_file`: each call first sleeps as many seconds as the file says
then (the tiny model encodes in milliseconds; a real one under load, or a video, takes seconds).
The worker's steps are counted too (its `execute_model` is called at every engine step, empty
ones included): how often an engine steps while a request of it is held back.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

PROMPT = "USER: <image>\nwhat is in this picture? ASSISTANT:"
MAX_TOKENS = 8
ENCODE_DELAY_FILE = "ECD_E2E_ENCODE_DELAY_FILE"  # how the spec's file reaches the worker


def image(seed: int) -> Any:
    """The test image number `seed`: 56x56 RGB noise, the same for every process."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (56, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def count_encoder_outputs(worker: Any) -> int:
    """In the worker: the encoder outputs computed so far (installing the counter first)."""
    model = worker.model_runner.model
    if not hasattr(model, "_e2e_encoded"):
        model._e2e_encoded = 0
        embed = model.embed_multimodal

        def counted(**kwargs: Any) -> Any:
            delay_file = os.environ.get(ENCODE_DELAY_FILE)
            if delay_file:
                with open(delay_file) as delay:
                    time.sleep(float(delay.read() or 0))
            outputs = embed(**kwargs)
            model._e2e_encoded += len(outputs)
            return outputs

        model.embed_multimodal = counted
    return int(model._e2e_encoded)


def count_steps(worker: Any) -> int:
    """In the worker: the engine steps it ran so far (installing the counter first)."""
    if not hasattr(worker, "_e2e_steps"):
        worker._e2e_steps = 0
        execute = worker.execute_model

        def counted(*args: Any, **kwargs: Any) -> Any:
            worker._e2e_steps += 1
            return execute(*args, **kwargs)

        worker.execute_model = counted
    return int(worker._e2e_steps)


def encoder_cache_tokens(worker: Any) -> int:
    """In the worker: the size of the engine's own encoder cache, in tokens (vLLM sets it to
    max_num_batched_tokens, whose default for an OpenAI server on CPU is 2048)."""
    return int(worker.vllm_config.scheduler_config.encoder_cache_size)


class EncoderCounter:
    """The counters above as methods of a server's worker (`vllm serve
    --worker-extension-cls e2e_engine.EncoderCounter`), which its `/collective_rpc` (dev mode)
    calls by name: an HTTP caller can name a worker method, not send a function."""

    def e2e_encoder_outputs(self) -> int:
        return count_encoder_outputs(self)

    def e2e_encoder_cache_tokens(self) -> int:
        return encoder_cache_tokens(self)


# The engine arguments every engine of the suite shares, `LLM(...)`'s and `vllm serve`'s alike.
ENGINE_ARGS: dict[str, Any] = {
    "seed": 0,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "limit_mm_per_prompt": {"image": 1},
    # On CPU this is the share of host memory reserved (14 GiB by default): a test runs
    # several engines at once, each needs a few MiB of KV cache.
    "gpu_memory_utilization": 0.05,
    "kv_cache_memory_bytes": 64 << 20,
}


def ec_transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's ec_transfer_config for the spec's connector and role (None: no connector)."""
    if spec["role"] is None:
        return None
    config: dict[str, Any] = {
        "ec_connector": spec["connector"],
        "ec_role": spec["role"],
        "ec_connector_extra_config": spec["extra"],
    }
    if spec["connector"] == "ECDaemonConnector":  # vLLM's own connectors need no path
        config["ec_connector_module_path"] = "ec_client.vllm.connector"
    return config


def build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if (config := ec_transfer_config(spec)) is not None:
        kwargs["ec_transfer_config"] = config
    return LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        disable_log_stats=not spec.get("log_stats", False),
        **ENGINE_ARGS,
        **kwargs,
    )


def generate(llm: Any, seeds: list[int], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One request per image, each alone (as a proxy sends them); the tokens, each request's
    latency (with max_tokens=1, its time to first token) and its time to first token as vLLM
    records it, the encoder outputs computed and the steps run meanwhile."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = sum(llm.collective_rpc(count_encoder_outputs))
    steps_before = sum(llm.collective_rpc(count_steps))
    tokens, latencies, ttfts = [], [], []
    for seed in seeds:
        started = time.perf_counter()
        [out] = llm.generate(
            {"prompt": PROMPT, "multi_modal_data": {"image": image(seed)}},
            params,
            use_tqdm=False,
        )
        latencies.append(time.perf_counter() - started)
        ttfts.append(out.metrics.first_token_latency if out.metrics else None)
        tokens.append(list(out.outputs[0].token_ids))
    encoded = sum(llm.collective_rpc(count_encoder_outputs)) - before
    steps = sum(llm.collective_rpc(count_steps)) - steps_before
    return {
        "tokens": tokens,
        "latency_s": latencies,
        "ttft_s": ttfts,
        "encoded": encoded,
        "steps": steps,
    }


def serve(llm: Any, conn: Connection) -> None:
    while True:
        command, args = conn.recv()
        if command == "quit":
            return
        try:
            if command == "generate":
                answer: Any = generate(llm, *args)
            elif command == "reset_caches":
                llm.llm_engine.reset_encoder_cache()
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM kept its prefix cache: a request still holds blocks")
                answer = None
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", answer))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def main() -> None:
    spec = json.loads(sys.argv[1])
    conn = Connection(socket.socket(fileno=int(sys.argv[2])).detach())
    started = time.perf_counter()
    if spec.get("encode_delay_file"):  # before the worker starts: it inherits the environment
        os.environ[ENCODE_DELAY_FILE] = spec["encode_delay_file"]
    try:
        llm = build_llm(spec)
        count_start = sum(llm.collective_rpc(count_encoder_outputs))
        llm.collective_rpc(count_steps)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"start_s": time.perf_counter() - started, "encoded": count_start}))
    try:
        serve(llm, conn)
    finally:
        conn.close()
        del llm  # shut the engine down (the connector's shutdown) before the process ends
        os._exit(0)
