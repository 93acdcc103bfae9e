"""The simulator's node decides what the generation executor decides: same plan, same choices.

``tessera_lab/simulate/node.py`` re-implements the executor's preparation steps on a simulated
engine. Each case here runs one plan through the real :class:`Executor` (a fake engine, no
model) and through :class:`SimNode`, both starting from the same local cache, and compares
what they decided: where each unit's state came from and how many tokens were recomputed
(the request's stats), what the local cache holds afterwards, and which read leases went
back. A change to either side that the other lacks fails here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers.engines import FakeEngine, FusingFakeEngine
from helpers.executor import QuietControl

from tessera.composition.policies import policy_from_config
from tessera.config import CompositionConfig, GenerationNodeConfig, TransportConfig
from tessera.engines.base import UnitState
from tessera.generation.executor import Executor
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages.common import BlockRef
from tessera.messages.generation import DoneEvent, ExecuteRequest, RequestStats, SamplingParams
from tessera.messages.plan import Preparation, ReadLease, RequestPlan, Retention, UnitPlan, WriteGrant
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
from tessera.wire import WIRE_VERSION
from tessera_lab.simulate.costs import CostModel
from tessera_lab.simulate.events import EventLoop
from tessera_lab.simulate.node import Execution, SimNode

UNITS = {"u1": (3, 4, 5, 6), "u2": (11, 12, 13)}
LAYOUT = PromptLayout((Segment(SegmentKind.TEXT, (1, 2)), Segment(SegmentKind.UNIT, UNITS["u1"], "u1"),
                       Segment(SegmentKind.TEXT, (10,)), Segment(SegmentKind.UNIT, UNITS["u2"], "u2"),
                       Segment(SegmentKind.TEXT, (7, 8))))
BLOCK_TOKENS, CAPACITY_BLOCKS, MAX_TOKENS = 4, 16, 3
COSTS = CostModel("test", "hand-written for the tests", base_s=0.02, per_token_s=0.002, per_attn_s=0.0005,
                  per_decode_s=0.001, place_per_token_s=1e-5, kv_bytes_per_token=64, link_latency_s=5e-4,
                  link_bytes_per_s=2e9, request_overhead_s=0.01)
# the decisions: where the states came from and what was recomputed (not bytes or timings)
DECIDED = ("prompt_tokens", "completion_tokens", "prefix_cached_tokens", "recomputed_tokens", "local_units",
           "local_tokens", "remote_units", "remote_tokens", "computed_units", "computed_unit_tokens",
           "coalesced_units", "coalesced_unit_tokens")


@dataclasses.dataclass(frozen=True)
class Case:
    """A plan (unit -> preparation, retention) and the units already in the local cache."""

    plan: dict[str, tuple[Preparation, Retention]]
    cached: tuple[str, ...] = ()
    mode: str = "compose"


CASES = {
    "a local hit and a miss": Case({"u1": (Preparation.LOCAL, Retention.NEITHER),
                                    "u2": (Preparation.COMPUTE, Retention.NEITHER)}, cached=("u1",)),
    "two fetches, one kept locally": Case({"u1": (Preparation.REMOTE, Retention.LOCAL),
                                           "u2": (Preparation.REMOTE, Retention.NEITHER)}),
    "misses kept locally": Case({"u1": (Preparation.COMPUTE, Retention.LOCAL),
                                 "u2": (Preparation.COMPUTE, Retention.BOTH)}),
    "a planned miss found local, a planned hit gone": Case({"u1": (Preparation.COMPUTE, Retention.NEITHER),
                                                            "u2": (Preparation.LOCAL, Retention.LOCAL)},
                                                           cached=("u1",)),
    "a fetch kept locally beside a local hit": Case({"u1": (Preparation.LOCAL, Retention.LOCAL),
                                                     "u2": (Preparation.REMOTE, Retention.BOTH)}, cached=("u1",)),
    "exact prefix mode": Case({"u1": (Preparation.LOCAL, Retention.LOCAL),
                               "u2": (Preparation.COMPUTE, Retention.LOCAL)}, cached=("u1",), mode="prefix"),
    "no units planned": Case({}),
}


def _policy() -> Any:
    return policy_from_config(CompositionConfig(policy="epic", recompute_tokens=1, unit_lead=""))


def _request(case: Case) -> ExecuteRequest:
    units = []
    for uid, (prep, retention) in case.plan.items():
        lease = ReadLease(f"lease-{uid}", uid, 1, (BlockRef("kv0", 0),), 30.0) if prep is Preparation.REMOTE else None
        grant = WriteGrant(uid, 1, (BlockRef("kv0", 1),), "gen0", len(UNITS[uid]), 30.0) if retention.shared else None
        units.append(UnitPlan(uid, len(UNITS[uid]), prep, retention, lease=lease, grant=grant))
    plan = RequestPlan(WIRE_VERSION, "req-1", "gen0", tuple(units))
    return ExecuteRequest(WIRE_VERSION, "req-1", LAYOUT, plan, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def _state(n: int) -> UnitState:
    t = torch.zeros(1, n, 1, 2)
    return UnitState(t, t.clone())


class _Reader:
    """Every fetch succeeds with a state of the asked length."""

    async def fetch(self, lease: ReadLease, n_tokens: int, *, release: bool = True,
                    received_at: float | None = None) -> UnitState:
        return _state(n_tokens)

    async def late_lease(self, unit_id: str) -> ReadLease | None:
        return None  # nothing was published since the plan


def _decided(stats: RequestStats, cache: LocalUnitCache, released: Sequence[str]) -> dict[str, Any]:
    return {**{f: getattr(stats, f) for f in DECIDED}, "cached after": sorted(u for u in UNITS if u in cache),
            "leases back": sorted(released)}


async def _executor(case: Case, fuse: bool) -> dict[str, Any]:
    engine = FusingFakeEngine() if fuse else FakeEngine()
    released: list[str] = []
    scheduler = Scheduler(engine, max_batch_tokens=64)
    cache = LocalUnitCache(capacity_blocks=CAPACITY_BLOCKS, block_tokens=BLOCK_TOKENS, pin_memory=False)
    retainer = Retainer(cache, None, QuietControl(), staging_bytes=1 << 20, outstanding=2)
    executor = Executor(scheduler, PrefillCoalescer(scheduler), cache, retainer, _Reader(), released.append,
                        _policy(), case.mode)
    for uid in case.cached:
        cache.insert(uid, _state(len(UNITS[uid])))
    req = _request(case)
    scheduler.start()
    try:
        cache.held(req.request_id, [u.unit_id for u in req.plan.units])
        events = [e async for e in executor.run(req)]
        await retainer.drain(timeout=1.0)
    finally:
        await scheduler.stop()
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return _decided(done.stats, cache, released)


class _Reports:
    def __init__(self) -> None:
        self.released: list[str] = []

    def residency(self, node: str, inserted: Sequence[str], evicted: Sequence[str], kept: Sequence[str]) -> None:
        pass

    def publish(self, grant: WriteGrant) -> None:
        pass

    def give_up(self, grant: WriteGrant) -> None:
        pass

    def release(self, lease_ids: Sequence[str]) -> None:
        self.released.extend(lease_ids)


def _simulated(case: Case, fuse: bool) -> dict[str, Any]:
    loop, reports = EventLoop(), _Reports()
    cfg = GenerationNodeConfig("gen0", local_capacity_blocks=CAPACITY_BLOCKS, max_batch_tokens=64)
    node = SimNode(cfg, TransportConfig(), BLOCK_TOKENS, loop, COSTS, _policy(), case.mode, reports,
                   fuse_units=fuse)
    for uid in case.cached:
        t = torch.empty((0, len(UNITS[uid]), 0, 0))
        node.cache.insert(uid, UnitState(t, t))
    req = _request(case)
    finished: list[RequestStats] = []
    node.snapshot(req.request_id, [u.unit_id for u in req.plan.units])
    node.execute(Execution(req.request_id, LAYOUT, "", MAX_TOKENS, req.plan, lambda _s: None, finished.append))
    loop.run()
    assert len(finished) == 1
    return _decided(finished[0], node.cache, reports.released)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate prefills", "fused prefills"])
@pytest.mark.parametrize("name", list(CASES))
async def test_the_simulated_node_decides_as_the_executor(name: str, fuse: bool) -> None:
    """One plan, one starting cache: the simulated node's stats, cache and lease returns equal the executor's."""
    case = CASES[name]
    assert _simulated(case, fuse) == await _executor(case, fuse)


async def test_the_comparison_sees_a_difference() -> None:
    """The check can fail: two different plans give different decisions on the executor."""
    hit = await _executor(CASES["a local hit and a miss"], fuse=False)
    fetched = await _executor(CASES["two fetches, one kept locally"], fuse=False)
    assert hit != fetched
