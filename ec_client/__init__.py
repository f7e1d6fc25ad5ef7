"""ecd client library: talk to the encoder-cache daemon and move tensors through its pools."""

__version__ = "0.1.0"

from ec_client.aio import AsyncClient
from ec_client.client import Client
from ec_client.errors import EcdError
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
    TensorSpec,
    WatchEvent,
)

__all__ = [
    "AcquireResult",
    "AllocateItem",
    "AllocateResult",
    "AsyncClient",
    "Client",
    "EcdError",
    "EntryState",
    "EventType",
    "Extent",
    "ItemResult",
    "LookupResult",
    "PoolInfo",
    "Role",
    "Stats",
    "Status",
    "TensorSpec",
    "WatchEvent",
]
