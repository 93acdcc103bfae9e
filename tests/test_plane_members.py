"""Membership and time in the control plane: memory nodes, generation nodes, expiry, publication."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.plane import Cluster, hello, preps

from tessera.errors import BadRequest, PublishRejected, Unavailable
from tessera.messages.control import CancelRequest, LoadReport, PublishRequest, ReleaseRequest
from tessera.messages.plan import Preparation
from tessera.wire import WIRE_VERSION


def _granted(c: Cluster, unit: str = "a", n: int = 8):
    plan = c.plan([(unit, n)])
    grant = plan.units[0].grant
    assert grant is not None
    return plan, grant


def test_a_memory_node_hello_registers_its_arena_and_repeats_as_a_heartbeat() -> None:
    """The first hello adds capacity; the same hello again changes nothing."""
    c = Cluster(join_memory=False, shared_blocks=16)
    assert c.plane.allocator.capacity == 0
    assert c.plane.hello(hello("kv0", 16)).reason == "joined"
    assert c.plane.hello(hello("kv0", 16)).reason == "heartbeat"
    assert c.plane.allocator.capacity == 16
    assert [h.name for h in c.plane.memory_nodes()] == ["kv0"]


def test_a_new_boot_id_means_the_memory_node_restarted_empty() -> None:
    """Entries with blocks on the restarted node are dropped; its capacity is fresh."""
    c = Cluster(shared_blocks=16)
    plan, _ = _granted(c)
    c.execute(plan)
    assert c.plane.directory.ready("a") is not None
    assert c.plane.hello(hello("kv0", 16, boot="boot-2")).reason == "restarted"
    assert c.plane.directory.get("a") is None
    assert c.plane.allocator.free_blocks == 16
    c.plane.check_invariants()


def test_hellos_from_unknown_or_inconsistent_memory_nodes_are_refused() -> None:
    """Unknown names are 404; a changed arena without a new boot id is 409."""
    c = Cluster()
    with pytest.raises(BadRequest, match="unknown memory node 'kv7'") as info:
        c.plane.hello(hello("kv7"))
    assert info.value.status == 404
    with pytest.raises(BadRequest, match="without a new boot_id") as info:
        c.plane.hello(dataclasses.replace(hello("kv0"), shm_name="tessera-elsewhere"))
    assert info.value.status == 409


def test_a_hello_claiming_more_than_the_config_gives_is_refused() -> None:
    """Regression: capacity_blocks = 1e9 in a hello sized the allocator and OOM-killed the plane."""
    c = Cluster()
    for capacity in (32, 10**9):
        with pytest.raises(BadRequest, match="the config gives it 16") as info:
            c.plane.hello(hello("kv0", capacity, boot=f"boot-{capacity}"))
        assert info.value.status == 400
    assert c.plane.allocator.capacity == 16
    c.plane.check_invariants()


def test_a_silent_memory_node_is_dropped_with_its_entries() -> None:
    """No hello for longer than heartbeat_timeout_s: entries and capacity go away."""
    c = Cluster(heartbeat_timeout_s=5.0)
    plan, _ = _granted(c)
    c.execute(plan)
    c.clock.advance(3)
    c.plane.tick()
    assert c.plane.directory.ready("a") is not None
    c.clock.advance(3)
    c.plane.tick()
    assert c.plane.directory.get("a") is None and c.plane.allocator.capacity == 0
    assert c.plane.memory_nodes() == []
    c.plane.check_invariants()


def test_a_silent_generation_node_is_declared_dead_and_revived_by_its_heartbeat() -> None:
    """Dead: not routed to, leases released, reservations cancelled, local view cleared."""
    c = Cluster(nodes=2, heartbeat_timeout_s=5.0, routing="load")
    for node in ("gen0", "gen1"):
        c.plane.load(LoadReport(WIRE_VERSION, node, 0))
    _, grant = _granted(c)  # the writer holds a pending reservation
    dead = grant.writer
    live = "gen1" if dead == "gen0" else "gen0"
    c.clock.advance(4)
    c.plane.load(LoadReport(WIRE_VERSION, live, 0))
    c.clock.advance(2)
    c.plane.tick()
    assert not c.plane.nodes[dead].alive and c.plane.nodes[live].alive
    assert c.plane.directory.get("a") is None  # its reservation was cancelled
    assert {c.plane.route(f"x{i}", []) for i in range(3)} == {live}
    c.plane.load(LoadReport(WIRE_VERSION, dead, 0))
    assert c.plane.nodes[dead].alive
    c.plane.check_invariants()


def test_routing_with_every_generation_node_dead_is_overloaded() -> None:
    """No live node: route raises Unavailable (503) instead of choosing a dead one."""
    c = Cluster(nodes=1, heartbeat_timeout_s=1.0)
    c.plane.load(LoadReport(WIRE_VERSION, "gen0", 0))
    c.clock.advance(2)
    c.plane.tick()
    with pytest.raises(Unavailable, match="no generation node is alive"):
        c.plane.route("r", [])


@pytest.mark.parametrize("flaw", ["writer", "epoch", "blocks", "foreign"])
def test_publication_is_refused_unless_writer_epoch_and_block_set_match(flaw: str) -> None:
    """Only the authorized writer, under the current epoch, with the full block set, publishes."""
    c = Cluster(nodes=1)
    _, g = _granted(c)
    writer, epoch, blocks = g.writer, g.epoch, g.blocks
    if flaw == "writer":
        writer = "gen9"
    elif flaw == "epoch":
        epoch += 1
    elif flaw == "blocks":
        blocks = blocks[:-1]
    else:
        blocks = (*blocks[:-1], type(blocks[0])("kv0", 99))
    with pytest.raises(PublishRejected):
        c.plane.publish(PublishRequest(WIRE_VERSION, g.unit_id, epoch, writer, blocks))
    assert c.plane.directory.ready("a") is None
    c.plane.publish(PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, g.blocks))
    assert c.plane.directory.ready("a") is not None


def test_an_expired_reservation_cannot_be_published_and_leaves_the_shared_tier() -> None:
    """Past write_timeout_s the tick drops the entry; a late publish is rejected."""
    c = Cluster(nodes=1, write_timeout_s=5.0)
    _, g = _granted(c)
    c.clock.advance(6)
    c.plane.tick()
    assert c.plane.directory.get("a") is None and "a" not in c.plane.shared.policy
    with pytest.raises(PublishRejected, match="no reservation"):
        c.plane.publish(PublishRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, g.blocks))
    c.plane.check_invariants()


def test_cancel_gives_the_reservation_up_and_later_requests_may_reserve_again() -> None:
    """A cancelled unit leaves the directory; its blocks return after the settle time."""
    c = Cluster(nodes=1, shared_blocks=2)
    _, g = _granted(c, n=8)
    ack = c.plane.cancel(CancelRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, settle_s=1.0))
    assert ack.ok and c.plane.directory.get("a") is None
    assert not c.plane.cancel(CancelRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer)).ok
    assert c.plane.allocator.free_blocks == 0  # quarantined until the settle time passes
    c.clock.advance(2)
    c.plane.tick()
    assert c.plane.allocator.free_blocks == 2
    c.caches["gen0"].clear()
    assert c.plan([("a", 8)]).units[0].grant is not None
    c.plane.check_invariants()


def test_leases_are_released_by_the_reader_or_expire() -> None:
    """A leased entry cannot be evicted until the lease is released or its TTL passes."""
    c = Cluster(nodes=2, lease_ttl_s=5.0, local_blocks=0)  # no local copies: every read is remote
    c.serve([("a", 8)])  # published at its first retrieval (free space)
    plan = c.plan([("a", 8)])
    assert preps(plan) == {"a": Preparation.REMOTE}
    lease = plan.units[0].lease
    assert lease is not None and not c.plane.directory.can_evict("a")
    ack = c.plane.release(ReleaseRequest(WIRE_VERSION, (lease.lease_id, "L-unknown")))
    assert ack.ok and "L-unknown" in ack.reason
    assert c.plane.directory.can_evict("a")
    plan = c.plan([("a", 8)])
    assert not c.plane.directory.can_evict("a")
    c.clock.advance(6)
    c.plane.tick()
    assert c.plane.directory.can_evict("a")
