"""The serving node's side of an assist: a unit a peer computes is awaited on the shared tier.

Fake engine (CPU, no model). The request has two units to compute: ``u1`` a peer prefills
(``UnitPlan.peer``) and ``u2`` this node prefills. Checked: the peer's unit is fetched once
published and counted as computed (source "peer"); this node's own unit is prefilled apart
(not fused into the extend, which would wait for the peer); a peer that never publishes
costs the wait, then the unit is computed here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.engines import FusingFakeEngine
from helpers.executor import QuietControl

import tessera.generation.executor as executor_module
from tessera.composition.policies import policy_from_config
from tessera.config import CompositionConfig
from tessera.engines.base import UnitState
from tessera.generation.executor import Executor
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.common import BlockRef
from tessera.messages.generation import DoneEvent, ExecuteRequest, SamplingParams
from tessera.messages.plan import Preparation, ReadLease, RequestPlan, Retention, UnitPlan
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.wire import WIRE_VERSION

U1, U2 = (3, 4, 5, 6), (10, 11, 12, 13, 14)
LAYOUT = PromptLayout((Segment(SegmentKind.TEXT, (1, 2)), Segment(SegmentKind.UNIT, U1, "u1"),
                       Segment(SegmentKind.UNIT, U2, "u2"), Segment(SegmentKind.TEXT, (7, 8))))
LEASE = ReadLease("lease-u1", "u1", 1, (BlockRef("kv0", 0),), 30.0)


class PeerReader:
    """The shared tier as the serving node sees it: ``u1`` turns READY after ``polls`` asks (never: -1)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.asked = 0
        self.fetched: list[str] = []

    async def late_lease(self, unit_id: str) -> ReadLease | None:
        assert unit_id == "u1"
        self.asked += 1
        return dataclasses.replace(LEASE) if 0 <= self.polls < self.asked else None

    async def fetch(self, lease: ReadLease, n_tokens: int, *, release: bool = True,
                    received_at: float | None = None) -> UnitState:
        self.fetched.append(lease.unit_id)
        t = torch.zeros(1, n_tokens, 1, 2)
        return UnitState(t, t.clone())


TWO_UNITS = (UnitPlan("u1", len(U1), Preparation.COMPUTE, Retention.NEITHER, peer="gen1"),
             UnitPlan("u2", len(U2), Preparation.COMPUTE, Retention.NEITHER))


async def run(engine: FusingFakeEngine, reader: PeerReader, layout: PromptLayout = LAYOUT,
              units: tuple[UnitPlan, ...] = TWO_UNITS, max_batch_prompts: int = 0) -> tuple[DoneEvent, list[str]]:
    released: list[str] = []
    scheduler = Scheduler(engine, max_batch_tokens=64, max_batch_prompts=max_batch_prompts)
    cache = LocalUnitCache(capacity_blocks=16, block_tokens=4, pin_memory=False)
    retainer = Retainer(cache, None, QuietControl(), staging_bytes=1 << 20, outstanding=2)
    policy = policy_from_config(CompositionConfig(policy="epic", recompute_tokens=1, unit_lead=""))
    executor = Executor(scheduler, PrefillCoalescer(scheduler), cache, retainer, reader, released.append, policy,
                        "compose")
    req = ExecuteRequest(WIRE_VERSION, "req-1", layout, RequestPlan(WIRE_VERSION, "req-1", "gen0", units),
                         SamplingParams(max_tokens=2))
    scheduler.start()
    try:
        events = [e async for e in executor.run(req)]
    finally:
        await retainer.drain(timeout=1.0)
        await scheduler.stop()
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done, released


async def test_the_peers_unit_is_fetched_once_published_and_the_own_unit_is_prefilled_apart() -> None:
    engine = FusingFakeEngine()
    reader = PeerReader(polls=3)
    done, released = await run(engine, reader)
    s = done.stats
    assert s.unit_sources == {"u1": "peer", "u2": "computed"}
    # both count as computed for this request: one forward pass each, one of them on the peer
    assert (s.computed_units, s.computed_unit_tokens, s.remote_units, s.fallbacks) == (2, len(U1) + len(U2), 0, 0)
    assert reader.asked == 4 and reader.fetched == ["u1"] and released == ["lease-u1"]
    # u2 was prefilled alone (its own step), not inside the extend: it ran while the peer worked
    assert [len(U2)] in engine.batches


async def test_a_peer_that_never_publishes_costs_its_wait_then_the_unit_is_computed_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_module, "PEER_UNMEASURED_S", 0.2)
    engine = FusingFakeEngine()
    reader = PeerReader(polls=-1)
    done, released = await run(engine, reader)
    s = done.stats
    assert s.unit_sources == {"u1": "computed", "u2": "computed"}
    assert (s.computed_units, s.fallbacks) == (2, 0)
    assert reader.asked >= 2 and reader.fetched == [] and released == []
    assert [len(U1)] in engine.batches  # prefilled here after the wait


async def test_the_own_units_of_an_assisted_request_are_prefilled_in_one_forward() -> None:
    """With one prompt a batch (the CPU default), the request's own units still share a step:
    each forward has a fixed cost, and the extend waits for both anyway."""
    u3 = (20, 21, 22)
    layout = PromptLayout((*LAYOUT.segments[:3], Segment(SegmentKind.UNIT, u3, "u3"), LAYOUT.segments[3]))
    engine = FusingFakeEngine()
    units = (*TWO_UNITS, UnitPlan("u3", len(u3), Preparation.COMPUTE, Retention.NEITHER))
    done, _ = await run(engine, PeerReader(polls=2), layout, units, max_batch_prompts=1)
    assert done.stats.unit_sources == {"u1": "peer", "u2": "computed", "u3": "computed"}
    assert [len(U2), len(u3)] in engine.batches
