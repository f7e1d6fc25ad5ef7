"""Applies tests/e2e/vllm_cpu.py's workarounds in every process of a test's vLLM engine."""

import os

if os.environ.get("ECD_E2E_VLLM_CPU") == "1":
    import vllm_cpu

    vllm_cpu.install()
