"""Residents ranked by a score that changes often: buckets of equal scores, walked in order.

Scores of the demand rule take few distinct values (w_recent·a + w_lifetime·b for small
counts a, b), so residents are grouped in one insertion-ordered dict per score, and only
the set of distinct scores is kept sorted. Moving a unit between scores is two dict
operations; the sorted set changes only when a bucket appears or empties.

Within a bucket, the unit keyed earliest comes first (the natural tie-break: its score
last changed longest ago). The structure files each unit's :class:`UnitRecord` under the
score it was *keyed* at, and keeps that score in ``record.keyed`` (None: not ranked); the
caller decides when a key is stale (see :class:`~tessera.control.admission.DemandAdmission`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

from sortedcontainers import SortedList

from tessera.control.record import UnitRecord


class ScoreBuckets:
    """Records by keyed score, iterable in increasing (score, keying order). Verbs: put, drop, walk."""

    __slots__ = ("_buckets", "_scores", "_size", "lowest")

    def __init__(self) -> None:
        self._buckets: dict[float, dict[UnitRecord, None]] = {}  # records hash by identity
        self._scores = SortedList()  # distinct keyed scores, ascending
        self._size = 0
        # the smallest keyed score (inf when empty): a caller can tell without starting a walk
        # that nothing ranks below its candidate
        self.lowest = math.inf

    def __len__(self) -> int:
        return self._size

    def put(self, record: UnitRecord, score: float) -> None:
        """Key a record at ``score`` (re-keying moves it to the end of that score's bucket)."""
        if record.keyed is not None:
            self.drop(record)
        bucket = self._buckets.get(score)
        if bucket is None:
            bucket = self._buckets[score] = {}
            self._scores.add(score)
            if score < self.lowest:
                self.lowest = score
        bucket[record] = None
        record.keyed = score
        self._size += 1

    def drop(self, record: UnitRecord) -> None:
        score = record.keyed
        assert score is not None, f"{record.unit_id} is not ranked"
        record.keyed = None
        bucket = self._buckets[score]
        del bucket[record]
        self._size -= 1
        if not bucket:
            del self._buckets[score]
            scores = self._scores
            scores.remove(score)
            if score == self.lowest:
                self.lowest = scores[0] if scores else math.inf

    def walk(self, below: float, fresh: Callable[[UnitRecord], float]) -> Generator[UnitRecord, None, None]:
        """Yield records in increasing keyed-score order while the score is < ``below``.

        ``fresh(record)`` returns the unit's current score, which must be >= its keyed
        score; a record whose score rose is re-keyed and met again at its new place (if
        still below ``below``). The caller may stop early; it must not mutate the structure
        while iterating.
        """
        i = 0
        scores = self._scores
        while i < len(scores):
            score = scores[i]
            if score >= below:
                return
            moved: list[tuple[UnitRecord, float]] = []
            try:
                for r in self._buckets[score]:
                    now = fresh(r)
                    if now != score:
                        moved.append((r, now))
                    else:
                        yield r
            finally:
                # applied after the bucket loop (a dict cannot change while iterated), and on
                # an early stop too, so the keys stay honest
                for r, now in moved:
                    self.put(r, now)
            if score in self._buckets:
                i += 1  # otherwise the emptied bucket's successor now sits at index i

    def items(self) -> list[tuple[float, UnitRecord]]:
        """(keyed score, record) in walk order."""
        return [(s, r) for s in self._scores for r in self._buckets[s]]

    def check_invariants(self) -> None:
        assert list(self._scores) == sorted(self._buckets), "distinct scores out of step with buckets"
        assert self.lowest == (self._scores[0] if self._scores else math.inf), (self.lowest, self._scores[:1])
        assert all(self._buckets.values()), "an empty bucket survived"
        assert sum(len(b) for b in self._buckets.values()) == self._size, "bucket sizes drifted"
        for s, bucket in self._buckets.items():
            for r in bucket:
                assert r.keyed == s, f"{r.unit_id} is in bucket {s} but keyed at {r.keyed}"
