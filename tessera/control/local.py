"""What the control plane believes one generation node's local unit cache holds.

The node is the authority on its own memory; this view, the node's cache *after* the plans
issued so far, is a policy signal for routing and local admission. The node's snapshots,
its :class:`~tessera.messages.control.ResidencyReport` (inserted, evicted, kept) and liveness (a dead
node comes back empty) correct it.

So that corrections are not misread: *planned* units (admitted, not yet inserted) count
against capacity and are never victims; *evicting* units (given up by a plan, drop not yet
reported) are not resident again because a snapshot still shows them.

This module knows nothing about the shared tier or routing policies.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping

from tessera.control.admission import AdmissionPolicy
from tessera.control.locality import Locality


class LocalTier:
    """One generation node's local cache as admission and routing see it."""

    __slots__ = ("bit", "capacity", "evicting", "locality", "name", "planned", "policy", "victim_blocks")

    def __init__(self, name: str, capacity_blocks: int, policy: AdmissionPolicy, *,
                 bit: int = 1, locality: Locality | None = None) -> None:
        self.name = name
        self.capacity = capacity_blocks
        self.policy = policy
        self.planned: dict[str, str] = {}  # unit -> request whose plan admitted it (uninserted)
        self.evicting: dict[str, int] = {}  # unit -> evictions asked of the node, not yet reported
        self.victim_blocks: dict[str, int] = {}  # blocks of each evicting unit: a kept victim comes back
        self.bit = bit  # this view's bit in the routing index shared by every view
        self.locality = Locality(1) if locality is None else locality

    @property
    def used_blocks(self) -> int:
        return self.policy.used_blocks

    def holds(self, unit_id: str) -> bool:
        """Resident or planned: the node has the unit or will insert it."""
        return unit_id in self.policy

    # --- decisions -----------------------------------------------------------------------

    def observe(self, unit_ids: tuple[str, ...]) -> None:
        """One request routed to this node (distinct ids), before any admission for it."""
        self.policy.observe(unit_ids)

    def admit(self, unit_id: str, n_blocks: int, request_id: str, pinned: Container[str]) -> list[str] | None:
        """Local admission for a unit the node will have after this request.

        Returns the victims the node must drop (gone from the view now), or None when the
        unit is not retained locally. ``pinned`` units (the request's own) are never victims.
        """
        policy = self.policy
        table = policy.records
        i = table.slots.get(unit_id)
        if (i is not None and table.blocks[i]) or n_blocks > self.capacity:
            return None  # resident already (or planned by another request), or never fits
        planned = self.planned

        def safe(v: str) -> bool:
            return v not in pinned and v not in planned

        victims = policy.decide(unit_id, n_blocks, self.capacity - policy.used_blocks, safe)
        if victims is None:
            return None
        evicting = self.evicting
        slots, blocks = table.slots, table.blocks
        for v in victims:
            self.victim_blocks[v] = blocks[slots[v]]
            self._discard(v)
            evicting[v] = evicting.get(v, 0) + 1
        self._add(unit_id, n_blocks)
        planned[unit_id] = request_id
        return victims

    # --- corrections ---------------------------------------------------------------------

    def reconcile(self, units: Iterable[tuple[str, int]], held: Container[str], live: Container[str]) -> None:
        """Correct the view with the node's snapshot of a request's units.

        ``live``: requests still outstanding. A planned unit that the node does not hold and
        whose planning request is gone was never inserted (a late report re-adds it).
        """
        table = self.policy.records
        slots, blocks = table.slots, table.blocks
        planned = self.planned
        for u, b in units:
            i = slots.get(u)
            resident = i is not None and blocks[i] > 0
            if u in held:
                if resident:
                    planned.pop(u, None)
                elif u not in self.evicting:
                    self._add(u, b)  # the node has it and nobody asked it to drop it
            elif resident:
                by = planned.get(u)
                if by is None or by not in live:
                    planned.pop(u, None)
                    self._discard(u)

    def confirm(self, unit_ids: Iterable[str], n_blocks: Mapping[str, int]) -> None:
        """The node inserted these units (ResidencyReport.inserted)."""
        policy = self.policy
        for u in unit_ids:
            if u in policy:
                self.planned.pop(u, None)
            elif u in n_blocks:
                self._add(u, n_blocks[u])  # the view had dropped it too early: the node is right

    def drop(self, unit_ids: Iterable[str]) -> None:
        """The node evicted these units, or declined to insert them (ResidencyReport.evicted)."""
        for u in unit_ids:
            if self._settle(u):
                continue  # the node carried out an eviction a plan asked for; the view already had it
            self.planned.pop(u, None)
            self._discard(u)

    def keep(self, unit_ids: Iterable[str]) -> None:
        """The node was allowed to evict these units but kept them (ResidencyReport.kept).

        The node evicts only as many victims as the insertion needs; unless the view takes
        the kept ones back, it believes in free space the node does not have.
        """
        for u in unit_ids:
            blocks = self.victim_blocks.get(u, 0)
            if self._settle(u) and u not in self.policy and blocks:
                self._add(u, blocks)

    def _settle(self, unit_id: str) -> bool:
        """One outstanding eviction of ``unit_id`` was answered; False if none was outstanding."""
        pending = self.evicting.get(unit_id)
        if not pending:
            return False
        if pending == 1:
            del self.evicting[unit_id]
            if unit_id not in self.evicting:
                self.victim_blocks.pop(unit_id, None)
        else:
            self.evicting[unit_id] = pending - 1
        return True

    def abandon(self, request_ids: Container[str]) -> None:
        """These requests expired without completing: units only their plans admitted never came."""
        for u, by in list(self.planned.items()):
            if by in request_ids:
                del self.planned[u]
                self._discard(u)

    def revoke(self, unit_ids: Iterable[str]) -> None:
        """These units were deleted: the node is told to drop them; the view forgets them now."""
        for u in unit_ids:
            self.planned.pop(u, None)
            self.evicting.pop(u, None)
            self._discard(u)

    def clear(self) -> None:
        """The node is gone; if it comes back, it comes back empty."""
        for u in list(self.policy.resident):
            self._discard(u)
        self.planned.clear()
        self.evicting.clear()
        self.victim_blocks.clear()

    # --- internals -----------------------------------------------------------------------

    def _add(self, unit_id: str, n_blocks: int) -> None:
        self.policy.add(unit_id, n_blocks)
        self.locality.add(unit_id, self.bit)

    def _discard(self, unit_id: str) -> None:
        if self.policy.discard(unit_id):
            self.locality.discard(unit_id, self.bit)

    def check_invariants(self) -> None:
        resident = self.policy.resident
        assert set(self.planned) <= set(resident), "planned unit missing from the resident set"
        for u in resident:
            assert self.locality.holds(u, self.bit), f"routing index lost {u} on {self.name}"
        assert all(n > 0 for n in self.evicting.values()), self.evicting
        assert set(self.victim_blocks) <= set(self.evicting), "victim blocks kept for a settled eviction"
        self.policy.check_invariants()


class AdmittedBlocks(Mapping[str, int]):
    """Block counts of the units local admission retained, on any node (one table for all views).

    A late ResidencyReport may confirm a unit its view already dropped; the view re-adds it
    with this count. Verbs: ``admitted``, ``reported`` (a resync; an admission's count wins),
    ``forget`` (revoked units).
    """

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: dict[str, int] = {}

    def admitted(self, unit_id: str, n_blocks: int) -> None:
        self._blocks[unit_id] = n_blocks

    def reported(self, counts: Iterable[tuple[str, int]]) -> None:
        for u, b in counts:
            self._blocks.setdefault(u, b)

    def forget(self, unit_ids: Iterable[str]) -> None:
        for u in unit_ids:
            self._blocks.pop(u, None)

    def __getitem__(self, unit_id: str) -> int:
        return self._blocks[unit_id]

    def __contains__(self, unit_id: object) -> bool:
        return unit_id in self._blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)
