"""Bounds on one client's transfers in flight: bytes and outstanding requests.

Every transport request acquires its byte size and one request slot before it starts and
gives both back when it has finished (or failed). Waiters are served first come, first
served, so a large request is not starved by a stream of small ones. A request larger than
the whole byte budget is charged the whole budget: it runs alone rather than never.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass


@dataclass
class LimiterStats:
    requests: int = 0
    waited: int = 0  # requests that had to queue for budget
    peak_bytes: int = 0
    peak_outstanding: int = 0


class TransferLimiter:
    """``acquire(nbytes) -> charge`` / ``release(charge)``; FIFO; cancellation-safe."""

    def __init__(self, max_bytes: int, max_outstanding: int) -> None:
        assert max_bytes > 0 and max_outstanding > 0, (max_bytes, max_outstanding)
        self.max_bytes = max_bytes
        self.max_outstanding = max_outstanding
        self.bytes = 0
        self.outstanding = 0
        self.stats = LimiterStats()
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, charge: int) -> bool:
        return self.outstanding < self.max_outstanding and self.bytes + charge <= self.max_bytes

    def _take(self, charge: int) -> None:
        self.bytes += charge
        self.outstanding += 1
        self.stats.requests += 1
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)
        self.stats.peak_outstanding = max(self.stats.peak_outstanding, self.outstanding)

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (capped at the budget) and one request slot are free; take them."""
        charge = min(max(nbytes, 0), self.max_bytes)
        if not self._waiters and self._fits(charge):
            self._take(charge)
            return charge
        self.stats.waited += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (charge, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(charge)  # granted just as we were cancelled: give it back
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove(entry)
                self._wake()
            raise
        return charge

    def release(self, charge: int) -> None:
        assert self.outstanding > 0 and self.bytes >= charge, (self.outstanding, self.bytes, charge)
        self.bytes -= charge
        self.outstanding -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            charge, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._take(charge)
            fut.set_result(None)
