"""The control plane's two-step plans: preparation, independent retention, leases and grants."""

from __future__ import annotations

import random

import pytest
from helpers.plane import B, Cluster, plane_config, preps, retentions

from tessera.control.stats import PlaneStats
from tessera.errors import BadRequest
from tessera.messages.control import ResidencyReport
from tessera.messages.plan import Preparation
from tessera.units import blocks_for
from tessera.wire import WIRE_VERSION

LOCAL, REMOTE, COMPUTE = Preparation.LOCAL, Preparation.REMOTE, Preparation.COMPUTE


def test_a_first_retrieval_is_computed_and_retained_in_free_space() -> None:
    """Nothing is cached yet; both tiers have room, so both keep the units at first sight."""
    c = Cluster()
    plan = c.serve([("a", 10), ("b", 3)])
    assert preps(plan) == {"a": COMPUTE, "b": COMPUTE}
    assert retentions(plan) == {"a": "both", "b": "both"}
    assert plan.local_evict == ()


def test_the_shared_retention_carries_a_reservation_for_the_node() -> None:
    """The grant names the computing node as writer; the entry is PENDING until published."""
    c = Cluster(nodes=1)
    plan = c.plan([("a", 10)])
    (unit,) = plan.units
    assert unit.preparation is COMPUTE and unit.retention.value == "both"
    grant = unit.grant
    assert grant is not None and grant.writer == plan.node and grant.unit_id == "a"
    assert len(grant.blocks) == blocks_for(10, B) == 3 and grant.n_tokens == 10
    assert c.plane.directory.get("a") is not None and c.plane.directory.ready("a") is None  # pending


def test_the_second_identical_request_reuses_every_unit() -> None:
    """Regression (demand lost to LRU when the tiers held the working set): no unit is computed twice."""
    c = Cluster(nodes=2)
    c.serve([("a", 10), ("b", 6)])
    plan = c.serve([("a", 10), ("b", 6)])
    assert set(preps(plan).values()) <= {LOCAL, REMOTE}


def test_when_full_a_first_retrieval_evicts_nothing() -> None:
    """Tiers full of other units: a unit seen once is computed and not retained (the demand rule)."""
    c = Cluster(nodes=1, local_blocks=2, shared_blocks=2)
    c.serve([("x", 8)])
    plan = c.serve([("a", 8)])
    assert preps(plan) == {"a": COMPUTE} and retentions(plan) == {"a": "neither"}
    assert c.caches["gen0"] == {"x"} and c.plane.directory.ready("x") is not None


def test_local_hits_come_only_from_the_snapshot() -> None:
    """A unit the node reports holding is prepared locally and not re-admitted anywhere."""
    c = Cluster(nodes=1)
    c.serve([("a", 10)])
    c.serve([("a", 10)])
    plan = c.serve([("a", 10)])
    assert preps(plan) == {"a": LOCAL} and retentions(plan) == {"a": "neither"}


def test_the_view_is_corrected_when_the_snapshot_lacks_a_unit() -> None:
    """The plane believed gen0 held a unit; the snapshot says no: compute (or remote), not local."""
    c = Cluster(nodes=1)
    c.serve([("a", 10)])
    c.serve([("a", 10)])
    c.caches["gen0"].clear()  # the node lost its cache without telling anyone
    plan = c.plan([("a", 10)])
    assert preps(plan) == {"a": REMOTE}  # the shared copy is still there
    assert retentions(plan) == {"a": "local"}  # re-admitted locally from the corrected view


def test_a_remote_hit_carries_a_read_lease_on_the_ready_epoch() -> None:
    """Another node reads the published entry under a lease on its current epoch."""
    c = Cluster(nodes=2, routing="load")
    assert c.serve([("a", 10)]).node == "gen0"  # computed, published, kept locally
    plan = c.plan([("a", 10)])
    assert plan.node == "gen1"
    (unit,) = plan.units
    entry = c.plane.directory.ready("a")
    assert unit.preparation is REMOTE and unit.lease is not None and entry is not None
    assert unit.lease.epoch == entry.epoch and unit.lease.blocks == entry.blocks
    assert unit.lease.lease_id in entry.leases
    # gen1's local cache has room: a remote hit is also kept locally
    assert unit.retention.value == "local"


def test_a_pending_entry_is_not_a_hit_and_gets_no_second_writer() -> None:
    """Before publication other requests compute the unit and receive no write permission."""
    c = Cluster(nodes=1)
    writer = c.plan([("a", 10)])
    c.execute(writer, publish=False, complete=False)
    c.caches["gen0"].clear()
    plan = c.plan([("a", 10)])
    assert preps(plan) == {"a": COMPUTE} and plan.units[0].grant is None


def test_local_admission_lists_the_victims_the_node_must_drop() -> None:
    """With room for one 2-block unit, a hotter unit replaces a colder one via local_evict."""
    c = Cluster(nodes=1, local_blocks=2, shared_blocks=64)
    c.serve([("cold", 8)])
    c.serve([("cold", 8)])  # cold: local, score 3.0
    assert c.caches["gen0"] == {"cold"}
    for _ in range(2):
        c.serve([("hot", 8)])  # hot: 3.0, equal: refused
    plan = c.serve([("hot", 8)])  # hot: 4.5 > cold's 3.0
    assert plan.local_evict == ("cold",) and retentions(plan)["hot"] in ("local", "both")
    assert c.caches["gen0"] == {"hot"}
    assert set(c.plane.nodes["gen0"].local.policy.resident) == {"hot"}


def _shared_full_of_a(shared_reason_lease: bool) -> Cluster:
    """Shared tier of 2 blocks holding unit a (2 blocks), whose recent demand has faded."""
    c = Cluster(nodes=1, local_blocks=0, shared_blocks=2, window=2)
    c.serve([("a", 8)])
    c.serve([("a", 8)])  # a: shared, published
    assert c.plane.directory.ready("a") is not None
    c.serve([("x", 4)])
    c.serve([("y", 4)])  # a leaves the window: s(a) = 0.5 * 2 = 1.0
    c.serve([("b", 8)])  # b's first retrieval
    return c


def test_a_leased_entry_is_never_reclaimed_even_by_a_later_decision_of_the_same_plan() -> None:
    """b (3.0) outscores a (2.5) but a is leased by this very plan, so b is not admitted."""
    c = _shared_full_of_a(True)
    plan = c.plan([("a", 8), ("b", 8)])
    by_unit = {u.unit_id: u for u in plan.units}
    assert by_unit["a"].preparation is REMOTE and by_unit["a"].lease is not None
    assert by_unit["b"].grant is None
    assert c.plane.directory.ready("a") is not None


def test_without_the_lease_the_hotter_unit_does_replace_the_colder_one() -> None:
    """Control case: the same b evicts a when a is not in the plan."""
    c = _shared_full_of_a(False)
    plan = c.plan([("b", 8)])
    assert plan.units[0].grant is not None
    assert c.plane.directory.get("a") is None


def test_shared_and_local_admission_use_their_own_streams() -> None:
    """Full tiers: a unit retrieved on two nodes may evict in the shared tier (2 retrievals) but
    in neither local cache (1 retrieval each)."""
    c = Cluster(nodes=2, routing="load", local_blocks=2, shared_blocks=2)
    c.serve([("x", 8)])  # gen0: x local and shared (free space)
    c.serve([("y", 8)])  # gen1: y local; the shared tier is full of x
    p1 = c.serve([("a", 8)])
    p2 = c.serve([("a", 8)])
    assert p1.node != p2.node
    assert retentions(p1) == {"a": "neither"}
    assert retentions(p2) == {"a": "shared"}


def test_prefix_mode_routes_requests_without_units() -> None:
    """mode = prefix: the serving layer sends no units; routing still balances load."""
    c = Cluster(nodes=2, mode="prefix")
    nodes = [c.plane.route(f"p{i}", []) for i in range(4)]
    assert sorted(nodes) == ["gen0", "gen0", "gen1", "gen1"]
    plan = c.plane.finalize("p0", nodes[0], [])
    assert plan.units == () and plan.local_evict == ()


def test_cache_aware_routing_follows_local_residency() -> None:
    """Once a node retains a unit no other tier holds, requests for it go there while loads stay within one."""
    c = Cluster(nodes=2, join_memory=False)  # no memory node: a node's local cache is the only copy
    home = None
    while home is None:
        plan = c.serve([("a", 8)])
        home = plan.node if plan.units[0].retention.local else None
    for _ in range(3):
        assert c.serve([("a", 8)]).node == home
    c.plane.route("busy1", [])
    c.plane.route("busy2", [])  # both land on the idle node, then the holder: loads differ by <= 1
    assert c.plane.route("next", [("a", 8)]) == home


def _busy(c: Cluster, node: str) -> None:
    """Put one unit-less request in flight on ``node`` (others that round-robin elsewhere are completed)."""
    for i in range(len(c.plane.nodes)):
        rid = f"busy-{node}-{i}"
        if c.plane.route(rid, []) == node:
            return
        c.plane.complete(rid)
    raise AssertionError(f"{node} never chosen")


def test_a_unit_ready_in_the_shared_tier_does_not_draw_requests_to_its_local_holder() -> None:
    """Any node copies a shared-ready unit instead of computing it: a busier holder is passed over
    for the idle node (regression: requests queued behind a holder while the other node idled).
    Without the shared copy, or with the paper's rule (``cache_aware_all``), the holder wins
    within the load bound."""
    for shared, routing in ((True, "cache_aware"), (False, "cache_aware"), (True, "cache_aware_all")):
        c = Cluster(nodes=2, join_memory=shared, routing=routing)
        plan = c.serve([("a", 8)])  # first sight: retained in the node's local cache (and shared)
        assert plan.units[0].retention.local
        assert (c.plane.directory.ready("a") is not None) is shared
        home = plan.node
        other = "gen1" if home == "gen0" else "gen0"
        _busy(c, home)
        assert (c.plane.nodes[home].inflight, c.plane.nodes[other].inflight) == (1, 0)
        assert c.plane.route("next", [("a", 8)]) == (other if shared and routing == "cache_aware" else home)


def test_complete_tracks_in_flight_counts() -> None:
    """route counts a request in flight on its node; complete releases it, once."""
    c = Cluster(nodes=1)
    plan = c.plan([("a", 4)])
    assert c.plane.nodes["gen0"].inflight == 1
    assert c.plane.complete(plan.request_id) is True
    assert c.plane.complete(plan.request_id) is False
    assert c.plane.nodes["gen0"].inflight == 0


def test_plan_errors_name_what_to_fix() -> None:
    """Unrouted, misrouted, duplicate and malformed requests are BadRequests with a status."""
    c = Cluster(nodes=2)
    with pytest.raises(BadRequest, match="not routed") as info:
        c.plane.finalize("ghost", "gen0", [])
    assert info.value.status == 404
    node = c.plane.route("r", [("a", 4)])
    other = "gen1" if node == "gen0" else "gen0"
    with pytest.raises(BadRequest, match=f"routed to '{node}'"):
        c.plane.finalize("r", other, [])
    c.plane.finalize("r", node, [])
    with pytest.raises(BadRequest, match="already has a plan"):
        c.plane.finalize("r", node, [])
    with pytest.raises(BadRequest, match="already routed"):
        c.plane.route("r", [])
    with pytest.raises(BadRequest, match="n_tokens must be > 0"):
        c.plane.route("r2", [("a", 0)])
    with pytest.raises(BadRequest, match="unknown generation node 'gen9'") as info:
        c.plane.residency(ResidencyReport(WIRE_VERSION, "gen9"))
    assert info.value.status == 404


def test_repeated_units_in_one_request_are_planned_once() -> None:
    """A unit listed twice is one UnitPlan and counts once in the demand history."""
    c = Cluster(nodes=1)
    plan = c.serve([("a", 4), ("b", 4), ("a", 4)])
    assert [u.unit_id for u in plan.units] == ["a", "b"]
    assert c.plane.shared.policy.score("a") == c.plane.shared.policy.score("b")


def test_the_load_bound_diverts_requests_from_a_busy_holder() -> None:
    """The holder of a unit only it can serve takes requests until it is two above the idlest
    node; then locality yields."""
    c = Cluster(nodes=2, join_memory=False)
    home = None
    while home is None:
        plan = c.serve([("a", 8)])
        home = plan.node if plan.units[0].retention.local else None
    assert c.plane.route("x1", [("a", 8)]) == home
    assert c.plane.route("x2", [("a", 8)]) == home
    assert c.plane.route("x3", [("a", 8)]) != home


def test_the_counters_the_planner_keeps_as_it_decides_equal_a_recount_of_its_plans() -> None:
    """The planner counts preparations, retentions and evictions in its loop; PlaneStats.count
    recounts each finished plan from its units: after 400 plans with hits of every kind and
    evictions in both tiers, both say the same."""
    rng = random.Random(1)
    c = Cluster(plane_config(nodes=4, local_blocks=12, shared_blocks=24))
    sizes = {f"u{i}": rng.randint(1, 16) for i in range(40)}
    recount = PlaneStats()
    for _ in range(400):
        plan = c.plan([(u, sizes[u]) for u in rng.sample(sorted(sizes), rng.randint(1, 6))])
        recount.count(plan)
        c.execute(plan)
    counted = c.plane.stats.snapshot()
    assert counted == recount.snapshot()
    assert min(counted["local"], counted["remote"], counted["keep_local"], counted["keep_shared"],
               counted["local_evictions"]) > 0, counted  # every counter was exercised
