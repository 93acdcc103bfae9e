"""Retention off the request's critical path (paper §5.4).

Once a unit's reusable form exists on this node (fetched or computed), the plan may
authorize keeping it: in the local cache, in the shared KV Pool, both or neither. Both
happen here, in background tasks, after the request already has what it needs:

* local insertion evicts only the plan's victims and is reported to the control plane;
* shared writeback is bounded (staging bytes and writes outstanding), and the budget is
  taken *before* a state is held: a grant that does not fit is given back at once (its
  reservation cancelled) instead of queueing a task that keeps the whole state alive. The
  KV Pool client writes every reserved block and only then asks to publish, and cancels
  with a settle time on failure. A failed or skipped retention only loses a future reuse;
  it never fails the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from tessera.engines.base import UnitState
from tessera.engines.device import host_copy
from tessera.errors import PlacementError, TesseraError
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.plan import WriteGrant
from tessera.runtime import BackgroundTasks

log = logging.getLogger(__name__)


class SharedWriter(Protocol):
    """Writes all blocks of a grant, then publishes; cancels and raises on failure."""

    async def store(self, grant: WriteGrant, state: UnitState, *, received_at: float | None = None) -> bool: ...


class ResidencyReporter(Protocol):
    async def residency(self, inserted: Sequence[str], evicted: Sequence[str], kept: Sequence[str] = ()) -> None: ...
    async def give_up(self, grant: WriteGrant) -> None: ...


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
        self.staging_bytes = staging_bytes
        self.outstanding = outstanding
        self.staged = 0  # bytes of states held by writebacks in flight
        self.writing = 0  # writebacks in flight
        self.tasks = BackgroundTasks("retention")
        self.published = 0
        self.write_failures = 0
        self.not_needed = 0  # grants that lapsed and that the plane did not renew (the unit is kept elsewhere)
        self.over_budget = 0  # grants given back at once: the writeback budget was full

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
            nbytes = state.nbytes()
            if self.writer is None or not self._reserve(nbytes):
                self.over_budget += self.writer is not None
                self.give_back(grant)
            else:
                self.tasks.spawn(self._write_shared(grant, state, received_at, nbytes),
                                 name=f"writeback-{unit_id[:8]}")

    def give_back(self, grant: WriteGrant) -> None:
        """A grant this node will not write (no budget, no state, or its request was served
        without the unit): the plane frees the pending entry now, not when the grant expires."""
        self.tasks.spawn(self.control.give_up(grant), name=f"cancel-{grant.unit_id[:8]}")

    def _reserve(self, nbytes: int) -> bool:
        """Take the writeback budget for one state now, or refuse (one oversized state may go alone)."""
        if self.writing >= self.outstanding:
            return False
        if self.writing and self.staged + nbytes > self.staging_bytes:
            return False
        self.writing += 1
        self.staged += nbytes
        return True

    async def _retain_from_device(self, unit_id: str, state: UnitState, local: bool, grant: WriteGrant | None,
                                  evict: Sequence[str], received_at: float) -> None:
        try:
            host = await host_copy(state)
        except PlacementError as exc:
            log.warning("staging unit %s to host memory failed (%s); not retaining it", unit_id, exc)
            if local:
                self.tasks.spawn(self.control.residency([], [unit_id]), name="residency")
            if grant is not None:
                self.give_back(grant)
            return
        self.retain(unit_id, host, local, grant, evict, received_at)

    def _insert_local(self, unit_id: str, state: UnitState, evict: Sequence[str]) -> None:
        # a plain dict update on the event loop: cheap, and it keeps the cache single-threaded
        inserted, _ = self.cache.insert(unit_id, state, evict)
        # every victim the plan named is answered: gone, or kept (the cache evicts only as many
        # as it needs, and the control plane dropped them all when it planned); a declined
        # insert is reported as "not held", so the plane's view stays true, unless it was
        # declined because another request on this node inserted the unit already
        held = inserted or self.cache.lookup(unit_id) is not None
        victims = [v for v in dict.fromkeys(evict) if v != unit_id]
        kept = [v for v in victims if v in self.cache]
        gone = [v for v in victims if v not in self.cache]
        self.tasks.spawn(
            self.control.residency([unit_id] if held else [], gone if held else [*gone, unit_id], kept),
            name="residency",
        )

    async def _write_shared(self, grant: WriteGrant, state: UnitState, received: float, nbytes: int) -> None:
        """One writeback whose budget :meth:`_reserve` already took; gives it back when done."""
        assert self.writer is not None
        try:
            written = await self.writer.store(grant, state, received_at=received)
        except (TesseraError, OSError, TimeoutError) as exc:
            # the writer already cancelled the reservation (with settle time) or it expires
            self.write_failures += 1
            log.warning("writeback of unit %s epoch %d failed: %s", grant.unit_id, grant.epoch, exc)
            return
        finally:
            self.writing -= 1
            self.staged -= nbytes
        if written:
            self.published += 1
        else:
            self.not_needed += 1

    async def drain(self, timeout: float) -> None:
        await self.tasks.drain(timeout)
