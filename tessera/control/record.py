"""What one cache tier knows about its units, kept in columns: one slot per unit.

Each tier (the shared tier, and each generation node's local view) keeps a
:class:`UnitTable`: unit id -> slot, and per slot the unit's demand in the tier's own
request stream (f_W ``recent``, f_∞ ``lifetime``), its residency in the tier (``blocks``
held; 0: not resident) and its place in the tier's eviction ranking (``keyed``: the score
it was filed under, :data:`NOT_KEYED` when not ranked).

Why columns and not one object per unit: the tables hold every unit a stream has retrieved
(10^4–10^5 per tier, ~120k at 256 nodes), and one Python object per unit is one object the
cyclic garbage collector tracks. Every full collection scanned all of them: 60–250 ms pauses
in the plan loop, though none of them can ever be part of a cycle. Here a tier is a handful
of containers whatever its size: the slot map holds only strings and ints (CPython does not
track such a dict), ``keyed`` is an ``array`` (not tracked), and the int columns are lists
of ints, which a collection walks with no per-unit object to examine (counts are mostly
small, preallocated ints); the demand window keeps tuples of slots, which the collector
untracks at their first collection. A column read is one list index, as many instructions
as an attribute of a per-unit object; the possible price is locality (one unit's state
spans four lists, more cache lines per unit), which README "Control plane" did not measure
beyond this machine's noise.

Slots are created on a unit's first retrieval in the stream (or when the tier learns it
holds the unit) and live as long as the tier, like the lifetime counts they hold. This
module knows nothing about scores, capacity or nodes; the policies give the columns meaning.
"""

from __future__ import annotations

from array import array

NOT_KEYED = -1.0  # ``keyed`` of a unit that is not ranked (every score is >= 0)


class UnitTable:
    """unit id -> slot, and the per-slot columns. Written by the tier's admission policy only.

    ``slot(u)`` creates a missing unit's slot (all zero, not keyed); ``slots.get(u)`` and the
    readers (``blocks_of`` ...) never do.
    """

    __slots__ = ("blocks", "ids", "keyed", "lifetime", "recent", "slots")

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}  # unit id -> slot (str keys, int values: never GC-tracked)
        self.ids: list[str] = []  # slot -> unit id
        self.recent: list[int] = []  # f_W: requests among the stream's last W that retrieved the unit
        self.lifetime: list[int] = []  # f_∞: all requests of the stream that retrieved it
        self.blocks: list[int] = []  # blocks it occupies in the tier; 0: not resident
        self.keyed = array("d")  # the score the tier's ranking filed it under (policies that rank)

    def slot(self, unit_id: str) -> int:
        """The unit's slot, created (all zero, not keyed) if the tier never saw it."""
        i = self.slots.get(unit_id)
        if i is None:
            i = self.slots[unit_id] = len(self.ids)
            self.ids.append(unit_id)
            self.recent.append(0)
            self.lifetime.append(0)
            self.blocks.append(0)
            self.keyed.append(NOT_KEYED)
        return i

    def blocks_of(self, unit_id: str) -> int:
        """Blocks the tier holds of the unit (0: not resident, or never seen)."""
        i = self.slots.get(unit_id)
        return 0 if i is None else self.blocks[i]

    def __contains__(self, unit_id: object) -> bool:
        """The tier has a slot for the unit (it saw it; resident or not)."""
        return unit_id in self.slots

    def __len__(self) -> int:
        return len(self.ids)

    def describe(self, unit_id: str) -> str:
        """One unit's columns, for assertion messages and dumps."""
        i = self.slots.get(unit_id)
        if i is None:
            return f"{unit_id!r}: no slot"
        keyed = self.keyed[i]
        return (f"{unit_id!r}: recent={self.recent[i]}, lifetime={self.lifetime[i]}, blocks={self.blocks[i]}, "
                f"keyed={None if keyed == NOT_KEYED else keyed}")
