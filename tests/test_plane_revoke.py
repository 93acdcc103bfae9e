"""Revocation in the control plane: a revoked unit is never LOCAL, REMOTE or retained again."""

from __future__ import annotations

import pytest
from helpers.plane import Cluster, hello, preps, retentions

from tessera.control.directory import Directory
from tessera.errors import PublishRejected
from tessera.messages.control import PublishRequest, ReleaseRequest, ResidencyReport
from tessera.messages.plan import Preparation
from tessera.wire import WIRE_VERSION

COMPUTE, LOCAL, REMOTE = Preparation.COMPUTE, Preparation.LOCAL, Preparation.REMOTE


def _shared_ready(c: Cluster, unit: str = "a", n: int = 8) -> None:
    """Serve the unit until it is READY in the shared tier; then the nodes drop their local
    copies (free space admits at first sight), so the next plan reads the shared entry."""
    for _ in range(3):
        c.serve([(unit, n)])
        if c.plane.directory.ready(unit) is not None:
            for cache in c.caches.values():
                cache.discard(unit)
            return
    raise AssertionError(f"{unit} never became READY")


def test_a_revoked_unit_is_computed_and_kept_nowhere_even_if_a_node_still_holds_it() -> None:
    """A node that missed the drop order reports the unit held; the plan still computes it."""
    c = Cluster(admission="lru")
    c.serve([("a", 8)])
    assert any("a" in cache for cache in c.caches.values())
    c.plane.revoke(["a"])
    for _ in range(4):
        plan = c.plan([("a", 8), ("b", 8)])  # the test nodes never drop "a": the snapshot says held
        assert preps(plan)["a"] is COMPUTE and retentions(plan)["a"] == "neither"
        c.execute(plan)
    assert all(not n.local.holds("a") for n in c.plane.nodes.values())
    c.plane.check_invariants()


def test_a_revoked_ready_entry_drains_its_leases_then_goes() -> None:
    """Leased entries take no new lease and are evicted when the last lease is released."""
    c = Cluster()
    _shared_ready(c)
    reader = c.plan([("a", 8)], request_id="reader")
    lease = next(u.lease for u in reader.units if u.lease is not None)
    c.plane.revoke(["a"])
    assert c.plane.directory.get("a") is not None  # the reader may still be copying
    other = c.plan([("a", 8)])
    assert preps(other)["a"] is COMPUTE
    c.plane.release(ReleaseRequest(WIRE_VERSION, (lease.lease_id,)))
    assert c.plane.directory.get("a") is None
    assert c.plane.allocator.free_blocks == c.plane.allocator.capacity
    c.execute(other)
    c.plane.complete("reader")
    c.plane.check_invariants()


def test_a_revoked_entry_whose_leases_expire_goes_at_the_next_tick() -> None:
    """A reader that never releases: its lease expires and the entry goes with it."""
    c = Cluster(lease_ttl_s=5.0)
    _shared_ready(c)
    c.plan([("a", 8)], request_id="reader")
    c.plane.revoke(["a"])
    c.clock.advance(6)
    c.plane.tick()
    assert c.plane.directory.get("a") is None
    c.plane.check_invariants()


def test_a_pending_writeback_of_a_revoked_unit_is_fenced() -> None:
    """The writer's publish is refused, and its blocks stay quarantined until it cannot write."""
    c = Cluster()
    plan = c.plan([("a", 8)])  # free shared space: the first sight is granted a writeback
    grant = next(u.grant for u in plan.units if u.grant is not None)
    c.plane.revoke(["a"])
    with pytest.raises(PublishRejected, match="no reservation"):
        c.plane.publish(PublishRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, grant.blocks))
    assert c.plane.directory.quarantined_blocks == len(grant.blocks)
    c.plane.check_invariants()


def test_a_late_insertion_report_of_a_revoked_unit_is_not_believed() -> None:
    """A request planned before the revocation inserts the unit afterwards: the view ignores it."""
    c = Cluster()
    c.serve([("a", 8)])
    plan = c.plan([("a", 8)])
    c.plane.revoke(["a"])
    c.plane.residency(ResidencyReport(WIRE_VERSION, plan.node, ("a",)))
    assert not c.plane.nodes[plan.node].local.holds("a")


def test_a_reinstated_unit_is_cached_again() -> None:
    """Ingested again (same text), the unit is no longer revoked and may be retained."""
    c = Cluster(admission="lru", nodes=1)
    c.plane.revoke(["a"])
    c.plane.reinstate(["a"])
    c.serve([("a", 8)])
    assert preps(c.plan([("a", 8)]))["a"] is LOCAL


def test_a_new_incarnation_never_repeats_epochs_and_fences_memory_nodes() -> None:
    """Epochs start above the previous incarnation's; slots stay fenced until old writes cannot land."""
    c = Cluster(join_memory=False, write_timeout_s=20.0, lease_ttl_s=10.0, heartbeat_timeout_s=60.0)
    c.plane.begin_incarnation(3)
    directory: Directory = c.plane.directory
    c.plane.hello(hello("kv0", 16))
    assert c.plane.allocator.free_blocks == 0 and directory.quarantined_blocks == 16
    c.clock.advance(20.0 + directory.reclaim_grace_s + 1)
    c.plane.tick()
    assert c.plane.allocator.free_blocks == 16
    plan = c.plan([("a", 8)])  # free shared space: the first sight is granted a writeback
    grant = next(u.grant for u in plan.units if u.grant is not None)
    assert grant.epoch > 3 << 32
