"""The simulation's one event loop: a heap of timed callbacks on a simulated clock.

Single-threaded and deterministic: events at the same time run in the order they were
scheduled (a sequence number breaks ties), so one seed always replays the same history.
The clock is the control plane's :class:`~tessera.control.simulated.SimulatedClock`; only
this loop advances it.

This module knows nothing about nodes, requests or the control plane.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from tessera.control.simulated import SimulatedClock


class EventLoop:
    def __init__(self, clock: SimulatedClock | None = None) -> None:
        self.clock = clock or SimulatedClock()  # its default start (1000 s): no deadline reads as "unset"
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0  # callbacks run so far

    @property
    def now(self) -> float:
        return self.clock.now

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at simulated time ``when`` (never in the past: at ``now`` at the earliest)."""
        heapq.heappush(self._heap, (max(when, self.clock.now), next(self._seq), fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        assert delay >= 0, delay
        self.at(self.clock.now + delay, fn)

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Run events in time order until none is left (or ``until()`` holds after one)."""
        heap, clock = self._heap, self.clock
        while heap:
            when, _, fn = heapq.heappop(heap)
            clock.now = when
            fn()
            self.events += 1
            if until is not None and until():
                return
