"""Residents ranked by a score that changes often: buckets of equal scores, walked in order.

Scores of the demand rule take few distinct values (w_recent·a + w_lifetime·b for small
counts a, b), so residents are grouped in one insertion-ordered dict per score, and only
the set of distinct scores is kept sorted. Moving a unit between scores is two dict
operations; the sorted set changes only when a bucket appears or empties.

Within a bucket, the unit keyed earliest comes first (the natural tie-break: its score
last changed longest ago). The structure stores the score each unit was *keyed* at; the
caller decides when a key is stale (see :class:`~tessera.control.admission.DemandAdmission`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from sortedcontainers import SortedList


class ScoreBuckets:
    """unit -> keyed score, iterable in increasing (score, keying order). Verbs: put, drop, walk."""

    __slots__ = ("_buckets", "_keyed", "_scores")

    def __init__(self) -> None:
        self._buckets: dict[float, dict[str, None]] = {}
        self._scores = SortedList()  # distinct keyed scores, ascending
        self._keyed: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._keyed)

    def __contains__(self, unit_id: object) -> bool:
        return unit_id in self._keyed

    def keyed(self, unit_id: str) -> float | None:
        return self._keyed.get(unit_id)

    def put(self, unit_id: str, score: float) -> None:
        """Key a unit at ``score`` (re-keying moves it to the end of that score's bucket)."""
        if unit_id in self._keyed:
            self.drop(unit_id)
        bucket = self._buckets.get(score)
        if bucket is None:
            bucket = self._buckets[score] = {}
            self._scores.add(score)
        bucket[unit_id] = None
        self._keyed[unit_id] = score

    def drop(self, unit_id: str) -> None:
        score = self._keyed.pop(unit_id)
        bucket = self._buckets[score]
        del bucket[unit_id]
        if not bucket:
            del self._buckets[score]
            self._scores.remove(score)

    def walk(self, below: float, fresh: Callable[[str, float], float]) -> Generator[tuple[str, float], None, None]:
        """Yield (unit, score) in increasing score order while score < ``below``.

        ``fresh(unit, keyed)`` returns the unit's current score, which must be >= its keyed
        score; a unit whose score rose is re-keyed and met again at its new place (if still
        below ``below``). The caller may stop early; it must not mutate the structure while
        iterating.
        """
        i = 0
        scores = self._scores
        while i < len(scores):
            score = scores[i]
            if score >= below:
                return
            moved: list[tuple[str, float]] = []
            try:
                for u in self._buckets[score]:
                    now = fresh(u, score)
                    if now != score:
                        moved.append((u, now))
                    else:
                        yield u, score
            finally:
                # applied after the bucket loop (a dict cannot change while iterated), and on
                # an early stop too, so the keys stay honest
                for u, now in moved:
                    self.put(u, now)
            if score in self._buckets:
                i += 1  # otherwise the emptied bucket's successor now sits at index i

    def items(self) -> list[tuple[float, str]]:
        """(keyed score, unit) in walk order."""
        return [(s, u) for s in self._scores for u in self._buckets[s]]

    def check_invariants(self) -> None:
        assert list(self._scores) == sorted(self._buckets), "distinct scores out of step with buckets"
        assert all(self._buckets.values()), "an empty bucket survived"
        assert sum(len(b) for b in self._buckets.values()) == len(self._keyed), "bucket sizes drifted"
        for u, s in self._keyed.items():
            assert u in self._buckets[s], f"{u} is keyed at {s} but not in that bucket"
