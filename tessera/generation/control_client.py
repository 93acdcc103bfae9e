"""A generation node's client of the control plane: the KV-pool verbs plus its own reports.

Adds to :class:`tessera.kvpool.control.ControlClient` (publish/cancel/release/hello):
``residency`` (what the local cache really holds), ``load`` (the heartbeat), ``give_up``
(a reservation this node cannot honour) and ``release_later``, which batches lease
releases into one RPC so a request with many remote hits costs one round trip.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from tessera.errors import ControlPlaneError
from tessera.kvpool.control import ControlClient
from tessera.messages import CancelRequest, LoadReport, ResidencyReport, WriteGrant
from tessera.wire import WIRE_VERSION

log = logging.getLogger(__name__)


class NodeControl(ControlClient):
    def __init__(self, base_url: str, node: str, timeout_s: float = 5.0) -> None:
        super().__init__(base_url, timeout_s=timeout_s)
        self.node = node
        self._to_release: list[str] = []
        self._flush: asyncio.Task[None] | None = None

    async def residency(self, inserted: Sequence[str], evicted: Sequence[str]) -> None:
        if not inserted and not evicted:
            return
        msg = ResidencyReport(WIRE_VERSION, self.node, tuple(inserted), tuple(evicted))
        try:
            await self._ack("/control/residency", msg)
        except ControlPlaneError as exc:
            log.warning("residency report lost (the next snapshot corrects the view): %s", exc)

    async def load(self, inflight: int, queued_tokens: int) -> None:
        await self._ack("/control/load", LoadReport(WIRE_VERSION, self.node, inflight, queued_tokens))

    async def give_up(self, grant: WriteGrant) -> None:
        try:
            await self.cancel(CancelRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, 0.0))
        except ControlPlaneError as exc:
            log.warning("could not cancel reservation of %s (it expires on its own): %s", grant.unit_id, exc)

    def release_later(self, lease_id: str) -> None:
        """Queue a lease release; one RPC carries every release queued in the same loop turn."""
        self._to_release.append(lease_id)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._release_queued())

    async def _release_queued(self) -> None:
        await asyncio.sleep(0)
        batch, self._to_release = self._to_release, []
        if batch:
            try:
                await self.release(tuple(batch))
            except ControlPlaneError as exc:
                log.warning("releasing %d leases failed (they expire on their own): %s", len(batch), exc)

    async def close(self) -> None:
        if self._flush is not None and not self._flush.done():
            await self._flush
        await super().close()
