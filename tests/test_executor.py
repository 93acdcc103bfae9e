"""The executor over a fake engine (CPU, no model): preparation paths, fallback, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from helpers.engines import FakeEngine, FusingFakeEngine, HeldStepsFakeEngine
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
from tessera.messages.common import BlockRef
from tessera.messages.generation import DoneEvent, ExecuteRequest, SamplingParams, TokenEvent
from tessera.messages.plan import Preparation, ReadLease, RequestPlan, Retention, UnitPlan
from tessera.messages.prompt import PromptLayout, Segment, SegmentKind
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

    def __init__(self, outcome: str, published: bool = False) -> None:
        self.outcome = outcome
        self.fetching = asyncio.Event()
        self.published = published  # the shared tier holds every unit READY by now
        self.late_asked: list[str] = []

    async def late_lease(self, unit_id: str) -> ReadLease | None:
        self.late_asked.append(unit_id)
        return dataclasses.replace(LEASE, lease_id="late-1") if self.published else None

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

    def __init__(self, engine: Any, reader: Reader | None) -> None:
        self.engine = engine
        self.released: list[str] = []
        self.scheduler = Scheduler(engine, max_batch_tokens=64)
        self.cache = LocalUnitCache(capacity_blocks=16, block_tokens=4, pin_memory=False)
        self.retainer = Retainer(self.cache, None, QuietControl(), staging_bytes=1 << 20, outstanding=2)
        policy = policy_from_config(CompositionConfig(policy="epic", recompute_tokens=1, unit_lead=""))
        self.executor = Executor(self.scheduler, PrefillCoalescer(self.scheduler), self.cache, self.retainer, reader,
                                 self.released.append, policy, "compose")

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
async def node(engine: Any, reader: Reader | None = None) -> AsyncIterator[Node]:
    n = Node(engine, reader)
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


@pytest.mark.parametrize("published", [True, False])
async def test_a_miss_planned_long_ago_is_fetched_if_another_node_published_it_since(
        fake_engine: Any, published: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that waited in a busy node's queue said COMPUTE; the unit is READY in the pool by
    now: it is fetched under a lease taken now (and that lease released), not prefilled again.
    Not READY: computed as planned. A fresh plan does not ask."""
    reader = Reader("ok", published=published)
    async with node(fake_engine, reader) as n:
        _, fresh = await n.run(Preparation.COMPUTE)
        assert reader.late_asked == [] and fresh.stats.computed_units == 1
        assert "u1" not in n.cache  # planned without retention: nothing local to find
        monkeypatch.setattr("tessera.generation.executor.LATE_PLAN_S", 0.0)
        fake_engine.batches.clear()
        _, done = await n.run(Preparation.COMPUTE, layout=LAYOUT)
    s = done.stats
    if published:
        assert reader.late_asked == ["u1"] and (s.remote_units, s.computed_units) == (1, 0)
        assert s.unit_sources == {"u1": "remote"} and n.released == ["late-1"]
        assert [len(UNIT)] not in fake_engine.batches  # no prefill of the unit
    else:
        assert reader.late_asked == ["u1"] and (s.remote_units, s.computed_units) == (0, 1)


async def test_two_late_requests_missing_the_same_units_never_wait_on_each_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a late plan's lease question was asked unit by unit inside the preparations,
    so request a claimed u1 (to prefill in its own forward), waited, then joined b's claim of
    u2, while b had claimed u2 and joined a's u1: neither forward ever ran. Now every late
    question is asked before any claim, and both requests finish."""
    u2 = (13, 14, 15)

    def two_units(first: str, second: str) -> PromptLayout:
        units = {"u1": UNIT, "u2": u2}
        return PromptLayout((Segment(SegmentKind.TEXT, (1, 2)), Segment(SegmentKind.UNIT, units[first], first),
                             Segment(SegmentKind.UNIT, units[second], second), Segment(SegmentKind.TEXT, (7, 8))))

    def late_request(rid: str, first: str, second: str) -> ExecuteRequest:
        units = tuple(UnitPlan(u, len(t), Preparation.COMPUTE, Retention.NEITHER) for u, t in
                      ((first, UNIT if first == "u1" else u2), (second, UNIT if second == "u1" else u2)))
        plan = RequestPlan(WIRE_VERSION, rid, "gen0", units)
        return ExecuteRequest(WIRE_VERSION, rid, two_units(first, second), plan, SamplingParams(max_tokens=1))

    class SlowAnswer(Reader):
        """Asked a:u1, a:u2, b:u2, b:u1 in that order: a hears of u1 and b of u2 first."""

        async def late_lease(self, unit_id: str) -> ReadLease | None:
            self.late_asked.append(unit_id)
            await asyncio.sleep(0.01 if len(self.late_asked) % 2 else 0.05)
            return None

    monkeypatch.setattr("tessera.generation.executor.LATE_PLAN_S", 0.0)
    async with node(FusingFakeEngine(), SlowAnswer("ok")) as n:
        runs = [asyncio.ensure_future(_events(n.executor.run(late_request("a", "u1", "u2")))),
                asyncio.ensure_future(_events(n.executor.run(late_request("b", "u2", "u1"))))]
        done = await asyncio.wait_for(asyncio.gather(*runs), 30)
    stats = [events[-1].stats for events in done]
    assert sum(s.computed_units for s in stats) == 2 and sum(s.coalesced_units for s in stats) == 2


async def test_a_miss_that_the_cache_holds_by_now_is_reused_not_prefilled(fake_engine: Any) -> None:
    """A unit planned COMPUTE that another request retained since the plan was made is a local hit."""
    async with node(fake_engine) as n:
        n.cache.insert("u1", unit_state())
        _, done = await n.run(Preparation.COMPUTE)
    assert (done.stats.local_units, done.stats.computed_units) == (1, 0)
    assert [len(UNIT)] not in fake_engine.batches  # no prefill of the unit


@pytest.mark.parametrize("engine_cls", [FakeEngine, FusingFakeEngine])
async def test_a_later_miss_of_a_just_computed_unit_never_prefills_it_again(engine_cls: type[FakeEngine]) -> None:
    """Requests missing one unit, started at staggered moments, prefill it once on the node.

    Each arrives while the prefill is in flight (coalesced) or after it was retained (local):
    the retention happens in the same step as the prefill's return, so there is no gap between.
    On an engine that fuses unit prefills the one computation is a request's own extend, which
    the others join as they would join a prefill.
    """
    engine = engine_cls()
    async with node(engine) as n:
        async def one(i: int, delay: float) -> DoneEvent:
            await asyncio.sleep(delay)
            events = [e async for e in n.executor.run(request(Preparation.COMPUTE, 2, LAYOUT, Retention.LOCAL,
                                                              f"req-{i}"))]
            done = events[-1]
            assert isinstance(done, DoneEvent)
            return done

        dones = await asyncio.gather(*(one(i, 0.0005 * i) for i in range(12)))
    assert n.executor.prefills.started == 1
    assert sum(d.stats.computed_units for d in dones) == 1
    assert sum(d.stats.computed_unit_tokens for d in dones) == len(UNIT)  # the one forward, counted once
    assert sum(d.stats.coalesced_units + d.stats.local_units for d in dones) == 11
    assert ([len(UNIT)] in engine.batches) == (engine_cls is FakeEngine)  # a prefill of its own, or none


async def test_a_unit_prefill_two_requests_share_is_counted_computed_once() -> None:
    """Two requests missing one unit on a node share its prefill: the one that ran it counts it
    computed, the one that joined it counts it coalesced, so their computed tokens add up to
    the one forward pass (the replies' usage, receipts and bench shares read these)."""
    engine = FakeEngine()
    async with node(engine) as n:
        gate = asyncio.Event()
        prefill_unit = n.scheduler.prefill_unit

        async def held_prefill(token_ids: Any, deadline: Any = None, group: int = 0) -> UnitState:
            await gate.wait()  # held off the engine thread: the other request's engine calls go on
            return await prefill_unit(token_ids, deadline, group)

        n.scheduler.prefill_unit = held_prefill  # type: ignore[method-assign]
        first = asyncio.ensure_future(_events(n.executor.run(request(Preparation.COMPUTE, request_id="a"))))
        await asyncio.wait_for(_until(lambda: len(n.executor.prefills) == 1), 30)
        second = asyncio.ensure_future(_events(n.executor.run(request(Preparation.COMPUTE, request_id="b"))))
        await asyncio.wait_for(_until(lambda: n.executor.prefills.coalesced == 1), 30)
        gate.set()
        a, b = (events[-1].stats for events in await asyncio.wait_for(asyncio.gather(first, second), 30))
    assert (a.computed_units, a.computed_unit_tokens, a.coalesced_units, a.coalesced_unit_tokens,
            a.unit_sources) == (1, len(UNIT), 0, 0, {"u1": "computed"})
    assert (b.computed_units, b.computed_unit_tokens, b.coalesced_units, b.coalesced_unit_tokens,
            b.unit_sources) == (0, 0, 1, len(UNIT), {"u1": "coalesced"})
    assert a.computed_unit_tokens + b.computed_unit_tokens == len(UNIT)
    assert dict(b.tokens_by_source())["coalesced"] == len(UNIT) and b.cached_tokens == 0
    assert engine.batches.count([len(UNIT)]) == 1  # one prefill of the unit ran


async def test_a_miss_on_a_fusing_engine_is_prefilled_in_the_requests_own_forward() -> None:
    """On an engine that fuses unit prefills, a missed unit costs no step of its own: the request's
    one extend carries it (its placed rows, then its recomputed head and the text), and the
    state is retained as a separate prefill's would be."""
    engine = FusingFakeEngine()
    async with node(engine) as n:
        events = [e async for e in n.executor.run(request(Preparation.COMPUTE, 3, LAYOUT, Retention.LOCAL))]
        done = events[-1]
        assert isinstance(done, DoneEvent)
        await n.retainer.drain(timeout=1.0)
        assert n.cache.lookup("u1") is not None
        assert len(n.executor.prefills) == 0  # the claim is settled
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == [9, 10, 11]
    s = done.stats
    assert (s.computed_units, s.computed_unit_tokens, s.coalesced_units, s.unit_sources) == \
        (1, len(UNIT), 0, {"u1": "computed"})
    extend_tokens = len(LAYOUT.token_ids()) - PLACED_TOKENS
    assert [b for b in engine.batches if b != [1]] == [[extend_tokens + len(UNIT)]]  # one forward, no prefill
    assert engine.placed == [(PLACED_OFFSET, PLACED_TOKENS)]


class FailingFusedEngine(FusingFakeEngine):
    """Its step fails whenever an extend carries a unit."""

    def step(self, work: Any) -> None:
        if any(getattr(item, "units", ()) for item in work):
            raise RuntimeError("engine step failed")
        super().step(work)


async def test_a_request_whose_fused_extend_fails_releases_its_claim() -> None:
    """The request fails with the engine's error, and its claim on the unit is abandoned, not
    left in flight for later requests to wait on forever."""
    async with node(FailingFusedEngine()) as n:
        with pytest.raises(RuntimeError, match="engine step failed"):
            await n.run(Preparation.COMPUTE)
        assert len(n.executor.prefills) == 0
        assert n.executor.prefills.claim("u1") is not None  # a later miss may claim it again


class UnplaceableEngine(FakeEngine):
    """Refuses to place float64 states, as a real engine refuses a state of a foreign dtype
    (its own prefills are float32)."""

    def place(self, slots: Any, offset: int, state: UnitState) -> None:
        if state.keys.dtype == torch.float64:
            raise PlacementError("state.keys is torch.float64, this engine holds torch.float32")
        super().place(slots, offset, state)


async def test_a_reused_state_that_cannot_be_placed_is_computed_and_the_extend_runs_once() -> None:
    """A local state refused at placement costs its prefill: the unit is prefilled and placed,
    and the request's one extend runs over it; the reply is the one a computed unit gives."""
    engine = UnplaceableEngine()
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
    """Its exact prefix cache raises on every match."""

    def match_prefix(self, slots: Any, token_ids: Any, namespace: str = "") -> int:
        raise RuntimeError("prefix cache is corrupt")


async def test_slots_taken_for_a_request_whose_prefix_match_fails_are_freed() -> None:
    """If the prefix match raises, the request's slots go back before the error reaches it."""
    engine = BrokenMatchEngine()
    async with node(engine) as n:
        with pytest.raises(RuntimeError, match="corrupt"):
            await n.run(Preparation.COMPUTE)
    assert [s.freed for s in engine.allocated] == [True]


async def _events(run: Any) -> list[Any]:
    return [e async for e in run]


async def _until(check: Any) -> None:
    while not check():
        await asyncio.sleep(0.005)


async def test_with_prefix_caching_a_first_token_never_waits_for_the_next_batch() -> None:
    """Regression (the baseline of every bench): in prefix mode the executor awaited
    the prefix cache insert as an engine call of its own after the extend, so it queued behind
    the batch the scheduler had already started, and whenever the node had other work queued a
    request's first token came one whole forward late. Here the second request's batch is held
    until the first request's first token arrives; with the old order it never does."""
    engine = HeldStepsFakeEngine(held=(1, 2))
    prompt = PromptLayout((Segment(SegmentKind.TEXT, (1, 2, 3, 4, 5, 6)),))
    scheduler = Scheduler(engine, max_batch_tokens=8)  # one 6-token prompt a batch
    cache = LocalUnitCache(capacity_blocks=16, block_tokens=4, pin_memory=False)
    retainer = Retainer(cache, None, QuietControl(), staging_bytes=1 << 20, outstanding=2)
    executor = Executor(scheduler, PrefillCoalescer(scheduler), cache, retainer, None, lambda _: None,
                        policy_from_config(CompositionConfig()), "prefix")
    scheduler.start()
    try:
        first, second = (executor.run(request(Preparation.COMPUTE, 1, prompt, request_id=r)) for r in ("a", "b"))
        first_token = asyncio.ensure_future(anext(first))
        rest = asyncio.ensure_future(_events(second))
        # the first request's batch is held on the engine thread, the second request queued behind it
        await asyncio.wait_for(_until(lambda: scheduler.batches == 1 and scheduler.queued_tokens == 6), 30)
        engine.release[1].set()
        event = await asyncio.wait_for(first_token, 30)  # the second batch is still held
        assert isinstance(event, TokenEvent) and event.token_id == 7
        # the loop forms the second batch only once the first request's insert has run
        await asyncio.wait_for(_until(lambda: "step 2" in engine.events), 30)
        assert not rest.done() and engine.events == ["step 1", "insert 6 ", "step 2"]
        engine.release[2].set()
        await asyncio.wait_for(rest, 30)
        assert [type(e) for e in await _events(first)] == [DoneEvent]
    finally:
        await scheduler.stop()
    assert engine.events == ["step 1", "insert 6 ", "step 2", "insert 6 "]
    assert [s.freed for s in engine.allocated] == [True, True]


@pytest.mark.parametrize("preparation", [Preparation.LOCAL, Preparation.REMOTE])
async def test_a_reused_unit_costs_no_engine_call_of_its_own(preparation: Preparation) -> None:
    """Hops: every engine call a request awaits queues behind the running forward. A request
    takes its slots and matches its prefix in one call, and its reused state is placed by
    its extend's own batch call: two calls to its first token (the loop then inserts the
    uncached leading text into the prefix cache), then the free."""
    engine = FakeEngine()
    async with node(engine, Reader("ok")) as n:
        if preparation is Preparation.LOCAL:
            n.cache.insert("u1", unit_state())
        calls: list[str] = []
        worker = n.scheduler.worker
        run, submit = worker.run, worker.submit

        def spy(through: Any) -> Any:
            def call(fn: Any, *args: Any) -> Any:
                calls.append(fn.__name__)
                return through(fn, *args)
            return call
        worker.run, worker.submit = spy(run), spy(submit)  # type: ignore[method-assign]
        _, done = await n.run(preparation, max_tokens=1)
    assert calls == ["_begin", "_run_batch", "insert_prefix", "free"]
    assert engine.placed == [(PLACED_OFFSET, PLACED_TOKENS)]
    assert done.stats.unit_sources == {"u1": preparation.value}


async def test_a_miss_is_decided_when_its_turn_comes_not_when_its_plan_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (goodput past saturation): a request planned to compute u1 decided how to get
    it as its plan arrived, then queued behind the node's work; meanwhile another node published
    u1, and both nodes computed it. Now a request with a miss waits in line (the waiting room)
    until its work would go into the next batch, and only then asks the shared tier: the unit
    published while it waited is fetched, not prefilled."""
    monkeypatch.setattr("tessera.generation.executor.LATE_PLAN_S", 0.0)
    engine = HeldStepsFakeEngine(held=(1,))
    reader = Reader("ok", published=False)
    n = Node(engine, reader)
    n.scheduler.max_batch_prompts = 1
    text = PromptLayout((Segment(SegmentKind.TEXT, (1, 2, 3, 4, 5, 6)),))
    n.scheduler.start()
    try:
        # all three take their slots before the first batch holds the engine thread
        busy, queued, missing = (asyncio.ensure_future(_events(n.executor.run(r))) for r in (
            request(Preparation.COMPUTE, 1, text, request_id="a"),
            request(Preparation.COMPUTE, 1, text, request_id="b"),
            request(Preparation.COMPUTE, 1, request_id="c")))
        # a's batch holds the engine, b's job fills the next batch, c waits for its turn
        await asyncio.wait_for(_until(lambda: engine.events == ["step 1"] and n.scheduler.room.waiting == 1), 30)
        assert reader.late_asked == [], "the miss was decided before the request's turn"
        assert n.scheduler.queued_tokens > 6  # its work counts as queued on the node (load reports)
        reader.published = True  # another node computed and published u1 meanwhile
        engine.release[1].set()
        done = (await asyncio.wait_for(missing, 30))[-1]
        await asyncio.wait_for(asyncio.gather(busy, queued), 30)
    finally:
        await n.retainer.drain(timeout=1.0)
        await n.scheduler.stop()
    s = done.stats
    assert reader.late_asked == ["u1"] and (s.remote_units, s.computed_units) == (1, 0)
    assert [len(UNIT)] not in engine.batches  # nobody prefilled the unit here
