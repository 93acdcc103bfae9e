"""The transfer limiter bounds bytes and requests in flight, first come first served."""

from __future__ import annotations

import asyncio

from tessera.transport.limits import TransferLimiter


async def test_requests_beyond_the_bounds_wait_until_budget_returns() -> None:
    """Neither max_bytes nor max_outstanding is ever exceeded."""
    limiter = TransferLimiter(max_bytes=100, max_outstanding=2)
    running = 0
    peak = 0

    async def job(n: int) -> None:
        nonlocal running, peak
        charge = await limiter.acquire(n)
        running += 1
        peak = max(peak, running)
        assert limiter.bytes <= 100 and limiter.outstanding <= 2
        await asyncio.sleep(0)
        running -= 1
        limiter.release(charge)

    await asyncio.gather(*(job(n) for n in [60, 30, 30, 10, 90, 5, 40] * 3))
    assert limiter.stats.peak_bytes <= 100 and limiter.stats.peak_outstanding <= 2
    assert limiter.stats.waited > 0 and peak == 2
    assert (limiter.bytes, limiter.outstanding) == (0, 0)


async def test_waiters_are_served_in_arrival_order() -> None:
    """A large request is not starved by smaller ones that arrive after it."""
    limiter = TransferLimiter(max_bytes=100, max_outstanding=8)
    first = await limiter.acquire(80)
    order: list[str] = []

    async def job(name: str, n: int) -> None:
        charge = await limiter.acquire(n)
        order.append(name)
        limiter.release(charge)

    big = asyncio.create_task(job("big", 90))
    await asyncio.sleep(0)
    small = asyncio.create_task(job("small", 10))  # would fit now, but big came first
    await asyncio.sleep(0)
    assert order == []
    limiter.release(first)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]


async def test_a_request_larger_than_the_budget_runs_alone() -> None:
    """Charged the whole budget instead of waiting forever."""
    limiter = TransferLimiter(max_bytes=100, max_outstanding=4)
    charge = await limiter.acquire(1000)
    assert charge == 100 and limiter.bytes == 100
    limiter.release(charge)


async def test_a_cancelled_waiter_gives_nothing_away_and_takes_nothing() -> None:
    """Cancellation while queued leaves the accounting exact and wakes the next waiter."""
    limiter = TransferLimiter(max_bytes=100, max_outstanding=1)
    held = await limiter.acquire(10)
    queued = asyncio.create_task(limiter.acquire(10))
    nxt = asyncio.create_task(limiter.acquire(10))
    await asyncio.sleep(0)
    queued.cancel()
    limiter.release(held)
    assert await nxt == 10
    assert (limiter.bytes, limiter.outstanding) == (10, 1)
    assert queued.cancelled()
