"""The scheduler's batching over a fake engine (CPU, no model): token budget, lone items, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from helpers.engines import FakeEngine, FusingFakeEngine, HeldStepsFakeEngine

from tessera.composition.layout import Placement
from tessera.engines.base import KVSlots, UnitFeed, UnitState
from tessera.errors import Overloaded, PlacementError
from tessera.generation.scheduler import Scheduler, StartDeadline, UnplacedUnits


@contextlib.asynccontextmanager
async def scheduler(engine: Any, max_batch_tokens: int) -> AsyncIterator[Scheduler]:
    s = Scheduler(engine, max_batch_tokens)
    try:
        yield s
    finally:
        await s.stop()


async def _slots(s: Scheduler, n: int = 64) -> KVSlots:
    slots, _ = await s.begin(n, [])
    return slots


def _extend(s: Scheduler, slots: KVSlots, n: int, start: int = 0) -> asyncio.Task[Any]:
    """Queue an extend of n tokens at positions start.. (queued at once, before the loop runs)."""
    return asyncio.ensure_future(s.extend(slots, [1] * n, range(start, start + n)))


async def _queued(*tasks: asyncio.Task[Any]) -> None:
    """Let every task submit its job (the loop is not started yet, so nothing runs)."""
    await asyncio.sleep(0)
    assert not any(t.done() for t in tasks)


async def test_extends_are_batched_up_to_the_token_budget(fake_engine: Any) -> None:
    """Three 4-token extends under a budget of 8 run as one batch of two, then one."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        tasks = [_extend(s, await _slots(s), 4) for _ in range(3)]
        await _queued(*tasks)
        s.start()
        await asyncio.gather(*tasks)
    assert fake_engine.batches == [[4, 4], [4]]


async def test_max_batch_prompts_runs_queued_prompts_one_forward_each_in_arrival_order(fake_engine: Any) -> None:
    """On a CPU a batch costs the sum of its prompts and each member waits for all of it, so
    with max_batch_prompts = 1 the first request queued is not held by the ones behind it."""
    s = Scheduler(fake_engine, max_batch_tokens=64, max_batch_prompts=1)
    try:
        tasks = [_extend(s, await _slots(s), n) for n in (4, 3, 2)]
        await _queued(*tasks)
        s.start()
        await asyncio.gather(*tasks)
    finally:
        await s.stop()
    assert fake_engine.batches == [[4], [3], [2]]


async def test_an_extend_longer_than_the_budget_runs_in_chunks_that_others_interleave(fake_engine: Any) -> None:
    """Regression: a prompt longer than max_batch_tokens ran as one item, and every other request
    waited for its whole prefill (a ~7,000-token prompt delayed the others by up to 29 s). A
    20-token extend under a budget of 8 runs as 8 + 8 + 4, and the short extend queued behind it
    runs between its chunks."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        tasks = [_extend(s, await _slots(s), 3), _extend(s, await _slots(s), 20), _extend(s, await _slots(s), 3)]
        await _queued(*tasks)
        s.start()
        results = await asyncio.gather(*tasks)
    assert fake_engine.batches == [[3], [8], [3], [8], [4]]
    assert int(results[1].argmax()) == 2  # the logits of the last chunk's last token (token 1 -> 2)


async def test_decodes_ride_along_with_every_chunk_of_a_long_extend(fake_engine: Any) -> None:
    """A pending decode joins the first chunk of a long extend instead of waiting behind all of it."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        decode = asyncio.ensure_future(s.decode(await _slots(s), 1, 0))
        long_extend = _extend(s, await _slots(s), 20)
        await _queued(decode, long_extend)
        s.start()
        await asyncio.gather(decode, long_extend)
    assert fake_engine.batches == [[1, 8], [8], [4]]


async def test_a_request_whose_units_are_ready_goes_before_unit_prefills_queued_earlier(fake_engine: Any) -> None:
    """Regression: at 3x saturation a request's final extend queued behind the unit prefills of
    every request that arrived after it, so first tokens came late and in bursts (accepted p99
    above max_queue_wait_s + one service time). Its extend now runs before queued unit prefills."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        prefills = [asyncio.ensure_future(s.prefill_unit([1] * 6)) for _ in range(2)]
        extend = _extend(s, await _slots(s), 3)
        await _queued(*prefills, extend)
        s.start()
        await asyncio.gather(*prefills, extend)
    assert fake_engine.batches == [[3], [6], [6]]


async def test_an_extend_that_prefills_its_own_unit_queues_behind_ready_requests() -> None:
    """An extend carrying a missing unit (an engine that fuses unit prefills) waits, as that
    unit's own prefill did, behind requests whose units are ready and which queued after it;
    its unit rides its first chunk."""
    engine = FusingFakeEngine()
    async with scheduler(engine, max_batch_tokens=8) as s:
        missing = asyncio.ensure_future(s.extend(await _slots(s), [1] * 3, range(6, 9),
                                                 units=[UnitFeed([1] * 6, [(0, 6, 0)])]))
        ready = _extend(s, await _slots(s), 3)
        await _queued(missing, ready)
        s.start()
        await asyncio.gather(missing, ready)
    assert engine.batches == [[3], [9]]


async def test_a_cancelled_request_never_reaches_the_engine(fake_engine: Any) -> None:
    """Work whose requester went away (cancelled future) is dropped, the rest still runs."""
    async with scheduler(fake_engine, max_batch_tokens=64) as s:
        gone, kept = _extend(s, await _slots(s), 5), _extend(s, await _slots(s), 7)
        await _queued(gone, kept)
        gone.cancel()
        s.start()
        await kept
        with pytest.raises(asyncio.CancelledError):
            await gone
    assert fake_engine.batches == [[7]]
    assert s.queued_tokens == 0


async def test_stopping_fails_queued_work_and_frees_the_engine_thread(fake_engine: Any) -> None:
    """stop() fails what is still queued with a clear error instead of leaving it hanging."""
    s = Scheduler(fake_engine, max_batch_tokens=64)
    task = _extend(s, await _slots(s), 5)
    await _queued(task)
    await s.stop()
    with pytest.raises(RuntimeError, match="shutting down"):
        await task


def _passed() -> StartDeadline:
    """A start deadline that has already passed."""
    return StartDeadline(time.monotonic() - 1.0)


async def test_a_request_passed_over_beyond_its_start_deadline_is_refused_before_it_costs_a_step(
        fake_engine: Any) -> None:
    """Regression: at 3x saturation accepted requests reached their first token at
    p99 1.14-1.74x the overload control's promise, because the plane's estimate of a node's
    queue was short and nothing on the node held the bound. A request still queued behind a
    batch that left it out when its start deadline passed is refused with Overloaded (429);
    it never reaches the engine, and the request ahead of it is served."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        first = _extend(s, await _slots(s), 8)
        late = asyncio.ensure_future(s.extend(await _slots(s), [1] * 8, range(8), _passed()))
        await _queued(first, late)
        s.start()
        await first
        with pytest.raises(Overloaded, match="queueing bound"):
            await late
    assert fake_engine.batches == [[8]]
    assert s.late_refused == 1


async def test_a_late_request_that_no_batch_passed_over_still_starts(fake_engine: Any) -> None:
    """The plane may send a request whose bound ran out before routing to an idle node; it
    waited for nothing on the node, so it starts."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        task = asyncio.ensure_future(s.extend(await _slots(s), [1] * 5, range(5), _passed()))
        await _queued(task)
        s.start()
        await task
    assert fake_engine.batches == [[5]]
    assert s.late_refused == 0


async def test_once_a_requests_unit_prefill_began_its_extend_is_never_refused_for_time(fake_engine: Any) -> None:
    """The deadline bounds queueing only: a request whose first step began (its unit prefill)
    is no longer queued, so its extend runs even after the deadline and a pass-over."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        deadline = _passed()
        prefill = asyncio.ensure_future(s.prefill_unit([1] * 4, deadline))
        await _queued(prefill)
        s.start()
        await prefill
        assert deadline.started
        ahead = _extend(s, await _slots(s), 8)
        extend = asyncio.ensure_future(s.extend(await _slots(s), [1] * 8, range(8), deadline))
        await asyncio.gather(ahead, extend)
    assert fake_engine.batches == [[4], [8], [8]]
    assert s.late_refused == 0


async def test_a_request_within_its_start_deadline_waits_its_turn(fake_engine: Any) -> None:
    """A deadline that has not passed changes nothing: passed over, the request still runs."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        first = _extend(s, await _slots(s), 8)
        second = asyncio.ensure_future(s.extend(await _slots(s), [1] * 8, range(8), s.deadline(60.0)))
        await _queued(first, second)
        s.start()
        await asyncio.gather(first, second)
    assert fake_engine.batches == [[8], [8]]


async def test_a_deadline_starts_earlier_by_the_nodes_measured_excess_work(fake_engine: Any) -> None:
    """Under load the node leaves room for its slower work: a 10 s budget on a node whose recent
    requests took 4 s more than alone to their first token becomes a 6 s start deadline."""
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        s.work.observe(1.0, alone=True)
        s.work.observe(5.0, alone=False)
        before = time.monotonic()
        deadline = s.deadline(10.0)
        assert before + 6.0 <= deadline.at <= time.monotonic() + 6.0
        assert s.deadline(None).at == float("inf")


def _inserting(s: Scheduler, slots: KVSlots, n: int, prefix: int) -> asyncio.Task[Any]:
    return asyncio.ensure_future(s.extend(slots, [1] * n, range(n), insert_prefix=([1] * prefix, "t")))


async def test_a_prefix_insert_runs_before_the_next_batch_and_never_delays_the_first_token() -> None:
    """Regression: the executor awaited the prefix insert as a call of its own after the extend,
    so it queued behind the batch the loop had already started, and the request's first token
    waited for that whole forward (prefix caching paid it on every request under load). The
    insert now rides on the extend: it runs on the engine thread right after the extend's step,
    before the next batch, and the request has its logits while the next batch still runs."""
    engine = HeldStepsFakeEngine(held=(2,))
    async with scheduler(engine, max_batch_tokens=8) as s:
        first = _inserting(s, await _slots(s), 6, prefix=5)
        second = _extend(s, await _slots(s), 6)
        await _queued(first, second)
        s.start()
        # the second batch is held on the engine thread until the first request has its logits:
        # with the old order this could never happen (the hang guard below would fire)
        logits = await asyncio.wait_for(first, 60)
        assert int(logits.argmax()) == 2
        assert not second.done()
        engine.release[2].set()
        await second
    assert engine.events == ["step 1", "insert 5 t", "step 2"]
    assert engine.batches == [[6], [6]]


async def test_a_chunked_extend_inserts_its_prefix_after_its_last_chunk_only() -> None:
    engine = HeldStepsFakeEngine()
    async with scheduler(engine, max_batch_tokens=8) as s:
        s.start()
        await _inserting(s, await _slots(s, 32), 20, prefix=19)
        await _extend(s, await _slots(s), 2)  # formed only once the insert has run
    assert engine.events == ["step 1", "step 2", "step 3", "insert 19 t", "step 4"]


async def test_a_failed_prefix_insert_is_logged_and_the_request_still_gets_its_logits(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = HeldStepsFakeEngine(fail_insert=True)
    async with scheduler(engine, max_batch_tokens=8) as s:
        s.start()
        logits = await _inserting(s, await _slots(s), 4, prefix=3)
        again = await _inserting(s, await _slots(s), 4, prefix=3)  # the loop goes on
    assert int(logits.argmax()) == int(again.argmax()) == 2
    assert "prefix cache insert of 3 tokens failed" in caplog.text


async def test_a_cancelled_request_inserts_no_prefix() -> None:
    """Its slots may be freed as soon as it is cancelled: nothing is read from them afterwards."""
    engine = HeldStepsFakeEngine()
    async with scheduler(engine, max_batch_tokens=64) as s:
        gone, kept = _inserting(s, await _slots(s), 5, prefix=4), _inserting(s, await _slots(s), 7, prefix=6)
        await _queued(gone, kept)
        gone.cancel()
        s.start()
        await kept
        await _extend(s, await _slots(s), 2)  # formed only once the insert has run
    assert engine.events == ["step 1", "insert 6 t", "step 2"]


class PickyPlacingEngine(FakeEngine):
    """Refuses float64 states as a real engine refuses a foreign dtype (PlacementError), and
    raises a plain bug (ValueError) on a state of 3 tokens."""

    def place(self, slots: KVSlots, offset: int, state: UnitState) -> None:
        if state.keys.dtype == torch.float64:
            raise PlacementError("state.keys is torch.float64, this engine holds torch.float32")
        if state.n_tokens == 3:
            raise ValueError("a bug in placement")
        super().place(slots, offset, state)


def _state(n: int, dtype: torch.dtype = torch.float32) -> UnitState:
    return UnitState(torch.zeros(1, n, 1, 2, dtype=dtype), torch.zeros(1, n, 1, 2, dtype=dtype))


def _placing(s: Scheduler, slots: KVSlots, states: dict[str, UnitState]) -> asyncio.Task[Any]:
    """An extend of 2 tokens after the units, which sit one after another from position 0."""
    spans, offset = {}, 0
    for uid, state in states.items():
        spans[uid] = ([Placement(uid, offset, 0, state.n_tokens, state.n_tokens)], state)
        offset += state.n_tokens
    return asyncio.ensure_future(s.extend(slots, [1, 1], range(offset, offset + 2), place=spans))


async def test_reused_states_are_placed_right_before_their_extends_forward_in_the_same_engine_call() -> None:
    """Hops: the states ride on the extend, so the request waits behind no forward for them."""
    engine = PickyPlacingEngine()
    async with scheduler(engine, max_batch_tokens=64) as s:
        s.start()
        await _placing(s, await _slots(s), {"a": _state(4), "b": _state(2)})
    assert engine.placed == [(0, 4), (4, 2)] and engine.batches == [[2]]
    assert set(s.worker.cpu_s) >= {"place_units", "step"}  # each counted under its own name


async def test_a_state_that_cannot_be_placed_fails_only_its_own_extend_before_the_forward() -> None:
    """The other units of that extend are in place; the other requests of the batch run."""
    engine = PickyPlacingEngine()
    async with scheduler(engine, max_batch_tokens=64) as s:
        refused = _placing(s, await _slots(s), {"a": _state(4), "b": _state(2, torch.float64)})
        buggy = _placing(s, await _slots(s), {"c": _state(3)})
        fine = _placing(s, await _slots(s), {"d": _state(4)})
        await _queued(refused, buggy, fine)
        s.start()
        await fine
        with pytest.raises(UnplacedUnits) as info:
            await refused
        with pytest.raises(ValueError, match="a bug in placement"):
            await buggy
    assert list(info.value.failed) == ["b"] and isinstance(info.value.failed["b"], PlacementError)
    assert engine.placed == [(0, 4), (0, 4)]  # a of the refused extend, d of the fine one
    assert engine.batches == [[2]]  # one forward, with the fine extend only


async def test_begin_takes_slots_and_matches_the_prefix_in_one_engine_call() -> None:
    engine = HeldStepsFakeEngine()
    async with scheduler(engine, max_batch_tokens=64) as s:
        slots, matched = await s.begin(16, [1, 2, 3], "t")
        assert matched == 0 and engine.allocated == [slots]
        _, none = await s.begin(8, [], "t")  # nothing to match: no match call
    assert none == 0 and {"allocate", "match_prefix"} <= set(s.worker.cpu_s)


async def test_the_engine_sets_up_the_engine_thread_before_its_first_call(fake_engine: Any) -> None:
    """An engine whose kernels keep per-thread state (SGLang binds an OpenMP team to cores) is
    told which thread runs its forwards: ``on_engine_thread`` runs there, once, before any call."""
    import threading

    seen: list[str] = []
    fake_engine.on_engine_thread = lambda: seen.append(threading.current_thread().name)
    step = fake_engine.step
    fake_engine.step = lambda work: (seen.append(threading.current_thread().name), step(work))[1]
    async with scheduler(fake_engine, max_batch_tokens=8) as s:
        task = _extend(s, await _slots(s), 4)
        s.start()
        await task
        await _extend(s, await _slots(s), 4)
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0].startswith("engine"), seen
