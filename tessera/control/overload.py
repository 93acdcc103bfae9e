"""Overload control on expected queueing time: refuse a request at once rather than queue it late.

A node's expected wait is the requests routed there without a first token yet, times its
measured service time (:meth:`~tessera.control.membership.GenerationMember.expected_wait_s`). A new request goes only
to nodes where it would queue at most ``control.max_queue_wait_s``; when there is none it is
refused with 429 and a Retry-After. Refusing at once keeps the accepted requests' time to
first token bounded; queueing everything only makes every request late.

The bound is on the time from the request's arrival: the time spent before routing
(tokenizing, retrieving, ingesting units, on the same cores as busy engines) counts against
it, or accepted requests would overshoot the promise under overload. A retry's ``waited_s``
leaves out its attempts on nodes that failed (:mod:`tessera.retrieval.chat.driver`).

``admit_mask`` reads the :class:`~tessera.control.fleet.Fleet`'s ``queued`` and ``over`` masks,
so a request that has not waited walks no nodes. ``admit`` is the same rule over a list, the
reference the tests compare with.
"""

from __future__ import annotations

from tessera.control.fleet import Fleet, bits
from tessera.control.membership import GenerationMember
from tessera.errors import Overloaded


class QueueBound:
    """Admits a request to the nodes within ``max_wait_s`` of expected queueing (0: no bound)."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.refused = 0  # requests refused because every node's queue was too long

    def admit_mask(self, fleet: Fleet, eligible: int, waited_s: float = 0.0) -> int:
        """``admit`` over the ``eligible`` mask (the fleet's bound must be ``max_wait_s``)."""
        bound = self.max_wait_s
        if bound <= 0:
            return eligible
        assert fleet.max_wait_s == bound, (fleet.max_wait_s, bound)
        if waited_s == 0:
            ok = eligible & ~fleet.over
        else:
            # what is left of the bound (see admit); a node with nothing queued always fits it
            budget = max(0.0, bound - waited_s)
            ok = eligible & ~fleet.queued
            wait = fleet.wait
            for i in bits(eligible & fleet.queued):
                if wait[i] <= budget:
                    ok |= 1 << i
        if not ok:
            self._refuse([fleet.wait[i] for i in bits(eligible)], waited_s)
        return ok

    def admit(self, live: list[GenerationMember], waited_s: float = 0.0) -> list[GenerationMember]:
        """The nodes of ``live`` a new request may go to, having waited ``waited_s`` since it arrived;
        raises Overloaded (counted) if none."""
        bound = self.max_wait_s
        if bound <= 0:
            return live
        # what is left of the bound; a node with nothing queued still takes a request that
        # spent it all before routing (refusing it would waste what was done for nothing)
        budget = max(0.0, bound - waited_s)
        waits = [n.expected_wait_s() for n in live]
        ok = [n for n, w in zip(live, waits, strict=True) if w <= budget]
        if not ok:
            self._refuse(waits, waited_s)
        return ok

    def _refuse(self, waits: list[float], waited_s: float) -> None:
        bound, shortest = self.max_wait_s, min(waits)
        self.refused += 1
        before = f" after {waited_s:.1f}s before routing" if waited_s >= 0.05 else ""
        raise Overloaded(f"every generation node is busy: a new request would queue {shortest:.1f}s or more"
                         f"{before} (control.max_queue_wait_s = {bound:g}); retry later",
                         retry_after_s=max(1.0, shortest - bound))
