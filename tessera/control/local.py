"""What the control plane believes one generation node's local unit cache holds.

The node is the authority on its own memory; this view is a policy signal for routing and
local admission, corrected by three sources of truth:

* the node's snapshot at plan time (units of the request it holds, which it pins),
* its :class:`~tessera.messages.ResidencyReport` (insertions it made, units it dropped or
  declined to insert),
* liveness: a node declared dead is assumed to come back empty.

A unit admitted by a plan is *planned* until the node confirms it. Planned units count
against capacity (the insertion is coming) but are never chosen as victims: the node may
not hold them yet, so dropping them would free nothing.

This module knows nothing about the shared tier or about routing.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from tessera.control.admission import AdmissionPolicy


class LocalTier:
    """One generation node's local cache as admission and routing see it."""

    __slots__ = ("bit", "capacity", "holders", "name", "planned", "policy")

    def __init__(self, name: str, capacity_blocks: int, policy: AdmissionPolicy, *,
                 bit: int = 1, holders: dict[str, int] | None = None) -> None:
        self.name = name
        self.capacity = capacity_blocks
        self.policy = policy
        self.planned: dict[str, str] = {}  # unit -> request whose plan admitted it (unconfirmed)
        # routing index shared by all nodes' views: unit -> bitmask of nodes holding it;
        # one lookup per unit ranks every node
        self.bit = bit
        self.holders: dict[str, int] = {} if holders is None else holders

    @property
    def used_blocks(self) -> int:
        return self.policy.used_blocks

    def holds(self, unit_id: str) -> bool:
        """Resident or planned: the node has the unit or will insert it."""
        return unit_id in self.policy.resident

    def blocks_held(self, units: Iterable[tuple[str, int]]) -> int:
        """Blocks of (unit, blocks) pairs this node holds or will hold: the routing signal."""
        resident = self.policy.resident
        total = 0
        for u, b in units:
            if u in resident:
                total += b
        return total

    def _add(self, unit_id: str, n_blocks: int) -> None:
        self.policy.add(unit_id, n_blocks)
        holders = self.holders
        holders[unit_id] = holders.get(unit_id, 0) | self.bit

    def _discard(self, unit_id: str) -> None:
        if self.policy.discard(unit_id):
            holders = self.holders
            mask = holders[unit_id] & ~self.bit
            if mask:
                holders[unit_id] = mask
            else:
                del holders[unit_id]

    def reconcile(self, units: Iterable[tuple[str, int]], held: Container[str], live: Container[str]) -> None:
        """Correct the view with the node's snapshot of a request's units.

        ``live``: requests still outstanding; a planned unit whose planning request is gone
        and that the node does not hold was never inserted (or the report is late: the
        report re-adds it).
        """
        resident = self.policy.resident
        planned = self.planned
        for u, b in units:
            if u in held:
                if u not in resident:
                    self._add(u, b)
                else:
                    planned.pop(u, None)
            elif u in resident:
                by = planned.get(u)
                if by is None or by not in live:
                    planned.pop(u, None)
                    self._discard(u)

    def admit(self, unit_id: str, n_blocks: int, request_id: str, pinned: Container[str]) -> list[str] | None:
        """Local admission for a unit the node will have after this request.

        Returns the victims the node must drop (removed from the view now), or None when the
        unit is not retained locally. ``pinned`` units (the request's own) are never victims.
        """
        policy = self.policy
        if unit_id in policy.resident or n_blocks > self.capacity or not policy.wants(unit_id):
            return None
        planned = self.planned

        def safe(v: str) -> bool:
            return v not in pinned and v not in planned

        victims = policy.victims(unit_id, n_blocks, self.capacity - policy.used_blocks, safe)
        if victims is None:
            return None
        for v in victims:
            self._discard(v)
        self._add(unit_id, n_blocks)
        planned[unit_id] = request_id
        return victims

    def confirm(self, unit_ids: Iterable[str], n_blocks: dict[str, int]) -> None:
        """The node inserted these units (ResidencyReport.inserted)."""
        for u in unit_ids:
            if u in self.policy.resident:
                self.planned.pop(u, None)
            elif u in n_blocks:
                # the view had lost it (late report after a snapshot correction): the node is right
                self._add(u, n_blocks[u])

    def drop(self, unit_ids: Iterable[str]) -> None:
        """The node evicted these units, or declined to insert them."""
        for u in unit_ids:
            self.planned.pop(u, None)
            self._discard(u)

    def clear(self) -> None:
        """The node is gone; if it comes back, it comes back empty."""
        for u in list(self.policy.resident):
            self._discard(u)
        self.planned.clear()

    def check_invariants(self) -> None:
        assert set(self.planned) <= set(self.policy.resident), "planned unit missing from the resident set"
        for u in self.policy.resident:
            assert self.holders.get(u, 0) & self.bit, f"routing index lost {u} on {self.name}"
        self.policy.check_invariants()
