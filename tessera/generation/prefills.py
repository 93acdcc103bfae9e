"""Coalescing of missing-unit prefills on one generation node.

Concurrent requests on this node that miss the same unit share one in-flight prefill
(paper §5.3). Coalescing is local: another node may compute the same unit independently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from tessera.engines.base import UnitState
from tessera.generation.scheduler import Scheduler


class PrefillCoalescer:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inflight: dict[str, asyncio.Task[UnitState]] = {}
        self.started = 0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def _forget(self, unit_id: str) -> Callable[[asyncio.Task[UnitState]], None]:
        def done(_task: asyncio.Task[UnitState]) -> None:
            self._inflight.pop(unit_id, None)

        return done

    async def state(self, unit_id: str, token_ids: Sequence[int]) -> tuple[UnitState, bool]:
        """The unit's reusable form, computing it unless an identical prefill is in flight.

        Returns (state, coalesced). The shared prefill is shielded: one waiter going away
        (client disconnect) does not cancel it for the others.
        """
        task = self._inflight.get(unit_id)
        coalesced = task is not None
        if task is None:
            task = asyncio.ensure_future(self.scheduler.prefill_unit(token_ids))
            self._inflight[unit_id] = task
            self.started += 1
            task.add_done_callback(self._forget(unit_id))
        else:
            self.coalesced += 1
        return await asyncio.shield(task), coalesced
