"""Retention off the request's critical path (paper §5.4).

Once a unit's reusable form exists on this node (fetched or computed), the plan may
authorize keeping it: in the local cache, in the shared KV Pool, both or neither. Both
happen here, in background tasks, after the request already has what it needs:

* local insertion evicts only the plan's victims and is reported to the control plane;
* shared writeback is bounded (staging bytes and writes outstanding); the KV Pool client
  writes every reserved block and only then asks to publish, and cancels with a settle time
  on failure. A failed retention only loses a future reuse; it never fails the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from tessera.engines.base import UnitState
from tessera.engines.device import host_copy
from tessera.errors import PlacementError, TesseraError
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages import WriteGrant
from tessera.runtime import BackgroundTasks

log = logging.getLogger(__name__)


class SharedWriter(Protocol):
    """Writes all blocks of a grant, then publishes; cancels and raises on failure."""

    async def store(self, grant: WriteGrant, state: UnitState, *, received_at: float | None = None) -> None: ...


class ResidencyReporter(Protocol):
    async def residency(self, inserted: Sequence[str], evicted: Sequence[str]) -> None: ...
    async def give_up(self, grant: WriteGrant) -> None: ...


class _ByteBudget:
    """Counting semaphore over bytes (staging memory held by writes in flight)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        n = min(n, self.capacity)  # one oversized state may use the whole budget alone
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.capacity)
            self.used += n

    async def release(self, n: int) -> None:
        n = min(n, self.capacity)
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class Retainer:
    def __init__(
        self,
        cache: LocalUnitCache,
        writer: SharedWriter | None,
        control: ResidencyReporter,
        *,
        staging_bytes: int,
        outstanding: int,
    ) -> None:
        self.cache = cache
        self.writer = writer
        self.control = control
        self._staging = _ByteBudget(staging_bytes)
        self._outstanding = asyncio.Semaphore(outstanding)
        self.tasks = BackgroundTasks("retention")
        self.published = 0
        self.write_failures = 0
        self.local_inserts = 0
        self.bytes_written = 0

    def retain(self, unit_id: str, state: UnitState, local: bool, grant: WriteGrant | None,
               evict: Sequence[str], received_at: float) -> None:
        """Schedule the authorized retention of one unit; returns at once.

        ``received_at`` is when the plan arrived: the grant's deadline counts from then.
        """
        if state.keys.device.type != "cpu" and (local or grant is not None):
            self.tasks.spawn(self._retain_from_device(unit_id, state, local, grant, evict, received_at),
                             name=f"stage-{unit_id[:8]}")
            return
        if local:
            self._insert_local(unit_id, state, evict)
        if grant is not None:
            if self.writer is None:
                self.tasks.spawn(self.control.give_up(grant), name=f"cancel-{unit_id[:8]}")
            else:
                self.tasks.spawn(self._write_shared(grant, state, received_at), name=f"writeback-{unit_id[:8]}")

    async def _retain_from_device(self, unit_id: str, state: UnitState, local: bool, grant: WriteGrant | None,
                                  evict: Sequence[str], received_at: float) -> None:
        try:
            host = await host_copy(state)
        except PlacementError as exc:
            log.warning("staging unit %s to host memory failed (%s); not retaining it", unit_id, exc)
            if local:
                self.tasks.spawn(self.control.residency([], [unit_id]), name="residency")
            if grant is not None:
                self.tasks.spawn(self.control.give_up(grant), name=f"cancel-{unit_id[:8]}")
            return
        self.retain(unit_id, host, local, grant, evict, received_at)

    def _insert_local(self, unit_id: str, state: UnitState, evict: Sequence[str]) -> None:
        # a plain dict update on the event loop: cheap, and it keeps the cache single-threaded
        inserted, evicted = self.cache.insert(unit_id, state, evict)
        if inserted:
            self.local_inserts += 1
        # a declined insert is reported as "not held" so the control plane's view stays true,
        # unless it was declined because another request on this node inserted the unit already
        held = inserted or self.cache.lookup(unit_id) is not None
        self.tasks.spawn(
            self.control.residency([unit_id] if held else [], evicted if held else [unit_id]),
            name="residency",
        )

    async def _write_shared(self, grant: WriteGrant, state: UnitState, received: float) -> None:
        assert self.writer is not None
        nbytes = state.nbytes()
        async with self._outstanding:
            await self._staging.acquire(nbytes)
            try:
                await self.writer.store(grant, state, received_at=received)
            except (TesseraError, OSError, TimeoutError) as exc:
                # the writer already cancelled the reservation (with settle time) or it expires
                self.write_failures += 1
                log.warning("writeback of unit %s epoch %d failed: %s", grant.unit_id, grant.epoch, exc)
                return
            finally:
                await self._staging.release(nbytes)
        self.published += 1
        self.bytes_written += nbytes

    async def drain(self, timeout: float) -> None:
        await self.tasks.drain(timeout)
