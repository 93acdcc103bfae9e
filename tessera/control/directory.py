"""Directory of the shared KV tier: entries, storage epochs, leases, safe reclamation (§5.4).

An entry is PENDING from reservation until its writer publishes, then READY. Rules:

* A PENDING entry is never a hit: only READY entries are leased.
* Only the authorized writer may publish, under the current epoch, with exactly the
  reserved blocks, before the deadline; anything else raises :class:`PublishRejected`.
* Blocks under an active lease are never reclaimed.
* Blocks of a dropped reservation are quarantined until max(now, deadline) + ``reclaim_grace_s``
  (longer than a transfer timeout), so a stale writer's write cannot land in a block handed
  to someone else.
* A corrupt entry (:meth:`invalidate`) is never leased again; its blocks are quarantined until
  its leases expire (+ grace), so no reader still copying sees them reused.
* A revoked unit's entry takes no new lease; a READY one goes once its leases drain, a
  PENDING one at once (so its publish is refused).
* A memory node that dies or restarts empty takes its entries with it; when it (re)joins,
  its slots stay fenced until no write granted to its lost incarnation can land.

The directory decides nothing about *which* units deserve space (that is admission) and
never touches payload bytes.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.auth import CapabilityIssuer
from tessera.control.allocator import BlockAllocator
from tessera.errors import PublishRejected
from tessera.messages.common import BlockRef
from tessera.messages.plan import ReadLease, WriteGrant
from tessera.transport.terms import term_of


class EntryState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass(slots=True)
class Lease:
    lease_id: str
    unit_id: str
    epoch: int
    holder: str
    expires_at: float


@dataclass(slots=True)
class Entry:
    unit_id: str
    epoch: int
    state: EntryState
    blocks: tuple[BlockRef, ...]
    n_tokens: int
    writer: str
    deadline: float  # PENDING only: publish must happen before this clock time
    leases: dict[str, Lease] = field(default_factory=dict)
    revoked: bool = False  # READY, its unit was deleted: no new leases, dropped once the last drains


class Directory:
    """Shared-tier metadata. Verbs: reserve/renew/publish/cancel, lease/release, evict, expire."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        lease_ttl_s: float = 30.0,
        write_timeout_s: float = 30.0,
        reclaim_grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        capabilities: CapabilityIssuer | None = None,
    ) -> None:
        self.allocator = allocator
        # signs the tokens memory nodes demand for every read and write (None: no cluster secret)
        self.capabilities = capabilities
        self.lease_ttl_s = lease_ttl_s
        self.write_timeout_s = write_timeout_s
        self.reclaim_grace_s = reclaim_grace_s
        self.clock = clock
        self._entries: dict[str, Entry] = {}
        self._leases: dict[str, Lease] = {}
        self._epochs = itertools.count(1)
        self.term = 0  # the incarnation (leader term) every epoch from begin_epochs carries
        self._lease_ids = itertools.count(1)
        # (free_at, seq, blocks): blocks that may still receive a stale write
        self._quarantine: list[tuple[float, int, tuple[BlockRef, ...]]] = []
        # memory node -> until when writes under grants of its lost incarnation may land
        self._fences: dict[str, float] = {}
        self._fence_seqs: dict[str, int] = {}  # memory node -> the quarantine item of its restart fence
        self._term_fenced: set[str] = set()  # fences guarding only earlier terms' grants (liftable by term)
        self._fenced_until: dict[str, float] = {}  # the same, kept after the node joined (recovery waits)
        self._qseq = itertools.count()

    # --- queries -------------------------------------------------------------------------

    def get(self, unit_id: str) -> Entry | None:
        return self._entries.get(unit_id)

    def ready(self, unit_id: str) -> Entry | None:
        entry = self._entries.get(unit_id)
        return entry if entry is not None and entry.state is EntryState.READY else None

    def __contains__(self, unit_id: str) -> bool:
        return unit_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(blocks) for _, _, blocks in self._quarantine)

    def can_evict(self, unit_id: str) -> bool:
        entry = self._entries.get(unit_id)
        return entry is not None and entry.state is EntryState.READY and not entry.leases

    # --- writer side ---------------------------------------------------------------------

    def reserve(self, unit_id: str, n_tokens: int, n_blocks: int, writer: str) -> WriteGrant | None:
        """Create a PENDING entry with a new epoch; None if the unit has an entry or space is short."""
        assert n_blocks > 0, n_blocks
        if unit_id in self._entries:
            return None
        self._reclaim_due(self.clock())
        blocks = self.allocator.allocate(n_blocks)
        if blocks is None:
            return None
        epoch = next(self._epochs)
        deadline = self.clock() + self.write_timeout_s
        entry = self._entries[unit_id] = Entry(unit_id, epoch, EntryState.PENDING, blocks, n_tokens, writer,
                                               deadline)
        return self._grant(entry)

    def renew(self, unit_id: str, epoch: int, writer: str) -> WriteGrant | None:
        """The writer's PENDING reservation, deadline moved to a full write timeout from now.

        Same epoch and blocks, fresh capabilities. None unless the entry is this writer's,
        at this epoch, still PENDING and not overdue. A dropped reservation's quarantine is
        computed from its deadline when dropped, so a later deadline delays reuse with it.
        """
        entry = self._entries.get(unit_id)
        now = self.clock()
        if (entry is None or entry.epoch != epoch or entry.writer != writer
                or entry.state is not EntryState.PENDING or now > entry.deadline):
            return None
        entry.deadline = now + self.write_timeout_s
        return self._grant(entry)

    def _grant(self, entry: Entry) -> WriteGrant:
        # writes may start until the deadline and land within a transfer timeout (< reclaim grace)
        tokens = () if self.capabilities is None else self.capabilities.issue(
            "write", entry.blocks, entry.epoch, self.write_timeout_s + self.reclaim_grace_s, holder=entry.writer)
        return WriteGrant(entry.unit_id, entry.epoch, entry.blocks, entry.writer, entry.n_tokens,
                          self.write_timeout_s, tokens)

    def publish(self, unit_id: str, epoch: int, writer: str, blocks: tuple[BlockRef, ...]) -> None:
        """Flip PENDING -> READY atomically after verifying writer, epoch and the full block set."""
        entry = self._entries.get(unit_id)
        if entry is None:
            raise PublishRejected(f"unit {unit_id}: no reservation (expired, cancelled or never made)")
        if entry.epoch != epoch:
            raise PublishRejected(f"unit {unit_id}: stale epoch {epoch}, current epoch is {entry.epoch}")
        if entry.state is not EntryState.PENDING:
            raise PublishRejected(f"unit {unit_id}: epoch {epoch} is already published")
        if entry.writer != writer:
            raise PublishRejected(f"unit {unit_id}: {writer!r} is not the authorized writer ({entry.writer!r})")
        if tuple(blocks) != entry.blocks:
            missing = len(set(entry.blocks) - set(blocks))
            extra = len(set(blocks) - set(entry.blocks))
            raise PublishRejected(
                f"unit {unit_id}: block set differs from the reservation "
                f"({len(blocks)} given, {len(entry.blocks)} reserved, {missing} missing, {extra} foreign)"
            )
        now = self.clock()
        if now > entry.deadline:
            self._drop_pending(entry, now)
            raise PublishRejected(f"unit {unit_id}: reservation of epoch {epoch} expired before publish")
        entry.state = EntryState.READY
        entry.deadline = float("inf")

    def cancel(self, unit_id: str, epoch: int, writer: str, settle_s: float = 0.0) -> bool:
        """The writer abandons its reservation. Blocks return after ``settle_s`` (in-flight writes)."""
        entry = self._entries.get(unit_id)
        if entry is None or entry.epoch != epoch or entry.writer != writer or entry.state is not EntryState.PENDING:
            return False
        del self._entries[unit_id]
        self._quarantine_blocks(entry.blocks, self.clock() + max(0.0, settle_s))
        return True

    # --- reader side ---------------------------------------------------------------------

    def lease(self, unit_id: str, holder: str) -> ReadLease | None:
        """Read lease on the current epoch of a READY entry; None for pending or absent units."""
        entry = self._entries.get(unit_id)
        if entry is None or entry.state is not EntryState.READY or entry.revoked:
            return None
        lease = Lease(f"L{next(self._lease_ids)}", unit_id, entry.epoch, holder, self.clock() + self.lease_ttl_s)
        entry.leases[lease.lease_id] = lease
        self._leases[lease.lease_id] = lease
        tokens = () if self.capabilities is None else self.capabilities.issue(
            "read", entry.blocks, entry.epoch, self.lease_ttl_s, holder=holder)
        return ReadLease(lease.lease_id, unit_id, entry.epoch, entry.blocks, self.lease_ttl_s, tokens)

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        entry = self._entries.get(lease.unit_id)
        if entry is not None and entry.epoch == lease.epoch:
            entry.leases.pop(lease_id, None)
            if entry.revoked and not entry.leases:
                self.evict(entry.unit_id)
        return True

    def revoke(self, unit_id: str) -> bool:
        """The unit was deleted: drop its entry now, or once its leases drain. True if dropped now."""
        entry = self._entries.get(unit_id)
        if entry is None:
            return False
        if entry.state is EntryState.PENDING:
            self._drop_pending(entry, self.clock())  # publish finds no reservation
            return True
        if entry.leases:
            entry.revoked = True
            return False
        self.evict(unit_id)
        return True

    def invalidate(self, unit_id: str, epoch: int) -> bool:
        """A reader found the entry corrupt: drop it now, its blocks after its leases drain.

        False if the unit has no READY entry at ``epoch`` (already dropped or rewritten).
        """
        entry = self._entries.get(unit_id)
        if entry is None or entry.state is not EntryState.READY or entry.epoch != epoch:
            return False
        del self._entries[unit_id]
        now = self.clock()
        drained = max((lease.expires_at for lease in entry.leases.values()), default=now)
        for lease_id in entry.leases:
            self._leases.pop(lease_id, None)
        self._quarantine_blocks(entry.blocks, max(now, drained) + self.reclaim_grace_s)
        return True

    # --- reclamation ---------------------------------------------------------------------

    def evict(self, unit_id: str) -> tuple[BlockRef, ...]:
        """Remove a READY, unleased entry and free its blocks at once."""
        entry = self._entries.get(unit_id)
        assert entry is not None and entry.state is EntryState.READY and not entry.leases, (
            f"evict({unit_id}) on an entry that is not safe to reclaim: "
            f"{None if entry is None else (entry.state, len(entry.leases))}"
        )
        del self._entries[unit_id]
        self.allocator.free(entry.blocks)
        return entry.blocks

    def expire(self) -> list[str]:
        """Drop expired leases and overdue reservations, free quarantined blocks that are due.

        Returns the units whose reservation was dropped (their entries are gone).
        """
        now = self.clock()
        for lease_id, lease in list(self._leases.items()):
            if lease.expires_at <= now:
                self.release(lease_id)
        dropped = []
        for entry in list(self._entries.values()):
            if entry.state is EntryState.PENDING and entry.deadline < now:
                self._drop_pending(entry, now)
                dropped.append(entry.unit_id)
        self._reclaim_due(now)
        return dropped

    def forget_holder(self, holder: str) -> list[str]:
        """A generation node died: release its leases, cancel its reservations (with grace).

        Returns the units whose reservation was dropped.
        """
        now = self.clock()
        for lease_id, lease in list(self._leases.items()):
            if lease.holder == holder:
                self.release(lease_id)
        dropped = []
        for entry in list(self._entries.values()):
            if entry.state is EntryState.PENDING and entry.writer == holder:
                self._drop_pending(entry, now)
                dropped.append(entry.unit_id)
        return dropped

    def begin_epochs(self, base: int) -> None:
        """Epochs from now on are > ``base`` (a new incarnation never repeats an old epoch)."""
        assert not self._entries, "begin_epochs before any reservation"
        self._epochs = itertools.count(base + 1)
        self.term = term_of(base)

    def fence(self, node: str, until: float) -> None:
        """No slot of ``node`` is handed out before ``until``: a write an earlier incarnation granted may land.

        Only such fences may end early by term (:meth:`lift_fence`).
        """
        self._term_fenced.add(node)
        self._fences[node] = max(until, self._fences.get(node, until))
        self._fenced_until[node] = self._fences[node]

    def fenced_for(self, node: str) -> float:
        """Seconds until the node's fence ends (0: none); its slots are quarantined until then."""
        return max(0.0, self._fenced_until.get(node, 0.0) - self.clock())

    def adopt(self, unit_id: str, epoch: int, blocks: tuple[BlockRef, ...], n_tokens: int) -> bool:
        """Recovery: a READY entry for blocks a memory node verified; False if a block is not free.

        Only called once the node's fence ended, so no write of an earlier incarnation can
        still land in these blocks; a free block is one no current grant or lease covers.
        """
        if unit_id in self._entries:
            return False
        self._reclaim_due(self.clock())
        if not self.allocator.claim(blocks):
            return False
        self._entries[unit_id] = Entry(unit_id, epoch, EntryState.READY, blocks, n_tokens, "", float("inf"))
        return True

    def add_node(self, node: str, capacity: int) -> None:
        """A memory node joins (or comes back empty); fenced slots return when writes are done."""
        self.allocator.add_node(node, capacity)
        until = self._fences.pop(node, None)
        now = self.clock()
        if until is not None and until > now:
            blocks = self.allocator.take_all(node)
            if blocks:
                self._fence_seqs[node] = next(self._qseq)
                heapq.heappush(self._quarantine, (until, self._fence_seqs[node], blocks))

    def lift_fence(self, node: str) -> int | None:
        """End ``node``'s restart fence now; the number of blocks it gives back (None: no such fence).

        Only for a node that refuses every earlier term and has none in progress. Blocks
        quarantined for this term's own writes stay: the term rule cannot cover those.
        """
        if node not in self._term_fenced:
            return None
        self._term_fenced.discard(node)
        now = self.clock()
        self._fences.pop(node, None)
        if self._fenced_until.get(node, 0.0) > now:
            self._fenced_until[node] = now
        seq = self._fence_seqs.pop(node, None)
        released = 0
        if seq is not None:
            kept = []
            for t, s, blocks in self._quarantine:
                if s == seq:
                    self.allocator.free(blocks)
                    released = len(blocks)
                else:
                    kept.append((t, s, blocks))
            self._quarantine = kept
            heapq.heapify(self._quarantine)
        return released

    def drop_node(self, node: str) -> list[str]:
        """A memory node died or restarted empty: every entry with a block there is gone."""
        dropped: list[str] = []
        now = self.clock()
        fence = now
        for entry in list(self._entries.values()):
            if any(b.node == node for b in entry.blocks):
                del self._entries[entry.unit_id]
                for lease_id in entry.leases:
                    self._leases.pop(lease_id, None)
                # blocks on surviving nodes go back (after grace if a write may be in flight)
                survivors = tuple(b for b in entry.blocks if b.node != node)
                if entry.state is EntryState.PENDING:
                    fence = max(fence, self._stale_writes_done(entry, now))
                    self._quarantine_blocks(survivors, self._stale_writes_done(entry, now))
                elif entry.leases:
                    # a reader may still be copying from the surviving blocks
                    self._quarantine_blocks(survivors, now + self.lease_ttl_s)
                else:
                    self.allocator.free(survivors)
                dropped.append(entry.unit_id)
        kept = []
        for t, s, blocks in self._quarantine:
            if any(b.node == node for b in blocks):
                fence = max(fence, t)  # a stale write may still land there until t
            kept.append((t, s, tuple(b for b in blocks if b.node != node)))
        self._quarantine = kept
        heapq.heapify(self._quarantine)
        self._fence_seqs.pop(node, None)
        if fence > now:
            self._term_fenced.discard(node)  # this term's own writes may land: only time ends it
            self._fences[node] = max(fence, self._fences.get(node, fence))
            self._fenced_until[node] = self._fences[node]
        self.allocator.remove_node(node)
        return dropped

    # --- internals -----------------------------------------------------------------------

    def _drop_pending(self, entry: Entry, now: float) -> None:
        del self._entries[entry.unit_id]
        self._quarantine_blocks(entry.blocks, self._stale_writes_done(entry, now))

    def _stale_writes_done(self, entry: Entry, now: float) -> float:
        """When no write of a dropped reservation can land anymore: its writer may not know and
        start writes until the deadline, each landing within a transfer timeout (< grace)."""
        return max(now, entry.deadline) + self.reclaim_grace_s

    def _quarantine_blocks(self, blocks: tuple[BlockRef, ...], free_at: float) -> None:
        if blocks:
            heapq.heappush(self._quarantine, (free_at, next(self._qseq), blocks))

    def _reclaim_due(self, now: float) -> None:
        while self._quarantine and self._quarantine[0][0] <= now:
            _, _, blocks = heapq.heappop(self._quarantine)
            self.allocator.free(blocks)

    def check_invariants(self) -> None:
        """Assert the directory's structural invariants (used by the property tests)."""
        self.allocator.check_invariants()
        owned: set[BlockRef] = set()
        for entry in self._entries.values():
            assert len(set(entry.blocks)) == len(entry.blocks), f"{entry.unit_id} holds a block twice"
            assert not (owned & set(entry.blocks)), f"{entry.unit_id} shares blocks with another entry"
            owned.update(entry.blocks)
            if entry.state is EntryState.PENDING:
                assert not entry.leases, f"pending {entry.unit_id} has leases"
            for lease in entry.leases.values():
                assert lease.epoch == entry.epoch and self._leases.get(lease.lease_id) is lease
        quarantined = {b for _, _, blocks in self._quarantine for b in blocks}
        assert not (owned & quarantined), "a block is both owned and quarantined"
        for lease in self._leases.values():
            holder_entry = self._entries.get(lease.unit_id)
            assert holder_entry is not None and lease.lease_id in holder_entry.leases, \
                f"dangling lease {lease.lease_id}"
