"""Retrieval demand of one request stream (paper §5.2).

    s(u, t) = w_recent · f_W(u, t) + w_lifetime · f_∞(u, t)

f_W counts the requests among the stream's last W that retrieved u; f_∞ counts all of them.
W is measured in requests of *this* stream: the shared tier's tracker sees every request,
a generation node's local tracker only the requests routed to that node, so one unit has a
different score in each tier.

The window is a ring of the last W requests' unit lists: when a request falls out of the
window its units are decremented at once, so a score is two dict reads and never a scan.
A unit counts once per request however often the request names it.

This module knows nothing about residency, capacity or nodes.
"""

from __future__ import annotations

from collections import deque

# f_W and f_∞ of a unit packed in one int: f_∞ << _SHIFT | f_W. One dict entry per unit and
# no per-unit container keeps the hot path to a single lookup (it is memory-bound).
_SHIFT = 24
_RECENT = (1 << _SHIFT) - 1
_ARRIVAL = (1 << _SHIFT) | 1
MAX_WINDOW = _RECENT


class DemandTracker:
    """Recent-window and lifetime retrieval counts of one stream. Verbs: ``record``, ``score``."""

    __slots__ = ("_counts", "_ring", "requests", "w_lifetime", "w_recent", "window")

    def __init__(self, window: int, w_recent: float, w_lifetime: float) -> None:
        assert 0 < window <= MAX_WINDOW and w_recent >= 0 and w_lifetime >= 0, (window, w_recent, w_lifetime)
        self.window = window
        self.w_recent = float(w_recent)
        self.w_lifetime = float(w_lifetime)
        self.requests = 0  # requests recorded so far: the stream's clock
        self._counts: dict[str, int] = {}  # unit -> f_∞ << _SHIFT | f_W
        self._ring: deque[tuple[str, ...]] = deque()

    def record(self, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
        """Count one request retrieving ``unit_ids`` (distinct ids).

        Returns the units of the request that just left the window: their scores dropped,
        so a caller ordering units by score must re-key them (the request's own units rose).
        """
        counts = self._counts
        get = counts.get
        for u in unit_ids:
            counts[u] = get(u, 0) + _ARRIVAL
        ring = self._ring
        ring.append(unit_ids)
        self.requests += 1
        if len(ring) <= self.window:
            return ()
        left = ring.popleft()
        for u in left:
            counts[u] -= 1
        return left

    def score(self, unit_id: str) -> float:
        c = self._counts.get(unit_id, 0)
        return self.w_recent * (c & _RECENT) + self.w_lifetime * (c >> _SHIFT)

    def admissible(self, unit_id: str, min_retrievals: int, theta: float) -> bool:
        """Retrieved at least ``min_retrievals`` times in the stream and s(u) >= θ."""
        c = self._counts.get(unit_id, 0)
        lifetime = c >> _SHIFT
        return lifetime >= min_retrievals and self.w_recent * (c & _RECENT) + self.w_lifetime * lifetime >= theta

    def recent(self, unit_id: str) -> int:
        """f_W(u): requests among the last W that retrieved u."""
        return self._counts.get(unit_id, 0) & _RECENT

    def lifetime(self, unit_id: str) -> int:
        """f_∞(u): all requests of the stream that retrieved u."""
        return self._counts.get(unit_id, 0) >> _SHIFT

    def check_invariants(self) -> None:
        """f_W equals a recount of the ring; the ring holds at most W requests."""
        assert len(self._ring) <= self.window, (len(self._ring), self.window)
        recount: dict[str, int] = {}
        for ids in self._ring:
            for u in ids:
                recount[u] = recount.get(u, 0) + 1
        for u, c in self._counts.items():
            recent, lifetime = c & _RECENT, c >> _SHIFT
            assert recent == recount.get(u, 0), f"f_W({u}) = {recent}, the ring says {recount.get(u, 0)}"
            assert lifetime >= recent, (u, recent, lifetime)
