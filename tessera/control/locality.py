"""The routing index: which generation nodes' local views hold each unit, as one bitmask per unit.

Each node's :class:`~tessera.control.local.LocalTier` sets and clears its own bit (node ``i``
owns ``1 << i``). ``holders`` answers holder mask -> blocks: popular units share holder sets,
so a router's cost follows the distinct masks, not the units or the nodes.

This module knows nothing of admission, capacity or liveness.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from tessera.control.fleet import bits


@functools.lru_cache(maxsize=1 << 12)
def set_bits(mask: int) -> tuple[int, ...]:
    """Indices of the set bits of a holders mask (few distinct masks recur: cached)."""
    return tuple(bits(mask))


def spread(holders: Mapping[int, int], n_nodes: int) -> list[int]:
    """Blocks per node index from ``holders`` (mask -> blocks held by every node of the mask)."""
    out = [0] * n_nodes
    for mask, b in holders.items():
        for i in set_bits(mask):
            out[i] += b
    return out


class Locality:
    """Unit -> bitmask of the nodes whose local view holds it. Verbs: ``add / discard / holds``."""

    __slots__ = ("_holders", "n_nodes")

    def __init__(self, n_nodes: int) -> None:
        self.n_nodes = n_nodes
        self._holders: dict[str, int] = {}

    def add(self, unit_id: str, bit: int) -> None:
        """The view owning ``bit`` holds the unit now."""
        holders = self._holders
        holders[unit_id] = holders.get(unit_id, 0) | bit

    def discard(self, unit_id: str, bit: int) -> None:
        """The view owning ``bit`` no longer holds the unit (it held it)."""
        holders = self._holders
        mask = holders[unit_id] & ~bit
        if mask:
            holders[unit_id] = mask
        else:
            del holders[unit_id]

    def holds(self, unit_id: str, bit: int) -> bool:
        return bool(self._holders.get(unit_id, 0) & bit)

    def holders(self, pairs: tuple[tuple[str, int], ...],
                skip: Callable[[str], object] | None = None) -> dict[int, int]:
        """Holder mask -> blocks of these (unit, blocks) pairs that exactly those nodes hold.

        Units no view holds are absent, and so are units for which ``skip(unit)`` is true.
        """
        holders = self._holders
        by_mask: dict[int, int] = {}  # popular units share holder sets: add per set, not per unit
        for u, b in pairs:
            mask = holders.get(u)
            if mask and (skip is None or not skip(u)):
                by_mask[mask] = by_mask.get(mask, 0) + b
        return by_mask

    def blocks_per_node(self, pairs: tuple[tuple[str, int], ...]) -> list[int]:
        """Blocks of these (unit, blocks) pairs each node's local view holds, indexed by node index."""
        return spread(self.holders(pairs), self.n_nodes)
