"""Safe publication and reclamation of the shared tier, as a random protocol (paper §5.4).

A stateful hypothesis test drives the real Directory with a fake clock and models what the
data path does around it: writers start block writes that land up to a transfer timeout
later (or never), readers copy leased blocks, memory nodes die and come back empty. The
clients follow the documented rules (a writer starts writes only before its grant's
deadline and publishes only after every write landed; a reader starts a copy only while its
lease has at least a transfer timeout left). Whatever the order of events:

* a READY entry never has a block whose content is not its own (unwritten or overwritten);
* a block under a live lease is never reclaimed and reused;
* a publish by a stale epoch, a second writer or with a partial block set is rejected;
* a renewed grant (a slow writer's) keeps its epoch and blocks, and its blocks are not
  reclaimed while its renewed deadline allows a write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from helpers.clock import Clock
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tessera.control.allocator import BlockAllocator
from tessera.control.directory import Directory, EntryState
from tessera.errors import PublishRejected
from tessera.messages.common import BlockRef
from tessera.messages.plan import ReadLease, WriteGrant

NODES = ("m0", "m1")
CAPACITY = 3
UNITS = ("u0", "u1", "u2", "u3")
WRITERS = ("gen0", "gen1")
TRANSFER_TIMEOUT = 5.0  # a write lands at most this long after it started, or never
RECLAIM_GRACE = 10.0  # the directory's grace must cover a transfer timeout
WRITE_TIMEOUT = 30.0
LEASE_TTL = 20.0


@dataclass
class Writer:
    grant: WriteGrant
    received: float
    incarnations: dict[str, int]  # memory node incarnations when the grant arrived
    started: set[int] = field(default_factory=set)
    landed: set[int] = field(default_factory=set)
    failed: bool = False
    stopped: bool = False  # cancelled, published, or gave up: starts no more writes
    computing: bool = False  # its unit is still being computed: it writes nothing before it renews


@dataclass
class InFlight:
    writer: Writer
    block: int
    ref: BlockRef
    incarnation: int
    latest: float  # lands by then or never


class DirectoryProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock(0.0)
        self.allocator = BlockAllocator()
        for node in NODES:
            self.allocator.add_node(node, CAPACITY)
        self.directory = Directory(self.allocator, lease_ttl_s=LEASE_TTL, write_timeout_s=WRITE_TIMEOUT,
                                   reclaim_grace_s=RECLAIM_GRACE, clock=self.clock)
        self.incarnation = dict.fromkeys(NODES, 0)
        self.down: set[str] = set()
        self.arena: dict[BlockRef, tuple[str, int]] = {}  # what last landed in each block
        self.writers: list[Writer] = []
        self.inflight: list[InFlight] = []
        self.leases: list[tuple[ReadLease, float, dict[str, int]]] = []

    # --- the properties ------------------------------------------------------------------

    def assert_ready_entries_hold_their_own_blocks(self) -> None:
        for entry in self.directory.entries():
            if entry.state is EntryState.READY:
                for ref in entry.blocks:
                    assert self.arena.get(ref) == (entry.unit_id, entry.epoch), (
                        f"READY {entry.unit_id}@{entry.epoch} block {ref} holds {self.arena.get(ref)}")

    @invariant()
    def directory_is_consistent(self) -> None:
        self.directory.check_invariants()
        self.assert_ready_entries_hold_their_own_blocks()

    @invariant()
    def no_block_changes_hands_while_a_write_to_it_may_land(self) -> None:
        """Reclamation waits out writes in flight and writers whose grant still allows writing."""
        owners = {ref: e for e in self.directory.entries() for ref in e.blocks}
        may_land = [(f.writer, f.ref, f.incarnation) for f in self.inflight]
        may_land += [(w, ref, w.incarnations[ref.node]) for w in self.active_writers()
                     if self.clock.now <= w.received + w.grant.deadline_s for ref in w.grant.blocks]
        for w, ref, _incarnation in may_land:
            owner = owners.get(ref)
            # a stale write lands in whatever incarnation of the node is up when it arrives
            if owner is not None:
                assert (owner.unit_id, owner.epoch) == (w.grant.unit_id, w.grant.epoch), (
                    f"{ref} now belongs to {owner.unit_id}@{owner.epoch} but "
                    f"{w.grant.unit_id}@{w.grant.epoch} (writer {w.grant.writer}) may still write it")

    # --- writers -------------------------------------------------------------------------

    @rule(unit=st.sampled_from(UNITS), n_blocks=st.integers(1, 4), writer=st.sampled_from(WRITERS))
    def reserve(self, unit: str, n_blocks: int, writer: str) -> None:
        grant = self.directory.reserve(unit, n_blocks * 4, n_blocks, writer)
        if grant is not None:
            assert len(grant.blocks) == n_blocks and all(b.node not in self.down for b in grant.blocks)
            self.writers.append(Writer(grant, self.clock.now, dict(self.incarnation)))

    def active_writers(self) -> list[Writer]:
        return [w for w in self.writers if not w.stopped]

    def start(self, w: Writer, blocks: list[int]) -> None:
        if self.clock.now > w.received + w.grant.deadline_s:
            w.stopped = True  # client rule: no write starts after the grant's deadline
            return
        for b in blocks:
            ref = w.grant.blocks[b]
            if ref.node in self.down:
                w.failed = True  # the node is gone: the transport fails
                continue
            # NOTE: a writer that never saw the node's previous incarnation cannot tell it
            # restarted, so its write goes through to the new, empty arena
            if self.incarnation[ref.node] != w.incarnations[ref.node]:
                w.failed = True  # its grant's slots are gone: it can never publish
            w.started.add(b)
            self.inflight.append(InFlight(w, b, ref, self.incarnation[ref.node], self.clock.now + TRANSFER_TIMEOUT))

    def unstarted(self) -> list[Writer]:
        return [w for w in self.active_writers() if len(w.started) < len(w.grant.blocks) and not w.computing]

    def complete(self) -> list[Writer]:
        return [w for w in self.active_writers() if not w.failed and len(w.landed) == len(w.grant.blocks)]

    @precondition(lambda self: self.unstarted())
    @rule(data=st.data(), some=st.booleans())
    def store(self, data: st.DataObject, some: bool) -> None:
        """The client's store starts every block's write at once (``some``: only a few of them)."""
        w = data.draw(st.sampled_from(self.unstarted()))
        blocks = [b for b in range(len(w.grant.blocks)) if b not in w.started]
        self.start(w, data.draw(st.lists(st.sampled_from(blocks), min_size=1, unique=True)) if some else blocks)

    def unwritten(self) -> list[Writer]:
        return [w for w in self.active_writers() if not w.started]

    @precondition(lambda self: self.unwritten())
    @rule(data=st.data())
    def compute_for_long(self, data: st.DataObject) -> None:
        """The unit waits behind a busy node's queue: no write starts, even at the deadline."""
        data.draw(st.sampled_from(self.unwritten())).computing = True

    @precondition(lambda self: self.unwritten())
    @rule(data=st.data(), as_whom=st.sampled_from(["itself", "rogue", "old epoch"]))
    def renew(self, data: st.DataObject, as_whom: str) -> None:
        """A writer whose unit was computed late renews its grant before its first write: the
        same epoch and blocks, a deadline a full write timeout from now, or None (lapsed)."""
        w = data.draw(st.sampled_from(self.unwritten()))
        g = w.grant
        entry = self.directory.get(g.unit_id)
        if as_whom != "itself":  # someone else's renewal never extends this entry
            before = None if entry is None else entry.deadline
            writer, epoch = ("rogue", g.epoch) if as_whom == "rogue" else (g.writer, g.epoch - 1)
            assert self.directory.renew(g.unit_id, epoch, writer) is None
            assert (None if entry is None else entry.deadline) == before
            return
        live = (entry is not None and entry.epoch == g.epoch and entry.writer == g.writer
                and entry.state is EntryState.PENDING and self.clock.now <= entry.deadline)
        renewed = self.directory.renew(g.unit_id, g.epoch, g.writer)
        assert (renewed is not None) == live
        w.computing = False
        if renewed is None:
            w.stopped = True  # it would ask for a new reservation: a new writer in this model
        else:
            assert (renewed.epoch, renewed.blocks, renewed.writer) == (g.epoch, g.blocks, g.writer)
            w.grant, w.received = renewed, self.clock.now

    def land(self, f: InFlight) -> None:
        self.inflight.remove(f)
        if f.ref.node not in self.down:
            # lands even in a newer incarnation of the node (only the directory's fence protects it)
            self.arena[f.ref] = (f.writer.grant.unit_id, f.writer.grant.epoch)
            if f.incarnation == self.incarnation[f.ref.node]:
                f.writer.landed.add(f.block)
        self.assert_ready_entries_hold_their_own_blocks()

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), fail=st.booleans(), all_of_them=st.booleans())
    def writes_finish(self, data: st.DataObject, fail: bool, all_of_them: bool) -> None:
        """One write (or all of one writer's) lands early, or fails and never lands."""
        first = data.draw(st.sampled_from(self.inflight))
        for f in [f for f in self.inflight if f.writer is first.writer] if all_of_them else [first]:
            if fail:
                self.inflight.remove(f)
                f.writer.failed = True
            else:
                self.land(f)

    @precondition(lambda self: self.complete())
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """Client rule: a writer asks to publish only after every one of its writes landed."""
        w = data.draw(st.sampled_from(self.complete()))
        g = w.grant
        w.stopped = True
        entry = self.directory.get(g.unit_id)
        legit = entry is not None and entry.epoch == g.epoch and self.clock.now <= entry.deadline
        try:
            self.directory.publish(g.unit_id, g.epoch, g.writer, g.blocks)
        except PublishRejected:
            assert not legit
        else:
            assert legit

    @precondition(lambda self: self.active_writers())
    @rule(data=st.data(), silently=st.booleans())
    def writer_gives_up(self, data: st.DataObject, silently: bool) -> None:
        """Cancel with a settle time covering writes in flight, or crash and leave it to expiry."""
        w = data.draw(st.sampled_from(self.active_writers()))
        w.stopped = True
        if not silently:
            self.directory.cancel(w.grant.unit_id, w.grant.epoch, w.grant.writer, settle_s=TRANSFER_TIMEOUT)

    @rule(writer=st.sampled_from(WRITERS))
    def declare_writer_dead(self, writer: str) -> None:
        """Heartbeats stopped; the node may in fact be alive and still writing until its deadline."""
        self.directory.forget_holder(writer)

    @precondition(lambda self: self.writers)
    @rule(data=st.data(), impostor=st.sampled_from([*WRITERS, "rogue"]))
    def rogue_publish(self, data: st.DataObject, impostor: str) -> None:
        """Second writers, stale epochs and partial block sets are always refused."""
        w = data.draw(st.sampled_from(self.writers))
        g = w.grant
        entry = self.directory.get(g.unit_id)
        current = entry is not None and entry.epoch == g.epoch and entry.state is EntryState.PENDING
        attempts = [(g.epoch, impostor, g.blocks)] if impostor != g.writer else []
        if not current:
            attempts.append((g.epoch, g.writer, g.blocks))  # a stale or finished writer
        if len(g.blocks) > 1:
            attempts.append((g.epoch, g.writer, g.blocks[:-1]))  # partial
        attempts.append((g.epoch + 1000, g.writer, g.blocks))  # an epoch never issued
        for epoch, writer, blocks in attempts:
            with pytest.raises(PublishRejected):
                self.directory.publish(g.unit_id, epoch, writer, blocks)

    # --- readers -------------------------------------------------------------------------

    @rule(unit=st.sampled_from(UNITS), reader=st.sampled_from(WRITERS))
    def lease(self, unit: str, reader: str) -> None:
        lease = self.directory.lease(unit, reader)
        entry = self.directory.get(unit)
        if lease is None:
            assert entry is None or entry.state is EntryState.PENDING, "a READY entry must be leasable"
        else:
            assert entry is not None and entry.state is EntryState.READY and entry.epoch == lease.epoch
            self.leases.append((lease, self.clock.now, dict(self.incarnation)))

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), then_release=st.booleans())
    def read(self, data: st.DataObject, then_release: bool) -> None:
        """A copy under a lease sees exactly the leased epoch's bytes on every surviving block."""
        item = data.draw(st.sampled_from(self.leases))
        lease, received, incarnations = item
        if self.clock.now + TRANSFER_TIMEOUT <= received + lease.ttl_s:  # client rule: enough lease left
            for ref in lease.blocks:
                if ref.node in self.down or self.incarnation[ref.node] != incarnations[ref.node]:
                    continue  # that block's fetch fails; the reader computes the unit instead
                assert self.arena.get(ref) == (lease.unit_id, lease.epoch), (
                    f"lease {lease.lease_id} on {lease.unit_id}@{lease.epoch}: block {ref} holds {self.arena.get(ref)}")
        if then_release:
            self.leases.remove(item)
            self.directory.release(lease.lease_id)

    # --- reclamation, time and failures --------------------------------------------------

    @rule(unit=st.sampled_from(UNITS))
    def evict(self, unit: str) -> None:
        """Admission may pick any victim; only unleased READY entries are reclaimed."""
        if self.directory.can_evict(unit):
            self.directory.evict(unit)
        else:
            entry = self.directory.get(unit)
            assert entry is None or entry.state is EntryState.PENDING or entry.leases

    @rule()
    def expire(self) -> None:
        self.directory.expire()

    @rule(dt=st.sampled_from([0.5, 2.0, 4.0, 6.0, 11.0, 21.0, 31.0]))
    def advance(self, dt: float) -> None:
        """Time passes, and the data path does the worst it is allowed to: every write in flight
        lands as late as possible, and every writer still holding a grant (even one the control
        plane gave up on) writes all its blocks again at the last moment its grant allows."""
        target = self.clock.now + dt
        while True:
            lands = [(f.latest, 0, i) for i, f in enumerate(self.inflight) if f.latest <= target]
            lasts = [(w.received + w.grant.deadline_s, 1, i) for i, w in enumerate(self.writers)
                     if not w.stopped and not w.computing and w.received + w.grant.deadline_s <= target]
            if not lands and not lasts:
                break
            when, kind, i = min(lands + lasts)
            self.clock.now = max(self.clock.now, when)
            if kind == 0:
                self.land(self.inflight[i])
            else:
                w = self.writers[i]
                self.start(w, list(range(len(w.grant.blocks))))
                w.stopped = True
        self.clock.now = target
        self.leases = [item for item in self.leases if self.clock.now < item[1] + item[0].ttl_s]

    @rule(node=st.sampled_from(NODES))
    def memory_node_fails_or_returns(self, node: str) -> None:
        """A live node dies (its arena is gone); a dead one comes back with an empty arena."""
        if node in self.down:
            self.down.discard(node)
            self.directory.add_node(node, CAPACITY)
            return
        self.down.add(node)
        self.incarnation[node] += 1
        self.directory.drop_node(node)
        for ref in [r for r in self.arena if r.node == node]:
            del self.arena[ref]


class TestDirectoryProtocol(DirectoryProtocol.TestCase):  # type: ignore[misc,valid-type]
    settings = settings(max_examples=300, stateful_step_count=80, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
class TestDirectoryProtocolLonger(DirectoryProtocol.TestCase):  # type: ignore[misc,valid-type]
    settings = settings(max_examples=5000, stateful_step_count=80, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])


# --- regressions found by the machine above ------------------------------------------------


def _directory(clock: Clock, capacity: int = 2) -> Directory:
    allocator = BlockAllocator()
    for node in NODES:
        allocator.add_node(node, capacity)
    return Directory(allocator, lease_ttl_s=LEASE_TTL, write_timeout_s=WRITE_TIMEOUT,
                     reclaim_grace_s=RECLAIM_GRACE, clock=clock)


def test_blocks_of_a_writer_declared_dead_stay_quarantined_until_its_deadline_passed(clock: Clock) -> None:
    """Regression: forget_holder freed blocks after the grace although the writer (maybe just
    slow to heartbeat) could still start writes until its grant's deadline."""
    d = _directory(clock, capacity=1)
    grant = d.reserve("u0", 4, 1, "gen0")
    assert grant is not None
    d.forget_holder("gen0")
    clock.now = RECLAIM_GRACE + 1  # grace over, deadline (30 s) not
    assert d.reserve("u1", 4, 2, "gen1") is None
    clock.now = WRITE_TIMEOUT + RECLAIM_GRACE + 0.1
    assert d.reserve("u1", 4, 2, "gen1") is not None


def test_surviving_blocks_of_a_pending_unit_wait_for_its_writer_when_a_node_dies(clock: Clock) -> None:
    """Regression: drop_node freed the pending unit's blocks on the other node after the grace
    while its writer could still write them until the deadline."""
    d = _directory(clock, capacity=1)
    grant = d.reserve("u0", 8, 2, "gen0")
    assert grant is not None and {b.node for b in grant.blocks} == set(NODES)
    d.drop_node("m0")
    clock.now = RECLAIM_GRACE + 1
    assert d.reserve("u1", 4, 1, "gen1") is None
    clock.now = WRITE_TIMEOUT + RECLAIM_GRACE + 0.1
    assert d.reserve("u1", 4, 1, "gen1") is not None
