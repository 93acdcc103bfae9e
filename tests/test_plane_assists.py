"""Assists: the plane gives an idle node about half of the units a request must compute.

In-process control plane (B = 4). What is checked: which units go to the helper (only ones
the shared tier would admit; the largest first, each to the side with less so far), the two plans
(the helper's under its own grants and seal; the serving node's naming the peer, without a
grant), the helper's queue (its expected wait counts the blocks until the request starts or
ends), and every case that must not assist.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cluster import with_secret_file
from helpers.plane import B, Cluster, plane_config

from tessera.auth import plan_seal
from tessera.messages.plan import Preparation, RequestPlan, Retention

COLD = [("a", 10 * B), ("b", 6 * B), ("c", 4 * B), ("d", 4 * B)]  # 24 blocks, 96 tokens


def cluster(**control: object) -> Cluster:
    return Cluster(plane_config(local_blocks=256, shared_blocks=256, assist_min_tokens=8, **control))


def plan_on(c: Cluster, node: str, units: list[tuple[str, int]]) -> RequestPlan:
    rid = c.rid()
    other = {"gen0": "gen1", "gen1": "gen0"}[node]
    assert c.plane.route(rid, units, exclude={other}) == node
    return c.plane.finalize(rid, node, c.snapshot(node, units))


def test_an_idle_node_prefills_about_half_of_the_tokens_largest_units_first() -> None:
    c = cluster()
    c.heartbeat(prefill_tokens_per_s=400.0)
    plan = plan_on(c, "gen0", COLD)
    (assist,) = plan.assists
    assert assist.node == "gen1" and assist.request_id == plan.request_id and assist.term == plan.term
    # largest first, each to the side with less so far (a tie stays here): a here, b and c
    # there (24, then 40), d here (40 = 40): 56 tokens here, 40 there
    assert [u.unit_id for u in assist.units] == ["b", "c"]
    for u in assist.units:
        assert u.preparation is Preparation.COMPUTE and u.retention is Retention.SHARED
        assert u.grant is not None and u.grant.writer == "gen1"
    served = {u.unit_id: u for u in plan.units}
    assert all(served[u].peer == "gen1" and served[u].grant is None for u in "bc")
    assert all(served[u].preparation is Preparation.COMPUTE for u in "abcd")
    assert all(not served[u].peer and served[u].grant is not None and served[u].grant.writer == "gen0"
               for u in "ad")
    # the helper's queue holds its blocks until the request starts; the serving node's holds the rest
    gen0, gen1 = c.plane.nodes["gen0"], c.plane.nodes["gen1"]
    assert gen1.assist_blocks == 10 and gen0.pending_blocks == 14
    assert gen1.expected_wait_s() == pytest.approx(10 * B / 400.0)
    assert not gen1.idle
    c.plane.started(plan.request_id)
    assert gen1.assist_blocks == 0 and gen1.idle
    c.plane.check_invariants()


def test_equal_units_split_evenly_and_each_assist_ends_with_its_request() -> None:
    c = cluster()
    plan = plan_on(c, "gen1", [(f"u{i}", 5 * B) for i in range(4)])
    assert [u.unit_id for u in plan.assists[0].units] == ["u1", "u3"]
    assert [u.peer for u in plan.units] == ["", "gen0", "", "gen0"]
    assert c.plane.nodes["gen0"].assists == {plan.request_id: 10}
    c.plane.complete(plan.request_id)  # never started (it failed): the assist ends too
    assert c.plane.nodes["gen0"].assists == {}


def test_the_assist_is_sealed_for_its_own_node(cluster_secret: Path) -> None:
    c = Cluster(with_secret_file(plane_config(local_blocks=64, shared_blocks=64, assist_min_tokens=8), cluster_secret))
    plan = plan_on(c, "gen0", COLD)
    secret = c.plane.directory.capabilities.secret  # type: ignore[union-attr]
    (assist,) = plan.assists
    assert assist.seal == plan_seal(secret, "gen1", assist.term, plan.request_id)
    assert assist.seal != plan.seal
    assert all(t.holder == "gen1" for u in assist.units for t in u.grant.tokens)  # type: ignore[union-attr]


def test_no_assist_from_a_busy_node_below_the_threshold_or_for_a_single_unit() -> None:
    c = cluster()
    busy = c.rid()
    assert c.plane.route(busy, [("x", B)], exclude={"gen0"}) == "gen1"  # gen1 has a request in flight
    assert plan_on(c, "gen0", COLD).assists == ()
    c.plane.complete(busy)
    assert plan_on(c, "gen0", [("one", 30 * B)]).assists == ()  # nothing to split
    assert plan_on(c, "gen0", [("s1", 1), ("s2", 2)]).assists == ()  # 3 tokens < 8
    # idle again: assisted (new units: COLD's have pending shared entries now)
    assert plan_on(c, "gen0", [(u + "2", n) for u, n in COLD]).assists != ()


def test_no_assist_when_disabled_or_without_a_kv_pool() -> None:
    off = Cluster(plane_config(local_blocks=64, shared_blocks=64, assist_min_tokens=0))
    assert plan_on(off, "gen0", COLD).assists == ()
    no_pool = Cluster(plane_config(local_blocks=64, kvpools=0, assist_min_tokens=8), join_memory=False)
    assert plan_on(no_pool, "gen0", COLD).assists == ()


def test_units_held_cached_or_shared_are_never_given_away() -> None:
    c = cluster()
    c.serve([("a", 10 * B)])  # computed and published: READY in the shared tier
    plan = plan_on(c, "gen0", COLD)
    given = {u.unit_id for a in plan.assists for u in a.units}
    assert given == {"c", "d"}  # b (24) stays here; c and d (16 each) go
    served = {u.unit_id: u for u in plan.units}
    assert served["a"].preparation in (Preparation.LOCAL, Preparation.REMOTE)
    # a revoked unit is computed and kept nowhere: not given either
    c2 = cluster()
    c2.plane.revoke(["a"])
    plan2 = plan_on(c2, "gen0", COLD)
    assert "a" not in {u.unit_id for a in plan2.assists for u in a.units}
