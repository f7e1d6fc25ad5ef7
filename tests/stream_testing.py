"""How the GPU tests make a missing stream wait visible: hold a stream busy (`torch.cuda._sleep`
for SLEEP cycles) so that a copy ordered without the wait runs early, and leave the allocations
made meanwhile a cached block (`cache_block`), since a cudaMalloc may wait for the device and so
hide the missing wait."""

from __future__ import annotations

import torch

SLEEP = 400_000_000  # GPU cycles: a few hundred ms, far longer than any copy in these tests


def cache_block(stream: torch.cuda.Stream | None, nbytes: int) -> None:
    """Leave a free block of nbytes in the allocator's cache for `stream`, so the next
    allocation of that size there reuses it instead of calling cudaMalloc."""
    assert stream is not None
    with torch.cuda.stream(stream):
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
