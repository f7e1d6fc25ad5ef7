"""Building blocks for core tests: a clock the test moves, and a Store on a private directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ec_daemon.core.pools import PoolSettings
from ec_daemon.core.store import Store, StoreConfig
from ec_protocol.types import PoolInfo, Role, TensorSpec, WatchEvent


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_store(
    shm_dir: Path,
    clock: FakeClock,
    *,
    events: list[WatchEvent] | None = None,
    lease_ttl_s: float = 10.0,
    pending_timeout_s: float = 30.0,
    **pools: Any,
) -> Store:
    """A Store on shm_dir with a 1 GiB budget; `pools` overrides PoolSettings fields."""
    settings = PoolSettings(**{"shm_dir": shm_dir, "max_bytes": 1 << 30, **pools})
    sink = events.append if events is not None else (lambda event: None)
    return Store(StoreConfig(settings, lease_ttl_s, pending_timeout_s), clock, sink)


def open_pool(
    store: Store,
    engine_id: str,
    block: int,
    capacity: int,
    compat_key: str = "",
    max_entries: int = 0,
) -> PoolInfo:
    """OpenPool in a session of its own, closed at once (so no test sees it expire)."""
    setup = store.open_session("setup", 1, Role.ADMIN)
    info = store.open_pool(setup, engine_id, block, capacity, compat_key, max_entries=max_entries)
    store.close_session(setup)
    return info


def spec(nbytes: int) -> TensorSpec:
    """A uint8 tensor of nbytes bytes."""
    return TensorSpec((nbytes,), "uint8", nbytes)


def session(store: Store, name: str = "producer", role: Role = Role.BOTH) -> str:
    return store.open_session(name, 1, role)
