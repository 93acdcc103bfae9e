"""Stateful property test of the control plane and the shared-tier directory.

Hypothesis drives a real ControlPlane through interleaved requests, node actions (inserts,
write-back, publish with or without flaws, cancel, release, cache loss), heartbeats, memory
node restarts and the passage of time, and checks after every step that:

* capacity is never exceeded (local views and the shared arena; blocks are conserved),
* a plan never asks for a local copy the snapshot did not report, and every remote unit
  reads a READY entry's current epoch under a lease,
* no leased entry is reclaimed while its lease is valid,
* publication succeeds exactly when writer, epoch and block set are right (and in time).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from helpers.plane import Cluster, hello, plane_config
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessera.errors import PublishRejected, Unavailable
from tessera.messages.common import BlockRef
from tessera.messages.control import CancelRequest, LoadReport, PublishRequest, ReleaseRequest
from tessera.messages.plan import Preparation, ReadLease, RequestPlan, WriteGrant
from tessera.wire import WIRE_VERSION

UNITS = {f"u{i}": n for i, n in enumerate([3, 4, 5, 8, 9, 12, 1, 16])}
NODES = ("gen0", "gen1")
LOCAL_BLOCKS = 6
SHARED_BLOCKS = 10
LEASE_TTL = 20.0


@dataclass
class HeldLease:
    lease: ReadLease
    holder: str
    expires_at: float
    valid: bool = True  # false once released, or invalidated by a restart / node death


class PlaneMachine(RuleBasedStateMachine):
    admission = "demand"

    def __init__(self) -> None:
        super().__init__()
        config = plane_config(nodes=len(NODES), local_blocks=LOCAL_BLOCKS, shared_blocks=SHARED_BLOCKS,
                                window=3, theta=1.5, admission=self.admission, lease_ttl_s=LEASE_TTL,
                                write_timeout_s=30.0, heartbeat_timeout_s=15.0)
        self.c = Cluster(config)
        self.plane = self.c.plane
        self.planned: list[RequestPlan] = []  # routed + finalized, not yet executed
        self.executed: list[RequestPlan] = []  # executed, not yet completed
        self.grants: list[WriteGrant] = []
        self.leases: list[HeldLease] = []
        self.boot = 0

    # --- the request path ----------------------------------------------------------------

    @rule(units=st.lists(st.sampled_from(sorted(UNITS)), min_size=0, max_size=4, unique=True))
    def request(self, units: list[str]) -> None:
        pairs = [(u, UNITS[u]) for u in units]
        self.c.blocks.update((u, -(-n // 4)) for u, n in pairs)
        rid = self.c.rid()
        if not any(n.alive for n in self.plane.nodes.values()):
            with pytest.raises(Unavailable):
                self.plane.route(rid, pairs)
            return
        node = self.plane.route(rid, pairs)
        held = [u for u in units if u in self.c.caches[node]]
        plan = self.plane.finalize(rid, node, held)
        self.check_plan(plan, held)
        self.planned.append(plan)
        self.grants += [u.grant for u in plan.units if u.grant is not None]
        now = self.c.clock.now
        self.leases += [HeldLease(u.lease, node, now + LEASE_TTL) for u in plan.units if u.lease is not None]

    def check_plan(self, plan: RequestPlan, held: list[str]) -> None:
        assert [u.unit_id for u in plan.units] == list(dict.fromkeys(u.unit_id for u in plan.units))
        for up in plan.units:
            if up.preparation is Preparation.LOCAL:
                assert up.unit_id in held, f"local preparation of {up.unit_id} not in the snapshot"
            if up.preparation is Preparation.REMOTE:
                entry = self.plane.directory.ready(up.unit_id)
                assert up.lease is not None and entry is not None
                assert (up.lease.epoch, up.lease.blocks) == (entry.epoch, entry.blocks)
            if up.grant is not None:
                entry = self.plane.directory.get(up.unit_id)
                assert entry is not None and entry.epoch == up.grant.epoch and entry.writer == plan.node
        assert not set(plan.local_evict) & {u.unit_id for u in plan.units}

    @precondition(lambda self: self.planned)
    @rule(data=st.data(), decline=st.booleans())
    def execute(self, data: st.DataObject, decline: bool) -> None:
        """The node drops its victims and inserts what it may (or declines one insertion)."""
        plan = self.planned.pop(data.draw(st.integers(0, len(self.planned) - 1)))
        self.c.execute(plan, publish=False, release=False, complete=False, decline=decline)
        self.executed.append(plan)

    @precondition(lambda self: self.executed)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        plan = self.executed.pop(data.draw(st.integers(0, len(self.executed) - 1)))
        assert self.plane.complete(plan.request_id)

    @precondition(lambda self: self.grants)
    @rule(data=st.data(), flaw=st.sampled_from(["none", "none", "writer", "epoch", "blocks", "cancel"]))
    def publish(self, data: st.DataObject, flaw: str) -> None:
        g = self.grants.pop(data.draw(st.integers(0, len(self.grants) - 1)))
        entry = self.plane.directory.get(g.unit_id)
        current = (entry is not None and entry.epoch == g.epoch and entry.state.value == "pending"
                   and self.c.clock.now <= entry.deadline)
        if flaw == "cancel":
            ack = self.plane.cancel(CancelRequest(WIRE_VERSION, g.unit_id, g.epoch, g.writer, settle_s=1.0))
            assert ack.ok == current
            return
        writer, epoch, blocks = g.writer, g.epoch, g.blocks
        if flaw == "writer":
            writer = "intruder"
        elif flaw == "epoch":
            epoch += 1000
        elif flaw == "blocks":
            blocks = (*blocks[1:], BlockRef("kv0", 10_000))
        try:
            self.plane.publish(PublishRequest(WIRE_VERSION, g.unit_id, epoch, writer, blocks))
            accepted = True
        except PublishRejected:
            accepted = False
        assert accepted == (current and flaw == "none"), (flaw, current, accepted)
        if not accepted and current:
            self.grants.append(g)  # the writer may still publish correctly

    @precondition(lambda self: any(h.valid for h in self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = [h for h in self.leases if h.valid]
        held = live[data.draw(st.integers(0, len(live) - 1))]
        self.plane.release(ReleaseRequest(WIRE_VERSION, (held.lease.lease_id,)))
        held.valid = False

    # --- the world -----------------------------------------------------------------------

    @rule(node=st.sampled_from(NODES))
    def node_loses_its_cache(self, node: str) -> None:
        """The node drops everything without telling the plane; snapshots must correct it."""
        self.c.caches[node].clear()

    @rule(node=st.sampled_from(NODES))
    def heartbeat(self, node: str) -> None:
        self.plane.load(LoadReport(WIRE_VERSION, node, self.plane.nodes[node].inflight))

    @rule()
    def memory_node_restarts(self) -> None:
        self.boot += 1
        self.plane.hello(hello("kv0", SHARED_BLOCKS, boot=f"boot-{self.boot + 1}"))
        for h in self.leases:
            h.valid = False  # the data under every lease is gone with the arena

    @rule(seconds=st.sampled_from([0.5, 2.0, 8.0, 25.0]))
    def time_passes(self, seconds: float) -> None:
        self.c.clock.advance(seconds)
        self.plane.hello(hello("kv0", SHARED_BLOCKS, boot=f"boot-{self.boot + 1}"))  # kv0 keeps beating
        alive = {n.name for n in self.plane.nodes.values() if n.alive}
        self.plane.tick()
        for name in alive:
            if not self.plane.nodes[name].alive:
                # a node declared dead restarts: empty cache, its requests die unexecuted
                # (the serving layer still completes them), its leases were released
                self.c.caches[name].clear()
                for h in self.leases:
                    if h.holder == name:
                        h.valid = False
                self.executed += [p for p in self.planned if p.node == name]
                self.planned = [p for p in self.planned if p.node != name]
        for h in self.leases:
            if h.expires_at <= self.c.clock.now:
                h.valid = False

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def structures_are_consistent(self) -> None:
        self.plane.check_invariants()

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        for node in self.plane.nodes.values():
            assert node.local.used_blocks <= LOCAL_BLOCKS, (node.name, node.local.used_blocks)
        for name, cache in self.c.caches.items():
            assert sum(-(-UNITS[u] // 4) for u in cache) <= LOCAL_BLOCKS, (name, cache)
        d = self.plane.directory
        owned = sum(len(e.blocks) for e in d.entries())
        assert owned + d.quarantined_blocks + self.plane.allocator.free_blocks == self.plane.allocator.capacity

    @invariant()
    def no_valid_lease_loses_its_entry(self) -> None:
        for h in self.leases:
            if not h.valid:
                continue
            entry = self.plane.directory.get(h.lease.unit_id)
            assert entry is not None, f"leased {h.lease.unit_id} was reclaimed"
            assert entry.epoch == h.lease.epoch and entry.blocks == h.lease.blocks
            assert h.lease.lease_id in entry.leases


class LruPlaneMachine(PlaneMachine):
    admission = "lru"


TestPlaneMachine = PlaneMachine.TestCase
TestPlaneMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestLruPlaneMachine = LruPlaneMachine.TestCase
TestLruPlaneMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
