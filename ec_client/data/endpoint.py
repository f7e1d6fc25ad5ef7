"""PoolEndpoint: what Producer and Consumer share: the client, the pool's mapping, the movers."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import torch

from ec_client.control.client import Client
from ec_client.data.mapping import PoolMapping
from ec_client.data.mover import TensorMover, cuda_device
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import file_at
from ec_protocol.pool.slot_locks import SlotPins
from ec_protocol.types import ItemResult, LeaseResult


class PoolEndpoint:
    def __init__(self, client: Client, engine_id: str) -> None:
        if not isinstance(client, Client):
            # An AsyncClient's calls are coroutines: the tensor path, whose copies wait on the
            # caller's CUDA stream, is a blocking one, driven by a Client.
            raise TypeError(
                f"Producer and Consumer need an ec_client.Client, not {type(client).__name__}: "
                "from asyncio code, make a Client and run their calls on a thread, e.g. "
                "`await asyncio.to_thread(Producer(client, pool).put, key, tensor)`"
            )
        self.client = client
        self.engine_id = engine_id
        self._movers: dict[torch.device, TensorMover] = {}
        self.mapping = PoolMapping.open(client.pool_info(engine_id))
        self._pins: SlotPins | None = None  # opened on the first lock pin

    def pins(self) -> SlotPins:
        """The lock pins on the file mapped now (call `mover` first: it maps a newer file)."""
        info = self.mapping.info
        if self._pins is None or self._pins.pool_uuid != info.pool_uuid:
            if self._pins is not None:
                self._pins.retire()  # its pins go as their copies land
            self._pins = SlotPins(info.path, info.pool_uuid)
        return self._pins

    def mover(self, device: torch.device | str) -> TensorMover:
        """The mover for a device, re-mapping first if the pool was recreated since."""
        self._refresh()
        device = cuda_device(device)  # "cuda" and "cuda:0" share one mover
        mover = self._movers.get(device)
        if mover is None or mover.mapping is not self.mapping:
            mover = self._movers[device] = TensorMover(self.mapping, device)
        return mover

    def file_at_path(self) -> tuple[int, int] | None:
        """The file at the pool's path now (device, inode), None if there is none: taken before
        a Step, to tell after it which file the Step was answered of (`answered_of`)."""
        return file_at(self.mapping.info.path)

    def answered_of(self, mover: TensorMover, before: tuple[int, int] | None) -> bool:
        """Whether a Step sent while `before` was at the path (`file_at_path`) was answered of
        the file `mover` maps (taken after the Step, so that it is current): that file was at
        the path before the Step and is now, and a pool's file, once replaced, never comes back,
        so it was the pool's throughout. Otherwise the pool was recreated around the Step, and
        its extents may be of another file than the mover's: read, another entry's bytes or
        zeros; written, over another entry's bytes."""
        return before is not None and mover.mapping.file_id == before

    def _refresh(self) -> None:
        """Map the pool again if the daemon announced a new file (after a restart), or if the
        file at the path is not the one mapped (dropped and recreated, truncated, removed):
        open the pool again as this client first opened it, once.

        The mapping in use is replaced only by one that verified: a pool that is not back yet
        raises EcdError and leaves this endpoint as it was, so a later call tries again and
        works once the pool is back."""
        info = self.client.pool_info(self.engine_id)
        if info.pool_uuid == self.mapping.info.pool_uuid:
            try:
                self.mapping.check_current()
                return
            except EcdError:
                info = self.client.reopen_pool(self.engine_id)
        mapping = PoolMapping.open(info)
        mapping.check_current()
        if mapping is not self.mapping:
            self.mapping.close()
            self.mapping = mapping


def item_errors(what: str, results: Iterable[ItemResult | LeaseResult]) -> EcdError | None:
    """One EcdError naming every result that is an error, with the first one's status code;
    None if none is."""
    failed = [r for r in results if r.status.is_error]
    if not failed:
        return None
    details = "; ".join(
        f"{r.key if isinstance(r, ItemResult) else r.lease_id!r}: {r.status.value}: {r.message}"
        for r in failed
    )
    code = getattr(grpc.StatusCode, failed[0].status.name)
    return EcdError(code, f"{what} refused {len(failed)} item(s): {details}")
