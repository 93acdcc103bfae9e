"""The routing index: which generation nodes' local views hold each unit, as one bitmask per unit.

Each node's :class:`~tessera.control.local.LocalTier` sets and clears its own bit (node ``i``
owns bit ``1 << i``) through ``add`` and ``discard`` as its view admits and drops units; a
cache-aware router asks how many
blocks of a request's units each node holds. Popular units share holder sets, so the count
is added once per distinct mask, not once per unit.

This module knows nothing of admission, capacity or liveness.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1 << 12)
def _bits(mask: int) -> tuple[int, ...]:
    """Indices of the set bits of a holders mask (few distinct masks recur: cached)."""
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


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

    def blocks_per_node(self, pairs: tuple[tuple[str, int], ...]) -> list[int]:
        """Blocks of these (unit, blocks) pairs each node's local view holds, indexed by node index."""
        holders = self._holders
        by_mask: dict[int, int] = {}  # popular units share holder sets: add per set, not per unit
        for u, b in pairs:
            mask = holders.get(u)
            if mask:
                by_mask[mask] = by_mask.get(mask, 0) + b
        out = [0] * self.n_nodes
        for mask, b in by_mask.items():
            for i in _bits(mask):
                out[i] += b
        return out
