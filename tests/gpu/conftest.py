"""The GPU suite runs only where CUDA is; ECD_REQUIRE_GPU=1 (what `make gpu-check` sets) turns
"no CUDA here" from a skip into a failure that says why, so a GPU run can never pass empty. Its
daemons keep their pools where there is room (gpu_testing.pools_with_room)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from gpu_testing import pools_with_room

POOL_ROOM = 512 << 20  # what a test daemon may hold (--max-bytes 256MiB), with a margin


def cuda_missing() -> str:
    return (
        f"no CUDA device: torch {torch.__version__} (built for CUDA {torch.version.cuda}), "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    )


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if torch.cuda.is_available():
        return
    if os.environ.get("ECD_REQUIRE_GPU") == "1":
        pytest.fail(f"ECD_REQUIRE_GPU=1 but {cuda_missing()}", pytrace=False)
    pytest.skip(f"needs a CUDA device ({cuda_missing()})")


@pytest.fixture(autouse=True, scope="session")
def _pools_with_room() -> Iterator[None]:
    with pools_with_room(POOL_ROOM):
        yield
