"""The executor over a fake engine (CPU, no model): preparation paths, fallback, cancellation, engine hops."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from helpers.engines import FakeEngine
from helpers.executor import QuietControl

from tessera.composition.policies import policy_from_config
from tessera.config import CompositionConfig
from tessera.engines.base import UnitState
from tessera.errors import PlacementError, TransferError
from tessera.generation.executor import Executor
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.retention import Retainer
from tessera.generation.scheduler import Scheduler
from tessera.generation.unit_cache import LocalUnitCache
from tessera.messages import (
    BlockRef,
    DoneEvent,
    ExecuteRequest,
    Preparation,
    PromptLayout,
    ReadLease,
    RequestPlan,
    Retention,
    SamplingParams,
    Segment,
    SegmentKind,
    TokenEvent,
    UnitPlan,
)
from tessera.wire import WIRE_VERSION

UNIT = (3, 4, 5, 6)
LAYOUT = PromptLayout((Segment(SegmentKind.TEXT, (1, 2)), Segment(SegmentKind.UNIT, UNIT, "u1"),
                       Segment(SegmentKind.TEXT, (7, 8))))
# epic with k = 1 recomputes the unit's first token; the rest of its state lands after "1 2" and it
PLACED_OFFSET, PLACED_TOKENS = 2 + 1, len(UNIT) - 1
LEASE = ReadLease("lease-1", "u1", 1, (BlockRef("kv0", 0),), 30.0)


def unit_state(n: int = len(UNIT)) -> UnitState:
    t = torch.zeros(1, n, 1, 2)
    return UnitState(t, t.clone())


class Reader:
    """A KV-pool client whose fetch fails, succeeds, or never returns."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.fetching = asyncio.Event()

    async def fetch(self, lease: ReadLease, n_tokens: int, *, release: bool = True,
                    received_at: float | None = None) -> UnitState:
        self.fetching.set()
        if self.outcome == "fail":
            raise TransferError("memory node kv0 is gone")
        if self.outcome == "hang":
            await asyncio.Event().wait()
        return unit_state(n_tokens)


class Node:
    """An executor wired as on a generation node, with a fake engine and a recording lease release."""

    def __init__(self, engine: Any, reader: Reader | None, mode: str = "compose") -> None:
        self.engine = engine
        self.released: list[str] = []
        self.scheduler = Scheduler(engine, max_batch_tokens=64)
        self.cache = LocalUnitCache(capacity_blocks=16, block_tokens=4, pin_memory=False)
        self.retainer = Retainer(self.cache, None, QuietControl(), staging_bytes=1 << 20, outstanding=2)
        policy = policy_from_config(CompositionConfig(policy="epic", recompute_tokens=1, unit_lead=""))
        self.executor = Executor(self.scheduler, PrefillCoalescer(self.scheduler), self.cache, self.retainer, reader,
                                 self.released.append, policy, mode)
        self.hops: list[str] = []  # every call queued on the engine thread, in order
        pool = self.scheduler.worker._pool
        submit = pool.submit

        def counted(fn: Any, *args: Any) -> Any:
            target = args[0] if fn == self.scheduler.worker.timed else fn
            self.hops.append(getattr(target, "__name__", "call"))
            return submit(fn, *args)

        pool.submit = counted  # type: ignore[method-assign]

    async def run(self, preparation: Preparation, max_tokens: int = 3,
                  layout: PromptLayout = LAYOUT) -> tuple[list[int], DoneEvent]:
        events = [e async for e in self.executor.run(request(preparation, max_tokens, layout))]
        done = events[-1]
        assert isinstance(done, DoneEvent)
        return [e.token_id for e in events if isinstance(e, TokenEvent)], done


def request(preparation: Preparation, max_tokens: int = 3, layout: PromptLayout = LAYOUT,
            retention: Retention = Retention.NEITHER, request_id: str = "req-1") -> ExecuteRequest:
    unit = UnitPlan("u1", len(UNIT), preparation, retention,
                    lease=LEASE if preparation is Preparation.REMOTE else None)
    return ExecuteRequest(WIRE_VERSION, request_id, layout, RequestPlan(WIRE_VERSION, request_id, "gen0", (unit,)),
                          SamplingParams(max_tokens=max_tokens))


@contextlib.asynccontextmanager
async def node(engine: Any, reader: Reader | None = None, mode: str = "compose") -> AsyncIterator[Node]:
    n = Node(engine, reader, mode)
    n.scheduler.start()
    try:
        yield n
    finally:
        await n.retainer.drain(timeout=1.0)
        await n.scheduler.stop()


async def test_a_failed_fetch_falls_back_to_computing_the_unit(fake_engine: Any) -> None:
    """A remote fetch that raises TransferError is computed instead; the request still answers."""
    async with node(fake_engine, Reader("fail")) as n:
        tokens, done = await n.run(Preparation.REMOTE)
    assert tokens == [9, 10, 11] and done.finish_reason == "length"
    s = done.stats
    assert (s.fallbacks, s.remote_units, s.computed_units, s.computed_unit_tokens) == (1, 0, 1, len(UNIT))
    assert n.released == ["lease-1"]  # the lease goes back once, failed fetch or not
    assert [len(UNIT)] in fake_engine.batches  # the unit's own prefill ran


async def test_a_remote_hit_is_placed_at_its_offset_without_a_prefill(fake_engine: Any) -> None:
    """A fetched state is placed after the leading text; only the policy's tokens are computed."""
    async with node(fake_engine, Reader("ok")) as n:
        tokens, done = await n.run(Preparation.REMOTE)
    assert tokens == [9, 10, 11]
    assert (done.stats.remote_units, done.stats.computed_units, done.stats.fallbacks) == (1, 0, 0)
    assert done.stats.bytes_fetched == unit_state().nbytes()
    assert fake_engine.placed == [(PLACED_OFFSET, PLACED_TOKENS)]
    assert n.released == ["lease-1"]


async def test_a_local_hit_comes_from_the_unit_cache(fake_engine: Any) -> None:
    """A unit planned LOCAL is read from the cache the snapshot pinned; nothing is fetched or prefilled."""
    async with node(fake_engine, Reader("fail")) as n:
        n.cache.insert("u1", unit_state())
        _, done = await n.run(Preparation.LOCAL)
    assert (done.stats.local_units, done.stats.local_tokens, done.stats.computed_units) == (1, len(UNIT), 0)
    assert n.released == []


async def test_the_stop_token_ends_the_request_with_reason_stop(fake_engine: Any) -> None:
    """EOS is not streamed; the request finishes with finish_reason "stop"."""
    layout = PromptLayout((Segment(SegmentKind.TEXT, (1, 2)), Segment(SegmentKind.UNIT, UNIT, "u1"),
                           Segment(SegmentKind.TEXT, (29,))))
    async with node(fake_engine) as n:
        tokens, done = await n.run(Preparation.COMPUTE, max_tokens=10, layout=layout)
    assert tokens == [30] and done.finish_reason == "stop"
    assert done.stats.completion_tokens == 2  # the EOS counts as generated


async def test_cancelling_a_run_frees_its_slots_and_returns_its_lease(fake_engine: Any) -> None:
    """An aborted request (its task cancelled mid-fetch) frees its KV slots and releases its lease once."""
    reader = Reader("hang")
    async with node(fake_engine, reader) as n:
        task = asyncio.ensure_future(n.run(Preparation.REMOTE))
        await reader.fetching.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [s.freed for s in fake_engine.allocated] == [True]
        assert n.released == ["lease-1"]
        assert n.cache.held("other", ["u1"]) == []  # nothing left pinned or inserted


async def test_a_miss_that_the_cache_holds_by_now_is_reused_not_prefilled(fake_engine: Any) -> None:
    """A unit planned COMPUTE that another request retained since the plan was made is a local hit."""
    async with node(fake_engine) as n:
        n.cache.insert("u1", unit_state())
        _, done = await n.run(Preparation.COMPUTE)
    assert (done.stats.local_units, done.stats.computed_units) == (1, 0)
    assert [len(UNIT)] not in fake_engine.batches  # no prefill of the unit


async def test_a_later_miss_of_a_just_computed_unit_never_prefills_it_again(fake_engine: Any) -> None:
    """Requests missing one unit, started at staggered moments, prefill it once on the node.

    Each arrives while the prefill is in flight (coalesced) or after it was retained (local):
    the retention happens in the same step as the prefill's return, so there is no gap between.
    """
    async with node(fake_engine) as n:
        async def one(i: int, delay: float) -> DoneEvent:
            await asyncio.sleep(delay)
            events = [e async for e in n.executor.run(request(Preparation.COMPUTE, 2, LAYOUT, Retention.LOCAL,
                                                              f"req-{i}"))]
            done = events[-1]
            assert isinstance(done, DoneEvent)
            return done

        dones = await asyncio.gather(*(one(i, 0.0005 * i) for i in range(12)))
    assert n.executor.prefills.started == 1
    assert sum(d.stats.computed_units - d.stats.coalesced_units for d in dones) == 1
    assert sum(d.stats.coalesced_units + d.stats.local_units for d in dones) == 11


async def _hops_to_first_token(n: Node, req: ExecuteRequest) -> tuple[list[str], list[TokenEvent | DoneEvent]]:
    events: list[TokenEvent | DoneEvent] = []
    hops: list[str] = []
    async for e in n.executor.run(req):
        if not events:
            hops = list(n.hops)
        events.append(e)
    return hops, events


@pytest.mark.parametrize("preparation", [Preparation.LOCAL, Preparation.REMOTE, Preparation.COMPUTE])
async def test_a_request_reaches_its_first_token_in_two_engine_calls_plus_its_unit_prefills(
        fake_engine: Any, preparation: Preparation) -> None:
    """Regression: every engine-thread call waits behind the running forward, and a request made
    one for its slots, one for its prefix match and one per unit placement before its extend (up
    to a whole step each under load). Now the slots and the match are one call and the states
    are placed by the extend's own batch: two calls, plus the step that prefills a missing unit."""
    async with node(fake_engine, Reader("ok")) as n:
        if preparation is Preparation.LOCAL:
            n.cache.insert("u1", unit_state())
        hops, events = await _hops_to_first_token(n, request(preparation))
    expected = ["_begin", "_place_and_step"] if preparation is not Preparation.COMPUTE else \
        ["_begin", "_place_and_step", "_place_and_step"]  # the unit's prefill, then the extend
    # the leading text "1 2" was not cached: its insert is queued after the extend, not awaited
    # (test_the_first_token_does_not_wait_for_the_prefix_cache_insert)
    assert hops == [*expected, "insert_prefix"]
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.stats.unit_sources == {"u1": preparation.value.replace(
        "compute", "computed")}
    assert fake_engine.placed == [(PLACED_OFFSET, PLACED_TOKENS)]


class SlowInsertEngine(FakeEngine):
    """Its prefix-cache insert blocks until the test has seen the first token (or 10 s pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_token_seen = threading.Event()
        self.insert_waited_for_first_token: bool | None = None

    def insert_prefix(self, slots: Any, token_ids: Any, namespace: str = "") -> None:
        self.insert_waited_for_first_token = self.first_token_seen.wait(timeout=10.0)


async def test_the_first_token_does_not_wait_for_the_prefix_cache_insert() -> None:
    """Regression: prefix mode awaited inserting the prompt into the prefix cache before it
    returned the first token, one more engine call behind the next step. Now the insert is
    queued and the first token goes out; it still runs before the request's slots are freed."""
    engine = SlowInsertEngine()
    async with node(engine, mode="prefix") as n:
        events: list[Any] = []
        async for e in n.executor.run(request(Preparation.COMPUTE)):
            if not events:
                engine.first_token_seen.set()
            events.append(e)
    assert engine.insert_waited_for_first_token is True
    assert [s.freed for s in engine.allocated] == [True]
    assert n.hops.index("insert_prefix") < n.hops.index("free")


class UnplaceableEngine(FakeEngine):
    """Refuses to place states of ``bad_tokens`` tokens (as a foreign dtype would be refused)."""

    def __init__(self, bad_tokens: int) -> None:
        super().__init__()
        self.bad_tokens = bad_tokens

    def place(self, slots: Any, offset: int, state: UnitState) -> None:
        if state.n_tokens == self.bad_tokens and state.keys.dtype == torch.float64:
            raise PlacementError("state.keys is torch.float64, this engine holds torch.float32")
        super().place(slots, offset, state)


async def test_a_reused_state_the_extend_cannot_place_is_computed_and_the_extend_runs_once() -> None:
    """A local state refused at placement (inside the extend's batch) costs its prefill: the
    extend is not computed over the missing state, the unit is prefilled, placed, and the same
    extend runs; the reply is the one a computed unit gives."""
    engine = UnplaceableEngine(PLACED_TOKENS)
    async with node(engine) as n:
        n.cache.insert("u1", UnitState(torch.zeros(1, len(UNIT), 1, 2, dtype=torch.float64),
                                       torch.zeros(1, len(UNIT), 1, 2, dtype=torch.float64)))
        tokens, done = await n.run(Preparation.LOCAL)
    assert tokens == [9, 10, 11]
    s = done.stats
    assert (s.fallbacks, s.local_units, s.computed_units, s.unit_sources) == (1, 0, 1, {"u1": "computed"})
    extend_tokens = len(LAYOUT.token_ids()) - PLACED_TOKENS
    assert [b for b in engine.batches if b != [1]] == [[len(UNIT)], [extend_tokens]]  # prefill, one extend


class BrokenMatchEngine(FakeEngine):
    def match_prefix(self, slots: Any, token_ids: Any, namespace: str = "") -> int:
        raise RuntimeError("prefix cache is corrupt")


async def test_slots_taken_for_a_request_whose_prefix_match_fails_are_freed() -> None:
    """Taking the slots and matching the prefix are one engine call; if the match raises, the
    slots go back before the error reaches the request."""
    engine = BrokenMatchEngine()
    async with node(engine) as n:
        with pytest.raises(RuntimeError, match="corrupt"):
            await n.run(Preparation.COMPUTE)
    assert [s.freed for s in engine.allocated] == [True]
