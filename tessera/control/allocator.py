"""Block allocation across the memory nodes of the KV Pool.

Memory nodes hold payloads only; which arena slot belongs to which unit is decided here, in
the control plane. A unit's blocks may come from several memory nodes.

Verbs: ``add_node / remove_node / allocate / free``. This module knows nothing about units,
epochs or leases (see :mod:`tessera.control.directory`).
"""

from __future__ import annotations

from tessera.messages import BlockRef


class NodeBlocks:
    """Free list of one memory node's arena slots."""

    def __init__(self, name: str, capacity: int) -> None:
        assert capacity > 0, capacity
        self.name = name
        self.capacity = capacity
        # pop() from the end: hand out low indices first (nicer to read in tests and dumps)
        self._free = list(range(capacity - 1, -1, -1))
        self._used: set[int] = set()
        # BlockRefs are immutable: build each once, on first use (the plan path hands out many)
        self._refs: list[BlockRef | None] = [None] * capacity

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert 0 <= n <= len(self._free), (n, len(self._free))
        taken = [self._free.pop() for _ in range(n)]
        self._used.update(taken)
        return taken

    def refs(self, indices: list[int]) -> list[BlockRef]:
        out: list[BlockRef] = []
        cache = self._refs
        for i in indices:
            ref = cache[i]
            if ref is None:
                ref = cache[i] = BlockRef(self.name, i)
            out.append(ref)
        return out

    def free(self, indices: list[int]) -> None:
        for i in indices:
            assert i in self._used, f"block {self.name}:{i} freed twice or never allocated"
            self._used.remove(i)
            self._free.append(i)


class BlockAllocator:
    """All memory nodes' free lists; allocations prefer the node with most free blocks."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeBlocks] = {}

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    @property
    def free_blocks(self) -> int:
        return sum(n.free_count for n in self._nodes.values())

    @property
    def capacity(self) -> int:
        return sum(n.capacity for n in self._nodes.values())

    def has_node(self, name: str) -> bool:
        return name in self._nodes

    def add_node(self, name: str, capacity: int) -> None:
        assert name not in self._nodes, f"memory node {name} added twice"
        self._nodes[name] = NodeBlocks(name, capacity)

    def remove_node(self, name: str) -> None:
        """Forget a node and every slot on it (it died or restarted empty)."""
        self._nodes.pop(name, None)

    def allocate(self, n: int) -> tuple[BlockRef, ...] | None:
        """n blocks, possibly spread over nodes; None (and nothing taken) if fewer are free."""
        if n > self.free_blocks:
            return None
        out: list[BlockRef] = []
        remaining = n
        # most free first keeps nodes balanced; a unit spills onto the next node when needed
        for node in sorted(self._nodes.values(), key=lambda nb: -nb.free_count):
            if remaining == 0:
                break
            take = min(remaining, node.free_count)
            out.extend(node.refs(node.allocate(take)))
            remaining -= take
        assert remaining == 0, remaining
        return tuple(out)

    def free(self, blocks: tuple[BlockRef, ...] | list[BlockRef]) -> None:
        by_node: dict[str, list[int]] = {}
        for b in blocks:
            by_node.setdefault(b.node, []).append(b.index)
        for name, indices in by_node.items():
            node = self._nodes.get(name)
            if node is not None:  # a removed node's slots are gone with it
                node.free(indices)
