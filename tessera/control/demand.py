"""Retrieval demand of one request stream (paper §5.2).

    s(u, t) = w_recent · f_W(u, t) + w_lifetime · f_∞(u, t)

f_W counts the requests among the stream's last W that retrieved u; f_∞ counts all of them.
W is in requests of *this* stream (the shared tier sees every request, a node's local tier
only those routed to it), so one unit has a different score in each tier. A unit counts
once per request. The window is a ring of the last W requests' slots, decremented as they
leave, so a score is two list reads.

This module knows nothing about residency, capacity or nodes.
"""

from __future__ import annotations

from collections import deque

from tessera.control.record import UnitTable

MAX_WINDOW = (1 << 24) - 1  # the config's bound on W (control.window)


class DemandTracker:
    """Recent-window and lifetime retrieval counts of one stream. Verbs: ``count``, ``score``."""

    __slots__ = ("_lifetime", "_recent", "_ring", "records", "requests", "w_lifetime", "w_recent", "window")

    def __init__(self, window: int, w_recent: float, w_lifetime: float, records: UnitTable | None = None) -> None:
        assert 0 < window <= MAX_WINDOW and w_recent >= 0 and w_lifetime >= 0, (window, w_recent, w_lifetime)
        self.window = window
        self.w_recent = float(w_recent)
        self.w_lifetime = float(w_lifetime)
        self.requests = 0  # requests recorded so far: the stream's clock
        self.records = UnitTable() if records is None else records  # shared with the tier's policy
        self._ring: deque[tuple[int, ...]] = deque()  # slots of the last W requests
        # the table's columns (grown in place, never replaced)
        self._recent, self._lifetime = self.records.recent, self.records.lifetime

    def count(self, unit_ids: tuple[str, ...]) -> tuple[int, ...]:
        """Count one request retrieving ``unit_ids`` (distinct ids).

        Returns the slots of the request that just left the window: their scores dropped,
        so a caller ordering units by score must re-key them (the request's own units rose).
        """
        table = self.records
        slots, recent, lifetime = table.slots, table.recent, table.lifetime
        entered = []
        for u in unit_ids:
            i = slots.get(u)
            if i is None:
                i = table.slot(u)
            recent[i] += 1
            lifetime[i] += 1
            entered.append(i)
        ring = self._ring
        ring.append(tuple(entered))  # a tuple of ints: untracked by the collector once it saw it
        self.requests += 1
        if len(ring) <= self.window:
            return ()
        left = ring.popleft()
        for i in left:
            recent[i] -= 1
        return left

    def record(self, unit_ids: tuple[str, ...]) -> tuple[str, ...]:
        """:meth:`count`, answering with the ids of the units that left the window."""
        ids = self.records.ids
        return tuple([ids[i] for i in self.count(unit_ids)])

    def score_of(self, i: int) -> float:
        """s(u) of the unit in slot ``i``."""
        return self.w_recent * self._recent[i] + self.w_lifetime * self._lifetime[i]

    def score(self, unit_id: str) -> float:
        i = self.records.slots.get(unit_id)
        return 0.0 if i is None else self.score_of(i)

    def admissible(self, unit_id: str, min_retrievals: int, theta: float) -> bool:
        """Retrieved at least ``min_retrievals`` times in the stream and s(u) >= θ."""
        i = self.records.slots.get(unit_id)
        if i is None:
            return min_retrievals <= 0 and theta <= 0.0
        return self.records.lifetime[i] >= min_retrievals and self.score_of(i) >= theta

    def recent(self, unit_id: str) -> int:
        """f_W(u): requests among the last W that retrieved u."""
        i = self.records.slots.get(unit_id)
        return 0 if i is None else self.records.recent[i]

    def lifetime(self, unit_id: str) -> int:
        """f_∞(u): all requests of the stream that retrieved u."""
        i = self.records.slots.get(unit_id)
        return 0 if i is None else self.records.lifetime[i]

    def check_invariants(self) -> None:
        """f_W equals a recount of the ring; the ring holds at most W requests."""
        table = self.records
        assert len(self._ring) <= self.window, (len(self._ring), self.window)
        recount = [0] * len(table)
        for entered in self._ring:
            assert len(set(entered)) == len(entered), f"a request counted a unit twice: {entered}"
            for i in entered:
                recount[i] += 1
        for u, i in table.slots.items():
            assert table.ids[i] == u, f"slot {i} is filed under {table.ids[i]!r}, not {u!r}"
            assert table.recent[i] == recount[i], f"f_W({u}) = {table.recent[i]}, the ring says {recount[i]}"
            assert table.lifetime[i] >= table.recent[i], table.describe(u)
