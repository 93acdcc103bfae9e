"""Block allocation across the memory nodes of the KV Pool.

Memory nodes hold payloads only; which arena slot belongs to which unit is decided here. A
unit's blocks may come from several memory nodes. This module knows nothing about units,
epochs or leases.
"""

from __future__ import annotations

from tessera.messages.common import BlockRef


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
        free = self._free
        assert 0 <= n <= len(free), (n, len(free))
        taken = free[:-n - 1:-1]  # what n pops from the end would give, in that order
        del free[len(free) - n:]
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

    def all_free(self, indices: list[int]) -> bool:
        return len(set(indices)) == len(indices) and set(self._free).issuperset(indices)

    def claim(self, indices: list[int]) -> None:
        """Take these exact free slots (recovery; check ``all_free`` first)."""
        assert self.all_free(indices), (self.name, indices)
        taken = set(indices)
        self._free = [i for i in self._free if i not in taken]
        self._used.update(taken)

    def free(self, indices: list[int]) -> None:
        used = self._used
        before = len(used)
        used.difference_update(indices)
        # the set shrinks by one per index only if every index was in use, and named once
        assert before - len(used) == len(indices), f"blocks {self.name}:{indices} freed twice or never allocated"
        self._free.extend(indices)


class BlockAllocator:
    """All memory nodes' free lists; allocations prefer the node with most free blocks."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeBlocks] = {}
        # totals kept current (admission reads them for every candidate); read-only outside
        self.free_blocks = 0
        self.capacity = 0

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def add_node(self, name: str, capacity: int) -> None:
        assert name not in self._nodes, f"memory node {name} added twice"
        self._nodes[name] = NodeBlocks(name, capacity)
        self.capacity += capacity
        self.free_blocks += capacity

    def remove_node(self, name: str) -> None:
        """Forget a node and every slot on it (it died or restarted empty)."""
        node = self._nodes.pop(name, None)
        if node is not None:
            self.capacity -= node.capacity
            self.free_blocks -= node.free_count

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
        self.free_blocks -= n
        return tuple(out)

    def claim(self, blocks: tuple[BlockRef, ...]) -> bool:
        """Take these exact blocks if all are free (entries recovered from a memory node)."""
        by_node: dict[str, list[int]] = {}
        for b in blocks:
            by_node.setdefault(b.node, []).append(b.index)
        nodes: list[NodeBlocks] = []
        for name, indices in by_node.items():
            node = self._nodes.get(name)
            if node is None or not node.all_free(indices):
                return False
            nodes.append(node)
        for node in nodes:
            node.claim(by_node[node.name])
        self.free_blocks -= len(blocks)
        return True

    def take_all(self, name: str) -> tuple[BlockRef, ...]:
        """Every free block of one node (to fence a node that came back)."""
        node = self._nodes[name]
        taken = node.refs(node.allocate(node.free_count))
        self.free_blocks -= len(taken)
        return tuple(taken)

    def free(self, blocks: tuple[BlockRef, ...] | list[BlockRef]) -> None:
        by_node: dict[str, list[int]] = {}
        for b in blocks:
            indices = by_node.get(b.node)
            if indices is None:
                by_node[b.node] = [b.index]
            else:
                indices.append(b.index)
        for name, indices in by_node.items():
            node = self._nodes.get(name)
            if node is not None:  # a removed node's slots are gone with it
                node.free(indices)
                self.free_blocks += len(indices)

    def check_invariants(self) -> None:
        nodes = self._nodes.values()
        assert self.capacity == sum(n.capacity for n in nodes), (self.capacity, [n.capacity for n in nodes])
        assert self.free_blocks == sum(n.free_count for n in nodes), (self.free_blocks, [n.free_count for n in nodes])
