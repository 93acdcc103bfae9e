"""What one cache tier knows about one unit, kept in one record.

Each tier (the shared tier, and each generation node's local view) keeps a table
unit id -> :class:`UnitRecord`: the unit's demand in the tier's own request stream
(f_W, f_∞), its residency in the tier (blocks held) and its place in the tier's eviction
ranking (the score it was filed under).

Why one record and not one dict per attribute: the tables hold every unit a stream has
retrieved (10^4–10^5 of them, Zipf-popular), so each separate dict costs another cache
miss per unit per request; with one record the first lookup of a request brings the
unit's whole state in. The request window keeps the records themselves, so a request
leaving the window costs no lookups at all.

Records are created on a unit's first retrieval in the stream (or when the tier learns it
holds the unit) and live as long as the tier, like the lifetime counts they hold. This
module knows nothing about scores, capacity or nodes; the policies give the fields meaning.
"""

from __future__ import annotations


class UnitRecord:
    """One unit in one tier. Written by the tier's admission policy only."""

    __slots__ = ("blocks", "keyed", "lifetime", "recent", "unit_id")

    def __init__(self, unit_id: str) -> None:
        self.unit_id = unit_id
        self.recent = 0  # f_W: requests among the stream's last W that retrieved the unit
        self.lifetime = 0  # f_∞: all requests of the stream that retrieved it
        self.blocks = 0  # blocks it occupies in the tier; 0: not resident
        # the score the tier's ranking filed it under; None: not ranked (policies that rank)
        self.keyed: float | None = None

    def __repr__(self) -> str:
        return (f"UnitRecord({self.unit_id!r}, recent={self.recent}, lifetime={self.lifetime}, "
                f"blocks={self.blocks}, keyed={self.keyed})")


NO_RECORD = UnitRecord("")  # what a lookup of a unit the tier never saw reads: all zero; never written


class UnitTable(dict[str, UnitRecord]):
    """unit id -> record. ``table[u]`` creates a missing record; ``table.get(u)`` never does."""

    __slots__ = ()

    def __missing__(self, unit_id: str) -> UnitRecord:
        record = self[unit_id] = UnitRecord(unit_id)
        return record
