"""Coalescing of missing-unit prefills on one generation node.

Concurrent requests on this node that miss the same unit share one in-flight prefill
(paper §5.3). Coalescing is local: another node may compute the same unit independently.

An in-flight prefill is either a separate engine job (:meth:`PrefillCoalescer.state`) or a
*claim*: a request that computes the unit inside its own extend (an engine that
``fuses_unit_prefills``) holds the prefill until its forward has run (:meth:`claim`, then
:meth:`finish`). Others join a claim as they join a job; if its request fails or goes away
first (:meth:`abandon`), they compute the unit themselves instead of failing with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tessera.engines.base import UnitState
from tessera.generation.scheduler import Scheduler, StartDeadline


class UnitPrefillAbandoned(Exception):
    """The request that claimed a unit's prefill failed or went away before its forward ran."""


class PrefillCoalescer:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inflight: dict[str, asyncio.Future[UnitState]] = {}
        # who still needs each in-flight prefill (joiners, and a claim's claimant until it settles);
        # by prefill, not by unit: an abandoned claim and the job replacing it are counted apart
        self._waiters: dict[asyncio.Future[UnitState], int] = {}
        self.started = 0
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def __contains__(self, unit_id: object) -> bool:
        """A prefill of the unit is in flight here (a claim, or a job)."""
        return unit_id in self._inflight

    def _forget(self, unit_id: str, task: asyncio.Future[UnitState]) -> None:
        if self._waiters.get(task, 0) == 0 and self._inflight.get(unit_id) is task:
            del self._inflight[unit_id]

    def _join(self, task: asyncio.Future[UnitState]) -> None:
        self._waiters[task] = self._waiters.get(task, 0) + 1

    def _leave(self, unit_id: str, task: asyncio.Future[UnitState]) -> None:
        left = self._waiters[task] - 1
        if left:
            self._waiters[task] = left
        else:
            del self._waiters[task]
            if task.done():
                self._forget(unit_id, task)

    def claim(self, unit_id: str) -> asyncio.Future[UnitState] | None:
        """Claim computing the unit inside the caller's own extend; None when a prefill of it is
        already in flight (join that one with :meth:`state`). The caller must settle the claim:
        :meth:`finish` once it has the state (and has retained it), or :meth:`abandon`."""
        if unit_id in self._inflight:
            return None
        claim: asyncio.Future[UnitState] = asyncio.get_running_loop().create_future()
        self._inflight[unit_id] = claim
        self._join(claim)  # the claimant, until it settles
        self.started += 1
        return claim

    def finish(self, unit_id: str, claim: asyncio.Future[UnitState], state: UnitState) -> None:
        """The claimed unit's state: joiners get it (call after retaining it, with no await between)."""
        if not claim.done():
            claim.set_result(state)
        self._leave(unit_id, claim)

    def abandon(self, unit_id: str, claim: asyncio.Future[UnitState]) -> None:
        """The claimant's request failed or went away: joiners compute the unit themselves."""
        if not claim.done():
            claim.set_exception(UnitPrefillAbandoned(f"the request computing unit {unit_id} ended first"))
            claim.exception()  # retrieved here: a claim nobody joined must not log "never retrieved"
        self._leave(unit_id, claim)

    async def state(self, unit_id: str, token_ids: Sequence[int],
                    deadline: StartDeadline | None = None, group: int = 0) -> tuple[UnitState, bool]:
        """The unit's reusable form, computing it unless an identical prefill is in flight.

        Returns (state, coalesced). The shared prefill is shielded: one waiter going away
        (client disconnect) does not cancel it for the others. A finished prefill stays
        joinable until its last waiter has resumed, so the caller can retain the state (with
        no await in between) before a newcomer could miss both the prefill and the cache.
        A joined claim that is abandoned is computed here as a job instead. ``group``: a new
        prefill's batching group (:meth:`Scheduler.prefill_unit`).
        """
        task = self._inflight.get(unit_id)
        if task is not None and task.done() and isinstance(task.exception(), UnitPrefillAbandoned):
            task = None  # an abandoned claim stays listed while its joiners resume: replace it
        coalesced = task is not None
        if task is None:
            task = self._start(unit_id, token_ids, deadline, group)
        else:
            self.coalesced += 1
        self._join(task)
        try:
            return await asyncio.shield(task), coalesced
        except UnitPrefillAbandoned:
            pass
        finally:
            self._leave(unit_id, task)
        # the claim we joined was abandoned: a job of our own (or one another joiner started)
        return await self.state(unit_id, token_ids, deadline)

    def _start(self, unit_id: str, token_ids: Sequence[int],
               deadline: StartDeadline | None, group: int = 0) -> asyncio.Future[UnitState]:
        # a new prefill carries its first requester's start deadline: refused as a late
        # start, it fails for whoever joined it too (they queued behind the same work)
        task = asyncio.ensure_future(self.scheduler.prefill_unit(token_ids, deadline, group))
        self._inflight[unit_id] = task
        self.started += 1
        # forgets a prefill whose waiters all went away (cancelled) once it finishes
        task.add_done_callback(lambda t: self._forget(unit_id, t))
        return task
