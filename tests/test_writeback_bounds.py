"""Shared writeback on a generation node is bounded in tasks and bytes before any state is held."""

from __future__ import annotations

import asyncio

import torch
from helpers.executor import QuietControl

from tessera.engines.base import UnitState
from tessera.generation.retention import Retainer
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.plan import WriteGrant


class _BlockedWriter:
    """A KV pool writer whose stores wait until released."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.stored: list[str] = []

    async def store(self, grant: WriteGrant, state: UnitState, *, received_at: float | None = None) -> bool:
        await self.go.wait()
        self.stored.append(grant.unit_id)
        return True


def _state(n_tokens: int) -> UnitState:
    t = torch.zeros(1, n_tokens, 1, 4)  # 16 bytes per token for keys, 32 with values
    return UnitState(t, t.clone())


def _grant(unit: str) -> WriteGrant:
    return WriteGrant(unit, 1, (), "gen0", 8, 30.0)


async def test_writebacks_beyond_the_configured_tasks_and_bytes_are_given_back_at_once(
        quiet_control: QuietControl) -> None:
    """Regression: one task per grant with no limit, each holding its unit's state while it waited."""
    writer, control = _BlockedWriter(), quiet_control
    cache = LocalUnitCache(64, 4, pin_memory=False)
    retainer = Retainer(cache, writer, control, staging_bytes=3 * 256, outstanding=2)
    for i in range(20):
        retainer.retain(f"u{i}", _state(8), False, _grant(f"u{i}"), (), 0.0)  # 256 bytes each
    await asyncio.sleep(0)
    assert retainer.writing == 2 and retainer.staged == 512  # held states: within both bounds
    assert len(control.given_up) == 18  # their reservations are cancelled, not queued
    writer.go.set()
    await retainer.drain(5.0)
    assert sorted(writer.stored) == ["u0", "u1"] and retainer.writing == retainer.staged == 0
    retainer.retain("late", _state(8), False, _grant("late"), (), 0.0)  # the budget came back
    await retainer.drain(5.0)
    assert writer.stored[-1] == "late"


async def test_the_byte_budget_is_taken_before_the_state_is_held(quiet_control: QuietControl) -> None:
    """States are admitted to writeback while their bytes fit; one oversized state may go alone."""
    writer, control = _BlockedWriter(), quiet_control
    retainer = Retainer(LocalUnitCache(64, 4, pin_memory=False), writer, control, staging_bytes=300, outstanding=8)
    retainer.retain("big", _state(64), False, _grant("big"), (), 0.0)  # 2 KiB > budget: alone is fine
    retainer.retain("small", _state(8), False, _grant("small"), (), 0.0)
    await asyncio.sleep(0)
    assert retainer.writing == 1 and control.given_up == ["small"]
    writer.go.set()
    await retainer.drain(5.0)
