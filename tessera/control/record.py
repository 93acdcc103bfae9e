"""What one cache tier knows about its units, kept in columns: one slot per unit.

Why columns and not one object per unit: a tier holds every unit its stream ever
retrieved, and one Python object per unit is one more object every full garbage collection
scans in the plan loop. A str->int dict, an ``array`` and lists of ints are not tracked or
are walked cheaply. Slots live as long as the tier, like the lifetime counts they hold.

This module knows nothing about scores, capacity or nodes; the policies give the columns meaning.
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
