"""The waiting room: requests with units to compute decide how to get them when their turn comes.

A request planned to compute a unit used to claim it (or join another request's claim) as
soon as its plan arrived, then queue in the scheduler for as long as the node was busy.
Under deep queues that decision is seconds stale when the forward runs: another node may
have published the unit meanwhile, or another request on this node computed it. So a
request with a miss waits here, in arrival order, until its work would go into the next
batch (the scheduler's queue would not fill that batch without it); only then does it look
for the unit again (local cache, a late lease on the shared tier, a prefill in flight) and
claim what is still missing. A request whose units are all held or fetched never waits here.

The room admits one request at a time into *preparing* (admitted, its job not queued yet),
counted as queued work, so admissions never overshoot the next batch; the ticket goes back
when the request's job is queued or when the request fails.

A request whose start deadline passes while it waits, after a batch formed without it, is
refused as a late start, exactly like one passed over in the scheduler's queue.

This module knows nothing of engines, units or plans.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.errors import Overloaded

LOOK_AGAIN_S = 0.05  # past its deadline with no batch formed since it came: how soon to look again


@dataclass(eq=False)
class Ticket:
    """One request's place in the room: admitted (preparing) until released."""

    room: WaitingRoom
    tokens: int  # the work it will queue (an estimate: the room's share of the node's queued tokens)
    admitted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    released: bool = False

    def release(self) -> None:
        """Its job is about to be queued, or it failed: the next request may prepare.

        Idempotent. The room admits the next request on the event loop's next turn, so a
        job queued right after this call (no await between) is counted by then.
        """
        if self.released:
            return
        self.released = True
        self.room.left(self)


class WaitingRoom:
    """Arrival-ordered admission to the next batch (see the module docstring).

    ``next_batch_full(prompts, tokens)``: whether the scheduler's queue, plus ``prompts``
    items of ``tokens`` tokens being prepared, already fills the next batch. ``batches()``:
    how many batches the scheduler has formed (a late start must have been passed over).
    """

    def __init__(self, next_batch_full: Callable[[int, int], bool], batches: Callable[[], int]) -> None:
        self._full = next_batch_full
        self._batches = batches
        self._waiting: deque[Ticket] = deque()
        self._preparing: set[Ticket] = set()
        self.waited = 0  # requests that waited here at all (metrics)

    @property
    def tokens(self) -> int:
        """Work waiting or being prepared here (part of the node's queued tokens)."""
        return sum(t.tokens for t in self._waiting) + sum(t.tokens for t in self._preparing)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _admits(self) -> bool:
        return not self._full(len(self._preparing), sum(t.tokens for t in self._preparing))

    async def enter(self, tokens: int, deadline_at: float = float("inf")) -> Ticket:
        """Wait for this request's turn; the ticket is admitted when this returns.

        Raises Overloaded if ``deadline_at`` (``time.monotonic()``) passes first and a batch
        formed without the request meanwhile. Release the ticket in every case after this
        returns (a ``finally``).
        """
        ticket = Ticket(self, tokens)
        if not self._waiting and self._admits():
            self._admit(ticket)
            return ticket
        self.waited += 1
        self._waiting.append(ticket)
        batches = self._batches()
        try:
            look_at = deadline_at
            while True:
                timeout = None if look_at == float("inf") else max(0.0, look_at - time.monotonic())
                try:
                    await asyncio.wait_for(asyncio.shield(ticket.admitted), timeout)
                    return ticket
                except TimeoutError:
                    if ticket.admitted.done():
                        continue  # admitted as the wait ran out
                    if self._batches() > batches:
                        late = time.monotonic() - deadline_at
                        raise Overloaded(
                            "the request's work could not start within its queueing bound "
                            f"(control.max_queue_wait_s): {late:.1f}s past it behind earlier work; retry later",
                            retry_after_s=max(1.0, late)) from None
                    look_at = time.monotonic() + LOOK_AGAIN_S  # nothing ran since it came: look again shortly
        except BaseException:
            # cancelled or refused: out of the line, or (admitted meanwhile) its place given back
            if ticket.admitted.done():
                ticket.release()
            else:
                self._waiting.remove(ticket)
                ticket.admitted.cancel()
            raise

    def _admit(self, ticket: Ticket) -> None:
        self._preparing.add(ticket)
        if not ticket.admitted.done():
            ticket.admitted.set_result(None)

    def left(self, ticket: Ticket) -> None:
        self._preparing.discard(ticket)
        asyncio.get_running_loop().call_soon(self.wake)

    def close(self, exc: BaseException) -> None:
        """The node is shutting down: every waiting request fails with ``exc``."""
        while self._waiting:
            ticket = self._waiting.popleft()
            if not ticket.admitted.done():
                ticket.admitted.set_exception(exc)

    def wake(self) -> None:
        """Admit waiting requests, first come first, while the next batch has room (the
        scheduler calls it whenever it takes a batch)."""
        while self._waiting and self._admits():
            self._admit(self._waiting.popleft())
