"""Routing policies: load-constrained cache-aware routing and the load-only baseline."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.control.router import CacheAwareRouter, LoadRouter, make_router, router_names
from tessera.errors import ConfigError


@dataclass
class Node:
    index: int
    inflight: int = 0


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
