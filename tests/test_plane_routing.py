"""The plane's routing over bitmasks (tessera/control/fleet.py) decides exactly as the exhaustive rule.

The reference is the routing path without the fleet index: the live nodes
as a list, the queue bound over that list, the locality counts of every node, and the
router's ``choose``. A long seeded run of the simulated cluster (more than 64 nodes, so the
masks span machine words) asks both at every request, through node deaths and returns,
retries that exclude nodes, a queue bound that refuses busy nodes (less of it left for a
request that waited before routing), and measured prefill rates, so queues are weighed
against reuse.
"""

from __future__ import annotations

import random

import pytest
from helpers.plane import B, Cluster, plane_config

from tessera.control.overload import QueueBound
from tessera.control.plane import ControlPlane
from tessera.control.router import make_router
from tessera.errors import Overloaded, Unavailable

NODES = 70


def exhaustive_route(plane: ControlPlane, units: list[tuple[str, int]], exclude: set[str], waited_s: float) -> str:
    """The node the exhaustive path picks (raises as route would); leaves the plane untouched."""
    live = [n for n in plane.liveness.live if n.name not in exclude]
    if not live:
        raise Unavailable("no generation node is alive")
    live = QueueBound(plane.queue_bound.max_wait_s).admit(live, waited_s)
    b = plane.block_tokens
    pairs = tuple((u, -(-n // b)) for u, n in dict(units).items())
    router = make_router(plane.router.name, len(plane.nodes))
    router._last = plane.router._last
    return router.choose(live, plane._local_blocks(pairs) if router.uses_locality else (), plane.rates.block_s).name


@pytest.mark.parametrize("routing", ["cache_aware", "cache_aware_all", "load"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_plane_routes_every_request_as_the_exhaustive_rule_would(routing: str, seed: int) -> None:
    """1,500 requests over 70 nodes: the fast path's node is the reference's, every time."""
    rng = random.Random(seed)
    c = Cluster(plane_config(nodes=NODES, local_blocks=24, shared_blocks=64, routing=routing, max_queue_wait_s=1.0))
    plane = c.plane
    names = list(plane.nodes)
    sizes = {f"u{i}": rng.randint(1, 30) for i in range(400)}
    popular = [f"u{int(rng.paretovariate(0.8)) % 400}" for _ in range(4000)]
    started: list[str] = []  # routed and executed, no first token yet
    running: list[str] = []  # first token sent, not completed
    outcomes = {"routed": 0, "refused": 0, "unavailable": 0, "some nodes over the bound": 0, "weighed": 0}
    for _ in range(1500):
        units = [(u, sizes[u]) for u in dict.fromkeys(rng.sample(popular, rng.randint(1, 8)))]
        exclude = set(rng.sample(names, rng.randint(1, 40))) if rng.random() < 0.1 else set()
        waited_s = rng.choice([0.0, 0.0, rng.random() * 1.5])  # time spent before routing, against the bound
        outcomes["some nodes over the bound"] += plane.fleet.over != 0
        outcomes["weighed"] += plane.rates.block_s is not None and plane.fleet.queued != 0
        try:
            expected = exhaustive_route(plane, units, exclude, waited_s)
        except (Overloaded, Unavailable) as refused:
            with pytest.raises(type(refused)):
                plane.route(c.rid(), units, exclude, waited_s)
            outcomes["refused" if isinstance(refused, Overloaded) else "unavailable"] += 1
        else:
            rid = c.rid()
            assert plane.route(rid, units, exclude, waited_s) == expected
            outcomes["routed"] += 1
            c.execute(plane.finalize(rid, expected, c.snapshot(expected, units)), complete=False)
            started.append(rid)
        c.clock.advance(rng.random() * 0.05)
        if len(started) > 90 or (started and rng.random() < 0.6):  # a first token: service time measured
            rid = started.pop(rng.randrange(len(started)))
            plane.started(rid)
            running.append(rid)
        while len(running) > 40 or (running and rng.random() < 0.5):
            plane.complete(running.pop(rng.randrange(len(running))))
        if rng.random() < 0.03:
            plane.suspect(rng.choice(names))
        if rng.random() < 0.05:  # with a prefill rate: the router weighs queues against reuse
            c.heartbeat(*rng.sample(names, 5), prefill_tokens_per_s=rng.choice([0.0, 100.0, 400.0, 2000.0]))
        plane.fleet.check_invariants()
    plane.check_invariants()
    # every path was taken: routed, refused by the queue bound, and routed past nodes it refused
    assert outcomes["routed"] > 900 and outcomes["refused"] > 10, outcomes
    assert outcomes["some nodes over the bound"] > 500, outcomes
    assert outcomes["weighed"] > 300, outcomes


def test_a_request_that_computes_its_units_goes_where_less_prefill_is_queued() -> None:
    """Regression (goodput past saturation): two nodes with as many requests waiting, but
    gen0's compute every unit they name and gen1's copy theirs from the shared tier. Counting
    requests made the nodes equal, so requests that compute their units went to both alike,
    and at the end of a burst gen1 idled while gen0 drained its prefill backlog. The queued
    blocks are now priced at the node's prefill rate: new cold requests go to gen1."""
    c = Cluster(local_blocks=64, shared_blocks=64)
    plane = c.plane
    c.heartbeat(prefill_tokens_per_s=400.0)
    shared = [(f"hot{i}", 4 * B) for i in range(3)]
    for unit in shared:
        c.serve([unit])  # written back: ready in the shared tier, a copy away from either node
    assert all(plane.directory.ready(u) is not None for u, _ in shared)

    def planned(units: list[tuple[str, int]], exclude: set[str] = set()) -> str:  # noqa: B006 (never mutated)
        rid = c.rid()
        node = plane.route(rid, units, exclude)
        plane.finalize(rid, node, c.snapshot(node, units))  # its plan says what it computes
        return node

    for i in range(3):
        planned([(f"cold{i}", 8 * B)], exclude={"gen1"})  # gen0 computes 8 blocks each
        planned([shared[i]], exclude={"gen0"})  # gen1 fetches: computes none
    gen0, gen1 = plane.nodes["gen0"], plane.nodes["gen1"]
    assert (gen0.inflight, gen1.inflight, gen0.pending_blocks, gen1.pending_blocks) == (3, 3, 24, 0)
    assert gen0.expected_wait_s() == pytest.approx(24 * B / 400.0) and gen1.expected_wait_s() == 0.0
    assert [planned([(f"new{i}", 8 * B)]) for i in range(2)] == ["gen1", "gen1"]
    # a start takes its blocks out of the queue and into the node's sampled mean
    plane.started(next(iter(gen0.waiting)))
    assert (gen0.pending_blocks, list(gen0.sampled_blocks)) == (16, [8])
    plane.complete(next(iter(gen0.waiting)))  # one that never started leaves the queue too
    assert gen0.pending_blocks == 8
