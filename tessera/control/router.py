"""Routing policies: which generation node executes a request (paper §5.2).

Contract of :class:`Router` (register new ones with :func:`register_router`):
``choose(nodes, local_blocks)`` picks one of ``nodes`` (the live generation nodes, never
empty). ``local_blocks[node.index]`` is how many blocks of the request's units that node's
local cache holds (per the control plane's view) *and the shared tier does not hold ready*;
it is only computed for routers that set ``uses_locality``. The router reads each node's
``inflight`` count; it mutates nothing but its own round-robin cursor, and never raises on
well-formed input.

Shared-tier residency is deliberately left out of the counts: a shared hit is reachable
from every node (a copy, not a prefill), so it cannot make one node better than another,
and counting it queued requests behind a busy holder while another node was idle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar

from tessera.registry import Registry


class RoutableNode(Protocol):
    @property
    def index(self) -> int: ...  # position in the cluster config: the round-robin order

    @property
    def inflight(self) -> int: ...


N = TypeVar("N", bound=RoutableNode)


class Router(ABC):
    name: ClassVar[str]
    uses_locality: ClassVar[bool] = False
    # count local blocks the shared tier also holds ready (paper §5.2 as written); off by
    # default, where only blocks no other node could copy count (see the module docstring)
    counts_shared: ClassVar[bool] = False

    def __init__(self, n_nodes: int) -> None:
        assert n_nodes > 0, n_nodes
        self.n_nodes = n_nodes
        self._last = -1  # index of the node chosen last

    def _after_last(self, index: int) -> int:
        """Round-robin rank: 0 for the node right after the last choice, growing cyclically."""
        return (index - self._last - 1) % self.n_nodes

    def _chose(self, node: N) -> N:
        self._last = node.index
        return node

    @abstractmethod
    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int]) -> N: ...


ROUTERS: Registry[type[Router]] = Registry("control.routing")
register_router = ROUTERS.register
router_names = ROUTERS.names


def make_router(name: str, n_nodes: int) -> Router:
    return ROUTERS.get(name)(n_nodes)


@register_router("cache_aware")
class CacheAwareRouter(Router):
    """Load-constrained cache-aware routing.

    Among nodes whose in-flight count is within one of the least loaded, pick the one whose
    local cache holds the most blocks of the request's units that no other node could copy
    from the shared tier; ties by lower load, then round-robin. The load bound keeps a node
    holding popular units from drawing every request to itself.
    """

    uses_locality = True

    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int]) -> N:
        bound = min(n.inflight for n in nodes) + 1
        n_nodes = self.n_nodes
        after = self._last + 1
        best = nodes[0]
        # rank by (most blocks, lowest load, earliest after the last choice), without tuples:
        # this runs once per request over every node
        best_blocks = best_load = best_rr = -1
        for node in nodes:
            load = node.inflight
            if load > bound:
                continue
            blocks = local_blocks[node.index]
            if blocks < best_blocks:
                continue
            rr = (node.index - after) % n_nodes
            if blocks > best_blocks or load < best_load or (load == best_load and rr < best_rr):
                best, best_blocks, best_load, best_rr = node, blocks, load, rr
        return self._chose(best)


@register_router("cache_aware_all")
class CacheAwareAllRouter(CacheAwareRouter):
    """:class:`CacheAwareRouter` counting every local block, also those the shared tier holds.

    The paper's rule as written: a local hit saves the copy from the pool as well as a
    prefill. Worth it where pool transfers are slow against prefill (TCP across hosts, long
    units); on shared memory the copy costs milliseconds and this rule queued requests behind
    a busy holder (README, Benchmarks: ablations).
    """

    counts_shared = True


@register_router("load")
class LoadRouter(Router):
    """Least loaded node, round-robin among equals; ignores cache contents (ablation baseline)."""

    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int]) -> N:
        best = min(nodes, key=lambda n: (n.inflight, self._after_last(n.index)))
        return self._chose(best)
