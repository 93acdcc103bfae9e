"""The planner's inlined ``plan`` decides exactly as its plain ``plan_reference``.

Two identical in-process clusters take the same random run of requests: one plans with
``Planner.plan``, the other with ``Planner.plan_reference``. Every plan (preparations, leases,
grants, retentions, local evictions, assists) and every counter must be the same, through lost
caches, declined insertions, unpublished writes, revocations and units whose token count changes.
"""

from __future__ import annotations

from helpers.plane import Cluster, plane_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

UNITS = [f"u{i}" for i in range(8)]
ASSIST = 12  # low enough that an idle node often prefills units of the other's requests

request = st.lists(st.tuples(st.sampled_from(UNITS), st.integers(1, 16)), min_size=1, max_size=6,
                   unique_by=lambda p: p[0])
step = st.one_of(
    st.tuples(st.just("serve"), request, st.booleans(), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("lose_cache"), st.integers(0, 1)),
    st.tuples(st.just("revoke"), st.lists(st.sampled_from(UNITS), min_size=1, max_size=3)),
    st.tuples(st.just("reinstate"), st.lists(st.sampled_from(UNITS), min_size=1, max_size=3)),
)


def reference_cluster() -> Cluster:
    """A cluster whose plane plans through ``plan_reference``."""
    c = Cluster(plane_config(nodes=2, local_blocks=6, shared_blocks=8, assist_min_tokens=ASSIST))
    planner = c.plane.planner
    planner.plan = planner.plan_reference  # type: ignore[method-assign]
    return c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=40))
def test_plan_and_plan_reference_agree_on_random_runs(steps: list[tuple]) -> None:
    """Same clusters, same requests: the same plans, counters and caches after every step."""
    fast = Cluster(plane_config(nodes=2, local_blocks=6, shared_blocks=8, assist_min_tokens=ASSIST))
    reference = reference_cluster()
    assert fast.plane.planner.plan != reference.plane.planner.plan
    for kind, *args in steps:
        if kind == "serve":
            units, publish, release, complete, decline = args
            plans = [c.plan(units) for c in (fast, reference)]
            assert plans[0] == plans[1]
            for c, plan in zip((fast, reference), plans, strict=True):
                c.execute(plan, publish=publish, release=release, complete=complete, decline=decline)
        elif kind == "lose_cache":
            for c in (fast, reference):  # a node restarted without telling the plane
                c.caches[list(c.caches)[args[0]]].clear()
        else:
            for c in (fast, reference):
                getattr(c.plane, kind)(args[0])
        assert fast.plane.stats.snapshot() == reference.plane.stats.snapshot()
        assert fast.caches == reference.caches
        for c in (fast, reference):
            c.plane.check_invariants()
