"""Order-free units: deduplicate a request's units and order them so exact prefixes recur.

A request may declare that its units' order does not matter (``unit_order: "free"``, or a
scope listed in ``retrieval.order_free_scopes``). Exact prefix caching then serves whatever
the prompt shares, token for token, with a prompt served before; the order decides how much
that is. :class:`UnitOrders` remembers the unit orders this process served after each
leading text (a trie of unit ids per :func:`lead_key`) and orders a new request's units
along the remembered path that covers the most of their tokens, the most recently served
path first on a tie; the units off that path follow in the order they came (retrieval rank).
Requests that share units then share prompt prefixes, which is what the generation node's
exact-prefix cache needs to serve them exactly (the node matches the prefix into the units,
:mod:`tessera.generation.executor`).

Reordering never changes which units a request has or their text: :meth:`UnitOrders.arrange`
returns the same set of units (a unit repeated in the request once). The trie is bounded:
past ``max_nodes`` the least recently served paths are dropped.

This module knows nothing about tokens beyond unit lengths, nodes or what a node caches: the
trie records what was served, and the node's own match decides what is exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.units import ContextUnit

ORDERS = ("fixed", "free")


def deduplicated(units: Sequence[ContextUnit]) -> list[ContextUnit]:
    """The units without repeats (the first of each unit id stays where it was)."""
    seen: set[str] = set()
    out = []
    for u in units:
        if u.unit_id not in seen:
            seen.add(u.unit_id)
            out.append(u)
    return out


def lead_key(tenant: str, messages: Sequence[dict[str, Any]], placement: str) -> bytes:
    """What fixes the tokens before a request's units: its tenant (the node's prefix cache is
    per tenant), the placement, and the messages the prompt builder puts before the units (the
    system message for ``"system"``; every message before the newest user message for ``"user"``)."""
    if placement == "system":
        before = [m for m in messages[:1] if m.get("role") == "system"]
    else:
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
        before = list(messages[:last_user])
    h = hashlib.blake2b(digest_size=16)
    for part in (tenant, placement, *(f"{m.get('role')}\x1e{m.get('content', '')}" for m in before)):
        data = str(part).encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


@dataclass(frozen=True)
class Arranged:
    """A request's units in the order to serve them."""

    units: list[ContextUnit]
    # every unit lies on one remembered path: this order was served before, as a prompt or the
    # beginning of one (the prefix cache may hold it; if not, computing it exactly now pays
    # off when it comes again)
    recurring: bool


@dataclass
class _Node:
    used: int = 0  # the clock of the latest order served through this node (a child's <= its parent's)
    children: dict[str, _Node] = field(default_factory=dict)


class UnitOrders:
    """Remembered unit orders per leading text (verbs ``arrange``, ``clear``)."""

    def __init__(self, max_nodes: int = 1 << 16) -> None:
        assert max_nodes > 0, max_nodes
        self.max_nodes = max_nodes
        self._roots: dict[Hashable, _Node] = {}
        self._nodes = 0
        self._clock = 0

    def __len__(self) -> int:
        """Trie nodes held (the roots not counted)."""
        return self._nodes

    def arrange(self, key: Hashable, units: Sequence[ContextUnit]) -> Arranged:
        """``units`` deduplicated and ordered along the best remembered path after ``key`` (the
        module docstring); the order returned is remembered."""
        units = deduplicated(units)
        if not units:
            return Arranged(units, False)
        root = self._roots.setdefault(key, _Node())
        by_id = {u.unit_id: u for u in units}
        path = self._best(root, by_id)
        on_path = set(path)
        ordered = [by_id[u] for u in path] + [u for u in units if u.unit_id not in on_path]
        self._remember(root, [u.unit_id for u in ordered])
        return Arranged(ordered, len(path) == len(ordered))

    def clear(self) -> None:
        self._roots.clear()
        self._nodes = 0

    def _best(self, root: _Node, units: dict[str, ContextUnit]) -> list[str]:
        """The remembered path through ``units`` only with the most tokens (latest on a tie)."""
        best: tuple[int, int] = (0, 0)
        best_path: list[str] = []
        stack: list[tuple[_Node, list[str], int]] = [(root, [], 0)]
        while stack:
            node, path, tokens = stack.pop()
            if (tokens, node.used) > best:
                best, best_path = (tokens, node.used), path
            for uid, child in node.children.items():
                if uid in units and uid not in path:
                    stack.append((child, [*path, uid], tokens + units[uid].n_tokens))
        return best_path

    def _remember(self, root: _Node, unit_ids: list[str]) -> None:
        self._clock += 1
        node = root
        node.used = self._clock
        for uid in unit_ids:
            child = node.children.get(uid)
            if child is None:
                child = node.children[uid] = _Node()
                self._nodes += 1
            child.used = self._clock
            node = child
        while self._nodes > self.max_nodes:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Drop at least the least recently served quarter of the nodes (with their subtrees: a
        child is never more recent than its parent)."""
        stamps = sorted(n.used for n in self._all())
        cut = max(stamps[len(stamps) // 4], stamps[0] + 1)
        self._nodes = 0
        for key, root in list(self._roots.items()):
            if root.used < cut:
                del self._roots[key]
                continue
            stack = [root]
            while stack:
                node = stack.pop()
                node.children = {u: c for u, c in node.children.items() if c.used >= cut}
                self._nodes += len(node.children)
                stack.extend(node.children.values())

    def _all(self) -> list[_Node]:
        out: list[_Node] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.extend(node.children.values())
            stack.extend(node.children.values())
        return out
