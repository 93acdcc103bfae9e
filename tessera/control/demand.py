"""Retrieval demand of one request stream (paper §5.2).

    s(u, t) = w_recent · f_W(u, t) + w_lifetime · f_∞(u, t)

f_W counts the requests among the stream's last W that retrieved u; f_∞ counts all of them.
W is measured in requests of *this* stream: the shared tier's tracker sees every request,
a generation node's local tracker only the requests routed to that node, so one unit has a
different score in each tier.

The counts live in the tier's :class:`~tessera.control.record.UnitRecord`s. The window is
a ring of the last W requests' records: when a request falls out of the window its records
are decremented at once (no lookup, no scan), so a score is two attribute reads.
A unit counts once per request however often the request names it.

This module knows nothing about residency, capacity or nodes.
"""

from __future__ import annotations

from collections import deque

from tessera.control.record import NO_RECORD, UnitRecord, UnitTable

MAX_WINDOW = (1 << 24) - 1  # the config's bound on W (control.window)


class DemandTracker:
    """Recent-window and lifetime retrieval counts of one stream. Verbs: ``count``, ``score``."""

    __slots__ = ("_ring", "records", "requests", "w_lifetime", "w_recent", "window")

    def __init__(self, window: int, w_recent: float, w_lifetime: float, records: UnitTable | None = None) -> None:
        assert 0 < window <= MAX_WINDOW and w_recent >= 0 and w_lifetime >= 0, (window, w_recent, w_lifetime)
        self.window = window
        self.w_recent = float(w_recent)
        self.w_lifetime = float(w_lifetime)
        self.requests = 0  # requests recorded so far: the stream's clock
        self.records = UnitTable() if records is None else records  # shared with the tier's policy
        self._ring: deque[list[UnitRecord]] = deque()

    def count(self, unit_ids: tuple[str, ...]) -> list[UnitRecord]:
        """Count one request retrieving ``unit_ids`` (distinct ids).

        Returns the records of the request that just left the window: their scores dropped,
        so a caller ordering units by score must re-key them (the request's own units rose).
        """
        records = self.records
        entered = []
        for u in unit_ids:
            r = records[u]
            r.recent += 1
            r.lifetime += 1
            entered.append(r)
        ring = self._ring
        ring.append(entered)
        self.requests += 1
        if len(ring) <= self.window:
            return []
        left = ring.popleft()
        for r in left:
            r.recent -= 1
        return left

    def record(self, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
        """:meth:`count`, answering with the ids of the units that left the window."""
        return tuple([r.unit_id for r in self.count(unit_ids)])

    def score_of(self, r: UnitRecord) -> float:
        return self.w_recent * r.recent + self.w_lifetime * r.lifetime

    def score(self, unit_id: str) -> float:
        r = self.records.get(unit_id, NO_RECORD)
        return self.w_recent * r.recent + self.w_lifetime * r.lifetime

    def admissible(self, unit_id: str, min_retrievals: int, theta: float) -> bool:
        """Retrieved at least ``min_retrievals`` times in the stream and s(u) >= θ."""
        r = self.records.get(unit_id, NO_RECORD)
        return r.lifetime >= min_retrievals and self.w_recent * r.recent + self.w_lifetime * r.lifetime >= theta

    def recent(self, unit_id: str) -> int:
        """f_W(u): requests among the last W that retrieved u."""
        return self.records.get(unit_id, NO_RECORD).recent

    def lifetime(self, unit_id: str) -> int:
        """f_∞(u): all requests of the stream that retrieved u."""
        return self.records.get(unit_id, NO_RECORD).lifetime

    def check_invariants(self) -> None:
        """f_W equals a recount of the ring; the ring holds at most W requests."""
        assert len(self._ring) <= self.window, (len(self._ring), self.window)
        recount: dict[str, int] = {}
        for entered in self._ring:
            for r in entered:
                assert self.records.get(r.unit_id) is r, f"the ring holds a stale record of {r.unit_id}"
                recount[r.unit_id] = recount.get(r.unit_id, 0) + 1
        for u, r in self.records.items():
            assert r.recent == recount.get(u, 0), f"f_W({u}) = {r.recent}, the ring says {recount.get(u, 0)}"
            assert r.lifetime >= r.recent, (u, r.recent, r.lifetime)
