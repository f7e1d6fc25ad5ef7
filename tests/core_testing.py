"""Building blocks for core tests: a clock the test moves, and a Store on a private directory."""

from __future__ import annotations

from pathlib import Path

from ec_daemon.index import Event, TensorSpec
from ec_daemon.sessions import Role, Session
from ec_daemon.store import Store, StoreConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_store(
    shm_dir: Path, clock: FakeClock, *, events: list[Event] | None = None, **config: object
) -> Store:
    settings: dict[str, object] = {"shm_dir": shm_dir, "max_bytes": 1 << 30, "lease_ttl_s": 10.0}
    settings.update(config)
    sink = events.append if events is not None else (lambda event: None)
    return Store(StoreConfig(**settings), clock, sink)  # type: ignore[arg-type]


def spec(nbytes: int) -> TensorSpec:
    """A uint8 tensor of nbytes bytes."""
    return TensorSpec((nbytes,), "uint8", nbytes)


def session(store: Store, name: str = "producer") -> Session:
    return store.open_session(name, 1, Role.BOTH)
