"""Overload control on expected queueing time: refuse a request at once rather than queue it late.

A node's expected wait is the requests routed there without a first token yet, times its
measured service time (:meth:`~tessera.control.membership.GenerationMember.expected_wait_s`). A new request goes only
to nodes where it would queue at most ``control.max_queue_wait_s``; when there is none it is
refused with 429 and a Retry-After. Refusing at once keeps the accepted requests' time to
first token bounded; queueing everything only makes every request late.

The plane asks ``admit_mask`` of the :class:`~tessera.control.fleet.Fleet`, which marks each
node over the bound (``over``) whenever its wait changes, so a request costs no walk over
the nodes; ``admit`` is the same rule over a list (the reference the tests compare with).
"""

from __future__ import annotations

from tessera.control.fleet import Fleet, FleetMember
from tessera.control.membership import GenerationMember
from tessera.errors import Overloaded


class QueueBound:
    """Admits a request to the nodes within ``max_wait_s`` of expected queueing (0: no bound)."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.refused = 0  # requests refused because every node's queue was too long

    def over(self, node: FleetMember) -> bool:
        """A new request may not go to ``node`` (the fleet's ``over`` mark; always False without a bound)."""
        return self.max_wait_s > 0 and not node.expected_wait_s() <= self.max_wait_s

    def admit_mask(self, fleet: Fleet, eligible: int) -> int:
        """The nodes of the ``eligible`` mask a new request may go to; raises Overloaded (counted) if none."""
        if self.max_wait_s <= 0:
            return eligible
        ok = eligible & ~fleet.over
        if not ok:
            self._refuse([m.expected_wait_s() for m in fleet.members(eligible)])
        return ok

    def admit(self, live: list[GenerationMember]) -> list[GenerationMember]:
        """The nodes of ``live`` a new request may go to; raises Overloaded (counted) if none."""
        bound = self.max_wait_s
        if bound <= 0:
            return live
        waits = [n.expected_wait_s() for n in live]
        ok = [n for n, w in zip(live, waits, strict=True) if w <= bound]
        if not ok:
            self._refuse(waits)
        return ok

    def _refuse(self, waits: list[float]) -> None:
        bound, shortest = self.max_wait_s, min(waits)
        self.refused += 1
        raise Overloaded(f"every generation node is busy: a new request would queue {shortest:.1f}s or more "
                         f"(control.max_queue_wait_s = {bound:g}); retry later",
                         retry_after_s=max(1.0, shortest - bound))
