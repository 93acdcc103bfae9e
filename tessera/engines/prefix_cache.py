"""Exact prefix cache: a radix tree over token ids whose edges carry post-RoPE K/V.

Reuse stops at the first differing token, exactly as in vLLM/SGLang prefix caching; this is
both the engine's cache for verbatim-repeated text (system prompts, chat history) and the
``prefix`` baseline Tessera is compared against.

Capacity is counted in tokens. When an insert needs room, least-recently-used *unlocked
leaves* are evicted first (an inner node always holds a prefix that some leaf extends).
``lock``/``unlock`` pin a matched path, for callers that read entries after ``match`` returns.

Entries live in *namespaces* (one radix tree each, sharing the capacity): a request only
matches what requests of its own namespace inserted. The generation node uses the tenant,
so one tenant's prompts never give another tenant a hit (or a ``prefix_cached_tokens`` count).

The cache stores whatever tensors ``insert`` is handed (``[L, n, H_kv, D]`` keys and values);
it never looks inside them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

KVRange = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (start, end) -> K, V [L, end-start, ...]


class _Node:
    __slots__ = ("children", "keys", "last_used", "locks", "parent", "tokens", "values")

    def __init__(self, parent: _Node | None, tokens: tuple[int, ...], keys: torch.Tensor | None,
                 values: torch.Tensor | None) -> None:
        self.parent = parent
        self.tokens = tokens  # edge label from parent
        self.keys = keys  # [L, len(tokens), H_kv, D]
        self.values = values
        self.children: dict[int, _Node] = {}
        self.locks = 0
        self.last_used = 0


@dataclass
class PrefixHit:
    length: int = 0
    chunks: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (start, K, V)
    nodes: list[_Node] = field(default_factory=list)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class PrefixCache:
    def __init__(self, capacity_tokens: int) -> None:
        assert capacity_tokens >= 0, capacity_tokens
        self.capacity = capacity_tokens
        self.n_tokens = 0
        self._roots: dict[str, _Node] = {}  # namespace -> root; roots are the nodes without a parent
        self._clock = itertools.count(1)

    def match(self, token_ids: Sequence[int], namespace: str = "") -> PrefixHit:
        """Longest cached prefix of ``token_ids`` in ``namespace`` (may end inside an edge)."""
        hit = PrefixHit()
        root = self._roots.get(namespace)
        if root is None:
            return hit
        node, pos, now = root, 0, next(self._clock)
        while pos < len(token_ids) and (child := node.children.get(token_ids[pos])) is not None:
            n = _common(child.tokens, token_ids[pos:pos + len(child.tokens)])
            assert child.keys is not None and child.values is not None
            hit.chunks.append((pos, child.keys[:, :n], child.values[:, :n]))
            hit.nodes.append(child)
            child.last_used = now
            pos += n
            if n < len(child.tokens):
                break
            node = child
        hit.length = pos
        return hit

    def lock(self, hit: PrefixHit) -> None:
        for n in hit.nodes:
            n.locks += 1

    def unlock(self, hit: PrefixHit) -> None:
        for n in hit.nodes:
            assert n.locks > 0, "unlock without lock"
            n.locks -= 1

    def insert(self, token_ids: Sequence[int], kv: KVRange, namespace: str = "") -> int:
        """Store the K/V of ``token_ids`` not cached yet (``kv(start, end)`` supplies them).

        Returns the number of tokens newly stored (fewer than missing if capacity runs out).
        """
        if self.capacity == 0:
            return 0
        hit = self.match(token_ids, namespace)
        if hit.length == len(token_ids):
            return 0
        parent = self._roots.setdefault(namespace, _Node(None, (), None, None))
        if hit.nodes:
            last = hit.nodes[-1]
            consumed = hit.chunks[-1][1].shape[1]
            parent = self._split(last, consumed) if consumed < len(last.tokens) else last
        # pin the path we attach to while making room
        path = PrefixHit(nodes=[*hit.nodes[:-1], parent] if hit.nodes else [])
        self.lock(path)
        try:
            self.evict(len(token_ids) - hit.length - (self.capacity - self.n_tokens))
        finally:
            self.unlock(path)
        end = min(len(token_ids), hit.length + self.capacity - self.n_tokens)
        if end <= hit.length:
            return 0
        keys, values = kv(hit.length, end)
        leaf = _Node(parent, tuple(token_ids[hit.length:end]), keys, values)
        leaf.last_used = next(self._clock)
        parent.children[leaf.tokens[0]] = leaf
        self.n_tokens += end - hit.length
        return end - hit.length

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; return the new upper node."""
        assert node.parent is not None and node.keys is not None and node.values is not None
        # clone: a view would keep the whole edge's storage alive after the lower part is evicted
        upper = _Node(node.parent, node.tokens[:at], node.keys[:, :at].clone(), node.values[:, :at].clone())
        upper.last_used = node.last_used  # no locks: while the lower part is pinned, upper is no leaf
        node.parent.children[upper.tokens[0]] = upper
        node.parent = upper
        node.tokens = node.tokens[at:]
        node.keys, node.values = node.keys[:, at:].clone(), node.values[:, at:].clone()
        upper.children[node.tokens[0]] = node
        return upper

    def evict(self, n_tokens: int) -> int:
        """Evict LRU unlocked leaves until ``n_tokens`` are freed (or nothing evictable is left)."""
        if n_tokens <= 0:
            return 0
        heap = [(n.last_used, id(n), n) for n in self._leaves() if n.locks == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[0]]
            freed += len(node.tokens)
            self.n_tokens -= len(node.tokens)
            if parent.parent is not None and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.children and node.parent is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out
