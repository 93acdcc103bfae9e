"""Residents ranked by a score that changes often: buckets of equal scores, walked in order.

Demand scores take few distinct values (w_recent·a + w_lifetime·b for small counts), so
slots are grouped in one insertion-ordered dict per score and only the distinct scores are
kept sorted: a move is two dict operations. Within a bucket the unit keyed earliest comes
first. The caller decides when a key is stale (see
:class:`~tessera.control.admission.DemandAdmission`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

from sortedcontainers import SortedList

from tessera.control.record import NOT_KEYED, UnitTable


class ScoreBuckets:
    """Slots by keyed score, iterable in increasing (score, keying order). Verbs: put, drop, walk."""

    __slots__ = ("_buckets", "_keyed", "_scores", "_size", "lowest")

    def __init__(self, table: UnitTable) -> None:
        self._keyed = table.keyed  # slot -> keyed score (written here only)
        self._buckets: dict[float, dict[int, None]] = {}
        self._scores = SortedList()  # distinct keyed scores, ascending
        self._size = 0
        self.lowest = math.inf  # lets a caller skip a walk when nothing ranks below its candidate

    def __len__(self) -> int:
        return self._size

    def put(self, i: int, score: float) -> None:
        """Key slot ``i`` at ``score`` (re-keying moves it to the end of that score's bucket)."""
        if self._keyed[i] != NOT_KEYED:
            self.drop(i)
        bucket = self._buckets.get(score)
        if bucket is None:
            bucket = self._buckets[score] = {}
            self._scores.add(score)
            if score < self.lowest:
                self.lowest = score
        bucket[i] = None
        self._keyed[i] = score
        self._size += 1

    def drop(self, i: int) -> None:
        keyed = self._keyed
        score = keyed[i]
        assert score != NOT_KEYED, f"slot {i} is not ranked"
        keyed[i] = NOT_KEYED
        bucket = self._buckets[score]
        del bucket[i]
        self._size -= 1
        if not bucket:
            del self._buckets[score]
            scores = self._scores
            scores.remove(score)
            if score == self.lowest:
                self.lowest = scores[0] if scores else math.inf

    def walk(self, below: float, fresh: Callable[[int], float]) -> Generator[int, None, None]:
        """Yield slots in increasing keyed-score order while the score is < ``below``.

        ``fresh(slot)`` returns the unit's current score, which must be >= its keyed
        score; a slot whose score rose is re-keyed and met again at its new place (if
        still below ``below``). The caller may stop early; it must not mutate the structure
        while iterating.
        """
        i = 0
        scores = self._scores
        while i < len(scores):
            score = scores[i]
            if score >= below:
                return
            moved: list[tuple[int, float]] = []
            try:
                for r in self._buckets[score]:
                    now = fresh(r)
                    if now != score:
                        moved.append((r, now))
                    else:
                        yield r
            finally:
                # after the bucket loop (a dict cannot change while iterated), and on an early stop
                for r, now in moved:
                    self.put(r, now)
            if score in self._buckets:
                i += 1  # otherwise the emptied bucket's successor now sits at index i

    def items(self) -> list[tuple[float, int]]:
        """(keyed score, slot) in walk order."""
        return [(s, r) for s in self._scores for r in self._buckets[s]]

    def check_invariants(self) -> None:
        assert list(self._scores) == sorted(self._buckets), "distinct scores out of step with buckets"
        assert self.lowest == (self._scores[0] if self._scores else math.inf), (self.lowest, self._scores[:1])
        assert all(self._buckets.values()), "an empty bucket survived"
        assert sum(len(b) for b in self._buckets.values()) == self._size, "bucket sizes drifted"
        for s, bucket in self._buckets.items():
            for i in bucket:
                assert self._keyed[i] == s, f"slot {i} is in bucket {s} but keyed at {self._keyed[i]}"
