"""A generation node's local unit cache: reusable unit states in host memory.

Capacity is counted in blocks of B tokens. The node admits and evicts only as the control
plane's plan authorizes (``insert`` with the plan's victims); it never picks victims itself.
A unit reported in a snapshot is pinned for that request so that it cannot disappear
between the snapshot and the copy; a pinned unit is never evicted.

Verbs: ``held/pin/unpin_request``, ``get``, ``insert``, ``evict``. Knows nothing about
transports or the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tessera.engines.base import UnitState
from tessera.units import blocks_for


@dataclass
class _Entry:
    state: UnitState
    blocks: int
    pins: int = 0


class LocalUnitCache:
    def __init__(self, capacity_blocks: int, block_tokens: int, pin_memory: bool | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        # pinned host memory makes host->GPU copies asynchronous; only meaningful with CUDA
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._entries: dict[str, _Entry] = {}
        self._pins: dict[str, list[str]] = {}  # request_id -> pinned unit ids
        self.used_blocks = 0

    def __contains__(self, unit_id: str) -> bool:
        return unit_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def unit_ids(self) -> list[str]:
        return list(self._entries)

    # --- snapshot and pins ---------------------------------------------------------------

    def held(self, request_id: str, unit_ids: Iterable[str]) -> list[str]:
        """Units of ``unit_ids`` present now; each is pinned for ``request_id``."""
        held = [u for u in dict.fromkeys(unit_ids) if u in self._entries]
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

    def get(self, unit_id: str) -> UnitState | None:
        entry = self._entries.get(unit_id)
        return None if entry is None else entry.state

    # --- admission and eviction (as authorized by the plan) ------------------------------

    def insert(self, unit_id: str, state: UnitState, evict: Sequence[str] = ()) -> tuple[bool, list[str]]:
        """Insert after evicting the authorized victims; returns (inserted, evicted ids).

        Declines (inserting nothing) when the unit is already present, or when the space the
        unpinned victims free is not enough; victims are then left in place.
        """
        if unit_id in self._entries:
            return False, []
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
        if self.pin_memory:
            state = UnitState(state.keys.pin_memory(), state.values.pin_memory())
        self._entries[unit_id] = _Entry(state, need)
        self.used_blocks += need
        assert self.used_blocks <= self.capacity_blocks, (self.used_blocks, self.capacity_blocks)
        return True, evicted

    def evict(self, unit_id: str) -> bool:
        entry = self._entries.get(unit_id)
        if entry is None or entry.pins:
            return False
        del self._entries[unit_id]
        self.used_blocks -= entry.blocks
        return True
