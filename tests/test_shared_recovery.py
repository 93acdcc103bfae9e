"""Recovery of the shared tier after a control-plane restart: verified arena inventory, adoption."""

from __future__ import annotations

import uuid

import pytest
from helpers.kvpool import BLOCK_TOKENS, random_state, tiny_layout
from helpers.plane import Cluster, hello, preps

from tessera.errors import PublishRejected
from tessera.kvpool.inventory import scan
from tessera.messages.control import LoadReport, PublishRequest, ResidencyReport
from tessera.messages.kvpool import InventoryBlock, MemoryNodeInventory
from tessera.messages.plan import Preparation
from tessera.transport.arena import Arena, segment_name
from tessera.transport.unit_blocks import encode_unit
from tessera.units import unit_key_hex
from tessera.wire import WIRE_VERSION


def test_an_arena_scan_lists_only_blocks_whose_header_and_payload_verify() -> None:
    """Written blocks are listed with their header fields; a flipped payload bit or an empty slot is not."""
    layout = tiny_layout()
    boot = uuid.uuid4().hex
    arena = Arena.create(segment_name("scan", boot), layout.slot_bytes, 8, boot)
    try:
        n = 2 * BLOCK_TOKENS + 1  # three blocks, the last one partial
        for i, block in enumerate(encode_unit(layout, random_state(n), "unit-a", epoch=9)):
            arena.slot(2 + i, len(block))[:] = block
        listed = scan(arena, layout)
        key = unit_key_hex("unit-a")
        assert [(b.slot, b.unit_key, b.epoch, b.block_index, b.tokens, b.unit_tokens) for b in listed] == [
            (2, key, 9, 0, BLOCK_TOKENS, n), (3, key, 9, 1, BLOCK_TOKENS, n), (4, key, 9, 2, 1, n)]
        payload = arena.slot(3)
        payload[100] ^= 0xFF  # a torn or corrupted write
        assert [b.slot for b in scan(arena, layout)] == [2, 4]
    finally:
        arena.close()


def _inventory(blocks: list[InventoryBlock], name: str = "kv0", boot: str = "boot-1"):
    return MemoryNodeInventory(WIRE_VERSION, name, boot, tuple(blocks))


def _blocks(unit: str, n: int, epoch: int, slots: list[int], b: int = 4) -> list[InventoryBlock]:
    return [InventoryBlock(s, unit_key_hex(unit), epoch, i, min(b, n - i * b), n) for i, s in enumerate(slots)]


def test_a_restarted_plane_adopts_complete_entries_of_live_units_after_its_fence() -> None:
    """Fenced: retry later. Then: READY again at the same epoch (a remote hit); gone or partial units are not."""
    c = Cluster(join_memory=False, write_timeout_s=5.0, lease_ttl_s=5.0, heartbeat_timeout_s=600.0)
    plane = c.plane
    plane.begin_incarnation(2)
    plane.hello(hello("kv0", 16))
    blocks = _blocks("a", 8, 7, [3, 5]) + _blocks("gone", 4, 8, [6]) + _blocks("partial", 8, 9, [7])
    live = {unit_key_hex("a"): ("a", 8), unit_key_hex("partial"): ("partial", 8)}
    first = plane.adopt(_inventory(blocks), live)
    assert first.adopted == () and first.retry_after_s > 0
    c.clock.advance(first.retry_after_s + 0.1)
    assert plane.adopt(_inventory(blocks), live).adopted == ("a",)
    entry = plane.directory.ready("a")
    assert entry is not None and entry.epoch == 7 and [b.index for b in entry.blocks] == [3, 5]
    assert plane.allocator.free_blocks == 14  # slots of "gone" and "partial" are free again
    plan = c.plan([("a", 8)])
    assert preps(plan)["a"] is Preparation.REMOTE and plan.units[0].lease is not None
    assert plan.units[0].lease.epoch == 7
    plane.check_invariants()


def test_recovery_refuses_revoked_units_wrong_lengths_and_slots_in_use() -> None:
    """A revoked unit, a block of another length, or a slot the new plane already handed out: not adopted."""
    c = Cluster(join_memory=False, heartbeat_timeout_s=600.0)
    plane = c.plane
    plane.hello(hello("kv0", 16))
    c.serve([("fresh", 4)])
    c.serve([("fresh", 4)])
    used = next(iter(plane.directory.entries())).blocks[0].index
    plane.revoke(["revoked"])
    blocks = (_blocks("revoked", 4, 1, [10]) + _blocks("short", 4, 2, [11]) + _blocks("clash", 4, 3, [used]))
    live = {unit_key_hex(u): (u, 4 if u != "short" else 5) for u in ("revoked", "short", "clash")}
    assert plane.adopt(_inventory(blocks), live).adopted == ()
    plane.check_invariants()


def test_a_unit_spread_over_two_memory_nodes_is_adopted_when_both_reported() -> None:
    """Blocks on kv0 and kv1: the entry is rebuilt once the second node's inventory completes it."""
    c = Cluster(join_memory=False, kvpools=2, heartbeat_timeout_s=600.0)
    plane = c.plane
    plane.hello(hello("kv0", 16))
    plane.hello(hello("kv1", 16))
    live = {unit_key_hex("a"): ("a", 8)}
    part0 = [InventoryBlock(2, unit_key_hex("a"), 4, 0, 4, 8)]
    part1 = [InventoryBlock(9, unit_key_hex("a"), 4, 1, 4, 8)]
    assert plane.adopt(_inventory(part0), live).adopted == ()
    assert plane.adopt(_inventory(part1, "kv1"), live).adopted == ("a",)
    entry = plane.directory.ready("a")
    assert entry is not None and [(b.node, b.index) for b in entry.blocks] == [("kv0", 2), ("kv1", 9)]
    plane.check_invariants()


def test_a_write_granted_by_the_previous_incarnation_cannot_publish() -> None:
    """The new plane has no reservation for an old grant: its publish is refused, not adopted."""
    c = Cluster(heartbeat_timeout_s=600.0)

    plan = c.plan([("a", 8)])
    grant = next(u.grant for u in plan.units if u.grant is not None)
    fresh = Cluster(heartbeat_timeout_s=600.0)  # the restarted plane
    fresh.plane.begin_incarnation(2)
    with pytest.raises(PublishRejected, match="no reservation"):
        fresh.plane.publish(PublishRequest(WIRE_VERSION, grant.unit_id, grant.epoch, grant.writer, grant.blocks))


def test_a_generation_node_re_reports_its_cache_to_a_restarted_plane() -> None:
    """The first heartbeat to a new plane is answered "resync"; the full report rebuilds the local view."""
    c = Cluster(admission="lru", nodes=1, join_generation=False)  # no heartbeat yet
    plane = c.plane
    assert plane.load(LoadReport(WIRE_VERSION, "gen0", 0)).reason == "resync"
    assert plane.load(LoadReport(WIRE_VERSION, "gen0", 0)).reason == ""
    plane.residency(ResidencyReport(WIRE_VERSION, "gen0", ("a", "b"), (), blocks=(2, 3)))
    assert plane.nodes["gen0"].local.used_blocks == 5
    c.caches["gen0"].update({"a", "b"})
    assert preps(c.plan([("a", 8), ("b", 12)])) == {"a": Preparation.LOCAL, "b": Preparation.LOCAL}
    plane.check_invariants()



def test_a_fence_for_this_terms_own_stale_writes_is_not_ended_by_term() -> None:
    """The term rule ends only the fence that guards an earlier incarnation's grants. A
    memory node that died with a write of this term still pending is fenced for that write; its
    new boot reporting the term settled must not lift that fence (the same term is not refused)."""
    import os
    import tempfile
    from pathlib import Path

    from helpers.kvpool import build_pool_config

    from tessera.control.plane import ControlPlane

    d = Path(tempfile.mkdtemp())
    secret = d / "secret"
    secret.write_text("s" * 64)
    os.chmod(secret, 0o600)
    plane = ControlPlane(build_pool_config(d, secret_file=secret, transport="tcp"))
    directory = plane.directory
    directory.fence("kv0", plane.clock() + 30.0)  # an earlier incarnation's grants: the term rule may end it
    directory.add_node("kv0", 64)
    assert directory.lift_fence("kv0") == 64 and directory.fenced_for("kv0") == 0
    assert directory.reserve("u" * 32, 32, 2, "gen0") is not None  # a write of this term, pending
    directory.drop_node("kv0")  # the memory node died under it
    assert directory.fenced_for("kv0") > 0
    assert directory.lift_fence("kv0") is None and directory.fenced_for("kv0") > 0
