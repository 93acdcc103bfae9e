"""Routing policies: load-constrained cache-aware routing and the load-only baseline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.control.fleet import Fleet
from tessera.control.locality import spread
from tessera.control.pace import PrefillRates
from tessera.control.router import CacheAwareRouter, LoadRouter, N, Router, make_router, router_names
from tessera.errors import ConfigError


@dataclass
class Node:
    index: int
    inflight: int = 0
    wait: float = 0.0

    def expected_wait_s(self) -> float:
        return self.wait


def nodes(*loads: int) -> list[Node]:
    return [Node(i, load) for i, load in enumerate(loads)]


def test_cache_aware_picks_the_node_holding_most_local_blocks() -> None:
    """Equal load: locality decides."""
    r = CacheAwareRouter(3)
    assert r.choose(nodes(0, 0, 0), [1, 5, 2]).index == 1


def test_cache_aware_ignores_nodes_loaded_more_than_one_above_the_least_loaded() -> None:
    """A node holding everything but two requests busier than the idlest is not eligible."""
    r = CacheAwareRouter(3)
    assert r.choose(nodes(2, 0, 1), [9, 0, 3]).index == 2
    assert r.choose(nodes(1, 0, 1), [9, 0, 3]).index == 0


def test_cache_aware_breaks_locality_ties_by_lower_load_then_round_robin() -> None:
    """Same blocks: the less loaded wins; same load too: the next node after the last choice."""
    r = CacheAwareRouter(3)
    assert r.choose(nodes(1, 0, 1), [4, 4, 4]).index == 1
    r = CacheAwareRouter(3)
    picks = [r.choose(nodes(0, 0, 0), [0, 0, 0]).index for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_a_queue_longer_than_the_prefill_it_saves_loses_to_an_idle_node() -> None:
    """The holder's 2 s queue against 10 blocks: at 0.1 s a block they save 1 s, so the idle
    node computes them sooner; at 0.5 s a block they save 5 s, so the holder is worth its queue."""
    busy, idle = Node(0, inflight=1, wait=2.0), Node(1, inflight=0, wait=0.0)
    assert CacheAwareRouter(2).choose([busy, idle], [10, 0], block_s=0.1).index == 1
    assert CacheAwareRouter(2).choose([busy, idle], [10, 0], block_s=0.5).index == 0
    assert CacheAwareRouter(2).choose([busy, idle], [10, 0], block_s=None).index == 0  # no rate measured yet


def test_with_equal_queues_the_most_blocks_win_whatever_a_block_costs() -> None:
    both = [Node(0, 0, wait=1.0), Node(1, 0, wait=1.0)]
    assert CacheAwareRouter(2).choose(both, [3, 4], block_s=0.01).index == 1
    assert CacheAwareRouter(2).choose(both, [3, 4], block_s=None).index == 1


def test_the_fleet_block_cost_is_the_mean_measured_rate_and_forgets_replaced_reports() -> None:
    rates = PrefillRates(block_tokens=16)
    assert rates.block_s is None
    rates.report(0.0, 400.0)
    rates.report(0.0, 800.0)
    assert rates.block_s == pytest.approx(16 / 600)
    rates.report(800.0, 0.0)  # that node's rate is unknown again
    rates.report(400.0, float("nan"))  # a malformed report counts as unmeasured
    assert rates.block_s is None


def test_load_router_ignores_locality() -> None:
    """The baseline sends the request to the least loaded node, round-robin among equals."""
    r = LoadRouter(3)
    assert r.choose(nodes(1, 1, 0), [9, 9, 0]).index == 2
    picks = [r.choose(nodes(0, 0, 0), [9, 0, 0]).index for _ in range(4)]
    assert picks == [0, 1, 2, 0]


def test_only_live_nodes_are_candidates() -> None:
    """The router chooses among the nodes it is given (the plane passes the live ones)."""
    r = CacheAwareRouter(4)
    live = [Node(1, 3), Node(3, 3)]
    assert r.choose(live, [0, 0, 0, 7]).index == 3


def test_routers_are_registered_by_name() -> None:
    """cache_aware, cache_aware_all and load are registered; unknown names list the known ones."""
    assert {"cache_aware", "cache_aware_all", "load"} <= set(router_names())
    assert isinstance(make_router("load", 2), LoadRouter)
    with pytest.raises(ConfigError, match="cache_aware"):
        make_router("random", 2)


@given(
    loads=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    blocks=st.lists(st.integers(0, 20), min_size=8, max_size=8),
    name=st.sampled_from(["cache_aware", "cache_aware_all", "load"]),
    rounds=st.integers(1, 5),
)
def test_routing_never_picks_a_node_loaded_more_than_the_minimum_plus_one(
        loads: list[int], blocks: list[int], name: str, rounds: int) -> None:
    """Whatever the locality, the chosen node's in-flight count is at most min + 1."""
    router = make_router(name, len(loads))
    ns = nodes(*loads)
    for _ in range(rounds):
        chosen = router.choose(ns, blocks)
        assert chosen.inflight <= min(n.inflight for n in ns) + 1
        if name.startswith("cache_aware"):
            eligible = [n for n in ns if n.inflight <= min(m.inflight for m in ns) + 1]
            assert blocks[chosen.index] == max(blocks[n.index] for n in eligible)
        chosen.inflight += 1


@dataclass
class Member:
    """A fleet member whose expected wait (and so queue-bound verdict) the test sets."""

    index: int
    inflight: int = 0
    refused: bool = False
    wait: float = 0.0  # under the bound

    def expected_wait_s(self) -> float:
        return 1.0 if self.refused else self.wait


@given(
    data=st.data(),
    n=st.integers(1, 70),  # more than 64 nodes: masks wider than a machine word
    name=st.sampled_from(["cache_aware", "cache_aware_all", "load"]),
    rounds=st.integers(1, 6),
)
def test_pick_over_bitmasks_chooses_what_the_exhaustive_choose_chooses(
        data: st.DataObject, n: int, name: str, rounds: int) -> None:
    """The fast path (least-loaded masks, holders only) agrees with ``choose`` over every node.

    Random loads, expected waits, block costs, live sets, queue-bound refusals, exclusions,
    holder sets and round-robin cursors; after each choice the chosen node's load rises and
    a random node changes.
    """
    waits = st.sampled_from([0.0, 0.0, 0.1, 0.3])
    members = [Member(i, data.draw(st.integers(0, 4)), data.draw(st.booleans()), data.draw(waits)) for i in range(n)]
    block_s = data.draw(st.sampled_from([None, 0.005, 0.02, 0.1]))
    fleet = Fleet(n, 0.5)  # a refused member's wait (1 s) is over the bound
    for m in members:
        if data.draw(st.booleans()) or m.index == 0:
            fleet.join(m)
    fast, reference = make_router(name, n), make_router(name, n)
    fast._last = reference._last = data.draw(st.integers(-1, n - 1))
    mask_of = st.integers(0, (1 << n) - 1)
    for _ in range(rounds):
        fleet.check_invariants()
        eligible = fleet.alive & ~data.draw(mask_of)
        if data.draw(st.booleans()) and eligible & ~fleet.over:
            eligible &= ~fleet.over  # the plane's queue bound, when it leaves a node
        if not eligible:
            eligible = fleet.alive
        holders = {m: data.draw(st.integers(1, 30)) for m in data.draw(st.lists(mask_of.filter(bool), max_size=10))}
        nodes = [m for m in members if eligible >> m.index & 1]
        expected = reference.choose(nodes, spread(holders, n), block_s).index
        assert fast.pick(fleet, eligible, holders, block_s) == expected
        assert fast._last == reference._last
        chosen = members[expected]
        chosen.inflight += 1
        fleet.update(chosen, chosen.inflight - 1)
        other = members[data.draw(st.integers(0, n - 1))]
        action = data.draw(st.sampled_from(["left", "refused", "toggle", "wait"]))
        alive = bool(fleet.alive >> other.index & 1)
        if action == "left" and other.inflight:
            other.inflight -= 1
            fleet.update(other, other.inflight + 1)
        elif action == "refused":
            other.refused = not other.refused
            fleet.update(other, other.inflight)
        elif action == "wait":
            other.wait = data.draw(waits)
            fleet.update(other, other.inflight)
        elif action == "toggle" and alive and fleet.alive != 1 << other.index:
            fleet.leave(other)
        elif action == "toggle" and not alive:
            fleet.join(other)


def test_a_router_without_a_fast_path_picks_through_choose() -> None:
    """A registered router that only implements ``choose`` gets the candidate list and per-node blocks."""

    class Last(Router):
        name = "last_holder"
        uses_locality = True

        def choose(self, nodes: Sequence[N], local_blocks: Sequence[int], block_s: float | None = None) -> N:
            return self._chose(max(nodes, key=lambda n: (local_blocks[n.index] > 0, n.index)))

    members = [Member(i) for i in range(5)]
    fleet = Fleet(5, 0.0)
    for m in members[:4]:
        fleet.join(m)
    r = Last(5)
    assert r.pick(fleet, 0b1011, {0b11: 2}) == 1  # node 2 is not eligible, 4 not alive
    assert r._last == 1
