"""The generation node's local unit cache and prefill coalescing (pure logic, real scheduler)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch

from tessera.engines.base import EngineAdapter, UnitState
from tessera.generation.prefills import PrefillCoalescer
from tessera.generation.scheduler import Scheduler
from tessera.generation.unit_cache import LocalUnitCache


def state(n_tokens: int) -> UnitState:
    t = torch.zeros(2, n_tokens, 1, 4)
    return UnitState(t, t.clone())


def test_insert_fits_or_declines_without_evicting() -> None:
    """An insert that does not fit even after its victims leaves the cache untouched."""
    cache = LocalUnitCache(capacity_blocks=3, block_tokens=4, pin_memory=False)
    assert cache.insert("a", state(8)) == (True, [])  # 2 blocks
    assert cache.insert("b", state(9)) == (False, [])  # 3 blocks, only 1 free, no victims given
    assert cache.insert("b", state(9), evict=["a"]) == (True, ["a"])
    assert cache.used_blocks == 3 and cache.unit_ids() == ["b"]


def test_only_authorized_victims_are_evicted_and_only_as_many_as_needed() -> None:
    cache = LocalUnitCache(capacity_blocks=4, block_tokens=4, pin_memory=False)
    for uid in ("a", "b", "c", "d"):
        cache.insert(uid, state(4))
    inserted, evicted = cache.insert("e", state(4), evict=["b", "c"])
    assert inserted and evicted == ["b"]
    assert sorted(cache.unit_ids()) == ["a", "c", "d", "e"]


def test_pinned_units_are_never_evicted() -> None:
    """A unit reported in a snapshot stays until its request unpins it."""
    cache = LocalUnitCache(capacity_blocks=1, block_tokens=4, pin_memory=False)
    cache.insert("a", state(4))
    assert cache.held("req-1", ["a", "zz"]) == ["a"]
    assert cache.insert("b", state(4), evict=["a"]) == (False, [])
    assert not cache.evict("a")
    cache.unpin_request("req-1")
    assert cache.insert("b", state(4), evict=["a"]) == (True, ["a"])


class CountingEngine(EngineAdapter):
    """Only ``step`` is used by the scheduler; it records how many unit prefills it ran."""

    def __init__(self) -> None:
        self.prefilled: list[tuple[int, ...]] = []

    def step(self, work):  # type: ignore[no-untyped-def]
        for item in work:
            self.prefilled.append(tuple(item.token_ids))
            item.state = state(len(item.token_ids))

    allocate = free = place = match_prefix = insert_prefix = encode = decode_tokens = None  # type: ignore[assignment]
    eos_token_ids = ()  # type: ignore[assignment]


@contextlib.asynccontextmanager
async def running_coalescer(engine: EngineAdapter) -> AsyncIterator[PrefillCoalescer]:
    """A coalescer over a real scheduler and engine thread, stopped afterwards."""
    scheduler = Scheduler(engine, max_batch_tokens=64)
    scheduler.start()
    try:
        yield PrefillCoalescer(scheduler)
    finally:
        await scheduler.stop()


async def test_concurrent_misses_of_one_unit_share_one_prefill() -> None:
    engine = CountingEngine()
    async with running_coalescer(engine) as coalescer:
        results = await asyncio.gather(*(coalescer.state("u1", [1, 2, 3]) for _ in range(5)),
                                       coalescer.state("u2", [4, 5]))
        assert engine.prefilled.count((1, 2, 3)) == 1 and engine.prefilled.count((4, 5)) == 1
        assert [c for _, c in results] == [False, True, True, True, True, False]
        assert coalescer.coalesced == 4 and coalescer.started == 2
        # once finished, a later miss prefills again (coalescing is for in-flight work only)
        await coalescer.state("u1", [1, 2, 3])
        assert engine.prefilled.count((1, 2, 3)) == 2


async def test_a_waiter_going_away_does_not_cancel_the_shared_prefill() -> None:
    async with running_coalescer(CountingEngine()) as coalescer:
        first = asyncio.ensure_future(coalescer.state("u", [7, 8]))
        second = asyncio.ensure_future(coalescer.state("u", [7, 8]))
        await asyncio.sleep(0)
        first.cancel()
        st, coalesced = await second
        assert coalesced and st.n_tokens == 2
        with pytest.raises(asyncio.CancelledError):
            await first


async def test_joiners_of_a_claim_get_its_state_without_a_prefill() -> None:
    """A request computing a unit in its own extend holds a claim; others missing the unit join
    it and get the claimant's state (coalesced), and no separate prefill runs."""
    engine = CountingEngine()
    async with running_coalescer(engine) as coalescer:
        claim = coalescer.claim("u")
        assert claim is not None and coalescer.claim("u") is None  # one claimant at a time
        joiners = [asyncio.ensure_future(coalescer.state("u", [7, 8])) for _ in range(2)]
        await asyncio.sleep(0)
        st = state(2)
        coalescer.finish("u", claim, st)
        assert [await j for j in joiners] == [(st, True), (st, True)]
        assert engine.prefilled == [] and len(coalescer) == 0 and coalescer.started == 1


async def test_joiners_of_an_abandoned_claim_compute_the_unit_once_themselves() -> None:
    """A claimant whose request failed or went away abandons its claim: its joiners do not fail
    with it, they compute the unit, sharing one prefill."""
    engine = CountingEngine()
    async with running_coalescer(engine) as coalescer:
        claim = coalescer.claim("u")
        assert claim is not None
        joiners = [asyncio.ensure_future(coalescer.state("u", [7, 8])) for _ in range(3)]
        await asyncio.sleep(0)
        coalescer.abandon("u", claim)
        results = [await j for j in joiners]
        assert all(st.n_tokens == 2 for st, _ in results)
        assert engine.prefilled == [(7, 8)]
        assert len(coalescer) == 0


async def test_an_abandoned_claim_nobody_joined_is_forgotten() -> None:
    async with running_coalescer(CountingEngine()) as coalescer:
        claim = coalescer.claim("u")
        assert claim is not None
        coalescer.abandon("u", claim)
        assert len(coalescer) == 0 and coalescer.claim("u") is not None
