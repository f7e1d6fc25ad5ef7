"""ecd client library: talk to the encoder-cache daemon and move tensors through its pools.

The tensor side (Producer, Consumer, PoolMapping, TensorMover) imports torch; it is loaded on
first use, so the daemon and the control clients never pay for importing torch.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from ec_client.aio import AsyncClient
from ec_client.client import Client, check_health
from ec_client.errors import EcdError
from ec_client.tls import TLSFiles
from ec_client.types import (
    AcquireResult,
    AllocateItem,
    AllocateResult,
    EntryState,
    EventType,
    Extent,
    ItemResult,
    LookupResult,
    PoolInfo,
    Role,
    Stats,
    Status,
    StepResult,
    TensorSpec,
    WatchEvent,
)

if TYPE_CHECKING:
    from ec_client.consumer import Consumer, GetHandle
    from ec_client.mapping import PoolMapping
    from ec_client.mover import TensorMover
    from ec_client.producer import Producer, PutHandle, PutStatus

_LAZY = {
    "Consumer": "ec_client.consumer",
    "GetHandle": "ec_client.consumer",
    "PoolMapping": "ec_client.mapping",
    "TensorMover": "ec_client.mover",
    "Producer": "ec_client.producer",
    "PutHandle": "ec_client.producer",
    "PutStatus": "ec_client.producer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ec_client' has no attribute {name!r}")


__all__ = [
    "AcquireResult",
    "AllocateItem",
    "AllocateResult",
    "AsyncClient",
    "Client",
    "Consumer",
    "EcdError",
    "EntryState",
    "EventType",
    "Extent",
    "GetHandle",
    "ItemResult",
    "LookupResult",
    "PoolInfo",
    "PoolMapping",
    "Producer",
    "PutHandle",
    "PutStatus",
    "Role",
    "Stats",
    "Status",
    "StepResult",
    "TLSFiles",
    "TensorMover",
    "TensorSpec",
    "WatchEvent",
    "check_health",
]
