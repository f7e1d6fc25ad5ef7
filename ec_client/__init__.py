"""ecd client library: talk to the encoder-cache daemon and move tensors through its pools.

The tensor side (Producer, Consumer, PoolMapping, TensorMover) imports torch; it is loaded on
first use, so the daemon and the control clients never pay for importing torch.

Import these names from here (or from `ec_client.types`, `ec_client.errors`). The modules stack
one way (tests/unit/test_layering.py): `vllm` (the connector) -> `data` (the tensor side, the
`torch` extra) -> `control` (the clients that talk to the daemon) -> the base the daemon shares,
ec_protocol: the API's values, errors, units, the address, the token file, the pool file's format
and its locks.
"""

from typing import TYPE_CHECKING, Any

from ec_client.control.aio import AsyncClient
from ec_client.control.client import Client, check_health
from ec_client.control.tls import TLSFiles
from ec_protocol import __version__ as __version__
from ec_protocol.errors import EcdError
from ec_protocol.types import (
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
    from ec_client.data.consumer import Consumer, GetHandle
    from ec_client.data.mapping import PoolMapping
    from ec_client.data.mover import TensorMover
    from ec_client.data.producer import Producer, PutHandle, PutStatus

_LAZY = {
    "Consumer": "ec_client.data.consumer",
    "GetHandle": "ec_client.data.consumer",
    "PoolMapping": "ec_client.data.mapping",
    "TensorMover": "ec_client.data.mover",
    "Producer": "ec_client.data.producer",
    "PutHandle": "ec_client.data.producer",
    "PutStatus": "ec_client.data.producer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ec_client' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, those loaded on first use included, and the module's own dunders; not
    the typing helpers this module imports, nor the submodules loaded beside it."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


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
