"""Coalescing of missing-unit prefills on one generation node.

Concurrent requests on this node that miss the same unit share one in-flight prefill
(paper §5.3). Coalescing is local: another node may compute the same unit independently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tessera.engines.base import UnitState
from tessera.generation.scheduler import Scheduler, StartDeadline


class PrefillCoalescer:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inflight: dict[str, asyncio.Task[UnitState]] = {}
        self._waiters: dict[str, int] = {}
        self.started = 0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def _forget(self, unit_id: str, task: asyncio.Task[UnitState]) -> None:
        if self._waiters.get(unit_id, 0) == 0 and self._inflight.get(unit_id) is task:
            del self._inflight[unit_id]

    async def state(self, unit_id: str, token_ids: Sequence[int],
                    deadline: StartDeadline | None = None) -> tuple[UnitState, bool]:
        """The unit's reusable form, computing it unless an identical prefill is in flight.

        Returns (state, coalesced). The shared prefill is shielded: one waiter going away
        (client disconnect) does not cancel it for the others. A finished prefill stays
        joinable until its last waiter has resumed, so the caller can retain the state (with
        no await in between) before a newcomer could miss both the prefill and the cache.
        """
        task = self._inflight.get(unit_id)
        coalesced = task is not None
        if task is None:
            # a new prefill carries its first requester's start deadline: refused as a late
            # start, it fails for whoever joined it too (they queued behind the same work)
            task = asyncio.ensure_future(self.scheduler.prefill_unit(token_ids, deadline))
            self._inflight[unit_id] = task
            self.started += 1
            # forgets a prefill whose waiters all went away (cancelled) once it finishes
            task.add_done_callback(lambda t: self._forget(unit_id, t))
        else:
            self.coalesced += 1
        self._waiters[unit_id] = self._waiters.get(unit_id, 0) + 1
        try:
            return await asyncio.shield(task), coalesced
        finally:
            left = self._waiters[unit_id] - 1
            if left:
                self._waiters[unit_id] = left
            else:
                del self._waiters[unit_id]
                if task.done():
                    self._forget(unit_id, task)
