"""The shared KV tier as admission sees it: the Directory plus the tier's admission policy.

Invariant: the policy's resident set mirrors the Directory's entries (PENDING and READY), so
every entry the directory drops on its own must be ``forget``-ed here. Victims are only
entries :meth:`Directory.can_evict` allows (READY and unleased).
"""

from __future__ import annotations

from collections.abc import Iterable

from tessera.control.admission import AdmissionPolicy
from tessera.control.directory import Directory
from tessera.messages.common import BlockRef
from tessera.messages.plan import WriteGrant


class SharedTier:
    """Shared-tier admission: ``observe``, ``admit`` (reserve with evictions), ``adopt``, ``forget``."""

    __slots__ = ("directory", "evictions", "policy")

    def __init__(self, directory: Directory, policy: AdmissionPolicy) -> None:
        self.directory = directory
        self.policy = policy
        self.evictions = 0

    def observe(self, unit_ids: tuple[str, ...]) -> None:
        self.policy.observe(unit_ids)

    def resident(self, unit_id: str) -> bool:
        """The shared tier has an entry (pending or ready) for the unit."""
        return self.policy.records.blocks_of(unit_id) > 0

    def admit(self, unit_id: str, n_tokens: int, n_blocks: int, writer: str) -> WriteGrant | None:
        """Reserve a PENDING entry for ``writer`` if the unit passes shared admission.

        Returns the grant, or None (already has an entry, not admitted, or no room).
        """
        directory = self.directory
        if unit_id in directory:
            return None
        policy = self.policy
        if policy.records.blocks_of(unit_id):  # the directory dropped it, nobody told us yet
            policy.discard(unit_id)
        allocator = directory.allocator
        if n_blocks > allocator.capacity:
            return None
        victims = policy.decide(unit_id, n_blocks, allocator.free_blocks, directory.can_evict)
        if victims is None:
            return None
        for v in victims:
            directory.evict(v)
            policy.discard(v)
        self.evictions += len(victims)
        grant = directory.reserve(unit_id, n_tokens, n_blocks, writer)
        if grant is not None:
            policy.add(unit_id, n_blocks)
        return grant

    def adopt(self, unit_id: str, epoch: int, blocks: tuple[BlockRef, ...], n_tokens: int) -> bool:
        """Recovery: a READY entry for blocks a memory node verified; False if a block is not free."""
        if not self.directory.adopt(unit_id, epoch, blocks, n_tokens):
            return False
        self.policy.add(unit_id, len(blocks))
        return True

    def forget(self, unit_ids: Iterable[str]) -> None:
        """The directory dropped these entries (cancelled, expired, memory node lost)."""
        for u in unit_ids:
            if u not in self.directory:
                self.policy.discard(u)

    def check_invariants(self) -> None:
        entries = {e.unit_id: len(e.blocks) for e in self.directory.entries()}
        assert entries == dict(self.policy.resident), "shared residents differ from directory entries"
        self.policy.check_invariants()
