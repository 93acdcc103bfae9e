"""A generation node's local unit cache: reusable unit states in host memory.

Capacity is counted in blocks of B tokens. The node admits and evicts only as the control
plane's plan authorizes (``insert`` with the plan's victims); it never picks victims itself.
A unit reported in a snapshot is pinned for that request so that it cannot disappear
between the snapshot and the copy; a pinned unit is never evicted.

A revoked unit (deleted at the retrieval role) is dropped at once, or when its last pin
goes if a request that started before the revocation still uses it; it is not inserted
again while it is among the last ``REVOKED_MEMORY`` revoked ids (a request planned before the
revocation may still try to keep it).

Verbs: ``held/pin/unpin_request``, ``get``, ``insert``, ``evict``, ``revoke``. Knows nothing
about transports or the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tessera.engines.base import UnitState
from tessera.units import blocks_for

REVOKED_MEMORY = 1 << 16  # revoked ids remembered to refuse late inserts


@dataclass
class _Entry:
    state: UnitState
    blocks: int
    pins: int = 0


class LocalUnitCache:
    """Host-memory unit states (the retainer stages device states to pinned host memory first)."""

    def __init__(self, capacity_blocks: int, block_tokens: int, pin_memory: bool = False) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        # pin host states that arrive pageable (a CPU engine never needs it; a CUDA engine's
        # states arrive pinned from tessera.engines.device.to_host already)
        self.pin_memory = pin_memory
        self._entries: dict[str, _Entry] = {}
        self._pins: dict[str, list[str]] = {}  # request_id -> pinned unit ids
        self.used_blocks = 0
        self.used_bytes = 0  # host memory of the held states (RSS the cache accounts for, bounded by capacity)
        self._revoked: OrderedDict[str, None] = OrderedDict()  # newest last

    def __contains__(self, unit_id: str) -> bool:
        return unit_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def unit_ids(self) -> list[str]:
        return list(self._entries)

    def residency(self) -> list[tuple[str, int]]:
        """(unit, blocks) of every cached unit (a restarted control plane asks for it)."""
        return [(u, e.blocks) for u, e in self._entries.items()]

    # --- snapshot and pins ---------------------------------------------------------------

    def held(self, request_id: str, unit_ids: Iterable[str]) -> list[str]:
        """Units of ``unit_ids`` present now; each is pinned for ``request_id``."""
        held = [u for u in dict.fromkeys(unit_ids) if u in self._entries and u not in self._revoked]
        for u in held:
            self._entries[u].pins += 1
        if held:
            self._pins.setdefault(request_id, []).extend(held)
        return held

    def unpin_request(self, request_id: str) -> None:
        for u in self._pins.pop(request_id, []):
            entry = self._entries.get(u)
            if entry is not None:
                entry.pins -= 1
                assert entry.pins >= 0, (u, entry.pins)
                if entry.pins == 0 and u in self._revoked:
                    self.evict(u)

    def get(self, unit_id: str) -> UnitState | None:
        entry = self._entries.get(unit_id)
        return None if entry is None else entry.state

    def lookup(self, unit_id: str) -> UnitState | None:
        """A held, unrevoked unit's state, for a request whose plan did not expect it here.

        The caller keeps a reference to the tensors, so a later eviction cannot pull them away.
        """
        return None if unit_id in self._revoked else self.get(unit_id)

    # --- admission and eviction (as authorized by the plan) ------------------------------

    def insert(self, unit_id: str, state: UnitState, evict: Sequence[str] = ()) -> tuple[bool, list[str]]:
        """Insert after evicting the authorized victims; returns (inserted, evicted ids).

        Declines (inserting nothing) when the unit is already present, or when the space the
        unpinned victims free is not enough; victims are then left in place.
        """
        if unit_id in self._entries or unit_id in self._revoked:
            return False, []
        assert state.keys.device.type == "cpu" and state.values.device.type == "cpu", (
            f"the local cache holds host states; state.keys is on {state.keys.device}: stage it with "
            "tessera.engines.device.host_copy first")
        need = blocks_for(state.n_tokens, self.block_tokens)
        victims = [v for v in dict.fromkeys(evict)
                   if v in self._entries and self._entries[v].pins == 0 and v != unit_id]
        free_after = self.capacity_blocks - self.used_blocks + sum(self._entries[v].blocks for v in victims)
        if need > free_after:
            return False, []
        evicted: list[str] = []
        # evict only as much as needed, in the order the plan gave
        for v in victims:
            if self.capacity_blocks - self.used_blocks >= need:
                break
            self.evict(v)
            evicted.append(v)
        if self.pin_memory and not state.keys.is_pinned():
            state = UnitState(state.keys.pin_memory(), state.values.pin_memory())
        self._entries[unit_id] = _Entry(state, need)
        self.used_blocks += need
        self.used_bytes += state.nbytes()
        assert self.used_blocks <= self.capacity_blocks, (self.used_blocks, self.capacity_blocks)
        return True, evicted

    def revoke(self, unit_ids: Iterable[str]) -> int:
        """Drop these deleted units (pinned ones when unpinned); returns how many were dropped now."""
        dropped = 0
        for u in unit_ids:
            self._revoked[u] = None
            self._revoked.move_to_end(u)
            dropped += self.evict(u)
        while len(self._revoked) > REVOKED_MEMORY:
            self._revoked.popitem(last=False)
        return dropped

    def evict(self, unit_id: str) -> bool:
        entry = self._entries.get(unit_id)
        if entry is None or entry.pins:
            return False
        del self._entries[unit_id]
        self.used_blocks -= entry.blocks
        self.used_bytes -= entry.state.nbytes()
        return True
