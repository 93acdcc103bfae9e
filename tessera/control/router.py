"""Routing policies: which generation node executes a request (paper §5.2).

Contract of :class:`Router` (register new ones with :func:`register_router`):
``choose(nodes, local_blocks, block_s)`` picks one of ``nodes`` (the live generation nodes,
never empty). ``local_blocks[node.index]`` is how many blocks of the request's units that
node's local cache holds (per the control plane's view) *and the shared tier does not hold
ready*; it is only computed for routers that set ``uses_locality``. ``block_s`` is what one
block of prefill costs on the fleet (seconds; None until some node measured its rate). The
router reads each node's ``inflight`` count and expected queueing (``expected_wait_s``); it
mutates nothing but its own round-robin cursor, and never raises on well-formed input.

The plane calls ``pick(loads, eligible, holders, block_s)``, the same decision over bitmasks
(node ``i`` is bit ``1 << i``; ``holders`` maps holder masks to blocks). By default it calls
``choose``, so a new router needs only ``choose``; the built-in ones override it to visit
only holders and the least loaded, never the whole fleet, and a property test checks they
agree with ``choose``.

Shared-tier residency is left out of the counts: every node can copy a shared hit, so it
cannot make one node better than another, and counting it queues requests behind a holder.
A node's expected queueing counts the prefill its waiting requests need, not only how many
wait (:meth:`~tessera.control.membership.GenerationMember.expected_wait_s`), so a node
whose queue is cheap hits takes the requests that compute their units.
Locality is worth a wait only up to the prefill it saves: a node whose queue is longer than
the time its cached blocks save loses to an idle node that computes them (the request's
other work costs the same everywhere, so it does not enter the comparison).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol, TypeVar

from tessera.control.fleet import bits, first_after
from tessera.control.locality import spread
from tessera.registry import Registry


class RoutableNode(Protocol):
    @property
    def index(self) -> int: ...  # position in the cluster config: the round-robin order

    @property
    def inflight(self) -> int: ...

    def expected_wait_s(self) -> float: ...  # queueing a new request would see there


N = TypeVar("N", bound=RoutableNode)


class Loads(Protocol):
    """In-flight counts of the alive nodes, by bitmask (what :class:`~tessera.control.fleet.Fleet` answers)."""

    def least(self, eligible: int) -> int: ...  # the smallest in-flight count among eligible nodes

    def at(self, load: int) -> int: ...  # the alive nodes with exactly this many in flight

    def inflight(self, index: int) -> int: ...

    def members(self, mask: int) -> Sequence[RoutableNode]: ...  # in config order

    @property
    def queued(self) -> int: ...  # the alive nodes whose expected wait is above 0


class Router(ABC):
    name: ClassVar[str]
    uses_locality: ClassVar[bool] = False
    counts_shared: ClassVar[bool] = False  # count local blocks the shared tier also holds (§5.2 as written)

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
    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int], block_s: float | None = None) -> N: ...

    def pick(self, loads: Loads, eligible: int, holders: Mapping[int, int], block_s: float | None = None) -> int:
        """``choose`` over bitmasks: the index of the chosen node among ``eligible`` (nonzero)."""
        local_blocks = spread(holders, self.n_nodes) if self.uses_locality else ()
        return self.choose(loads.members(eligible), local_blocks, block_s).index

    def _next_of(self, mask: int) -> int:
        """The node of ``mask`` first after the last choice in round-robin order, chosen."""
        self._last = first_after(mask, self._last)
        return self._last


ROUTERS: Registry[type[Router]] = Registry("control.routing")
register_router = ROUTERS.register
router_names = ROUTERS.names


def make_router(name: str, n_nodes: int) -> Router:
    return ROUTERS.get(name)(n_nodes)


@register_router("cache_aware")
class CacheAwareRouter(Router):
    """Load-constrained cache-aware routing, with the queue weighed against the reuse.

    Among nodes whose in-flight count is within one of the least loaded, pick the one where
    the request's unit prefill ends first: the most ``blocks × block_s − expected wait``
    (the prefill its local cache saves, less the queueing ahead of it), counting the blocks
    of the request's units that no other node could copy from the shared tier; ties by more
    blocks, lower load, then round-robin. With equal waits (or ``block_s`` unknown) that is
    the node holding the most blocks. The load bound keeps a node holding popular units
    from drawing every request to itself.
    """

    uses_locality = True

    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int], block_s: float | None = None) -> N:
        bound = min(n.inflight for n in nodes) + 1
        n_nodes = self.n_nodes
        after = self._last + 1
        best = nodes[0]
        best_key: tuple[float, int, int, int] | None = None
        for node in nodes:
            load = node.inflight
            if load > bound:
                continue
            blocks = local_blocks[node.index]
            gain = 0.0 if block_s is None else blocks * block_s - node.expected_wait_s()
            key = (-gain, -blocks, load, (node.index - after) % n_nodes)
            if best_key is None or key < best_key:
                best, best_key = node, key
        return self._chose(best)

    def pick(self, loads: Loads, eligible: int, holders: Mapping[int, int], block_s: float | None = None) -> int:
        """``choose``'s rule, visiting only the holders within the load bound.

        While no candidate has a queue, a node holding a block outranks every node holding
        none, so when some holder is within the bound the choice is among the holders;
        otherwise it is the round-robin successor among the least loaded (``choose`` ranks
        them by load, then round-robin). Once a candidate has a queue, its wait is weighed
        against its blocks on every candidate.
        """
        least = loads.least(eligible)
        within = eligible & (loads.at(least) | loads.at(least + 1))
        if block_s is not None and within & loads.queued:
            return self.choose(loads.members(within), spread(holders, self.n_nodes), block_s).index
        counts: dict[int, int] = {}
        for mask, b in holders.items():
            for i in bits(mask & within):  # holder sets are small
                counts[i] = counts.get(i, 0) + b
        if not counts:
            return self._next_of(loads.at(least) & eligible)
        n_nodes = self.n_nodes
        after = self._last + 1
        inflight = loads.inflight
        best = best_blocks = best_load = best_rr = -1
        for i, blocks in counts.items():
            if blocks < best_blocks:
                continue
            load = inflight(i)
            rr = (i - after) % n_nodes
            if blocks > best_blocks or load < best_load or (load == best_load and rr < best_rr):
                best, best_blocks, best_load, best_rr = i, blocks, load, rr
        self._last = best
        return best


@register_router("cache_aware_all")
class CacheAwareAllRouter(CacheAwareRouter):
    """:class:`CacheAwareRouter` counting every local block, also those the shared tier holds.

    The paper's rule as written: a local hit saves the copy from the pool as well as a
    prefill. Worth it only where pool transfers are slow against prefill (TCP across hosts).
    """

    counts_shared = True


@register_router("load")
class LoadRouter(Router):
    """Least loaded node, round-robin among equals; ignores cache contents (ablation baseline)."""

    def choose(self, nodes: Sequence[N], local_blocks: Sequence[int], block_s: float | None = None) -> N:
        best = min(nodes, key=lambda n: (n.inflight, self._after_last(n.index)))
        return self._chose(best)

    def pick(self, loads: Loads, eligible: int, holders: Mapping[int, int], block_s: float | None = None) -> int:
        """The round-robin successor among the least loaded eligible nodes."""
        return self._next_of(loads.at(loads.least(eligible)) & eligible)
