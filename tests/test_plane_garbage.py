"""The request path leaves no cyclic garbage: everything it drops is freed by reference counting.

Python's cyclic collector would otherwise have to find it, and its collections are what
pause the plane for milliseconds (bench/control_plane.py prints the pauses, and times a full
collection of what the loop left tracked). A closure or generator that referenced itself on the plan path would
make every collection of the loop do real work.
"""

from __future__ import annotations

import gc
import random

from helpers.plane import Cluster, plane_config


def test_routing_planning_and_completing_requests_creates_no_reference_cycles() -> None:
    """800 requests with evictions in both tiers, then a collection finds nothing unreachable."""
    rng = random.Random(0)
    c = Cluster(plane_config(nodes=8, local_blocks=12, shared_blocks=24))
    sizes = {f"u{i}": rng.randint(1, 16) for i in range(60)}
    inflight: list[str] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(800):
            units = [(u, sizes[u]) for u in rng.sample(sorted(sizes), rng.randint(1, 6))]
            plan = c.plan(units)
            c.execute(plan, complete=False)
            inflight.append(plan.request_id)
            if len(inflight) > 8:
                c.plane.complete(inflight.pop(0))
        assert c.plane.stats.local_evictions > 0 and c.plane.shared.evictions > 0  # the eviction walks ran
        assert gc.collect() == 0
    finally:
        gc.enable()
