"""Reassembling shared-tier entries from memory nodes' inventories after a plane restart.

Memory nodes report the blocks they hold, verified against their own headers. A unit is
*complete* when all its ceil(T / B) blocks were reported at one epoch, each with the token
count its index implies for the unit's current length T.

It decides nothing about slots or leases: the directory adopts a candidate only if all its
slots are free, and the plane decides which units may be adopted at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tessera.messages.common import BlockRef
from tessera.messages.kvpool import InventoryBlock


class Reassembly:
    """Verbs: ``add`` (reported blocks of live units), ``complete`` (candidates ready to adopt)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        # (unit, epoch, n_tokens) -> block index -> where it is
        self._parts: dict[tuple[str, int, int], dict[int, BlockRef]] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, node: str, blocks: Iterable[tuple[InventoryBlock, str, int]]) -> None:
        """(block, unit_id, n_tokens of the unit now) of one node; blocks of another length are ignored."""
        B = self.block_tokens
        for blk, unit_id, n in blocks:
            start = blk.block_index * B
            if blk.unit_tokens != n or not 0 <= start < n or blk.tokens != min(B, n - start):
                continue  # written for another length: not this unit's state
            self._parts.setdefault((unit_id, blk.epoch, n), {})[blk.block_index] = BlockRef(node, blk.slot)

    def complete(self) -> Iterator[tuple[str, int, tuple[BlockRef, ...], int]]:
        """Pop and yield every complete candidate: (unit_id, epoch, blocks in order, n_tokens)."""
        for key, found in list(self._parts.items()):
            unit_id, epoch, n = key
            nb = -(-n // self.block_tokens)
            if len(found) == nb:
                del self._parts[key]
                yield unit_id, epoch, tuple(found[i] for i in range(nb)), n
